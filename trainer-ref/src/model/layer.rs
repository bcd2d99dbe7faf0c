//! One decoder layer, forward and backward, in the manner of llm.c's `train_gpt2.c`: each forward helper is one
//! recompute segment (named as [`SegmentId`] names it) that reads its inputs from the layer's [`LayerSaved`] and
//! saves its outputs there, and has a `_backward` twin that takes what it last uses out of the store, so each
//! saved tensor is freed after its last use. The layer's backward is its forward read in reverse, one helper per
//! line; a replay before the backward reruns the same helpers ([`Ops::segment_forward`]).
//!
//! ```text
//! attention block   h1 = norm(x)   q,k,v = rope(h1·Wq,k,vᵀ)   o = attn(q,k,v)   x2 = x + o·Woᵀ
//! dense MLP         h2 = norm(x2)  act = silu(h2·Wgᵀ) ∘ h2·Wuᵀ (Nemotron: relu(h2·Wuᵀ)²)   out = x2 + act·Wdᵀ
//! experts (Mixtral) probs = softmax(h2·Wrᵀ), each token's top K with weights w renormalised;
//!                   per expert e over its rows of h2: ye_e = (silu(xe_e·W1ᵀ) ∘ xe_e·W3ᵀ)·W2ᵀ;
//!                   out = x2 + Σ_j w[t,j]·ye[row(t,j)]   (summed in ascending expert order)
//! ```
//!
//! Shapes: `L` tokens on this rank, `C` the model width, `Hq`/`Hkv` query and KV heads of width `D`, `F` the MLP
//! width (of one expert), `E` experts, `K` experts per token, `N = L·K` rows dispatched to experts. Activations
//! are `[L, C]` token-major; attention works head-major `[1, H, L, D]`.

use longctx_kernels::{
    AttnGrads, AttnOut, AttnSaved, Backend, Buffer, DType, GradMode, IntoDims, LayerNormSaved, LinearGrads,
    LinearSaved, MoeCombineSaved, MoeRouterSaved, NormGrads, NormParams, Qkv, RmsNormSaved, RopeTable, Routing,
    SquaredReluSaved, SwigluSaved, View, ViewMut,
};
use longctx_ring_attn::CpPlan;

use super::layout::{ExpertIx, LayerIx, Layout, MlpIx, NormIx};
use super::moe::MoeStats;
use super::params::Params;
use super::saved::{LayerSaved, SavedId, SegmentId};
use crate::error::{Result, TrainError};
use crate::recipe::ModelConfig;

/// What a layer's ops compute with: the backend, the shapes, the weights and where each sits in them.
pub(crate) struct Ops<'m> {
    pub backend: &'m dyn Backend,
    pub cfg: &'m ModelConfig,
    pub weights: &'m Params,
    pub ix: &'m Layout,
    pub rope: &'m RopeTable,
    /// The working dtype of weights and activations.
    pub dtype: DType,
    /// `[C]` ones in the working dtype: the `+ 1` of zero-centred LayerNorm weights (Nemotron).
    pub ones: Option<&'m Buffer>,
}

/// Where the weight gradients go, and whether they overwrite or add to what is there.
pub(crate) struct WeightGrads<'g> {
    pub params: &'g mut Params,
    pub mode: GradMode,
}

impl WeightGrads<'_> {
    /// The gradient of weight `i`.
    fn of(&mut self, i: usize) -> ViewMut<'_> {
        self.params.tensors[i].view_mut()
    }
}

/// A norm's three outputs: LayerNorm's mean (`None` for RMSNorm), `1/rms` or `1/std`, and the normalised rows.
pub(crate) type NormOut = (Option<Buffer>, Buffer, Buffer);

impl Ops<'_> {
    fn t(&self, i: usize) -> &Buffer {
        &self.weights.tensors[i]
    }

    fn at(&self, s: &LayerSaved) -> &LayerIx {
        &self.ix.layers[s.layer()]
    }

    /// An output buffer of the working dtype: every one is written whole by the op it is passed to, so none is
    /// cleared first ([`Backend::empty`]).
    pub fn buf(&self, dims: impl IntoDims) -> Result<Buffer> {
        Ok(self.backend.empty(self.dtype, dims.into_dims()?)?)
    }

    /// An `f32` output buffer (see [`Ops::buf`]).
    pub fn buf_f32(&self, dims: impl IntoDims) -> Result<Buffer> {
        Ok(self.backend.empty(DType::F32, dims.into_dims()?)?)
    }

    /// One decoder layer: attention block then MLP block, each `x + f(norm(x))`, one segment per line. Returns
    /// the layer's output, what it saved, and its routing statistics (Mixtral).
    pub fn layer_forward(
        &self,
        layer: usize,
        x: Buffer,
        plan: &mut CpPlan,
        pos: &[i64],
    ) -> Result<(Buffer, LayerSaved, Option<MoeStats>)> {
        let mut s = LayerSaved::new(layer, x);
        self.attn_norm(&mut s)?;
        self.qkv_proj(&mut s, pos)?;
        self.core_attn(&mut s, plan)?;
        self.o_proj(&mut s)?;
        self.mlp_norm(&mut s)?;
        let (out, stats) = match &self.ix.layers[layer].mlp {
            MlpIx::SwiGlu { gate, up, down } => {
                self.gate_up(*gate, *up, &mut s)?;
                self.swiglu(&mut s)?;
                (self.down_proj(*down, &s)?, None)
            }
            MlpIx::SquaredRelu { up, down } => {
                self.up_proj(*up, &mut s)?;
                self.squared_relu(&mut s)?;
                (self.down_proj(*down, &s)?, None)
            }
            MlpIx::Moe { router, experts } => {
                let stats = self.router(*router, &mut s)?;
                self.experts_gate_up(experts, &mut s)?;
                self.swiglu(&mut s)?;
                self.experts_down(experts, &mut s)?;
                (self.combine(&s)?, Some(stats))
            }
        };
        Ok((out, s, stats))
    }

    /// The forward helper of `segment` (the dense or the experts' one, as the layer has), on what `s` holds;
    /// returns the layer's output from the segment that makes it (`down_proj` of a dense MLP, `combine`).
    pub fn segment_forward(
        &self,
        segment: SegmentId,
        s: &mut LayerSaved,
        plan: &mut CpPlan,
        pos: &[i64],
    ) -> Result<Option<Buffer>> {
        let ix = &self.ix.layers[s.layer()];
        match (segment, &ix.mlp) {
            (SegmentId::AttnNorm, _) => self.attn_norm(s)?,
            (SegmentId::QkvProj, _) => self.qkv_proj(s, pos)?,
            (SegmentId::CoreAttn, _) => self.core_attn(s, plan)?,
            (SegmentId::OProj, _) => self.o_proj(s)?,
            (SegmentId::MlpNorm, _) => self.mlp_norm(s)?,
            // The statistics are the forward's; a replay makes the same ones.
            (SegmentId::Router, MlpIx::Moe { router, .. }) => {
                self.router(*router, s)?;
            }
            (SegmentId::GateUp, MlpIx::SwiGlu { gate, up, .. }) => self.gate_up(*gate, *up, s)?,
            (SegmentId::GateUp, MlpIx::Moe { experts, .. }) => self.experts_gate_up(experts, s)?,
            (SegmentId::UpProj, MlpIx::SquaredRelu { up, .. }) => self.up_proj(*up, s)?,
            (SegmentId::Swiglu, MlpIx::SwiGlu { .. } | MlpIx::Moe { .. }) => self.swiglu(s)?,
            (SegmentId::SquaredRelu, MlpIx::SquaredRelu { .. }) => self.squared_relu(s)?,
            (SegmentId::DownProj, MlpIx::SwiGlu { down, .. } | MlpIx::SquaredRelu { down, .. }) => {
                return Ok(Some(self.down_proj(*down, s)?))
            }
            (SegmentId::DownProj, MlpIx::Moe { experts, .. }) => self.experts_down(experts, s)?,
            (SegmentId::Combine, MlpIx::Moe { .. }) => return Ok(Some(self.combine(s)?)),
            (segment, _) => {
                return Err(TrainError::Internal(format!(
                    "layer {}: its family's layer has no segment `{}`",
                    s.layer(),
                    segment.name()
                )))
            }
        }
        Ok(None)
    }

    /// The layer's backward: `dout` `[L, C]` in, the input's gradient out; weight gradients into `grads`;
    /// `moe_aux` is the load-balancing loss's gradient per router probability (Mixtral).
    ///
    /// It owns the layer's saved tensors and each helper frees what it used last, and allocates each gradient
    /// where it is first written: the peak of a step is inside the first layer's backward, with every layer's
    /// tensors resident, and the MLP's saved tensors (more than half of a layer's) held through the attention
    /// block's backward were the larger part of what it adds to them.
    pub fn layer_backward(
        &self,
        dout: Buffer,
        mut s: LayerSaved,
        grads: &mut WeightGrads<'_>,
        plan: &mut CpPlan,
        pos: &[i64],
        moe_aux: Option<&[f32]>,
    ) -> Result<Buffer> {
        let b = self.backend;
        let ix = &self.ix.layers[s.layer()];
        // MLP block, reversed.
        let dh2 = match &ix.mlp {
            MlpIx::SwiGlu { gate, up, down } => {
                let dact = self.down_proj_backward(*down, &dout, &mut s, grads)?;
                let (dgate, dup) = self.swiglu_backward(dact, &mut s)?;
                self.gate_up_backward(*gate, *up, dgate, dup, &mut s, grads)?
            }
            MlpIx::SquaredRelu { up, down } => {
                let dact = self.down_proj_backward(*down, &dout, &mut s, grads)?;
                let dup = self.squared_relu_backward(dact, &mut s)?;
                self.up_proj_backward(*up, dup, &mut s, grads)?
            }
            MlpIx::Moe { router, experts } => {
                let (dye, dtopk_w) = self.combine_backward(&dout, &mut s)?;
                let dact = self.experts_down_backward(experts, dye, &mut s, grads)?;
                let (dgate, dup) = self.swiglu_backward(dact, &mut s)?;
                let mut dh2 = self.experts_gate_up_backward(experts, dgate, dup, &mut s, grads)?;
                self.router_backward(*router, &mut dh2, dtopk_w, &mut s, grads, moe_aux)?;
                dh2
            }
        };
        let mut dx2 = self.mlp_norm_backward(dh2, &mut s, grads)?;
        b.add(dx2.view_mut(), dout.view())?; // the residual around the MLP
        drop(dout);
        // Attention block, reversed.
        let d_o = self.o_proj_backward(&dx2, &mut s, grads)?;
        let (dq, dk, dv) = self.core_attn_backward(d_o, &mut s, plan)?;
        let dh1 = self.qkv_proj_backward((dq, dk, dv), &mut s, grads, pos)?;
        let mut dx = self.attn_norm_backward(dh1, &mut s, grads)?;
        b.add(dx.view_mut(), dx2.view())?; // the residual around attention
        Ok(dx)
    }

    // ---- norms ----------------------------------------------------------------------------------------------

    /// `h = norm(x)`: RMSNorm, or (a norm with a bias, Nemotron) LayerNorm with the effective weight
    /// `weight + 1` (zero-centred gamma, Hugging Face `NemotronLayerNorm1P`).
    pub fn norm_forward(&self, n: NormIx, x: &Buffer) -> Result<NormOut> {
        let b = self.backend;
        let l = x.dims()[0];
        let (mut h, mut rstd) = (self.buf([l, self.cfg.d_model])?, self.buf_f32([l])?);
        match n.bias {
            None => {
                b.rmsnorm_forward(h.view_mut(), rstd.view_mut(), x.view(), &norm(self.t(n.weight), self.cfg.norm_eps))?;
                Ok((None, rstd, h))
            }
            Some(bias) => {
                let w = self.one_plus(n.weight)?;
                let mut mean = self.buf_f32([l])?;
                let p = NormParams { weight: w.view(), bias: Some(self.t(bias).view()), eps: self.cfg.norm_eps };
                b.layernorm_forward(h.view_mut(), mean.view_mut(), rstd.view_mut(), x.view(), &p)?;
                Ok((Some(mean), rstd, h))
            }
        }
    }

    /// `weight + 1`: a zero-centred LayerNorm weight's effective value (its gradient is the effective one's).
    fn one_plus(&self, weight: usize) -> Result<Buffer> {
        let ones = self.ones.ok_or_else(|| TrainError::Internal("a LayerNorm in a non-Nemotron model".into()))?;
        let mut w = self.buf([self.cfg.d_model])?;
        self.backend.copy(w.view_mut(), self.t(weight).view())?;
        self.backend.add(w.view_mut(), ones.view())?;
        Ok(w)
    }

    /// The norm's backward: `dx` (overwritten), the weight's (and bias's) gradients.
    pub fn norm_backward(
        &self,
        n: NormIx,
        dx: &mut Buffer,
        dh: &Buffer,
        (x, mean, rstd): (&Buffer, Option<&Buffer>, &Buffer),
        grads: &mut WeightGrads<'_>,
    ) -> Result<()> {
        let b = self.backend;
        let mode = grads.mode;
        match (n.bias, mean) {
            (None, _) => {
                let g = ng(dx.view_mut(), grads.of(n.weight));
                b.rmsnorm_backward(g, dh.view(), rms_saved(x, rstd), self.t(n.weight).view(), mode)?;
            }
            (Some(bias), Some(mean)) => {
                let w = self.one_plus(n.weight)?;
                let (dw, db) = two_mut(&mut grads.params.tensors, n.weight, bias);
                let g = NormGrads { dx: dx.view_mut(), dweight: dw.view_mut(), dbias: Some(db.view_mut()) };
                let saved = LayerNormSaved { x: x.view(), mean: mean.view(), rstd: rstd.view() };
                b.layernorm_backward(g, dh.view(), saved, w.view(), mode)?;
            }
            (Some(_), None) => return Err(TrainError::Internal("a LayerNorm's backward without its mean".into())),
        }
        Ok(())
    }

    // ---- attention block ------------------------------------------------------------------------------------

    /// `mean1, rstd1, h1 = norm(x)`.
    fn attn_norm(&self, s: &mut LayerSaved) -> Result<()> {
        let out = self.norm_forward(self.at(s).attn_norm, s.get(SavedId::X)?)?;
        put_norm(s, [SavedId::Mean1, SavedId::Rstd1, SavedId::H1], out);
        Ok(())
    }

    /// `dx` from `dh1`; frees `x`, `mean1`, `rstd1`.
    fn attn_norm_backward(&self, dh1: Buffer, s: &mut LayerSaved, grads: &mut WeightGrads<'_>) -> Result<Buffer> {
        let n = self.at(s).attn_norm;
        let (x, mean, rstd) = (s.take(SavedId::X)?, s.take_if_held(SavedId::Mean1), s.take(SavedId::Rstd1)?);
        let mut dx = self.buf(x.dims())?;
        self.norm_backward(n, &mut dx, &dh1, (&x, mean.as_ref(), &rstd), grads)?;
        Ok(dx)
    }

    /// `q, k, v` `[1, H, L, D]` from `h1` `[L, C]`, head-major, `q` and `k` rotated (their first `rotary_dim` dims,
    /// with partial RoPE).
    fn qkv_proj(&self, s: &mut LayerSaved, pos: &[i64]) -> Result<()> {
        let b = self.backend;
        let ix = self.at(s);
        let h1 = s.get(SavedId::H1)?;
        let (l, d, hq, hkv) = (h1.dims()[0], self.cfg.head_dim(), self.cfg.heads, self.cfg.kv_heads);
        let (mut q_t, mut k_t, mut v_t) = (self.buf([l, hq * d])?, self.buf([l, hkv * d])?, self.buf([l, hkv * d])?);
        let (mut q, mut k, mut v) = (self.buf([1, hq, l, d])?, self.buf([1, hkv, l, d])?, self.buf([1, hkv, l, d])?);
        b.linear_forward(q_t.view_mut(), h1.view(), self.t(ix.wq).view(), None)?;
        b.linear_forward(k_t.view_mut(), h1.view(), self.t(ix.wk).view(), None)?;
        b.linear_forward(v_t.view_mut(), h1.view(), self.t(ix.wv).view(), None)?;
        b.transpose12(q.view_mut(), q_t.view().reshape([1, l, hq, d])?)?;
        b.transpose12(k.view_mut(), k_t.view().reshape([1, l, hkv, d])?)?;
        b.transpose12(v.view_mut(), v_t.view().reshape([1, l, hkv, d])?)?;
        b.rope_forward(self.rope, q.view_mut(), pos)?;
        b.rope_forward(self.rope, k.view_mut(), pos)?;
        s.put(SavedId::Q, q);
        s.put(SavedId::K, k);
        s.put(SavedId::V, v);
        Ok(())
    }

    /// `dh1` `[L, C]` from `dq, dk, dv` (rotated back); frees `h1`.
    fn qkv_proj_backward(
        &self,
        (mut dq, mut dk, dv): (Buffer, Buffer, Buffer),
        s: &mut LayerSaved,
        grads: &mut WeightGrads<'_>,
        pos: &[i64],
    ) -> Result<Buffer> {
        let b = self.backend;
        let ix = self.at(s);
        let (wq, wk, wv) = (ix.wq, ix.wk, ix.wv);
        let (l, c, d, hq, hkv) =
            (dq.dims()[2], self.cfg.d_model, self.cfg.head_dim(), self.cfg.heads, self.cfg.kv_heads);
        let mode = grads.mode;
        b.rope_backward(self.rope, dq.view_mut(), pos)?;
        b.rope_backward(self.rope, dk.view_mut(), pos)?;
        let (mut dq_t, mut dk_t, mut dv_t) =
            (self.buf([1, l, hq, d])?, self.buf([1, l, hkv, d])?, self.buf([1, l, hkv, d])?);
        b.transpose12(dq_t.view_mut(), dq.view())?;
        b.transpose12(dk_t.view_mut(), dk.view())?;
        b.transpose12(dv_t.view_mut(), dv.view())?;
        drop((dq, dk, dv));
        let (dq_t, dk_t, dv_t) =
            (dq_t.view().reshape([l, hq * d])?, dk_t.view().reshape([l, hkv * d])?, dv_t.view().reshape([l, hkv * d])?);
        let h1 = s.take(SavedId::H1)?;
        let (mut dh1, mut dh1_kv) = (self.buf([l, c])?, self.buf([l, c])?);
        b.linear_backward(lg(Some(dh1.view_mut()), grads.of(wq)), dq_t, saved_x(&h1), self.t(wq).view(), mode)?;
        b.linear_backward(lg(Some(dh1_kv.view_mut()), grads.of(wk)), dk_t, saved_x(&h1), self.t(wk).view(), mode)?;
        b.add(dh1.view_mut(), dh1_kv.view())?;
        b.linear_backward(lg(Some(dh1_kv.view_mut()), grads.of(wv)), dv_t, saved_x(&h1), self.t(wv).view(), mode)?;
        b.add(dh1.view_mut(), dh1_kv.view())?;
        Ok(dh1)
    }

    /// `o, lse` = attention over the whole sequence, through the context-parallel plan.
    fn core_attn(&self, s: &mut LayerSaved, plan: &mut CpPlan) -> Result<()> {
        let (q, k, v) = (s.get(SavedId::Q)?, s.get(SavedId::K)?, s.get(SavedId::V)?);
        let (hq, l) = (q.dims()[1], q.dims()[2]);
        let (mut o, mut lse) = (self.buf(q.dims())?, self.buf_f32([1, hq, l])?);
        plan.forward(AttnOut { o: o.view_mut(), lse: lse.view_mut() }, Qkv::new(q.view(), k.view(), v.view()))?;
        s.put(SavedId::O, o);
        s.put(SavedId::Lse, lse);
        Ok(())
    }

    /// `dq, dk, dv` from `d_o`; frees `q, k, v, o, lse`.
    fn core_attn_backward(
        &self,
        d_o: Buffer,
        s: &mut LayerSaved,
        plan: &mut CpPlan,
    ) -> Result<(Buffer, Buffer, Buffer)> {
        let (q, k, v) = (s.take(SavedId::Q)?, s.take(SavedId::K)?, s.take(SavedId::V)?);
        let (o, lse) = (s.take(SavedId::O)?, s.take(SavedId::Lse)?);
        let (mut dq, mut dk, mut dv) = (self.buf(q.dims())?, self.buf(k.dims())?, self.buf(v.dims())?);
        let saved = AttnSaved { qkv: Qkv::new(q.view(), k.view(), v.view()), o: o.view(), lse: lse.view() };
        plan.backward(AttnGrads { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut() }, d_o.view(), saved)?;
        Ok((dq, dk, dv))
    }

    /// `x2 = x + o·Woᵀ` (o transposed back to token-major).
    fn o_proj(&self, s: &mut LayerSaved) -> Result<()> {
        let b = self.backend;
        let (o, x) = (s.get(SavedId::O)?, s.get(SavedId::X)?);
        let (hq, l, d, c) = (o.dims()[1], o.dims()[2], o.dims()[3], self.cfg.d_model);
        let (mut o_t, mut x2) = (self.buf([1, l, hq, d])?, self.buf([l, c])?);
        b.transpose12(o_t.view_mut(), o.view())?;
        let wo = self.t(self.at(s).wo).view();
        // The projection straight into the output, then the residual added to it (`x + y` is `y + x` bit for
        // bit): no buffer for the projection alone, and no pass copying `x`.
        b.linear_forward(x2.view_mut(), o_t.view().reshape([l, hq * d])?, wo, None)?;
        b.add(x2.view_mut(), x.view())?;
        s.put(SavedId::X2, x2);
        Ok(())
    }

    /// `d_o` `[1, Hq, L, D]` from `dx2` (the residual's share is the caller's); `o` stays for attention's backward.
    fn o_proj_backward(&self, dx2: &Buffer, s: &mut LayerSaved, grads: &mut WeightGrads<'_>) -> Result<Buffer> {
        let b = self.backend;
        let wo = self.at(s).wo;
        let o = s.get(SavedId::O)?;
        let (hq, l, d) = (o.dims()[1], o.dims()[2], o.dims()[3]);
        let mut o_t = self.buf([1, l, hq, d])?;
        b.transpose12(o_t.view_mut(), o.view())?;
        let mut do_t = self.buf([l, hq * d])?;
        let o_flat = o_t.view().reshape([l, hq * d])?;
        let mode = grads.mode;
        b.linear_backward(
            lg(Some(do_t.view_mut()), grads.of(wo)),
            dx2.view(),
            LinearSaved { x: o_flat },
            self.t(wo).view(),
            mode,
        )?;
        drop(o_t);
        let mut d_o = self.buf([1, hq, l, d])?;
        b.transpose12(d_o.view_mut(), do_t.view().reshape([1, l, hq, d])?)?;
        Ok(d_o)
    }

    // ---- MLP block --------------------------------------------------------------------------------------------

    /// `mean2, rstd2, h2 = norm(x2)`.
    fn mlp_norm(&self, s: &mut LayerSaved) -> Result<()> {
        let out = self.norm_forward(self.at(s).mlp_norm, s.get(SavedId::X2)?)?;
        put_norm(s, [SavedId::Mean2, SavedId::Rstd2, SavedId::H2], out);
        Ok(())
    }

    /// `dx2` from `dh2` (the residual's share is the caller's); frees `x2`, `mean2`, `rstd2`.
    fn mlp_norm_backward(&self, dh2: Buffer, s: &mut LayerSaved, grads: &mut WeightGrads<'_>) -> Result<Buffer> {
        let n = self.at(s).mlp_norm;
        let mut dx2 = self.buf(dh2.dims())?;
        let (x2, mean, rstd) = (s.take(SavedId::X2)?, s.take_if_held(SavedId::Mean2), s.take(SavedId::Rstd2)?);
        self.norm_backward(n, &mut dx2, &dh2, (&x2, mean.as_ref(), &rstd), grads)?;
        Ok(dx2)
    }

    /// `gate, up` `[L, F]` projections of `h2`.
    fn gate_up(&self, wg: usize, wu: usize, s: &mut LayerSaved) -> Result<()> {
        let h2 = s.get(SavedId::H2)?;
        let (l, f) = (h2.dims()[0], self.cfg.ffn);
        let (mut gate, mut up) = (self.buf([l, f])?, self.buf([l, f])?);
        self.backend.linear_forward(gate.view_mut(), h2.view(), self.t(wg).view(), None)?;
        self.backend.linear_forward(up.view_mut(), h2.view(), self.t(wu).view(), None)?;
        s.put(SavedId::Gate, gate);
        s.put(SavedId::Up, up);
        Ok(())
    }

    /// `dh2` from `dgate, dup`; frees `h2`.
    fn gate_up_backward(
        &self,
        wg: usize,
        wu: usize,
        dgate: Buffer,
        dup: Buffer,
        s: &mut LayerSaved,
        grads: &mut WeightGrads<'_>,
    ) -> Result<Buffer> {
        let b = self.backend;
        let mode = grads.mode;
        let h2 = s.take(SavedId::H2)?;
        let mut dh2 = self.buf(h2.dims())?;
        b.linear_backward(lg(Some(dh2.view_mut()), grads.of(wg)), dgate.view(), saved_x(&h2), self.t(wg).view(), mode)?;
        drop(dgate);
        let mut dh2_up = self.buf(h2.dims())?;
        b.linear_backward(
            lg(Some(dh2_up.view_mut()), grads.of(wu)),
            dup.view(),
            saved_x(&h2),
            self.t(wu).view(),
            mode,
        )?;
        drop((dup, h2));
        b.add(dh2.view_mut(), dh2_up.view())?;
        Ok(dh2)
    }

    /// The up projection `[L, F]` of `h2` (Nemotron's only input projection).
    fn up_proj(&self, wu: usize, s: &mut LayerSaved) -> Result<()> {
        let h2 = s.get(SavedId::H2)?;
        let mut up = self.buf([h2.dims()[0], self.cfg.ffn])?;
        self.backend.linear_forward(up.view_mut(), h2.view(), self.t(wu).view(), None)?;
        s.put(SavedId::Up, up);
        Ok(())
    }

    /// `dh2` from `dup`; frees `h2`.
    fn up_proj_backward(
        &self,
        wu: usize,
        dup: Buffer,
        s: &mut LayerSaved,
        grads: &mut WeightGrads<'_>,
    ) -> Result<Buffer> {
        let mode = grads.mode;
        let h2 = s.take(SavedId::H2)?;
        let mut dh2 = self.buf(h2.dims())?;
        let g = lg(Some(dh2.view_mut()), grads.of(wu));
        self.backend.linear_backward(g, dup.view(), saved_x(&h2), self.t(wu).view(), mode)?;
        Ok(dh2)
    }

    /// `act = silu(gate) ∘ up`.
    fn swiglu(&self, s: &mut LayerSaved) -> Result<()> {
        let (gate, up) = (s.get(SavedId::Gate)?, s.get(SavedId::Up)?);
        let mut act = self.buf(gate.dims())?;
        self.backend.swiglu_forward(act.view_mut(), gate.view(), up.view())?;
        s.put(SavedId::Act, act);
        Ok(())
    }

    /// `dgate, dup` from `dact`; frees `gate`, `up`.
    fn swiglu_backward(&self, dact: Buffer, s: &mut LayerSaved) -> Result<(Buffer, Buffer)> {
        let (gate, up) = (s.take(SavedId::Gate)?, s.take(SavedId::Up)?);
        let (mut dgate, mut dup) = (self.buf(gate.dims())?, self.buf(up.dims())?);
        let saved = SwigluSaved { gate: gate.view(), up: up.view() };
        self.backend.swiglu_backward(dgate.view_mut(), dup.view_mut(), dact.view(), saved)?;
        Ok((dgate, dup))
    }

    /// `act = relu(up)²`.
    fn squared_relu(&self, s: &mut LayerSaved) -> Result<()> {
        let up = s.get(SavedId::Up)?;
        let mut act = self.buf(up.dims())?;
        self.backend.squared_relu_forward(act.view_mut(), up.view())?;
        s.put(SavedId::Act, act);
        Ok(())
    }

    /// `dup` from `dact`; frees `up`.
    fn squared_relu_backward(&self, dact: Buffer, s: &mut LayerSaved) -> Result<Buffer> {
        let up = s.take(SavedId::Up)?;
        let mut dup = self.buf(up.dims())?;
        self.backend.squared_relu_backward(dup.view_mut(), dact.view(), SquaredReluSaved { x: up.view() })?;
        Ok(dup)
    }

    /// The layer's output `x2 + act·Wdownᵀ` `[L, C]` (a dense MLP).
    fn down_proj(&self, down: usize, s: &LayerSaved) -> Result<Buffer> {
        let (act, x2) = (s.get(SavedId::Act)?, s.get(SavedId::X2)?);
        let (l, c) = (act.dims()[0], self.cfg.d_model);
        let mut out = self.buf([l, c])?;
        // As in `o_proj`: the projection into the output, the residual added to it.
        self.backend.linear_forward(out.view_mut(), act.view(), self.t(down).view(), None)?;
        self.backend.add(out.view_mut(), x2.view())?;
        Ok(out)
    }

    /// `dact` from `dout` (the residual's share is the caller's); frees `act`.
    fn down_proj_backward(
        &self,
        down: usize,
        dout: &Buffer,
        s: &mut LayerSaved,
        grads: &mut WeightGrads<'_>,
    ) -> Result<Buffer> {
        let mode = grads.mode;
        let act = s.take(SavedId::Act)?;
        let mut dact = self.buf(act.dims())?;
        let g = lg(Some(dact.view_mut()), grads.of(down));
        self.backend.linear_backward(g, dout.view(), saved_x(&act), self.t(down).view(), mode)?;
        Ok(dact)
    }

    // ---- experts (Mixtral) ------------------------------------------------------------------------------------

    fn top_k(&self) -> usize {
        self.cfg.experts().map_or(1, |m| m.top_k)
    }

    /// `router_probs` `[L, E]`, `topk_w` `[L, K]` and the routing of `h2` through the router `Wgate`; returns the
    /// call's statistics.
    fn router(&self, router: usize, s: &mut LayerSaved) -> Result<MoeStats> {
        let b = self.backend;
        let h2 = s.get(SavedId::H2)?;
        let (l, e, k) = (h2.dims()[0], self.t(router).dims()[0], self.top_k());
        let mut logits = self.buf([l, e])?;
        b.linear_forward(logits.view_mut(), h2.view(), self.t(router).view(), None)?;
        let (mut probs, mut w) = (self.buf_f32([l, e])?, self.buf_f32([l, k])?);
        let out = b.moe_router_forward(probs.view_mut(), w.view_mut(), logits.view(), k)?;
        let stats = MoeStats::of(&out);
        s.put(SavedId::RouterProbs, probs);
        s.put(SavedId::TopkW, w);
        s.put_routing(out.routing);
        Ok(stats)
    }

    /// Adds the router's share to `dh2`, from `dtopk_w` and the load-balancing loss's `moe_aux`; frees `h2`,
    /// `router_probs`, `topk_w` and the routing.
    fn router_backward(
        &self,
        router: usize,
        dh2: &mut Buffer,
        dtopk_w: Buffer,
        s: &mut LayerSaved,
        grads: &mut WeightGrads<'_>,
        moe_aux: Option<&[f32]>,
    ) -> Result<()> {
        let b = self.backend;
        let mode = grads.mode;
        let (h2, probs, topk_w) = (s.take(SavedId::H2)?, s.take(SavedId::RouterProbs)?, s.take(SavedId::TopkW)?);
        let routing = s.take_routing()?;
        let r = &routing;
        let (l, c, e) = (r.tokens(), self.cfg.d_model, r.experts());
        let (mut dlogits, mut dh2_router) = (self.buf([l, e])?, self.buf([l, c])?);
        // The load-balancing gradient is computed on the host from the step's routing statistics: one upload.
        let aux_buf = match moe_aux {
            Some(a) => {
                let mut t = self.buf_f32([a.len()])?;
                b.upload(t.view_mut(), View::new(a, [a.len()])?)?;
                Some(t)
            }
            None => None,
        };
        let aux = aux_buf.as_ref().map(|t| t.view());
        b.moe_router_backward(
            dlogits.view_mut(),
            dtopk_w.view(),
            aux,
            MoeRouterSaved { probs: probs.view(), weights: topk_w.view(), routing: r },
        )?;
        let g = lg(Some(dh2_router.view_mut()), grads.of(router));
        b.linear_backward(g, dlogits.view(), saved_x(&h2), self.t(router).view(), mode)?;
        b.add(dh2.view_mut(), dh2_router.view())?;
        Ok(())
    }

    /// The dispatched rows of `h2` `[N, C]`, grouped by expert.
    fn dispatch(&self, h2: &Buffer, routing: &Routing) -> Result<Buffer> {
        let mut xe = self.buf([routing.rows(), self.cfg.d_model])?;
        self.backend.moe_gather_forward(xe.view_mut(), h2.view(), routing)?;
        Ok(xe)
    }

    /// Each expert's `gate = xe_e·W1ᵀ` and `up = xe_e·W3ᵀ` over its rows, `[N, F]` each.
    fn experts_gate_up(&self, experts: &[ExpertIx], s: &mut LayerSaved) -> Result<()> {
        let b = self.backend;
        let r = s.routing()?;
        let xe = self.dispatch(s.get(SavedId::H2)?, r)?;
        let (n, f) = (r.rows(), self.cfg.ffn);
        let (mut gate, mut up) = (self.buf([n, f])?, self.buf([n, f])?);
        for (e, ex) in experts.iter().enumerate() {
            let (at, rows) = expert_rows(r, e);
            if rows == 0 {
                continue;
            }
            let x = xe.view().rows(at, rows)?;
            b.linear_forward(gate.view_mut().rows(at, rows)?, x, self.t(ex.w1).view(), None)?;
            b.linear_forward(up.view_mut().rows(at, rows)?, x, self.t(ex.w3).view(), None)?;
        }
        s.put(SavedId::Gate, gate);
        s.put(SavedId::Up, up);
        Ok(())
    }

    /// `dh2` `[L, C]` from each expert's `dgate, dup` (the router's share is `router_backward`'s); `h2` and the
    /// routing stay for it. An expert no token reached gets zeros under [`GradMode::Overwrite`].
    fn experts_gate_up_backward(
        &self,
        experts: &[ExpertIx],
        dgate: Buffer,
        dup: Buffer,
        s: &mut LayerSaved,
        grads: &mut WeightGrads<'_>,
    ) -> Result<Buffer> {
        let b = self.backend;
        let mode = grads.mode;
        let (h2, r) = (s.get(SavedId::H2)?, s.routing()?);
        let (n, c) = (r.rows(), self.cfg.d_model);
        let (mut dxe, mut dxe_up) = (self.buf([n, c])?, self.buf([n, c])?);
        let xe = self.dispatch(h2, r)?;
        for (e, ex) in experts.iter().enumerate() {
            let (at, m) = expert_rows(r, e);
            if m == 0 {
                unreached(b, grads, ex.w1)?;
                unreached(b, grads, ex.w3)?;
                continue;
            }
            let x = LinearSaved { x: xe.view().rows(at, m)? };
            let g1 = lg(Some(dxe.view_mut().rows(at, m)?), grads.of(ex.w1));
            b.linear_backward(g1, dgate.view().rows(at, m)?, x, self.t(ex.w1).view(), mode)?;
            let g3 = lg(Some(dxe_up.view_mut().rows(at, m)?), grads.of(ex.w3));
            b.linear_backward(g3, dup.view().rows(at, m)?, x, self.t(ex.w3).view(), mode)?;
        }
        b.add(dxe.view_mut(), dxe_up.view())?;
        let mut dh2 = self.buf(h2.dims())?;
        b.moe_gather_backward(dh2.view_mut(), dxe.view(), r)?;
        Ok(dh2)
    }

    /// Each expert's output `ye_e = act_e·W2ᵀ`, `[N, C]`.
    fn experts_down(&self, experts: &[ExpertIx], s: &mut LayerSaved) -> Result<()> {
        let (act, r) = (s.get(SavedId::Act)?, s.routing()?);
        let mut ye = self.buf([r.rows(), self.cfg.d_model])?;
        for (e, ex) in experts.iter().enumerate() {
            let (at, rows) = expert_rows(r, e);
            if rows == 0 {
                continue;
            }
            let a = act.view().rows(at, rows)?;
            self.backend.linear_forward(ye.view_mut().rows(at, rows)?, a, self.t(ex.w2).view(), None)?;
        }
        s.put(SavedId::Ye, ye);
        Ok(())
    }

    /// `dact` `[N, F]` from `dye`; frees `act`.
    fn experts_down_backward(
        &self,
        experts: &[ExpertIx],
        dye: Buffer,
        s: &mut LayerSaved,
        grads: &mut WeightGrads<'_>,
    ) -> Result<Buffer> {
        let b = self.backend;
        let mode = grads.mode;
        let act = s.take(SavedId::Act)?;
        let r = s.routing()?;
        let mut dact = self.buf(act.dims())?;
        for (e, ex) in experts.iter().enumerate() {
            let (at, m) = expert_rows(r, e);
            if m == 0 {
                unreached(b, grads, ex.w2)?;
                continue;
            }
            let g = lg(Some(dact.view_mut().rows(at, m)?), grads.of(ex.w2));
            let x = LinearSaved { x: act.view().rows(at, m)? };
            b.linear_backward(g, dye.view().rows(at, m)?, x, self.t(ex.w2).view(), mode)?;
        }
        Ok(dact)
    }

    /// The layer's output `x2 + Σ_j w[t,j]·ye[row(t,j)]` `[L, C]`.
    fn combine(&self, s: &LayerSaved) -> Result<Buffer> {
        let b = self.backend;
        let (ye, w, x2) = (s.get(SavedId::Ye)?, s.get(SavedId::TopkW)?, s.get(SavedId::X2)?);
        let mut out = self.buf(x2.dims())?;
        // As in `o_proj`: the combined experts into the output, the residual added to it.
        b.moe_combine_forward(out.view_mut(), ye.view(), w.view(), s.routing()?)?;
        b.add(out.view_mut(), x2.view())?;
        Ok(out)
    }

    /// `dye` `[N, C]` and `dtopk_w` `[L, K]` from `dout` (the residual's share is the caller's); frees `ye`.
    fn combine_backward(&self, dout: &Buffer, s: &mut LayerSaved) -> Result<(Buffer, Buffer)> {
        let ye = s.take(SavedId::Ye)?;
        let (topk_w, r) = (s.get(SavedId::TopkW)?, s.routing()?);
        let (mut dye, mut dtopk_w) = (self.buf(ye.dims())?, self.buf_f32([r.tokens(), r.top_k()])?);
        self.backend.moe_combine_backward(
            dye.view_mut(),
            dtopk_w.view_mut(),
            dout.view(),
            MoeCombineSaved { ye: ye.view(), weights: topk_w.view(), routing: r },
        )?;
        Ok((dye, dtopk_w))
    }
}

/// Holds a norm's outputs as `[mean, rstd, h]` (a mean only from LayerNorm).
fn put_norm(s: &mut LayerSaved, [mean_id, rstd_id, h_id]: [SavedId; 3], (mean, rstd, h): NormOut) {
    if let Some(mean) = mean {
        s.put(mean_id, mean);
    }
    s.put(rstd_id, rstd);
    s.put(h_id, h);
}

/// Expert `e`'s first row among the dispatched rows, and its row count.
fn expert_rows(r: &Routing, e: usize) -> (usize, usize) {
    (r.offsets()[e], r.offsets()[e + 1] - r.offsets()[e])
}

/// An expert no token reached: its gradient is zero, written out when the gradients are overwritten.
fn unreached(b: &dyn Backend, grads: &mut WeightGrads<'_>, i: usize) -> Result<()> {
    if grads.mode == GradMode::Overwrite {
        b.scale(grads.of(i), 0.0)?;
    }
    Ok(())
}

fn norm(weight: &Buffer, eps: f32) -> NormParams<'_> {
    NormParams { weight: weight.view(), bias: None, eps }
}

/// Two distinct tensors mutably (`i < j`: a norm's weight comes before its bias).
fn two_mut(ts: &mut [Buffer], i: usize, j: usize) -> (&mut Buffer, &mut Buffer) {
    let (a, b) = ts.split_at_mut(j);
    (&mut a[i], &mut b[0])
}

fn lg<'a>(dx: Option<ViewMut<'a>>, dw: ViewMut<'a>) -> LinearGrads<'a> {
    LinearGrads { dx, dw, dbias: None }
}

fn ng<'a>(dx: ViewMut<'a>, dweight: ViewMut<'a>) -> NormGrads<'a> {
    NormGrads { dx, dweight, dbias: None }
}

fn saved_x(x: &Buffer) -> LinearSaved<'_> {
    LinearSaved { x: x.view() }
}

fn rms_saved<'a>(x: &'a Buffer, rstd: &'a Buffer) -> RmsNormSaved<'a> {
    RmsNormSaved { x: x.view(), rstd: rstd.view() }
}
