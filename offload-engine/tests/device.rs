//! Device tensors through a copier: a stand-in device whose memory is a separate allocation the engine cannot
//! read (as a GPU's), and one whose buffers the CPU can read in place (as a CPU backend's). Each comes back
//! bit-exact from both tiers, with one copy each way through the host tier, its device buffer freed while it
//! is away; a failing copier and a missing one are typed errors naming the tensor.

mod common;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use common::{spill_files, tensor};
use longctx_offload::{
    DType, DeviceBuffer, DeviceCopier, DeviceTensor, HostTensor, Location, OffloadEngine, OffloadError, Tier,
};
use proptest::prelude::*;

/// What the stand-in device counts: live buffers, and copies each way.
#[derive(Debug, Default)]
struct Counts {
    live: AtomicUsize,
    downloads: AtomicUsize,
    uploads: AtomicUsize,
    fail_download: AtomicBool,
    fail_upload: AtomicBool,
}

/// A buffer of the stand-in device: its bytes, reachable only through the copier unless `host_visible`.
#[derive(Debug)]
struct FakeBuf {
    bytes: Vec<u8>,
    host_visible: bool,
    counts: Arc<Counts>,
}

impl FakeBuf {
    fn new(bytes: Vec<u8>, host_visible: bool, counts: &Arc<Counts>) -> Self {
        counts.live.fetch_add(1, Ordering::SeqCst);
        Self { bytes, host_visible, counts: Arc::clone(counts) }
    }
}

impl Drop for FakeBuf {
    fn drop(&mut self) {
        self.counts.live.fetch_sub(1, Ordering::SeqCst);
    }
}

impl DeviceBuffer for FakeBuf {
    fn size_bytes(&self) -> usize {
        self.bytes.len()
    }
    fn host_bytes(&self) -> Option<&[u8]> {
        self.host_visible.then_some(&self.bytes[..])
    }
    fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        self.host_visible.then_some(&mut self.bytes[..])
    }
}

#[derive(Debug, Clone)]
struct FakeDevice {
    host_visible: bool,
    counts: Arc<Counts>,
}

impl FakeDevice {
    fn new(host_visible: bool) -> Self {
        Self { host_visible, counts: Arc::default() }
    }

    /// `t` moved onto this device.
    fn tensor(&self, t: &HostTensor) -> DeviceTensor {
        let buf = FakeBuf::new(t.as_bytes().to_vec(), self.host_visible, &self.counts);
        DeviceTensor::new(Box::new(buf), t.dtype(), t.dims()).expect("dims match")
    }
}

impl DeviceCopier for FakeDevice {
    fn download(&self, src: &dyn DeviceBuffer, dst: &mut [u8]) -> io::Result<()> {
        if self.counts.fail_download.load(Ordering::SeqCst) {
            return Err(io::Error::other("device lost"));
        }
        let src = (src as &dyn std::any::Any).downcast_ref::<FakeBuf>().expect("one of this device's buffers");
        assert_eq!(dst.as_ptr() as usize % 8, 0, "the engine hands a copier aligned host bytes");
        dst.copy_from_slice(&src.bytes);
        self.counts.downloads.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn alloc(&self, dtype: DType, dims: &[usize]) -> io::Result<Box<dyn DeviceBuffer>> {
        let n = dims.iter().product::<usize>() * dtype.size();
        Ok(Box::new(FakeBuf::new(vec![0xAA; n], self.host_visible, &self.counts)))
    }

    fn upload(&self, src: &[u8], dst: &mut dyn DeviceBuffer) -> io::Result<()> {
        if self.counts.fail_upload.load(Ordering::SeqCst) {
            return Err(io::Error::other("out of device memory"));
        }
        let dst = (dst as &mut dyn std::any::Any).downcast_mut::<FakeBuf>().expect("one of this device's buffers");
        assert_eq!(src.as_ptr() as usize % 8, 0, "the engine hands a copier aligned host bytes");
        dst.bytes.copy_from_slice(src);
        self.counts.uploads.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// The device tensor's bytes, read back as a host tensor to compare.
fn on_host(t: DeviceTensor) -> HostTensor {
    let (dtype, dims) = (t.dtype(), t.dims().to_vec());
    let buf = t.downcast::<FakeBuf>().expect("the fake device's buffer");
    let b = &buf.bytes;
    match dtype {
        DType::F32 => HostTensor::f32(collect(b), dims),
        DType::Bf16 => HostTensor::bf16(collect(b), dims),
        DType::F16 => HostTensor::f16(collect(b), dims),
    }
    .expect("dims match")
}

fn collect<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
    b.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect()
}

fn same(got: &HostTensor, want: &HostTensor, what: &str) {
    assert_eq!((got.dtype(), got.dims()), (want.dtype(), want.dims()), "{what}");
    assert!(got.as_bytes() == want.as_bytes(), "{what}: data differs");
}

#[test]
fn device_tensors_round_trip_through_each_tier_with_one_copy_each_way() {
    for host_visible in [false, true] {
        for disk in [false, true] {
            let dev = FakeDevice::new(host_visible);
            let dir = tempfile::tempdir().unwrap();
            let builder = OffloadEngine::builder().workers(2).prefetch_depth(0).device(dev.clone());
            let engine = if disk { builder.disk_tier(dir.path(), 64 << 20) } else { builder.host_tier(64 << 20) }
                .build()
                .unwrap();
            let want: Vec<HostTensor> = (0..4).map(|i| tensor(DType::ALL[i % 3], &[3, 1000 + i], i as u64)).collect();
            let tickets: Vec<_> =
                want.iter().enumerate().map(|(i, t)| engine.offload(i, "x", dev.tensor(t)).unwrap()).collect();
            engine.sync();
            let what = format!("host_visible {host_visible}, disk {disk}");
            let tier = if disk { Tier::Disk } else { Tier::Host };
            assert!(tickets.iter().all(|t| t.location() == Location::In(tier)), "{what}");
            assert_eq!(dev.counts.live.load(Ordering::SeqCst), 0, "{what}: device memory freed while away");
            for (t, w) in tickets.into_iter().zip(&want).rev() {
                same(&on_host(engine.fetch(t).unwrap()), w, &what);
            }
            // One copy each way through the host tier; the disk tier writes and reads a host-visible buffer in
            // place, and stages a device one through one host buffer (one copy each way again).
            let copies = if disk && host_visible { 0 } else { want.len() };
            assert_eq!(dev.counts.downloads.load(Ordering::SeqCst), copies, "{what}");
            assert_eq!(dev.counts.uploads.load(Ordering::SeqCst), copies, "{what}");
            engine.sync();
            if disk {
                assert!(spill_files(engine.spill_dir().unwrap()).is_empty(), "{what}");
            }
        }
    }
}

#[test]
fn a_prefetch_brings_a_device_tensor_back_onto_the_device_before_its_fetch() {
    let dev = FakeDevice::new(false);
    let engine = OffloadEngine::builder().host_tier(1 << 20).prefetch_depth(1).device(dev.clone()).build().unwrap();
    let want = [tensor(DType::Bf16, &[4096], 1), tensor(DType::Bf16, &[4096], 2)];
    let a = engine.offload(0, "a", dev.tensor(&want[0])).unwrap();
    let b = engine.offload(1, "b", dev.tensor(&want[1])).unwrap();
    engine.sync();
    assert_eq!(dev.counts.live.load(Ordering::SeqCst), 0);
    engine.backward_started(1);
    engine.sync();
    assert_eq!(a.location(), Location::Ready);
    assert_eq!(dev.counts.live.load(Ordering::SeqCst), 1, "layer 0's tensor is back on the device");
    same(&on_host(engine.fetch(b).unwrap()), &want[1], "b");
    same(&on_host(engine.fetch(a).unwrap()), &want[0], "a");
    assert_eq!(engine.stats().fetches_waited, 1, "only b's fetch waited");
}

#[test]
fn host_and_device_tickets_share_one_engine_and_each_fetch_gives_back_its_kind() {
    let dev = FakeDevice::new(false);
    let engine = OffloadEngine::builder().host_tier(1 << 20).device(dev.clone()).build().unwrap();
    let (h, d) = (tensor(DType::F32, &[100], 1), tensor(DType::F16, &[300], 2));
    let th = engine.offload(0, "h", h.clone()).unwrap();
    let td = engine.offload_weights(0, "d", dev.tensor(&d)).unwrap();
    // The types say what comes back: a HostTensor from `th`, a DeviceTensor from `td`.
    let got_d: DeviceTensor = engine.fetch(td).unwrap();
    let got_h: HostTensor = engine.fetch(th).unwrap();
    same(&got_h, &h, "host");
    same(&on_host(got_d), &d, "device");
}

#[test]
fn refusals_hand_the_device_tensor_back() {
    let dev = FakeDevice::new(false);
    let t = tensor(DType::F32, &[2000], 3);
    let plain = OffloadEngine::builder().host_tier(1 << 20).build().unwrap();
    match plain.offload(2, "k", dev.tensor(&t)) {
        Err(OffloadError::NoDeviceCopier { tensor, returned }) => {
            assert_eq!((tensor.layer, tensor.name.as_ref()), (2, "k"));
            same(&on_host(returned.into_device().unwrap()), &t, "handed back");
        }
        other => panic!("expected NoDeviceCopier, got {other:?}"),
    }
    let small = OffloadEngine::builder().host_tier(1 << 12).device(dev.clone()).build().unwrap();
    match small.offload(2, "k", dev.tensor(&t)) {
        Err(OffloadError::TooLarge { returned, .. }) => same(&on_host(returned.into_device().unwrap()), &t, "back"),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(dev.counts.live.load(Ordering::SeqCst), 0);
}

#[test]
fn a_failing_copier_is_a_typed_error_naming_the_tensor_each_way() {
    for (disk, out) in [(false, true), (false, false), (true, true), (true, false)] {
        let dev = FakeDevice::new(false);
        let dir = tempfile::tempdir().unwrap();
        let b = OffloadEngine::builder().prefetch_depth(0).device(dev.clone());
        // Room for one tensor only: the next offload is placed only if the failed one's room came back.
        let engine = if disk { b.disk_tier(dir.path(), 8192) } else { b.host_tier(4096) }.build().unwrap();
        if out {
            dev.counts.fail_download.store(true, Ordering::SeqCst);
        }
        let t = engine.offload(5, "v", dev.tensor(&tensor(DType::Bf16, &[2000], 4))).unwrap();
        engine.sync();
        dev.counts.fail_upload.store(true, Ordering::SeqCst);
        match engine.fetch(t) {
            Err(OffloadError::DeviceCopy { tensor, source }) => {
                assert_eq!((tensor.layer, tensor.name.as_ref()), (5, "v"));
                let want = if out { "device lost" } else { "out of device memory" };
                assert_eq!(source.to_string(), want, "disk {disk}, out {out}");
            }
            other => panic!("disk {disk}, out {out}: expected DeviceCopy, got {other:?}"),
        }
        // The engine goes on: its room came back.
        dev.counts.fail_download.store(false, Ordering::SeqCst);
        dev.counts.fail_upload.store(false, Ordering::SeqCst);
        let want = tensor(DType::F32, &[1000], 9);
        let t = engine.offload(1, "w", dev.tensor(&want)).unwrap();
        engine.sync();
        let tier = if disk { Tier::Disk } else { Tier::Host };
        assert_eq!(t.location(), Location::In(tier), "disk {disk}, out {out}: the room came back");
        same(&on_host(engine.fetch(t).unwrap()), &want, "after the failure");
        assert_eq!(engine.stats().failures, 1);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random mixes of host and device tensors, shapes, dtypes and tiers, fetched in a random order, all come
    /// back bit-exact, and no device buffer outlives its ticket.
    #[test]
    fn random_mixes_come_back_bit_exact(
        items in prop::collection::vec((0usize..3, prop::collection::vec(1usize..300, 1..=2), any::<bool>()), 1..12),
        host_budget in prop::option::of(8u64 << 10..256 << 10),
        host_visible in any::<bool>(),
        order in any::<u64>(),
    ) {
        let dev = FakeDevice::new(host_visible);
        let dir = tempfile::tempdir().unwrap();
        let mut b = OffloadEngine::builder().workers(2).device(dev.clone());
        if let Some(h) = host_budget {
            b = b.host_tier(h);
        }
        let engine = b.disk_tier(dir.path(), 16 << 20).build().unwrap();
        let mut held = Vec::new();
        for (i, (dt, dims, on_device)) in items.iter().enumerate() {
            let t = tensor(DType::ALL[*dt], dims, i as u64);
            if *on_device {
                held.push((Some(engine.offload(i, "d", dev.tensor(&t)).unwrap()), None, t));
            } else {
                held.push((None, Some(engine.offload(i, "h", t.clone()).unwrap()), t));
            }
        }
        let n = held.len();
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by_key(|&i| (i as u64).wrapping_mul(order | 1).rotate_left(17));
        let mut slots: Vec<_> = held.into_iter().map(Some).collect();
        for i in idx {
            let (d, h, want) = slots[i].take().unwrap();
            let got = match (d, h) {
                (Some(d), None) => on_host(engine.fetch(d).unwrap()),
                (None, Some(h)) => engine.fetch(h).unwrap(),
                _ => unreachable!(),
            };
            prop_assert!(got.as_bytes() == want.as_bytes(), "tensor {i}");
        }
        engine.sync();
        prop_assert_eq!(dev.counts.live.load(Ordering::SeqCst), 0);
    }
}
