//! `longctx-ring-attn`: exact context-parallel attention.
//!
//! Context parallelism (CP) splits one sequence across ranks so each holds `S / CP` tokens of activations.
//! Attention is the one operation that needs every key; this crate makes each rank's rows of the output (and
//! the gradients of its tokens) exactly those of full attention over the whole sequence.
//!
//! Main types:
//! - [`ContextParallel`]: owns a communicator handle (`Arc<Communicator>`), a [`Backend`] and a [`CpConfig`]
//!   (partition, schedule, scale), so a model can hold it.
//! - [`CpPlan`]: made once per problem by [`ContextParallel::plan`] (collective: the ranks check that they agree);
//!   it owns every rank's positions and its accumulators, answers [`CpPlan::workspace_bytes`] and
//!   [`CpPlan::saved_bytes`], and runs [`CpPlan::forward`] / [`CpPlan::backward`] on grouped views.
//! - Partitions ([`Partition`]): zigzag (default; equal causal work per rank), contiguous, striped.
//!   Schedules ([`Schedule`]): ring P2P with overlap (default), all-gather KV, all-to-all (Ulysses), and a hybrid
//!   of all-to-all inside groups and ring across them.
//!
//! Everything below the plan runs on the backend's memory: the plan's accumulators and the ring's blocks are
//! backend buffers, fills, sums, merges and re-shards are backend calls, and the communicator moves the bytes
//! where the backend keeps them (device memory through the backend's copies; see `longctx_p2p::memory`). The
//! same code runs on `CpuBackend` and on a device backend, through the same tests.
//!
//! What a caller needs from the kernels and the communicator is re-exported here, so this crate alone is
//! enough to call it. Conventions: views are `[B, H, L, D]` (query head `h` reads KV head `h / (Hq / Hkv)`),
//! `D` is 32 to 256 in steps of 8, `LSE` is `[B, Hq, L]` `f32` natural log (`-inf` for a row that sees no key),
//! masks are by global positions ([`CpMask`]: a window of `w` shows a query itself and the `w − 1` keys before
//! it when causal, and the `w − 1` keys on each side of it when not; documents by id, per batch with
//! [`CpPlan::set_documents`]).
//!
//! ```
//! use std::sync::Arc;
//! use longctx_ring_attn::{AttnOut, ContextParallel, CpConfig, CpMask, CpShape, CpuBackend, DType, Qkv, ThreadWorld, View, ViewMut};
//! let shape = CpShape { batch: 1, q_heads: 2, kv_heads: 1, seq_len: 64, head_dim: 32, dtype: DType::F32 };
//! let outs = ThreadWorld::run(4, |comm| {
//!     let cp = ContextParallel::new(comm, Arc::new(CpuBackend::new()), CpConfig::default())?;
//!     let mut plan = cp.plan(&shape, &CpMask::causal())?;
//!     let (qd, kd) = (plan.q_dims(), plan.kv_dims());
//!     let q = vec![0.1f32; qd.iter().product()];
//!     let kv = vec![0.2f32; kd.iter().product()];
//!     let (mut o, mut lse) = (vec![0f32; q.len()], vec![0f32; plan.lse_dims().iter().product()]);
//!     let qkv = Qkv::new(View::new(&q, qd)?, View::new(&kv, kd)?, View::new(&kv, kd)?);
//!     plan.forward(AttnOut { o: ViewMut::new(&mut o, qd)?, lse: ViewMut::new(&mut lse, plan.lse_dims())? }, qkv)?;
//!     Ok::<_, longctx_ring_attn::RingError>(o)
//! }).unwrap();
//! assert!(outs.iter().all(|o| o.as_ref().unwrap().iter().all(|x| (x - 0.2).abs() < 1e-6)));
//! ```
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]

mod agree;
mod allgather;
mod block;
mod config;
mod context;
pub mod error;
mod hybrid;
mod local;
pub mod partition;
mod plan;
mod report;
mod reshard;
mod ring;
pub mod transfer;

pub use config::{CpConfig, CpMask, CpShape, Schedule};
pub use context::ContextParallel;
pub use error::{Result, RingError};
pub use partition::{Partition, SeqLayout};
pub use plan::{CpPlan, WorkspaceBytes};
pub use report::StepReport;

pub use longctx_kernels::{AttnGrads, AttnOut, AttnSaved, Backend, CpuBackend, DType, KernelError, Qkv, View, ViewMut};
pub use longctx_p2p::{CommError, Communicator, ThreadWorld};

/// The README's example, compiled and run as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeExample;
