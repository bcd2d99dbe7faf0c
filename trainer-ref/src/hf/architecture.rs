//! Which Hugging Face architectures the trainer reads, and which `config.json` fields each may carry.
//!
//! Every field of a `config.json` is in one of three sets per architecture: *mapped* onto the trainer's
//! [`ModelConfig`](crate::recipe::ModelConfig) (read by [`super::config`]), *required to hold a value* the model
//! computes exactly (`attention_bias: false`, `hidden_act: "silu"`), or *bookkeeping* that changes nothing the
//! model computes (`torch_dtype`, token ids, `use_cache`). Anything else is an error naming the field: a setting
//! silently ignored gives a plausible but wrong model. A new family (Mixtral, Nemotron) adds its variant, its
//! names and its mapped and required fields here.

use serde_json::Value;

/// A Hugging Face architecture the trainer's model computes exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM` (`model_type` `llama`): RMSNorm, RoPE, GQA, SwiGLU, no biases.
    Llama,
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
            Some("llama") => Some(Architecture::Llama),
            Some(_) => None,
            None => architectures.iter().find_map(|a| match a.as_str() {
                "LlamaForCausalLM" => Some(Architecture::Llama),
                _ => None,
            }),
        }
    }

    /// `model_type` as transformers writes it.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
        }
    }

    /// The class name of `architectures`.
    pub fn class_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
        }
    }

    /// Fields mapped onto the model's configuration.
    pub fn mapped(self) -> &'static [&'static str] {
        match self {
            Architecture::Llama => &[
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "vocab_size",
                "rms_norm_eps",
                "rope_theta",
                "rope_scaling",
                "rope_parameters",
                "max_position_embeddings",
                "original_max_position_embeddings",
                "tie_word_embeddings",
                "partial_rotary_factor",
            ],
        }
    }

    /// Fields that must hold one given value (the model computes nothing else); absent is the same as
    /// transformers' default, which is always allowed.
    pub fn required(self) -> &'static [Required] {
        match self {
            Architecture::Llama => &[
                Required {
                    field: "attention_bias",
                    ok: |v| v == &Value::Bool(false),
                    want: "false (the model has no q/k/v/o biases)",
                },
                Required { field: "mlp_bias", ok: |v| v == &Value::Bool(false), want: "false (the MLP has no biases)" },
                Required { field: "hidden_act", ok: |v| v.as_str() == Some("silu"), want: "\"silu\" (SwiGLU)" },
                Required {
                    field: "attention_dropout",
                    ok: |v| v.as_f64() == Some(0.0),
                    want: "0.0 (attention dropout is not implemented)",
                },
            ],
        }
    }

    /// Supported architectures, for messages.
    pub fn supported() -> &'static str {
        "llama (LlamaForCausalLM)"
    }
}
