//! Importing llama.cpp's GGUF checkpoints of the Llama architecture: the container ([`container`]), the
//! dequantisation of its block formats ([`dequant`]), its tokenizer ([`tokenizer`]), and here the mapping of
//! its metadata and tensors onto the trainer's model, with Hugging Face names.
//!
//! Two conventions differ from a Hugging Face checkpoint and are undone here:
//! - GGML lists dims fastest first: a `[rows, cols]` matrix is stored as `ne = [cols, rows]`, same bytes.
//! - llama.cpp's converter permutes the rows of `q_proj` and `k_proj` so that rotary pairs are adjacent
//!   (interleaved, `(x0, x1), (x2, x3)…`), where Hugging Face and this trainer rotate half-split pairs
//!   (`(x_i, x_{i+D/2})`). [`permute_interleaved_to_half_split`] restores the Hugging Face order; without it the model
//!   still runs and its loss is plausible but wrong.

pub mod container;
pub mod dequant;
pub mod tokenizer;

use std::path::Path;

use crate::checkpoint::LoadedTensor;
use crate::error::Result;
use crate::hf::permute::permute_interleaved_to_half_split;
use crate::recipe::{Family, ModelConfig, RopeScalingConfig};
pub use container::{GgufFile, TensorInfo, Value};
pub use dequant::GgmlType;

/// A Llama-architecture GGUF checkpoint, dequantised to `f32` with Hugging Face names and layout.
#[derive(Debug)]
pub struct GgufLlama {
    /// Decoder layers (`llama.block_count`).
    pub layers: usize,
    /// Model width (`llama.embedding_length`).
    pub d_model: usize,
    /// Query heads (`llama.attention.head_count`).
    pub heads: usize,
    /// Key/value heads (`llama.attention.head_count_kv`).
    pub kv_heads: usize,
    /// Width of each head (`llama.rope.dimension_count`, or `d_model / heads`).
    pub head_dim: usize,
    /// MLP width (`llama.feed_forward_length`).
    pub ffn: usize,
    /// Vocabulary (`llama.vocab_size`, or the embedding's rows).
    pub vocab: usize,
    /// RoPE base (`llama.rope.freq_base`, 10000 when absent).
    pub rope_theta: f64,
    /// Linear position interpolation the file declares (`llama.rope.scaling.type = linear`).
    pub rope_linear_factor: Option<f64>,
    /// RMSNorm epsilon (`llama.attention.layer_norm_rms_epsilon`).
    pub norm_eps: f32,
    /// The context the model was trained at (`llama.context_length`).
    pub context_length: usize,
    /// No `output.weight`: the output projection is the embedding.
    pub tied_embeddings: bool,
    /// Every tensor, in the trainer's order (embedding, each layer's nine, final norm, then `lm_head.weight`
    /// unless tied), with Hugging Face names and row-major dims: [`crate::model::param_shapes`] of
    /// [`GgufLlama::model_config`].
    pub tensors: Vec<LoadedTensor>,
    /// The tokenizer in the file's metadata, when it carries a byte-level BPE one.
    pub tokenizer: Option<tokenizers::Tokenizer>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_token: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_token: Option<u32>,
}

/// The GGUF names of a layer's tensors and their Hugging Face names, in the trainer's order.
const LAYER: [(&str, &str); 9] = [
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

impl GgufLlama {
    /// The trainer's model of this checkpoint (`init_std` only matters to a fresh initialisation).
    pub fn model_config(&self) -> ModelConfig {
        ModelConfig {
            layers: self.layers,
            d_model: self.d_model,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: Some(self.head_dim),
            ffn: self.ffn,
            vocab: self.vocab,
            rope_theta: self.rope_theta,
            rope_scaling: self.rope_linear_factor.map(|factor| RopeScalingConfig::Linear { factor }),
            norm_eps: self.norm_eps,
            init_std: 0.02,
            family: Family::Llama,
            moe: None,
            partial_rotary_factor: None,
            tie_embeddings: self.tied_embeddings,
        }
    }

    /// Reads and dequantises `path`.
    ///
    /// Errors (naming the file and the key or tensor): not GGUF, truncated, an architecture other than
    /// `llama`, a missing key, a missing, extra or misshapen tensor, a quantisation type not read, a rope
    /// scaling not supported.
    pub fn load(path: &Path) -> Result<GgufLlama> {
        let f = GgufFile::open(path)?;
        let arch = f.get("general.architecture")?.as_str().unwrap_or("?").to_string();
        if arch != "llama" {
            return Err(f.bad(format!("general.architecture = `{arch}`: only `llama` is imported")));
        }
        let int = |key: &str| -> Result<usize> {
            let v = f.get(key)?;
            v.as_u64().map(|v| v as usize).ok_or_else(|| f.bad(format!("metadata `{key}` = {v:?} is not an integer")))
        };
        let float = |key: &str| -> Result<f64> {
            let v = f.get(key)?;
            v.as_f64().ok_or_else(|| f.bad(format!("metadata `{key}` = {v:?} is not a number")))
        };
        let opt = |key: &str| f.metadata.contains_key(key);
        let layers = int("llama.block_count")?;
        let d_model = int("llama.embedding_length")?;
        let heads = int("llama.attention.head_count")?;
        let kv_heads = if opt("llama.attention.head_count_kv") { int("llama.attention.head_count_kv")? } else { heads };
        let ffn = int("llama.feed_forward_length")?;
        let head_dim =
            if opt("llama.rope.dimension_count") { int("llama.rope.dimension_count")? } else { d_model / heads.max(1) };
        if opt("llama.attention.key_length") && int("llama.attention.key_length")? != head_dim {
            return Err(f.bad("metadata `llama.attention.key_length` differs from the rotary dimension count"));
        }
        let rope_theta = if opt("llama.rope.freq_base") { float("llama.rope.freq_base")? } else { 10000.0 };
        let norm_eps = float("llama.attention.layer_norm_rms_epsilon")? as f32;
        let context_length = int("llama.context_length")?;
        let rope_linear_factor = match f.metadata.get("llama.rope.scaling.type").and_then(Value::as_str) {
            None | Some("none") => None,
            Some("linear") => Some(float("llama.rope.scaling.factor")?),
            Some(other) => {
                return Err(
                    f.bad(format!("metadata `llama.rope.scaling.type` = `{other}` is not supported (linear is)"))
                )
            }
        };
        if f.tensor("rope_freqs.weight").is_some() {
            return Err(f.bad(
                "tensor `rope_freqs.weight` (per-frequency rotary factors, Llama 3.1's scaling) is not imported; \
                 give the scaling with --rope-scaling llama3:… instead",
            ));
        }
        let embd = f.tensor("token_embd.weight").ok_or_else(|| f.bad("tensor `token_embd.weight` is missing"))?;
        let vocab = if opt("llama.vocab_size") { int("llama.vocab_size")? } else { embd.dims()[0] };
        let tied_embeddings = f.tensor("output.weight").is_none();

        let (q, kv) = (heads * head_dim, kv_heads * head_dim);
        let mut want: Vec<(String, String, Vec<usize>)> =
            vec![("token_embd.weight".into(), "model.embed_tokens.weight".into(), vec![vocab, d_model])];
        for l in 0..layers {
            for (g, h) in LAYER {
                let dims = match g {
                    "attn_norm" | "ffn_norm" => vec![d_model],
                    "attn_q" => vec![q, d_model],
                    "attn_k" | "attn_v" => vec![kv, d_model],
                    "attn_output" => vec![d_model, q],
                    "ffn_gate" | "ffn_up" => vec![ffn, d_model],
                    _ => vec![d_model, ffn],
                };
                want.push((format!("blk.{l}.{g}.weight"), format!("model.layers.{l}.{h}.weight"), dims));
            }
        }
        want.push(("output_norm.weight".into(), "model.norm.weight".into(), vec![d_model]));
        if !tied_embeddings {
            want.push(("output.weight".into(), "lm_head.weight".into(), vec![vocab, d_model]));
        }
        if let Some(extra) = f.tensors.iter().find(|t| !want.iter().any(|(g, _, _)| *g == t.name)) {
            return Err(f.bad(format!("tensor `{}` is not part of a {layers}-layer Llama", extra.name)));
        }
        let mut tensors = Vec::with_capacity(want.len());
        for (gname, hname, dims) in want {
            let t = f.tensor(&gname).ok_or_else(|| f.bad(format!("tensor `{gname}` is missing")))?;
            if t.dims() != dims {
                return Err(f.bad(format!("tensor `{gname}` has dims {:?}; the metadata implies {dims:?}", t.dims())));
            }
            let mut data = read_f32(&f, t)?;
            if gname.ends_with("attn_q.weight") {
                data = permute_interleaved_to_half_split(&data, heads, head_dim, d_model);
            } else if gname.ends_with("attn_k.weight") {
                data = permute_interleaved_to_half_split(&data, kv_heads, head_dim, d_model);
            }
            tensors.push(LoadedTensor { name: hname, dims, data });
        }
        let token = |key: &str| f.metadata.get(key).and_then(Value::as_u64).map(|v| v as u32);
        Ok(GgufLlama {
            layers,
            d_model,
            heads,
            kv_heads,
            head_dim,
            ffn,
            vocab,
            rope_theta,
            rope_linear_factor,
            norm_eps,
            context_length,
            tied_embeddings,
            tokenizer: tokenizer::from_gguf(&f)?,
            bos_token: token("tokenizer.ggml.bos_token_id"),
            eos_token: token("tokenizer.ggml.eos_token_id"),
            tensors,
        })
    }
}

/// A tensor's values in `f32`.
///
/// Errors: a GGML type not read, a row that is not a whole number of blocks, or data past the end of the file.
pub fn read_f32(f: &GgufFile, t: &TensorInfo) -> Result<Vec<f32>> {
    let ty = GgmlType::from_id(t.ggml_type).ok_or_else(|| {
        f.bad(format!(
            "tensor `{}` is {}, a type this importer does not read (it reads {})",
            t.name,
            GgmlType::name_of(t.ggml_type),
            GgmlType::SUPPORTED
        ))
    })?;
    let n = t.numel();
    let row = t.ne.first().copied().unwrap_or(1);
    let bytes = ty
        .bytes_for(n)
        .filter(|_| ty.bytes_for(row).is_some())
        .ok_or_else(|| f.bad(format!("tensor `{}`: rows of {row} are not whole {ty:?} blocks", t.name)))?;
    let raw = f.read_raw(t, bytes)?;
    let mut out = vec![0.0f32; n as usize];
    ty.dequantize(&raw, &mut out);
    Ok(out)
}
