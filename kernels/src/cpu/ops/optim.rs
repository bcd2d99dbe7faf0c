//! The CPU backend's AdamW step and sum of squares ([`AdamW`]'s formulas).

use rayon::prelude::*;

use super::ELEMS_PER_TASK;
use crate::dtype::Element;
use crate::ops::AdamW;

#[inline(always)]
fn update(p: &mut f32, g: f32, m: &mut f32, v: &mut f32, h: &AdamW, bc1: f32, bc2: f32) {
    *m = h.beta1 * *m + (1.0 - h.beta1) * g;
    *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
    let mh = *m / bc1;
    let vh = *v / bc2;
    *p -= h.lr * (mh / (vh.sqrt() + h.eps) + h.weight_decay * *p);
}

fn bias_corrections(h: &AdamW, step: u64) -> (f32, f32) {
    let t = step.min(i32::MAX as u64) as i32;
    ((1.0 - (h.beta1 as f64).powi(t)) as f32, (1.0 - (h.beta2 as f64).powi(t)) as f32)
}

/// One AdamW step on `f32` parameters `params[P]` with gradients `grads[P]` and moments `m[P]`, `v[P]`; `step`
/// counts from 1.
pub(crate) fn adamw_step<G: Element>(
    params: &mut [f32],
    grads: &[G],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamW,
    step: u64,
) {
    let (bc1, bc2) = bias_corrections(hp, step);
    params
        .par_chunks_mut(ELEMS_PER_TASK)
        .zip(grads.par_chunks(ELEMS_PER_TASK))
        .zip(m.par_chunks_mut(ELEMS_PER_TASK).zip(v.par_chunks_mut(ELEMS_PER_TASK)))
        .for_each(|((p, g), (m, v))| {
            for i in 0..p.len() {
                update(&mut p[i], g[i].to_f32(), &mut m[i], &mut v[i], hp, bc1, bc2);
            }
        });
}

/// One AdamW step on an `f32` master copy `master[P]`, then writes the rounded result into the model's
/// parameters `params[P]` (e.g. `bf16`).
pub(crate) fn adamw_step_with_copy<P: Element, G: Element>(
    params: &mut [P],
    master: &mut [f32],
    grads: &[G],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamW,
    step: u64,
) {
    let (bc1, bc2) = bias_corrections(hp, step);
    params
        .par_chunks_mut(ELEMS_PER_TASK)
        .zip(master.par_chunks_mut(ELEMS_PER_TASK))
        .zip(grads.par_chunks(ELEMS_PER_TASK))
        .zip(m.par_chunks_mut(ELEMS_PER_TASK).zip(v.par_chunks_mut(ELEMS_PER_TASK)))
        .for_each(|(((q, p), g), (m, v))| {
            for i in 0..p.len() {
                update(&mut p[i], g[i].to_f32(), &mut m[i], &mut v[i], hp, bc1, bc2);
                q[i] = P::from_f32(p[i]);
            }
        });
}

/// `Σ x²` in `f64`, summed in fixed pieces and then in order, so the bits do not depend on the thread count.
pub(crate) fn sum_squares<G: Element>(x: &[G]) -> f64 {
    let parts: Vec<f64> = x
        .par_chunks(ELEMS_PER_TASK)
        .map(|c| c.iter().map(|v| (v.to_f32() as f64) * (v.to_f32() as f64)).sum::<f64>())
        .collect();
    parts.iter().sum()
}
