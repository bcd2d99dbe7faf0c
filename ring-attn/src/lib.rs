//! `longctx-ring-attn`: exact context-parallel attention.
//!
//! Context parallelism (CP) splits one sequence across ranks so each holds `S / CP` tokens of activations.
//! Attention is the one operation that needs every key; [`ContextParallel`] makes each rank's rows of the
//! output (and the gradients of its tokens) exactly those of full attention over the whole sequence, on top
//! of `longctx-kernels` (attention with global-position masks and the LSE merge) and `longctx-p2p`.
//!
//! Partitions ([`Partition`]): zigzag (default; equal causal work per rank), contiguous, striped.
//! Schedules ([`Schedule`]): ring P2P with overlap (default), all-gather KV, all-to-all (Ulysses), and a
//! hybrid of all-to-all inside groups and ring across them.
//!
//! ```
//! use longctx_p2p::ThreadWorld;
//! use longctx_ring_attn::{ContextParallel, CpConfig, CpMask, CpShape};
//! let shape = CpShape { batch: 1, q_heads: 2, kv_heads: 1, seq_len: 64, head_dim: 32 };
//! let outs = ThreadWorld::run(4, |comm| {
//!     let cp = ContextParallel::new(&comm, CpConfig::default())?;
//!     let l = shape.local_len(comm.world_size());
//!     let q = vec![0.1f32; shape.batch * shape.q_heads * l * shape.head_dim];
//!     let kv = vec![0.2f32; shape.batch * shape.kv_heads * l * shape.head_dim];
//!     let mut o = vec![0f32; q.len()];
//!     let mut lse = vec![0f32; shape.batch * shape.q_heads * l];
//!     cp.forward(&shape, &CpMask::causal(), (&q).into(), (&kv).into(), (&kv).into(), (&mut o).into(), &mut lse)?;
//!     Ok::<_, longctx_ring_attn::RingError>(o)
//! }).unwrap();
//! assert!(outs.iter().all(|o| o.as_ref().unwrap().iter().all(|x| (x - 0.2).abs() < 1e-6)));
//! ```
#![warn(missing_docs)]

mod allgather;
mod block;
mod context;
pub mod error;
mod hybrid;
pub mod partition;
mod reshard;
mod ring;

pub use context::{ContextParallel, CpConfig, CpMask, CpShape, Schedule, StepReport};
pub use error::{Result, RingError};
pub use partition::{Partition, SeqLayout};

pub(crate) use context::Local;
