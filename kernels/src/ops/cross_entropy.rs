//! Softmax cross-entropy over the vocabulary, from logits or fused with the output projection and chunked over
//! tokens so the `[T, V]` logits never exist at once.
//!
//! Legend: `T` tokens, `C` channels (hidden size), `V` vocabulary, `K` tokens per chunk.
//!
//! ```text
//! logits[t,:] = hidden[t,:] · Wᵀ                       W[V,C] (the output / unembedding matrix)
//! lse[t]      = max_v z + ln Σ_v exp(z[v] − max_v z)    (max-subtracted, summed in f64)
//! loss        = Σ_{t valid} (lse[t] − z[t, target[t]]) / N,   N = valid tokens (or a given denominator)
//! dz[t,v]     = (softmax(z[t])[v] − [v = target[t]]) / N      (0 for ignored tokens)
//! dhidden     = dz · W                                   dW (+)= dzᵀ · hidden
//! ```
//!
//! Tokens whose target equals `ignore_index` contribute nothing and are not counted in `N`. The fused variant
//! runs `K` tokens at a time: logits `[K,V]`, their loss and `dz` in place, then `dhidden` for those tokens and
//! their share of `dW`; memory is `K·V` floats whatever `T` is. Chunks run in token order and each is
//! parallel inside (gemm tiles, softmax rows), so results do not depend on the thread count; per-token losses
//! are summed in token order in `f64`, so the loss does not depend on `K` either.

use crate::checks::finite;
use crate::error::{KernelError, Result};

/// Options of the cross-entropy ops.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrossEntropyOptions {
    /// Targets equal to this are skipped (PyTorch's default `-100`).
    pub ignore_index: i64,
    /// Tokens per chunk `K` of [`Backend::cross_entropy_fused`](crate::Backend::cross_entropy_fused) (≥ 1): peak
    /// memory is `K·V` floats.
    pub chunk_tokens: usize,
    /// Divide the loss sum (and the gradients) by this instead of the number of valid tokens, e.g. the valid
    /// tokens of the whole global batch when tokens are split across context-parallel ranks or micro-batches.
    pub denominator: Option<f64>,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        CrossEntropyOptions { ignore_index: -100, chunk_tokens: 256, denominator: None }
    }
}

/// What a cross-entropy call returns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrossEntropyOutput {
    /// `loss_sum / N`: the mean over valid tokens (0 when there are none and no denominator was given).
    pub loss: f32,
    /// Sum of the per-token losses over valid tokens.
    pub loss_sum: f64,
    /// Number of tokens whose target is not `ignore_index`.
    pub n_valid: usize,
}

/// Checks targets; returns the valid count and the gradient scale `1/N`.
pub(crate) fn check_targets(targets: &[i64], v: usize, opts: &CrossEntropyOptions) -> Result<(usize, f64)> {
    let mut n_valid = 0usize;
    for (t, &y) in targets.iter().enumerate() {
        if y == opts.ignore_index {
            continue;
        }
        if y < 0 || y as u64 >= v as u64 {
            return Err(KernelError::InvalidArgument {
                name: "targets",
                why: format!(
                    "targets[{t}] = {y} is out of range for a vocabulary of {v} (ignore_index {})",
                    opts.ignore_index
                ),
            });
        }
        n_valid += 1;
    }
    let denom = match opts.denominator {
        Some(d) => {
            finite("denominator", d, true)?;
            d
        }
        None => n_valid.max(1) as f64,
    };
    Ok((n_valid, denom))
}
