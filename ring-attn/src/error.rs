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
    HeadsNotDivisibleByGroup {
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
    /// The sequence has no tokens.
    #[error("the sequence is empty (seq_len = 0)")]
    EmptySequence,
    /// A layout over no ranks.
    #[error("a layout needs at least one rank")]
    NoRanks,
    /// A rank index past the world.
    #[error("rank {rank} is out of range for {world} ranks")]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// Ranks in the layout.
        world: usize,
    },
    /// `unshard` got another number of shards than there are ranks.
    #[error("{got} shards given for {world} ranks")]
    ShardCount {
        /// Shards given.
        got: usize,
        /// Ranks in the layout.
        world: usize,
    },
    /// The all-gather schedule was asked to gather zero KV heads per step.
    #[error("the all-gather schedule needs at least one KV head per step")]
    ZeroKvHeadsPerStep,
    /// A softmax scale that is not positive and finite.
    #[error("softmax scale {0} is not positive and finite")]
    Scale(f32),
    /// A sliding window of 0 hides every key.
    #[error("a sliding window of 0 hides every key")]
    ZeroWindow,
    /// The plan was made for packed documents but no document ids were set, or ids were set for a plan
    /// without documents.
    #[error("{0}")]
    Documents(&'static str),
    /// A view's dtype or dims differ from what the plan was made for: whichever view it is, this error names it
    /// (`q`, `k`, `v`, `o`, `lse`, `dq`, `dk`, `dv`, `dout`) with its dims and the plan's.
    #[error("`{name}`: {why}")]
    NotAsPlanned {
        /// The argument.
        name: &'static str,
        /// What differs.
        why: String,
    },
    /// The ranks planned different problems: the field and which ranks hold which value (checked when
    /// planning, on every rank, so none of them computes silently wrong results or waits for a timeout).
    #[error("the ranks disagree on {field}: {detail}")]
    RanksDisagree {
        /// The configuration field (`causal`, `partition`, `q_heads`, …).
        field: &'static str,
        /// Each value with the ranks that hold it.
        detail: String,
    },
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
