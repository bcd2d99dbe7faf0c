//! The CPU backend's mixture-of-experts kernels ([`Routing`]'s formulas).

use rayon::prelude::*;

use super::ROWS_PER_TASK;
use crate::dtype::Element;
use crate::error::Result;
use crate::ops::{RouterOutput, Routing};

/// Router forward: softmax of `logits[L,E]` into `probs` (`f32`), its top `k` per token, and their weights
/// renormalised to sum to 1 into `weights[L,K]` (`f32`).
pub(crate) fn router_forward<T: Element>(
    probs: &mut [f32],
    weights: &mut [f32],
    logits: &[T],
    l: usize,
    e: usize,
    k: usize,
) -> Result<RouterOutput> {
    let mut choice = vec![0u32; l * k];
    probs
        .par_chunks_mut(e * ROWS_PER_TASK)
        .zip(weights.par_chunks_mut(k * ROWS_PER_TASK))
        .zip(choice.par_chunks_mut(k * ROWS_PER_TASK))
        .zip(logits.par_chunks(e * ROWS_PER_TASK))
        .for_each(|(((p, w), c), x)| {
            for (((p, w), c), x) in
                p.chunks_exact_mut(e).zip(w.chunks_exact_mut(k)).zip(c.chunks_exact_mut(k)).zip(x.chunks_exact(e))
            {
                let max = x.iter().map(|v| v.to_f32()).fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for (p, x) in p.iter_mut().zip(x) {
                    *p = (x.to_f32() - max).exp();
                    sum += *p;
                }
                for p in p.iter_mut() {
                    *p /= sum;
                }
                // Top-k by repeated selection: strictly greater wins, so ties go to the lower index.
                let mut total = 0.0f32;
                for j in 0..k {
                    let mut best: Option<usize> = None;
                    for (i, &v) in p.iter().enumerate() {
                        if c[..j].contains(&(i as u32)) {
                            continue;
                        }
                        if best.is_none_or(|b| v > p[b]) {
                            best = Some(i);
                        }
                    }
                    let b = best.unwrap_or(0);
                    c[j] = b as u32;
                    w[j] = p[b];
                    total += p[b];
                }
                for w in w.iter_mut() {
                    *w /= total;
                }
            }
        });
    let mut prob_sum = vec![0.0f64; e];
    for row in probs.chunks_exact(e) {
        for (s, p) in prob_sum.iter_mut().zip(row) {
            *s += *p as f64;
        }
    }
    Ok(RouterOutput { routing: Routing::new(choice, l, e, k)?, prob_sum })
}

/// Router backward (see the module docs): `dlogits[L,E]` (overwritten) from `dweights[L,K]`, the auxiliary
/// loss's per-expert probability gradient `aux[E]` (added to every token's), and the saved `probs`, `weights`
/// and routing.
pub(crate) fn router_backward<T: Element>(
    dlogits: &mut [T],
    dweights: &[f32],
    aux: Option<&[f32]>,
    probs: &[f32],
    weights: &[f32],
    routing: &Routing,
) {
    let (e, k) = (routing.experts, routing.top_k);
    dlogits
        .par_chunks_mut(e * ROWS_PER_TASK)
        .zip(probs.par_chunks(e * ROWS_PER_TASK))
        .zip(weights.par_chunks(k * ROWS_PER_TASK))
        .zip(dweights.par_chunks(k * ROWS_PER_TASK))
        .zip(routing.choice.par_chunks(k * ROWS_PER_TASK))
        .for_each(|((((dl, p), w), dw), c)| {
            let mut dp = vec![0.0f32; e];
            for ((((dl, p), w), dw), c) in dl
                .chunks_exact_mut(e)
                .zip(p.chunks_exact(e))
                .zip(w.chunks_exact(k))
                .zip(dw.chunks_exact(k))
                .zip(c.chunks_exact(k))
            {
                match aux {
                    Some(a) => dp.copy_from_slice(a),
                    None => dp.fill(0.0),
                }
                let total: f32 = c.iter().map(|&i| p[i as usize]).sum();
                let g: f32 = dw.iter().zip(w).map(|(d, w)| d * w).sum();
                for (&i, d) in c.iter().zip(dw) {
                    dp[i as usize] += (d - g) / total;
                }
                let dot: f32 = p.iter().zip(&dp).map(|(p, d)| p * d).sum();
                for ((dl, p), d) in dl.iter_mut().zip(p).zip(&dp) {
                    *dl = T::from_f32(p * (d - dot));
                }
            }
        });
}

/// Gather: `xe[N,C]` row `n` = `x[L,C]` row `rows[n]`.
pub(crate) fn gather<T: Element>(xe: &mut [T], x: &[T], routing: &Routing, c: usize) {
    xe.par_chunks_mut(c * ROWS_PER_TASK).zip(routing.rows.par_chunks(ROWS_PER_TASK)).for_each(|(o, rows)| {
        for (o, &t) in o.chunks_exact_mut(c).zip(rows) {
            let t = t as usize;
            o.copy_from_slice(&x[t * c..(t + 1) * c]);
        }
    });
}

/// The weighted sum over each token's dispatched rows, in ascending expert order: `out[t,:] = Σ_n w(n)·ye[n,:]`
/// with `w(n) = weights[slot[n]]`, or 1 without weights (the gather's backward). Overwrites `out`.
fn sum_rows<T: Element, U: Element>(out: &mut [T], ye: &[U], weights: Option<&[f32]>, routing: &Routing, c: usize) {
    let k = routing.top_k;
    out.par_chunks_mut(c * ROWS_PER_TASK).zip(routing.inv.par_chunks(k * ROWS_PER_TASK)).for_each(|(o, inv)| {
        let mut acc = vec![0.0f32; c];
        for (o, inv) in o.chunks_exact_mut(c).zip(inv.chunks_exact(k)) {
            acc.fill(0.0);
            for &n in inv {
                let n = n as usize;
                let w = weights.map_or(1.0, |w| w[routing.slots[n] as usize]);
                for (a, y) in acc.iter_mut().zip(&ye[n * c..(n + 1) * c]) {
                    *a += w * y.to_f32();
                }
            }
            super::store(o, &acc, false);
        }
    });
}

/// Gather backward: `dx[L,C]` (overwritten) row `t` = the sum of `dxe[N,C]`'s rows of token `t`.
pub(crate) fn gather_backward<T: Element>(dx: &mut [T], dxe: &[T], routing: &Routing, c: usize) {
    sum_rows(dx, dxe, None, routing, c);
}

/// Combine: `out[L,C]` (overwritten) row `t` = `Σ_j weights[t,j]·ye[row of (t,j)]`, in ascending expert order.
pub(crate) fn combine<T: Element>(out: &mut [T], ye: &[T], weights: &[f32], routing: &Routing, c: usize) {
    sum_rows(out, ye, Some(weights), routing, c);
}

/// Combine backward: `dye[N,C]` and `dweights[L,K]` (`f32`), both overwritten.
pub(crate) fn combine_backward<T: Element>(
    dye: &mut [T],
    dweights: &mut [f32],
    dout: &[T],
    ye: &[T],
    weights: &[f32],
    routing: &Routing,
    c: usize,
) {
    let mut dw_row = vec![0.0f32; routing.rows()];
    dye.par_chunks_mut(c * ROWS_PER_TASK)
        .zip(ye.par_chunks(c * ROWS_PER_TASK))
        .zip(dw_row.par_chunks_mut(ROWS_PER_TASK))
        .enumerate()
        .for_each(|(blk, ((dy, y), dwr))| {
            for (j, ((dy, y), dwr)) in dy.chunks_exact_mut(c).zip(y.chunks_exact(c)).zip(dwr.iter_mut()).enumerate() {
                let n = blk * ROWS_PER_TASK + j;
                let t = routing.rows[n] as usize;
                let w = weights[routing.slots[n] as usize];
                let g = &dout[t * c..(t + 1) * c];
                let mut dot = 0.0f32;
                for ((dy, y), g) in dy.iter_mut().zip(y).zip(g) {
                    let g = g.to_f32();
                    *dy = T::from_f32(w * g);
                    dot += g * y.to_f32();
                }
                *dwr = dot;
            }
        });
    for (n, d) in dw_row.into_iter().enumerate() {
        dweights[routing.slots[n] as usize] = d;
    }
}
