//! Transformer ops other than attention, each with its backward: what they compute, and the types their
//! [`Backend`](crate::Backend) methods take ([`AdamW`], [`CrossEntropyOptions`], [`CrossEntropyOutput`], the rotary
//! tables [`RopeConfig`], [`RopeScaling`], [`RopeTable`], the expert dispatch [`Routing`], [`RouterOutput`]). The
//! computing is the backend's: the CPU kernels below this module are private to [`CpuBackend`](crate::CpuBackend), which checks the views and calls them.
//!
//! Legend: `B` batch, `S` sequence, `H` heads, `D` head dim, `T` tokens (`B·S` flattened), `C` channels (model
//! dim), `F` hidden (FFN) dim, `V` vocabulary, `P` parameters. Every buffer is row-major, last dimension innermost.
//!
//! ```text
//! matmul                c[M,N] = a[M,K]·b[K,N]
//! matmul_backward       da = dc·bᵀ                  db (+)= aᵀ·dc
//! linear_forward        y[T,OUT] = x[T,IN]·wᵀ + bias (w is [OUT,IN])
//! linear_backward       dx = dy·w                   dw (+)= dyᵀ·x          dbias (+)= Σ_t dy[t,:]
//! rmsnorm_forward       y[N,C] = x·rstd·weight      rstd[N] = 1/√(mean(x²) + eps)
//! layernorm_forward     y[N,C] = (x − mean)·rstd·weight + bias
//! rope_forward          y[B,H,S,D] = x rotated by the angles of positions[S]; rope_backward rotates back
//! swiglu_forward        out = silu(gate) ∘ up
//! squared_relu_forward  out = max(x, 0)²
//! embedding_forward     out[T,C] = table[ids[t], :]  embedding_backward: dtable[ids[t], :] (+)= dout[t, :]
//! moe_router_forward    p[T,E] = softmax(logits), top-k per token, weights renormalised (Mixtral)
//! moe_gather/combine    xe[n] = x[row[n]] (tokens grouped by expert); out[t] = Σ_j w[t,j]·ye[row(t,j)]
//! cross_entropy_fused   the loss of hidden[T,C]·weightᵀ (weight [V,C]) in chunks of tokens, never all [T,V]
//! adamw_step            m, v and the f32 master weights (and a rounded copy) take one AdamW step
//! clip_grad_norm        ‖g‖ = √(Σ g²) in f64; if ‖g‖ > max: g *= max / (‖g‖ + 1e-6)
//! ```
//!
//! Conventions (llm.c `train_gpt2.c`), the same for every backend:
//! - Outputs first, then the upstream gradient, then what the forward saved ([`crate::saved`]), then parameters
//!   and options; gradients are named `dx`, `dw`, `dout`, ….
//! - Storage is `f32` or `bf16` ([`crate::DType`]); every op computes and accumulates in `f32` (reductions that
//!   decide a loss or a norm in `f64`). Weight gradients may have their own element type, so a `bf16` model can
//!   accumulate `f32` gradients across micro-batches; [`GradMode`](crate::GradMode) says whether a backward
//!   overwrites the weight gradients or adds to them. Activation gradients are always overwritten.
//! - Every shape and length is checked before any element is written: an `Err` leaves outputs untouched.
//! - Results are bit-identical for any number of rayon threads: work is split into pieces whose boundaries
//!   depend only on the shapes, and partial sums are combined in a fixed order on one thread.
//!
//! ```
//! use longctx_kernels::{Backend, CpuBackend, GradMode, LinearGrads, LinearSaved, View, ViewMut};
//! let cpu = CpuBackend::new();
//! // y[T,OUT] = x[T,IN]·wᵀ with T = 2, IN = 3, OUT = 2, then the backward with dy = 1.
//! let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
//! let w = [1.0f32, 0.0, 0.0, 0.0, 1.0, 1.0];
//! let (xv, wv) = (View::new(&x, [2, 3])?, View::new(&w, [2, 3])?);
//! let mut y = [0.0f32; 4];
//! cpu.linear_forward(ViewMut::new(&mut y, [2, 2])?, xv, wv, None)?;
//! assert_eq!(y, [1.0, 5.0, 4.0, 11.0]);
//! let (mut dx, mut dw) = ([0.0f32; 6], [0.0f32; 6]);
//! let (dxv, dwv) = (ViewMut::new(&mut dx, [2, 3])?, ViewMut::new(&mut dw, [2, 3])?);
//! let grads = LinearGrads { dx: Some(dxv), dw: dwv, dbias: None };
//! let dy = [1.0f32; 4];
//! cpu.linear_backward(grads, View::new(&dy, [2, 2])?, LinearSaved { x: xv }, wv, GradMode::Overwrite)?;
//! assert_eq!(dx, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
//! assert_eq!(dw, [5.0, 7.0, 9.0, 5.0, 7.0, 9.0]);
//! # Ok::<(), longctx_kernels::KernelError>(())
//! ```

mod activation;
mod cross_entropy;
mod embedding;
mod layernorm;
mod matmul;
mod moe;
mod optim;
mod rmsnorm;
mod rope;

pub(crate) use activation::{squared_relu_backward, squared_relu_forward, swiglu_backward, swiglu_forward};
pub(crate) use cross_entropy::{cross_entropy_fused, cross_entropy_logits};
pub use cross_entropy::{CrossEntropyOptions, CrossEntropyOutput};
pub(crate) use embedding::{embedding_backward, embedding_forward};
pub(crate) use layernorm::{layernorm_backward, layernorm_forward};
pub(crate) use matmul::{linear_backward, linear_forward, matmul, matmul_backward};
pub(crate) use moe::{combine, combine_backward, gather, gather_backward, router_backward, router_forward};
pub use moe::{RouterOutput, Routing};
pub use optim::AdamW;
pub(crate) use optim::{adamw_step, adamw_step_with_copy, sum_squares};
pub(crate) use rmsnorm::{rmsnorm_backward, rmsnorm_forward};
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

/// An `f32` buffer of `len` elements taken from the calling thread's pool and given back on drop. The pooled
/// vector keeps every element it ever initialised (`buf.len() >= len`), so a later, longer use of it need not
/// write them again before [`Scratch::overwritten`] hands them out.
pub(crate) struct Scratch {
    buf: Vec<f32>,
    len: usize,
}

impl Scratch {
    /// A buffer of `n` zeros.
    pub(crate) fn zeroed(n: usize) -> Self {
        let mut s = Self::overwritten(n);
        s.fill(0.0);
        s
    }
    /// A buffer of `n` elements left as an earlier use of the pooled buffer wrote them (zeros where none did):
    /// for outputs written whole before they are read, which need not be cleared first.
    pub(crate) fn overwritten(n: usize) -> Self {
        let mut buf = Self::take(n);
        if buf.len() < n {
            buf.resize(n, 0.0);
        }
        Scratch { buf, len: n }
    }
    fn take(n: usize) -> Vec<f32> {
        POOL.with(|p| {
            let mut p = p.borrow_mut();
            // Best fit: the smallest pooled buffer that is large enough, else the largest.
            let best = (0..p.len())
                .filter(|&i| p[i].len() >= n)
                .min_by_key(|&i| p[i].len())
                .or_else(|| (0..p.len()).max_by_key(|&i| p[i].len()));
            best.map(|i| p.swap_remove(i)).unwrap_or_default()
        })
    }
    /// `src` widened to `f32`.
    pub(crate) fn widened<T: Element>(src: &[T]) -> Self {
        let mut s = Scratch::overwritten(src.len());
        crate::dtype::load_f32(src, &mut s);
        s
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.buf);
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
        &self.buf[..self.len]
    }
}
impl DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[..self.len]
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
