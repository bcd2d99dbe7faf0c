//! The Llama 3 style decoder: RMSNorm, RoPE (with Llama 3 frequency scaling), grouped-query attention through
//! context-parallel ring attention, a SwiGLU MLP, untied embeddings, and the output projection fused with the
//! loss in chunks of tokens, so `[tokens, vocab]` logits never exist at once.
//!
//! Every computation is a call of the [`Backend`] the model was given, on buffers the backend allocated: a CUDA
//! backend changes nothing here. Each layer's forward returns what its backward needs as a named struct
//! ([`LayerSaved`]) whose size follows from the shapes ([`LayerSaved::bytes_for`]), the contract activation
//! recomputation and offload decide on. The backward is the forward read in reverse, one op per line
//! (llm.c's `gpt2_backward`).
//!
//! Shapes: `L` tokens on this rank, `C` the model width, `Hq`/`Hkv` query and KV heads of width `D`, `F` the MLP
//! width, `V` the vocabulary. Activations are `[L, C]` token-major; attention works head-major `[1, H, L, D]`.

use std::sync::Arc;

use longctx_kernels::HostVec;
use longctx_kernels::{
    AttnGrads, AttnOut, AttnSaved, Backend, Buffer, CrossEntropyOptions, DType, Dims, GradMode, IntoDims, LinearGrads,
    LinearSaved, NormGrads, NormParams, ProjectionGrads, Qkv, RmsNormSaved, RopeTable, SwigluSaved, View,
};
use longctx_offload::{Activation, HostTensor, OffloadEngine, Ticket};
use longctx_recompute::{Action, LayerActions};
use longctx_ring_attn::CpPlan;

use crate::error::{Result, TrainError};
use crate::recipe::ModelConfig;
use crate::rope_scaling::rope_config;

/// Tensors per decoder layer, in [`Params`] order.
const PER_LAYER: usize = 9;
/// Index of each tensor within a layer.
const ATTN_NORM: usize = 0;
const WQ: usize = 1;
const WK: usize = 2;
const WV: usize = 3;
const WO: usize = 4;
const MLP_NORM: usize = 5;
const W_GATE: usize = 6;
const W_UP: usize = 7;
const W_DOWN: usize = 8;

/// The model's tensors (weights, or their gradients, or an optimizer moment), one buffer each, named as in a
/// Hugging Face Llama checkpoint, in a fixed order: the embedding, each layer's nine, the final norm, the head.
#[derive(Debug)]
pub struct Params {
    /// Hugging Face names (`model.layers.3.self_attn.q_proj.weight`).
    pub names: Vec<String>,
    /// One buffer per name.
    pub tensors: Vec<Buffer>,
}

/// The dims of every tensor of a model, with its Hugging Face name, in [`Params`] order.
pub fn param_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (c, f, v, d) = (cfg.d_model, cfg.ffn, cfg.vocab, cfg.head_dim());
    let (q, kv) = (cfg.heads * d, cfg.kv_heads * d);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, c])];
    for l in 0..cfg.layers {
        let p = format!("model.layers.{l}");
        out.extend([
            (format!("{p}.input_layernorm.weight"), vec![c]),
            (format!("{p}.self_attn.q_proj.weight"), vec![q, c]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, c]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, c]),
            (format!("{p}.self_attn.o_proj.weight"), vec![c, q]),
            (format!("{p}.post_attention_layernorm.weight"), vec![c]),
            (format!("{p}.mlp.gate_proj.weight"), vec![f, c]),
            (format!("{p}.mlp.up_proj.weight"), vec![f, c]),
            (format!("{p}.mlp.down_proj.weight"), vec![c, f]),
        ]);
    }
    out.push(("model.norm.weight".to_string(), vec![c]));
    out.push(("lm_head.weight".to_string(), vec![v, c]));
    out
}

impl Params {
    /// Zeroed tensors of `dtype` for `cfg`, in `backend`'s memory.
    pub fn zeros(backend: &dyn Backend, cfg: &ModelConfig, dtype: DType) -> Result<Params> {
        let (mut names, mut tensors) = (Vec::new(), Vec::new());
        for (name, dims) in param_shapes(cfg) {
            tensors.push(backend.zeros(dtype, Dims::new(&dims)?)?);
            names.push(name);
        }
        Ok(Params { names, tensors })
    }

    /// The initial weights (`f32`): norms 1, matrices normal with `init_std` (residual output projections
    /// divided by `√(2·layers)`, GPT-2's rule), from a generator seeded by `seed` alone, so every rank draws the
    /// same weights.
    pub fn init(backend: &dyn Backend, cfg: &ModelConfig, seed: u64) -> Result<Params> {
        let mut p = Params::zeros(backend, cfg, DType::F32)?;
        let mut rng = Rng::new(seed);
        let resid = cfg.init_std / ((2 * cfg.layers) as f32).sqrt();
        for (name, t) in p.names.iter().zip(p.tensors.iter_mut()) {
            let host: Vec<f32> = if t.dims().len() == 1 {
                vec![1.0; t.len()]
            } else {
                let std = if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
                    resid
                } else {
                    cfg.init_std
                };
                (0..t.len()).map(|_| rng.normal() * std).collect()
            };
            let dims = t.dims().to_vec();
            backend.copy(t.view_mut(), View::new(&host, dims)?)?;
        }
        Ok(p)
    }

    /// Elements over all tensors.
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(Buffer::len).sum()
    }

    /// The tensors as views, in order.
    pub fn views(&self) -> Vec<View<'_>> {
        self.tensors.iter().map(Buffer::view).collect()
    }
}

/// A small deterministic generator (SplitMix64, Box–Muller): the initial weights depend on the seed only.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal.
    pub fn normal(&mut self) -> f32 {
        let (u1, u2) = (1.0 - self.uniform(), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
}

/// What one decoder layer's forward keeps for its backward. `x` is the layer's input; the others are named by
/// the op that made them.
#[derive(Debug)]
pub struct LayerSaved {
    /// The layer's input `[L, C]` (saved by the attention norm and the residual).
    pub x: Buffer,
    /// Attention norm: `1/rms` per token `[L]`, `f32`.
    pub rstd1: Buffer,
    /// Attention norm output `[L, C]`: the input of the Q, K and V projections.
    pub h1: Buffer,
    /// Rotated queries `[1, Hq, L, D]`.
    pub q: Buffer,
    /// Rotated keys `[1, Hkv, L, D]`.
    pub k: Buffer,
    /// Values `[1, Hkv, L, D]`.
    pub v: Buffer,
    /// Attention output `[1, Hq, L, D]` (the output projection's input, transposed back in the backward).
    pub o: Buffer,
    /// Attention log-sum-exp `[1, Hq, L]`, `f32`.
    pub lse: Buffer,
    /// The residual after attention `[L, C]`: the MLP norm's input.
    pub x2: Buffer,
    /// MLP norm: `1/rms` per token `[L]`, `f32`.
    pub rstd2: Buffer,
    /// MLP norm output `[L, C]`: the gate and up projections' input.
    pub h2: Buffer,
    /// Gate projection `[L, F]`.
    pub gate: Buffer,
    /// Up projection `[L, F]`.
    pub up: Buffer,
    /// SwiGLU output `[L, F]`: the down projection's input.
    pub act: Buffer,
}

impl LayerSaved {
    /// The fields with their names, for recompute and offload policies.
    pub fn fields(&self) -> [(&'static str, &Buffer); 14] {
        [
            ("x", &self.x),
            ("rstd1", &self.rstd1),
            ("h1", &self.h1),
            ("q", &self.q),
            ("k", &self.k),
            ("v", &self.v),
            ("o", &self.o),
            ("lse", &self.lse),
            ("x2", &self.x2),
            ("rstd2", &self.rstd2),
            ("h2", &self.h2),
            ("gate", &self.gate),
            ("up", &self.up),
            ("act", &self.act),
        ]
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.fields().iter().map(|(_, b)| b.bytes()).sum()
    }

    /// Bytes one layer's forward over `l` tokens saves, from the shapes alone (equals [`LayerSaved::bytes`]).
    pub fn bytes_for(cfg: &ModelConfig, l: usize, dtype: DType) -> usize {
        let (c, f, d) = (cfg.d_model, cfg.ffn, cfg.head_dim());
        let attn = longctx_kernels::AttnShape {
            batch: 1,
            q_heads: cfg.heads,
            kv_heads: cfg.kv_heads,
            q_len: l,
            kv_len: l,
            head_dim: d,
        };
        2 * RmsNormSaved::bytes_for(l, c, dtype)
            + 2 * LinearSaved::bytes_for(l, c, dtype)
            + AttnSaved::bytes_for(&attn, dtype)
            + SwigluSaved::bytes_for(l, f, dtype)
            + LinearSaved::bytes_for(l, f, dtype)
    }
}

/// The names of a layer's saved tensors, in [`LayerSaved`] order.
pub const SAVED_NAMES: [&str; 14] =
    ["x", "rstd1", "h1", "q", "k", "v", "o", "lse", "x2", "rstd2", "h2", "gate", "up", "act"];

/// A layer's saved tensors after its recompute policy: each one kept, or dropped to be rebuilt before the
/// backward (fields as in [`LayerSaved`]).
#[derive(Debug, Default)]
#[allow(missing_docs)]
pub struct KeptLayer {
    pub x: Option<Buffer>,
    pub rstd1: Option<Buffer>,
    pub h1: Option<Buffer>,
    pub q: Option<Buffer>,
    pub k: Option<Buffer>,
    pub v: Option<Buffer>,
    pub o: Option<Buffer>,
    pub lse: Option<Buffer>,
    pub x2: Option<Buffer>,
    pub rstd2: Option<Buffer>,
    pub h2: Option<Buffer>,
    pub gate: Option<Buffer>,
    pub up: Option<Buffer>,
    pub act: Option<Buffer>,
    /// Tensors handed to the offload engine, by field name.
    pub away: Vec<(&'static str, Ticket<Activation>)>,
}

impl KeptLayer {
    fn slot(&mut self, name: &str) -> Option<&mut Option<Buffer>> {
        Some(match name {
            "x" => &mut self.x,
            "rstd1" => &mut self.rstd1,
            "h1" => &mut self.h1,
            "q" => &mut self.q,
            "k" => &mut self.k,
            "v" => &mut self.v,
            "o" => &mut self.o,
            "lse" => &mut self.lse,
            "x2" => &mut self.x2,
            "rstd2" => &mut self.rstd2,
            "h2" => &mut self.h2,
            "gate" => &mut self.gate,
            "up" => &mut self.up,
            "act" => &mut self.act,
            _ => return None,
        })
    }

    /// Hands the tensors `which` selects to `engine` (they come back through [`KeptLayer::restore`]).
    fn offload(&mut self, layer: usize, engine: &OffloadEngine, which: impl Fn(&str) -> bool) -> Result<()> {
        for name in SAVED_NAMES {
            if !which(name) {
                continue;
            }
            let Some(buf) = self.slot(name).and_then(Option::take) else { continue };
            let (data, dims) = buf.into_host_vec();
            let t = match data {
                HostVec::F32(v) => HostTensor::f32(v, dims.as_slice().to_vec()),
                HostVec::Bf16(v) => HostTensor::bf16(v, dims.as_slice().to_vec()),
            }
            .map_err(|e| TrainError::Config(format!("offload of layer {layer} `{name}`: {e}")))?;
            let ticket = engine.offload(layer, name, t).map_err(|e| TrainError::Config(format!("offload: {e}")))?;
            self.away.push((name, ticket));
        }
        Ok(())
    }

    /// Fetches back what was offloaded (bit-exact).
    fn restore(&mut self, engine: Option<&OffloadEngine>) -> Result<()> {
        let Some(engine) = engine else { return Ok(()) };
        for (name, ticket) in std::mem::take(&mut self.away) {
            let t = engine.fetch(ticket).map_err(|e| TrainError::Config(format!("offload fetch: {e}")))?;
            let dims = t.dims().to_vec();
            let data = match t.into_f32() {
                Ok(v) => HostVec::F32(v),
                Err(t) => HostVec::Bf16(t.into_bf16().map_err(|_| missing(0, name))?),
            };
            let buf = Buffer::from_host_vec(data, dims)?;
            if let Some(slot) = self.slot(name) {
                *slot = Some(buf);
            }
        }
        Ok(())
    }

    /// Bytes still held.
    pub fn bytes(&self) -> usize {
        [
            &self.x,
            &self.rstd1,
            &self.h1,
            &self.q,
            &self.k,
            &self.v,
            &self.o,
            &self.lse,
            &self.x2,
            &self.rstd2,
            &self.h2,
            &self.gate,
            &self.up,
            &self.act,
        ]
        .iter()
        .map(|b| b.as_ref().map_or(0, Buffer::bytes))
        .sum()
    }
}

impl LayerSaved {
    /// Keeps what `actions` keeps or offloads and frees the rest (the names are [`SAVED_NAMES`]). An
    /// `Offload` action needs an offload engine (`offload_ok`): without one it is an error.
    pub fn keep(self, actions: &LayerActions, offload_ok: bool) -> Result<KeptLayer> {
        let k = |name: &'static str, b: Buffer| -> Result<Option<Buffer>> {
            match actions.of(name) {
                Action::Keep => Ok(Some(b)),
                Action::Recompute => Ok(None),
                Action::Offload if offload_ok => Ok(Some(b)),
                Action::Offload => Err(TrainError::Config(format!(
                    "the recompute policy offloads `{name}`: give the run an offload tier (--offload host|disk)"
                ))),
            }
        };
        let LayerSaved { x, rstd1, h1, q, k: kk, v, o, lse, x2, rstd2, h2, gate, up, act } = self;
        Ok(KeptLayer {
            x: k("x", x)?,
            rstd1: k("rstd1", rstd1)?,
            h1: k("h1", h1)?,
            q: k("q", q)?,
            k: k("k", kk)?,
            v: k("v", v)?,
            o: k("o", o)?,
            lse: k("lse", lse)?,
            x2: k("x2", x2)?,
            rstd2: k("rstd2", rstd2)?,
            h2: k("h2", h2)?,
            gate: k("gate", gate)?,
            up: k("up", up)?,
            act: k("act", act)?,
            away: Vec::new(),
        })
    }
}

fn missing(layer: usize, name: &str) -> TrainError {
    TrainError::Config(format!("layer {layer}: `{name}` was not rebuilt"))
}

/// What the whole forward keeps: each layer's, and the final norm's.
#[derive(Debug)]
pub struct ModelSaved {
    /// Token ids of this rank `[L]` (the embedding's backward).
    pub ids: Vec<u32>,
    /// Per layer, after the recompute policy.
    pub layers: Vec<KeptLayer>,
    /// The last layer's output `[L, C]`: the final norm's input.
    pub x_final: Buffer,
    /// Final norm `1/rms` `[L]`.
    pub rstd_final: Buffer,
    /// Final norm output `[L, C]`: the output projection's input.
    pub h_final: Buffer,
}

impl ModelSaved {
    /// Bytes held by every saved activation.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(KeptLayer::bytes).sum::<usize>()
            + self.x_final.bytes()
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
}

/// The model: its configuration, its weights in the working dtype, and the backend it computes on.
#[derive(Debug)]
pub struct Llama {
    /// Shape.
    pub cfg: ModelConfig,
    /// The working weights (`f32`, or `bf16` copies of the `f32` master weights).
    pub weights: Params,
    backend: Arc<dyn Backend>,
    rope: RopeTable,
    dtype: DType,
    /// What each layer keeps for its backward (everything when empty).
    recompute: Vec<LayerActions>,
    /// Where kept tensors go between a layer's forward and its backward (`None`: they stay).
    offload: Option<Arc<OffloadEngine>>,
}

fn norm(weight: &Buffer, eps: f32) -> NormParams<'_> {
    NormParams { weight: weight.view(), bias: None, eps }
}

impl Llama {
    /// A model with `weights` (working dtype `dtype`) computing on `backend`.
    pub fn new(cfg: ModelConfig, weights: Params, backend: Arc<dyn Backend>) -> Result<Llama> {
        let dtype = weights.tensors.first().map_or(DType::F32, Buffer::dtype);
        let want = param_shapes(&cfg);
        if weights.tensors.len() != want.len() {
            return Err(TrainError::Config(format!("{} tensors for a model of {}", weights.tensors.len(), want.len())));
        }
        for ((name, dims), t) in want.iter().zip(&weights.tensors) {
            if t.dims() != dims.as_slice() || t.dtype() != dtype {
                return Err(TrainError::Config(format!(
                    "tensor {name}: {:?} {} where the model needs {dims:?} {}",
                    t.dims(),
                    t.dtype().name(),
                    dtype.name()
                )));
            }
        }
        // Sequence length 0: the table of the original context (what transformers builds at start-up);
        // `set_sequence_length` rebuilds it for the scalings that depend on the length.
        let rope = RopeTable::new(&rope_config(&cfg, 0))?;
        Ok(Llama { cfg, weights, backend, rope, dtype, recompute: Vec::new(), offload: None })
    }

    /// Builds the rotary table for sequences of `seq_len` tokens (the whole sequence, over every rank).
    /// `dynamic` and `longrope` scalings depend on it: transformers recomputes them per forward from
    /// `max(position) + 1`, which for a run of fixed sequence length is this, every step.
    pub fn set_sequence_length(&mut self, seq_len: usize) -> Result<()> {
        self.rope = RopeTable::new(&rope_config(&self.cfg, seq_len))?;
        Ok(())
    }

    /// Sets what each layer keeps for its backward (one entry per layer, from a
    /// [`longctx_recompute::Policy`]); the gradients do not change, only memory and time.
    pub fn set_recompute(&mut self, per_layer: Vec<LayerActions>) -> Result<()> {
        if !per_layer.is_empty() && per_layer.len() != self.cfg.layers {
            return Err(TrainError::Config(format!(
                "{} recompute entries for {} layers",
                per_layer.len(),
                self.cfg.layers
            )));
        }
        if per_layer.first().is_some_and(|a| a.of("x") == Action::Recompute) {
            return Err(TrainError::Config("the first layer's input (the embedding) cannot be recomputed".into()));
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

    fn w(&self, layer: usize, which: usize) -> &Buffer {
        &self.weights.tensors[1 + layer * PER_LAYER + which]
    }

    fn buf(&self, dims: impl IntoDims) -> Result<Buffer> {
        Ok(self.backend.zeros(self.dtype, dims.into_dims()?)?)
    }

    fn buf_f32(&self, dims: impl IntoDims) -> Result<Buffer> {
        Ok(self.backend.zeros(DType::F32, dims.into_dims()?)?)
    }

    /// One decoder layer: attention block then MLP block, each `x + f(norm(x))`; the segments are those
    /// [`longctx_recompute::llama_layer`] describes, and a rebuild before the backward reruns the same ones.
    fn layer_forward(&self, layer: usize, x: Buffer, plan: &mut CpPlan, pos: &[i64]) -> Result<(Buffer, LayerSaved)> {
        let (rstd1, h1) = self.attn_norm(layer, &x)?;
        let (q, k, v) = self.qkv_proj(layer, &h1, pos)?;
        let (o, lse) = self.core_attn(&q, &k, &v, plan)?;
        let x2 = self.o_proj(layer, &o, &x)?;
        let (rstd2, h2) = self.mlp_norm(layer, &x2)?;
        let (gate, up) = self.gate_up(layer, &h2)?;
        let act = self.swiglu(&gate, &up)?;
        let out = self.down_proj(layer, &act, &x2)?;
        Ok((out, LayerSaved { x, rstd1, h1, q, k, v, o, lse, x2, rstd2, h2, gate, up, act }))
    }

    /// `h1 = rmsnorm(x)`.
    fn attn_norm(&self, layer: usize, x: &Buffer) -> Result<(Buffer, Buffer)> {
        let l = x.dims()[0];
        let (mut h1, mut rstd1) = (self.buf([l, self.cfg.d_model])?, self.buf_f32([l])?);
        let p = norm(self.w(layer, ATTN_NORM), self.cfg.norm_eps);
        self.backend.rmsnorm_forward(h1.view_mut(), rstd1.view_mut(), x.view(), &p)?;
        Ok((rstd1, h1))
    }

    /// `q, k, v` from `h1`, head-major, `q` and `k` rotated.
    fn qkv_proj(&self, layer: usize, h1: &Buffer, pos: &[i64]) -> Result<(Buffer, Buffer, Buffer)> {
        let b = &*self.backend;
        let (l, d, hq, hkv) = (h1.dims()[0], self.cfg.head_dim(), self.cfg.heads, self.cfg.kv_heads);
        let w = |i| self.w(layer, i);
        let (mut q_t, mut k_t, mut v_t) = (self.buf([l, hq * d])?, self.buf([l, hkv * d])?, self.buf([l, hkv * d])?);
        let (mut q, mut k, mut v) = (self.buf([1, hq, l, d])?, self.buf([1, hkv, l, d])?, self.buf([1, hkv, l, d])?);
        b.linear_forward(q_t.view_mut(), h1.view(), w(WQ).view(), None)?;
        b.linear_forward(k_t.view_mut(), h1.view(), w(WK).view(), None)?;
        b.linear_forward(v_t.view_mut(), h1.view(), w(WV).view(), None)?;
        b.transpose12(q.view_mut(), q_t.view().reshape([1, l, hq, d])?)?;
        b.transpose12(k.view_mut(), k_t.view().reshape([1, l, hkv, d])?)?;
        b.transpose12(v.view_mut(), v_t.view().reshape([1, l, hkv, d])?)?;
        b.rope_forward_inplace(&self.rope, q.view_mut(), pos)?;
        b.rope_forward_inplace(&self.rope, k.view_mut(), pos)?;
        Ok((q, k, v))
    }

    /// `o, lse` = attention over the whole sequence, through the context-parallel plan.
    fn core_attn(&self, q: &Buffer, k: &Buffer, v: &Buffer, plan: &mut CpPlan) -> Result<(Buffer, Buffer)> {
        let (hq, l) = (q.dims()[1], q.dims()[2]);
        let (mut o, mut lse) = (self.buf(q.dims())?, self.buf_f32([1, hq, l])?);
        plan.forward(AttnOut { o: o.view_mut(), lse: lse.view_mut() }, Qkv::new(q.view(), k.view(), v.view()))?;
        Ok((o, lse))
    }

    /// `x2 = x + o·Woᵀ` (o transposed back to token-major).
    fn o_proj(&self, layer: usize, o: &Buffer, x: &Buffer) -> Result<Buffer> {
        let b = &*self.backend;
        let (hq, l, d, c) = (o.dims()[1], o.dims()[2], o.dims()[3], self.cfg.d_model);
        let (mut o_t, mut attn_out, mut x2) = (self.buf([1, l, hq, d])?, self.buf([l, c])?, self.buf([l, c])?);
        b.transpose12(o_t.view_mut(), o.view())?;
        b.linear_forward(attn_out.view_mut(), o_t.view().reshape([l, hq * d])?, self.w(layer, WO).view(), None)?;
        b.copy(x2.view_mut(), x.view())?;
        b.add(x2.view_mut(), attn_out.view())?;
        Ok(x2)
    }

    /// `h2 = rmsnorm(x2)`.
    fn mlp_norm(&self, layer: usize, x2: &Buffer) -> Result<(Buffer, Buffer)> {
        let l = x2.dims()[0];
        let (mut h2, mut rstd2) = (self.buf([l, self.cfg.d_model])?, self.buf_f32([l])?);
        let p = norm(self.w(layer, MLP_NORM), self.cfg.norm_eps);
        self.backend.rmsnorm_forward(h2.view_mut(), rstd2.view_mut(), x2.view(), &p)?;
        Ok((rstd2, h2))
    }

    /// `gate, up` projections of `h2`.
    fn gate_up(&self, layer: usize, h2: &Buffer) -> Result<(Buffer, Buffer)> {
        let (l, f) = (h2.dims()[0], self.cfg.ffn);
        let (mut gate, mut up) = (self.buf([l, f])?, self.buf([l, f])?);
        self.backend.linear_forward(gate.view_mut(), h2.view(), self.w(layer, W_GATE).view(), None)?;
        self.backend.linear_forward(up.view_mut(), h2.view(), self.w(layer, W_UP).view(), None)?;
        Ok((gate, up))
    }

    /// `act = silu(gate) ∘ up`.
    fn swiglu(&self, gate: &Buffer, up: &Buffer) -> Result<Buffer> {
        let mut act = self.buf(gate.dims())?;
        self.backend.swiglu_forward(act.view_mut(), gate.view(), up.view())?;
        Ok(act)
    }

    /// The layer's output `x2 + act·Wdownᵀ`.
    fn down_proj(&self, layer: usize, act: &Buffer, x2: &Buffer) -> Result<Buffer> {
        let (l, c) = (act.dims()[0], self.cfg.d_model);
        let (mut mlp_out, mut out) = (self.buf([l, c])?, self.buf([l, c])?);
        self.backend.linear_forward(mlp_out.view_mut(), act.view(), self.w(layer, W_DOWN).view(), None)?;
        self.backend.copy(out.view_mut(), x2.view())?;
        self.backend.add(out.view_mut(), mlp_out.view())?;
        Ok(out)
    }

    /// Reruns, in forward order, every segment whose outputs the policy dropped, from what was kept: the same
    /// ops on the same inputs, so the rebuilt tensors are bit-identical to the forward's.
    fn rebuild(&self, layer: usize, k: KeptLayer, plan: &mut CpPlan, pos: &[i64]) -> Result<LayerSaved> {
        let KeptLayer {
            x,
            mut rstd1,
            mut h1,
            mut q,
            mut k,
            mut v,
            mut o,
            mut lse,
            mut x2,
            mut rstd2,
            mut h2,
            mut gate,
            mut up,
            mut act,
            away,
        } = k;
        if !away.is_empty() {
            return Err(missing(layer, away[0].0));
        }
        let x =
            x.ok_or_else(|| TrainError::Config(format!("layer {layer}: its input was neither kept nor rebuilt")))?;
        if rstd1.is_none() || h1.is_none() {
            let (r, h) = self.attn_norm(layer, &x)?;
            (rstd1, h1) = (Some(r), Some(h));
        }
        let h1 = h1.ok_or_else(|| missing(layer, "h1"))?;
        if q.is_none() || k.is_none() || v.is_none() {
            let (a, b, c) = self.qkv_proj(layer, &h1, pos)?;
            (q, k, v) = (Some(a), Some(b), Some(c));
        }
        let (q, k, v) = (
            q.ok_or_else(|| missing(layer, "q"))?,
            k.ok_or_else(|| missing(layer, "k"))?,
            v.ok_or_else(|| missing(layer, "v"))?,
        );
        if o.is_none() || lse.is_none() {
            let (a, b) = self.core_attn(&q, &k, &v, plan)?;
            (o, lse) = (Some(a), Some(b));
        }
        let o = o.ok_or_else(|| missing(layer, "o"))?;
        if x2.is_none() {
            x2 = Some(self.o_proj(layer, &o, &x)?);
        }
        let x2 = x2.ok_or_else(|| missing(layer, "x2"))?;
        if rstd2.is_none() || h2.is_none() {
            let (r, h) = self.mlp_norm(layer, &x2)?;
            (rstd2, h2) = (Some(r), Some(h));
        }
        let h2 = h2.ok_or_else(|| missing(layer, "h2"))?;
        if gate.is_none() || up.is_none() {
            let (g, u) = self.gate_up(layer, &h2)?;
            (gate, up) = (Some(g), Some(u));
        }
        let (gate, up) = (gate.ok_or_else(|| missing(layer, "gate"))?, up.ok_or_else(|| missing(layer, "up"))?);
        if act.is_none() {
            act = Some(self.swiglu(&gate, &up)?);
        }
        Ok(LayerSaved {
            x,
            rstd1: rstd1.ok_or_else(|| missing(layer, "rstd1"))?,
            h1,
            q,
            k,
            v,
            o,
            lse: lse.ok_or_else(|| missing(layer, "lse"))?,
            x2,
            rstd2: rstd2.ok_or_else(|| missing(layer, "rstd2"))?,
            h2,
            gate,
            up,
            act: act.ok_or_else(|| missing(layer, "act"))?,
        })
    }

    /// The layer's backward: `dout` `[L, C]` in, the input's gradient out; weight gradients into `grads`
    /// (per `mode`).
    fn layer_backward(
        &self,
        layer: usize,
        dout: &Buffer,
        s: &LayerSaved,
        (grads, mode): (&mut Params, GradMode),
        plan: &mut CpPlan,
        pos: &[i64],
    ) -> Result<Buffer> {
        let b = &*self.backend;
        let cfg = &self.cfg;
        let (l, c, f, d, hq, hkv) = (s.x.dims()[0], cfg.d_model, cfg.ffn, cfg.head_dim(), cfg.heads, cfg.kv_heads);
        let w = |i| self.w(layer, i);
        let base = 1 + layer * PER_LAYER;
        let (mut dact, mut dgate, mut dup) = (self.buf([l, f])?, self.buf([l, f])?, self.buf([l, f])?);
        let (mut dh2, mut dh2_up, mut dx2) = (self.buf([l, c])?, self.buf([l, c])?, self.buf([l, c])?);
        let (mut o_t, mut do_t, mut d_o) = (self.buf([1, l, hq, d])?, self.buf([l, hq * d])?, self.buf([1, hq, l, d])?);
        let (mut dq, mut dk, mut dv) = (self.buf([1, hq, l, d])?, self.buf([1, hkv, l, d])?, self.buf([1, hkv, l, d])?);
        let (mut dq_t, mut dk_t, mut dv_t) =
            (self.buf([1, l, hq, d])?, self.buf([1, l, hkv, d])?, self.buf([1, l, hkv, d])?);
        let (mut dh1, mut dh1_kv, mut dx) = (self.buf([l, c])?, self.buf([l, c])?, self.buf([l, c])?);
        let g = |i: usize| base + i;
        macro_rules! dw {
            ($i:expr) => {
                grads.tensors[g($i)].view_mut()
            };
        }

        // MLP block, reversed.
        b.linear_backward(
            lg(Some(dact.view_mut()), dw!(W_DOWN)),
            dout.view(),
            saved_x(&s.act),
            w(W_DOWN).view(),
            mode,
        )?;
        b.swiglu_backward(
            dgate.view_mut(),
            dup.view_mut(),
            dact.view(),
            SwigluSaved { gate: s.gate.view(), up: s.up.view() },
        )?;
        b.linear_backward(lg(Some(dh2.view_mut()), dw!(W_GATE)), dgate.view(), saved_x(&s.h2), w(W_GATE).view(), mode)?;
        b.linear_backward(lg(Some(dh2_up.view_mut()), dw!(W_UP)), dup.view(), saved_x(&s.h2), w(W_UP).view(), mode)?;
        b.add(dh2.view_mut(), dh2_up.view())?;
        b.rmsnorm_backward(
            ng(dx2.view_mut(), dw!(MLP_NORM)),
            dh2.view(),
            rms_saved(&s.x2, &s.rstd2),
            w(MLP_NORM).view(),
            mode,
        )?;
        b.add(dx2.view_mut(), dout.view())?;

        // Attention block, reversed.
        b.transpose12(o_t.view_mut(), s.o.view())?;
        let o_flat = o_t.view().reshape([l, hq * d])?;
        b.linear_backward(
            lg(Some(do_t.view_mut()), dw!(WO)),
            dx2.view(),
            LinearSaved { x: o_flat },
            w(WO).view(),
            mode,
        )?;
        b.transpose12(d_o.view_mut(), do_t.view().reshape([1, l, hq, d])?)?;
        let saved = AttnSaved { qkv: Qkv::new(s.q.view(), s.k.view(), s.v.view()), o: s.o.view(), lse: s.lse.view() };
        plan.backward(AttnGrads { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut() }, d_o.view(), saved)?;
        b.rope_backward_inplace(&self.rope, dq.view_mut(), pos)?;
        b.rope_backward_inplace(&self.rope, dk.view_mut(), pos)?;
        b.transpose12(dq_t.view_mut(), dq.view())?;
        b.transpose12(dk_t.view_mut(), dk.view())?;
        b.transpose12(dv_t.view_mut(), dv.view())?;
        let (dq_t, dk_t, dv_t) =
            (dq_t.view().reshape([l, hq * d])?, dk_t.view().reshape([l, hkv * d])?, dv_t.view().reshape([l, hkv * d])?);
        b.linear_backward(lg(Some(dh1.view_mut()), dw!(WQ)), dq_t, saved_x(&s.h1), w(WQ).view(), mode)?;
        b.linear_backward(lg(Some(dh1_kv.view_mut()), dw!(WK)), dk_t, saved_x(&s.h1), w(WK).view(), mode)?;
        b.add(dh1.view_mut(), dh1_kv.view())?;
        b.linear_backward(lg(Some(dh1_kv.view_mut()), dw!(WV)), dv_t, saved_x(&s.h1), w(WV).view(), mode)?;
        b.add(dh1.view_mut(), dh1_kv.view())?;
        b.rmsnorm_backward(
            ng(dx.view_mut(), dw!(ATTN_NORM)),
            dh1.view(),
            rms_saved(&s.x, &s.rstd1),
            w(ATTN_NORM).view(),
            mode,
        )?;
        b.add(dx.view_mut(), dx2.view())?;
        Ok(dx)
    }

    /// The forward over this rank's tokens `ids` (at the global positions `plan.positions()`), keeping what the
    /// backward needs.
    pub fn forward(&self, ids: &[u32], plan: &mut CpPlan) -> Result<ModelSaved> {
        let b = &*self.backend;
        let (l, c) = (ids.len(), self.cfg.d_model);
        let pos = plan.positions().to_vec();
        let mut x = self.buf([l, c])?;
        b.embedding_forward(x.view_mut(), ids, self.weights.tensors[0].view())?;
        let mut layers = Vec::with_capacity(self.cfg.layers);
        let keep_all = LayerActions::keep_all();
        let marks_offload = self.recompute.iter().any(|a| a.actions.values().any(|&v| v == Action::Offload));
        for layer in 0..self.cfg.layers {
            let (out, saved) = self.layer_forward(layer, x, plan, &pos)?;
            let actions = self.recompute.get(layer).unwrap_or(&keep_all);
            let mut kept = saved.keep(actions, self.offload.is_some())?;
            if let Some(engine) = &self.offload {
                kept.offload(layer, engine, |name| !marks_offload || actions.of(name) == Action::Offload)?;
            }
            layers.push(kept);
            x = out;
        }
        let (mut h_final, mut rstd_final) = (self.buf([l, c])?, self.buf_f32([l])?);
        let final_norm = &self.weights.tensors[1 + self.cfg.layers * PER_LAYER];
        b.rmsnorm_forward(h_final.view_mut(), rstd_final.view_mut(), x.view(), &norm(final_norm, self.cfg.norm_eps))?;
        Ok(ModelSaved { ids: ids.to_vec(), layers, x_final: x, rstd_final, h_final })
    }

    /// The loss of `loss.targets` and the whole backward: gradients are written into `grads` (overwriting them
    /// with [`GradMode::Overwrite`], adding with [`GradMode::Accumulate`]), scaled so that the losses summed
    /// over every rank, divided by `loss.denominator`, are the mean loss.
    pub fn loss_and_backward(
        &self,
        saved: ModelSaved,
        loss: &LossSpec<'_>,
        grads: &mut Params,
        mode: GradMode,
        plan: &mut CpPlan,
    ) -> Result<LocalLoss> {
        let b = &*self.backend;
        let (l, c, n) = (saved.ids.len(), self.cfg.d_model, self.weights.tensors.len());
        let pos = plan.positions().to_vec();
        let targets = loss.targets;
        let opts =
            CrossEntropyOptions { chunk_tokens: loss.chunk, denominator: Some(loss.denominator), ..Default::default() };
        let (mut dh_final, mut dx) = (self.buf([l, c])?, self.buf([l, c])?);
        let final_norm = 1 + self.cfg.layers * PER_LAYER;

        let lm = {
            let dweight = grads.tensors[n - 1].view_mut();
            let g = ProjectionGrads { dhidden: dh_final.view_mut(), dweight };
            b.cross_entropy_fused(g, saved.h_final.view(), self.weights.tensors[n - 1].view(), targets, &opts, mode)?
        };
        let rs = rms_saved(&saved.x_final, &saved.rstd_final);
        let nw = self.weights.tensors[final_norm].view();
        b.rmsnorm_backward(ng(dx.view_mut(), grads.tensors[final_norm].view_mut()), dh_final.view(), rs, nw, mode)?;
        let ids = saved.ids;
        let mut kept: Vec<Option<KeptLayer>> = saved.layers.into_iter().map(Some).collect();
        let mut rebuilt: Vec<Option<LayerSaved>> = (0..kept.len()).map(|_| None).collect();
        let engine = self.offload.clone();
        for layer in (0..kept.len()).rev() {
            if let Some(e) = &engine {
                e.backward_started(layer);
            }
            let s = match rebuilt[layer].take() {
                Some(s) => s,
                None => {
                    let mut k = kept[layer].take().ok_or_else(|| missing(layer, "saved tensors"))?;
                    k.restore(engine.as_deref())?;
                    if k.x.is_some() {
                        self.rebuild(layer, k, plan, &pos)?
                    } else {
                        // `uniform`: replay the chunk's forward from its first layer's input.
                        let has_x = |k: &KeptLayer| k.x.is_some() || k.away.iter().any(|(n, _)| *n == "x");
                        let start = (0..layer).rev().find(|&i| kept[i].as_ref().is_some_and(has_x));
                        let start = start.ok_or_else(|| missing(layer, "x (no earlier layer kept its input)"))?;
                        if let Some(k) = kept[start].as_mut() {
                            k.restore(engine.as_deref())?;
                        }
                        let mut x = kept[start].as_mut().and_then(|k| k.x.take()).ok_or_else(|| missing(start, "x"))?;
                        for i in start..layer {
                            kept[i] = None;
                            let (out, s) = self.layer_forward(i, x, plan, &pos)?;
                            rebuilt[i] = Some(s);
                            x = out;
                        }
                        self.layer_forward(layer, x, plan, &pos)?.1
                    }
                }
            };
            dx = self.layer_backward(layer, &dx, &s, (grads, mode), plan, &pos)?;
        }
        b.embedding_backward(grads.tensors[0].view_mut(), dx.view(), &ids, mode)?;
        Ok(LocalLoss { sum: lm.loss_sum, tokens: lm.n_valid })
    }

    /// The loss alone (held-out evaluation): the forward, and the output projection's loss with its gradients
    /// written to scratch.
    pub fn loss(&self, ids: &[u32], targets: &[i64], loss_chunk: usize, plan: &mut CpPlan) -> Result<LocalLoss> {
        let b = &*self.backend;
        let saved = self.forward(ids, plan)?;
        let n = self.weights.tensors.len();
        let (l, c, v) = (ids.len(), self.cfg.d_model, self.cfg.vocab);
        let (mut dh, mut dw) = (self.buf([l, c])?, self.buf_f32([v, c])?);
        let opts = CrossEntropyOptions { chunk_tokens: loss_chunk, denominator: Some(1.0), ..Default::default() };
        let g = ProjectionGrads { dhidden: dh.view_mut(), dweight: dw.view_mut() };
        let out = b.cross_entropy_fused(
            g,
            saved.h_final.view(),
            self.weights.tensors[n - 1].view(),
            targets,
            &opts,
            GradMode::Overwrite,
        )?;
        Ok(LocalLoss { sum: out.loss_sum, tokens: out.n_valid })
    }
}

fn lg<'a>(dx: Option<longctx_kernels::ViewMut<'a>>, dw: longctx_kernels::ViewMut<'a>) -> LinearGrads<'a> {
    LinearGrads { dx, dw, dbias: None }
}

fn ng<'a>(dx: longctx_kernels::ViewMut<'a>, dweight: longctx_kernels::ViewMut<'a>) -> NormGrads<'a> {
    NormGrads { dx, dweight, dbias: None }
}

fn saved_x(x: &Buffer) -> LinearSaved<'_> {
    LinearSaved { x: x.view() }
}

fn rms_saved<'a>(x: &'a Buffer, rstd: &'a Buffer) -> RmsNormSaved<'a> {
    RmsNormSaved { x: x.view(), rstd: rstd.view() }
}
