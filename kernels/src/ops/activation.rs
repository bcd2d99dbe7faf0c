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

use rayon::prelude::*;

use super::ELEMS_PER_TASK;
use crate::dtype::Element;
use crate::error::{check_len, Result};

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SwiGLU forward: `out[N] = silu(gate[N]) · up[N]`.
///
/// Errors: the three lengths differ.
pub(crate) fn swiglu_forward<T: Element>(out: &mut [T], gate: &[T], up: &[T]) -> Result<()> {
    check_len("up", up.len(), gate.len())?;
    check_len("out", out.len(), gate.len())?;
    out.par_chunks_mut(ELEMS_PER_TASK)
        .zip(gate.par_chunks(ELEMS_PER_TASK))
        .zip(up.par_chunks(ELEMS_PER_TASK))
        .for_each(|((o, g), u)| {
            for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
                let g = g.to_f32();
                *o = T::from_f32(g * sigmoid(g) * u.to_f32());
            }
        });
    Ok(())
}

/// SwiGLU backward: `d_gate[N]`, `d_up[N]` (overwritten) from `dout[N]` and the forward inputs.
///
/// Errors: the lengths differ.
pub(crate) fn swiglu_backward<T: Element>(
    d_gate: &mut [T],
    d_up: &mut [T],
    dout: &[T],
    gate: &[T],
    up: &[T],
) -> Result<()> {
    let n = gate.len();
    check_len("up", up.len(), n)?;
    check_len("dout", dout.len(), n)?;
    check_len("d_gate", d_gate.len(), n)?;
    check_len("d_up", d_up.len(), n)?;
    d_gate
        .par_chunks_mut(ELEMS_PER_TASK)
        .zip(d_up.par_chunks_mut(ELEMS_PER_TASK))
        .zip(dout.par_chunks(ELEMS_PER_TASK))
        .zip(gate.par_chunks(ELEMS_PER_TASK).zip(up.par_chunks(ELEMS_PER_TASK)))
        .for_each(|(((dg, du), d), (g, u))| {
            for i in 0..g.len() {
                let (gi, ui, di) = (g[i].to_f32(), u[i].to_f32(), d[i].to_f32());
                let s = sigmoid(gi);
                let silu = gi * s;
                dg[i] = T::from_f32(di * ui * s * (1.0 + gi * (1.0 - s)));
                du[i] = T::from_f32(di * silu);
            }
        });
    Ok(())
}

/// Squared ReLU forward: `out[N] = max(x, 0)²`.
///
/// Errors: the lengths differ.
pub(crate) fn squared_relu_forward<T: Element>(out: &mut [T], x: &[T]) -> Result<()> {
    check_len("out", out.len(), x.len())?;
    out.par_chunks_mut(ELEMS_PER_TASK).zip(x.par_chunks(ELEMS_PER_TASK)).for_each(|(o, x)| {
        for (o, x) in o.iter_mut().zip(x) {
            let r = x.to_f32().max(0.0);
            *o = T::from_f32(r * r);
        }
    });
    Ok(())
}

/// Squared ReLU backward: `dx[N] = dout · 2·max(x, 0)` (overwritten).
///
/// Errors: the lengths differ.
pub(crate) fn squared_relu_backward<T: Element>(dx: &mut [T], dout: &[T], x: &[T]) -> Result<()> {
    check_len("dout", dout.len(), x.len())?;
    check_len("dx", dx.len(), x.len())?;
    dx.par_chunks_mut(ELEMS_PER_TASK).zip(dout.par_chunks(ELEMS_PER_TASK)).zip(x.par_chunks(ELEMS_PER_TASK)).for_each(
        |((dx, d), x)| {
            for ((dx, d), x) in dx.iter_mut().zip(d).zip(x) {
                *dx = T::from_f32(d.to_f32() * 2.0 * x.to_f32().max(0.0));
            }
        },
    );
    Ok(())
}
