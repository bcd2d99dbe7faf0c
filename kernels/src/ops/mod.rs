//! Transformer ops other than attention, each with its backward: linear layers ([`matmul`](mod@matmul)), RMSNorm and
//! LayerNorm ([`rmsnorm`], [`layernorm`]), rotary embeddings ([`rope`]), SwiGLU and squared ReLU
//! ([`activation`]), token embeddings ([`embedding`]), chunked softmax cross-entropy ([`cross_entropy`]), and the
//! optimizer step with gradient clipping ([`optim`]).
//!
//! Conventions (llm.c `train_gpt2.c`):
//! - Legend: `B` batch, `S` sequence, `H` heads, `D` head dim, `T` tokens (`B·S` flattened), `C` channels
//!   (model dim), `F` hidden (FFN) dim, `V` vocabulary. Every buffer is row-major, last dimension innermost.
//! - Forward functions take outputs first, then inputs, then sizes and options. Backward functions take the
//!   gradients they write first (`d`-prefixed), then the upstream gradient, then the saved forward values.
//! - Storage is `f32` or `bf16` ([`Element`]); every op computes and accumulates in `f32`
//!   (reductions that decide a loss or a norm in `f64`). Weight gradients have their own element type `G`, so a
//!   `bf16` model can accumulate `f32` gradients across micro-batches; with `accumulate = true` weight gradients
//!   are added to what the buffer holds, with `false` they are overwritten. Activation gradients are always
//!   overwritten.
//! - Every shape and length is checked before any element is written: an `Err` leaves outputs untouched.
//! - Results are bit-identical for any number of rayon threads: work is split into pieces whose boundaries
//!   depend only on the shapes, and partial sums are combined in a fixed order on one thread.
//!
//! ```
//! use longctx_kernels::ops::{linear_backward, linear_forward};
//! // Y[T,OUT] = X[T,IN]·Wᵀ with T = 2, IN = 3, OUT = 2, then the backward with dY = 1.
//! let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
//! let w = [1.0f32, 0.0, 0.0, 0.0, 1.0, 1.0];
//! let mut y = [0.0f32; 4];
//! linear_forward(&mut y, &x, &w, None, 2, 3, 2)?;
//! assert_eq!(y, [1.0, 5.0, 4.0, 11.0]);
//! let (mut dx, mut dw) = ([0.0f32; 6], [0.0f32; 6]);
//! linear_backward(Some(&mut dx[..]), &mut dw[..], None, &[1.0f32; 4], &x, &w, 2, 3, 2, false)?;
//! assert_eq!(dx, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
//! assert_eq!(dw, [5.0, 7.0, 9.0, 5.0, 7.0, 9.0]);
//! # Ok::<(), longctx_kernels::KernelError>(())
//! ```

pub mod activation;
pub mod cross_entropy;
pub mod embedding;
pub mod layernorm;
pub mod matmul;
pub mod optim;
pub mod rmsnorm;
pub mod rope;

pub use activation::{squared_relu_backward, squared_relu_forward, swiglu_backward, swiglu_forward};
pub use cross_entropy::{cross_entropy_fused, cross_entropy_logits, CrossEntropyOptions, CrossEntropyOutput};
pub use embedding::{embedding_backward, embedding_forward};
pub use layernorm::{layernorm_backward, layernorm_forward};
pub use matmul::{linear_backward, linear_forward, matmul, matmul_backward, release_scratch};
pub use optim::{adamw_step, adamw_step_with_copy, clip_grad_norm, AdamW};
pub use rmsnorm::{rmsnorm_backward, rmsnorm_forward};
pub use rope::{RopeConfig, RopeScaling, RopeTable};

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

use crate::dtype::{DType, Element};
use crate::error::{KernelError, Result};

/// Rows per parallel task in row-wise ops; fixed so the split never depends on the thread count.
pub(crate) const ROWS_PER_TASK: usize = 16;
/// Elements per parallel task in element-wise ops.
pub(crate) const ELEMS_PER_TASK: usize = 1 << 14;

/// The product of `dims`, or a [`KernelError::Shape`] when it overflows `usize`.
pub(crate) fn numel(what: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| KernelError::Shape(format!("{what}: element count {dims:?} overflows usize")))
}

/// Errors with [`KernelError::ZeroDim`] when `d` is zero.
pub(crate) fn nonzero(name: &'static str, d: usize) -> Result<()> {
    if d == 0 {
        Err(KernelError::ZeroDim(name))
    } else {
        Ok(())
    }
}

/// Errors with [`KernelError::InvalidArgument`] unless `x` is finite (and, with `positive`, above zero).
pub(crate) fn finite(name: &'static str, x: f64, positive: bool) -> Result<()> {
    if !x.is_finite() || (positive && x <= 0.0) {
        let want = if positive { "finite and > 0" } else { "finite" };
        Err(KernelError::InvalidArgument { name, why: format!("{x} is not {want}") })
    } else {
        Ok(())
    }
}

/// `s` as `f32` without copying when `T` is `f32`.
#[inline]
pub(crate) fn as_f32<T: Element>(s: &[T]) -> Option<&[f32]> {
    (T::DTYPE == DType::F32).then(|| bytemuck::cast_slice(s))
}

/// `s` as mutable `f32` without copying when `T` is `f32`.
#[inline]
pub(crate) fn as_f32_mut<T: Element>(s: &mut [T]) -> Option<&mut [f32]> {
    if T::DTYPE == DType::F32 {
        Some(bytemuck::cast_slice_mut(s))
    } else {
        None
    }
}

thread_local! {
    /// Per-thread free list of `f32` buffers, so `bf16` calls reuse their conversion buffers.
    static POOL: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// A zeroed `f32` buffer taken from the calling thread's pool and given back on drop.
pub(crate) struct Scratch(Vec<f32>);

impl Scratch {
    /// A buffer of `n` zeros.
    pub(crate) fn zeroed(n: usize) -> Self {
        let mut v = POOL.with(|p| {
            let mut p = p.borrow_mut();
            // Best fit: the smallest pooled buffer that is large enough, else the largest.
            let best = (0..p.len())
                .filter(|&i| p[i].capacity() >= n)
                .min_by_key(|&i| p[i].capacity())
                .or_else(|| (0..p.len()).max_by_key(|&i| p[i].capacity()));
            best.map(|i| p.swap_remove(i)).unwrap_or_default()
        });
        v.clear();
        v.resize(n, 0.0);
        Scratch(v)
    }
    /// `src` widened to `f32`.
    pub(crate) fn widened<T: Element>(src: &[T]) -> Self {
        let mut s = Scratch::zeroed(src.len());
        crate::dtype::load_f32(src, &mut s);
        s
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        // Tolerate drops during thread teardown, when the pool is gone.
        let _ = POOL.try_with(|p| {
            let mut p = p.borrow_mut();
            if p.len() < 8 {
                p.push(v);
            }
        });
    }
}

impl Deref for Scratch {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}
impl DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.0
    }
}

/// Frees the calling thread's pooled conversion buffers.
pub(crate) fn clear_pool() {
    let _ = POOL.try_with(|p| p.borrow_mut().clear());
}

/// An `f32` view of a buffer: borrowed for `f32` storage, converted into scratch for `bf16`.
pub(crate) enum F32In<'a> {
    Borrowed(&'a [f32]),
    Owned(Scratch),
}

impl<'a> F32In<'a> {
    pub(crate) fn new<T: Element>(s: &'a [T]) -> Self {
        match as_f32(s) {
            Some(f) => F32In::Borrowed(f),
            None => F32In::Owned(Scratch::widened(s)),
        }
    }
}

impl Deref for F32In<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            F32In::Borrowed(s) => s,
            F32In::Owned(s) => s,
        }
    }
}

/// Stores (or with `accumulate` adds, in `f32`) `src` into `dst`.
#[inline]
pub(crate) fn store<T: Element>(dst: &mut [T], src: &[f32], accumulate: bool) {
    if accumulate {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = T::from_f32(d.to_f32() + *s);
        }
    } else {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = T::from_f32(*s);
        }
    }
}

/// Sums per-task partial vectors in task order (fixed, thread-count independent) into `dst`.
pub(crate) fn reduce_partials<G: Element>(dst: &mut [G], partials: &[Vec<f32>], accumulate: bool) {
    let mut acc: Vec<f32> = if accumulate { dst.iter().map(|x| x.to_f32()).collect() } else { vec![0.0; dst.len()] };
    for p in partials {
        for (a, x) in acc.iter_mut().zip(p) {
            *a += *x;
        }
    }
    store(dst, &acc, false);
}
