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

use crate::checks::finite;
use crate::error::{KernelError, Result};

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
    pub(crate) fn validate(&self, step: u64) -> Result<()> {
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
