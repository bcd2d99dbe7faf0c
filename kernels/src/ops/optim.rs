//! AdamW with decoupled weight decay, and the sum of squares behind gradient-norm clipping
//! ([`Backend::clip_grad_norm`](crate::Backend::clip_grad_norm)).
//!
//! Legend: `P` parameters (one flat buffer), `t` the 1-based step.
//!
//! ```text
//! m = β1·m + (1−β1)·g          v = β2·v + (1−β2)·g²
//! m̂ = m / (1−β1ᵗ)              v̂ = v / (1−β2ᵗ)
//! p = p − lr·(m̂ / (√v̂ + eps) + wd·p)                  (PyTorch `AdamW`, llm.c `adamw_update`)
//!
//! clip_grad_norm: ‖g‖ = sqrt(Σ_slices Σ_i g_i²)  (in f64); if ‖g‖ > max: g *= max / (‖g‖ + 1e-6)
//! ```
//!
//! The norm is summed per fixed block of elements, blocks in order, so it is the same for any thread count.

use rayon::prelude::*;

use super::{finite, ELEMS_PER_TASK};
use crate::dtype::Element;
use crate::error::{check_len, KernelError, Result};

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay β1.
    pub beta1: f32,
    /// Second-moment decay β2.
    pub beta2: f32,
    /// Added to `√v̂`.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

impl Default for AdamW {
    /// PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    fn default() -> Self {
        AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

impl AdamW {
    fn validate(&self, step: u64) -> Result<()> {
        finite("lr", self.lr as f64, false)?;
        finite("eps", self.eps as f64, true)?;
        finite("weight_decay", self.weight_decay as f64, false)?;
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(KernelError::InvalidArgument { name, why: format!("{b} is not in [0, 1)") });
            }
        }
        if step == 0 {
            return Err(KernelError::InvalidArgument { name: "step", why: "steps count from 1".into() });
        }
        Ok(())
    }
}

#[inline(always)]
fn update(p: &mut f32, g: f32, m: &mut f32, v: &mut f32, h: &AdamW, bc1: f32, bc2: f32) {
    *m = h.beta1 * *m + (1.0 - h.beta1) * g;
    *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
    let mh = *m / bc1;
    let vh = *v / bc2;
    *p -= h.lr * (mh / (vh.sqrt() + h.eps) + h.weight_decay * *p);
}

fn check(n: usize, grads: usize, m: usize, v: usize) -> Result<()> {
    check_len("grads", grads, n)?;
    check_len("m", m, n)?;
    check_len("v", v, n)
}

fn bias_corrections(h: &AdamW, step: u64) -> (f32, f32) {
    let t = step.min(i32::MAX as u64) as i32;
    ((1.0 - (h.beta1 as f64).powi(t)) as f32, (1.0 - (h.beta2 as f64).powi(t)) as f32)
}

/// One AdamW step on `f32` parameters `params[P]` with gradients `grads[P]` and moments `m[P]`, `v[P]`; `step`
/// counts from 1.
///
/// Errors: a length mismatch, `step == 0`, a beta outside `[0, 1)`, or a non-finite / non-positive eps.
pub(crate) fn adamw_step<G: Element>(
    params: &mut [f32],
    grads: &[G],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamW,
    step: u64,
) -> Result<()> {
    check(params.len(), grads.len(), m.len(), v.len())?;
    hp.validate(step)?;
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
    Ok(())
}

/// One AdamW step on an `f32` master copy `master[P]`, then writes the rounded result into the model's
/// parameters `params[P]` (e.g. `bf16`).
///
/// Errors: as [`adamw_step`], and `params` not of length `P`.
pub(crate) fn adamw_step_with_copy<P: Element, G: Element>(
    params: &mut [P],
    master: &mut [f32],
    grads: &[G],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamW,
    step: u64,
) -> Result<()> {
    check_len("params", params.len(), master.len())?;
    check(master.len(), grads.len(), m.len(), v.len())?;
    hp.validate(step)?;
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
    Ok(())
}

/// `Σ x²` in `f64`, summed in fixed pieces and then in order, so the bits do not depend on the thread count.
pub(crate) fn sum_squares<G: Element>(x: &[G]) -> f64 {
    let parts: Vec<f64> = x
        .par_chunks(ELEMS_PER_TASK)
        .map(|c| c.iter().map(|v| (v.to_f32() as f64) * (v.to_f32() as f64)).sum::<f64>())
        .collect();
    parts.iter().sum()
}
