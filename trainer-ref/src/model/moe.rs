//! The Mixtral block's load-balancing loss (Hugging Face `load_balancing_loss_func`) and the router statistics it
//! is formed from; the block itself (a router and `E` SwiGLU experts per layer, Hugging Face
//! `MixtralSparseMoeBlock`) is one of the layer's MLPs (`layer`).
//!
//! The auxiliary loss is Hugging Face's over the global batch and every layer at once: with `N` the (layer,
//! token) pairs of the whole batch, `f_e = tokens routed to e / N` (over the top-k assignments, so `Σ f = K`)
//! and `P_e = Σ p[·,e] / N`, `aux = E · Σ_e f_e·P_e`, and the training loss adds `aux_loss_coef · aux`. The
//! counts are not differentiable, so its gradient with respect to each router probability is the constant
//! `coef · E · f_e / N` ([`MoeStats::prob_grad`]): the backward needs the global statistics, which the trainer
//! sums over every rank (context- and data-parallel) after the forward and before any backward, so every layout
//! of the same batch gives the same loss and gradients.

use longctx_kernels::RouterOutput;

/// Router statistics over some tokens and layers: per expert, the tokens routed to it and the sum of its
/// probabilities, and how many (layer, token) pairs they cover.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MoeStats {
    /// `[E]`: top-k assignments to each expert.
    pub counts: Vec<f64>,
    /// `[E]`: `Σ p[·,e]`.
    pub prob_sum: Vec<f64>,
    /// (layer, token) pairs.
    pub tokens: f64,
}

impl MoeStats {
    /// No tokens yet, over `experts`.
    pub fn zeros(experts: usize) -> Self {
        MoeStats { counts: vec![0.0; experts], prob_sum: vec![0.0; experts], tokens: 0.0 }
    }
    /// One router call's.
    pub fn of(r: &RouterOutput) -> Self {
        let counts = r.routing.counts().into_iter().map(|c| c as f64).collect();
        MoeStats { counts, prob_sum: r.prob_sum.clone(), tokens: r.routing.tokens() as f64 }
    }
    /// Experts `E`.
    pub fn experts(&self) -> usize {
        self.counts.len()
    }
    /// Adds `other`'s tokens.
    pub fn merge(&mut self, other: &MoeStats) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        for (a, b) in self.prob_sum.iter_mut().zip(&other.prob_sum) {
            *a += b;
        }
        self.tokens += other.tokens;
    }
    /// `[counts, prob_sum, tokens]` as one vector (`2E + 1`), to all-reduce.
    pub fn to_flat(&self) -> Vec<f64> {
        let mut v = self.counts.clone();
        v.extend(&self.prob_sum);
        v.push(self.tokens);
        v
    }
    /// The inverse of [`MoeStats::to_flat`].
    pub fn from_flat(v: &[f64]) -> Self {
        let e = v.len().saturating_sub(1) / 2;
        MoeStats {
            counts: v[..e].to_vec(),
            prob_sum: v[e..2 * e].to_vec(),
            tokens: v.get(2 * e).copied().unwrap_or(0.0),
        }
    }
    /// `E · Σ_e f_e·P_e` (before the coefficient).
    pub fn aux_loss(&self) -> f64 {
        let n = self.tokens.max(1.0);
        let e = self.experts() as f64;
        e * self.counts.iter().zip(&self.prob_sum).map(|(c, p)| (c / n) * (p / n)).sum::<f64>()
    }
    /// `∂(coef · aux)/∂p[t,e] = coef · E · f_e / N`, the same for every (layer, token).
    pub fn prob_grad(&self, coef: f64) -> Vec<f32> {
        let n = self.tokens.max(1.0);
        let e = self.experts() as f64;
        self.counts.iter().map(|c| (coef * e * (c / n) / n) as f32).collect()
    }
}
