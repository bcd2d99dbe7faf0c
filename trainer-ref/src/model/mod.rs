//! The decoder of every [`Family`]: Llama 3 (RMSNorm, RoPE with Llama 3 frequency scaling, grouped-query
//! attention through context-parallel ring attention, a SwiGLU MLP), Mixtral (the same layer with a top-k mixture
//! of SwiGLU experts and a load-balancing loss, [`moe`]) and Nemotron-4 (LayerNorm with zero-centred weight and
//! bias, partial RoPE, a squared-ReLU MLP); embeddings untied or tied, and the output projection fused with the
//! loss in chunks of tokens, so `[tokens, vocab]` logits never exist at once.
//!
//! One model, not three: the families share the attention block and differ in their norms and MLP, which the
//! layer's forward and backward choose by the tensors' layout (the private `layout` module's `MlpIx`, a norm with
//! or without a bias), so the recompute and offload machinery serves every family unchanged.
//!
//! Every computation is a call of the [`Backend`] the model was given, on buffers the backend allocated: a CUDA
//! backend changes nothing here. Each layer's forward keeps what its backward needs in a [`LayerSaved`], one
//! entry per [`SavedId`], whose size follows from the shapes ([`LayerSaved::bytes_for`]): the contract
//! activation recomputation and offload decide on. A tensor the recompute policy dropped is made again before
//! the backward by rerunning its segment of the recompute crate's description of the layer, through the same
//! forward helper that made it. The layer's backward is its forward read in reverse, one helper per line (llm.c's
//! `gpt2_backward`).
//!
//! Files: `params` (the tensors and their initialisation), `layout` (where each sits), `saved` (the saved-tensor
//! table and what the policies do to it), `offload_copy` (the offload engine's copier over the backend), `layer`
//! (one layer's forward and backward), `moe` (the load-balancing statistics); this one holds the whole model's
//! forward and backward.
//!
//! Shapes: `L` tokens on this rank, `C` the model width, `V` the vocabulary.

mod layer;
mod layout;
pub mod moe;
pub mod offload_copy;
mod params;
mod saved;

use std::sync::Arc;

use longctx_kernels::{Backend, Buffer, CrossEntropyOptions, DType, Dims, GradMode, ProjectionGrads, RopeTable};
use longctx_offload::OffloadEngine;
use longctx_recompute::{Action, LayerActions};
use longctx_ring_attn::CpPlan;

use crate::error::{Result, TrainError};
use crate::recipe::{Family, ModelConfig};
use layer::{Ops, WeightGrads};
pub use layout::param_shapes;
use layout::Layout;
pub use moe::MoeStats;
pub use params::{Params, Rng};
use saved::{missing, replay_steps, ReplayStep};
pub use saved::{LayerSaved, SavedId, SegmentId};

/// What the whole forward keeps: each layer's, and the final norm's.
#[derive(Debug)]
pub struct ModelSaved {
    /// Token ids of this rank `[L]` (the embedding's backward).
    pub ids: Vec<u32>,
    /// Per layer, after the recompute policy.
    pub layers: Vec<LayerSaved>,
    /// The last layer's output `[L, C]`: the final norm's input.
    pub x_final: Buffer,
    /// Final LayerNorm mean `[L]` (Nemotron).
    pub mean_final: Option<Buffer>,
    /// Final norm `1/rms` (or `1/std`) `[L]`.
    pub rstd_final: Buffer,
    /// Final norm output `[L, C]`: the output projection's input.
    pub h_final: Buffer,
    /// The routers' statistics over this rank's tokens and every layer (Mixtral): what the load-balancing loss
    /// is formed from, once summed over every rank.
    pub moe: Option<MoeStats>,
}

impl ModelSaved {
    /// Bytes held by every saved activation.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(LayerSaved::bytes).sum::<usize>()
            + self.x_final.bytes()
            + self.mean_final.as_ref().map_or(0, Buffer::bytes)
            + self.rstd_final.bytes()
            + self.h_final.bytes()
    }
}

/// The loss over this rank's tokens: its sum, and the count of scored tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LocalLoss {
    /// Sum of the per-token cross-entropies (nats).
    pub sum: f64,
    /// Tokens scored.
    pub tokens: usize,
}

/// What the loss is taken against.
#[derive(Debug, Clone, Copy)]
pub struct LossSpec<'a> {
    /// The next token of each of this rank's tokens (`-100`: not scored).
    pub targets: &'a [i64],
    /// The global batch's scored token count: the losses of every rank summed and divided by it are the mean.
    pub denominator: f64,
    /// Tokens per chunk of the fused output projection.
    pub chunk: usize,
    /// Mixtral: the load-balancing loss's gradient with respect to each router probability `[E]`, the same for
    /// every token and layer ([`MoeStats::prob_grad`] of the global statistics); `None` without experts.
    pub moe_aux: Option<&'a [f32]>,
}

/// The model: its configuration, its weights in the working dtype, and the backend it computes on.
#[derive(Debug)]
pub struct Model {
    /// Shape.
    pub cfg: ModelConfig,
    /// The working weights (`f32`, or `bf16` copies of the `f32` master weights).
    pub weights: Params,
    backend: Arc<dyn Backend>,
    rope: RopeTable,
    dtype: DType,
    /// Where each tensor sits in `weights`.
    ix: Layout,
    /// `[C]` ones in the working dtype: the `+ 1` of zero-centred LayerNorm weights (Nemotron).
    ones: Option<Buffer>,
    /// The family's layer as segments, in forward order: what a replay before the backward reruns.
    replay: Vec<ReplayStep>,
    /// What each layer keeps for its backward (everything when empty).
    recompute: Vec<LayerActions>,
    /// Where kept tensors go between a layer's forward and its backward (`None`: they stay).
    offload: Option<Arc<OffloadEngine>>,
}

/// The first name the trainer gave its model, when it had one family.
pub type Llama = Model;

impl Model {
    /// A model with `weights` (working dtype `dtype`) computing on `backend`.
    pub fn new(cfg: ModelConfig, weights: Params, backend: Arc<dyn Backend>) -> Result<Model> {
        let dtype = weights.tensors.first().map_or(DType::F32, Buffer::dtype);
        let ix = Layout::new(&cfg);
        let want = &ix.shapes;
        if weights.tensors.len() != want.len() {
            return Err(TrainError::InvalidArgument {
                name: "weights".into(),
                detail: format!("{} tensors for a model of {}", weights.tensors.len(), want.len()),
            });
        }
        for ((name, dims), t) in want.iter().zip(&weights.tensors) {
            if t.dims() != dims.as_slice() || t.dtype() != dtype {
                return Err(TrainError::InvalidArgument {
                    name: "weights".into(),
                    detail: format!(
                        "tensor {name}: {:?} {} where the model needs {dims:?} {}",
                        t.dims(),
                        t.dtype().name(),
                        dtype.name()
                    ),
                });
            }
        }
        // Sequence length 0: the table of the original context (what transformers builds at start-up);
        // `set_sequence_length` rebuilds it for the scalings that depend on the length.
        let rope = rope_table(&cfg, 0)?;
        let ones = if cfg.family == Family::Nemotron {
            let mut o = backend.empty(dtype, Dims::new(&[cfg.d_model])?)?;
            backend.fill(o.view_mut(), 1.0)?;
            Some(o)
        } else {
            None
        };
        // The recompute crate's description of the family's layer: what a replay reruns (its segments' order and
        // what each saves do not depend on the sizes).
        let replay = replay_steps(&cfg.layer_spec(1, 1, dtype.size() as u64))?;
        Ok(Model { cfg, weights, backend, rope, dtype, ix, ones, replay, recompute: Vec::new(), offload: None })
    }

    /// Builds the rotary table for sequences of `seq_len` tokens (the whole sequence, over every rank).
    /// `dynamic` and `longrope` scalings depend on it: transformers recomputes them per forward from
    /// `max(position) + 1`, which for a run of fixed sequence length is this, every step.
    pub fn set_sequence_length(&mut self, seq_len: usize) -> Result<()> {
        self.rope = rope_table(&self.cfg, seq_len)?;
        Ok(())
    }

    /// Sets what each layer keeps for its backward (one entry per layer, from a
    /// [`longctx_recompute::Policy`]); the gradients do not change, only memory and time.
    pub fn set_recompute(&mut self, per_layer: Vec<LayerActions>) -> Result<()> {
        if !per_layer.is_empty() && per_layer.len() != self.cfg.layers {
            return Err(TrainError::InvalidArgument {
                name: "per_layer".into(),
                detail: format!("{} recompute entries for {} layers", per_layer.len(), self.cfg.layers),
            });
        }
        if per_layer.first().is_some_and(|a| a.of("x") == Action::Recompute) {
            return Err(TrainError::InvalidField {
                field: "train.recompute".into(),
                detail: "the first layer's input (the embedding) cannot be recomputed".into(),
            });
        }
        self.recompute = per_layer;
        Ok(())
    }

    /// Moves what each layer keeps to `engine` after its forward and fetches it back before its backward:
    /// the tensors the recompute policy marks `Offload` when it marks any, else every kept tensor (the
    /// engine keeps its resident last layers in place). Gradients do not change.
    pub fn set_offload(&mut self, engine: Option<Arc<OffloadEngine>>) {
        self.offload = engine;
    }

    /// The offload engine, if any (for its statistics).
    pub fn offload_engine(&self) -> Option<&Arc<OffloadEngine>> {
        self.offload.as_ref()
    }

    /// The working dtype of weights and activations.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// What the layer ops compute with, borrowed from the model.
    fn ops(&self) -> Ops<'_> {
        Ops {
            backend: &*self.backend,
            cfg: &self.cfg,
            weights: &self.weights,
            ix: &self.ix,
            rope: &self.rope,
            dtype: self.dtype,
            ones: self.ones.as_ref(),
        }
    }

    /// The forward over this rank's tokens `ids` (at the global positions `plan.positions()`), keeping what the
    /// backward needs.
    pub fn forward(&self, ids: &[u32], plan: &mut CpPlan) -> Result<ModelSaved> {
        let ops = self.ops();
        let (l, c) = (ids.len(), self.cfg.d_model);
        let pos = plan.positions().to_vec();
        let mut x = ops.buf([l, c])?;
        self.backend.embedding_forward(x.view_mut(), ids, self.weights.tensors[0].view())?;
        let mut layers = Vec::with_capacity(self.cfg.layers);
        let keep_all = LayerActions::keep_all();
        let marks_offload = self.recompute.iter().any(|a| a.actions.values().any(|&v| v == Action::Offload));
        let mut moe: Option<MoeStats> = None;
        for layer in 0..self.cfg.layers {
            let (out, mut saved, stats) = ops
                .layer_forward(layer, x, plan, &pos)
                .map_err(|e| e.in_phase(|| format!("forward of layer {layer}")))?;
            if let Some(s) = stats {
                moe.get_or_insert_with(|| MoeStats::zeros(s.experts())).merge(&s);
            }
            let actions = self.recompute.get(layer).unwrap_or(&keep_all);
            saved.keep(actions, self.offload.is_some())?;
            if let Some(engine) = &self.offload {
                let ready = self.backend.record_event()?;
                saved.offload(engine, &ready, |id| !marks_offload || actions.of(id.name()) == Action::Offload)?;
            }
            layers.push(saved);
            x = out;
        }
        let (mean_final, rstd_final, h_final) = ops.norm_forward(self.ix.final_norm, &x)?;
        Ok(ModelSaved { ids: ids.to_vec(), layers, x_final: x, mean_final, rstd_final, h_final, moe })
    }

    /// The loss of `loss.targets` and the whole backward: gradients are written into `grads` (overwriting them
    /// with [`GradMode::Overwrite`], adding with [`GradMode::Accumulate`]), scaled so that the losses summed
    /// over every rank, divided by `loss.denominator`, are the mean loss. A Mixtral model's load-balancing loss
    /// enters through `loss.moe_aux` (its value is the caller's: it needs every rank's statistics).
    pub fn loss_and_backward(
        &self,
        saved: ModelSaved,
        loss: &LossSpec<'_>,
        grads: &mut Params,
        mode: GradMode,
        plan: &mut CpPlan,
    ) -> Result<LocalLoss> {
        let b = &*self.backend;
        let ops = self.ops();
        let (l, c) = (saved.ids.len(), self.cfg.d_model);
        let pos = plan.positions().to_vec();
        let targets = loss.targets;
        let opts =
            CrossEntropyOptions { chunk_tokens: loss.chunk, denominator: Some(loss.denominator), ..Default::default() };
        let (mut dh_final, mut dx) = (ops.buf([l, c])?, ops.buf([l, c])?);
        let head = self.ix.lm_head;

        let lm = {
            let dweight = grads.tensors[head].view_mut();
            let g = ProjectionGrads { dhidden: dh_final.view_mut(), dweight };
            b.cross_entropy_fused(g, saved.h_final.view(), self.weights.tensors[head].view(), targets, &opts, mode)
                .map_err(|e| TrainError::from(e).in_phase(|| "the loss (output projection and cross-entropy)".into()))?
        };
        let mut grads = WeightGrads { params: grads, mode };
        let final_saved = (&saved.x_final, saved.mean_final.as_ref(), &saved.rstd_final);
        ops.norm_backward(self.ix.final_norm, &mut dx, &dh_final, final_saved, &mut grads)?;
        let ids = saved.ids;
        let mut layers: Vec<Option<LayerSaved>> = saved.layers.into_iter().map(Some).collect();
        for layer in (0..layers.len()).rev() {
            if let Some(e) = &self.offload {
                e.backward_started(layer);
            }
            let phase = || format!("backward of layer {layer}");
            let s = self.saved_for_backward(layer, &mut layers, plan, &pos).map_err(|e| e.in_phase(phase))?;
            dx = ops.layer_backward(dx, s, &mut grads, plan, &pos, loss.moe_aux).map_err(|e| e.in_phase(phase))?;
        }
        // Tied embeddings: the output projection's gradient is already in the table's; add the lookup's.
        let emb_mode = if head == 0 { GradMode::Accumulate } else { mode };
        b.embedding_backward(grads.params.tensors[0].view_mut(), dx.view(), &ids, emb_mode)?;
        Ok(LocalLoss { sum: lm.loss_sum, tokens: lm.n_valid })
    }

    /// `layer`'s saved tensors, whole again for its backward: fetched back from the offload engine, and every
    /// segment whose outputs the policy dropped rerun. A layer whose input was dropped too (`uniform`) takes it
    /// from the layer below, made whole first the same way and run to its output (its last segment); that
    /// layer's tensors stay in `layers` for its own backward, which comes next.
    fn saved_for_backward(
        &self,
        layer: usize,
        layers: &mut [Option<LayerSaved>],
        plan: &mut CpPlan,
        pos: &[i64],
    ) -> Result<LayerSaved> {
        let ops = self.ops();
        let mut s = layers[layer].take().ok_or_else(|| missing(layer, "saved tensors"))?;
        s.restore(self.offload.as_deref())?;
        if !s.holds(SavedId::X) {
            let below = layer.checked_sub(1).ok_or_else(|| missing(layer, "x (no earlier layer kept its input)"))?;
            let mut prev = self.saved_for_backward(below, layers, plan, pos)?;
            let last = self.replay.last().ok_or_else(|| missing(below, "the layer's output"))?;
            let x = ops.segment_forward(last.segment, &mut prev, plan, pos)?;
            s.put(SavedId::X, x.ok_or_else(|| missing(below, "the layer's output"))?);
            layers[below] = Some(prev);
        }
        s.replay(&self.replay, |segment, s| ops.segment_forward(segment, s, plan, pos).map(drop))?;
        Ok(s)
    }

    /// The loss alone (held-out evaluation: the cross-entropy, without a load-balancing term): the forward, and
    /// the output projection's loss with its gradients written to scratch.
    pub fn loss(&self, ids: &[u32], targets: &[i64], loss_chunk: usize, plan: &mut CpPlan) -> Result<LocalLoss> {
        let ops = self.ops();
        let saved = self.forward(ids, plan)?;
        let (l, c, v) = (ids.len(), self.cfg.d_model, self.cfg.vocab);
        let (mut dh, mut dw) = (ops.buf([l, c])?, ops.buf_f32([v, c])?);
        let opts = CrossEntropyOptions { chunk_tokens: loss_chunk, denominator: Some(1.0), ..Default::default() };
        let g = ProjectionGrads { dhidden: dh.view_mut(), dweight: dw.view_mut() };
        let out = self.backend.cross_entropy_fused(
            g,
            saved.h_final.view(),
            self.weights.tensors[self.ix.lm_head].view(),
            targets,
            &opts,
            GradMode::Overwrite,
        )?;
        Ok(LocalLoss { sum: out.loss_sum, tokens: out.n_valid })
    }
}

/// The RoPE table of `cfg` at `seq_len` (see [`ModelConfig::rope_config`]), rotating only the first `rotary_dim` dims of
/// each head for a partial-rotary model.
fn rope_table(cfg: &ModelConfig, seq_len: usize) -> Result<RopeTable> {
    let rc = cfg.rope_config(seq_len);
    Ok(if cfg.rotary_dim() == cfg.head_dim() {
        RopeTable::new(&rc)?
    } else {
        RopeTable::with_rotary_dim(&rc, cfg.rotary_dim())?
    })
}
