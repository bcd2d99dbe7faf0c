//! The one error type of this crate.

use longctx_kernels::KernelError;
use longctx_p2p::CommError;
use thiserror::Error;

/// What went wrong in a context-parallel attention call.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RingError {
    /// The attention kernel rejected its arguments.
    #[error("kernel: {0}")]
    Kernel(#[from] KernelError),
    /// A communication step failed (a peer died or stalled, sizes disagreed, …).
    #[error("communication: {0}")]
    Comm(#[from] CommError),
    /// The sequence cannot be cut evenly for the partition.
    #[error(
        "sequence length {seq_len} is not divisible by {divisor} ({partition} partition over {world} ranks); \
         pad the sequence to a multiple of {divisor} with tokens of a separate document id"
    )]
    SeqNotDivisible {
        /// Total tokens.
        seq_len: usize,
        /// What it must be a multiple of.
        divisor: usize,
        /// The partition's name.
        partition: &'static str,
        /// Context-parallel ranks.
        world: usize,
    },
    /// A head count cannot be split across the ranks of an all-to-all (Ulysses) group.
    #[error("{what} heads ({heads}) are not divisible by the all-to-all group size {group}")]
    HeadsNotDivisible {
        /// `query` or `key/value`.
        what: &'static str,
        /// The head count.
        heads: usize,
        /// The group size.
        group: usize,
    },
    /// The hybrid schedule's group size does not divide the number of ranks.
    #[error("hybrid group size {group} does not divide the {world} context-parallel ranks")]
    GroupSize {
        /// Requested all-to-all group size.
        group: usize,
        /// Context-parallel ranks.
        world: usize,
    },
    /// A local buffer does not have the length the shape implies.
    #[error("buffer `{name}` has {got} elements, expected {expected}")]
    BufferLength {
        /// Argument name.
        name: &'static str,
        /// Expected elements.
        expected: usize,
        /// Actual elements.
        got: usize,
    },
    /// Other invalid configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// Result alias of this crate.
pub type Result<T, E = RingError> = std::result::Result<T, E>;

pub(crate) fn check_len(name: &'static str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(RingError::BufferLength { name, expected, got })
    }
}
