//! The plain reference: softmax materialised row by row, in `f64`, as loops. It is the independent check of
//! the fast kernels (and of ring attention in other crates); never use it for speed.

use super::AttnParams;

/// Reference forward: returns `(O, LSE)` in `f64` for `f64` inputs laid out as in the module docs.
/// Rows that see no key give `O = 0`, `LSE = -inf`.
pub fn forward(p: &AttnParams<'_>, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let s = p.shape;
    let d = s.head_dim;
    let mut o = vec![0.0; s.q_elems()];
    let mut lse = vec![f64::NEG_INFINITY; s.lse_elems()];
    let mut scores = vec![0.0; s.kv_len];
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            let hk = h / s.group();
            for i in 0..s.q_len {
                let qi = &q[((b * s.q_heads + h) * s.q_len + i) * d..][..d];
                let mut mx = f64::NEG_INFINITY;
                for j in 0..s.kv_len {
                    scores[j] = if p.mask.visible(i, j) {
                        let kj = &k[((b * s.kv_heads + hk) * s.kv_len + j) * d..][..d];
                        p.scale as f64 * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>()
                    } else {
                        f64::NEG_INFINITY
                    };
                    mx = mx.max(scores[j]);
                }
                if mx == f64::NEG_INFINITY {
                    continue;
                }
                let z: f64 = scores.iter().map(|x| (x - mx).exp()).sum();
                let row = (b * s.q_heads + h) * s.q_len + i;
                lse[row] = mx + z.ln();
                for j in 0..s.kv_len {
                    let pj = (scores[j] - mx).exp() / z;
                    if pj == 0.0 {
                        continue;
                    }
                    let vj = &v[((b * s.kv_heads + hk) * s.kv_len + j) * d..][..d];
                    for (o, x) in o[row * d..(row + 1) * d].iter_mut().zip(vj) {
                        *o += pj * x;
                    }
                }
            }
        }
    }
    (o, lse)
}

/// Reference backward: returns `(dQ, dK, dV)` in `f64`, recomputing the softmax from scratch.
pub fn backward(p: &AttnParams<'_>, q: &[f64], k: &[f64], v: &[f64], d_o: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let s = p.shape;
    let d = s.head_dim;
    let sc = p.scale as f64;
    let (mut dq, mut dk, mut dv) = (vec![0.0; s.q_elems()], vec![0.0; s.kv_elems()], vec![0.0; s.kv_elems()]);
    let mut probs = vec![0.0; s.kv_len];
    let mut dp = vec![0.0; s.kv_len];
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            let hk = h / s.group();
            let kv_row = |j: usize| ((b * s.kv_heads + hk) * s.kv_len + j) * d;
            for i in 0..s.q_len {
                let row = ((b * s.q_heads + h) * s.q_len + i) * d;
                let qi = &q[row..row + d];
                let doi = &d_o[row..row + d];
                let mut mx = f64::NEG_INFINITY;
                for j in 0..s.kv_len {
                    probs[j] = if p.mask.visible(i, j) {
                        sc * qi.iter().zip(&k[kv_row(j)..kv_row(j) + d]).map(|(a, b)| a * b).sum::<f64>()
                    } else {
                        f64::NEG_INFINITY
                    };
                    mx = mx.max(probs[j]);
                }
                if mx == f64::NEG_INFINITY {
                    continue;
                }
                let z: f64 = probs.iter().map(|x| (x - mx).exp()).sum();
                for x in probs.iter_mut() {
                    *x = (*x - mx).exp() / z;
                }
                // dP_j = dO·v_j ; dS_j = P_j (dP_j - Σ_l P_l dP_l)
                let mut dot = 0.0;
                for j in 0..s.kv_len {
                    dp[j] = doi.iter().zip(&v[kv_row(j)..kv_row(j) + d]).map(|(a, b)| a * b).sum::<f64>();
                    dot += probs[j] * dp[j];
                }
                for j in 0..s.kv_len {
                    if probs[j] == 0.0 {
                        continue;
                    }
                    let ds = probs[j] * (dp[j] - dot);
                    let kr = kv_row(j);
                    for x in 0..d {
                        dq[row + x] += sc * ds * k[kr + x];
                        dk[kr + x] += sc * ds * qi[x];
                        dv[kr + x] += probs[j] * doi[x];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}
