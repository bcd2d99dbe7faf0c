//! What each op's forward saves for its backward, one struct per op, each with its size in bytes from the
//! shapes alone (llm.c's `ActivationTensors` and `fill_in_activation_sizes`).
//!
//! These structs are the contract of activation recomputation and offload: a policy decides per field whether
//! to keep it, recompute it, or move it to host memory or disk, and the backward takes the struct back. Only
//! activations are listed; the weights a backward also reads are parameters, passed beside the struct.
//! Attention's struct is [`AttnSaved`](crate::AttnSaved).
//!
//! Legend: `N` rows (tokens), `C` channels, `F` hidden (FFN) dim, `IN`/`OUT` a linear layer's sizes.

use crate::dtype::DType;
use crate::ops::Routing;
use crate::view::View;

/// Linear layer `y = x·Wᵀ + b`: the backward needs `x` (for `dW`); `W` is a parameter.
#[derive(Debug, Clone, Copy)]
pub struct LinearSaved<'a> {
    /// `[N, IN]`.
    pub x: View<'a>,
}

impl LinearSaved<'_> {
    /// Bytes saved.
    pub fn bytes(&self) -> usize {
        self.x.bytes()
    }
    /// Bytes a forward over `n` rows of `d_in` saves.
    pub fn bytes_for(n: usize, d_in: usize, dtype: DType) -> usize {
        n * d_in * dtype.size()
    }
}

/// RMSNorm: the input and the reciprocal root mean square of each row.
#[derive(Debug, Clone, Copy)]
pub struct RmsNormSaved<'a> {
    /// `[N, C]`.
    pub x: View<'a>,
    /// `[N]`, `f32`.
    pub rstd: View<'a>,
}

impl RmsNormSaved<'_> {
    /// Bytes saved.
    pub fn bytes(&self) -> usize {
        self.x.bytes() + self.rstd.bytes()
    }
    /// Bytes a forward over `n` rows of `c` saves.
    pub fn bytes_for(n: usize, c: usize, dtype: DType) -> usize {
        n * c * dtype.size() + n * 4
    }
}

/// LayerNorm: the input, and the mean and reciprocal standard deviation of each row.
#[derive(Debug, Clone, Copy)]
pub struct LayerNormSaved<'a> {
    /// `[N, C]`.
    pub x: View<'a>,
    /// `[N]`, `f32`.
    pub mean: View<'a>,
    /// `[N]`, `f32`.
    pub rstd: View<'a>,
}

impl LayerNormSaved<'_> {
    /// Bytes saved.
    pub fn bytes(&self) -> usize {
        self.x.bytes() + self.mean.bytes() + self.rstd.bytes()
    }
    /// Bytes a forward over `n` rows of `c` saves.
    pub fn bytes_for(n: usize, c: usize, dtype: DType) -> usize {
        n * c * dtype.size() + 2 * n * 4
    }
}

/// SwiGLU `out = silu(gate) ∘ up`: both inputs.
#[derive(Debug, Clone, Copy)]
pub struct SwigluSaved<'a> {
    /// `[N, F]`.
    pub gate: View<'a>,
    /// `[N, F]`.
    pub up: View<'a>,
}

impl SwigluSaved<'_> {
    /// Bytes saved.
    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes()
    }
    /// Bytes a forward over `n` rows of `f` saves.
    pub fn bytes_for(n: usize, f: usize, dtype: DType) -> usize {
        2 * n * f * dtype.size()
    }
}

/// Squared ReLU `out = max(x, 0)²`: the input.
#[derive(Debug, Clone, Copy)]
pub struct SquaredReluSaved<'a> {
    /// `[N, F]`.
    pub x: View<'a>,
}

impl SquaredReluSaved<'_> {
    /// Bytes saved.
    pub fn bytes(&self) -> usize {
        self.x.bytes()
    }
    /// Bytes a forward over `n` rows of `f` saves.
    pub fn bytes_for(n: usize, f: usize, dtype: DType) -> usize {
        n * f * dtype.size()
    }
}

/// Mixture-of-experts router (softmax, top-k, renormalised weights): the probabilities, the weights and the
/// routing.
#[derive(Debug, Clone, Copy)]
pub struct MoeRouterSaved<'a> {
    /// `[L, E]`, `f32`.
    pub probs: View<'a>,
    /// `[L, K]`, `f32`.
    pub weights: View<'a>,
    /// The top-k choices and the dispatch order (host metadata).
    pub routing: &'a Routing,
}

impl MoeRouterSaved<'_> {
    /// Bytes saved.
    pub fn bytes(&self) -> usize {
        self.probs.bytes() + self.weights.bytes() + self.routing.bytes()
    }
    /// Bytes a router over `l` tokens, `e` experts and top `k` saves.
    pub fn bytes_for(l: usize, e: usize, k: usize) -> usize {
        l * e * 4 + l * k * 4 + Routing::bytes_for(l, e, k)
    }
}

/// Mixture-of-experts combine `out[t] = Σ_j w[t,j]·ye[row(t,j)]`: the experts' outputs, the weights and the
/// routing.
#[derive(Debug, Clone, Copy)]
pub struct MoeCombineSaved<'a> {
    /// `[N, C]` (`N = L·K` dispatched rows).
    pub ye: View<'a>,
    /// `[L, K]`, `f32`.
    pub weights: View<'a>,
    /// The dispatch order.
    pub routing: &'a Routing,
}

/// Token embedding: the ids (the table is a parameter).
#[derive(Debug, Clone, Copy)]
pub struct EmbeddingSaved<'a> {
    /// `[N]` token ids.
    pub ids: &'a [u32],
}

impl EmbeddingSaved<'_> {
    /// Bytes saved.
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.ids)
    }
    /// Bytes a forward over `n` tokens saves.
    pub fn bytes_for(n: usize) -> usize {
        n * 4
    }
}
