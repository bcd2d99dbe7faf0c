//! What a property test of an attention kernel needs besides the kernel: seeded data, the error measure, and
//! slice-level calls of a backend's attention.
//!
//! The suites of this workspace (kernels, ring attention, the cross-crate tests) use these, and so can a
//! framework that tests its own kernels against ours or against [`crate::attention::reference`]. The slice-level
//! calls ([`attention_forward`], [`attention_backward`], [`attention_f32`]) are thin wrappers that view the
//! slices with the dims of an [`AttnParams`] and call a [`Backend`]; there is no second implementation. Nothing
//! in the kernels themselves depends on this module.
//!
//! With the `conformance` feature, `testing::conformance` is the whole conformance suite: every [`Backend`] op of
//! any backend against f64 references and the CPU backend, on cases drawn by proptest (this crate's own tests run
//! it on each of its backends).

#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;

use crate::attention::{reference, AttnGrads, AttnOut, AttnParams, AttnSaved, Qkv};
use crate::backend::{Backend, GradMode};
use crate::cpu::CpuBackend;
use crate::error::{check_len, Result};
use crate::host::{HostSlice, HostSliceMut};
use crate::view::{IntoDims, View, ViewMut};

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

/// A view of `data` with `dims`; a length that does not match them is a [`KernelError::BufferLength`] naming
/// `name`, as the slice-level checks of the kernels report it.
///
/// [`KernelError::BufferLength`]: crate::KernelError::BufferLength
fn view<'a>(name: &'static str, data: HostSlice<'a>, dims: impl IntoDims) -> Result<View<'a>> {
    let dims = dims.into_dims()?;
    check_len(name, data.len(), dims.numel())?;
    View::host(data, dims)
}

fn view_mut<'a>(name: &'static str, data: HostSliceMut<'a>, dims: impl IntoDims) -> Result<ViewMut<'a>> {
    let dims = dims.into_dims()?;
    check_len(name, data.len(), dims.numel())?;
    ViewMut::host(data, dims)
}

/// Attention forward of `p` on host slices, through `backend`: a thin wrapper that views `q`, `k`, `v` (`f32` or
/// `bf16`, one type), `o` (`[B, Hq, Sq, D]`) and `lse` (`[B, Hq, Sq]`) with the dims of `p.shape` and calls
/// [`Backend::attention_forward`] with `p`'s mask and scale. Outputs first, as the backend takes them.
///
/// For property tests that keep their buffers as slices; code that computes holds views and calls the backend.
/// A slice whose length does not match `p.shape` is a [`KernelError::BufferLength`](crate::KernelError) naming
/// it; everything else is the backend's check.
pub fn attention_forward(
    backend: &dyn Backend,
    p: &AttnParams<'_>,
    o: HostSliceMut<'_>,
    lse: &mut [f32],
    q: HostSlice<'_>,
    k: HostSlice<'_>,
    v: HostSlice<'_>,
) -> Result<()> {
    let s = p.shape;
    let qkv = Qkv::new(view("q", q, s.q_dims())?, view("k", k, s.kv_dims())?, view("v", v, s.kv_dims())?);
    let out = AttnOut { o: view_mut("o", o, s.q_dims())?, lse: view_mut("lse", lse.into(), s.lse_dims())? };
    backend.attention_forward(&p.options(), out, qkv)
}

/// Attention backward of `p` on host slices, through `backend` (see [`attention_forward`]): `dq`, `dk`, `dv`
/// (overwritten, or added to with [`GradMode::Accumulate`]) from `dout` and what the forward saved (`q`, `k`,
/// `v`, its output `o` and `lse`), by [`Backend::attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    backend: &dyn Backend,
    p: &AttnParams<'_>,
    dq: HostSliceMut<'_>,
    dk: HostSliceMut<'_>,
    dv: HostSliceMut<'_>,
    dout: HostSlice<'_>,
    q: HostSlice<'_>,
    k: HostSlice<'_>,
    v: HostSlice<'_>,
    o: HostSlice<'_>,
    lse: &[f32],
    mode: GradMode,
) -> Result<()> {
    let s = p.shape;
    let qkv = Qkv::new(view("q", q, s.q_dims())?, view("k", k, s.kv_dims())?, view("v", v, s.kv_dims())?);
    let saved = AttnSaved { qkv, o: view("o", o, s.q_dims())?, lse: view("lse", lse.into(), s.lse_dims())? };
    let grads = AttnGrads {
        dq: view_mut("dq", dq, s.q_dims())?,
        dk: view_mut("dk", dk, s.kv_dims())?,
        dv: view_mut("dv", dv, s.kv_dims())?,
    };
    backend.attention_backward(&p.options(), grads, view("dout", dout, s.q_dims())?, saved, mode)
}

/// Forward then backward on `f32` buffers through the CPU backend (its best SIMD path, the calling thread's
/// rayon pool): `[O, LSE, dQ, dK, dV]`. Every output is poisoned with NaN before its call, so an element the
/// kernel fails to write cannot pass a comparison.
pub fn attention_f32(p: &AttnParams<'_>, q: &[f32], k: &[f32], v: &[f32], d_o: &[f32]) -> Result<[Vec<f32>; 5]> {
    attention_f32_with(&CpuBackend::new(), p, q, k, v, d_o)
}

/// [`attention_f32`] through any backend that computes on host memory (e.g. a [`CpuBackend`] limited to one
/// SIMD path, or on a pool of its own), so one test body runs on every backend.
pub fn attention_f32_with(
    backend: &dyn Backend,
    p: &AttnParams<'_>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d_o: &[f32],
) -> Result<[Vec<f32>; 5]> {
    let s = p.shape;
    let mut o = vec![f32::NAN; s.q_elems()];
    let mut lse = vec![f32::NAN; s.lse_elems()];
    attention_forward(backend, p, (&mut o).into(), &mut lse, q.into(), k.into(), v.into())?;
    let (mut dq, mut dk, mut dv) =
        (vec![f32::NAN; s.q_elems()], vec![f32::NAN; s.kv_elems()], vec![f32::NAN; s.kv_elems()]);
    attention_backward(
        backend,
        p,
        (&mut dq).into(),
        (&mut dk).into(),
        (&mut dv).into(),
        d_o.into(),
        q.into(),
        k.into(),
        v.into(),
        (&o).into(),
        &lse,
        GradMode::Overwrite,
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
