//! The optimizer: the learning-rate schedule and AdamW on every tensor of a rank's replica.

use longctx_kernels::{AdamW, AdamwState};

use super::rank::Rank;
use crate::error::Result;
use crate::recipe::Recipe;

/// Linear warm-up to `train.lr` over `train.warmup` steps, then cosine decay to `train.min_lr` at the last step.
pub fn lr_at(recipe: &Recipe, step: u64) -> f32 {
    let t = &recipe.train;
    if step < t.warmup {
        return t.lr * (step + 1) as f32 / t.warmup as f32;
    }
    let span = t.steps.saturating_sub(t.warmup).max(1) as f64;
    let progress = ((step - t.warmup) as f64 / span).min(1.0);
    let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    (t.min_lr as f64 + (t.lr - t.min_lr) as f64 * cos) as f32
}

impl Rank<'_> {
    /// One AdamW step at `lr` on every tensor, from the gradients in `self.grads`; matrices and embeddings decay,
    /// norm weights do not. A `bf16` model's master weights take the step and the model's are rounded from them.
    pub(super) fn adamw(&mut self, lr: f32) -> Result<()> {
        let t = &self.recipe.train;
        let b = self.model.backend().clone();
        let step = self.step + 1;
        for i in 0..self.grads.tensors.len() {
            let decay = if self.grads.tensors[i].dims().len() > 1 { t.weight_decay } else { 0.0 };
            let hp = AdamW { lr, beta1: t.beta1, beta2: t.beta2, eps: t.eps, weight_decay: decay };
            let state = AdamwState { m: self.m.tensors[i].view_mut(), v: self.v.tensors[i].view_mut() };
            let g = self.grads.tensors[i].view();
            match self.master.as_mut() {
                None => b.adamw_step(self.model.weights.tensors[i].view_mut(), None, g, state, &hp, step)?,
                Some(master) => b.adamw_step(
                    master.tensors[i].view_mut(),
                    Some(self.model.weights.tensors[i].view_mut()),
                    g,
                    state,
                    &hp,
                    step,
                )?,
            }
        }
        Ok(())
    }
}
