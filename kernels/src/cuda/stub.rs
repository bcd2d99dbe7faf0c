//! The CUDA backend in a build without the `cuda` feature: the same public names, constructors that return
//! [`KernelError::NotCompiled`].

use crate::error::{KernelError, Result};

/// A CUDA device to compute on; this build has no CUDA backend (enable the `cuda` feature).
#[derive(Debug)]
pub struct CudaBackend {
    _never: std::convert::Infallible,
}

/// Bytes the device's allocator holds (see the `cuda` feature's backend).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// In use by live buffers.
    pub used: usize,
    /// The most `used` has been.
    pub used_high: usize,
    /// Held by the pool: in use plus kept for reuse.
    pub reserved: usize,
    /// The most `reserved` has been.
    pub reserved_high: usize,
}

impl CudaBackend {
    /// The backend on device `ordinal`: [`KernelError::NotCompiled`] in this build.
    pub fn new(ordinal: usize) -> Result<Self> {
        let _ = ordinal;
        Err(KernelError::NotCompiled { backend: "cuda", feature: "cuda" })
    }
    /// The backend on the host emulator: [`KernelError::NotCompiled`] in this build.
    pub fn emulated() -> Result<Self> {
        Err(KernelError::NotCompiled { backend: "cuda", feature: "cuda" })
    }
}
