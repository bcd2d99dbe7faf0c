//! The backend seam: the attention operations as a trait over a backend's own buffer types.
//!
//! The CPU backend takes [`HostSlice`]s; a device backend (the `cuda` feature, later) takes device slices
//! through the same trait, so code written against [`AttentionBackend`] (ring attention, the trainer) moves to
//! the device by changing one type. Shapes and masks are plain structs shared by every backend.

use std::sync::Arc;

use crate::attention::{self, AttnParams};
use crate::error::{KernelError, Result};
use crate::view::{HostSlice, HostSliceMut};

/// Attention on one backend's memory.
pub trait AttentionBackend {
    /// A read-only buffer of `f32` or `bf16` elements.
    type Slice<'a>;
    /// A writable buffer of `f32` or `bf16` elements.
    type SliceMut<'a>;
    /// A read-only `f32` buffer (LSE, partial outputs).
    type F32<'a>;
    /// A writable `f32` buffer.
    type F32Mut<'a>;

    /// See [`attention::attention_forward`].
    fn attention_forward(
        &self,
        p: &AttnParams<'_>,
        q: Self::Slice<'_>,
        k: Self::Slice<'_>,
        v: Self::Slice<'_>,
        o: Self::SliceMut<'_>,
        lse: Self::F32Mut<'_>,
    ) -> Result<()>;

    /// See [`attention::attention_backward`].
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        p: &AttnParams<'_>,
        q: Self::Slice<'_>,
        k: Self::Slice<'_>,
        v: Self::Slice<'_>,
        o: Self::Slice<'_>,
        d_o: Self::Slice<'_>,
        lse: Self::F32<'_>,
        d_q: Self::SliceMut<'_>,
        d_k: Self::SliceMut<'_>,
        d_v: Self::SliceMut<'_>,
        accumulate: bool,
    ) -> Result<()>;

    /// See [`attention::merge_partial_attention`].
    fn merge_partial_attention(
        &self,
        o1: Self::F32Mut<'_>,
        lse1: Self::F32Mut<'_>,
        o2: Self::F32<'_>,
        lse2: Self::F32<'_>,
    ) -> Result<()>;
}

/// The CPU backend: SIMD kernels on a rayon thread pool (the global pool unless one is given, so a host
/// framework can own the threads).
#[derive(Debug, Clone, Default)]
pub struct CpuBackend {
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl CpuBackend {
    /// Runs on rayon's global pool.
    pub fn new() -> Self {
        Self::default()
    }
    /// Runs on a new pool of `threads` threads.
    pub fn with_threads(threads: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| KernelError::InvalidArgument { name: "threads", why: e.to_string() })?;
        Ok(Self { pool: Some(Arc::new(pool)) })
    }
    /// Runs on a pool the caller owns.
    pub fn with_pool(pool: Arc<rayon::ThreadPool>) -> Self {
        Self { pool: Some(pool) }
    }
    /// Threads the kernels use.
    pub fn threads(&self) -> usize {
        self.pool.as_ref().map_or_else(rayon::current_num_threads, |p| p.current_num_threads())
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }
}

impl AttentionBackend for CpuBackend {
    type Slice<'a> = HostSlice<'a>;
    type SliceMut<'a> = HostSliceMut<'a>;
    type F32<'a> = &'a [f32];
    type F32Mut<'a> = &'a mut [f32];

    fn attention_forward(
        &self,
        p: &AttnParams<'_>,
        q: HostSlice<'_>,
        k: HostSlice<'_>,
        v: HostSlice<'_>,
        o: HostSliceMut<'_>,
        lse: &mut [f32],
    ) -> Result<()> {
        self.run(|| attention::attention_forward(p, q, k, v, o, lse))
    }

    fn attention_backward(
        &self,
        p: &AttnParams<'_>,
        q: HostSlice<'_>,
        k: HostSlice<'_>,
        v: HostSlice<'_>,
        o: HostSlice<'_>,
        d_o: HostSlice<'_>,
        lse: &[f32],
        d_q: HostSliceMut<'_>,
        d_k: HostSliceMut<'_>,
        d_v: HostSliceMut<'_>,
        accumulate: bool,
    ) -> Result<()> {
        self.run(|| attention::attention_backward(p, q, k, v, o, d_o, lse, d_q, d_k, d_v, accumulate))
    }

    fn merge_partial_attention(&self, o1: &mut [f32], lse1: &mut [f32], o2: &[f32], lse2: &[f32]) -> Result<()> {
        attention::merge_partial_attention(o1, lse1, o2, lse2)
    }
}
