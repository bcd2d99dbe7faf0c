//! The seed's models with their exact hyper-parameters (sources: Hugging Face `config.json` files and NeMo's
//! model classes `gpt/model/{llama,mixtral,nemotron}.py`), and the planner's devices.

use serde::{Deserialize, Serialize};

use crate::error::{RecomputeError, Result};
use crate::layer::{LayerSpec, SavedTensor, Segment};

/// The MLP of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mlp {
    /// Gated SiLU (Llama, Mixtral experts): gate and up projections, `silu(gate)·up`, down.
    SwiGlu,
    /// Not gated, squared ReLU (Nemotron-4): up projection, `relu(x)²`, down.
    SquaredRelu,
}

/// A decoder-only model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelDesc {
    /// Name (`llama3-8b`).
    pub name: String,
    /// Decoder layers.
    pub layers: u64,
    /// Model width.
    pub d_model: u64,
    /// Query heads.
    pub heads: u64,
    /// KV heads.
    pub kv_heads: u64,
    /// Head width.
    pub head_dim: u64,
    /// MLP width (of one expert).
    pub ffn: u64,
    /// Vocabulary.
    pub vocab: u64,
    /// Experts per MLP (1: dense).
    pub experts: u64,
    /// Experts each token is routed to.
    pub top_k: u64,
    /// MLP kind.
    pub mlp: Mlp,
    /// LayerNorm (mean and bias) instead of RMSNorm.
    pub layernorm: bool,
    /// Input and output embeddings shared.
    pub tied_embeddings: bool,
}

impl ModelDesc {
    fn dense(name: &str, layers: u64, d: u64, heads: u64, kv: u64, ffn: u64, vocab: u64) -> Self {
        ModelDesc {
            name: name.into(),
            layers,
            d_model: d,
            heads,
            kv_heads: kv,
            head_dim: d / heads,
            ffn,
            vocab,
            experts: 1,
            top_k: 1,
            mlp: Mlp::SwiGlu,
            layernorm: false,
            tied_embeddings: false,
        }
    }

    /// Weights of one layer.
    pub fn layer_params(&self) -> u64 {
        let (c, q, kv) = (self.d_model, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let attn = c * q + 2 * c * kv + q * c;
        let mats = if self.mlp == Mlp::SwiGlu { 3 } else { 2 };
        let mlp = self.experts * mats * c * self.ffn + if self.experts > 1 { self.experts * c } else { 0 };
        let norms = if self.layernorm { 4 * c } else { 2 * c };
        attn + mlp + norms
    }

    /// All weights.
    pub fn params(&self) -> u64 {
        let emb = self.vocab * self.d_model * if self.tied_embeddings { 1 } else { 2 };
        self.layers * self.layer_params() + emb + self.d_model * if self.layernorm { 2 } else { 1 }
    }

    /// Weights a token's forward multiplies by (routed experts only; the embedding gather excluded, the output
    /// projection included).
    pub fn active_matmul_params(&self) -> u64 {
        let (c, q, kv) = (self.d_model, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let mats = if self.mlp == Mlp::SwiGlu { 3 } else { 2 };
        let per_layer = c * q + 2 * c * kv + q * c + self.top_k * mats * c * self.ffn;
        self.layers * per_layer + self.vocab * c
    }

    /// Model FLOPs of one token's forward and backward at sequence length `seq` (PaLM's count: `6·N` plus
    /// causal attention's `6·layers·Hq·D·S`).
    pub fn flops_per_token(&self, seq: u64) -> f64 {
        6.0 * self.active_matmul_params() as f64 + 6.0 * (self.layers * self.heads * self.head_dim * seq) as f64
    }
}

/// A built-in model by name.
pub fn model(name: &str) -> Result<ModelDesc> {
    let m = match name {
        "llama3-8b" => ModelDesc::dense(name, 32, 4096, 32, 8, 14336, 128256),
        "llama3-70b" => ModelDesc::dense(name, 80, 8192, 64, 8, 28672, 128256),
        "mixtral-8x7b" => ModelDesc { experts: 8, top_k: 2, ..ModelDesc::dense(name, 32, 4096, 32, 8, 14336, 32000) },
        "nemotron4-15b" => ModelDesc {
            mlp: Mlp::SquaredRelu,
            layernorm: true,
            ..ModelDesc::dense(name, 32, 6144, 48, 8, 24576, 256000)
        },
        "nemotron4-22b" => ModelDesc {
            mlp: Mlp::SquaredRelu,
            layernorm: true,
            ..ModelDesc::dense(name, 40, 6144, 48, 48, 24576, 256000)
        },
        "tiny-llama" => ModelDesc::dense(name, 4, 128, 4, 2, 352, 257),
        _ => {
            return Err(RecomputeError::Plan {
                what: format!("model `{name}`"),
                why: "not a built-in model".into(),
                fix: format!("use one of {}", MODELS.join(", ")),
            })
        }
    };
    Ok(m)
}

/// The built-in models.
pub const MODELS: &[&str] =
    &["llama3-8b", "llama3-70b", "mixtral-8x7b", "nemotron4-15b", "nemotron4-22b", "tiny-llama"];

/// An accelerator and its links.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Device {
    /// Name (`h100-80g`).
    pub name: String,
    /// Memory per device, bytes.
    pub memory_bytes: u64,
    /// Dense bf16 peak FLOP/s.
    pub bf16_flops: f64,
    /// Dense FP8 peak FLOP/s (0 where there is none).
    pub fp8_flops: f64,
    /// Bandwidth each way between devices of one node (NVLink), bytes/s.
    pub intra_node_bytes_per_s: f64,
    /// Bandwidth each way between nodes per device (InfiniBand), bytes/s.
    pub inter_node_bytes_per_s: f64,
    /// Host to device bandwidth (PCIe), bytes/s.
    pub host_bytes_per_s: f64,
    /// Host memory per device, bytes.
    pub host_memory_bytes: u64,
    /// Devices per node.
    pub per_node: u64,
}

/// The built-in devices (datasheet peaks, dense; links as NVIDIA's DGX systems have them). `h200-141g`'s memory and
/// host link are what the H200 lent to this project measured (2026-12-04): 139 GiB usable by allocations (the
/// datasheet's 141 GB is the raw size in decimal units), pinned copies at 52–55 GB/s each way (the lower figure).
pub const DEVICES: &[&str] = &["a100-80g", "h100-80g", "h200-141g", "b200-180g"];

/// A built-in device by name.
pub fn device(name: &str) -> Result<Device> {
    let gb = 1_000_000_000u64;
    let d = |mem: u64, bf16: f64, fp8: f64, nvlink: f64, ib: f64, pcie: f64| Device {
        name: name.into(),
        memory_bytes: mem,
        bf16_flops: bf16,
        fp8_flops: fp8,
        intra_node_bytes_per_s: nvlink,
        inter_node_bytes_per_s: ib,
        host_bytes_per_s: pcie,
        host_memory_bytes: 2048 * gb / 8,
        per_node: 8,
    };
    Ok(match name {
        "a100-80g" => d(80 * gb, 312e12, 0.0, 300e9, 25e9, 25e9),
        "h100-80g" => d(80 * gb, 989e12, 1979e12, 450e9, 50e9, 50e9),
        "h200-141g" => d(139 << 30, 989e12, 1979e12, 450e9, 50e9, 52e9),
        "b200-180g" => d(180 * gb, 2250e12, 4500e12, 900e9, 50e9, 50e9),
        _ => {
            return Err(RecomputeError::Plan {
                what: format!("device `{name}`"),
                why: "not a built-in device".into(),
                fix: format!("use one of {}", DEVICES.join(", ")),
            })
        }
    })
}

/// A Nemotron-4 layer (LayerNorm with bias, squared-ReLU MLP) as [`crate::llama_layer`] describes a Llama
/// layer, tensor for tensor as longctx's reference trainer saves them: `x; mean1, rstd1, h1; q, k, v; o, lse; x2;
/// mean2, rstd2, h2; up; act` (`up` is the up projection, the squared ReLU's input).
pub fn nemotron_layer(s: &crate::LlamaLayerShape) -> LayerSpec {
    let mut spec = crate::llama_layer(s);
    let (l, e, f) = (s.tokens, s.elem_bytes, s.ffn);
    let ls = l / s.seq_shard.max(1);
    let t = SavedTensor::new;
    for seg in spec.segments.iter_mut() {
        match seg.name.as_str() {
            "attn_norm" => seg.outputs.insert(0, t("mean1", ls * 4)),
            "mlp_norm" => seg.outputs.insert(0, t("mean2", ls * 4)),
            _ => {}
        }
    }
    let lf = l as f64;
    let cf = s.d_model as f64;
    let ff = f as f64;
    spec.segments.retain(|seg| !matches!(seg.name.as_str(), "gate_up" | "swiglu" | "down_proj"));
    spec.segments.push(Segment {
        name: "up_proj".into(),
        module: "mlp".into(),
        flops: 2.0 * lf * cf * ff,
        inputs: vec!["h2".into()],
        outputs: vec![t("up", l * f * e)],
    });
    spec.segments.push(Segment {
        name: "squared_relu".into(),
        module: "mlp_act".into(),
        flops: 2.0 * lf * ff,
        inputs: vec!["up".into()],
        outputs: vec![t("act", l * f * e)],
    });
    spec.segments.push(Segment {
        name: "down_proj".into(),
        module: "mlp".into(),
        flops: 2.0 * lf * ff * cf + lf * cf,
        inputs: vec!["act".into(), "x2".into()],
        outputs: vec![],
    });
    // The squared ReLU's backward: the incoming gradient and `dh2` (`[L, C]`), `dact`, `dup` (`[L, F]`), less the
    // `act` already freed (see `llama_layer`).
    spec.backward_working_bytes = (2 * ls * s.d_model + l * f) * e;
    spec
}

/// A Mixtral layer (the Llama layer with a top-`top_k`-of-`experts` mixture of SwiGLU experts, `s.ffn` wide each)
/// as longctx's reference trainer saves it: the Llama tensors up to `h2`, then the router's `router_probs`
/// (`[L, E]`, f32), `topk_w` (`[L, K]`, f32) and `routing` (the dispatch order: four `u32` per routed row and the
/// `E + 1` row offsets), and over the `N = L·K` dispatched rows the experts' `gate`, `up`, `act` (`[N, F]`) and
/// outputs `ye` (`[N, C]`, the weighted combine's input).
pub fn mixtral_layer(s: &crate::LlamaLayerShape, experts: u64, top_k: u64) -> LayerSpec {
    let mut spec = crate::llama_layer(s);
    let (l, e, f, c) = (s.tokens, s.elem_bytes, s.ffn, s.d_model);
    let n = l * top_k;
    let t = SavedTensor::new;
    let seg = Segment::new;
    let (lf, nf, cf, ff, ef) = (l as f64, n as f64, c as f64, f as f64, experts as f64);
    spec.segments.retain(|seg| !matches!(seg.name.as_str(), "gate_up" | "swiglu" | "down_proj"));
    let routing = 16 * n + 8 * (experts + 1);
    spec.segments.extend([
        seg(
            "router",
            "moe",
            2.0 * lf * cf * ef + 5.0 * lf * ef,
            &["h2"],
            vec![t("router_probs", l * experts * 4), t("topk_w", l * top_k * 4), t("routing", routing)],
        ),
        seg("gate_up", "mlp", 4.0 * nf * cf * ff, &["h2", "routing"], vec![t("gate", n * f * e), t("up", n * f * e)]),
        seg("swiglu", "mlp_act", 5.0 * nf * ff, &["gate", "up"], vec![t("act", n * f * e)]),
        seg("down_proj", "mlp", 2.0 * nf * ff * cf, &["act"], vec![t("ye", n * c * e)]),
        // Saves nothing (its output is the next layer's input), so no policy reruns it.
        seg("combine", "moe", 2.0 * nf * cf + lf * cf, &["ye", "topk_w", "routing", "x2"], vec![]),
    ]);
    let (ls, q) = (l / s.seq_shard.max(1), s.heads * s.head_dim);
    // The backward holds the `[L, C]` gradients, the dispatched `[N, F]` ones and the regathered `[N, C]` input.
    spec.backward_working_bytes = (4 * ls * c + 3 * n * f + 3 * n * c + 2 * l * q) * e + l * experts * 8;
    spec
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_family_layers_are_well_formed_and_name_the_trainers_tensors() {
        let s = crate::LlamaLayerShape {
            tokens: 1024,
            seq_len: 2048,
            d_model: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            ffn: 256,
            elem_bytes: 4,
            seq_shard: 1,
        };
        let m = mixtral_layer(&s, 4, 2);
        m.validate().unwrap();
        let names: Vec<&str> = m.tensors().map(|t| t.name.as_str()).collect();
        for n in ["router_probs", "topk_w", "routing", "gate", "up", "act", "ye"] {
            assert!(names.contains(&n), "{n} in {names:?}");
        }
        // Top-2 doubles the dispatched MLP tensors over a dense layer's.
        let dense = crate::llama_layer(&s);
        let act = |l: &LayerSpec| l.tensors().find(|t| t.name == "act").map_or(0, |t| t.bytes);
        assert_eq!(act(&m), 2 * act(&dense));
        let n = nemotron_layer(&s);
        n.validate().unwrap();
        assert!(n.tensors().any(|t| t.name == "up") && !n.tensors().any(|t| t.name == "gate"));
    }
}
