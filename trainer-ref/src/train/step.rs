//! One optimizer step, llm.c's `train_gpt2.c` loop body in a function: every micro-batch's forward and
//! backward into the gradients, the gradients summed over all ranks, clipped to `train.clip`, then AdamW.
//! Also the held-out loss, which runs the same forwards without a backward.

use longctx_kernels::{DType, GradMode, KernelError};
use longctx_p2p::ReduceOp;
use longctx_ring_attn::transfer::{bytes_mut, BackendCopy};

use super::rank::Rank;
use crate::data::{Sequence, TokenStream};
use crate::error::{Result, TrainError};
use crate::model::{LossSpec, ModelSaved, MoeStats};

/// What one step did, as every rank sees it.
pub(super) struct StepOut {
    /// The mean training loss over the global batch (with a mixture's load-balancing loss).
    pub(super) loss: f64,
    /// Bytes of activations this rank's forward kept over one micro-batch.
    pub(super) saved_bytes: usize,
    /// The summed gradient's norm before clipping.
    pub(super) grad_norm: f64,
    /// Some rank asked the run to stop after this step.
    pub(super) stop: bool,
}

/// What [`Rank::gradients`] leaves beside the summed gradient.
pub(super) struct Gradients {
    /// This rank's cross-entropy sum, scaled by the global token count (the sum over ranks is the mean loss).
    pub(super) loss_sum: f64,
    /// Bytes this rank's forward kept over one micro-batch (the largest).
    pub(super) saved_bytes: usize,
    /// The load-balancing loss, already weighted by its coefficient, the same on every rank (0 without experts).
    pub(super) aux_loss: f64,
}

/// A micro-batch between its forward and its backward.
struct Forwarded {
    saved: ModelSaved,
    targets: Vec<i64>,
    docs: Vec<u32>,
}

impl Rank<'_> {
    /// One optimizer step at `lr` on the global batch that `sequence(micro, dp_group)` gives. `stop`: this rank
    /// asks the run to stop after the step (a signal, `--stop-at`); the answer says whether any rank did.
    pub(super) fn run_step(
        &mut self,
        lr: f32,
        stop: bool,
        sequence: impl Fn(usize, usize) -> Sequence,
    ) -> Result<StepOut> {
        let t = &self.recipe.train;
        let denominator = (t.batch * t.seq_len) as f64;
        // A device running out of memory is reported with the step, what it was doing, and the planner's figure.
        let (step, predicted) = (self.step + 1, self.predicted.peak_bytes as f64 / (1 << 20) as f64);
        let placed = |e: TrainError| e.in_step(step, predicted);
        let g = self.gradients(sequence).map_err(placed)?;
        let mut reduced = [g.loss_sum, if stop { 1.0 } else { 0.0 }];
        self.world.all_reduce(&mut reduced, ReduceOp::Sum)?;
        let grad_norm = self.clip().map_err(|e| placed(e.in_phase(|| "gradient clipping".into())))?;
        self.adamw(lr).map_err(|e| placed(e.in_phase(|| "the optimizer".into())))?;
        self.step += 1;
        Ok(StepOut {
            loss: reduced[0] / denominator + g.aux_loss,
            saved_bytes: g.saved_bytes,
            grad_norm,
            stop: reduced[1] > 0.0,
        })
    }

    /// This rank's micro-batches (`sequence(micro, dp_group)` gives each), their gradients summed over every
    /// rank into `self.grads` (before clipping).
    ///
    /// A dense model runs each micro-batch's backward right after its forward. A mixture of experts' load-balancing
    /// loss is over the global batch (Hugging Face's, over every layer and token), and its gradient needs the
    /// global routing statistics, so there every micro-batch's forward runs first, the statistics are summed over
    /// all ranks, then the backwards run: a rank holds its micro-batches' activations together (one micro-batch
    /// with `train.batch = parallel.dp`).
    pub(super) fn gradients(&mut self, sequence: impl Fn(usize, usize) -> Sequence) -> Result<Gradients> {
        let accum = self.recipe.train.batch / self.recipe.parallel.dp;
        let experts = self.recipe.model.experts();
        let ahead = if experts.is_some() { accum } else { 1 };
        let mut out = Gradients { loss_sum: 0.0, saved_bytes: 0, aux_loss: 0.0 };
        for first in (0..accum).step_by(ahead) {
            let mut forwards = Vec::with_capacity(ahead);
            for micro in first..first + ahead {
                let f = self.micro_forward(&sequence(micro, self.dp_index))?;
                out.saved_bytes = out.saved_bytes.max(f.saved.bytes());
                forwards.push(f);
            }
            let aux_grad = match experts {
                None => None,
                Some(moe) => {
                    let global = self.global_routing(&forwards)?;
                    out.aux_loss = moe.aux_loss_coef * global.aux_loss();
                    Some(global.prob_grad(moe.aux_loss_coef))
                }
            };
            // With several forwards in flight, the plan holds the last one's documents: each backward sets its own.
            let reset_documents = forwards.len() > 1;
            for (i, f) in forwards.into_iter().enumerate() {
                let mode = if first + i == 0 { GradMode::Overwrite } else { GradMode::Accumulate };
                out.loss_sum += self.micro_backward(f, mode, reset_documents, aux_grad.as_deref())?;
            }
        }
        self.all_reduce_grads()?;
        Ok(out)
    }

    /// One micro-batch's forward on this rank's share of `seq`.
    fn micro_forward(&mut self, seq: &Sequence) -> Result<Forwarded> {
        let (ids, targets, docs) = self.local(seq);
        if self.recipe.data.document_masking {
            self.plan.set_documents(&docs)?;
        }
        let saved = self.model.forward(&ids, &mut self.plan)?;
        Ok(Forwarded { saved, targets, docs })
    }

    /// The loss and backward of a micro-batch already forwarded, into `self.grads` per `mode`; returns its loss
    /// sum (scaled by the global batch's token count).
    fn micro_backward(
        &mut self,
        f: Forwarded,
        mode: GradMode,
        reset_documents: bool,
        moe_aux: Option<&[f32]>,
    ) -> Result<f64> {
        let t = &self.recipe.train;
        if reset_documents && self.recipe.data.document_masking {
            self.plan.set_documents(&f.docs)?;
        }
        let denominator = (t.batch * t.seq_len) as f64;
        let spec = LossSpec { targets: &f.targets, denominator, chunk: t.loss_chunk, moe_aux };
        let loss = self.model.loss_and_backward(f.saved, &spec, &mut self.grads, mode, &mut self.plan)?;
        Ok(loss.sum)
    }

    /// The routing statistics of `forwards` summed over every rank (the global batch's).
    fn global_routing(&self, forwards: &[Forwarded]) -> Result<MoeStats> {
        let mut stats = None::<MoeStats>;
        for s in forwards.iter().filter_map(|f| f.saved.moe.as_ref()) {
            stats.get_or_insert_with(|| MoeStats::zeros(s.experts())).merge(s);
        }
        let stats = stats
            .ok_or_else(|| TrainError::Internal("a mixture of experts' forward without router statistics".into()))?;
        let mut flat = stats.to_flat();
        self.world.all_reduce(&mut flat, ReduceOp::Sum)?;
        Ok(MoeStats::from_flat(&flat))
    }

    /// Sums every gradient over all ranks, in place, from the backend's buffers: host memory is reduced where
    /// it is; device memory is handed to the communicator with the backend's copier (staged through host memory
    /// until a transport reaches the device itself, the GPU-training work).
    fn all_reduce_grads(&mut self) -> Result<()> {
        let backend = self.model.backend().clone();
        let copy = BackendCopy(&*backend);
        for g in self.grads.tensors.iter_mut() {
            if g.dtype() != DType::F32 {
                return Err(TrainError::Internal(format!("a {} gradient: gradients are f32", g.dtype())));
            }
            self.world.all_reduce_bytes::<f32>(bytes_mut(g.view_mut(), &copy), ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// Clips the summed gradient to `train.clip` (PyTorch's `clip_grad_norm_`, [`Backend::clip_grad_norm`]; 0
    /// only measures it); returns the norm before. Every rank holds the whole summed gradient, so no reduction
    /// of the squares is needed between the norm and the scaling.
    ///
    /// [`Backend::clip_grad_norm`]: longctx_kernels::Backend::clip_grad_norm
    fn clip(&mut self) -> Result<f64> {
        let b = self.model.backend().clone();
        let max = self.recipe.train.clip;
        let measured = if max > 0.0 {
            let mut grads: Vec<_> = self.grads.tensors.iter_mut().map(|g| g.view_mut()).collect();
            match b.clip_grad_norm(&mut grads, max) {
                // A norm that is not finite: the gradients are left untouched, and measured again to report it.
                Err(KernelError::InvalidArgument { name: "grads", .. }) => None,
                r => Some(r?),
            }
        } else {
            Some(b.sum_squares(&self.grads.views())?.sqrt())
        };
        let norm = match measured {
            Some(n) => n,
            None => b.sum_squares(&self.grads.views())?.sqrt(),
        };
        if !norm.is_finite() {
            return Err(TrainError::Diverged { step: self.step + 1, norm });
        }
        Ok(norm)
    }

    /// The mean loss over the first `eval_seqs` held-out sequences, shared out over the data-parallel groups.
    pub(super) fn heldout_loss(&mut self, heldout: &TokenStream) -> Result<f64> {
        let t = &self.recipe.train;
        let dp = self.recipe.parallel.dp;
        let mut sums = [0.0f64, 0.0];
        for i in (self.dp_index..t.eval_seqs).step_by(dp) {
            let (ids, targets, docs) = self.local(&heldout.sequence(i as u64, t.seq_len));
            if self.recipe.data.document_masking {
                self.plan.set_documents(&docs)?;
            }
            let l = self.model.loss(&ids, &targets, t.loss_chunk, &mut self.plan)?;
            sums[0] += l.sum;
            sums[1] += l.tokens as f64;
        }
        self.world.all_reduce(&mut sums, ReduceOp::Sum)?;
        Ok(sums[0] / sums[1].max(1.0))
    }
}
