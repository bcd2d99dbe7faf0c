//! [`Stream`]: one stream on a [`Device`], what the ops in `ops/` enqueue on: kernel launches, cuBLASLt products,
//! scratch memory from the pool, and the byte copies and fills that host-typed arguments need. The backend
//! owns one and hands it to each op, so the ops depend on the stream, not on the backend that calls them.

use std::sync::Arc;

use super::alloc::CudaAllocation;
use super::device::{Device, DevicePtr, Gemm, Kernel, KernelArgs, LaunchConfig};
use super::path::AttentionPath;
use crate::checks::On;
use crate::error::Result;

/// A device and the stream its work is enqueued on.
#[derive(Debug, Clone)]
pub(crate) struct Stream {
    pub(crate) device: Arc<dyn Device>,
    /// Which attention kernels run (forks keep it).
    pub(crate) attn_path: AttentionPath,
    /// How the wgmma attention backward computes dQ (forks keep it).
    pub(crate) attn_backward: super::WgmmaBackward,
}

impl Stream {
    /// A stream on `device` with the attention choices the environment makes (`LONGCTX_CUDA_ATTN_PATH`,
    /// `LONGCTX_CUDA_ATTN_DETERMINISTIC`); an unreadable value is an error naming the variable.
    pub(crate) fn from_env(device: Arc<dyn Device>) -> Result<Self> {
        Ok(Self {
            device,
            attn_path: AttentionPath::from_env()?,
            attn_backward: super::path::wgmma_backward_from_env()?,
        })
    }

    pub(crate) fn on(&self) -> On {
        On { memory: self.device.memory() }
    }

    /// Launches `kernel`.
    ///
    /// # Safety
    /// The parameters are what the kernel declares and every address among them is live device memory of this
    /// device covering what the kernel touches (see [`Device::launch`]).
    pub(crate) unsafe fn launch(&self, kernel: &Kernel, cfg: LaunchConfig, args: &KernelArgs) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.device.launch(kernel, &cfg, args) }
    }

    /// Enqueues a matrix product.
    ///
    /// # Safety
    /// Every address covers the bytes the product touches.
    pub(crate) unsafe fn gemm(&self, g: &Gemm) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.device.gemm(g) }
    }

    /// Scratch device memory of `bytes`, freed (stream-ordered) when dropped.
    pub(crate) fn scratch(&self, bytes: usize) -> Result<CudaAllocation> {
        CudaAllocation::new(&self.device, bytes)
    }

    /// `data` (host) copied into new device memory: how host-typed arguments reach a kernel.
    pub(crate) fn upload_bytes(&self, data: &[u8]) -> Result<CudaAllocation> {
        let a = self.scratch(data.len())?;
        if !data.is_empty() {
            // SAFETY: `a` holds `data.len()` bytes, just allocated on this stream.
            unsafe { self.device.upload(a.ptr(), data)? };
        }
        Ok(a)
    }

    /// The `bytes` at `src` brought to the host, after the work enqueued so far.
    pub(crate) fn download_bytes(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        // SAFETY: callers pass an address of live device memory holding `dst.len()` bytes.
        unsafe { self.device.download(dst, src) }
    }

    /// Sets `count` 32-bit words at `dst` to `value`.
    ///
    /// # Safety
    /// `dst` covers `4·count` bytes of live device memory.
    pub(crate) unsafe fn memset32(&self, dst: DevicePtr, value: u32, count: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.device.memset32(dst, value, count) }
    }

    /// Copies `bytes` between device addresses.
    ///
    /// # Safety
    /// Both cover `bytes` of live device memory and do not overlap.
    pub(crate) unsafe fn copy_bytes(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.device.copy(dst, src, bytes) }
    }
}
