//! The error type of every fallible operation.

use std::time::Duration;

/// Everything that can go wrong in a communicator, a rendezvous or a launcher.
///
/// Errors that concern a peer name its rank (in the communicator the operation ran on).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// A peer rank outside `0..world_size`.
    #[error("rank {rank} is out of range for a world of {world_size} ranks")]
    InvalidRank {
        /// The rank that was asked for.
        rank: usize,
        /// The size of the communicator.
        world_size: usize,
    },
    /// The receive buffer and the matched message differ in length; the message is discarded on both sides.
    #[error("message from rank {src} to rank {dst} (tag {tag}) has {message_bytes} bytes but the receive buffer has {buffer_bytes}")]
    LengthMismatch {
        /// Sending rank.
        src: usize,
        /// Receiving rank.
        dst: usize,
        /// Tag of the message (internal tags of collectives are above `u32::MAX`).
        tag: u64,
        /// Bytes the sender sent.
        message_bytes: usize,
        /// Bytes the receiver expected.
        buffer_bytes: usize,
    },
    /// A receive timed out while a message from the same source with another tag was waiting.
    #[error("rank {dst} waited for tag {expected} from rank {src}, but rank {src} sent tag {found}")]
    TagMismatch {
        /// Sending rank.
        src: usize,
        /// Receiving rank.
        dst: usize,
        /// The tag the receive asked for.
        expected: u64,
        /// The tag of a message from `src` that is waiting unmatched.
        found: u64,
    },
    /// Ranks called a collective with different arguments (sizes, root, operation).
    #[error("collective {op}: rank {peer} called it with {theirs}, this rank with {ours}")]
    CollectiveMismatch {
        /// Name of the collective.
        op: &'static str,
        /// The peer whose arguments differ.
        peer: usize,
        /// This rank's arguments, in words.
        ours: String,
        /// The peer's arguments, in words.
        theirs: String,
    },
    /// An operation did not complete within the communicator's timeout.
    #[error("{op} with rank {peer} timed out after {after:?}")]
    Timeout {
        /// The operation (`"send"`, `"recv"`).
        op: &'static str,
        /// The peer the operation waited on.
        peer: usize,
        /// The timeout that elapsed.
        after: Duration,
    },
    /// The peer's communicator was dropped, its thread panicked or its process exited.
    #[error("rank {rank} is gone (its communicator was dropped, its thread panicked or its process exited)")]
    PeerGone {
        /// The rank that left.
        rank: usize,
    },
    /// The peer failed and said why before leaving ([`Communicator::abort`](crate::Communicator::abort), or a
    /// [`ThreadWorld`](crate::ThreadWorld) rank whose closure panicked or returned an error).
    #[error("rank {rank} failed: {reason}")]
    PeerFailed {
        /// The rank that failed.
        rank: usize,
        /// Why, in its words.
        reason: String,
    },
    /// The peer gave up a send to this rank (it timed out waiting for it) and closed its link to this rank; a
    /// receive from it that ends afterwards is refused (its data may have been read from memory the peer had
    /// already reused) or, if it failed, reported as this (UCX transport, peers on one host).
    #[error("rank {rank} closed its link to this rank after one of its sends to it failed; a receive from it that ends afterwards is refused")]
    LinkClosed {
        /// The rank that closed the link.
        rank: usize,
    },
    /// A rank of a [`ThreadWorld`](crate::ThreadWorld) panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank whose closure panicked.
        rank: usize,
        /// The panic payload, if it was a string.
        message: String,
    },
    /// An argument is invalid on this rank alone (a buffer length that is not a multiple of the world size...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Reading the environment for a bootstrap failed.
    #[error("bootstrap: {0}")]
    Bootstrap(String),
    /// A rendezvous peer did not present the job token.
    #[error("rendezvous: a peer at {addr} presented a wrong job token")]
    BadToken {
        /// Address of the peer.
        addr: String,
    },
    /// An I/O error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The crate was built without the transport that was asked for.
    #[error("longctx-p2p was built without the `{0}` feature")]
    NotCompiled(&'static str),
    /// An error reported by UCX.
    #[error("UCX: {0}")]
    Ucx(String),
    /// NCCL (or the CUDA driver under it) could not be loaded, or an NCCL call failed: the call, NCCL's result and
    /// its last error.
    #[error("NCCL: {0}")]
    Nccl(String),
    /// The copier of a buffer in device memory failed to move its bytes.
    #[error("copying a message's bytes to or from device {ordinal}: {reason}")]
    DeviceCopy {
        /// The device's ordinal.
        ordinal: u32,
        /// What the copier reported.
        reason: String,
    },
}

impl CommError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        CommError::Io { context: context.into(), source }
    }
}
