//! The Mixtral block: a router and `E` SwiGLU experts per layer (Hugging Face `MixtralSparseMoeBlock`), and its
//! load-balancing loss (Hugging Face `load_balancing_loss_func`).
//!
//! ```text
//! logits[L,E] = h2·Wgateᵀ          probs = softmax(logits)       each token's top K, weights renormalised
//! xe[N,C]     = h2 rows dispatched to their experts (grouped by expert, no capacity: every token reaches K)
//! per expert  ye_e = (silu(xe_e·W1ᵀ) ∘ xe_e·W3ᵀ)·W2ᵀ
//! out[L,C]    = x2 + Σ_j w[t,j]·ye[row(t,j)]   (summed in ascending expert order)
//! ```
//!
//! The auxiliary loss is Hugging Face's over the global batch and every layer at once: with `N` the (layer,
//! token) pairs of the whole batch, `f_e = tokens routed to e / N` (over the top-k assignments, so `Σ f = K`)
//! and `P_e = Σ p[·,e] / N`, `aux = E · Σ_e f_e·P_e`, and the training loss adds `aux_loss_coef · aux`. The
//! counts are not differentiable, so its gradient with respect to each router probability is the constant
//! `coef · E · f_e / N` ([`MoeStats::prob_grad`]): the backward needs the global statistics, which the trainer
//! sums over every rank (context- and data-parallel) after the forward and before any backward, so every layout
//! of the same batch gives the same loss and gradients.

use longctx_kernels::{Buffer, GradMode, MoeCombineSaved, MoeRouterSaved, RouterOutput, Routing, SwigluSaved};

use super::layout::ExpertIx;
use super::{lg, missing, saved_x, LayerSaved, Model, Params};
use crate::error::Result;

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

impl Model {
    /// `probs, topk_w` and the routing of `h2` through the router `Wgate`.
    pub(super) fn router(&self, router: usize, h2: &Buffer) -> Result<(Buffer, Buffer, RouterOutput)> {
        let b = &*self.backend;
        let (l, e, k) = (h2.dims()[0], self.t(router).dims()[0], self.top_k());
        let mut logits = self.buf([l, e])?;
        b.linear_forward(logits.view_mut(), h2.view(), self.t(router).view(), None)?;
        let (mut probs, mut w) = (self.buf_f32([l, e])?, self.buf_f32([l, k])?);
        let out = b.moe_router_forward(probs.view_mut(), w.view_mut(), logits.view(), k)?;
        Ok((probs, w, out))
    }

    fn top_k(&self) -> usize {
        self.cfg.experts().map_or(1, |m| m.top_k)
    }

    /// The dispatched rows of `h2` `[N, C]`, grouped by expert.
    fn dispatch(&self, h2: &Buffer, routing: &Routing) -> Result<Buffer> {
        let mut xe = self.buf([routing.rows(), self.cfg.d_model])?;
        self.backend.moe_gather_forward(xe.view_mut(), h2.view(), routing)?;
        Ok(xe)
    }

    /// Each expert's `gate = xe_e·W1ᵀ` and `up = xe_e·W3ᵀ` over its rows, `[N, F]` each.
    pub(super) fn experts_gate_up(&self, experts: &[ExpertIx], h2: &Buffer, r: &Routing) -> Result<(Buffer, Buffer)> {
        let b = &*self.backend;
        let xe = self.dispatch(h2, r)?;
        let (n, f) = (r.rows(), self.cfg.ffn);
        let (mut gate, mut up) = (self.buf([n, f])?, self.buf([n, f])?);
        for (e, ex) in experts.iter().enumerate() {
            let (at, rows) = (r.offsets()[e], r.offsets()[e + 1] - r.offsets()[e]);
            if rows == 0 {
                continue;
            }
            let x = xe.view().rows(at, rows)?;
            b.linear_forward(gate.view_mut().rows(at, rows)?, x, self.t(ex.w1).view(), None)?;
            b.linear_forward(up.view_mut().rows(at, rows)?, x, self.t(ex.w3).view(), None)?;
        }
        Ok((gate, up))
    }

    /// Each expert's output `ye_e = act_e·W2ᵀ`, `[N, C]`.
    pub(super) fn experts_down(&self, experts: &[ExpertIx], act: &Buffer, r: &Routing) -> Result<Buffer> {
        let mut ye = self.buf([r.rows(), self.cfg.d_model])?;
        for (e, ex) in experts.iter().enumerate() {
            let (at, rows) = (r.offsets()[e], r.offsets()[e + 1] - r.offsets()[e]);
            if rows == 0 {
                continue;
            }
            let a = act.view().rows(at, rows)?;
            self.backend.linear_forward(ye.view_mut().rows(at, rows)?, a, self.t(ex.w2).view(), None)?;
        }
        Ok(ye)
    }

    /// The layer's output `x2 + Σ_j w[t,j]·ye[row(t,j)]`.
    pub(super) fn combine(&self, ye: &Buffer, w: &Buffer, r: &Routing, x2: &Buffer) -> Result<Buffer> {
        let b = &*self.backend;
        let mut out = self.buf(x2.dims())?;
        // As in `o_proj`: the combined experts into the output, the residual added to it.
        b.moe_combine_forward(out.view_mut(), ye.view(), w.view(), r)?;
        b.add(out.view_mut(), x2.view())?;
        Ok(out)
    }

    /// The block's backward, the forward reversed: `dh2` (overwritten) from `dout`; the router's and experts'
    /// weight gradients per `mode` (an expert no token reached gets zeros under [`GradMode::Overwrite`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_backward(
        &self,
        layer: usize,
        (router, experts): (usize, &[ExpertIx]),
        dh2: &mut Buffer,
        dout: &Buffer,
        s: &LayerSaved,
        (grads, mode): (&mut Params, GradMode),
        moe_aux: Option<&[f32]>,
    ) -> Result<()> {
        let b = &*self.backend;
        let r = s.routing.as_ref().ok_or_else(|| missing(layer, "routing"))?;
        let probs = s.router_probs.as_ref().ok_or_else(|| missing(layer, "router_probs"))?;
        let topk_w = s.topk_w.as_ref().ok_or_else(|| missing(layer, "topk_w"))?;
        let gate = s.gate.as_ref().ok_or_else(|| missing(layer, "gate"))?;
        let ye = s.ye.as_ref().ok_or_else(|| missing(layer, "ye"))?;
        let (l, c, f, n, e) = (r.tokens(), self.cfg.d_model, self.cfg.ffn, r.rows(), r.experts());
        let (mut dye, mut dtopk_w) = (self.buf([n, c])?, self.buf_f32([l, r.top_k()])?);
        let (mut dact, mut dgate, mut dup) = (self.buf([n, f])?, self.buf([n, f])?, self.buf([n, f])?);
        let (mut dxe, mut dxe_up, mut dlogits, mut dh2_router) =
            (self.buf([n, c])?, self.buf([n, c])?, self.buf([l, e])?, self.buf([l, c])?);
        let rows = |e: usize| (r.offsets()[e], r.offsets()[e + 1] - r.offsets()[e]);
        let unreached = |grads: &mut Params, i: usize| -> Result<()> {
            if mode == GradMode::Overwrite {
                b.scale(grads.tensors[i].view_mut(), 0.0)?;
            }
            Ok(())
        };

        b.moe_combine_backward(
            dye.view_mut(),
            dtopk_w.view_mut(),
            dout.view(),
            MoeCombineSaved { ye: ye.view(), weights: topk_w.view(), routing: r },
        )?;
        for (ei, ex) in experts.iter().enumerate() {
            let (at, m) = rows(ei);
            if m == 0 {
                unreached(grads, ex.w2)?;
                continue;
            }
            let g = lg(Some(dact.view_mut().rows(at, m)?), grads.tensors[ex.w2].view_mut());
            let x = longctx_kernels::LinearSaved { x: s.act.view().rows(at, m)? };
            b.linear_backward(g, dye.view().rows(at, m)?, x, self.t(ex.w2).view(), mode)?;
        }
        b.swiglu_backward(
            dgate.view_mut(),
            dup.view_mut(),
            dact.view(),
            SwigluSaved { gate: gate.view(), up: s.up.view() },
        )?;
        let xe = self.dispatch(&s.h2, r)?;
        for (ei, ex) in experts.iter().enumerate() {
            let (at, m) = rows(ei);
            if m == 0 {
                unreached(grads, ex.w1)?;
                unreached(grads, ex.w3)?;
                continue;
            }
            let x = longctx_kernels::LinearSaved { x: xe.view().rows(at, m)? };
            let g1 = lg(Some(dxe.view_mut().rows(at, m)?), grads.tensors[ex.w1].view_mut());
            b.linear_backward(g1, dgate.view().rows(at, m)?, x, self.t(ex.w1).view(), mode)?;
            let g3 = lg(Some(dxe_up.view_mut().rows(at, m)?), grads.tensors[ex.w3].view_mut());
            b.linear_backward(g3, dup.view().rows(at, m)?, x, self.t(ex.w3).view(), mode)?;
        }
        b.add(dxe.view_mut(), dxe_up.view())?;
        b.moe_gather_backward(dh2.view_mut(), dxe.view(), r)?;
        let aux = match moe_aux {
            Some(a) => Some(longctx_kernels::View::new(a, [a.len()])?),
            None => None,
        };
        b.moe_router_backward(
            dlogits.view_mut(),
            dtopk_w.view(),
            aux,
            MoeRouterSaved { probs: probs.view(), weights: topk_w.view(), routing: r },
        )?;
        let g = lg(Some(dh2_router.view_mut()), grads.tensors[router].view_mut());
        b.linear_backward(g, dlogits.view(), saved_x(&s.h2), self.t(router).view(), mode)?;
        b.add(dh2.view_mut(), dh2_router.view())?;
        Ok(())
    }
}
