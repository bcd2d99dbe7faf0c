//! `longctx-trainer`: the reference trainer, where every longctx crate meets (binary `longctx`).
//!
//! A Llama 3, Mixtral or Nemotron-4 style decoder ([`model`]) computed through the kernels' [`Backend`](longctx_kernels::Backend),
//! its attention through `longctx-ring-attn`'s planned [`ContextParallel`](longctx_ring_attn::ContextParallel),
//! trained over `cp × dp` ranks of `longctx-p2p` ([`train`]) on the packed documents of a real corpus
//! ([`data`]), configured by TOML recipes ([`recipe`]) and computing on the device one of their fields names
//! ([`device`]: `cpu` or `cuda:N`), reporting to a progress bar and a metrics file
//! ([`metrics`]), and saving atomic, verified checkpoints ([`checkpoint`]); Hugging Face checkpoints are read
//! (`--init-from`) and written (`longctx export --hf`) by [`hf`].
//!
//! ```no_run
//! use longctx_trainer::{recipe::Recipe, train::{train, RunOptions}};
//! let recipe = Recipe::load("tiny-llama", &["train.steps=20".into(), "parallel.cp=2".into()])?;
//! let summary = train(&recipe, &RunOptions { out: "runs/tiny".into(), ..Default::default() })?;
//! println!("loss {:?} → {:?}", summary.losses.first(), summary.losses.last());
//! # Ok::<(), longctx_trainer::TrainError>(())
//! ```
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]

pub mod alloc;
pub mod bench;
pub mod checkpoint;
pub mod data;
pub mod device;
pub mod error;
pub mod eval;
pub mod gguf;
pub mod hf;
pub mod metrics;
pub mod model;
pub mod npy;
pub mod plan_cmd;
pub mod plot;
pub mod recipe;
pub mod rope_scaling;
pub mod train;

pub use error::{Result, TrainError};
