//! The CUDA backend in a build without the `cuda` feature: the same public names, constructors that return
//! [`KernelError::NotCompiled`].

use std::time::Duration;

use crate::error::{KernelError, Result};

/// A CUDA device to compute on; this build has no CUDA backend (enable the `cuda` feature).
#[derive(Debug)]
pub struct CudaBackend {
    _never: std::convert::Infallible,
}

pub use crate::backend::MemoryStats;

impl CudaBackend {
    /// The backend on device `ordinal`: [`KernelError::NotCompiled`] in this build.
    pub fn new(ordinal: usize) -> Result<Self> {
        let _ = ordinal;
        Err(KernelError::NotCompiled { backend: "cuda", feature: "cuda" })
    }
    /// The backend as a shared `dyn Backend` (no value of this type exists in this build): lets code that names
    /// the CUDA backend build without the feature, as tests that skip without it do.
    pub fn into_shared(self) -> std::sync::Arc<dyn crate::Backend> {
        match self._never {}
    }
    /// The backend on the host emulator: [`KernelError::NotCompiled`] in this build.
    pub fn emulated() -> Result<Self> {
        Err(KernelError::NotCompiled { backend: "cuda", feature: "cuda" })
    }
    /// This backend running the attention kernels of `path` (no value of this type exists in this build).
    pub fn with_attention_path(self, path: super::AttentionPath) -> Self {
        let _ = path;
        match self._never {}
    }
    /// Which attention kernels this backend runs (no value of this type exists in this build).
    pub fn attention_path(&self) -> super::AttentionPath {
        match self._never {}
    }
    /// This backend with the wgmma backward computing dQ by `how` (no value of this type exists in this build).
    pub fn with_wgmma_backward(self, how: super::WgmmaBackward) -> Self {
        let _ = how;
        match self._never {}
    }
    /// How the wgmma backward computes dQ (no value of this type exists in this build).
    pub fn wgmma_backward(&self) -> super::WgmmaBackward {
        match self._never {}
    }
    /// This backend with a deterministic attention backward or not (no value of this type exists in this build).
    pub fn with_deterministic_backward(self, deterministic: bool) -> Self {
        let _ = deterministic;
        match self._never {}
    }
    /// Whether the attention backward is deterministic (no value of this type exists in this build).
    pub fn deterministic_backward(&self) -> bool {
        match self._never {}
    }
    /// The device's name (no value of this type exists in this build).
    pub fn device_name(&self) -> String {
        match self._never {}
    }
    /// Whether this is the host emulator (no value of this type exists in this build).
    pub fn is_emulated(&self) -> bool {
        match self._never {}
    }
    /// Compiles every kernel now (no value of this type exists in this build).
    pub fn compile_kernels(&self) -> Result<()> {
        match self._never {}
    }
    /// Compiles every kernel for a GPU of architecture `arch` into the disk cache: [`KernelError::NotCompiled`]
    /// in this build.
    pub fn precompile(arch: &str) -> Result<usize> {
        let _ = arch;
        Err(KernelError::NotCompiled { backend: "cuda", feature: "cuda" })
    }
    /// How long the device took to run `work`'s ops (no value of this type exists in this build).
    pub fn time(&self, work: impl FnOnce() -> Result<()>) -> Result<Duration> {
        let _ = work;
        match self._never {}
    }
    /// What the device's pool holds (no value of this type exists in this build).
    pub fn memory_stats(&self) -> MemoryStats {
        match self._never {}
    }
    /// Gives the pool's kept memory back (no value of this type exists in this build).
    pub fn trim(&self) -> Result<()> {
        match self._never {}
    }
}
