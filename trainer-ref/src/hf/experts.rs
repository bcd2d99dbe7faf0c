//! The two layouts of a Mixtral checkpoint's expert tensors, reading either into the trainer's tensors and
//! writing the trainer's tensors as either: the one place that knows where an expert's matrix lies in the files.
//!
//! ```text
//! Per expert (real checkpoints; transformers 5's save_pretrained by default; the trainer's own, and what export
//! writes by default):
//!   model.layers.N.block_sparse_moe.gate.weight          [E, C]   the router
//!   model.layers.N.block_sparse_moe.experts.E.w1.weight  [F, C]   gate
//!   model.layers.N.block_sparse_moe.experts.E.w3.weight  [F, C]   up
//!   model.layers.N.block_sparse_moe.experts.E.w2.weight  [C, F]   down
//! Fused (transformers 5's modules, written by save_pretrained(save_original_format=False) and by
//! `longctx export --experts fused`):
//!   model.layers.N.mlp.gate.weight                       [E, C]
//!   model.layers.N.mlp.experts.gate_up_proj              [E, 2F, C]   expert e: rows 0..F are w1, F..2F are w3
//!   model.layers.N.mlp.experts.down_proj                 [E, C, F]    expert e: w2
//! ```
//!
//! transformers 5 reads the per-expert layout through its conversion mapping (`block_sparse_moe` → `mlp`, the
//! per-expert `w1`/`w3` concatenated into `gate_up_proj`, `w2` stacked into `down_proj`), and its
//! `MixtralExperts.forward` splits `gate_up_proj` with `chunk(2)` into gate then up: the row ranges above. The
//! fused layout is recognised by its `gate_up_proj` tensors; everything else about the checkpoint, `config.json`
//! included, is the same in both.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;

use super::weights::WeightFiles;
use crate::checkpoint::LoadedTensor;
use crate::error::{Result, TrainError};
use crate::model::param_shapes;
use crate::recipe::ModelConfig;

/// Where the experts' weights lie in a checkpoint's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertLayout {
    /// One tensor per expert and projection, under `block_sparse_moe`, as the Hub's checkpoints hold them (and
    /// every non-Mixtral checkpoint).
    #[default]
    PerExpert,
    /// One `[E, 2F, C]` and one `[E, C, F]` tensor per layer, under `mlp`.
    Fused,
}

/// One tensor of a checkpoint's files, to write: a trainer tensor as it is (borrowed), or a fused one gathered
/// from several.
#[derive(Debug, Clone)]
pub struct FileTensor<'a> {
    /// Its name in the files.
    pub name: String,
    /// Its dims.
    pub dims: Vec<usize>,
    /// Its values, row-major.
    pub data: Cow<'a, [f32]>,
}

/// Where a trainer tensor lies in the fused layout's files.
enum Part {
    /// The whole of another name (the router).
    Renamed(String),
    /// Rows `rows` of expert `expert`'s `[rows, cols]` block of a fused tensor, which are its values `values`
    /// (row-major, the whole tensor counted).
    Slice { tensor: String, dims: [usize; 3], expert: usize, rows: Range<usize>, values: Range<usize> },
}

impl ExpertLayout {
    /// `per-expert` or `fused`, as the command line spells it.
    pub fn parse(s: &str) -> Option<ExpertLayout> {
        match s {
            "per-expert" => Some(ExpertLayout::PerExpert),
            "fused" => Some(ExpertLayout::Fused),
            _ => None,
        }
    }

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ExpertLayout::PerExpert => "per-expert",
            ExpertLayout::Fused => "fused",
        }
    }

    /// The layout of `files`: fused when any tensor is a fused `gate_up_proj`.
    pub fn of(files: &WeightFiles) -> ExpertLayout {
        if files.entries.keys().any(|n| n.ends_with(".mlp.experts.gate_up_proj")) {
            ExpertLayout::Fused
        } else {
            ExpertLayout::PerExpert
        }
    }

    /// The tensors (names and dims) the files of a checkpoint of `cfg` hold in this layout.
    pub fn file_shapes(self, cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
        let shapes = param_shapes(cfg);
        let (ExpertLayout::Fused, Some(moe)) = (self, cfg.experts()) else { return shapes };
        let mut out = Vec::with_capacity(shapes.len());
        for (name, dims) in shapes {
            match fused_name(&name) {
                Some(Fused::Router(layer)) => out.push((fused_router(layer), dims)),
                // The layer's two fused tensors stand where its first expert's w1 stood.
                Some(Fused::Expert { layer, expert: 0, proj: 1 }) => {
                    for proj in [1, 2] {
                        let (tensor, dims, _) = fused_slot(layer, proj, cfg, moe.experts);
                        out.push((tensor, dims.to_vec()));
                    }
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
                Some(Part::Slice { tensor: file_name, expert, rows, values, .. }) => {
                    if !fused.contains_key(&file_name) {
                        let all = files.read_f32(&file_name)?;
                        fused.insert(file_name.clone(), all);
                    }
                    let all = fused.get(&file_name).map(Vec::as_slice).unwrap_or_default();
                    all.get(values)
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

    /// The tensors to write for the trainer's `tensors` of `cfg` (named and shaped as [`param_shapes`] says), in
    /// [`ExpertLayout::file_shapes`] order: what [`ExpertLayout::read`] reads back as `tensors`. Per expert, each
    /// tensor as it is; fused, each layer's experts gathered into its two fused tensors and the router renamed,
    /// which only a model with experts has (anything else is an [`TrainError::ExportOption`] error).
    pub fn file_tensors<'a>(self, cfg: &ModelConfig, tensors: &'a [LoadedTensor]) -> Result<Vec<FileTensor<'a>>> {
        if self == ExpertLayout::PerExpert {
            let as_is = |t: &'a LoadedTensor| FileTensor {
                name: t.name.clone(),
                dims: t.dims.clone(),
                data: Cow::from(&t.data[..]),
            };
            return Ok(tensors.iter().map(as_is).collect());
        }
        if cfg.experts().is_none() {
            return Err(TrainError::ExportOption {
                option: format!("--experts {}", self.name()),
                detail: format!(
                    "the checkpoint's model is a {} without experts; only a Mixtral's experts have a fused layout",
                    cfg.family.name()
                ),
            });
        }
        let mut by_name: HashMap<&str, &LoadedTensor> = tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        let mut whole: HashMap<String, &LoadedTensor> = HashMap::new();
        let mut fused: HashMap<String, Vec<f32>> = HashMap::new();
        for (name, dims) in param_shapes(cfg) {
            let t = by_name.remove(name.as_str()).filter(|t| t.dims == dims).ok_or_else(|| {
                TrainError::InvalidArgument {
                    name: format!("tensor `{name}`"),
                    detail: format!("missing or not of dims {dims:?}, which the model has"),
                }
            })?;
            match self.part(&name, cfg) {
                None => {
                    whole.insert(name, t);
                }
                Some(Part::Renamed(file_name)) => {
                    whole.insert(file_name, t);
                }
                Some(Part::Slice { tensor, dims, values, .. }) => {
                    let all = fused.entry(tensor.clone()).or_insert_with(|| vec![0.0; dims.iter().product()]);
                    let block = all.get_mut(values).filter(|b| b.len() == t.data.len()).ok_or_else(|| {
                        TrainError::InvalidArgument {
                            name: format!("tensor `{name}`"),
                            detail: format!("does not fit its block of `{tensor}` {dims:?}"),
                        }
                    })?;
                    block.copy_from_slice(&t.data);
                }
            }
        }
        if let Some(extra) = by_name.keys().min() {
            return Err(TrainError::InvalidArgument {
                name: format!("tensor `{extra}`"),
                detail: "not one the model has".into(),
            });
        }
        let mut out = Vec::with_capacity(fused.len() + whole.len());
        for (name, dims) in self.file_shapes(cfg) {
            let data = match (fused.remove(&name), whole.get(name.as_str())) {
                (Some(data), _) => Cow::Owned(data),
                (None, Some(t)) => Cow::from(&t.data[..]),
                (None, None) => {
                    return Err(TrainError::Internal(format!(
                        "tensor `{name}` of the fused layout: no tensor of the model makes it"
                    )))
                }
            };
            out.push(FileTensor { name, dims, data });
        }
        Ok(out)
    }

    /// Where trainer tensor `name` lies in this layout's files, when not under its own name.
    fn part(self, name: &str, cfg: &ModelConfig) -> Option<Part> {
        if self == ExpertLayout::PerExpert {
            return None;
        }
        let experts = cfg.experts()?.experts;
        match fused_name(name)? {
            Fused::Router(layer) => Some(Part::Renamed(fused_router(layer))),
            Fused::Expert { layer, expert, proj } => {
                let (tensor, dims, rows) = fused_slot(layer, proj, cfg, experts);
                let [_, rows_per_expert, cols] = dims;
                let at = expert * rows_per_expert * cols;
                let values = at + rows.start * cols..at + rows.end * cols;
                Some(Part::Slice { tensor, dims, expert, rows, values })
            }
        }
    }
}

/// A layer's router in the fused layout.
fn fused_router(layer: usize) -> String {
    format!("model.layers.{layer}.mlp.gate.weight")
}

/// Where projection `w{proj}` of a layer's experts lies in the fused layout: the fused tensor's name, its dims
/// `[experts, rows, cols]`, and which rows of each expert's `[rows, cols]` block are that projection's.
fn fused_slot(layer: usize, proj: u8, cfg: &ModelConfig, experts: usize) -> (String, [usize; 3], Range<usize>) {
    let (c, f) = (cfg.d_model, cfg.ffn);
    let name = |t: &str| format!("model.layers.{layer}.mlp.experts.{t}");
    match proj {
        1 => (name("gate_up_proj"), [experts, 2 * f, c], 0..f),
        3 => (name("gate_up_proj"), [experts, 2 * f, c], f..2 * f),
        _ => (name("down_proj"), [experts, c, f], 0..c),
    }
}

/// A per-expert-layout MoE tensor name, parsed.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipe::Recipe;

    /// A Mixtral of 4 experts, C 64 and F 6 (so no fused dims equal their transposes), each trainer tensor's
    /// values distinct: its index in [`param_shapes`] order times 100000 plus the value's position.
    fn mixtral() -> (ModelConfig, Vec<LoadedTensor>) {
        let sets: Vec<String> = ["model.d_model=64", "model.heads=2", "model.kv_heads=1", "model.ffn=6"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let cfg = Recipe::load("tiny-mixtral", &sets).map(|r| r.model).expect("the built-in recipe");
        let tensors = param_shapes(&cfg)
            .into_iter()
            .enumerate()
            .map(|(i, (name, dims))| {
                let data = (0..dims.iter().product::<usize>()).map(|j| (i * 100_000 + j) as f32).collect();
                LoadedTensor { name, dims, data }
            })
            .collect();
        (cfg, tensors)
    }

    #[test]
    fn fused_tensors_are_the_fused_file_shapes_with_each_expert_in_its_rows() {
        let (cfg, tensors) = mixtral();
        let out = ExpertLayout::Fused.file_tensors(&cfg, &tensors).expect("a Mixtral fuses");
        let names: Vec<(String, Vec<usize>)> = out.iter().map(|t| (t.name.clone(), t.dims.clone())).collect();
        assert_eq!(names, ExpertLayout::Fused.file_shapes(&cfg));
        let get = |n: &str| out.iter().find(|t| t.name == n).map(|t| t.data.to_vec()).unwrap_or_default();
        let src = |n: &str| tensors.iter().find(|t| t.name == n).map(|t| t.data.clone()).unwrap_or_default();
        let (c, f) = (64, 6);
        let gate_up = get("model.layers.1.mlp.experts.gate_up_proj");
        let down = get("model.layers.1.mlp.experts.down_proj");
        assert_eq!((gate_up.len(), down.len()), (4 * 2 * f * c, 4 * c * f));
        let e2 = |w: &str| src(&format!("model.layers.1.block_sparse_moe.experts.2.{w}.weight"));
        assert_eq!(gate_up[2 * 2 * f * c..][..f * c], e2("w1"));
        assert_eq!(gate_up[(2 * 2 * f + f) * c..][..f * c], e2("w3"));
        assert_eq!(down[2 * c * f..][..c * f], e2("w2"));
        assert_eq!(get("model.layers.1.mlp.gate.weight"), src("model.layers.1.block_sparse_moe.gate.weight"));
        // Everything else is borrowed as it is.
        assert!(matches!(out[0].data, Cow::Borrowed(_)) && out[0].name == "model.embed_tokens.weight");
        let per_expert = ExpertLayout::PerExpert.file_tensors(&cfg, &tensors).expect("as they are");
        assert!(per_expert.iter().zip(&tensors).all(|(a, b)| a.name == b.name && *a.data == b.data[..]));
    }

    #[test]
    fn fusing_needs_every_tensor_of_a_model_with_experts() {
        let (cfg, mut tensors) = mixtral();
        let mut llama = cfg.clone();
        llama.family = crate::recipe::Family::Llama;
        llama.moe = None;
        match ExpertLayout::Fused.file_tensors(&llama, &[]) {
            Err(TrainError::ExportOption { option, detail }) => {
                assert_eq!(option, "--experts fused");
                assert!(detail.contains("llama"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        tensors.retain(|t| t.name != "model.layers.0.block_sparse_moe.experts.3.w3.weight");
        let e = ExpertLayout::Fused.file_tensors(&cfg, &tensors).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("experts.3.w3.weight") && e.contains("missing"), "{e}");
        assert_eq!(ExpertLayout::parse("fused"), Some(ExpertLayout::Fused));
        assert_eq!(ExpertLayout::parse(ExpertLayout::PerExpert.name()), Some(ExpertLayout::PerExpert));
        assert_eq!(ExpertLayout::parse("hub"), None);
    }
}
