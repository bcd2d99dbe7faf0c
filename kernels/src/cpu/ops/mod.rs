//! The CPU backend's kernels for every op but attention: typed slices and explicit sizes, called by
//! [`CpuBackend`](crate::CpuBackend) once it has checked the views ([`crate::checks`]). What each op computes is
//! written in [`crate::ops`].
//!
//! Results are bit-identical for any number of rayon threads: work is split into pieces whose boundaries depend
//! only on the shapes, and partial sums are combined in a fixed order on one thread.

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
pub(crate) use cross_entropy::cross_entropy_fused;
pub(crate) use embedding::{embedding_backward, embedding_forward};
pub(crate) use layernorm::{layernorm_backward, layernorm_forward};
pub(crate) use matmul::{linear_backward, linear_forward};
pub(crate) use moe::{combine, combine_backward, gather, gather_backward, router_backward, router_forward};
pub(crate) use optim::{adamw_step, adamw_step_with_copy, sum_squares};
pub(crate) use rmsnorm::{rmsnorm_backward, rmsnorm_forward};

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

use crate::dtype::{DType, Element};

/// Rows per parallel task in row-wise ops; fixed so the split never depends on the thread count.
pub(crate) const ROWS_PER_TASK: usize = 16;
/// Elements per parallel task in element-wise ops.
pub(crate) const ELEMS_PER_TASK: usize = 1 << 14;

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
