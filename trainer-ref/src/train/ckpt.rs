//! Checkpoint I/O of a rank: rank 0 writes the `f32` weights and AdamW moments, every rank resumes from them.
//! Tensors move through the backend's `download` and `upload` into host buffers, so this works on device memory
//! as on the host's.

use std::path::Path;

use longctx_kernels::{Backend, Buffer, View, ViewMut};
use longctx_p2p::ReduceOp;

use super::rank::Rank;
use crate::checkpoint;
use crate::error::{Result, TrainError};
use crate::metrics::Meter;
use crate::model::{param_shapes, Params};
use crate::recipe::Recipe;

/// A backend's `f32` buffer copied into host memory.
pub(super) fn download_f32(b: &dyn Backend, t: &Buffer) -> Result<Vec<f32>> {
    let mut host = vec![0.0f32; t.len()];
    b.download(ViewMut::new(&mut host, t.dims())?, t.view())?;
    Ok(host)
}

/// A tensor read from a checkpoint, as a host view.
fn host(t: &checkpoint::LoadedTensor) -> Result<View<'_>> {
    Ok(View::new(&t.data, t.dims.as_slice())?)
}

/// Every tensor of `p` downloaded, in order.
fn download_all(b: &dyn Backend, p: &Params) -> Result<Vec<Vec<f32>>> {
    p.tensors.iter().map(|t| download_f32(b, t)).collect()
}

/// The tensors of `p` for a checkpoint, each name prefixed, their values in `host` (`p`'s, downloaded).
fn tensors<'h>(p: &Params, host: &'h [Vec<f32>], prefix: &str) -> Vec<checkpoint::Tensor<'h>> {
    p.names
        .iter()
        .zip(&p.tensors)
        .zip(host)
        .map(|((name, t), data)| checkpoint::Tensor::new(format!("{prefix}{name}"), t.dims(), data))
        .collect()
}

impl Rank<'_> {
    /// Rank 0 writes the checkpoint; the others wait for it, so no rank runs ahead of a failed save.
    pub(super) fn save(&self, out: &Path, meter: Option<&mut Meter>) -> Result<()> {
        let mut failed = [0i32];
        let mut failure = None;
        if self.is_root() {
            if let Err(e) = self.write_checkpoint(out) {
                failed[0] = 1;
                failure = Some(e);
            } else if let Some(m) = meter {
                m.note(&format!("checkpoint step {} written to {}", self.step, out.join("checkpoints").display()));
            }
        }
        self.world.all_reduce(&mut failed, ReduceOp::Max)?;
        match failure {
            Some(e) => Err(e),
            None if failed[0] != 0 => Err(TrainError::PeerFailed { rank: 0, what: "write the checkpoint".into() }),
            None => Ok(()),
        }
    }

    fn write_checkpoint(&self, out: &Path) -> Result<()> {
        let b = self.model.backend();
        let master = self.master();
        let (w, m, v) = (download_all(&**b, master)?, download_all(&**b, &self.m)?, download_all(&**b, &self.v)?);
        let model = tensors(master, &w, "");
        let mut optim = tensors(&self.m, &m, "exp_avg.");
        optim.extend(tensors(&self.v, &v, "exp_avg_sq."));
        let state = serde_json::json!({
            "step": self.step,
            "sequences_consumed": self.step * self.recipe.train.batch as u64,
            "seed": self.recipe.train.seed,
            "recipe": self.recipe.to_toml(),
        });
        let keep = self.recipe.train.keep_checkpoints;
        checkpoint::save_with_tokenizer(out, self.step, &model, &optim, &state, keep, self.tokenizer)?;
        Ok(())
    }

    /// Loads the newest checkpoint in `out`: the recipe's model must be the checkpoint's, tensor for tensor.
    pub(super) fn resume(&mut self, out: &Path) -> Result<()> {
        let Some(dir) = checkpoint::latest(out)? else {
            return Err(TrainError::NoCheckpoint { dir: out.join("checkpoints") });
        };
        let ck = checkpoint::load(&dir)?;
        let state_file = dir.join("state.json");
        if let Some(text) = ck.state.get("recipe").and_then(|r| r.as_str()) {
            let saved = Recipe::parse("checkpoint", text, &[]).map_err(|e| TrainError::Checkpoint {
                path: state_file.clone(),
                detail: format!("field `recipe`: {e}"),
            })?;
            if saved.model != self.recipe.model {
                return Err(TrainError::Checkpoint {
                    path: state_file,
                    detail: format!(
                        "field `recipe.model` is {:?}, the run's recipe has {:?}",
                        saved.model, self.recipe.model
                    ),
                });
            }
        }
        let shapes = param_shapes(&self.recipe.model);
        checkpoint::expect_tensors(&dir.join("model.safetensors"), &ck.model, &shapes)?;
        let mut want_optim: Vec<(String, Vec<usize>)> =
            shapes.iter().map(|(n, d)| (format!("exp_avg.{n}"), d.clone())).collect();
        want_optim.extend(shapes.iter().map(|(n, d)| (format!("exp_avg_sq.{n}"), d.clone())));
        checkpoint::expect_tensors(&dir.join("optim.safetensors"), &ck.optim, &want_optim)?;
        let b = self.model.backend().clone();
        let n = shapes.len();
        for i in 0..n {
            let w = host(&ck.model[i])?;
            match self.master.as_mut() {
                // A `bf16` model: the master weights take the values, the model's are rounded from them.
                Some(master) => {
                    b.upload(master.tensors[i].view_mut(), w)?;
                    b.copy(self.model.weights.tensors[i].view_mut(), master.tensors[i].view())?;
                }
                None => b.upload(self.model.weights.tensors[i].view_mut(), w)?,
            }
            b.upload(self.m.tensors[i].view_mut(), host(&ck.optim[i])?)?;
            b.upload(self.v.tensors[i].view_mut(), host(&ck.optim[n + i])?)?;
        }
        self.step = ck.step;
        Ok(())
    }
}
