//! The two layouts of a Mixtral checkpoint's expert tensors, and reading either into the trainer's.
//!
//! ```text
//! Hub (real checkpoints; transformers 5's save_pretrained by default; the trainer's own and what export writes):
//!   model.layers.N.block_sparse_moe.gate.weight          [E, C]   the router
//!   model.layers.N.block_sparse_moe.experts.E.w1.weight  [F, C]   gate
//!   model.layers.N.block_sparse_moe.experts.E.w3.weight  [F, C]   up
//!   model.layers.N.block_sparse_moe.experts.E.w2.weight  [C, F]   down
//! Fused (transformers 5's modules, written by save_pretrained(save_original_format=False)):
//!   model.layers.N.mlp.gate.weight                       [E, C]
//!   model.layers.N.mlp.experts.gate_up_proj              [E, 2F, C]   expert e: rows 0..F are w1, F..2F are w3
//!   model.layers.N.mlp.experts.down_proj                 [E, C, F]    expert e: w2
//! ```
//!
//! transformers 5 reads the Hub layout through its conversion mapping (`block_sparse_moe` → `mlp`, the
//! per-expert `w1`/`w3` concatenated into `gate_up_proj`, `w2` stacked into `down_proj`), and its
//! `MixtralExperts.forward` splits `gate_up_proj` with `chunk(2)` into gate then up: the row ranges above. The
//! fused layout is recognised by its `gate_up_proj` tensors; everything else about the checkpoint is the same.

use std::collections::HashMap;

use super::weights::WeightFiles;
use crate::checkpoint::LoadedTensor;
use crate::error::{Result, TrainError};
use crate::model::param_shapes;
use crate::recipe::ModelConfig;

/// Where the experts' weights lie in a checkpoint's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertLayout {
    /// One tensor per expert and projection, under `block_sparse_moe` (and every non-Mixtral checkpoint).
    Hub,
    /// One `[E, 2F, C]` and one `[E, C, F]` tensor per layer, under `mlp`.
    Fused,
}

/// Where a trainer tensor lies in the fused layout's files.
enum Part {
    /// The whole of another name (the router).
    Renamed(String),
    /// Rows `rows` of expert `expert`'s `[rows, cols]` matrix in a fused tensor.
    Slice { tensor: String, expert: usize, rows: std::ops::Range<usize> },
}

impl ExpertLayout {
    /// The layout of `files`: fused when any tensor is a fused `gate_up_proj`.
    pub fn of(files: &WeightFiles) -> ExpertLayout {
        if files.entries.keys().any(|n| n.ends_with(".mlp.experts.gate_up_proj")) {
            ExpertLayout::Fused
        } else {
            ExpertLayout::Hub
        }
    }

    /// The tensors (names and dims) the files of a checkpoint of `cfg` hold in this layout.
    pub fn file_shapes(self, cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
        let shapes = param_shapes(cfg);
        let (ExpertLayout::Fused, Some(moe)) = (self, cfg.experts()) else { return shapes };
        let (c, f, e) = (cfg.d_model, cfg.ffn, moe.experts);
        let mut out = Vec::with_capacity(shapes.len());
        for (name, dims) in shapes {
            match fused_name(&name) {
                Some(Fused::Router(layer)) => out.push((format!("model.layers.{layer}.mlp.gate.weight"), dims)),
                // The layer's two fused tensors stand where its first expert's w1 stood.
                Some(Fused::Expert { layer, expert: 0, proj: 1 }) => {
                    out.push((format!("model.layers.{layer}.mlp.experts.gate_up_proj"), vec![e, 2 * f, c]));
                    out.push((format!("model.layers.{layer}.mlp.experts.down_proj"), vec![e, c, f]));
                }
                Some(Fused::Expert { .. }) => {}
                None => out.push((name, dims)),
            }
        }
        out
    }

    /// Reads every trainer tensor of `cfg` ([`param_shapes`] order, f32) from `files`, whose names and dims
    /// [`WeightFiles::check`] has compared with [`ExpertLayout::file_shapes`]. A fused tensor is read once and
    /// cut into its experts' matrices.
    pub fn read(self, files: &WeightFiles, cfg: &ModelConfig) -> Result<Vec<LoadedTensor>> {
        let shapes = param_shapes(cfg);
        let mut fused: HashMap<String, Vec<f32>> = HashMap::new();
        let mut out = Vec::with_capacity(shapes.len());
        for (name, dims) in shapes {
            let data = match self.part(&name, cfg) {
                None => files.read_f32(&name)?,
                Some(Part::Renamed(file_name)) => files.read_f32(&file_name)?,
                Some(Part::Slice { tensor: file_name, expert, rows }) => {
                    if !fused.contains_key(&file_name) {
                        let all = files.read_f32(&file_name)?;
                        fused.insert(file_name.clone(), all);
                    }
                    let all = fused.get(&file_name).map(Vec::as_slice).unwrap_or_default();
                    let cols = dims[1];
                    let per_expert = all.len() / cfg.experts().map_or(1, |m| m.experts).max(1);
                    let at = expert * per_expert;
                    let (s, e) = (at + rows.start * cols, at + rows.end * cols);
                    all.get(s..e)
                        .ok_or_else(|| TrainError::HfTensor {
                            path: files.listing.clone(),
                            tensor: file_name.clone(),
                            detail: format!("{} values, too few for expert {expert}'s rows {rows:?}", all.len()),
                        })?
                        .to_vec()
                }
            };
            out.push(LoadedTensor { name, dims, data });
        }
        Ok(out)
    }

    /// Where trainer tensor `name` lies in this layout's files, when not under its own name.
    fn part(self, name: &str, cfg: &ModelConfig) -> Option<Part> {
        if self == ExpertLayout::Hub {
            return None;
        }
        let f = cfg.ffn;
        match fused_name(name)? {
            Fused::Router(layer) => Some(Part::Renamed(format!("model.layers.{layer}.mlp.gate.weight"))),
            Fused::Expert { layer, expert, proj } => {
                let (tensor, rows) = match proj {
                    1 => ("gate_up_proj", 0..f),
                    3 => ("gate_up_proj", f..2 * f),
                    _ => ("down_proj", 0..cfg.d_model),
                };
                Some(Part::Slice { tensor: format!("model.layers.{layer}.mlp.experts.{tensor}"), expert, rows })
            }
        }
    }
}

/// A Hub-layout MoE tensor name, parsed.
enum Fused {
    /// `model.layers.N.block_sparse_moe.gate.weight`.
    Router(usize),
    /// `model.layers.N.block_sparse_moe.experts.E.w{proj}.weight`.
    Expert { layer: usize, expert: usize, proj: u8 },
}

fn fused_name(name: &str) -> Option<Fused> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    let rest = rest.strip_prefix("block_sparse_moe.")?;
    if rest == "gate.weight" {
        return Some(Fused::Router(layer));
    }
    let (expert, proj) = rest.strip_prefix("experts.")?.strip_suffix(".weight")?.split_once('.')?;
    let proj = match proj {
        "w1" => 1,
        "w2" => 2,
        "w3" => 3,
        _ => return None,
    };
    Some(Fused::Expert { layer, expert: expert.parse().ok()?, proj })
}
