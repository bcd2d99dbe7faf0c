//! The CPU backend's cross-entropy ([`CrossEntropyOptions`]'s formulas): from logits, and fused with the output
//! projection in chunks of tokens.

use rayon::prelude::*;

use super::matmul::{gemm_f32, row_major, transposed, with_out};
use super::{F32In, Scratch};
use crate::dtype::Element;
use crate::ops::{CrossEntropyOptions, CrossEntropyOutput};

/// Replaces one row of logits by its gradient `(softmax − onehot) · scale`; returns the token's loss.
///
/// With `e_j = exp(z_j − max)`, `O = Σ_{j≠y} e_j` and `S = e_y + O` (sums in f64), the target entry is
/// `dz_y = −O/S · scale` and the loss `ln(S/e_y) = ln1p(O/e_y)`: neither subtracts two nearly equal numbers,
/// so a confident prediction (`p_y → 1`) keeps full relative precision in both, where `p_y − 1` in f32 would
/// round to 0.
#[inline]
fn softmax_xent_row(z: &mut [f32], target: Option<usize>, scale: f32) -> f64 {
    let Some(y) = target else {
        z.fill(0.0);
        return 0.0;
    };
    let zy = z[y];
    let max = z.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let exp_sum = |s: &mut [f32]| {
        let mut acc = 0.0f64;
        for x in s.iter_mut() {
            *x = (*x - max).exp();
            acc += *x as f64;
        }
        acc
    };
    let (lo, rest) = z.split_at_mut(y);
    let other = exp_sum(lo) + exp_sum(&mut rest[1..]);
    let d = zy - max; // <= 0
    let ey = d.exp();
    let sum = other + ey as f64;
    let loss = if d > -1.0 { (other / ey as f64).ln_1p() } else { sum.ln() - d as f64 };
    let k = (scale as f64 / sum) as f32;
    for x in z.iter_mut() {
        *x *= k;
    }
    z[y] = (-other * scale as f64 / sum) as f32;
    loss
}

fn target_of(y: i64, ignore: i64) -> Option<usize> {
    (y != ignore).then_some(y as usize)
}

/// Fused output projection and cross-entropy, chunked over tokens: from `hidden[T,C]` and `weight[V,C]` computes
/// the mean loss, `dhidden[T,C]` (overwritten) and `dweight[V,C]` (added to when `accumulate`), holding only
/// `opts.chunk_tokens × V` logits at a time.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_fused<T: Element, G: Element>(
    dhidden: &mut [T],
    dweight: &mut [G],
    hidden: &[T],
    weight: &[T],
    targets: &[i64],
    t: usize,
    c: usize,
    v: usize,
    opts: &CrossEntropyOptions,
    (n_valid, denom): (usize, f64),
    accumulate: bool,
) -> CrossEntropyOutput {
    let k = opts.chunk_tokens.min(t);
    let scale = (1.0 / denom) as f32;

    let (h, w) = (F32In::new(hidden), F32In::new(weight));
    let mut losses = vec![0.0f64; t];
    let mut z = Scratch::zeroed(k * v);
    with_out(dweight, accumulate, |dw, acc| {
        if !acc {
            dw.fill(0.0);
        }
        with_out(dhidden, false, |dh, _| {
            for t0 in (0..t).step_by(k) {
                let rows = k.min(t - t0);
                let tg = &targets[t0..t0 + rows];
                let dh = &mut dh[t0 * c..(t0 + rows) * c];
                if tg.iter().all(|&y| y == opts.ignore_index) {
                    dh.fill(0.0);
                    continue;
                }
                let hc = &h[t0 * c..(t0 + rows) * c];
                let z = &mut z[..rows * v];
                gemm_f32(rows, v, c, z, row_major(hc, c), transposed(&w, c), false);
                z.par_chunks_mut(v)
                    .zip(tg.par_iter())
                    .zip(losses[t0..t0 + rows].par_iter_mut())
                    .for_each(|((row, &y), l)| *l = softmax_xent_row(row, target_of(y, opts.ignore_index), scale));
                gemm_f32(rows, c, v, dh, row_major(z, v), row_major(&w, c), false);
                gemm_f32(v, c, rows, dw, transposed(z, v), row_major(hc, c), true);
            }
        });
    });
    let loss_sum: f64 = losses.iter().sum();
    CrossEntropyOutput { loss: (loss_sum / denom) as f32, loss_sum, n_valid }
}
