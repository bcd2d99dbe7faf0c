//! Which Hugging Face architectures the trainer reads, and which `config.json` fields each may carry.
//!
//! Every field of a `config.json` is in one of three sets per architecture: *mapped* onto the trainer's
//! [`ModelConfig`](crate::recipe::ModelConfig) (read by [`super::config`]), *required to hold a value* the model
//! computes exactly (`attention_bias: false`, `hidden_act: "silu"`), or *bookkeeping* that changes nothing the
//! model computes (`torch_dtype`, token ids, `use_cache`). Anything else is an error naming the field: a setting
//! silently ignored gives a plausible but wrong model. A new family adds its variant, its names, its mapped and
//! required fields and its defaults (what transformers assumes for an absent field, which differs by family:
//! Mixtral's `rope_theta` is 1e6, Nemotron's `partial_rotary_factor` 0.5) here.
//!
//! Checked against transformers 5.24's modelling code: Mixtral's router (`MixtralTopKRouter`) takes the softmax
//! over all `E` logits, the top `k` of it, and renormalises them, which is the softmax over the top-k logits the
//! trainer's router computes; `router_jitter_noise` multiplies the router's input by noise in training only, so
//! it must be 0. Nemotron's `NemotronLayerNorm1P` is `F.layer_norm(x, weight + 1, bias)` (the trainer's
//! zero-centred LayerNorm with bias); its partial RoPE rotates the first `head_dim · partial_rotary_factor` dims
//! of each head with `rotate_half` within them (pairs `(i, i + R/2)`) and passes the rest through, as the
//! trainer's kernel does, so a checkpoint's q/k rows load as they are.

use serde_json::Value;

use crate::recipe::Family;

/// A Hugging Face architecture the trainer's model computes exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM` (`model_type` `llama`): RMSNorm, RoPE, GQA, SwiGLU, no biases.
    Llama,
    /// `MixtralForCausalLM` (`model_type` `mixtral`): the Llama layer with a top-k mixture of SwiGLU experts.
    Mixtral,
    /// `NemotronForCausalLM` (`model_type` `nemotron`): LayerNorm1P with bias, partial RoPE, squared-ReLU MLP.
    Nemotron,
}

/// A `config.json` field that must hold the one value the model computes.
#[derive(Debug, Clone, Copy)]
pub struct Required {
    /// The field.
    pub field: &'static str,
    /// Whether a value is the supported one.
    pub ok: fn(&Value) -> bool,
    /// The supported value, for messages.
    pub want: &'static str,
}

/// Fields that describe the files or the generation defaults, not the computation: accepted and unused.
pub const BOOKKEEPING: &[&str] = &[
    "_name_or_path",
    "_attn_implementation_autoset",
    "architectures",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "use_cache",
    "initializer_range",
    "tokenizer_class",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "torchscript",
    "id2label",
    "label2id",
    "problem_type",
    "finetuning_task",
    "task_specific_params",
    "prefix",
    "chunk_size_feed_forward",
    "is_decoder",
    "is_encoder_decoder",
    "add_cross_attention",
    "tie_encoder_decoder",
    // Splits the projections into slices in transformers' eager code; the product is the same matrix.
    "pretraining_tp",
];

impl Architecture {
    /// The architecture a `config.json` names through `model_type` (or, without one, `architectures`).
    pub fn from_names(model_type: Option<&str>, architectures: &[String]) -> Option<Architecture> {
        match model_type {
            Some(t) => Self::ALL.into_iter().find(|a| a.model_type() == t),
            None => architectures.iter().find_map(|n| Self::ALL.into_iter().find(|a| a.class_name() == n)),
        }
    }

    /// Every architecture the trainer reads.
    pub const ALL: [Architecture; 3] = [Architecture::Llama, Architecture::Mixtral, Architecture::Nemotron];

    /// The architecture of a trainer family (what export writes).
    pub fn of_family(family: Family) -> Architecture {
        match family {
            Family::Llama => Architecture::Llama,
            Family::Mixtral => Architecture::Mixtral,
            Family::Nemotron => Architecture::Nemotron,
        }
    }

    /// The trainer family that computes this architecture.
    pub fn family(self) -> Family {
        match self {
            Architecture::Llama => Family::Llama,
            Architecture::Mixtral => Family::Mixtral,
            Architecture::Nemotron => Family::Nemotron,
        }
    }

    /// The norm epsilon's field: RMSNorm's `rms_norm_eps`, Nemotron's LayerNorm `norm_eps`.
    pub fn eps_field(self) -> &'static str {
        match self {
            Architecture::Llama | Architecture::Mixtral => "rms_norm_eps",
            Architecture::Nemotron => "norm_eps",
        }
    }

    /// transformers' defaults for fields a `config.json` may leave out (its config classes'): the norm epsilon,
    /// `rope_theta`, `partial_rotary_factor` (`NemotronConfig` sets 0.5 when absent) and the KV heads
    /// (`MixtralConfig` 8; Llama as many as the query heads; Nemotron's modelling code has no default, so the
    /// query heads' count, multi-head attention, stands in).
    pub fn defaults(self) -> Defaults {
        match self {
            Architecture::Llama => {
                Defaults { norm_eps: 1e-6, rope_theta: 10_000.0, partial_rotary_factor: 1.0, kv_heads: None }
            }
            Architecture::Mixtral => {
                Defaults { norm_eps: 1e-5, rope_theta: 1e6, partial_rotary_factor: 1.0, kv_heads: Some(8) }
            }
            Architecture::Nemotron => {
                Defaults { norm_eps: 1e-5, rope_theta: 10_000.0, partial_rotary_factor: 0.5, kv_heads: None }
            }
        }
    }

    /// `model_type` as transformers writes it.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mixtral => "mixtral",
            Architecture::Nemotron => "nemotron",
        }
    }

    /// The class name of `architectures`.
    pub fn class_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mixtral => "MixtralForCausalLM",
            Architecture::Nemotron => "NemotronForCausalLM",
        }
    }

    /// Fields mapped onto the model's configuration beyond [`COMMON_MAPPED`] (see [`Architecture::maps`]).
    pub fn mapped(self) -> &'static [&'static str] {
        match self {
            Architecture::Llama => &["rms_norm_eps"],
            // `output_router_logits` only decides whether transformers' forward returns the router logits and
            // adds the load-balancing loss; the trainer always adds `router_aux_loss_coef` times it in training
            // (the import notes it when the flag is false), and evaluation reports the cross-entropy alone.
            Architecture::Mixtral => &[
                "rms_norm_eps",
                "num_local_experts",
                "num_experts_per_tok",
                "router_aux_loss_coef",
                "output_router_logits",
            ],
            Architecture::Nemotron => &["norm_eps"],
        }
    }

    /// Fields that must hold one given value (the model computes nothing else); absent is the same as
    /// transformers' default, which is always allowed.
    pub fn required(self) -> &'static [Required] {
        match self {
            Architecture::Llama => &[NO_ATTENTION_BIAS, NO_MLP_BIAS, SILU, NO_ATTENTION_DROPOUT],
            Architecture::Mixtral => &[
                SILU,
                NO_ATTENTION_DROPOUT,
                Required {
                    field: "router_jitter_noise",
                    ok: |v| v.as_f64() == Some(0.0),
                    want: "0.0 (router input noise in training is not implemented)",
                },
                // null (absent) is full causal attention; any window is refused, even one longer than every
                // sequence, rather than guessed about.
                Required {
                    field: "sliding_window",
                    ok: |_| false,
                    want: "null (sliding-window attention is not implemented)",
                },
            ],
            Architecture::Nemotron => &[
                NO_ATTENTION_BIAS,
                NO_MLP_BIAS,
                NO_ATTENTION_DROPOUT,
                Required {
                    field: "hidden_act",
                    ok: |v| v.as_str() == Some("relu2"),
                    want: "\"relu2\" (the squared-ReLU MLP)",
                },
            ],
        }
    }

    /// Supported architectures, for messages.
    pub fn supported() -> &'static str {
        "llama (LlamaForCausalLM), mixtral (MixtralForCausalLM) and nemotron (NemotronForCausalLM)"
    }
}

/// What transformers assumes for an absent field, per architecture.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Defaults {
    /// The norm epsilon.
    pub norm_eps: f64,
    /// The RoPE base.
    pub rope_theta: f64,
    /// The rotating share of each head.
    pub partial_rotary_factor: f64,
    /// The KV heads (`None`: as many as the query heads).
    pub kv_heads: Option<usize>,
}

/// The fields every architecture maps the same way (`partial_rotary_factor` must be 1 but for Nemotron) (the shapes, RoPE, embeddings tying).
pub const COMMON_MAPPED: &[&str] = &[
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "original_max_position_embeddings",
    "tie_word_embeddings",
    "partial_rotary_factor",
];

const NO_ATTENTION_BIAS: Required = Required {
    field: "attention_bias",
    ok: |v| v == &Value::Bool(false),
    want: "false (the model has no q/k/v/o biases)",
};
const NO_MLP_BIAS: Required =
    Required { field: "mlp_bias", ok: |v| v == &Value::Bool(false), want: "false (the MLP has no biases)" };
const SILU: Required = Required { field: "hidden_act", ok: |v| v.as_str() == Some("silu"), want: "\"silu\" (SwiGLU)" };
const NO_ATTENTION_DROPOUT: Required = Required {
    field: "attention_dropout",
    ok: |v| v.as_f64() == Some(0.0),
    want: "0.0 (attention dropout is not implemented)",
};

impl Architecture {
    /// Whether `field` is one this architecture maps (see [`Architecture::mapped`]).
    pub fn maps(self, field: &str) -> bool {
        COMMON_MAPPED.contains(&field) || self.mapped().contains(&field)
    }
}
