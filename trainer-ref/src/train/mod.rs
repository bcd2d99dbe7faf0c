//! The training loop over `cp × dp` ranks (threads of one process, or processes over UCX).
//!
//! Rank `r` is context-parallel rank `r mod cp` of data-parallel group `r / cp`. Each step, every group runs
//! `batch / dp` micro-batches of one sequence, each rank holding the sequence's tokens at its partition's
//! positions (RoPE and the loss use those global positions); the weight gradients are summed over all ranks,
//! already scaled by the global batch's token count, so the sum is the gradient of the mean loss; then the
//! gradient is clipped and every rank applies the same AdamW step to its replica of the weights.
//!
//! The parts, each importing only those listed before it:
//! - `tiers`: the offload tier a rank spills to, and the rates the recompute solver prices its choices at;
//! - `rank`: one rank's state and its set-up (communicators, backend, weights, plan, recompute and offload);
//! - `optim`: the learning-rate schedule and the AdamW update;
//! - `step`: one optimizer step (micro-batches → gradient all-reduce → clip → AdamW) and the held-out loss;
//! - `ckpt`: checkpoint I/O (rank 0 writes, every rank resumes), through the backend's download and upload;
//! - `run`: the run (ranks launched over threads or UCX, the loop, metrics and checkpoints on schedule).

mod ckpt;
mod optim;
mod rank;
mod run;
mod step;
mod tiers;

pub use optim::lr_at;
pub use rank::layer_saved_bytes;
pub use run::{loss_and_gradients, loss_gradients_and_saved, train, train_from, Data, RunOptions, Summary};
