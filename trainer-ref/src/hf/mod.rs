//! Hugging Face checkpoints: read a transformers checkpoint directory (`--init-from DIR`) into the trainer's
//! model, and write one back (`longctx export --hf DIR`).
//!
//! ```text
//! DIR/config.json                          the architecture and shape (config)
//! DIR/model.safetensors                    the weights, or
//! DIR/model.safetensors.index.json         {"weight_map": {tensor: shard}} and the shards it names (weights)
//! DIR/tokenizer.json                       optional: text for `longctx eval --tokens FILE.txt` and a run's
//!                                          corpus (saved in its checkpoints; export writes it back)
//! ```
//!
//! Architectures: Llama, Mixtral and Nemotron ([`architecture`]). Tensor names are transformers'
//! (`model.layers.N.self_attn.q_proj.weight`, `[out, in]`), the trainer's own (see
//! [`crate::model::param_shapes`]); a Mixtral's experts may also come fused as transformers 5 holds them
//! ([`experts`]), and export writes either (per expert, the names real checkpoints have, unless `--experts fused`).
//! Rotary layout: transformers rotates the pairs `(i, i + D/2)` of each head (`rotate_half`), and so does the
//! trainer's RoPE kernel, so q and k rows load as they are; Meta's original checkpoints and GGUF files pair
//! `(2i, 2i+1)` instead and need [`permute`]'s row permutation (the fixture test `hf_interop` shows the loss moving
//! by 0.2 nats when it is applied where it should not be).
//!
//! Everything is checked before any tensor data is read: `config.json` field by field ([`config`]), every
//! safetensors header, then names, shapes and dtypes ([`weights`]). Errors name the file and the field or
//! tensor.

pub mod architecture;
pub mod config;
pub mod experts;
pub mod export;
pub mod permute;
pub mod weights;

use std::path::{Path, PathBuf};

pub use architecture::Architecture;
pub use config::HfConfig;

use crate::checkpoint::LoadedTensor;
use crate::error::{Result, TrainError};
use crate::recipe::{ModelConfig, Recipe};

/// The tokenizer's file inside a checkpoint directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// A pretrained checkpoint, read and checked: its configuration and every tensor of the trainer's model, in
/// [`param_shapes`](crate::model::param_shapes) order, as f32; from a Hugging Face directory or a GGUF file.
#[derive(Debug, Clone)]
pub struct HfCheckpoint {
    /// The directory (or the GGUF file).
    pub dir: PathBuf,
    /// Its `config.json` (for a GGUF file, the same facts from its metadata).
    pub config: HfConfig,
    /// The model's tensors, in the trainer's order, f32.
    pub tensors: Vec<LoadedTensor>,
    /// Its tokenizer (`DIR/tokenizer.json`, or the vocabulary in a GGUF file's metadata), if it has one.
    pub tokenizer: Option<tokenizers::Tokenizer>,
}

impl HfCheckpoint {
    /// The model's configuration.
    pub fn model(&self) -> &ModelConfig {
        &self.config.model
    }

    /// How the corpus becomes this model's tokens: its tokenizer with its end-of-sequence token closing
    /// each document, or `None` when the checkpoint has no tokenizer or names no end-of-sequence token.
    pub fn text_tokenizer(&self) -> Option<crate::data::TextTokenizer> {
        self.saved_tokenizer().map(|t| t.text_tokenizer())
    }

    /// Its tokenizer and special tokens as a run's checkpoints save them, or `None` when the checkpoint has
    /// no tokenizer or names no end-of-sequence token (the run then reads bytes, and saves no tokenizer).
    pub fn saved_tokenizer(&self) -> Option<crate::checkpoint::SavedTokenizer> {
        Some(crate::checkpoint::SavedTokenizer {
            tokenizer: self.tokenizer.clone()?,
            eos_token_id: self.config.eos_token_id?,
            bos_token_id: self.config.bos_token_id,
        })
    }
}

/// Reads a pretrained checkpoint: a GGUF file (`*.gguf`, see [`crate::gguf`]) or a Hugging Face directory.
pub fn load_any(path: &Path) -> Result<HfCheckpoint> {
    if path.is_file() && path.extension().is_some_and(|e| e == "gguf") {
        return from_gguf(path);
    }
    load(path)
}

/// A GGUF Llama as a checkpoint: its metadata in `config.json` terms, its tensors dequantised and in the
/// Hugging Face layout, its tokenizer.
fn from_gguf(path: &Path) -> Result<HfCheckpoint> {
    let g = crate::gguf::GgufLlama::load(path)?;
    let notes = vec![format!(
        "{}: a GGUF file, dequantised to f32; trained context {} tokens",
        path.display(),
        g.context_length
    )];
    let config = HfConfig {
        path: path.to_path_buf(),
        architecture: Architecture::Llama,
        model: g.model_config(),
        max_position_embeddings: Some(g.context_length),
        tie_word_embeddings: g.tied_embeddings,
        dtype: None,
        eos_token_id: g.eos_token,
        bos_token_id: g.bos_token,
        notes,
    };
    Ok(HfCheckpoint { dir: path.to_path_buf(), tensors: g.tensors, tokenizer: g.tokenizer, config })
}

/// A legacy buffer some checkpoints carry; transformers recomputes it and so does the trainer.
fn ignorable(name: &str) -> bool {
    name.ends_with(".self_attn.rotary_emb.inv_freq")
}

/// Reads and checks the checkpoint in `dir`, then its tensors (bf16 and f16 widened to f32).
pub fn load(dir: &Path) -> Result<HfCheckpoint> {
    let config = HfConfig::read(dir)?;
    let files = weights::WeightFiles::open(dir)?;
    // Tied: the model has no lm_head.weight (param_shapes leaves it out); a tied checkpoint may still carry
    // one, which transformers ties to the embedding regardless.
    let layout = experts::ExpertLayout::of(&files);
    let shapes = layout.file_shapes(&config.model);
    let tied = config.model.tie_embeddings;
    files.check(&shapes, |n| ignorable(n) || (tied && n == "lm_head.weight")).map_err(with_fields)?;
    let tensors = layout.read(&files, &config.model)?;
    let tok_path = dir.join(TOKENIZER_FILE);
    let tokenizer = if tok_path.is_file() {
        Some(tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| TrainError::Checkpoint {
            path: tok_path.clone(),
            detail: format!("not a usable tokenizer: {e}"),
        })?)
    } else {
        None
    };
    Ok(HfCheckpoint { dir: dir.to_path_buf(), config, tensors, tokenizer })
}

/// Adds to a shape error the `config.json` fields the wanted dims come from, so a wrong `head_dim` or
/// `intermediate_size` is named as well as the tensor it shows in.
fn with_fields(e: TrainError) -> TrainError {
    let TrainError::HfTensor { path, tensor, detail } = e else { return e };
    if !detail.contains("config.json implies") {
        return TrainError::HfTensor { path, tensor, detail };
    }
    let from = [
        ("q_proj.weight", "[num_attention_heads × head_dim, hidden_size]"),
        ("k_proj.weight", "[num_key_value_heads × head_dim, hidden_size]"),
        ("v_proj.weight", "[num_key_value_heads × head_dim, hidden_size]"),
        ("o_proj.weight", "[hidden_size, num_attention_heads × head_dim]"),
        ("gate_proj.weight", "[intermediate_size, hidden_size]"),
        ("up_proj.weight", "[intermediate_size, hidden_size]"),
        ("down_proj.weight", "[hidden_size, intermediate_size]"),
        ("embed_tokens.weight", "[vocab_size, hidden_size]"),
        ("lm_head.weight", "[vocab_size, hidden_size]"),
        ("norm.weight", "[hidden_size]"),
        ("norm.bias", "[hidden_size]"),
        ("gate.weight", "[num_local_experts, hidden_size]"),
        ("w1.weight", "[intermediate_size, hidden_size]"),
        ("w3.weight", "[intermediate_size, hidden_size]"),
        ("w2.weight", "[hidden_size, intermediate_size]"),
        ("experts.gate_up_proj", "[num_local_experts, 2 × intermediate_size, hidden_size]"),
        ("experts.down_proj", "[num_local_experts, hidden_size, intermediate_size]"),
    ]
    .iter()
    .find(|(suffix, _)| tensor.ends_with(suffix))
    .map(|(_, f)| *f);
    let mut detail = detail;
    if let Some(f) = from {
        let at = detail.find(" (and ").unwrap_or(detail.len());
        detail.insert_str(at, &format!(" = {f}"));
    }
    TrainError::HfTensor { path, tensor, detail }
}

/// The model fields a recipe may not change from the checkpoint's: the shapes its tensors have (an absent
/// mixture of experts counts 0 experts).
fn shape_fields(m: &ModelConfig) -> [(&'static str, usize); 8] {
    [
        ("model.layers", m.layers),
        ("model.d_model", m.d_model),
        ("model.heads", m.heads),
        ("model.kv_heads", m.kv_heads),
        ("model.head_dim", m.head_dim()),
        ("model.ffn", m.ffn),
        ("model.vocab", m.vocab),
        ("model.moe.experts", m.moe.map_or(0, |e| e.experts)),
    ]
}

/// Fails naming the field where `recipe`'s model has a shape other than the checkpoint's.
pub fn check_model(recipe: &ModelConfig, hf: &HfConfig) -> Result<()> {
    if recipe.family != hf.model.family {
        return Err(TrainError::InvalidField {
            field: "model.family".into(),
            detail: format!(
                "{}, but {} gives the checkpoint {}",
                recipe.family.name(),
                hf.path.display(),
                hf.model.family.name()
            ),
        });
    }
    for ((field, mine), (_, theirs)) in shape_fields(recipe).into_iter().zip(shape_fields(&hf.model)) {
        if mine != theirs {
            return Err(TrainError::InvalidField {
                field: field.to_string(),
                detail: format!("{mine}, but {} gives the checkpoint {theirs}", hf.path.display()),
            });
        }
    }
    Ok(())
}

/// `recipe` with its model section replaced by the checkpoint's, then the `model.*` entries of `overrides`
/// applied on top: the RoPE base, scaling and norm epsilon may change (extending the context); a shape may
/// not (the tensors have theirs), and trying is an error naming the field.
pub fn recipe_from(recipe: &Recipe, overrides: &[String], hf: &HfConfig) -> Result<Recipe> {
    let mut r = recipe.clone();
    r.model = ModelConfig { init_std: recipe.model.init_std, ..hf.model.clone() };
    let model_sets: Vec<String> = overrides.iter().filter(|o| o.trim_start().starts_with("model.")).cloned().collect();
    if !model_sets.is_empty() {
        r = Recipe::parse("recipe with the checkpoint's model", &r.to_toml(), &model_sets)?;
    }
    r.validate()?;
    check_model(&r.model, hf)?;
    Ok(r)
}
