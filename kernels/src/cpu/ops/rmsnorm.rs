//! RMSNorm over the last dimension.
//!
//! Legend: `N` rows (tokens), `C` channels.
//!
//! ```text
//! forward:  r[n] = 1 / sqrt(mean_c x[n,c]² + eps)        (saved as `rstd`)
//!           y[n,c] = x[n,c] · r[n] · w[c]
//! backward: x̂ = x·r,  g = dy·w
//!           dx[n,c] = r[n] · (g[n,c] − x̂[n,c] · mean_c(g·x̂)[n])
//!           dw[c] (+)= Σ_n dy[n,c] · x̂[n,c]
//! ```
//!
//! Rows run in parallel in fixed blocks of `ROWS_PER_TASK`; the weight gradient is
//! summed per block and the blocks are added in order, so the result does not depend on the thread count.

use rayon::prelude::*;

use super::{reduce_partials, ROWS_PER_TASK};
use crate::dtype::Element;

/// RMSNorm forward: `y[N,C] = x · rstd · w`, saving `rstd[N]` for the backward.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rmsnorm_forward<T: Element>(y: &mut [T], rstd: &mut [f32], x: &[T], weight: &[T], c: usize, eps: f32) {
    let w: Vec<f32> = weight.iter().map(|v| v.to_f32()).collect();
    y.par_chunks_mut(c * ROWS_PER_TASK)
        .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
        .zip(x.par_chunks(c * ROWS_PER_TASK))
        .for_each(|((y, rs), x)| {
            let mut row = vec![0.0f32; c];
            for ((y, r), x) in y.chunks_exact_mut(c).zip(rs.iter_mut()).zip(x.chunks_exact(c)) {
                let mut ss = 0.0f32;
                for (d, s) in row.iter_mut().zip(x) {
                    *d = s.to_f32();
                    ss += *d * *d;
                }
                let inv = 1.0 / (ss / c as f32 + eps).sqrt();
                *r = inv;
                for ((y, v), w) in y.iter_mut().zip(&row).zip(&w) {
                    *y = T::from_f32(*v * inv * *w);
                }
            }
        });
}

/// RMSNorm backward: `dx[N,C]` (overwritten) and `dweight[C]` (added to when `accumulate`), from `dy[N,C]`,
/// the forward input `x`, `weight` and the saved `rstd[N]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rmsnorm_backward<T: Element, G: Element>(
    dx: &mut [T],
    dweight: &mut [G],
    dy: &[T],
    x: &[T],
    weight: &[T],
    rstd: &[f32],
    c: usize,
    accumulate: bool,
) {
    let w: Vec<f32> = weight.iter().map(|v| v.to_f32()).collect();
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(c * ROWS_PER_TASK)
        .zip(dy.par_chunks(c * ROWS_PER_TASK))
        .zip(x.par_chunks(c * ROWS_PER_TASK))
        .zip(rstd.par_chunks(ROWS_PER_TASK))
        .map(|(((dx, dy), x), rs)| {
            let mut dw = vec![0.0f32; c];
            let mut xh = vec![0.0f32; c];
            let mut g = vec![0.0f32; c];
            for (((dx, dy), x), &r) in dx.chunks_exact_mut(c).zip(dy.chunks_exact(c)).zip(x.chunks_exact(c)).zip(rs) {
                let mut dot = 0.0f32;
                for i in 0..c {
                    let d = dy[i].to_f32();
                    xh[i] = x[i].to_f32() * r;
                    g[i] = d * w[i];
                    dw[i] += d * xh[i];
                    dot += g[i] * xh[i];
                }
                let mean = dot / c as f32;
                for i in 0..c {
                    dx[i] = T::from_f32(r * (g[i] - xh[i] * mean));
                }
            }
            dw
        })
        .collect();
    reduce_partials(dweight, &partials, accumulate);
}
