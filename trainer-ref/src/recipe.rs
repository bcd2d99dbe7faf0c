//! Recipes: everything a run needs, in one TOML file (`trainer-ref/recipes/*.toml`).
//!
//! Unknown fields are refused (a misspelt field is an error naming it, not a silently ignored setting), every
//! value is range-checked by [`Recipe::validate`] before any work starts, and `--set section.field=value`
//! overrides any field by its dotted path before the recipe is parsed, so an override is checked exactly as
//! the file is.

use std::path::Path;

use longctx_kernels::{RopeConfig, RopeScaling};
use serde::{Deserialize, Serialize};

use crate::device::Device;
use crate::error::{Result, TrainError};
pub use crate::rope_scaling::RopeScalingConfig;

/// The built-in recipes: name and TOML text.
pub const BUILTIN: &[(&str, &str)] = &[
    ("tiny-llama", include_str!("../recipes/tiny-llama.toml")),
    ("tiny-llama-docs", include_str!("../recipes/tiny-llama-docs.toml")),
    ("llama3-8b-16k", include_str!("../recipes/llama3-8b-16k.toml")),
    ("llama3-8b-64k", include_str!("../recipes/llama3-8b-64k.toml")),
    ("llama3-8b-128k", include_str!("../recipes/llama3-8b-128k.toml")),
    ("llama3-70b-16k", include_str!("../recipes/llama3-70b-16k.toml")),
    ("llama3-70b-64k", include_str!("../recipes/llama3-70b-64k.toml")),
    ("tiny-mixtral", include_str!("../recipes/tiny-mixtral.toml")),
    ("tiny-nemotron", include_str!("../recipes/tiny-nemotron.toml")),
    ("mixtral-8x7b-16k", include_str!("../recipes/mixtral-8x7b-16k.toml")),
    ("mixtral-8x7b-64k", include_str!("../recipes/mixtral-8x7b-64k.toml")),
    ("nemotron4-15b-16k", include_str!("../recipes/nemotron4-15b-16k.toml")),
    ("nemotron4-15b-64k", include_str!("../recipes/nemotron4-15b-64k.toml")),
    ("nemotron4-22b-16k", include_str!("../recipes/nemotron4-22b-16k.toml")),
    ("nemotron4-22b-64k", include_str!("../recipes/nemotron4-22b-64k.toml")),
    ("smollm2-135m-extend-32k", include_str!("../recipes/smollm2-135m-extend-32k.toml")),
];

/// A run: the model, the training loop, the data and the parallel layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// A short name for messages and the output folder.
    pub name: String,
    /// One line on what the recipe is for.
    #[serde(default)]
    pub description: String,
    /// The model's shape.
    pub model: ModelConfig,
    /// The optimisation loop.
    pub train: TrainConfig,
    /// The corpus and how it is cut into sequences.
    pub data: DataConfig,
    /// Context-parallel and data-parallel ranks.
    #[serde(default)]
    pub parallel: ParallelConfig,
}

/// A decoder of one of the [`Family`] kinds: Llama 3 style by default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The layer structure (`llama` when absent).
    #[serde(default)]
    pub family: Family,
    /// Decoder layers.
    pub layers: usize,
    /// Model (residual) width `C`.
    pub d_model: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (GQA; divides `heads`).
    pub kv_heads: usize,
    /// Width of each head (`d_model / heads` when absent).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// SwiGLU hidden width `F`.
    pub ffn: usize,
    /// Vocabulary (at least 257 for text read by the byte tokenizer: 256 bytes and the end-of-document token).
    pub vocab: usize,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// RoPE context-extension scaling.
    #[serde(default)]
    pub rope_scaling: Option<RopeScalingConfig>,
    /// RMSNorm epsilon (LayerNorm's for `nemotron`).
    pub norm_eps: f32,
    /// Standard deviation of the initial weights (residual projections are scaled by `1/√(2·layers)`).
    pub init_std: f32,
    /// The mixture of experts: required for `mixtral`, refused for the other families.
    #[serde(default)]
    pub moe: Option<MoeConfig>,
    /// Rotary embedding on the first `head_dim · factor` dims of each head only, the rest passing through
    /// (Nemotron-4: 0.5); absent: every dim rotates.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// The output projection is the embedding matrix (no `lm_head.weight`; the two gradients are summed).
    #[serde(default)]
    pub tie_embeddings: bool,
}

/// The kind of decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Llama 3: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.
    #[default]
    Llama,
    /// Mixtral: the Llama layer with a top-k-of-E mixture of SwiGLU experts and a load-balancing loss.
    Mixtral,
    /// Nemotron-4: LayerNorm with zero-centred weight (`weight + 1`) and bias, partial RoPE, squared-ReLU MLP
    /// (not gated), no linear biases.
    Nemotron,
}

impl Family {
    /// The name recipes use.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mixtral => "mixtral",
            Family::Nemotron => "nemotron",
        }
    }
}

/// A Mixtral-style mixture of experts (Hugging Face `num_local_experts`, `num_experts_per_tok`,
/// `router_aux_loss_coef`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    /// Experts per layer (Mixtral 8x7B: 8), each a SwiGLU MLP of width `model.ffn`.
    pub experts: usize,
    /// Experts each token is routed to (2).
    pub top_k: usize,
    /// Weight of the load-balancing loss added to the training loss (Hugging Face 0.02, NeMo 0.01).
    pub aux_loss_coef: f64,
}

/// Number formats of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// `bf16` (with `f32` master weights) on a device, where the tensor cores make it the fast format; `f32` on
    /// the CPU, the trainer's reference format there. See [`Recipe::precision`].
    Auto,
    /// Weights, activations and gradients in `f32`.
    F32,
    /// `bf16` weights and activations; `f32` master weights, gradients and AdamW moments.
    Bf16,
}

/// The optimisation loop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: u64,
    /// Tokens per sequence (the context length trained on).
    pub seq_len: usize,
    /// Sequences per optimizer step over all data-parallel ranks (the global batch); each rank runs
    /// `batch / dp` micro-batches of one sequence and accumulates their gradients.
    pub batch: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f32,
    /// Steps of linear warm-up.
    pub warmup: u64,
    /// Decoupled weight decay (matrices only; norms and embeddings are not decayed).
    pub weight_decay: f32,
    /// AdamW β1.
    pub beta1: f32,
    /// AdamW β2.
    pub beta2: f32,
    /// AdamW ε.
    pub eps: f32,
    /// Clip the global gradient norm to this (0 turns clipping off).
    pub clip: f32,
    /// Seeds the weights.
    pub seed: u64,
    /// `f32` or `bf16`.
    pub precision: Precision,
    /// Held-out loss every this many steps (and after the last); 0 never.
    pub eval_every: u64,
    /// Held-out sequences per evaluation.
    pub eval_seqs: usize,
    /// A checkpoint every this many steps (and after the last); 0 only after the last.
    pub checkpoint_every: u64,
    /// Checkpoints kept (the newest); 0 writes none at all (a benchmark's run: the weights are not wanted back, and
    /// a large model's checkpoint takes seconds and gigabytes).
    pub keep_checkpoints: usize,
    /// Tokens per chunk of the fused output projection and loss (its logits are `chunk × vocab`).
    pub loss_chunk: usize,
    /// Activation recomputation: `none`, `full`, `selective[:MODULES]`, `uniform:K`, `block:N`,
    /// `budget:BYTES` (see `longctx-recompute`). Gradients are bit-identical under every policy.
    #[serde(default = "default_recompute")]
    pub recompute: String,
    /// Where kept activations wait for the backward: `none`, `host` (a pool of host buffers) or `disk`
    /// (spill files; on a CPU-only machine the tier that lowers peak memory).
    #[serde(default = "default_offload")]
    pub offload: String,
    /// Byte budget of the offload tier (`8GiB`, `512MiB`; `auto`: 90% of the spill filesystem's free space
    /// for `disk`, half of the available memory for `host`).
    #[serde(default = "default_offload_budget")]
    pub offload_budget: String,
    /// Layers whose tensors are offloaded, from the first (0: all but the last, which the backward needs
    /// first). A recompute policy with `offload` actions (`budget:` with a tier, `custom:`) decides instead,
    /// tensor by tensor in every layer.
    #[serde(default)]
    pub offload_layers: usize,
    /// The spill directory of the disk tier (empty: `offload/` in the run's output folder).
    #[serde(default)]
    pub offload_dir: String,
    /// A pretrained checkpoint to start from (a Hugging Face directory or a GGUF file; `--init-from` wins):
    /// its model replaces `[model]` except `rope_scaling`, which a recipe written for the checkpoint sets.
    /// A relative path is taken from the current directory, else from the trainer crate's directory.
    #[serde(default)]
    pub init_from: String,
}

fn default_offload() -> String {
    "none".into()
}

fn default_offload_budget() -> String {
    "auto".into()
}

fn default_recompute() -> String {
    "none".into()
}

/// The corpus.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// `jargon` (the built-in Jargon File) or the path of a UTF-8 text file.
    pub corpus: String,
    /// Attention stays inside each document of a packed sequence (through the ring as well).
    #[serde(default)]
    pub document_masking: bool,
    /// Every this many-th document is held out (never trained on).
    pub heldout_every: usize,
}

/// The parallel layout: `cp × dp` ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelConfig {
    /// Context-parallel ranks: each holds `seq_len / cp` tokens of every sequence.
    pub cp: usize,
    /// Data-parallel groups: each trains on its own sequences.
    pub dp: usize,
    /// `zigzag` (default), `contiguous` or `striped`.
    pub partition: String,
    /// `ring` (default), `allgather`, `ulysses`.
    pub schedule: String,
    /// Kernel threads per rank (0: the cores divided among the ranks; with a rank per process, rayon's global
    /// pool, `RAYON_NUM_THREADS` or every core).
    pub threads: usize,
    /// Tensor parallelism of a published layout (NeMo's), for `longctx plan --recipe`; the trainer itself
    /// runs CP × DP and refuses more than 1.
    #[serde(default = "one")]
    pub tp: usize,
    /// Pipeline parallelism of a published layout, for `longctx plan --recipe`; as `tp`, 1 to train.
    #[serde(default = "one")]
    pub pp: usize,
    /// Where every rank computes: `cpu` (default), `cuda:N`, the GPU of ordinal N (a build with the `cuda`
    /// feature), `cuda`, the GPU of ordinal `LOCAL_RANK` (each process of a launch on a GPU of its own; 0 outside
    /// a launch), or `cuda-emulated`, the CUDA path on its host emulator (see [`crate::device::Device`]).
    /// `--device` overrides it; [`Recipe::device`] reads it.
    #[serde(default = "default_backend")]
    pub backend: String,
}

fn default_backend() -> String {
    "cpu".into()
}

fn one() -> usize {
    1
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            cp: 1,
            dp: 1,
            partition: "zigzag".into(),
            schedule: "ring".into(),
            threads: 0,
            tp: 1,
            pp: 1,
            backend: default_backend(),
        }
    }
}

fn bad(field: &str, why: impl std::fmt::Display) -> TrainError {
    TrainError::InvalidField { field: field.to_string(), detail: why.to_string() }
}

fn syntax(origin: &str, e: &toml::de::Error) -> TrainError {
    TrainError::RecipeSyntax { origin: origin.to_string(), detail: e.message().to_string() }
}

fn set_error(o: &str, why: impl std::fmt::Display) -> TrainError {
    TrainError::InvalidOption { option: "--set".into(), detail: format!("{o}: {why}") }
}

impl ModelConfig {
    /// The recompute crate's description of one layer of this family over `tokens` of a `seq_len` sequence, with
    /// activations of `elem_bytes` each.
    pub fn layer_spec(&self, tokens: usize, seq_len: usize, elem_bytes: u64) -> longctx_recompute::LayerSpec {
        let shape = longctx_recompute::LlamaLayerShape {
            tokens: tokens as u64,
            seq_len: seq_len as u64,
            d_model: self.d_model as u64,
            heads: self.heads as u64,
            kv_heads: self.kv_heads as u64,
            head_dim: self.head_dim() as u64,
            ffn: self.ffn as u64,
            elem_bytes,
            seq_shard: 1,
        };
        match (self.family, self.experts()) {
            (Family::Nemotron, _) => longctx_recompute::models::nemotron_layer(&shape),
            (Family::Mixtral, Some(moe)) => {
                longctx_recompute::models::mixtral_layer(&shape, moe.experts as u64, moe.top_k as u64)
            }
            _ => longctx_recompute::llama_layer(&shape),
        }
    }

    /// The kernel's RoPE parameters for sequences of `seq_len` tokens.
    pub fn rope_config(&self, seq_len: usize) -> RopeConfig {
        let scaling = self.rope_scaling.as_ref().map_or(RopeScaling::None, |s| s.to_kernel(seq_len));
        RopeConfig { head_dim: self.head_dim(), base: self.rope_theta, scaling }
    }
    /// Width of each head.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.heads.max(1))
    }

    /// The dims of each head that rotate (`head_dim · partial_rotary_factor`, all of them without one).
    pub fn rotary_dim(&self) -> usize {
        match self.partial_rotary_factor {
            Some(f) => (self.head_dim() as f64 * f).round() as usize,
            None => self.head_dim(),
        }
    }

    /// The mixture of experts of a `mixtral` model (`None` for the dense families).
    pub fn experts(&self) -> Option<MoeConfig> {
        self.moe.filter(|_| self.family == Family::Mixtral)
    }

    /// Checks the family's own fields; each error names the field.
    fn validate_family(&self) -> Result<()> {
        match (self.family, self.moe) {
            (Family::Mixtral, None) => {
                return Err(bad("model.moe", "a `mixtral` model needs { experts, top_k, aux_loss_coef }"))
            }
            (Family::Mixtral, Some(m)) => {
                if m.experts == 0 {
                    return Err(bad("model.moe.experts", "must be at least 1"));
                }
                if m.top_k == 0 || m.top_k > m.experts {
                    return Err(bad(
                        "model.moe.top_k",
                        format!("{} must lie in [1, model.moe.experts = {}]", m.top_k, m.experts),
                    ));
                }
                if !(m.aux_loss_coef.is_finite() && m.aux_loss_coef >= 0.0) {
                    return Err(bad("model.moe.aux_loss_coef", format!("{} must be finite and ≥ 0", m.aux_loss_coef)));
                }
            }
            (f, Some(_)) => {
                return Err(bad("model.moe", format!("only a `mixtral` model has experts, not `{}`", f.name())))
            }
            (_, None) => {}
        }
        if let Some(f) = self.partial_rotary_factor {
            if !(f.is_finite() && f > 0.0 && f <= 1.0) {
                return Err(bad("model.partial_rotary_factor", format!("{f} must lie in (0, 1]")));
            }
            let dims = self.head_dim() as f64 * f;
            if dims.fract() != 0.0 || !(dims as usize).is_multiple_of(2) || dims < 2.0 {
                return Err(bad(
                    "model.partial_rotary_factor",
                    format!("{f} × head_dim {} = {dims} rotary dims: must be a whole, even number", self.head_dim()),
                ));
            }
        }
        Ok(())
    }
}

impl ParallelConfig {
    /// Errors unless the layout is one the trainer runs: CP × DP, no tensor or pipeline parallelism.
    pub fn check_trainable(&self) -> Result<()> {
        for (f, v) in [("parallel.tp", self.tp), ("parallel.pp", self.pp)] {
            if v != 1 {
                return Err(bad(
                    f,
                    format!(
                        "{v}: longctx trains with CP × DP ranks only; tensor and pipeline parallelism are \
                             for `longctx plan --recipe` (set it to 1, or --set {f}=1, to train)"
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl Recipe {
    /// A built-in recipe by name, or a TOML file by path, with `overrides` (`a.b=value`) applied.
    pub fn load(name_or_path: &str, overrides: &[String]) -> Result<Recipe> {
        let (origin, text) = match BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
            Some((n, t)) => (format!("built-in recipe `{n}`"), t.to_string()),
            None => {
                let p = Path::new(name_or_path);
                if !p.exists() {
                    let names: Vec<_> = BUILTIN.iter().map(|(n, _)| *n).collect();
                    return Err(TrainError::UnknownRecipe {
                        name: name_or_path.to_string(),
                        builtins: names.join(", "),
                    });
                }
                (p.display().to_string(), std::fs::read_to_string(p).map_err(|e| TrainError::io(p, e))?)
            }
        };
        Self::parse(&origin, &text, overrides)
    }

    /// Parses `text` (from `origin`, for messages) with `overrides` applied, then validates.
    pub fn parse(origin: &str, text: &str, overrides: &[String]) -> Result<Recipe> {
        let mut value: toml::Table = toml::from_str(text).map_err(|e| syntax(origin, &e))?;
        for o in overrides {
            apply_override(&mut value, o)?;
        }
        let recipe: Recipe = toml::Value::Table(value).try_into().map_err(|e: toml::de::Error| syntax(origin, &e))?;
        recipe.validate()?;
        Ok(recipe)
    }

    /// The recipe as TOML (what a checkpoint records and `longctx recipes --show` prints).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot print the recipe: {e}"))
    }

    /// Checks every value before any work starts; each error names the field. The vocabulary needs one token:
    /// which ids it must hold depends on where they come from, and is checked there (the byte tokenizer's 257
    /// where text goes through it, [`TextTokenizer::check_vocab`](crate::data::TextTokenizer::check_vocab); ids
    /// from a file against the vocabulary itself, in [`crate::eval`]).
    pub fn validate(&self) -> Result<()> {
        let m = &self.model;
        let t = &self.train;
        let p = &self.parallel;
        for (f, v) in [
            ("model.layers", m.layers),
            ("model.d_model", m.d_model),
            ("model.heads", m.heads),
            ("model.kv_heads", m.kv_heads),
            ("model.ffn", m.ffn),
            ("train.seq_len", t.seq_len),
            ("train.batch", t.batch),
            ("train.eval_seqs", t.eval_seqs),
            ("train.loss_chunk", t.loss_chunk),
            ("data.heldout_every", self.data.heldout_every),
            ("parallel.cp", p.cp),
            ("parallel.dp", p.dp),
            ("parallel.tp", p.tp),
            ("parallel.pp", p.pp),
        ] {
            if v == 0 {
                return Err(bad(f, "must be at least 1"));
            }
        }
        if m.vocab == 0 {
            return Err(bad("model.vocab", "must be at least 1"));
        }
        if !m.heads.is_multiple_of(m.kv_heads) {
            return Err(bad(
                "model.kv_heads",
                format!("{} does not divide model.heads = {} (grouped-query attention)", m.kv_heads, m.heads),
            ));
        }
        if m.head_dim.is_none() && !m.d_model.is_multiple_of(m.heads) {
            return Err(bad("model.heads", format!("{} does not divide model.d_model = {}", m.heads, m.d_model)));
        }
        let d = m.head_dim();
        if !(32..=256).contains(&d) || !d.is_multiple_of(8) {
            return Err(bad("model.head_dim", format!("{d}: attention needs 32 to 256 in steps of 8")));
        }
        m.validate_family()?;
        if !(m.rope_theta.is_finite() && m.rope_theta > 1.0) {
            return Err(bad("model.rope_theta", format!("{} must be finite and above 1", m.rope_theta)));
        }
        longctx_kernels::RopeTable::new(&m.rope_config(t.seq_len)).map_err(|e| bad("model.rope_scaling", e))?;
        if !(m.norm_eps.is_finite() && m.norm_eps > 0.0) {
            return Err(bad("model.norm_eps", format!("{} must be finite and positive", m.norm_eps)));
        }
        if !(m.init_std.is_finite() && m.init_std > 0.0) {
            return Err(bad("model.init_std", format!("{} must be finite and positive", m.init_std)));
        }
        if t.steps == 0 {
            return Err(bad("train.steps", "must be at least 1"));
        }
        if !(t.lr.is_finite() && t.lr > 0.0) {
            return Err(bad("train.lr", format!("{} must be finite and positive", t.lr)));
        }
        if !(t.min_lr.is_finite() && t.min_lr >= 0.0 && t.min_lr <= t.lr) {
            return Err(bad("train.min_lr", format!("{} must lie in [0, train.lr = {}]", t.min_lr, t.lr)));
        }
        for (f, b) in [("train.beta1", t.beta1), ("train.beta2", t.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(bad(f, format!("{b} must lie in [0, 1)")));
            }
        }
        if !(t.eps.is_finite() && t.eps > 0.0) {
            return Err(bad("train.eps", format!("{} must be finite and positive", t.eps)));
        }
        if !(t.weight_decay.is_finite() && t.weight_decay >= 0.0) {
            return Err(bad("train.weight_decay", format!("{} must be finite and ≥ 0", t.weight_decay)));
        }
        if !(t.clip.is_finite() && t.clip >= 0.0) {
            return Err(bad("train.clip", format!("{} must be finite and ≥ 0 (0 turns clipping off)", t.clip)));
        }
        if !t.batch.is_multiple_of(p.dp) {
            return Err(bad("train.batch", format!("{} sequences do not split over parallel.dp = {}", t.batch, p.dp)));
        }
        let divisor = if p.partition == "zigzag" { 2 * p.cp } else { p.cp };
        if !t.seq_len.is_multiple_of(divisor) {
            return Err(bad(
                "train.seq_len",
                format!(
                    "{} does not split over parallel.cp = {} with the {} partition (needs a multiple of {divisor})",
                    t.seq_len, p.cp, p.partition
                ),
            ));
        }
        self.partition()?;
        self.schedule()?;
        self.device()?;
        self.recompute_policy()?;
        if !["none", "host", "disk"].contains(&self.train.offload.as_str()) {
            return Err(bad("train.offload", format!("`{}` (none, host or disk)", self.train.offload)));
        }
        if self.train.offload_budget != "auto" && longctx_recompute::parse_bytes(&self.train.offload_budget).is_none() {
            return Err(bad(
                "train.offload_budget",
                format!("`{}` is not a size (8GiB, 512MiB, auto)", self.train.offload_budget),
            ));
        }
        if self.train.offload_layers > self.model.layers {
            return Err(bad(
                "train.offload_layers",
                format!("{} is more than model.layers = {}", self.train.offload_layers, self.model.layers),
            ));
        }
        if p.schedule == "ulysses" && !(m.kv_heads.is_multiple_of(p.cp) && m.heads.is_multiple_of(p.cp)) {
            return Err(bad(
                "parallel.schedule",
                format!(
                    "ulysses needs parallel.cp = {} to divide model.kv_heads = {} and model.heads",
                    p.cp, m.kv_heads
                ),
            ));
        }
        if self.data.corpus != "jargon" && !Path::new(&self.data.corpus).exists() {
            return Err(bad(
                "data.corpus",
                format!("{}: no such file (or `jargon`, the built-in corpus)", self.data.corpus),
            ));
        }
        Ok(())
    }

    /// The recompute policy the recipe names.
    pub fn recompute_policy(&self) -> Result<longctx_recompute::Policy> {
        self.train.recompute.parse().map_err(|e: longctx_recompute::RecomputeError| bad("train.recompute", e))
    }

    /// The recompute crate's description of one layer of this recipe's model on one rank (its family's).
    pub fn layer_spec(&self) -> longctx_recompute::LayerSpec {
        let elem_bytes = self.dtype().size() as u64;
        self.model.layer_spec(self.train.seq_len / self.parallel.cp, self.train.seq_len, elem_bytes)
    }

    /// The partition the recipe names.
    pub fn partition(&self) -> Result<longctx_ring_attn::Partition> {
        use longctx_ring_attn::Partition;
        Ok(match self.parallel.partition.as_str() {
            "zigzag" => Partition::Zigzag,
            "contiguous" => Partition::Contiguous,
            "striped" => Partition::Striped,
            other => return Err(bad("parallel.partition", format!("`{other}` (zigzag, contiguous or striped)"))),
        })
    }

    /// The number format the run computes in: `train.precision`, with `auto` resolved for the recipe's device
    /// (`bf16` on `cuda:N` and `cuda-emulated`, which runs the GPU path; `f32` on the CPU, and where
    /// `parallel.backend` does not parse, which [`Recipe::validate`] reports).
    pub fn precision(&self) -> Precision {
        match (self.train.precision, self.device()) {
            (Precision::Auto, Ok(Device::Cpu) | Err(_)) => Precision::F32,
            (Precision::Auto, Ok(_)) => Precision::Bf16,
            (p, _) => p,
        }
    }

    /// The element type of the run's weights and activations ([`Recipe::precision`]).
    pub fn dtype(&self) -> longctx_kernels::DType {
        match self.precision() {
            Precision::Bf16 => longctx_kernels::DType::Bf16,
            _ => longctx_kernels::DType::F32,
        }
    }

    /// The device the recipe computes on (`parallel.backend`).
    pub fn device(&self) -> Result<Device> {
        self.parallel.backend.parse().map_err(|e: crate::device::ParseDeviceError| bad("parallel.backend", e))
    }

    /// A context-parallel plan for sequences of `seq_len` in `dtype` with the recipe's model and mask (causal,
    /// within documents with `data.document_masking`).
    pub fn cp_plan(
        &self,
        cp: &longctx_ring_attn::ContextParallel,
        seq_len: usize,
        dtype: longctx_kernels::DType,
    ) -> Result<longctx_ring_attn::CpPlan> {
        let m = &self.model;
        let shape = longctx_ring_attn::CpShape {
            batch: 1,
            q_heads: m.heads,
            kv_heads: m.kv_heads,
            seq_len,
            head_dim: m.head_dim(),
            dtype,
        };
        let mut mask = longctx_ring_attn::CpMask::causal();
        if self.data.document_masking {
            mask = mask.with_documents();
        }
        Ok(cp.plan(&shape, &mask)?)
    }

    /// The schedule the recipe names.
    pub fn schedule(&self) -> Result<longctx_ring_attn::Schedule> {
        use longctx_ring_attn::Schedule;
        Ok(match self.parallel.schedule.as_str() {
            "ring" => Schedule::Ring,
            "allgather" => Schedule::AllGather { kv_heads_per_step: self.model.kv_heads },
            "ulysses" => Schedule::Ulysses,
            other => return Err(bad("parallel.schedule", format!("`{other}` (ring, allgather or ulysses)"))),
        })
    }
}

/// Applies `a.b.c=value` to the table: the value is parsed as TOML (`3`, `1e-3`, `true`, `"text"`), or taken as
/// a string when it does not parse (`--set data.corpus=my.txt`).
fn apply_override(table: &mut toml::Table, o: &str) -> Result<()> {
    let (path, raw) = o.split_once('=').ok_or_else(|| set_error(o, "expected `section.field=value`"))?;
    let value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v").unwrap_or(toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.into()),
    };
    let keys: Vec<&str> = path.trim().split('.').collect();
    let (last, parents) = keys.split_last().ok_or_else(|| set_error(o, "empty path"))?;
    let mut t = table;
    for k in parents {
        t = t
            .entry(k.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| set_error(o, format!("`{k}` is not a section")))?;
    }
    t.insert(last.to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_recipe_parses_and_validates() {
        for (name, _) in BUILTIN {
            Recipe::load(name, &[]).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn auto_precision_is_bf16_on_a_device_and_f32_on_the_cpu() {
        use longctx_kernels::DType;
        for (backend, precision, want) in [
            ("cpu", "auto", DType::F32),
            ("cuda:0", "auto", DType::Bf16),
            ("cuda-emulated", "auto", DType::Bf16),
            ("cuda:0", "f32", DType::F32),
            ("cpu", "bf16", DType::Bf16),
        ] {
            let sets = [format!("parallel.backend=\"{backend}\""), format!("train.precision=\"{precision}\"")];
            let r = Recipe::load("tiny-llama", &sets).unwrap();
            assert_eq!(r.dtype(), want, "{backend} {precision}");
        }
        assert_eq!(Recipe::load("tiny-llama", &[]).unwrap().train.precision, Precision::Auto);
    }

    #[test]
    fn a_misspelt_field_is_an_error_naming_it() {
        let text = BUILTIN[0].1.replace("seq_len", "seq_lne");
        let e = Recipe::parse("test", &text, &[]).unwrap_err().to_string();
        assert!(e.contains("seq_lne"), "{e}");
        let e = Recipe::load("tiny-llama", &["train.stpes=3".into()]).unwrap_err().to_string();
        assert!(e.contains("stpes"), "{e}");
    }

    #[test]
    fn the_backend_is_a_device_and_a_bad_one_names_the_field() {
        assert_eq!(Recipe::load("tiny-llama", &[]).unwrap().device().unwrap(), Device::Cpu);
        let r = Recipe::load("tiny-llama", &["parallel.backend=cuda:1".into()]).unwrap();
        assert_eq!(r.device().unwrap(), Device::Cuda(1));
        // A recipe written before the field existed computes on the CPU.
        let text = BUILTIN[0].1.replace("backend = \"cpu\"", "");
        assert_eq!(Recipe::parse("test", &text, &[]).unwrap().device().unwrap(), Device::Cpu);
        let e = Recipe::load("tiny-llama", &["parallel.backend=gpu0".into()]).unwrap_err();
        assert!(
            matches!(&e, TrainError::InvalidField { field, detail } if field == "parallel.backend" && detail.contains("gpu0")),
            "{e}"
        );
    }

    #[test]
    fn overrides_set_any_field_by_its_dotted_path() {
        let r = Recipe::load("tiny-llama", &["train.steps=3".into(), "model.layers=1".into(), "parallel.cp=2".into()])
            .unwrap();
        assert_eq!((r.train.steps, r.model.layers, r.parallel.cp), (3, 1, 2));
    }

    /// The byte tokenizer's 257 tokens are checked where text goes through it, not here: a recipe (a trainer
    /// checkpoint's, say) for a pretrained model of a smaller vocabulary, read with its own tokenizer or given
    /// ids, is a recipe like any other.
    #[test]
    fn a_vocabulary_below_the_byte_tokenizers_is_a_valid_recipe() {
        let r = Recipe::load("tiny-llama", &["model.vocab=200".into()]).unwrap();
        assert_eq!(r.model.vocab, 200);
        Recipe::parse("checkpoint", &r.to_toml(), &[]).unwrap();
        let e = Recipe::load("tiny-llama", &["model.vocab=0".into()]).unwrap_err().to_string();
        assert!(e.contains("model.vocab") && e.contains("at least 1"), "{e}");
    }

    #[test]
    fn bad_values_are_refused_before_work_starts_naming_the_field() {
        for (set, field) in [
            ("model.kv_heads=3", "model.kv_heads"),
            ("parallel.cp=3", "train.seq_len"),
            ("train.lr=-1", "train.lr"),
            ("data.corpus=/no/such/file.txt", "data.corpus"),
            ("train.batch=3", "train.batch"),
            ("parallel.schedule=\"mesh\"", "parallel.schedule"),
        ] {
            let o = if field == "train.batch" { vec![set.into(), "parallel.dp=2".into()] } else { vec![set.into()] };
            let e = Recipe::load("tiny-llama", &o).unwrap_err().to_string();
            assert!(e.contains(field), "{set}: {e}");
        }
    }
}
