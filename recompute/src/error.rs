//! The crate's errors: each says what is wrong and, where there is one, the smallest change that would fit.

/// Everything that can go wrong in describing, choosing or planning.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RecomputeError {
    /// A policy string that does not parse.
    #[error("recompute policy `{text}`: {why} (none, full, selective[:MODULES], uniform:K, block:N, budget:BYTES)")]
    Policy {
        /// What was given.
        text: String,
        /// Why it does not parse.
        why: String,
    },
    /// A layer description that is inconsistent.
    #[error("layer description: {0}")]
    Layer(String),
    /// A per-tensor action that cannot be carried out.
    #[error("tensor `{tensor}`: {why}")]
    Action {
        /// The tensor.
        tensor: String,
        /// Why.
        why: String,
    },
    /// No choice fits the memory budget.
    #[error("a budget of {budget} bytes cannot hold the minimum of {minimum} bytes ({why}); the smallest change that fits: {fix}")]
    Budget {
        /// The budget given.
        budget: u64,
        /// The least memory any choice needs.
        minimum: u64,
        /// What the minimum consists of.
        why: String,
        /// The smallest change that would fit.
        fix: String,
    },
    /// A model, device or layout the planner cannot use.
    #[error("{what}: {why}; {fix}")]
    Plan {
        /// The input at fault.
        what: String,
        /// Why.
        why: String,
        /// The smallest change that would fit.
        fix: String,
    },
}

/// The crate's result type.
pub type Result<T, E = RecomputeError> = std::result::Result<T, E>;
