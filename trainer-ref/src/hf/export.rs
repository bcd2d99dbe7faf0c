//! `longctx export --hf DIR`: a trainer checkpoint written as a Hugging Face checkpoint directory
//! (`config.json`, f32 safetensors, sharded with an index past a size), which [`super::load`] reads back bit
//! for bit and transformers' `AutoModelForCausalLM.from_pretrained` loads.

use std::path::{Path, PathBuf};

use super::config::{to_json, CONFIG_FILE};
use super::weights::{self, OutTensor};
use crate::checkpoint::{self, LoadedTensor};
use crate::error::{Result, TrainError};
use crate::model::param_shapes;
use crate::recipe::ModelConfig;

/// How to export.
#[derive(Debug, Clone, Copy)]
pub struct ExportOptions {
    /// Largest safetensors file; past it the weights are sharded (transformers' default is 5 GB).
    pub max_shard_bytes: u64,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions { max_shard_bytes: 5_000_000_000 }
    }
}

/// Exports the trainer checkpoint `ckpt` (a checkpoint directory or a run's output folder: its newest) to the
/// new or empty directory `out`; returns the files written. `max_position_embeddings` is the run's sequence
/// length.
pub fn export_checkpoint(ckpt: &Path, out: &Path, opts: &ExportOptions) -> Result<Vec<PathBuf>> {
    let ck = checkpoint::load(ckpt)?;
    let recipe = crate::eval::checkpoint_recipe(&ck)?;
    checkpoint::expect_tensors(&ck.model_path(), &ck.model, &param_shapes(&recipe.model))?;
    write_dir(out, &recipe.model, recipe.train.seq_len, &ck.model, opts)
}

/// Writes `tensors` of `model` (named and shaped as [`param_shapes`] says) as a Hugging Face directory `out`.
pub fn write_dir(
    out: &Path,
    model: &ModelConfig,
    max_position_embeddings: usize,
    tensors: &[LoadedTensor],
    opts: &ExportOptions,
) -> Result<Vec<PathBuf>> {
    if out.exists() {
        let mut entries = std::fs::read_dir(out).map_err(|e| TrainError::io(out, e))?;
        if entries.next().is_some() {
            return Err(TrainError::Config(format!(
                "{}: not empty; export writes into a new or empty directory (nothing is overwritten)",
                out.display()
            )));
        }
    }
    std::fs::create_dir_all(out).map_err(|e| TrainError::io(out, e))?;
    let config_path = out.join(CONFIG_FILE);
    let text = serde_json::to_vec_pretty(&to_json(model, max_position_embeddings, "float32"))
        .map_err(|e| TrainError::Config(format!("{}: {e}", config_path.display())))?;
    std::fs::write(&config_path, text).map_err(|e| TrainError::io(&config_path, e))?;
    let outs: Vec<OutTensor<'_>> =
        tensors.iter().map(|t| OutTensor { name: &t.name, dims: &t.dims, data: &t.data }).collect();
    let mut files = vec![config_path];
    files.extend(weights::write(out, &outs, opts.max_shard_bytes)?);
    Ok(files)
}
