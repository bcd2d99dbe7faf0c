//! How a layer describes its forward to a policy: named segments, each with its compute cost, the tensors it
//! reads and the tensors it saves for the backward.
//!
//! A segment is the stretch of ops between saved tensors (a norm, a group of projections, core attention, an
//! activation): rerunning it during the backward regenerates all of its outputs at once, so recomputing one of
//! them costs the whole segment. The layer's input is saved by the layer before it and is never recomputed
//! inside the layer; every segment's inputs are its layer's input or outputs of earlier segments, so any choice
//! of what to recompute can be replayed in forward order from the input.

use serde::{Deserialize, Serialize};

use crate::error::{RecomputeError, Result};

/// A tensor the forward saves for the backward.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedTensor {
    /// Its name within the layer (`h1`, `q`, `act`).
    pub name: String,
    /// Its size.
    pub bytes: u64,
}

/// A stretch of the forward between saved tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    /// Its name (`attn_norm`).
    pub name: String,
    /// The module it belongs to, as Megatron's `recompute_modules` name them: `norm`, `attn_proj`,
    /// `core_attn`, `mlp`, `mlp_act`, `moe`, …; `selective` recomputes whole modules.
    pub module: String,
    /// FLOPs of one forward of the segment.
    pub flops: f64,
    /// The tensors it reads: the layer's input or earlier segments' outputs.
    pub inputs: Vec<String>,
    /// The tensors it saves.
    pub outputs: Vec<SavedTensor>,
}

impl SavedTensor {
    /// A tensor of `bytes` named `name`.
    pub fn new(name: &str, bytes: u64) -> Self {
        SavedTensor { name: name.into(), bytes }
    }
}

impl Segment {
    /// A segment of `module` costing `flops`, reading `inputs`, saving `outputs`.
    pub fn new(name: &str, module: &str, flops: f64, inputs: &[&str], outputs: Vec<SavedTensor>) -> Self {
        Segment {
            name: name.into(),
            module: module.into(),
            flops,
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            outputs,
        }
    }
}

/// One layer's forward, as a policy sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerSpec {
    /// The layer's input (the checkpoint a full recompute keeps).
    pub input: SavedTensor,
    /// The segments in forward order.
    pub segments: Vec<Segment>,
    /// Bytes the layer's backward needs beyond its saved tensors (activation gradients and scratch), present
    /// only while that layer's backward runs.
    pub backward_working_bytes: u64,
}

impl LayerSpec {
    /// Checks that names are unique and every input is defined before it is read.
    pub fn validate(&self) -> Result<()> {
        let mut seen = vec![self.input.name.as_str()];
        for s in &self.segments {
            for i in &s.inputs {
                if !seen.contains(&i.as_str()) {
                    return Err(RecomputeError::Layer(format!(
                        "segment `{}` reads `{i}`, which no earlier segment saves",
                        s.name
                    )));
                }
            }
            if !(s.flops.is_finite() && s.flops >= 0.0) {
                return Err(RecomputeError::Layer(format!("segment `{}` has {} FLOPs", s.name, s.flops)));
            }
            for o in &s.outputs {
                if seen.contains(&o.name.as_str()) {
                    return Err(RecomputeError::Layer(format!("tensor `{}` is saved twice", o.name)));
                }
                seen.push(&o.name);
            }
        }
        Ok(())
    }

    /// Every saved tensor: the input, then each segment's outputs in order.
    pub fn tensors(&self) -> impl Iterator<Item = &SavedTensor> {
        std::iter::once(&self.input).chain(self.segments.iter().flat_map(|s| s.outputs.iter()))
    }

    /// Bytes saved when everything is kept.
    pub fn saved_bytes(&self) -> u64 {
        self.tensors().map(|t| t.bytes).sum()
    }

    /// FLOPs of the whole forward.
    pub fn forward_flops(&self) -> f64 {
        self.segments.iter().map(|s| s.flops).sum()
    }

    /// The segment that saves `name` (`None` for the input or an unknown name).
    pub fn producer(&self, name: &str) -> Option<usize> {
        self.segments.iter().position(|s| s.outputs.iter().any(|o| o.name == name))
    }
}

/// The shape of a Llama-style decoder layer (RMSNorm, GQA attention, SwiGLU MLP), for [`llama_layer`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LlamaLayerShape {
    /// Tokens this rank holds (the sequence divided by context parallelism and by tensor-parallel sequence
    /// sharding where that applies to the tensor).
    pub tokens: u64,
    /// Tokens of the whole sequence (what each query attends over, before the causal half).
    pub seq_len: u64,
    /// Model width.
    pub d_model: u64,
    /// Query heads on this rank.
    pub heads: u64,
    /// KV heads on this rank.
    pub kv_heads: u64,
    /// Head width.
    pub head_dim: u64,
    /// MLP width on this rank.
    pub ffn: u64,
    /// Bytes per activation element (2 for bf16, 4 for f32).
    pub elem_bytes: u64,
    /// Sequence-parallel sharding of the norm-side tensors over `tp` ranks (1 without).
    pub seq_shard: u64,
}

/// The saved tensors of a Llama layer as longctx's reference trainer keeps them (its `SavedId` table, tensor for
/// tensor: `x, rstd1, h1, q, k, v, o, lse, x2, rstd2, h2, gate, up, act`; its replay reruns these segments by
/// name), with PaLM-style FLOP counts (causal attention counted at half of the full `4·L·S·H·D`).
pub fn llama_layer(s: &LlamaLayerShape) -> LayerSpec {
    let (l, e) = (s.tokens, s.elem_bytes);
    let c = s.d_model;
    let ls = l / s.seq_shard.max(1);
    let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let t = SavedTensor::new;
    let seg = Segment::new;
    let (lf, cf, qf, kvf, ff) = (l as f64, c as f64, q as f64, kv as f64, s.ffn as f64);
    LayerSpec {
        input: t("x", ls * c * e),
        segments: vec![
            seg("attn_norm", "norm", 4.0 * lf * cf, &["x"], vec![t("rstd1", ls * 4), t("h1", ls * c * e)]),
            seg(
                "qkv_proj",
                "attn_proj",
                2.0 * lf * cf * (qf + 2.0 * kvf) + 6.0 * lf * (qf + kvf),
                &["h1"],
                vec![t("q", l * q * e), t("k", l * kv * e), t("v", l * kv * e)],
            ),
            seg(
                "core_attn",
                "core_attn",
                2.0 * lf * s.seq_len as f64 * qf,
                &["q", "k", "v"],
                vec![t("o", l * q * e), t("lse", l * s.heads * 4)],
            ),
            seg("o_proj", "attn_proj", 2.0 * lf * qf * cf + lf * cf, &["o", "x"], vec![t("x2", ls * c * e)]),
            seg("mlp_norm", "norm", 4.0 * lf * cf, &["x2"], vec![t("rstd2", ls * 4), t("h2", ls * c * e)]),
            seg("gate_up", "mlp", 4.0 * lf * cf * ff, &["h2"], vec![t("gate", l * s.ffn * e), t("up", l * s.ffn * e)]),
            seg("swiglu", "mlp_act", 5.0 * lf * ff, &["gate", "up"], vec![t("act", l * s.ffn * e)]),
            // Saves nothing (its output is the next layer's input), so no policy reruns it.
            seg("down_proj", "mlp", 2.0 * lf * ff * cf + lf * cf, &["act", "x2"], vec![]),
        ],
        // The trainer's backward frees each saved tensor after its last use, so its largest working set is at
        // the SwiGLU's backward: the incoming gradient and `dh2` (`[L, C]`), `dact`, `dgate`, `dup` (`[L, F]`),
        // less the `act` already freed. The attention block's gradients come after `gate`, `up`, `h2`, `x2` are
        // freed, so they add less whenever the MLP is at least as wide as the attention (every model here).
        backward_working_bytes: (2 * ls * c + 2 * l * s.ffn) * e,
    }
}
