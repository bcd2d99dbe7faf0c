//! The linear layer, on the `gemm` crate (f32 micro-kernels; `bf16` operands are widened
//! into reused `f32` scratch first).
//!
//! Legend: `M`, `K`, `N` matrix sizes; `T` tokens; `IN`/`OUT` a linear layer's input and output features.
//!
//! ```text
//! linear_forward:   Y[T,OUT] = X[T,IN] · Wᵀ + b    with W[OUT,IN], b[OUT]
//! linear_backward:  dX[T,IN] = dY · W              dW[OUT,IN] (+)= dYᵀ · X     db[OUT] (+)= Σ_t dY[t,:]
//! ```
//!
//! Determinism: the output is cut into tiles that depend on its shape alone (`tile_sizes`), each computed by
//! one single-threaded `gemm` call over the whole `K`; tiles run in parallel on rayon. Gradients of a
//! weight (a long reduction over tokens into a small output) cut `K` instead, into chunks that depend on the
//! shape alone, and sum the chunks' partial products in chunk order (`gemm_f32_split_k`). Every output element
//! is therefore the same sequence of operations whatever the number of threads.

use rayon::prelude::*;

use super::{as_f32_mut, store, F32In, Scratch};
use crate::dtype::Element;

/// Rows of an output tile at most: each tile's `gemm` call packs its slice of `B` (a weight, for the linear
/// layer) again, so taller tiles pack it less often (the `linear_bench` runs behind 512:
/// `bench/log/comment-history-2026-12-05.md`).
const TILE_M: usize = 512;
const TILE_N: usize = 256;
/// Fewer tiles than this leave a thread idle for most of a product (a `[128, 256]` weight gradient over
/// thousands of tokens is one tile): rows are then cut finer, down to [`MIN_TILE_M`]. Enough for a 16-core
/// machine to have a tile per thread.
const MIN_TILES: usize = 16;
const MIN_TILE_M: usize = 32;
/// Chunks of a split reduction ([`gemm_f32_split_k`]): enough to keep every thread of a small machine busy;
/// more cost partials' memory and their summing.
const K_CHUNKS: usize = 8;
/// The shortest chunk of a split reduction: long enough that a chunk's packing of its operands stays small
/// against its multiply-adds.
const K_CHUNK_MIN: usize = 512;
/// The most bytes of partials a split reduction may take (per thread that runs one: they are pooled).
const SPLIT_K_MAX_BYTES: usize = 32 << 20;
/// Below this many multiply-adds a product runs on the calling thread (same tiles, same result).
const PAR_MIN_FLOPS: usize = 1 << 18;

/// A strided read-only `f32` matrix: element `(i, j)` is at `ptr + i·rs + j·cs`.
#[derive(Clone, Copy)]
pub(crate) struct Strided {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}
// SAFETY: only read, and the borrow it came from outlives every use (scoped to `gemm_f32`).
unsafe impl Send for Strided {}
unsafe impl Sync for Strided {}
impl Strided {
    /// Pointer to element `(i, j)` (a method, so closures capture the whole `Send` view).
    fn at(self, i: usize, j: usize) -> *const f32 {
        self.ptr.wrapping_offset(i as isize * self.rs + j as isize * self.cs)
    }
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tiles written through it are disjoint.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}
impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// One single-threaded `gemm` call: `c[m,n] (+)= a[m,k] · b[k,n]`, `c` row-major with leading dimension `ldc`,
/// `a` and `b` starting at `a0` and `b0` with the strides of `a` and `b`.
///
/// # Safety
/// `c` must be valid for writes, and `a0`, `b0` for reads, over the extents these sizes and strides give.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_serial(
    m: usize,
    n: usize,
    k: usize,
    c: *mut f32,
    ldc: usize,
    a0: *const f32,
    a: Strided,
    b0: *const f32,
    b: Strided,
    accumulate: bool,
) {
    // SAFETY: the caller's contract; `gemm` reads `c` only with `accumulate`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c,
            1,
            ldc as isize,
            accumulate,
            a0,
            a.cs,
            a.rs,
            b0,
            b.cs,
            b.rs,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// `c[M,N] (+)= a[M,K] · b[K,N]` with `c` row-major and `a`, `b` strided views. Callers have checked that the
/// views stay inside their buffers.
pub(crate) fn gemm_f32(m: usize, n: usize, k: usize, c: &mut [f32], a: Strided, b: Strided, accumulate: bool) {
    debug_assert_eq!(c.len(), m * n);
    let (tile_m, tile_n) = tile_sizes(m, n);
    let tiles_m = m.div_ceil(tile_m);
    let tiles_n = n.div_ceil(tile_n);
    let out = OutPtr(c.as_mut_ptr());
    let run = |tile: usize| {
        let (ti, tj) = (tile / tiles_n, tile % tiles_n);
        let (i0, j0) = (ti * tile_m, tj * tile_n);
        let (mm, nn) = (tile_m.min(m - i0), tile_n.min(n - j0));
        // SAFETY: the tile `[i0, i0+mm) × [j0, j0+nn)` lies inside `c` and no other task writes it; the operand
        // views cover rows `i0..i0+mm` of `a` and columns `j0..j0+nn` of `b`, inside their buffers.
        unsafe { gemm_serial(mm, nn, k, out.get().add(i0 * n + j0), n, a.at(i0, 0), a, b.at(0, j0), b, accumulate) }
    };
    let tiles = tiles_m * tiles_n;
    if tiles == 1 || m.saturating_mul(n).saturating_mul(k) < PAR_MIN_FLOPS {
        (0..tiles).for_each(run);
    } else {
        (0..tiles).into_par_iter().for_each(run);
    }
}

/// `c[M,N] (+)= a[M,K] · b[K,N]` for a long reduction over a small output (a weight gradient, `K` the tokens):
/// `K` cut into chunks (their count and length a function of the shape alone), each chunk's product of the
/// whole output one single-threaded `gemm` call into a partial of its own, the chunks in parallel, then the
/// partials summed in chunk order. Cut by output tiles instead ([`gemm_f32`]), every tile would repack its slice
/// of `b` over the whole `K` (the layer's input, once per tile row). Falls back to [`gemm_f32`] when the
/// reduction is too short to cut into [`K_CHUNKS`] chunks of [`K_CHUNK_MIN`] or the partials would outgrow
/// [`SPLIT_K_MAX_BYTES`].
pub(crate) fn gemm_f32_split_k(m: usize, n: usize, k: usize, c: &mut [f32], a: Strided, b: Strided, accumulate: bool) {
    if k < K_CHUNKS * K_CHUNK_MIN || K_CHUNKS.saturating_mul(4 * m).saturating_mul(n) > SPLIT_K_MAX_BYTES {
        return gemm_f32(m, n, k, c, a, b, accumulate);
    }
    let chunk = k.div_ceil(K_CHUNKS);
    // Every partial is written whole by its chunk's product (`gemm` without accumulation reads no output).
    let mut partials = Scratch::overwritten(K_CHUNKS * m * n);
    partials.par_chunks_mut(m * n).enumerate().for_each(|(i, part)| {
        let k0 = i * chunk;
        let kc = chunk.min(k - k0);
        // SAFETY: `part` is `m × n`, row-major, and this task's alone; the operand views cover rows `0..m` of
        // `a` and columns `0..n` of `b` over the reduction's `k0..k0+kc`, inside their buffers.
        unsafe { gemm_serial(m, n, kc, part.as_mut_ptr(), n, a.at(0, k0), a, b.at(k0, 0), b, false) }
    });
    // Each output element adds its chunks in chunk order (one contiguous pass per chunk): the same operations on
    // any number of threads.
    c.par_chunks_mut(super::ELEMS_PER_TASK).enumerate().for_each(|(t, out)| {
        let e0 = t * super::ELEMS_PER_TASK;
        if !accumulate {
            out.fill(0.0);
        }
        for part in partials.chunks_exact(m * n) {
            out.iter_mut().zip(&part[e0..]).for_each(|(o, p)| *o += *p);
        }
    });
}

/// The output tile of a product: at most `TILE_M × TILE_N`, cut into equal parts (257 columns are two tiles
/// of 144 and 113, not 256 and 1), with rows cut finer while there are fewer than [`MIN_TILES`]. A function of
/// the shape alone, so every element's sum is the same whatever the number of threads.
fn tile_sizes(m: usize, n: usize) -> (usize, usize) {
    let even = |len: usize, max: usize, align: usize| len.div_ceil(len.div_ceil(max)).next_multiple_of(align).min(len);
    let tile_n = even(n, TILE_N, 16);
    let tiles_n = n.div_ceil(tile_n);
    let mut max_m = TILE_M;
    while max_m > MIN_TILE_M && m.div_ceil(max_m) * tiles_n < MIN_TILES {
        max_m /= 2;
    }
    (even(m, max_m, 8), tile_n)
}

pub(crate) fn row_major(s: &[f32], cols: usize) -> Strided {
    Strided { ptr: s.as_ptr(), rs: cols as isize, cs: 1 }
}
pub(crate) fn transposed(s: &[f32], cols: usize) -> Strided {
    // Element (i, j) of the transpose is s[j·cols + i].
    Strided { ptr: s.as_ptr(), rs: 1, cs: cols as isize }
}

/// Runs `f` on an `f32` output buffer for `dst`: `dst` itself when it is `f32` (then `accumulate` is passed to
/// `f`), else zeroed scratch whose result is stored or added into `dst` afterwards.
pub(crate) fn with_out<G: Element>(dst: &mut [G], accumulate: bool, f: impl FnOnce(&mut [f32], bool)) {
    match as_f32_mut(dst) {
        Some(d) => f(d, accumulate),
        None => {
            let mut s = Scratch::zeroed(dst.len());
            f(&mut s, false);
            store(dst, &s, accumulate);
        }
    }
}

/// Linear layer forward: `Y[T,OUT] = X[T,IN] · Wᵀ + b`, with `W[OUT,IN]` (PyTorch `nn.Linear` layout) and an
/// optional bias `b[OUT]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_forward<T: Element>(
    y: &mut [T],
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    t: usize,
    d_in: usize,
    d_out: usize,
) {
    let (x, w) = (F32In::new(x), F32In::new(w));
    let bias = bias.map(F32In::new);
    with_out(y, false, |y, _| {
        // Start from the bias and let gemm add X·Wᵀ to it.
        if let Some(b) = &bias {
            y.chunks_exact_mut(d_out).for_each(|row| row.copy_from_slice(b));
        }
        gemm_f32(t, d_out, d_in, y, row_major(&x, d_in), transposed(&w, d_in), bias.is_some());
    });
}

/// Linear layer backward. `dX[T,IN] = dY · W` (overwritten; `None` skips it, e.g. for the first layer),
/// `dW[OUT,IN] (+)= dYᵀ · X`, `db[OUT] (+)= Σ_t dY[t,:]` (added to when `accumulate`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_backward<T: Element, G: Element>(
    dx: Option<&mut [T]>,
    dw: &mut [G],
    dbias: Option<&mut [G]>,
    dy: &[T],
    x: &[T],
    w: &[T],
    t: usize,
    d_in: usize,
    d_out: usize,
    accumulate: bool,
) {
    let dy = F32In::new(dy);
    if let Some(dx) = dx {
        let w = F32In::new(w);
        with_out(dx, false, |o, acc| gemm_f32(t, d_in, d_out, o, row_major(&dy, d_out), row_major(&w, d_in), acc));
    }
    {
        let x = F32In::new(x);
        with_out(dw, accumulate, |o, acc| {
            gemm_f32_split_k(d_out, d_in, t, o, transposed(&dy, d_out), row_major(&x, d_in), acc)
        });
    }
    if let Some(db) = dbias {
        // Column sums in token order (one thread; O(T·OUT), small next to the products).
        let mut sum = vec![0.0f32; d_out];
        for row in dy.chunks_exact(d_out) {
            for (s, v) in sum.iter_mut().zip(row) {
                *s += *v;
            }
        }
        store(db, &sum, accumulate);
    }
}
