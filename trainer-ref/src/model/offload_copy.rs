//! The offload engine's view of the run's backend: a saved [`Buffer`] handed over as the engine's
//! [`DeviceBuffer`], and [`BackendCopier`], its [`DeviceCopier`], which moves the buffer's bytes with the
//! backend's own download and upload. So a saved tensor goes from wherever the backend keeps it straight into the
//! engine's host tier and back, one copy each way, on any backend; a CPU backend's buffers, which the CPU reads
//! in place, are also written to and read from spill files without a copy of their own.
//!
//! [`BackendPageLocker`] registers the host tier's buffers with the backend's device once, when the pool maps them,
//! so those copies run by DMA (on a GPU: page-locked, at the link's rate, with no staging of the backend's own).
//!
//! The copies run on the engine's worker threads, on a queue of their own where the backend has queues (a
//! [`fork`](Backend::fork) of a device backend: on a GPU, a second stream, so a copy overlaps the compute):
//! - out: the buffer carries an [`Event`] recorded on the compute queue when it was handed over
//!   ([`BackendBuffer::new`]); the copy queue waits for it, then downloads. The buffer is then dropped, its memory
//!   going back on the compute queue that allocated it, after the download (which the worker waited for).
//! - back: the copy queue allocates and uploads, the worker waits for it, and the compute backend
//!   [adopts](Backend::adopt) the buffer: compute follows the upload, and the buffer, dropped after the layer's
//!   backward, goes back to the pool on the compute queue, after the work that reads it.
//!
//! A backend whose ops run before they return (the CPU) copies on its own queue, where every event is complete.

use std::io;
use std::sync::Arc;

use longctx_kernels::{Backend, Buffer, DType, Dims, Event, RawBytes, RawBytesMut, View, ViewMut};
use longctx_offload::{DeviceBuffer, DeviceCopier, PageLocker};

/// A saved buffer, as the offload engine holds it: the buffer, and the point in the compute queue after which
/// its values are in place.
#[derive(Debug)]
pub struct BackendBuffer {
    buf: Buffer,
    ready: Event,
}

impl BackendBuffer {
    /// `buf`, whose values are in place once `ready` is complete (an event the compute backend recorded after the
    /// ops that wrote it).
    pub fn new(buf: Buffer, ready: Event) -> Self {
        Self { buf, ready }
    }

    /// The buffer.
    pub fn into_buffer(self) -> Buffer {
        self.buf
    }
}

impl DeviceBuffer for BackendBuffer {
    fn size_bytes(&self) -> usize {
        self.buf.bytes()
    }

    fn host_bytes(&self) -> Option<&[u8]> {
        match self.buf.view().raw_bytes() {
            RawBytes::Host(b) => Some(b),
            RawBytes::Device { .. } => None,
        }
    }

    fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        match self.buf.view_mut().into_raw_bytes() {
            RawBytesMut::Host(b) => Some(b),
            RawBytesMut::Device { .. } => None,
        }
    }
}

/// Copies saved buffers between the run's backend and the offload engine's host tier, on a queue of their own
/// (see the module docs).
#[derive(Debug)]
pub struct BackendCopier {
    compute: Arc<dyn Backend>,
    copy: Arc<dyn Backend>,
}

impl BackendCopier {
    /// The copier of `backend`'s buffers: on a fork of it where it computes on device memory, else on it.
    pub fn new(backend: Arc<dyn Backend>) -> longctx_kernels::Result<Self> {
        let copy = if backend.device_memory().is_some() { backend.fork()? } else { backend.clone() };
        Ok(Self { compute: backend, copy })
    }
}

impl DeviceCopier for BackendCopier {
    fn download(&self, src: &dyn DeviceBuffer, dst: &mut [u8]) -> io::Result<()> {
        let src = ours(src)?;
        let dst = ViewMut::from_host_bytes(dst, src.buf.dtype(), src.buf.dims()).map_err(io::Error::other)?;
        self.copy.wait_event(&src.ready).map_err(io::Error::other)?;
        self.copy.download(dst, src.buf.view()).map_err(io::Error::other)
    }

    fn alloc(&self, dtype: DType, dims: &[usize]) -> io::Result<Box<dyn DeviceBuffer>> {
        let dims = Dims::new(dims).map_err(io::Error::other)?;
        let buf = self.copy.empty(dtype, dims).map_err(io::Error::other)?;
        Ok(Box::new(BackendBuffer::new(buf, Event::complete())))
    }

    fn upload(&self, src: &[u8], dst: &mut dyn DeviceBuffer) -> io::Result<()> {
        let dst = ours_mut(dst)?;
        let src = View::from_host_bytes(src, dst.buf.dtype(), dst.buf.dims()).map_err(io::Error::other)?;
        self.copy.upload(dst.buf.view_mut(), src).map_err(io::Error::other)?;
        // The engine hands the buffer to compute as soon as this returns.
        self.copy.synchronize().map_err(io::Error::other)?;
        self.compute.adopt(&mut dst.buf).map_err(io::Error::other)
    }
}

/// Registers the host tier's buffers with the run's backend ([`Backend::register_host`]; see the module docs).
#[derive(Debug)]
pub struct BackendPageLocker {
    backend: Arc<dyn Backend>,
}

impl BackendPageLocker {
    /// The locker of `backend`'s device.
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        Self { backend }
    }
}

// SAFETY: registering only pins the pages and tells the driver of them (the kernels' `register_host` contract); it
// neither reads, writes nor unmaps them.
unsafe impl PageLocker for BackendPageLocker {
    unsafe fn lock(&self, ptr: *mut u8, len: usize) -> io::Result<()> {
        // SAFETY: the engine's contract (a page-aligned mapping of its own, not locked, mapped until `unlock`) is
        // what `register_host` asks.
        unsafe { self.backend.register_host(ptr, len) }.map_err(io::Error::other)
    }

    unsafe fn unlock(&self, ptr: *mut u8, len: usize) {
        // SAFETY: locked by `lock` above and not unlocked since; the engine unlocks only buffers no copy uses.
        unsafe { self.backend.unregister_host(ptr, len) }
    }
}

fn ours(b: &dyn DeviceBuffer) -> io::Result<&BackendBuffer> {
    (b as &dyn std::any::Any)
        .downcast_ref::<BackendBuffer>()
        .ok_or_else(|| io::Error::other(format!("not a buffer of this run's backend: {b:?}")))
}

fn ours_mut(b: &mut dyn DeviceBuffer) -> io::Result<&mut BackendBuffer> {
    let what = format!("{b:?}");
    (b as &mut dyn std::any::Any)
        .downcast_mut::<BackendBuffer>()
        .ok_or_else(|| io::Error::other(format!("not a buffer of this run's backend: {what}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use longctx_kernels::{CpuBackend, CudaBackend};
    use longctx_offload::{DeviceTensor, OffloadEngine};

    /// Saved buffers of every dtype go out to each tier through the copier (the host tier registered with the
    /// backend, as a run on a device registers it) and come back bit-exact, as buffers
    /// of the same backend: the CPU backend's (read in place for spill files), the CUDA backend's host emulator
    /// and a GPU's (memory only their download and upload reach). The CUDA ones skip, saying so, where the backend
    /// cannot open, except `cuda` under `LONGCTX_REQUIRE_GPU=1` (the GPU check).
    mod saved_buffers_round_trip_through_both_tiers {
        use super::*;

        #[test]
        fn cpu() {
            round_trips(Arc::new(CpuBackend::new()));
        }

        #[test]
        fn cuda_emulated() {
            match CudaBackend::emulated() {
                Ok(b) => round_trips(b.into_shared()),
                Err(e) => eprintln!("saved_buffers_round_trip_through_both_tiers::cuda_emulated: skipped: {e}"),
            }
        }

        #[test]
        fn cuda() {
            match CudaBackend::new(0) {
                Ok(b) => round_trips(b.into_shared()),
                Err(e) if std::env::var("LONGCTX_REQUIRE_GPU").as_deref() == Ok("1") => {
                    panic!("LONGCTX_REQUIRE_GPU=1 but: {e}")
                }
                Err(e) => eprintln!("saved_buffers_round_trip_through_both_tiers::cuda: skipped, no GPU: {e}"),
            }
        }
    }

    fn round_trips(backend: Arc<dyn Backend>) {
        for disk in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let copier = BackendCopier::new(backend.clone()).unwrap();
            let b = OffloadEngine::builder().prefetch_depth(0).device(copier);
            let b = if disk {
                b.disk_tier(dir.path(), 64 << 20)
            } else {
                b.host_tier(64 << 20).page_lock(BackendPageLocker::new(backend.clone()))
            };
            let engine = b.build().unwrap();
            for (i, dtype) in DType::ALL.into_iter().enumerate() {
                let what = format!("{}, disk {disk}, {dtype}", backend.name());
                let dims = [3usize, 1001 + i];
                // Every bit pattern the element can hold, NaN payloads included (in words: aligned for any type).
                let n = 3 * (1001 + i) * dtype.size();
                let mut bits = vec![0u64; n.div_ceil(8)];
                for (k, b) in bytemuck::cast_slice_mut::<u64, u8>(&mut bits).iter_mut().enumerate() {
                    *b = (k * 131 + i) as u8;
                }
                let bits = &bytemuck::cast_slice::<u64, u8>(&bits)[..n];
                let mut buf = backend.empty(dtype, Dims::new(&dims).unwrap()).unwrap();
                backend.upload(buf.view_mut(), View::from_host_bytes(bits, dtype, dims).unwrap()).unwrap();
                let ready = backend.record_event().unwrap();
                let t = DeviceTensor::new(Box::new(BackendBuffer::new(buf, ready)), dtype, dims).unwrap();
                let ticket = engine.offload(i, "x", t).unwrap();
                let back = engine.fetch(ticket).unwrap().downcast::<BackendBuffer>().unwrap().into_buffer();
                assert_eq!((back.dims(), back.memory()), (&dims[..], backend.memory()), "{what}");
                let mut got = vec![0u64; n.div_ceil(8)];
                let got = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut got)[..n];
                backend.download(ViewMut::from_host_bytes(got, dtype, dims).unwrap(), back.view()).unwrap();
                assert!(got == bits, "{what}");
            }
        }
    }
}
