//! What a property test of an attention kernel needs besides the kernel: seeded data and the error measure.
//!
//! The suites of this workspace (kernels, ring attention, the cross-crate tests) use these, and so can a
//! framework that tests its own kernels against ours or against [`crate::attention::reference`]. Nothing in the
//! kernels themselves depends on this module.

use crate::attention::{reference, AttnParams};
use crate::{attention_backward, attention_forward};

/// `n` values uniform in (−1, 1), never exactly zero, reproducible from `seed` (xorshift64).
///
/// Never zero so that an output that should be nonzero cannot be matched by an unwritten buffer, and bounded
/// so that attention scores stay in a range where f32 and bf16 errors are comparable across tests.
pub fn uniform_nonzero(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            if v == 0.0 {
                0.25
            } else {
                v
            }
        })
        .collect()
}

/// max |got − want| / max |want|: the relative error of a whole tensor, as the suites measure it.
///
/// Where `want` is zero everywhere the measure is the absolute error instead. That happens exactly, not just
/// nearly, when `want` comes from an exact reference such as [`crate::attention::reference`] and the true result
/// vanishes: with a window of 1 (or one key) every query sees a single key, the softmax is constant and dQ and dK
/// are zero, while the computed values are the rounding noise of the cancellation `dP − rowsum(dO·O)`. Compare
/// against the f64 reference, not against another f32 computation, whose zeros are noise too.
///
/// An infinite `want` (the LSE of a fully masked row) must be matched exactly; a non-finite `got` where `want` is
/// finite, a mismatched infinity or a length mismatch gives `f64::INFINITY`, so every tolerance check fails.
pub fn max_rel_err<W: Copy + Into<f64>>(got: &[f32], want: &[W]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let (g, w) = (g as f64, w.into());
        if w.is_infinite() || !g.is_finite() {
            if g != w {
                return f64::INFINITY;
            }
            continue;
        }
        num = num.max((g - w).abs());
        den = den.max(w.abs());
    }
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

/// Forward then backward of the kernels on `f32` buffers: `[O, LSE, dQ, dK, dV]`. Every output is poisoned with
/// NaN before its call, so an element the kernel fails to write cannot pass a comparison.
pub fn attention_f32(p: &AttnParams<'_>, q: &[f32], k: &[f32], v: &[f32], d_o: &[f32]) -> crate::Result<[Vec<f32>; 5]> {
    let s = p.shape;
    let mut o = vec![f32::NAN; s.q_elems()];
    let mut lse = vec![f32::NAN; s.lse_elems()];
    attention_forward(p, q.into(), k.into(), v.into(), (&mut o).into(), &mut lse)?;
    let (mut dq, mut dk, mut dv) =
        (vec![f32::NAN; s.q_elems()], vec![f32::NAN; s.kv_elems()], vec![f32::NAN; s.kv_elems()]);
    attention_backward(
        p,
        q.into(),
        k.into(),
        v.into(),
        (&o).into(),
        d_o.into(),
        &lse,
        (&mut dq).into(),
        (&mut dk).into(),
        (&mut dv).into(),
        false,
    )?;
    Ok([o, lse, dq, dk, dv])
}

/// The plain f64 reference ([`reference::forward`], [`reference::backward`]) on the same `f32` inputs, widened
/// exactly: `[O, LSE, dQ, dK, dV]`.
pub fn reference_f64(p: &AttnParams<'_>, q: &[f32], k: &[f32], v: &[f32], d_o: &[f32]) -> [Vec<f64>; 5] {
    let wide = |x: &[f32]| x.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    let (q, k, v, d_o) = (wide(q), wide(k), wide(v), wide(d_o));
    let (o, lse) = reference::forward(p, &q, &k, &v);
    let (dq, dk, dv) = reference::backward(p, &q, &k, &v, &d_o);
    [o, lse, dq, dk, dv]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_is_reproducible_bounded_and_nonzero() {
        let a = uniform_nonzero(10_000, 7);
        assert_eq!(a, uniform_nonzero(10_000, 7));
        assert_ne!(a, uniform_nonzero(10_000, 8));
        assert!(a.iter().all(|x| *x != 0.0 && x.abs() < 1.0));
    }

    #[test]
    fn error_measure() {
        assert_eq!(max_rel_err(&[1.0, 2.0], &[1.0f64, 2.0]), 0.0);
        assert!((max_rel_err(&[1.0, 2.1], &[1.0f32, 2.0]) - 0.05).abs() < 1e-6);
        assert_eq!(max_rel_err(&[f32::NEG_INFINITY], &[f64::NEG_INFINITY]), 0.0);
        assert_eq!(max_rel_err(&[0.0], &[f64::NEG_INFINITY]), f64::INFINITY);
        assert_eq!(max_rel_err(&[f32::NAN], &[0.5f64]), f64::INFINITY);
        assert_eq!(max_rel_err(&[1.0], &[1.0f64, 2.0]), f64::INFINITY);
        // An exact zero reference: the absolute error.
        assert!((max_rel_err(&[1e-6], &[0.0f64]) - 1e-6).abs() < 1e-12);
    }
}
