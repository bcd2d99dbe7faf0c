//! Where each tensor of a model sits in [`Params`](super::Params), family by family, with its Hugging Face
//! name and dims: the one place that knows a checkpoint's names, so the layers address tensors by role
//! (`ix.wq`, `ix.mlp`) rather than by position.
//!
//! Order: the embedding, then per layer the attention norm (weight, and bias for LayerNorm), `q, k, v, o`, the MLP
//! norm, the MLP's tensors (Llama `gate, up, down`; Nemotron `up, down`; Mixtral the router, then per expert
//! `w1, w2, w3`), then the final norm and, unless the embeddings are tied, the output projection.

use crate::recipe::{Family, ModelConfig};

/// A norm's weight, and its bias for LayerNorm (Nemotron).
#[derive(Debug, Clone, Copy)]
pub(crate) struct NormIx {
    pub weight: usize,
    pub bias: Option<usize>,
}

/// One expert's SwiGLU: `w1` the gate, `w3` the up, `w2` the down projection (Mixtral's names).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ExpertIx {
    pub w1: usize,
    pub w3: usize,
    pub w2: usize,
}

/// A layer's MLP.
#[derive(Debug, Clone)]
pub(crate) enum MlpIx {
    /// Llama: `down(silu(gate(h)) · up(h))`.
    SwiGlu { gate: usize, up: usize, down: usize },
    /// Nemotron: `down(relu(up(h))²)`.
    SquaredRelu { up: usize, down: usize },
    /// Mixtral: the router `[E, C]` and the experts.
    Moe { router: usize, experts: Vec<ExpertIx> },
}

/// One decoder layer's tensors.
#[derive(Debug, Clone)]
pub(crate) struct LayerIx {
    pub attn_norm: NormIx,
    pub wq: usize,
    pub wk: usize,
    pub wv: usize,
    pub wo: usize,
    pub mlp_norm: NormIx,
    pub mlp: MlpIx,
}

/// Every tensor of a model.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    /// Hugging Face name and dims, in [`Params`](super::Params) order.
    pub shapes: Vec<(String, Vec<usize>)>,
    pub layers: Vec<LayerIx>,
    pub final_norm: NormIx,
    /// The output projection: the embedding (0) when tied.
    pub lm_head: usize,
}

impl Layout {
    pub fn new(cfg: &ModelConfig) -> Layout {
        let (c, f, v, d) = (cfg.d_model, cfg.ffn, cfg.vocab, cfg.head_dim());
        let (q, kv) = (cfg.heads * d, cfg.kv_heads * d);
        let layernorm = cfg.family == Family::Nemotron;
        let mut shapes: Vec<(String, Vec<usize>)> = Vec::new();
        let mut add = |name: String, dims: Vec<usize>| {
            shapes.push((name, dims));
            shapes.len() - 1
        };
        add("model.embed_tokens.weight".into(), vec![v, c]);
        let norm = |add: &mut dyn FnMut(String, Vec<usize>) -> usize, p: &str| NormIx {
            weight: add(format!("{p}.weight"), vec![c]),
            bias: layernorm.then(|| add(format!("{p}.bias"), vec![c])),
        };
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = format!("model.layers.{l}");
            let attn_norm = norm(&mut add, &format!("{p}.input_layernorm"));
            let wq = add(format!("{p}.self_attn.q_proj.weight"), vec![q, c]);
            let wk = add(format!("{p}.self_attn.k_proj.weight"), vec![kv, c]);
            let wv = add(format!("{p}.self_attn.v_proj.weight"), vec![kv, c]);
            let wo = add(format!("{p}.self_attn.o_proj.weight"), vec![c, q]);
            let mlp_norm = norm(&mut add, &format!("{p}.post_attention_layernorm"));
            let mlp = match (cfg.family, cfg.experts()) {
                (Family::Nemotron, _) => MlpIx::SquaredRelu {
                    up: add(format!("{p}.mlp.up_proj.weight"), vec![f, c]),
                    down: add(format!("{p}.mlp.down_proj.weight"), vec![c, f]),
                },
                (Family::Mixtral, Some(moe)) => {
                    let m = format!("{p}.block_sparse_moe");
                    let router = add(format!("{m}.gate.weight"), vec![moe.experts, c]);
                    let experts = (0..moe.experts)
                        .map(|e| {
                            let w1 = add(format!("{m}.experts.{e}.w1.weight"), vec![f, c]);
                            let w2 = add(format!("{m}.experts.{e}.w2.weight"), vec![c, f]);
                            let w3 = add(format!("{m}.experts.{e}.w3.weight"), vec![f, c]);
                            ExpertIx { w1, w3, w2 }
                        })
                        .collect();
                    MlpIx::Moe { router, experts }
                }
                _ => MlpIx::SwiGlu {
                    gate: add(format!("{p}.mlp.gate_proj.weight"), vec![f, c]),
                    up: add(format!("{p}.mlp.up_proj.weight"), vec![f, c]),
                    down: add(format!("{p}.mlp.down_proj.weight"), vec![c, f]),
                },
            };
            layers.push(LayerIx { attn_norm, wq, wk, wv, wo, mlp_norm, mlp });
        }
        let final_norm = norm(&mut add, "model.norm");
        let lm_head = if cfg.tie_embeddings { 0 } else { add("lm_head.weight".into(), vec![v, c]) };
        Layout { shapes, layers, final_norm, lm_head }
    }
}

/// The dims of every tensor of a model, with its Hugging Face name, in [`Params`](super::Params) order.
pub fn param_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    Layout::new(cfg).shapes
}
