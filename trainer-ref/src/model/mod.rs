//! The decoder of every [`Family`]: Llama 3 (RMSNorm, RoPE with Llama 3 frequency scaling, grouped-query
//! attention through context-parallel ring attention, a SwiGLU MLP), Mixtral (the same layer with a top-k mixture
//! of SwiGLU experts and a load-balancing loss, [`moe`]) and Nemotron-4 (LayerNorm with zero-centred weight and
//! bias, partial RoPE, a squared-ReLU MLP); embeddings untied or tied, and the output projection fused with the
//! loss in chunks of tokens, so `[tokens, vocab]` logits never exist at once.
//!
//! One model, not three: the families share the attention block and differ in their norms and MLP, which the
//! layer's forward, rebuild and backward choose by the tensors' layout (the private `layout` module's `MlpIx`,
//! a norm with or without a bias), so the recompute and offload machinery below serves every family unchanged.
//!
//! Every computation is a call of the [`Backend`] the model was given, on buffers the backend allocated: a CUDA
//! backend changes nothing here. Each layer's forward returns what its backward needs as a named struct
//! ([`LayerSaved`]) whose size follows from the shapes ([`LayerSaved::bytes_for`]), the contract activation
//! recomputation and offload decide on. The backward is the forward read in reverse, one op per line
//! (llm.c's `gpt2_backward`).
//!
//! Shapes: `L` tokens on this rank, `C` the model width, `Hq`/`Hkv` query and KV heads of width `D`, `F` the MLP
//! width (of one expert), `V` the vocabulary, `E` experts, `K` experts per token, `N = L·K` tokens dispatched to
//! experts. Activations are `[L, C]` token-major; attention works head-major `[1, H, L, D]`.

mod layout;
pub mod moe;

use std::sync::Arc;

use longctx_kernels::HostVec;
use longctx_kernels::{
    AttnGrads, AttnOut, AttnSaved, Backend, Buffer, CrossEntropyOptions, DType, Dims, GradMode, IntoDims,
    LayerNormSaved, LinearGrads, LinearSaved, MoeRouterSaved, NormGrads, NormParams, ProjectionGrads, Qkv,
    RmsNormSaved, RopeTable, Routing, SquaredReluSaved, SwigluSaved, View,
};
use longctx_offload::{Activation, HostTensor, OffloadEngine, Ticket};
use longctx_recompute::{Action, LayerActions};
use longctx_ring_attn::CpPlan;

use crate::error::{Result, TrainError};
use crate::recipe::{Family, ModelConfig};
pub use layout::param_shapes;
use layout::{Layout, MlpIx, NormIx};
pub use moe::MoeStats;

/// The model's tensors (weights, or their gradients, or an optimizer moment), one buffer each, named as in a
/// Hugging Face checkpoint of the family, in a fixed order (see [`param_shapes`]).
#[derive(Debug)]
pub struct Params {
    /// Hugging Face names (`model.layers.3.self_attn.q_proj.weight`).
    pub names: Vec<String>,
    /// One buffer per name.
    pub tensors: Vec<Buffer>,
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

    /// The initial weights (`f32`): norms 1 (Nemotron's zero-centred LayerNorm weights 0, so effectively 1, and
    /// biases 0), matrices normal with `init_std` (residual output projections divided by `√(2·layers)`, GPT-2's
    /// rule), from a generator seeded by `seed` alone, so every rank draws the same weights.
    pub fn init(backend: &dyn Backend, cfg: &ModelConfig, seed: u64) -> Result<Params> {
        let mut p = Params::zeros(backend, cfg, DType::F32)?;
        let mut rng = Rng::new(seed);
        let resid = cfg.init_std / ((2 * cfg.layers) as f32).sqrt();
        let zero_centred = cfg.family == Family::Nemotron;
        for (name, t) in p.names.iter().zip(p.tensors.iter_mut()) {
            let host: Vec<f32> = if t.dims().len() == 1 {
                let one = if zero_centred || name.ends_with(".bias") { 0.0 } else { 1.0 };
                vec![one; t.len()]
            } else {
                let residual = ["o_proj.weight", "down_proj.weight", ".w2.weight"].iter().any(|s| name.ends_with(s));
                let std = if residual { resid } else { cfg.init_std };
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
/// the op that made them. The `Option` fields belong to some families only (`None` in the others): LayerNorm's
/// means (Nemotron), the gate (Llama, Mixtral), the router's and experts' tensors (Mixtral). In a Mixtral layer
/// `gate`, `up` and `act` hold the `N = L·K` dispatched rows, grouped by expert.
#[derive(Debug)]
pub struct LayerSaved {
    /// The layer's input `[L, C]` (saved by the attention norm and the residual).
    pub x: Buffer,
    /// Attention LayerNorm: mean per token `[L]`, `f32` (Nemotron).
    pub mean1: Option<Buffer>,
    /// Attention norm: `1/rms` (or LayerNorm's `1/std`) per token `[L]`, `f32`.
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
    /// MLP LayerNorm: mean per token `[L]`, `f32` (Nemotron).
    pub mean2: Option<Buffer>,
    /// MLP norm: `1/rms` (or `1/std`) per token `[L]`, `f32`.
    pub rstd2: Buffer,
    /// MLP norm output `[L, C]`: the MLP's (and the router's) input.
    pub h2: Buffer,
    /// Router probabilities `[L, E]`, `f32` (Mixtral).
    pub router_probs: Option<Buffer>,
    /// Each token's renormalised top-k weights `[L, K]`, `f32` (Mixtral).
    pub topk_w: Option<Buffer>,
    /// Which experts each token goes to and the dispatch order (Mixtral; host metadata).
    pub routing: Option<Routing>,
    /// Gate projection `[L, F]` (`[N, F]` for the experts' `w1`); not in Nemotron's MLP.
    pub gate: Option<Buffer>,
    /// Up projection `[L, F]` (`[N, F]`, the experts' `w3`): the activation's input.
    pub up: Buffer,
    /// SwiGLU or squared-ReLU output `[L, F]` (`[N, F]`): the down projection's input.
    pub act: Buffer,
    /// The experts' outputs `[N, C]` before their weighted sum (Mixtral).
    pub ye: Option<Buffer>,
}

/// The names of a layer's saved tensors (all families), in [`LayerSaved`] order; `routing` is metadata.
pub const SAVED_NAMES: [&str; 20] = [
    "x",
    "mean1",
    "rstd1",
    "h1",
    "q",
    "k",
    "v",
    "o",
    "lse",
    "x2",
    "mean2",
    "rstd2",
    "h2",
    "router_probs",
    "topk_w",
    "routing",
    "gate",
    "up",
    "act",
    "ye",
];

impl LayerSaved {
    /// The buffers with their names, for recompute and offload policies (the family's only).
    pub fn fields(&self) -> Vec<(&'static str, &Buffer)> {
        let all: [(&'static str, Option<&Buffer>); 19] = [
            ("x", Some(&self.x)),
            ("mean1", self.mean1.as_ref()),
            ("rstd1", Some(&self.rstd1)),
            ("h1", Some(&self.h1)),
            ("q", Some(&self.q)),
            ("k", Some(&self.k)),
            ("v", Some(&self.v)),
            ("o", Some(&self.o)),
            ("lse", Some(&self.lse)),
            ("x2", Some(&self.x2)),
            ("mean2", self.mean2.as_ref()),
            ("rstd2", Some(&self.rstd2)),
            ("h2", Some(&self.h2)),
            ("router_probs", self.router_probs.as_ref()),
            ("topk_w", self.topk_w.as_ref()),
            ("gate", self.gate.as_ref()),
            ("up", Some(&self.up)),
            ("act", Some(&self.act)),
            ("ye", self.ye.as_ref()),
        ];
        all.into_iter().filter_map(|(n, b)| b.map(|b| (n, b))).collect()
    }

    /// Bytes held (buffers and routing metadata).
    pub fn bytes(&self) -> usize {
        self.fields().iter().map(|(_, b)| b.bytes()).sum::<usize>() + self.routing.as_ref().map_or(0, Routing::bytes)
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
        let norms = if cfg.family == Family::Nemotron {
            2 * LayerNormSaved::bytes_for(l, c, dtype)
        } else {
            2 * RmsNormSaved::bytes_for(l, c, dtype)
        };
        let mlp = match (cfg.family, cfg.experts()) {
            (Family::Nemotron, _) => SquaredReluSaved::bytes_for(l, f, dtype) + LinearSaved::bytes_for(l, f, dtype),
            (Family::Mixtral, Some(m)) => {
                let n = l * m.top_k;
                MoeRouterSaved::bytes_for(l, m.experts, m.top_k)
                    + SwigluSaved::bytes_for(n, f, dtype)
                    + LinearSaved::bytes_for(n, f, dtype)
                    + n * c * dtype.size()
            }
            _ => SwigluSaved::bytes_for(l, f, dtype) + LinearSaved::bytes_for(l, f, dtype),
        };
        norms + 2 * LinearSaved::bytes_for(l, c, dtype) + AttnSaved::bytes_for(&attn, dtype) + mlp
    }
}

/// A layer's saved tensors after its recompute policy: each one kept, or dropped to be rebuilt before the
/// backward (fields as in [`LayerSaved`]; a family's absent tensors stay `None`).
#[derive(Debug, Default)]
#[allow(missing_docs)]
pub struct KeptLayer {
    pub x: Option<Buffer>,
    pub mean1: Option<Buffer>,
    pub rstd1: Option<Buffer>,
    pub h1: Option<Buffer>,
    pub q: Option<Buffer>,
    pub k: Option<Buffer>,
    pub v: Option<Buffer>,
    pub o: Option<Buffer>,
    pub lse: Option<Buffer>,
    pub x2: Option<Buffer>,
    pub mean2: Option<Buffer>,
    pub rstd2: Option<Buffer>,
    pub h2: Option<Buffer>,
    pub router_probs: Option<Buffer>,
    pub topk_w: Option<Buffer>,
    /// Host metadata: kept unless the policy recomputes `routing` (offloading it keeps it in place).
    pub routing: Option<Routing>,
    pub gate: Option<Buffer>,
    pub up: Option<Buffer>,
    pub act: Option<Buffer>,
    pub ye: Option<Buffer>,
    /// Tensors handed to the offload engine, by field name.
    pub away: Vec<(&'static str, Ticket<Activation>)>,
}

impl KeptLayer {
    fn slot(&mut self, name: &str) -> Option<&mut Option<Buffer>> {
        Some(match name {
            "x" => &mut self.x,
            "mean1" => &mut self.mean1,
            "rstd1" => &mut self.rstd1,
            "h1" => &mut self.h1,
            "q" => &mut self.q,
            "k" => &mut self.k,
            "v" => &mut self.v,
            "o" => &mut self.o,
            "lse" => &mut self.lse,
            "x2" => &mut self.x2,
            "mean2" => &mut self.mean2,
            "rstd2" => &mut self.rstd2,
            "h2" => &mut self.h2,
            "router_probs" => &mut self.router_probs,
            "topk_w" => &mut self.topk_w,
            "gate" => &mut self.gate,
            "up" => &mut self.up,
            "act" => &mut self.act,
            "ye" => &mut self.ye,
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
            // The offload engine takes host tensors: a device buffer would need the backend's copy into its pool,
            // which this glue does not make yet.
            let (data, dims) = buf.into_host_vec().map_err(|b| {
                TrainError::Config(format!("offload of layer {layer} `{name}`: a buffer in {} memory", b.memory()))
            })?;
            let t = match data {
                HostVec::F32(v) => HostTensor::f32(v, dims.as_slice().to_vec()),
                HostVec::Bf16(v) => HostTensor::bf16(v, dims.as_slice().to_vec()),
                HostVec::F16(_) => {
                    return Err(TrainError::Config(format!(
                        "offload of layer {layer} `{name}`: the model holds f32 or bf16 tensors, not f16"
                    )))
                }
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
            &self.mean1,
            &self.rstd1,
            &self.h1,
            &self.q,
            &self.k,
            &self.v,
            &self.o,
            &self.lse,
            &self.x2,
            &self.mean2,
            &self.rstd2,
            &self.h2,
            &self.router_probs,
            &self.topk_w,
            &self.gate,
            &self.up,
            &self.act,
            &self.ye,
        ]
        .iter()
        .map(|b| b.as_ref().map_or(0, Buffer::bytes))
        .sum::<usize>()
            + self.routing.as_ref().map_or(0, Routing::bytes)
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
        let opt = |name: &'static str, b: Option<Buffer>| -> Result<Option<Buffer>> {
            match b {
                Some(b) => k(name, b),
                None => Ok(None),
            }
        };
        let LayerSaved {
            x,
            mean1,
            rstd1,
            h1,
            q,
            k: kk,
            v,
            o,
            lse,
            x2,
            mean2,
            rstd2,
            h2,
            router_probs,
            topk_w,
            routing,
            gate,
            up,
            act,
            ye,
        } = self;
        Ok(KeptLayer {
            x: k("x", x)?,
            mean1: opt("mean1", mean1)?,
            rstd1: k("rstd1", rstd1)?,
            h1: k("h1", h1)?,
            q: k("q", q)?,
            k: k("k", kk)?,
            v: k("v", v)?,
            o: k("o", o)?,
            lse: k("lse", lse)?,
            x2: k("x2", x2)?,
            mean2: opt("mean2", mean2)?,
            rstd2: k("rstd2", rstd2)?,
            h2: k("h2", h2)?,
            router_probs: opt("router_probs", router_probs)?,
            topk_w: opt("topk_w", topk_w)?,
            routing: routing.filter(|_| actions.of("routing") != Action::Recompute),
            gate: opt("gate", gate)?,
            up: k("up", up)?,
            act: k("act", act)?,
            ye: opt("ye", ye)?,
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
        self.layers.iter().map(KeptLayer::bytes).sum::<usize>()
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
    /// What each layer keeps for its backward (everything when empty).
    recompute: Vec<LayerActions>,
    /// Where kept tensors go between a layer's forward and its backward (`None`: they stay).
    offload: Option<Arc<OffloadEngine>>,
}

/// The first name the trainer gave its model, when it had one family.
pub type Llama = Model;

fn norm(weight: &Buffer, eps: f32) -> NormParams<'_> {
    NormParams { weight: weight.view(), bias: None, eps }
}

/// A norm's three outputs: LayerNorm's mean (`None` for RMSNorm), `1/rms` or `1/std`, and the normalised rows.
type NormOut = (Option<Buffer>, Buffer, Buffer);

impl Model {
    /// A model with `weights` (working dtype `dtype`) computing on `backend`.
    pub fn new(cfg: ModelConfig, weights: Params, backend: Arc<dyn Backend>) -> Result<Model> {
        let dtype = weights.tensors.first().map_or(DType::F32, Buffer::dtype);
        let ix = Layout::new(&cfg);
        let want = &ix.shapes;
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
        let rope = rope_table(&cfg, 0)?;
        let ones = if cfg.family == Family::Nemotron {
            let mut o = backend.zeros(dtype, Dims::new(&[cfg.d_model])?)?;
            backend.copy(o.view_mut(), View::new(&vec![1.0f32; cfg.d_model], [cfg.d_model])?)?;
            Some(o)
        } else {
            None
        };
        Ok(Model { cfg, weights, backend, rope, dtype, ix, ones, recompute: Vec::new(), offload: None })
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

    fn t(&self, i: usize) -> &Buffer {
        &self.weights.tensors[i]
    }

    /// An output buffer of the model's dtype: every one is written whole by the op it is passed to, so none is
    /// cleared first ([`Backend::empty`]).
    fn buf(&self, dims: impl IntoDims) -> Result<Buffer> {
        Ok(self.backend.empty(self.dtype, dims.into_dims()?)?)
    }

    /// An `f32` output buffer (see [`Model::buf`]).
    fn buf_f32(&self, dims: impl IntoDims) -> Result<Buffer> {
        Ok(self.backend.empty(DType::F32, dims.into_dims()?)?)
    }

    /// One decoder layer: attention block then MLP block, each `x + f(norm(x))`; the segments are those
    /// [`longctx_recompute::llama_layer`] (and its Nemotron and Mixtral variants) describes, and a rebuild before
    /// the backward reruns the same ones. Returns the layer's routing statistics too (Mixtral).
    fn layer_forward(
        &self,
        layer: usize,
        x: Buffer,
        plan: &mut CpPlan,
        pos: &[i64],
    ) -> Result<(Buffer, LayerSaved, Option<MoeStats>)> {
        let ix = &self.ix.layers[layer];
        let (mean1, rstd1, h1) = self.norm_forward(ix.attn_norm, &x)?;
        let (q, k, v) = self.qkv_proj(layer, &h1, pos)?;
        let (o, lse) = self.core_attn(&q, &k, &v, plan)?;
        let x2 = self.o_proj(layer, &o, &x)?;
        let (mean2, rstd2, h2) = self.norm_forward(ix.mlp_norm, &x2)?;
        let (mut router_probs, mut topk_w, mut routing, mut ye, mut stats) = (None, None, None, None, None);
        let (gate, up, act, out) = match &ix.mlp {
            MlpIx::SwiGlu { gate: wg, up: wu, down } => {
                let (gate, up) = self.gate_up(*wg, *wu, &h2)?;
                let act = self.swiglu(&gate, &up)?;
                let out = self.down_proj(*down, &act, &x2)?;
                (Some(gate), up, act, out)
            }
            MlpIx::SquaredRelu { up: wu, down } => {
                let up = self.up_proj(*wu, &h2)?;
                let act = self.squared_relu(&up)?;
                let out = self.down_proj(*down, &act, &x2)?;
                (None, up, act, out)
            }
            MlpIx::Moe { router, experts } => {
                let (p, w, r) = self.router(*router, &h2)?;
                stats = Some(MoeStats::of(&r));
                let (gate, up) = self.experts_gate_up(experts, &h2, &r.routing)?;
                let act = self.swiglu(&gate, &up)?;
                let y = self.experts_down(experts, &act, &r.routing)?;
                let out = self.combine(&y, &w, &r.routing, &x2)?;
                (router_probs, topk_w, routing, ye) = (Some(p), Some(w), Some(r.routing), Some(y));
                (Some(gate), up, act, out)
            }
        };
        let saved = LayerSaved {
            x,
            mean1,
            rstd1,
            h1,
            q,
            k,
            v,
            o,
            lse,
            x2,
            mean2,
            rstd2,
            h2,
            router_probs,
            topk_w,
            routing,
            gate,
            up,
            act,
            ye,
        };
        Ok((out, saved, stats))
    }

    /// `h = norm(x)`: RMSNorm, or (a norm with a bias, Nemotron) LayerNorm with the effective weight
    /// `weight + 1` (zero-centred gamma, Hugging Face `NemotronLayerNorm1P`).
    fn norm_forward(&self, n: NormIx, x: &Buffer) -> Result<NormOut> {
        let b = &*self.backend;
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
        let ones =
            self.ones.as_ref().ok_or_else(|| TrainError::Config("a LayerNorm in a non-Nemotron model".into()))?;
        let mut w = self.buf([self.cfg.d_model])?;
        self.backend.copy(w.view_mut(), self.t(weight).view())?;
        self.backend.add(w.view_mut(), ones.view())?;
        Ok(w)
    }

    /// The norm's backward: `dx` (overwritten), the weight's (and bias's) gradients per `mode`.
    #[allow(clippy::too_many_arguments)]
    fn norm_backward(
        &self,
        n: NormIx,
        dx: &mut Buffer,
        dh: &Buffer,
        (x, mean, rstd): (&Buffer, Option<&Buffer>, &Buffer),
        grads: &mut Params,
        mode: GradMode,
    ) -> Result<()> {
        let b = &*self.backend;
        match (n.bias, mean) {
            (None, _) => {
                let g = ng(dx.view_mut(), grads.tensors[n.weight].view_mut());
                b.rmsnorm_backward(g, dh.view(), rms_saved(x, rstd), self.t(n.weight).view(), mode)?;
            }
            (Some(bias), Some(mean)) => {
                let w = self.one_plus(n.weight)?;
                let (dw, db) = two_mut(&mut grads.tensors, n.weight, bias);
                let g = NormGrads { dx: dx.view_mut(), dweight: dw.view_mut(), dbias: Some(db.view_mut()) };
                let saved = LayerNormSaved { x: x.view(), mean: mean.view(), rstd: rstd.view() };
                b.layernorm_backward(g, dh.view(), saved, w.view(), mode)?;
            }
            (Some(_), None) => return Err(TrainError::Config("a LayerNorm's backward without its mean".into())),
        }
        Ok(())
    }

    /// `q, k, v` from `h1`, head-major, `q` and `k` rotated (their first `rotary_dim` dims, with partial RoPE).
    fn qkv_proj(&self, layer: usize, h1: &Buffer, pos: &[i64]) -> Result<(Buffer, Buffer, Buffer)> {
        let b = &*self.backend;
        let ix = &self.ix.layers[layer];
        let (l, d, hq, hkv) = (h1.dims()[0], self.cfg.head_dim(), self.cfg.heads, self.cfg.kv_heads);
        let (mut q_t, mut k_t, mut v_t) = (self.buf([l, hq * d])?, self.buf([l, hkv * d])?, self.buf([l, hkv * d])?);
        let (mut q, mut k, mut v) = (self.buf([1, hq, l, d])?, self.buf([1, hkv, l, d])?, self.buf([1, hkv, l, d])?);
        b.linear_forward(q_t.view_mut(), h1.view(), self.t(ix.wq).view(), None)?;
        b.linear_forward(k_t.view_mut(), h1.view(), self.t(ix.wk).view(), None)?;
        b.linear_forward(v_t.view_mut(), h1.view(), self.t(ix.wv).view(), None)?;
        b.transpose12(q.view_mut(), q_t.view().reshape([1, l, hq, d])?)?;
        b.transpose12(k.view_mut(), k_t.view().reshape([1, l, hkv, d])?)?;
        b.transpose12(v.view_mut(), v_t.view().reshape([1, l, hkv, d])?)?;
        b.rope_forward(&self.rope, q.view_mut(), pos)?;
        b.rope_forward(&self.rope, k.view_mut(), pos)?;
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
        let (mut o_t, mut x2) = (self.buf([1, l, hq, d])?, self.buf([l, c])?);
        b.transpose12(o_t.view_mut(), o.view())?;
        let wo = self.t(self.ix.layers[layer].wo).view();
        // The projection straight into the output, then the residual added to it (`x + y` is `y + x` bit for
        // bit): no buffer for the projection alone, and no pass copying `x`.
        b.linear_forward(x2.view_mut(), o_t.view().reshape([l, hq * d])?, wo, None)?;
        b.add(x2.view_mut(), x.view())?;
        Ok(x2)
    }

    /// `gate, up` projections of `h2`.
    fn gate_up(&self, wg: usize, wu: usize, h2: &Buffer) -> Result<(Buffer, Buffer)> {
        let (l, f) = (h2.dims()[0], self.cfg.ffn);
        let (mut gate, mut up) = (self.buf([l, f])?, self.buf([l, f])?);
        self.backend.linear_forward(gate.view_mut(), h2.view(), self.t(wg).view(), None)?;
        self.backend.linear_forward(up.view_mut(), h2.view(), self.t(wu).view(), None)?;
        Ok((gate, up))
    }

    /// The up projection of `h2` (Nemotron's only input projection).
    fn up_proj(&self, wu: usize, h2: &Buffer) -> Result<Buffer> {
        let mut up = self.buf([h2.dims()[0], self.cfg.ffn])?;
        self.backend.linear_forward(up.view_mut(), h2.view(), self.t(wu).view(), None)?;
        Ok(up)
    }

    /// `act = silu(gate) ∘ up`.
    fn swiglu(&self, gate: &Buffer, up: &Buffer) -> Result<Buffer> {
        let mut act = self.buf(gate.dims())?;
        self.backend.swiglu_forward(act.view_mut(), gate.view(), up.view())?;
        Ok(act)
    }

    /// `act = relu(up)²`.
    fn squared_relu(&self, up: &Buffer) -> Result<Buffer> {
        let mut act = self.buf(up.dims())?;
        self.backend.squared_relu_forward(act.view_mut(), up.view())?;
        Ok(act)
    }

    /// The layer's output `x2 + act·Wdownᵀ`.
    fn down_proj(&self, down: usize, act: &Buffer, x2: &Buffer) -> Result<Buffer> {
        let (l, c) = (act.dims()[0], self.cfg.d_model);
        let mut out = self.buf([l, c])?;
        // As in `o_proj`: the projection into the output, the residual added to it.
        self.backend.linear_forward(out.view_mut(), act.view(), self.t(down).view(), None)?;
        self.backend.add(out.view_mut(), x2.view())?;
        Ok(out)
    }

    /// Reruns, in forward order, every segment whose outputs the policy dropped, from what was kept: the same
    /// ops on the same inputs, so the rebuilt tensors are bit-identical to the forward's.
    fn rebuild(&self, layer: usize, k: KeptLayer, plan: &mut CpPlan, pos: &[i64]) -> Result<LayerSaved> {
        let ix = &self.ix.layers[layer];
        let ln = ix.attn_norm.bias.is_some();
        let KeptLayer {
            x,
            mut mean1,
            mut rstd1,
            mut h1,
            mut q,
            mut k,
            mut v,
            mut o,
            mut lse,
            mut x2,
            mut mean2,
            mut rstd2,
            mut h2,
            mut router_probs,
            mut topk_w,
            mut routing,
            mut gate,
            mut up,
            mut act,
            mut ye,
            away,
        } = k;
        if !away.is_empty() {
            return Err(missing(layer, away[0].0));
        }
        let x =
            x.ok_or_else(|| TrainError::Config(format!("layer {layer}: its input was neither kept nor rebuilt")))?;
        if rstd1.is_none() || h1.is_none() || (ln && mean1.is_none()) {
            (mean1, rstd1, h1) = opt3(self.norm_forward(ix.attn_norm, &x)?);
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
        if rstd2.is_none() || h2.is_none() || (ln && mean2.is_none()) {
            (mean2, rstd2, h2) = opt3(self.norm_forward(ix.mlp_norm, &x2)?);
        }
        let h2 = h2.ok_or_else(|| missing(layer, "h2"))?;
        match &ix.mlp {
            MlpIx::SwiGlu { gate: wg, up: wu, .. } => {
                if gate.is_none() || up.is_none() {
                    let (g, u) = self.gate_up(*wg, *wu, &h2)?;
                    (gate, up) = (Some(g), Some(u));
                }
                if act.is_none() {
                    let (g, u) = (gate.as_ref().ok_or_else(|| missing(layer, "gate"))?, up.as_ref());
                    act = Some(self.swiglu(g, u.ok_or_else(|| missing(layer, "up"))?)?);
                }
            }
            MlpIx::SquaredRelu { up: wu, .. } => {
                if up.is_none() {
                    up = Some(self.up_proj(*wu, &h2)?);
                }
                if act.is_none() {
                    act = Some(self.squared_relu(up.as_ref().ok_or_else(|| missing(layer, "up"))?)?);
                }
            }
            MlpIx::Moe { router, experts } => {
                if router_probs.is_none() || topk_w.is_none() || routing.is_none() {
                    let (p, w, r) = self.router(*router, &h2)?;
                    (router_probs, topk_w, routing) = (Some(p), Some(w), Some(r.routing));
                }
                let r = routing.as_ref().ok_or_else(|| missing(layer, "routing"))?;
                if gate.is_none() || up.is_none() {
                    let (g, u) = self.experts_gate_up(experts, &h2, r)?;
                    (gate, up) = (Some(g), Some(u));
                }
                if act.is_none() {
                    let (g, u) = (gate.as_ref().ok_or_else(|| missing(layer, "gate"))?, up.as_ref());
                    act = Some(self.swiglu(g, u.ok_or_else(|| missing(layer, "up"))?)?);
                }
                if ye.is_none() {
                    ye = Some(self.experts_down(experts, act.as_ref().ok_or_else(|| missing(layer, "act"))?, r)?);
                }
            }
        }
        Ok(LayerSaved {
            x,
            mean1,
            rstd1: rstd1.ok_or_else(|| missing(layer, "rstd1"))?,
            h1,
            q,
            k,
            v,
            o,
            lse: lse.ok_or_else(|| missing(layer, "lse"))?,
            x2,
            mean2,
            rstd2: rstd2.ok_or_else(|| missing(layer, "rstd2"))?,
            h2,
            router_probs,
            topk_w,
            routing,
            gate,
            up: up.ok_or_else(|| missing(layer, "up"))?,
            act: act.ok_or_else(|| missing(layer, "act"))?,
            ye,
        })
    }

    /// The layer's backward: `dout` `[L, C]` in, the input's gradient out; weight gradients into `grads`
    /// (per `mode`); `moe_aux` is the load-balancing loss's gradient per router probability (Mixtral).
    ///
    /// It owns the layer's saved tensors and frees each after its last use, and allocates each gradient where it
    /// is first written: the peak of a step is inside the first layer's backward, with every layer's tensors
    /// resident, and the MLP's saved tensors (more than half of a layer's) held through the attention block's
    /// backward were the larger part of what it adds to them.
    #[allow(clippy::too_many_arguments)]
    fn layer_backward(
        &self,
        layer: usize,
        dout: Buffer,
        s: LayerSaved,
        (grads, mode): (&mut Params, GradMode),
        plan: &mut CpPlan,
        pos: &[i64],
        moe_aux: Option<&[f32]>,
    ) -> Result<Buffer> {
        let b = &*self.backend;
        let cfg = &self.cfg;
        let ix = &self.ix.layers[layer];
        let (l, c, d, hq, hkv) = (s.x.dims()[0], cfg.d_model, cfg.head_dim(), cfg.heads, cfg.kv_heads);
        let w = |i: usize| self.t(i);
        macro_rules! dw {
            ($i:expr) => {
                grads.tensors[$i].view_mut()
            };
        }

        // MLP block, reversed.
        let mut dh2 = self.buf([l, c])?;
        match &ix.mlp {
            MlpIx::SwiGlu { gate: wg, up: wu, down } => {
                let gate = s.gate.ok_or_else(|| missing(layer, "gate"))?;
                let f = cfg.ffn;
                let mut dact = self.buf([l, f])?;
                b.linear_backward(
                    lg(Some(dact.view_mut()), dw!(*down)),
                    dout.view(),
                    saved_x(&s.act),
                    w(*down).view(),
                    mode,
                )?;
                drop(s.act);
                let (mut dgate, mut dup) = (self.buf([l, f])?, self.buf([l, f])?);
                let saved = SwigluSaved { gate: gate.view(), up: s.up.view() };
                b.swiglu_backward(dgate.view_mut(), dup.view_mut(), dact.view(), saved)?;
                drop((dact, gate, s.up));
                b.linear_backward(
                    lg(Some(dh2.view_mut()), dw!(*wg)),
                    dgate.view(),
                    saved_x(&s.h2),
                    w(*wg).view(),
                    mode,
                )?;
                drop(dgate);
                let mut dh2_up = self.buf([l, c])?;
                b.linear_backward(
                    lg(Some(dh2_up.view_mut()), dw!(*wu)),
                    dup.view(),
                    saved_x(&s.h2),
                    w(*wu).view(),
                    mode,
                )?;
                drop((dup, s.h2));
                b.add(dh2.view_mut(), dh2_up.view())?;
            }
            MlpIx::SquaredRelu { up: wu, down } => {
                let f = cfg.ffn;
                let mut dact = self.buf([l, f])?;
                b.linear_backward(
                    lg(Some(dact.view_mut()), dw!(*down)),
                    dout.view(),
                    saved_x(&s.act),
                    w(*down).view(),
                    mode,
                )?;
                drop(s.act);
                let mut dup = self.buf([l, f])?;
                b.squared_relu_backward(dup.view_mut(), dact.view(), SquaredReluSaved { x: s.up.view() })?;
                drop((dact, s.up));
                b.linear_backward(lg(Some(dh2.view_mut()), dw!(*wu)), dup.view(), saved_x(&s.h2), w(*wu).view(), mode)?;
                drop((dup, s.h2));
            }
            MlpIx::Moe { router, experts } => {
                self.moe_backward(layer, (*router, experts), &mut dh2, &dout, &s, (grads, mode), moe_aux)?;
                drop((s.act, s.up, s.h2, s.gate, s.router_probs, s.topk_w, s.routing, s.ye));
            }
        }
        let mut dx2 = self.buf([l, c])?;
        self.norm_backward(ix.mlp_norm, &mut dx2, &dh2, (&s.x2, s.mean2.as_ref(), &s.rstd2), grads, mode)?;
        drop((dh2, s.x2, s.mean2, s.rstd2));
        b.add(dx2.view_mut(), dout.view())?;
        drop(dout);

        // Attention block, reversed.
        let mut o_t = self.buf([1, l, hq, d])?;
        b.transpose12(o_t.view_mut(), s.o.view())?;
        let mut do_t = self.buf([l, hq * d])?;
        let o_flat = o_t.view().reshape([l, hq * d])?;
        b.linear_backward(
            lg(Some(do_t.view_mut()), dw!(ix.wo)),
            dx2.view(),
            LinearSaved { x: o_flat },
            w(ix.wo).view(),
            mode,
        )?;
        drop(o_t);
        let mut d_o = self.buf([1, hq, l, d])?;
        b.transpose12(d_o.view_mut(), do_t.view().reshape([1, l, hq, d])?)?;
        drop(do_t);
        let (mut dq, mut dk, mut dv) = (self.buf([1, hq, l, d])?, self.buf([1, hkv, l, d])?, self.buf([1, hkv, l, d])?);
        let saved = AttnSaved { qkv: Qkv::new(s.q.view(), s.k.view(), s.v.view()), o: s.o.view(), lse: s.lse.view() };
        plan.backward(AttnGrads { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut() }, d_o.view(), saved)?;
        drop((d_o, s.q, s.k, s.v, s.o, s.lse));
        b.rope_backward(&self.rope, dq.view_mut(), pos)?;
        b.rope_backward(&self.rope, dk.view_mut(), pos)?;
        let (mut dq_t, mut dk_t, mut dv_t) =
            (self.buf([1, l, hq, d])?, self.buf([1, l, hkv, d])?, self.buf([1, l, hkv, d])?);
        b.transpose12(dq_t.view_mut(), dq.view())?;
        b.transpose12(dk_t.view_mut(), dk.view())?;
        b.transpose12(dv_t.view_mut(), dv.view())?;
        drop((dq, dk, dv));
        let (dq_t, dk_t, dv_t) =
            (dq_t.view().reshape([l, hq * d])?, dk_t.view().reshape([l, hkv * d])?, dv_t.view().reshape([l, hkv * d])?);
        let (mut dh1, mut dh1_kv) = (self.buf([l, c])?, self.buf([l, c])?);
        b.linear_backward(lg(Some(dh1.view_mut()), dw!(ix.wq)), dq_t, saved_x(&s.h1), w(ix.wq).view(), mode)?;
        b.linear_backward(lg(Some(dh1_kv.view_mut()), dw!(ix.wk)), dk_t, saved_x(&s.h1), w(ix.wk).view(), mode)?;
        b.add(dh1.view_mut(), dh1_kv.view())?;
        b.linear_backward(lg(Some(dh1_kv.view_mut()), dw!(ix.wv)), dv_t, saved_x(&s.h1), w(ix.wv).view(), mode)?;
        b.add(dh1.view_mut(), dh1_kv.view())?;
        drop((dh1_kv, s.h1));
        let mut dx = self.buf([l, c])?;
        self.norm_backward(ix.attn_norm, &mut dx, &dh1, (&s.x, s.mean1.as_ref(), &s.rstd1), grads, mode)?;
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
        let mut moe: Option<MoeStats> = None;
        for layer in 0..self.cfg.layers {
            let (out, saved, stats) = self.layer_forward(layer, x, plan, &pos)?;
            if let Some(s) = stats {
                moe.get_or_insert_with(|| MoeStats::zeros(s.experts())).merge(&s);
            }
            let actions = self.recompute.get(layer).unwrap_or(&keep_all);
            let mut kept = saved.keep(actions, self.offload.is_some())?;
            if let Some(engine) = &self.offload {
                kept.offload(layer, engine, |name| !marks_offload || actions.of(name) == Action::Offload)?;
            }
            layers.push(kept);
            x = out;
        }
        let (mean_final, rstd_final, h_final) = self.norm_forward(self.ix.final_norm, &x)?;
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
        let (l, c) = (saved.ids.len(), self.cfg.d_model);
        let pos = plan.positions().to_vec();
        let targets = loss.targets;
        let opts =
            CrossEntropyOptions { chunk_tokens: loss.chunk, denominator: Some(loss.denominator), ..Default::default() };
        let (mut dh_final, mut dx) = (self.buf([l, c])?, self.buf([l, c])?);
        let head = self.ix.lm_head;

        let lm = {
            let dweight = grads.tensors[head].view_mut();
            let g = ProjectionGrads { dhidden: dh_final.view_mut(), dweight };
            b.cross_entropy_fused(g, saved.h_final.view(), self.weights.tensors[head].view(), targets, &opts, mode)?
        };
        let final_saved = (&saved.x_final, saved.mean_final.as_ref(), &saved.rstd_final);
        self.norm_backward(self.ix.final_norm, &mut dx, &dh_final, final_saved, grads, mode)?;
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
                            let (out, s, _) = self.layer_forward(i, x, plan, &pos)?;
                            rebuilt[i] = Some(s);
                            x = out;
                        }
                        self.layer_forward(layer, x, plan, &pos)?.1
                    }
                }
            };
            dx = self.layer_backward(layer, dx, s, (grads, mode), plan, &pos, loss.moe_aux)?;
        }
        // Tied embeddings: the output projection's gradient is already in the table's; add the lookup's.
        let emb_mode = if head == 0 { GradMode::Accumulate } else { mode };
        b.embedding_backward(grads.tensors[0].view_mut(), dx.view(), &ids, emb_mode)?;
        Ok(LocalLoss { sum: lm.loss_sum, tokens: lm.n_valid })
    }

    /// The loss alone (held-out evaluation: the cross-entropy, without a load-balancing term): the forward, and
    /// the output projection's loss with its gradients written to scratch.
    pub fn loss(&self, ids: &[u32], targets: &[i64], loss_chunk: usize, plan: &mut CpPlan) -> Result<LocalLoss> {
        let b = &*self.backend;
        let saved = self.forward(ids, plan)?;
        let (l, c, v) = (ids.len(), self.cfg.d_model, self.cfg.vocab);
        let (mut dh, mut dw) = (self.buf([l, c])?, self.buf_f32([v, c])?);
        let opts = CrossEntropyOptions { chunk_tokens: loss_chunk, denominator: Some(1.0), ..Default::default() };
        let g = ProjectionGrads { dhidden: dh.view_mut(), dweight: dw.view_mut() };
        let out = b.cross_entropy_fused(
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

/// A norm's outputs as the optional fields of a [`KeptLayer`] being rebuilt.
fn opt3((mean, rstd, h): NormOut) -> (Option<Buffer>, Option<Buffer>, Option<Buffer>) {
    (mean, Some(rstd), Some(h))
}

/// Two distinct tensors mutably (`i < j`: a norm's weight comes before its bias).
fn two_mut(ts: &mut [Buffer], i: usize, j: usize) -> (&mut Buffer, &mut Buffer) {
    let (a, b) = ts.split_at_mut(j);
    (&mut a[i], &mut b[0])
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
