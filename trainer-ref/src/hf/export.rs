//! `longctx export --hf DIR`: a trainer checkpoint written as a Hugging Face checkpoint directory, the format
//! `--init-from` reads, so a run can go back to transformers or start another run:
//!
//! ```text
//! DIR/config.json               the architecture; `torch_dtype` the weights' format; `eos_token_id` and
//!                               `bos_token_id` when the checkpoint carries a tokenizer
//! DIR/model.safetensors         the weights, f32 (default) or bf16 (`--dtype bf16`), or shards past a size
//!                               with `model.safetensors.index.json`; a Mixtral's experts per expert as on the
//!                               Hub (default, `--experts per-expert`) or fused as transformers 5 holds them
//!                               (`--experts fused`: `mlp.experts.gate_up_proj`/`down_proj`, see [`super::experts`])
//! DIR/tokenizer.json            the run's tokenizer, when its checkpoint saved one (a run `--init-from` a
//!                               checkpoint with a tokenizer, a GGUF file's included)
//! DIR/tokenizer_config.json     with it: which class reads it and its special tokens, for `AutoTokenizer`
//! ```
//!
//! [`super::load`] reads an f32 export back bit for bit in either expert layout, and a bf16 one as each value
//! rounded to the nearest bf16 (ties to even) and widened; transformers' `AutoModelForCausalLM.from_pretrained`
//! and `AutoTokenizer.from_pretrained` load the directory as it is. A fused tensor is one tensor, so it lies in
//! one shard whatever `--max-shard-size` says (a shard of its own when larger). `--experts fused` on a model
//! without experts is an error ([`TrainError::ExportOption`]).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::config::{to_json, CONFIG_FILE};
pub use super::experts::ExpertLayout;
use super::experts::FileTensor;
pub use super::weights::WeightDtype;
use super::weights::{self, OutTensor};
use super::TOKENIZER_FILE;
use crate::checkpoint::{self, LoadedTensor, SavedTokenizer};
use crate::error::{Result, TrainError};
use crate::model::param_shapes;
use crate::recipe::ModelConfig;

/// `AutoTokenizer`'s own file beside `tokenizer.json`.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// How to export.
#[derive(Debug, Clone, Copy)]
pub struct ExportOptions {
    /// Largest safetensors file; past it the weights are sharded (transformers' default is 5 GB).
    pub max_shard_bytes: u64,
    /// The weights' number format.
    pub dtype: WeightDtype,
    /// Where a Mixtral's experts go: per expert (the Hub's names) or fused (transformers 5's); fused is an error
    /// for a model without experts.
    pub experts: ExpertLayout,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions { max_shard_bytes: 5_000_000_000, dtype: WeightDtype::F32, experts: ExpertLayout::PerExpert }
    }
}

/// Exports the trainer checkpoint `ckpt` (a checkpoint directory or a run's output folder: its newest) to the
/// new or empty directory `out`, with its tokenizer when it saved one; returns the files written.
/// `max_position_embeddings` is the run's sequence length.
pub fn export_checkpoint(ckpt: &Path, out: &Path, opts: &ExportOptions) -> Result<Vec<PathBuf>> {
    let ck = checkpoint::load(ckpt)?;
    let recipe = crate::eval::checkpoint_recipe(&ck)?;
    // Checked here too, so that a mismatch names the checkpoint's file rather than the export's directory.
    checkpoint::expect_tensors(&ck.model_path(), &ck.model, &param_shapes(&recipe.model))?;
    write_dir(out, &recipe.model, recipe.train.seq_len, &ck.model, ck.tokenizer.as_ref(), opts)
}

/// Writes `tensors` of `model` (named and shaped as [`param_shapes`] says), and `tokenizer` when given, as a
/// Hugging Face directory `out`, the experts in the layout `opts` names. Tensors that are not the model's
/// (missing, extra, or of other dims: [`TrainError::Checkpoint`] naming each) and options the model cannot take
/// fail before anything is written.
pub fn write_dir(
    out: &Path,
    model: &ModelConfig,
    max_position_embeddings: usize,
    tensors: &[LoadedTensor],
    tokenizer: Option<&SavedTokenizer>,
    opts: &ExportOptions,
) -> Result<Vec<PathBuf>> {
    checkpoint::expect_tensors(out, tensors, &param_shapes(model))?;
    let file_tensors = opts.experts.file_tensors(model, tensors)?;
    if out.exists() {
        let mut entries = std::fs::read_dir(out).map_err(|e| TrainError::io(out, e))?;
        if entries.next().is_some() {
            return Err(TrainError::OutputNotEmpty {
                path: out.to_path_buf(),
                why: "export writes into a new or empty directory (nothing is overwritten)".into(),
            });
        }
    }
    // Serialised before anything is written, so a tokenizer that cannot be leaves no half-written directory.
    let tokenizer_text = tokenizer
        .map(|t| {
            t.tokenizer.to_string(true).map_err(|e| TrainError::Tokenizer {
                context: format!("{}: the tokenizer cannot be serialised", out.join(TOKENIZER_FILE).display()),
                detail: e.to_string(),
            })
        })
        .transpose()?;
    std::fs::create_dir_all(out).map_err(|e| TrainError::io(out, e))?;
    let config_path = out.join(CONFIG_FILE);
    let mut config = to_json(model, max_position_embeddings, opts.dtype.torch_dtype());
    if let (Some(t), Some(obj)) = (tokenizer, config.as_object_mut()) {
        // transformers takes the end of generation from here (and `--init-from` the end of each document).
        obj.insert("eos_token_id".into(), t.eos_token_id.into());
        obj.insert("bos_token_id".into(), t.bos_token_id.map_or(Value::Null, Value::from));
    }
    let mut files = vec![write_json(&config_path, &config)?];
    files.extend(weights::write(out, &tensor_views(&file_tensors), opts.max_shard_bytes, opts.dtype)?);
    if let (Some(t), Some(text)) = (tokenizer, tokenizer_text) {
        let path = out.join(TOKENIZER_FILE);
        std::fs::write(&path, text).map_err(|e| TrainError::io(&path, e))?;
        files.push(path);
        files.push(write_json(&out.join(TOKENIZER_CONFIG_FILE), &tokenizer_config(t))?);
    }
    Ok(files)
}

fn tensor_views<'a>(tensors: &'a [FileTensor<'_>]) -> Vec<OutTensor<'a>> {
    tensors.iter().map(|t| OutTensor { name: &t.name, dims: &t.dims, data: &t.data }).collect()
}

/// What `AutoTokenizer` needs beside `tokenizer.json`: without it transformers loads the tokenizer but knows no
/// end-of-sequence token. The generic fast class reads `tokenizer.json` as it is, whatever the architecture.
fn tokenizer_config(t: &SavedTokenizer) -> Value {
    let token = |id: Option<u32>| id.and_then(|i| t.tokenizer.id_to_token(i)).map_or(Value::Null, Value::from);
    json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": token(Some(t.eos_token_id)),
        "bos_token": token(t.bos_token_id),
    })
}

fn write_json(path: &Path, value: &Value) -> Result<PathBuf> {
    let text = serde_json::to_vec_pretty(value)
        .map_err(|e| TrainError::Internal(format!("{}: cannot encode: {e}", path.display())))?;
    std::fs::write(path, text).map_err(|e| TrainError::io(path, e))?;
    Ok(path.to_path_buf())
}
