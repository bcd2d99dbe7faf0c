//! LayerNorm over the last dimension, with weight and bias.
//!
//! Legend: `N` rows (tokens), `C` channels.
//!
//! ```text
//! forward:  μ[n] = mean_c x[n,c],  r[n] = 1 / sqrt(mean_c (x−μ)² + eps)      (both saved)
//!           y[n,c] = (x[n,c] − μ[n]) · r[n] · w[c] + b[c]
//! backward: x̂ = (x−μ)·r,  g = dy·w
//!           dx[n,c] = r[n] · (g[n,c] − mean_c g[n] − x̂[n,c] · mean_c(g·x̂)[n])
//!           dw[c] (+)= Σ_n dy·x̂      db[c] (+)= Σ_n dy
//! ```
//!
//! Rows run in parallel in fixed blocks; weight and bias gradients are summed per block, blocks in order.

use rayon::prelude::*;

use super::{reduce_partials, ROWS_PER_TASK};
use crate::dtype::Element;

/// LayerNorm forward: `y[N,C]`, saving `mean[N]` and `rstd[N]` for the backward.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layernorm_forward<T: Element>(
    y: &mut [T],
    mean: &mut [f32],
    rstd: &mut [f32],
    x: &[T],
    weight: &[T],
    bias: &[T],
    c: usize,
    eps: f32,
) {
    let w: Vec<f32> = weight.iter().map(|v| v.to_f32()).collect();
    let b: Vec<f32> = bias.iter().map(|v| v.to_f32()).collect();
    y.par_chunks_mut(c * ROWS_PER_TASK)
        .zip(mean.par_chunks_mut(ROWS_PER_TASK))
        .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
        .zip(x.par_chunks(c * ROWS_PER_TASK))
        .for_each(|(((y, ms), rs), x)| {
            let mut row = vec![0.0f32; c];
            for (((y, m), r), x) in y.chunks_exact_mut(c).zip(ms.iter_mut()).zip(rs.iter_mut()).zip(x.chunks_exact(c)) {
                let mut s = 0.0f32;
                for (d, v) in row.iter_mut().zip(x) {
                    *d = v.to_f32();
                    s += *d;
                }
                let mu = s / c as f32;
                // Two-pass variance: no cancellation for rows with a large mean.
                let mut ss = 0.0f32;
                for v in &row {
                    ss += (*v - mu) * (*v - mu);
                }
                let inv = 1.0 / (ss / c as f32 + eps).sqrt();
                *m = mu;
                *r = inv;
                for i in 0..c {
                    y[i] = T::from_f32((row[i] - mu) * inv * w[i] + b[i]);
                }
            }
        });
}

/// LayerNorm backward: `dx[N,C]` (overwritten), `dweight[C]` and `dbias[C]` (added to when `accumulate`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn layernorm_backward<T: Element, G: Element>(
    dx: &mut [T],
    dweight: &mut [G],
    dbias: &mut [G],
    dy: &[T],
    x: &[T],
    weight: &[T],
    mean: &[f32],
    rstd: &[f32],
    c: usize,
    accumulate: bool,
) {
    let w: Vec<f32> = weight.iter().map(|v| v.to_f32()).collect();
    let partials: Vec<(Vec<f32>, Vec<f32>)> = dx
        .par_chunks_mut(c * ROWS_PER_TASK)
        .zip(dy.par_chunks(c * ROWS_PER_TASK))
        .zip(x.par_chunks(c * ROWS_PER_TASK))
        .zip(mean.par_chunks(ROWS_PER_TASK).zip(rstd.par_chunks(ROWS_PER_TASK)))
        .map(|(((dx, dy), x), (ms, rs))| {
            let mut dw = vec![0.0f32; c];
            let mut db = vec![0.0f32; c];
            let mut xh = vec![0.0f32; c];
            let mut g = vec![0.0f32; c];
            for ((((dx, dy), x), &mu), &r) in
                dx.chunks_exact_mut(c).zip(dy.chunks_exact(c)).zip(x.chunks_exact(c)).zip(ms).zip(rs)
            {
                let (mut sg, mut sgx) = (0.0f32, 0.0f32);
                for i in 0..c {
                    let d = dy[i].to_f32();
                    xh[i] = (x[i].to_f32() - mu) * r;
                    g[i] = d * w[i];
                    dw[i] += d * xh[i];
                    db[i] += d;
                    sg += g[i];
                    sgx += g[i] * xh[i];
                }
                let (mg, mgx) = (sg / c as f32, sgx / c as f32);
                for i in 0..c {
                    dx[i] = T::from_f32(r * (g[i] - mg - xh[i] * mgx));
                }
            }
            (dw, db)
        })
        .collect();
    let (pw, pb): (Vec<Vec<f32>>, Vec<Vec<f32>>) = partials.into_iter().unzip();
    reduce_partials(dweight, &pw, accumulate);
    reduce_partials(dbias, &pb, accumulate);
}
