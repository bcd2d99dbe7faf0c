//! NCCL beside the host transport (`Communicator::attach_nccl`).
//!
//! Without NCCL or a GPU (CI): attaching fails on every rank with `CommError::Nccl`, promptly, saying what is
//! missing. With a GPU (`nccl_world_one::cuda`, run by `scripts/gpu-check`): at world size 1, the only size one GPU
//! allows (NCCL refuses two ranks on one device), every byte-level operation on device memory goes through NCCL and
//! gives what the host path gives; the multi-GPU path is the same code with more ranks.

use std::time::{Duration, Instant};

use cudarc::driver::result as cu;
use longctx_p2p::{Bytes, BytesMut, CommError, DeviceBytes, DeviceCopy, ReduceOp, ThreadWorld};

/// Whether a CUDA device is present (the driver loads, initialises and counts at least one device).
fn device_present() -> bool {
    // SAFETY: only dlopens candidate names.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    driver && cu::init().is_ok() && cu::device::get_count().is_ok_and(|n| n > 0)
}

#[test]
fn attaching_without_nccl_or_a_device_fails_on_every_rank() {
    if device_present() && longctx_p2p::nccl_version().is_ok() {
        eprintln!("skipped: NCCL and a device are present (nccl_world_one::cuda covers this machine)");
        return;
    }
    let start = Instant::now();
    let out = ThreadWorld::builder()
        .timeout(Duration::from_secs(20))
        .run(3, |comm| {
            let r = comm.attach_nccl(0);
            // The host transport still works after the failure.
            let mut x = [1.0f32];
            comm.all_reduce(&mut x, ReduceOp::Sum).map(|()| (r, x[0], comm.reaches_device(0), comm.nccl_ordinal()))
        })
        .expect("world");
    for (rank, o) in out.into_iter().enumerate() {
        let (r, sum, _, ordinal) = o.expect("the host transport after a failed attach");
        match r {
            Err(CommError::Nccl(msg)) => assert!(!msg.is_empty(), "rank {rank}"),
            other => panic!("rank {rank}: expected CommError::Nccl, got {other:?}"),
        }
        assert_eq!(sum, 3.0);
        assert_eq!(ordinal, None, "rank {rank}: a failed attach leaves nothing attached");
    }
    assert!(start.elapsed() < Duration::from_secs(20), "attaching failed only after {:?}", start.elapsed());
    match longctx_p2p::nccl_version() {
        // NCCL loads (e.g. from LONGCTX_CUDA_LIB_DIRS) but there is no device: its version needs none.
        Ok((version, path)) => eprintln!("NCCL {version} from {path}, no device"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("libnccl.so.2"), "the error names the library: {msg}");
        }
    }
}

/// Device memory of the test, through the driver.
struct Driver;

impl DeviceCopy for Driver {
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), String> {
        // SAFETY: `src` holds `dst.len()` bytes (the test's allocations).
        unsafe { cu::memcpy_dtoh_sync(dst, src) }.map_err(|e| format!("{e:?}"))
    }
    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), String> {
        // SAFETY: `dst` holds `src.len()` bytes.
        unsafe { cu::memcpy_htod_sync(dst, src) }.map_err(|e| format!("{e:?}"))
    }
    fn copy_within(&self, dst: u64, src: u64, len: usize) -> Result<(), String> {
        // SAFETY: both hold `len` bytes.
        unsafe { cu::memcpy_dtod_sync(dst, src, len) }.map_err(|e| format!("{e:?}"))
    }
}

/// A device allocation filled from `host`.
struct DeviceVec {
    ptr: u64,
    len: usize,
}

impl DeviceVec {
    fn from(host: &[u8]) -> DeviceVec {
        // SAFETY: a fresh allocation of `host.len()` bytes, filled at once.
        let ptr = unsafe { cu::malloc_sync(host.len().max(1)) }.expect("cuMemAlloc");
        Driver.upload(ptr, host).expect("upload");
        DeviceVec { ptr, len: host.len() }
    }
    fn bytes(&self) -> DeviceBytes<'static> {
        DeviceBytes { ptr: self.ptr, len: self.len, ordinal: 0, copy: &Driver }
    }
    fn read(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        Driver.download(self.ptr, &mut v).expect("download");
        v
    }
}

impl Drop for DeviceVec {
    fn drop(&mut self) {
        // SAFETY: allocated by `from`, no transfer in flight (every request was waited for).
        let _ = unsafe { cu::free_sync(self.ptr) };
    }
}

mod nccl_world_one {
    use super::*;

    #[test]
    fn cuda() {
        if !device_present() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        let (version, path) = longctx_p2p::nccl_version().expect("NCCL on a GPU machine");
        eprintln!("NCCL {version} from {path}");
        let out = ThreadWorld::builder()
            .timeout(Duration::from_secs(60))
            .run(1, |comm| -> Result<(), String> {
                let ctx = cudarc::driver::CudaContext::new(0).map_err(|e| format!("{e:?}"))?;
                ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
                comm.attach_nccl(0).map_err(|e| e.to_string())?;
                assert_eq!(comm.nccl_ordinal(), Some(0));
                assert!(comm.reaches_device(0));
                let before = comm.stats();

                // All-reduce of f32 (sum and max) and bf16 at world 1: the values unchanged.
                let xs: Vec<f32> = (0..4099).map(|i| (i as f32 * 0.37).sin()).collect();
                let d = DeviceVec::from(bytemuck::cast_slice(&xs));
                comm.all_reduce_bytes::<f32>(BytesMut::Device(d.bytes()), ReduceOp::Sum).map_err(|e| e.to_string())?;
                comm.all_reduce_bytes::<f32>(BytesMut::Device(d.bytes()), ReduceOp::Max).map_err(|e| e.to_string())?;
                assert_eq!(d.read(), bytemuck::cast_slice::<f32, u8>(&xs));

                // All-gather and all-to-all of odd sizes.
                let src: Vec<u8> = (0..1001u32).map(|i| (i * 7 % 251) as u8).collect();
                let (s, r) = (DeviceVec::from(&src), DeviceVec::from(&vec![0u8; src.len()]));
                comm.all_gather_bytes(Bytes::Device(s.bytes()), BytesMut::Device(r.bytes()))
                    .map_err(|e| e.to_string())?;
                assert_eq!(r.read(), src);
                let r2 = DeviceVec::from(&vec![0u8; src.len()]);
                comm.all_to_all_bytes(Bytes::Device(s.bytes()), BytesMut::Device(r2.bytes()))
                    .map_err(|e| e.to_string())?;
                assert_eq!(r2.read(), src);

                // A ring shift to itself, two messages in flight, posted sends first (one NCCL group at the wait).
                let a: Vec<u8> = (0..(1 << 20)).map(|i: u32| (i % 253) as u8).collect();
                let b: Vec<u8> = a.iter().rev().copied().collect();
                let (sa, sb) = (DeviceVec::from(&a), DeviceVec::from(&b));
                let (ra, rb) = (DeviceVec::from(&vec![0u8; a.len()]), DeviceVec::from(&vec![0u8; b.len()]));
                comm.scope(|sc| {
                    let reqs = [
                        sc.isend_bytes(0, 1, Bytes::Device(sa.bytes()))?,
                        sc.isend_bytes(0, 2, Bytes::Device(sb.bytes()))?,
                        sc.irecv_bytes(0, 1, BytesMut::Device(ra.bytes()))?,
                        sc.irecv_bytes(0, 2, BytesMut::Device(rb.bytes()))?,
                    ];
                    reqs.into_iter().try_for_each(|r| r.wait())
                })
                .map_err(|e| e.to_string())?;
                assert_eq!(ra.read(), a);
                assert_eq!(rb.read(), b);
                let after = comm.stats();
                assert_eq!(after.bytes_sent - before.bytes_sent, 2 << 20, "the shift's bytes are counted");

                // Host memory still moves on the host transport.
                let mut h = [2.0f64];
                comm.all_reduce(&mut h, ReduceOp::Sum).map_err(|e| e.to_string())?;
                assert_eq!(h[0], 2.0);
                Ok(())
            })
            .expect("world");
        for (rank, o) in out.into_iter().enumerate() {
            o.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        }
    }
}
