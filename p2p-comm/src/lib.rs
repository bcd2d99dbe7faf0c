//! `longctx-p2p`: the communicator of longctx's context parallelism.
//!
//! A [`Communicator`] gives each rank point-to-point messages (blocking and non-blocking), the ring shift that
//! ring attention is built on ([`Communicator::isendrecv`]), collectives and sub-communicators, over in-process
//! threads ([`ThreadWorld`]) or, with the `ucx` feature, UCX between processes started by `longctx-launch`.
//!
//! ```
//! use longctx_p2p::{ReduceOp, ThreadWorld};
//!
//! let sums = ThreadWorld::run(4, |comm| {
//!     // Pass each rank's block one step around the ring.
//!     let mine = [comm.rank() as f32; 8];
//!     let mut from_prev = [0.0f32; 8];
//!     comm.sendrecv(&mine, &mut from_prev)?;
//!     assert_eq!(from_prev[0] as usize, (comm.rank() + 3) % 4);
//!     // Sum over all ranks.
//!     let mut x = [comm.rank() as f32 + 1.0];
//!     comm.all_reduce(&mut x, ReduceOp::Sum)?;
//!     Ok::<f32, longctx_p2p::CommError>(x[0])
//! })?;
//! assert!(sums.into_iter().all(|s| s.unwrap() == 10.0));
//! # Ok::<(), longctx_p2p::CommError>(())
//! ```
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod bootstrap;
mod collectives;
mod communicator;
mod copy;
mod error;
mod reduce;
pub mod rendezvous;
mod request;
mod stats;
mod threads;
#[cfg(feature = "ucx")]
#[cfg_attr(docsrs, doc(cfg(feature = "ucx")))]
mod ucx;

pub use bootstrap::Bootstrap;
pub use communicator::Communicator;
pub use error::CommError;
pub use reduce::{Reduce, ReduceOp};
pub use request::Request;
pub use stats::CommStats;
pub use threads::{ThreadWorld, ThreadWorldBuilder};
