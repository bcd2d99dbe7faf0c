//! `longctx-p2p`: the communicator of longctx's context parallelism.
//!
//! A [`Communicator`] gives each rank point-to-point messages (blocking, and non-blocking: [`OwnedRequest`]s
//! that own their buffers and hand them back from `wait`, or [`Request`]s that borrow them within a
//! [`Communicator::scope`]), the ring shift that ring attention is built on ([`Communicator::isendrecv`],
//! [`Scope::isendrecv`]), collectives and sub-communicators, over in-process threads ([`ThreadWorld`]) or, with
//! the `ucx` feature, UCX between processes started by `longctx-launch`. No public function is `unsafe`: a leaked
//! request costs memory, never soundness. A rank that fails can tell its peers why ([`Communicator::abort`],
//! [`CommError::PeerFailed`]).
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
//!
//! # Transports and features
//!
//! - threads (always): ranks are threads of one process; each message is copied once, from the send buffer
//!   straight into the receive buffer (in device memory, by the buffer owner's [`DeviceCopy`]); waits honour [`Communicator::timeout`]; a rank whose communicator is
//!   dropped (or whose thread panics) makes its peers' pending operations fail with [`CommError::PeerGone`]
//!   (under [`ThreadWorld::run`] a panicking rank's peers get [`CommError::PeerFailed`] with the panic message,
//!   and under [`ThreadWorld::try_run`] also a rank's returned error).
//! - `ucx`: ranks are processes. Start them with `longctx-launch --nproc N -- CMD` (feature `launcher`, on by
//!   default), Slurm or `mpirun`, and call `Communicator::from_env()` in each; a small [`rendezvous`]
//!   store on `MASTER_ADDR:MASTER_PORT`, hosted by rank 0 (or by `longctx-launch` when it picks the port),
//!   only admits holders of the job token. Bindings are
//!   generated at build time from the installed UCX headers (`libucx-dev`, `pkg-config`, libclang). A
//!   background thread of each process progresses UCX while non-blocking operations are in flight, so a
//!   transfer posted with `isend`/`irecv`/`isendrecv` moves while the rank computes (`LONGCTX_UCX_PROGRESS=0`
//!   turns it off; blocking calls progress UCX themselves). A UCX built with CUDA support moves device memory
//!   itself (the buffer's memory type goes with each message); any other stages it through host memory (see
//!   [`memory`]). `LONGCTX_UCX_PEER_ERRORS=1` turns on UCX's peer
//!   error handling: a rank then survives a peer that dies in the middle of a transfer over shared memory
//!   (UCX 1.13 to 1.21 otherwise abort it; 1.22 does not), at a cost in shared-memory bandwidth.
//! - `nccl`: device memory through NCCL beside either transport ([`Communicator::attach_nccl`], one rank per
//!   GPU): point-to-point transfers and the collectives of device bytes on NCCL's stream, host messages on the
//!   host transport. NCCL and the CUDA driver are loaded at run time, so the feature builds anywhere.
//!
//! # Layout
//!
//! Modules depend downwards only: `sync`, `error`, `copy`, `device_copy`, `stats`, `reduce`, `hostlist` ← `op`
//! (what a transport is asked to do), `bootstrap`, `rendezvous` ← `threads/` (refs ← completion, channel ←
//! mailbox ← world ← mailbox_op, exchange, device ← endpoint) and `ucx/` (sys ← result ← safe ← mod) ← `pending`
//! ← `communicator` ← `request`, `owned`, `collectives`, `thread_world` ← `memory` (buffers in any memory, moved
//! by the transport where it reaches them, else staged through the host with their owner's copier); `nccl/`
//! (library ← comm) beside the transports, used by `communicator` and `memory` for device memory.
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod bootstrap;
mod collectives;
mod communicator;
mod copy;
mod device_copy;
mod error;
mod hostlist;
pub mod memory;
#[cfg(feature = "nccl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
mod nccl;
mod op;
mod owned;
mod pending;
mod reduce;
pub mod rendezvous;
mod request;
mod stats;
mod sync;
mod thread_world;
mod threads;
#[cfg(feature = "ucx")]
#[cfg_attr(docsrs, doc(cfg(feature = "ucx")))]
mod ucx;

pub use bootstrap::Bootstrap;
pub use communicator::Communicator;
pub use error::CommError;
pub use memory::{Bytes, BytesMut, BytesRequest, DeviceBytes, DeviceCopy, MemoryKind};
#[cfg(feature = "nccl")]
pub use nccl::nccl_version;
pub use owned::{OwnedBuf, OwnedRequest, SendRequest};
pub use reduce::{Reduce, ReduceOp};
pub use request::{Request, Scope};
pub use stats::CommStats;
pub use thread_world::{ThreadWorld, ThreadWorldBuilder};
#[cfg(feature = "ucx")]
#[cfg_attr(docsrs, doc(cfg(feature = "ucx")))]
pub use ucx::ucx_version;
