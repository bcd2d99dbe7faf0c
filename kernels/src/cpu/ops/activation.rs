//! Element-wise MLP activations: SwiGLU and squared ReLU.
//!
//! Legend: `N` elements (any shape, e.g. `T·F` for `T` tokens and `F` hidden features).
//!
//! ```text
//! swiglu:        out = silu(gate) · up,      silu(g) = g·σ(g)
//!   backward:    d_gate = dout · up · σ(g)·(1 + g·(1−σ(g))),   d_up = dout · silu(g)
//! squared_relu:  out = max(x, 0)²
//!   backward:    dx = dout · 2·max(x, 0)
//! ```
//!
//! Element-wise, so trivially deterministic; parallel in fixed blocks of `ELEMS_PER_TASK`.
//!
//! `σ` goes through [`exp`], a polynomial the compiler vectorises, rather than the C library's `expf` (one call
//! per element, 2–3% of a training step's time at 4K tokens). Each block's loop is compiled twice, for the
//! baseline instruction set and for AVX2 (8 lanes instead of 4), and picked by the backend's [`SimdPath`]; both
//! compute the same operations in the same order without fused multiply-adds, so they agree bit for bit.

use rayon::prelude::*;

use super::ELEMS_PER_TASK;
use crate::cpu::SimdPath;
use crate::dtype::Element;

/// `e^x` within 1 ulp of the exact value for `x` in `[-87.33, 88]` (Cephes `expf`: `x = n·ln 2 + r` with `ln 2`
/// in two parts, a degree-6 polynomial in `r`, `2^n` built in the exponent bits), 0 below (where `expf` gives a
/// subnormal), +inf above (where it gives 1.7e38 to 3.4e38, then +inf), NaN for NaN. Branch-free, so that
/// loops over it vectorise.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5·2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    const HI: f32 = 88.0; // n stays at most 127, so that 2^n is a normal number
    const LO: f32 = -87.336_55; // ln(2^-126): n stays at least -126
    let xc = x.clamp(LO, HI);
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes 5.0000001201e-1, which rounds to 0.5 in f32
    let er = p * r * r + r + 1.0;
    let y = er * f32::from_bits(((n as i32 + 127) as u32) << 23);
    let y = if x > HI { f32::INFINITY } else { y };
    if x < LO {
        0.0
    } else {
        y
    }
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// Runs `f` compiled for AVX2 when `simd` allows it, else for the baseline (see the module docs).
#[inline(always)]
fn on_path(simd: SimdPath, f: impl FnOnce()) {
    #[cfg(target_arch = "x86_64")]
    if simd.clamp_supported() >= SimdPath::Avx2 {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(f: impl FnOnce()) {
            f()
        }
        // SAFETY: `clamp_supported` returned a path this CPU has, and every path from AVX2 up includes AVX2 and
        // FMA.
        return unsafe { avx2(f) };
    }
    let _ = simd;
    f()
}

/// SwiGLU forward: `out[N] = silu(gate[N]) · up[N]`.
pub(crate) fn swiglu_forward<T: Element>(simd: SimdPath, out: &mut [T], gate: &[T], up: &[T]) {
    out.par_chunks_mut(ELEMS_PER_TASK)
        .zip(gate.par_chunks(ELEMS_PER_TASK))
        .zip(up.par_chunks(ELEMS_PER_TASK))
        .for_each(|((o, g), u)| {
            on_path(simd, || {
                for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
                    let g = g.to_f32();
                    *o = T::from_f32(g * sigmoid(g) * u.to_f32());
                }
            })
        });
}

/// SwiGLU backward: `d_gate[N]`, `d_up[N]` (overwritten) from `dout[N]` and the forward inputs.
pub(crate) fn swiglu_backward<T: Element>(
    simd: SimdPath,
    d_gate: &mut [T],
    d_up: &mut [T],
    dout: &[T],
    gate: &[T],
    up: &[T],
) {
    d_gate
        .par_chunks_mut(ELEMS_PER_TASK)
        .zip(d_up.par_chunks_mut(ELEMS_PER_TASK))
        .zip(dout.par_chunks(ELEMS_PER_TASK))
        .zip(gate.par_chunks(ELEMS_PER_TASK).zip(up.par_chunks(ELEMS_PER_TASK)))
        .for_each(|(((dg, du), d), (g, u))| {
            on_path(simd, || {
                for i in 0..g.len() {
                    let (gi, ui, di) = (g[i].to_f32(), u[i].to_f32(), d[i].to_f32());
                    let s = sigmoid(gi);
                    let silu = gi * s;
                    dg[i] = T::from_f32(di * ui * s * (1.0 + gi * (1.0 - s)));
                    du[i] = T::from_f32(di * silu);
                }
            })
        });
}

/// Squared ReLU forward: `out[N] = max(x, 0)²`.
pub(crate) fn squared_relu_forward<T: Element>(out: &mut [T], x: &[T]) {
    out.par_chunks_mut(ELEMS_PER_TASK).zip(x.par_chunks(ELEMS_PER_TASK)).for_each(|(o, x)| {
        for (o, x) in o.iter_mut().zip(x) {
            let r = x.to_f32().max(0.0);
            *o = T::from_f32(r * r);
        }
    });
}

/// Squared ReLU backward: `dx[N] = dout · 2·max(x, 0)` (overwritten).
pub(crate) fn squared_relu_backward<T: Element>(dx: &mut [T], dout: &[T], x: &[T]) {
    dx.par_chunks_mut(ELEMS_PER_TASK).zip(dout.par_chunks(ELEMS_PER_TASK)).zip(x.par_chunks(ELEMS_PER_TASK)).for_each(
        |((dx, d), x)| {
            for ((dx, d), x) in dx.iter_mut().zip(d).zip(x) {
                *dx = T::from_f32(d.to_f32() * 2.0 * x.to_f32().max(0.0));
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::exp;

    #[test]
    fn exp_is_within_one_ulp_over_its_range_and_saturates_outside_it() {
        // Error in units of the f32 spacing at the exact value.
        let ulps = |x: f32| {
            let e = (x as f64).exp();
            let spacing = (e as f32).next_up() as f64 - e as f32 as f64;
            ((exp(x) as f64 - e) / spacing).abs()
        };
        let grid = (0..=1_000_000).map(|i| -87.33 + (88.0 + 87.33) * i as f32 / 1e6);
        let special = [0.0f32, -0.0, 1e-30, -1e-30, 1e-7, 0.5, -0.5, 1.0, 10.0, -10.0];
        let worst = grid.chain(special).map(ulps).fold(0.0, f64::max);
        assert!(worst <= 1.0, "{worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-87.4), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(88.1), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }
}
