//! What the probes' tests share (`wgmma_probe.rs`, `tma_probe.rs`): one emulator of a probe source for the test
//! binary, emulator memory that frees itself, and the sm_90 GPU or the reason there is none (which
//! `wgmma_attention.rs` uses too).

use std::sync::{Arc, OnceLock};

use super::device::{DevicePtr, KernelSource};
use super::driver::{DriverDevice, DriverOptions};
use super::emulator::Emulator;
use crate::error::KernelError;

/// The emulator of `source`, built once into `cell` and shared by the tests.
pub(crate) fn emulator(
    cell: &'static OnceLock<Result<Emulator, String>>,
    source: &'static KernelSource,
) -> &'static Emulator {
    cell.get_or_init(|| Emulator::new(&[source]).map_err(|e| e.to_string())).as_ref().unwrap_or_else(|e| panic!("{e}"))
}

/// Emulator memory holding a copy of some bytes (freed on drop).
pub(crate) struct EmuBuf {
    emu: &'static Emulator,
    pub ptr: DevicePtr,
    pub len: usize,
}

impl EmuBuf {
    pub fn new(emu: &'static Emulator, bytes: &[u8]) -> Self {
        let ptr = emu.alloc(bytes.len()).unwrap();
        emu.check_range(ptr, bytes.len(), "upload").unwrap();
        // SAFETY: the allocation holds `bytes.len()` bytes (checked above).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr as *mut u8, bytes.len()) };
        Self { emu, ptr, len: bytes.len() }
    }

    /// The bytes it holds now.
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        // SAFETY: the allocation holds `self.len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr as *const u8, out.as_mut_ptr(), self.len) };
        out
    }

    /// Its bytes as `f32`s.
    pub fn read_f32(&self) -> Vec<f32> {
        f32s(&self.bytes())
    }
}

impl Drop for EmuBuf {
    fn drop(&mut self) {
        // SAFETY: launches are synchronous: nothing uses the buffer any more.
        let _ = unsafe { self.emu.free(self.ptr) };
    }
}

/// Little-endian bytes as `f32`s.
pub(crate) fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Device 0 with `options`, or `None` with the reason on stderr when there is no GPU (a panic under
/// `LONGCTX_REQUIRE_GPU=1`).
pub(crate) fn gpu_or_skip(test: &str, options: DriverOptions) -> Option<Arc<DriverDevice>> {
    or_skip(test, DriverDevice::with_options(0, options))
}

/// What opening a GPU gave, or `None` with the reason on stderr when there is none (a panic under
/// `LONGCTX_REQUIRE_GPU=1`, and on any other error).
pub(crate) fn or_skip<T>(test: &str, opened: Result<T, KernelError>) -> Option<T> {
    match opened {
        Ok(d) => Some(d),
        Err(KernelError::NoDevice { why, .. }) => {
            if std::env::var("LONGCTX_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{test}: LONGCTX_REQUIRE_GPU=1 but there is no device: {why}");
            }
            eprintln!("{test}: skipped, no GPU: {why}");
            None
        }
        Err(e) => panic!("{test}: {e}"),
    }
}

/// The GPU with checked launches when it is an sm_90 device (what `what`, sm_90a code, runs on), else `None` with the
/// reason on stderr.
pub(crate) fn sm90_gpu(test: &str, what: &str) -> Option<Arc<DriverDevice>> {
    let d = gpu_or_skip(test, DriverOptions { checked: true })?;
    if d.arch() == "sm_90" || d.arch() == "sm_90a" {
        return Some(d);
    }
    eprintln!("{test}: skipped, the device is {} and {what} needs sm_90a", d.arch());
    None
}
