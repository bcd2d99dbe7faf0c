//! A Hugging Face `config.json`, read into the trainer's [`ModelConfig`] and written back from one.
//!
//! Field for field (Llama): `num_hidden_layers` → `layers`, `hidden_size` → `d_model`, `num_attention_heads` →
//! `heads`, `num_key_value_heads` → `kv_heads` (`heads` when absent), `head_dim` → `head_dim` (`hidden_size /
//! heads` when absent or null), `intermediate_size` → `ffn`, `vocab_size` → `vocab`, `rope_theta` (or
//! `rope_parameters.rope_theta`, transformers 5) → `rope_theta`, `rms_norm_eps` → `norm_eps`, `rope_scaling` /
//! `rope_parameters` → `rope_scaling`, `tie_word_embeddings` → `tie_embeddings` (the output projection is the
//! embedding; no `lm_head.weight`). Mixtral adds `num_local_experts` → `moe.experts`, `num_experts_per_tok` →
//! `moe.top_k`, `router_aux_loss_coef` → `moe.aux_loss_coef`; Nemotron reads its LayerNorm epsilon from
//! `norm_eps` and `partial_rotary_factor` (top level, or inside `rope_parameters` as transformers 5 writes it;
//! 0.5 when absent, as `NemotronConfig` assumes) → `partial_rotary_factor`. An absent field takes transformers'
//! default for the architecture ([`Architecture::defaults`]).

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use super::architecture::{Architecture, BOOKKEEPING};
use crate::error::{Result, TrainError};
use crate::recipe::{Family, ModelConfig, MoeConfig};
use crate::rope_scaling::RopeScalingConfig;

/// The config file's name inside a checkpoint directory.
pub const CONFIG_FILE: &str = "config.json";

/// The standard deviation recorded in an imported [`ModelConfig`] (it only seeds fresh weights, which an
/// import does not draw).
const IMPORTED_INIT_STD: f32 = 0.02;

/// What a `config.json` says, in the trainer's terms.
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    /// The file it was read from.
    pub path: PathBuf,
    /// The architecture.
    pub architecture: Architecture,
    /// The model's shape (its `init_std` is a placeholder).
    pub model: ModelConfig,
    /// `max_position_embeddings`, when given.
    pub max_position_embeddings: Option<usize>,
    /// `tie_word_embeddings`.
    pub tie_word_embeddings: bool,
    /// `torch_dtype` / `dtype`, when given (what the weights were saved in; they are converted anyway).
    pub dtype: Option<String>,
    /// `eos_token_id` (the first, when a list): the token that closes a document when the corpus is
    /// tokenized with the checkpoint's tokenizer.
    pub eos_token_id: Option<u32>,
    /// `bos_token_id` (the first, when a list): kept so that an export of a run from this checkpoint names
    /// it again.
    pub bos_token_id: Option<u32>,
    /// What the import changed or assumed, for the user.
    pub notes: Vec<String>,
}

impl HfConfig {
    /// Reads `dir/config.json`.
    pub fn read(dir: &Path) -> Result<HfConfig> {
        let path = dir.join(CONFIG_FILE);
        let text = std::fs::read(&path).map_err(|e| TrainError::io(&path, e))?;
        let value: Value = serde_json::from_slice(&text)
            .map_err(|e| TrainError::Checkpoint { path: path.clone(), detail: format!("not valid JSON: {e}") })?;
        let obj = value
            .as_object()
            .ok_or_else(|| TrainError::Checkpoint { path: path.clone(), detail: "not a JSON object".into() })?;
        Self::parse(&path, obj)
    }

    /// Parses a `config.json` object (`path` names it in errors).
    pub fn parse(path: &Path, obj: &Map<String, Value>) -> Result<HfConfig> {
        let err = |field: &str, detail: String| TrainError::HfConfig {
            path: path.to_path_buf(),
            field: field.to_string(),
            detail,
        };
        let model_type = obj.get("model_type").and_then(Value::as_str);
        let architectures: Vec<String> = obj
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(|x| x.as_str().map(String::from)).collect())
            .unwrap_or_default();
        let architecture = Architecture::from_names(model_type, &architectures).ok_or_else(|| {
            let (field, named) = match model_type {
                Some(t) => ("model_type", t.to_string()),
                None => ("architectures", format!("{architectures:?}")),
            };
            err(
                field,
                format!(
                    "`{named}` is not an architecture this trainer computes (it reads {})",
                    Architecture::supported()
                ),
            )
        })?;
        if let Some(other) = architectures.iter().find(|a| a.as_str() != architecture.class_name()) {
            return Err(err(
                "architectures",
                format!("`{other}` is not {} (model_type {})", architecture.class_name(), architecture.model_type()),
            ));
        }

        for (key, value) in obj {
            let k = key.as_str();
            // null is transformers' "unset": the default, whatever the field.
            if value.is_null() || BOOKKEEPING.contains(&k) || architecture.maps(k) {
                continue;
            }
            match architecture.required().iter().find(|r| r.field == k) {
                Some(r) if !(r.ok)(value) => {
                    return Err(err(k, format!("{value} is not supported: the model computes only {}", r.want)));
                }
                Some(_) => {}
                None => {
                    return Err(err(
                        k,
                        format!(
                            "{value}: not a field this trainer knows for model_type {} (refused rather than ignored)",
                            architecture.model_type()
                        ),
                    ))
                }
            }
        }

        let usize_field = |k: &str| -> Result<Option<usize>> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|x| Some(x as usize))
                    .ok_or_else(|| err(k, format!("{v} is not a non-negative integer"))),
            }
        };
        let need = |k: &str| -> Result<usize> {
            match usize_field(k)? {
                Some(0) => Err(err(k, "must be at least 1".into())),
                Some(x) => Ok(x),
                None => Err(err(k, "missing".into())),
            }
        };
        let f64_field = |k: &str| -> Result<Option<f64>> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v.as_f64().map(Some).ok_or_else(|| err(k, format!("{v} is not a number"))),
            }
        };

        let layers = need("num_hidden_layers")?;
        let d_model = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        let defaults = architecture.defaults();
        let kv_heads = usize_field("num_key_value_heads")?.or(defaults.kv_heads).unwrap_or(heads);
        let ffn = need("intermediate_size")?;
        let vocab = need("vocab_size")?;
        let max_position_embeddings = usize_field("max_position_embeddings")?;
        let head_dim = usize_field("head_dim")?;
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(err(
                "num_key_value_heads",
                format!("{kv_heads} does not divide num_attention_heads = {heads} (grouped-query attention)"),
            ));
        }
        if head_dim.is_none() && !d_model.is_multiple_of(heads) {
            return Err(err("num_attention_heads", format!("{heads} does not divide hidden_size = {d_model}")));
        }
        let d = head_dim.unwrap_or(d_model / heads);
        if !(32..=256).contains(&d) || !d.is_multiple_of(8) {
            let field = if head_dim.is_some() { "head_dim" } else { "num_attention_heads" };
            return Err(err(field, format!("head dim {d}: the attention kernels take 32 to 256 in steps of 8")));
        }
        let eps_field = architecture.eps_field();
        let norm_eps = f64_field(eps_field)?.unwrap_or(defaults.norm_eps);
        if !(norm_eps.is_finite() && norm_eps > 0.0) {
            return Err(err(eps_field, format!("{norm_eps} must be finite and positive")));
        }

        // transformers 5 writes `rope_parameters` (with `rope_theta` inside); older files `rope_theta` and
        // `rope_scaling` at the top level. Both may be present; they must then agree.
        let rope_obj = |k: &str| -> Result<Option<&Map<String, Value>>> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Object(m)) => Ok(Some(m)),
                Some(v) => Err(err(k, format!("{v} is not an object"))),
            }
        };
        let (params, scaling) = (rope_obj("rope_parameters")?, rope_obj("rope_scaling")?);
        let partial_rotary_factor = partial_rotary(
            path,
            architecture,
            d,
            f64_field("partial_rotary_factor")?,
            [("rope_parameters", params), ("rope_scaling", scaling)],
        )?;
        let mut rope_theta = f64_field("rope_theta")?;
        if let Some(t) = params.and_then(|p| p.get("rope_theta")) {
            let t = t.as_f64().ok_or_else(|| err("rope_parameters.rope_theta", format!("{t} is not a number")))?;
            if rope_theta.is_some_and(|top| top != t) {
                return Err(err("rope_parameters.rope_theta", format!("{t} disagrees with rope_theta {rope_theta:?}")));
            }
            rope_theta = Some(t);
        }
        let rope_theta = rope_theta.unwrap_or(defaults.rope_theta);
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(err("rope_theta", format!("{rope_theta} must be finite and above 1")));
        }
        let top_original = usize_field("original_max_position_embeddings")?;
        let parse_rope = |k: &str, m: &Map<String, Value>| {
            // The rotating share of the head was read above; the rest is the frequency scaling.
            let mut m = m.clone();
            m.remove("partial_rotary_factor");
            RopeScalingConfig::from_hf(path, k, &m, max_position_embeddings, top_original)
        };
        let from_params = params.map(|m| parse_rope("rope_parameters", m)).transpose()?.flatten();
        let from_scaling = scaling.map(|m| parse_rope("rope_scaling", m)).transpose()?.flatten();
        let rope_scaling = match (from_params, from_scaling) {
            (Some(a), Some(b)) if a != b => {
                return Err(err("rope_scaling", format!("{b:?} disagrees with rope_parameters {a:?}")));
            }
            (a, b) => a.or(b),
        };

        let tie_word_embeddings = match obj.get("tie_word_embeddings") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(err("tie_word_embeddings", format!("{v} is not a boolean"))),
        };
        let mut notes = Vec::new();
        let moe = match architecture.family() {
            Family::Mixtral => {
                // MixtralConfig's defaults: 8 experts, top 2, coefficient 0.001.
                let experts = usize_field("num_local_experts")?.unwrap_or(8);
                let top_k = usize_field("num_experts_per_tok")?.unwrap_or(2);
                let aux_loss_coef = f64_field("router_aux_loss_coef")?.unwrap_or(0.001);
                if experts == 0 {
                    return Err(err("num_local_experts", "must be at least 1".into()));
                }
                if top_k == 0 || top_k > experts {
                    return Err(err(
                        "num_experts_per_tok",
                        format!("{top_k} must lie in 1..={experts} (num_local_experts)"),
                    ));
                }
                if !(aux_loss_coef.is_finite() && aux_loss_coef >= 0.0) {
                    return Err(err(
                        "router_aux_loss_coef",
                        format!("{aux_loss_coef} must be finite and non-negative"),
                    ));
                }
                let router_logits = match obj.get("output_router_logits") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => return Err(err("output_router_logits", format!("{v} is not a boolean"))),
                };
                if !router_logits && aux_loss_coef > 0.0 {
                    notes.push(format!(
                        "{}: output_router_logits is false, so transformers' own training would add no \
                         load-balancing loss; training here adds router_aux_loss_coef {aux_loss_coef} × it \
                         (--set model.moe.aux_loss_coef=0 to leave it out)",
                        path.display()
                    ));
                }
                Some(MoeConfig { experts, top_k, aux_loss_coef })
            }
            Family::Llama | Family::Nemotron => None,
        };
        let dtype = ["torch_dtype", "dtype"].iter().find_map(|k| obj.get(*k).and_then(Value::as_str)).map(String::from);
        let model = ModelConfig {
            layers,
            d_model,
            heads,
            kv_heads,
            head_dim: head_dim.filter(|&h| h != d_model / heads || !d_model.is_multiple_of(heads)),
            ffn,
            vocab,
            rope_theta,
            rope_scaling,
            norm_eps: norm_eps as f32,
            init_std: IMPORTED_INIT_STD,
            family: architecture.family(),
            moe,
            partial_rotary_factor,
            tie_embeddings: tie_word_embeddings,
        };
        let token_id = |k: &str| {
            match obj.get(k) {
                Some(Value::Array(a)) => a.first().and_then(Value::as_u64),
                Some(v) => v.as_u64(),
                None => None,
            }
            .and_then(|v| u32::try_from(v).ok())
        };
        let (eos_token_id, bos_token_id) = (token_id("eos_token_id"), token_id("bos_token_id"));
        Ok(HfConfig {
            path: path.to_path_buf(),
            architecture,
            model,
            max_position_embeddings,
            tie_word_embeddings,
            dtype,
            eos_token_id,
            bos_token_id,
            notes,
        })
    }
}

/// The rotating share of each head: `partial_rotary_factor` at the top level or inside a RoPE object (all
/// that are given must agree), else the architecture's default; `None` when every dim rotates. Only Nemotron
/// rotates part of the head (transformers' Llama and Mixtral rotate all of it whatever the field says), and the
/// rotating dims must be a whole, even number.
fn partial_rotary(
    path: &Path,
    arch: Architecture,
    head_dim: usize,
    top: Option<f64>,
    nested: [(&str, Option<&Map<String, Value>>); 2],
) -> Result<Option<f64>> {
    let err = |field: String, detail: String| TrainError::HfConfig { path: path.to_path_buf(), field, detail };
    let mut found: Option<(String, f64)> = top.map(|p| ("partial_rotary_factor".to_string(), p));
    for (key, m) in nested {
        let Some(v) = m.and_then(|m| m.get("partial_rotary_factor")).filter(|v| !v.is_null()) else { continue };
        let field = format!("{key}.partial_rotary_factor");
        let p = v.as_f64().ok_or_else(|| err(field.clone(), format!("{v} is not a number")))?;
        if let Some((other, q)) = &found {
            if *q != p {
                return Err(err(field, format!("{p} disagrees with {other} {q}")));
            }
        }
        found = Some((field, p));
    }
    let (field, p) = found.unwrap_or(("partial_rotary_factor".into(), arch.defaults().partial_rotary_factor));
    if arch != Architecture::Nemotron {
        if p != 1.0 {
            return Err(err(field, format!("{p}: {} rotates every dim of the head", arch.class_name())));
        }
        return Ok(None);
    }
    let dims = head_dim as f64 * p;
    if !(p > 0.0 && p <= 1.0) || dims.fract() != 0.0 || !(dims as usize).is_multiple_of(2) {
        return Err(err(
            field,
            format!("{p} × head_dim {head_dim} = {dims} rotary dims: must be a whole, even number"),
        ));
    }
    Ok((p != 1.0).then_some(p))
}

/// A `config.json` of `model`'s family (Llama, Mixtral or Nemotron; f32 unless `dtype` says otherwise), with
/// `rope_theta`, `rope_scaling` and `partial_rotary_factor` at the top level (what transformers 4 and 5 both
/// read). `max_position_embeddings` is the context the model was trained at; with a `dynamic` scaling it is that
/// scaling's original context, which transformers takes from this field. A Mixtral's `output_router_logits` is
/// true when it trains with a load-balancing loss, so transformers' training adds it too.
pub fn to_json(model: &ModelConfig, max_position_embeddings: usize, dtype: &str) -> Value {
    let max_pos = match &model.rope_scaling {
        Some(RopeScalingConfig::Dynamic { original_max_position_embeddings, .. }) => *original_max_position_embeddings,
        _ => max_position_embeddings,
    };
    let arch = Architecture::of_family(model.family);
    // The shortest decimal that reads back as the same f32 (`1e-05`, not its f64 widening 9.99999974e-06).
    let eps: f64 = model.norm_eps.to_string().parse().unwrap_or(model.norm_eps as f64);
    let mut v = json!({
        "architectures": [arch.class_name()],
        "model_type": arch.model_type(),
        "hidden_size": model.d_model,
        "intermediate_size": model.ffn,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim(),
        "vocab_size": model.vocab,
        (arch.eps_field()): eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": model.rope_scaling.as_ref().map(RopeScalingConfig::to_hf),
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_dropout": 0.0,
        "torch_dtype": dtype,
    });
    let extra = match arch {
        Architecture::Llama => json!({ "attention_bias": false, "mlp_bias": false, "hidden_act": "silu" }),
        Architecture::Mixtral => {
            let moe = model.moe.unwrap_or(MoeConfig { experts: 1, top_k: 1, aux_loss_coef: 0.0 });
            json!({
                "hidden_act": "silu",
                "num_local_experts": moe.experts,
                "num_experts_per_tok": moe.top_k,
                "router_aux_loss_coef": moe.aux_loss_coef,
                "output_router_logits": moe.aux_loss_coef > 0.0,
                "router_jitter_noise": 0.0,
                "sliding_window": null,
            })
        }
        Architecture::Nemotron => json!({
            "attention_bias": false,
            "mlp_bias": false,
            "hidden_act": "relu2",
            "partial_rotary_factor": model.partial_rotary_factor.unwrap_or(1.0),
        }),
    };
    if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
    v
}
