//! The suite's tolerances, all in one place, each with its reason.
//!
//! **The measure.** One number per output tensor: `max |got − want| / max |want|` over its elements (the absolute
//! error when `want` is zero everywhere, as when a gradient vanishes exactly), so an element is judged against the
//! tensor's scale, not its own (a value that cancels to near zero does not blow the error up). A non-finite
//! `want` must be met exactly (a masked row's `LSE = -inf`, a NaN that must show); a non-finite `got` where `want`
//! is finite fails whatever the tolerance.
//!
//! **The element type.** A case is held to the tolerance of its inputs' type, for every output: with `bf16` inputs
//! a backend may round intermediates to `bf16` (the CUDA backend rounds the logits' gradient of the cross-entropy
//! before its two products), so even an `f32` output of a `bf16` case carries `bf16` error.
//!
//! **Against the CPU backend.** Both sides are within the tolerance of the truth, so they are compared within
//! [`CPU_FACTOR`] times it; an exact family is compared bit for bit.
//!
//! `f16` cases (3 more mantissa bits than `bf16`, a smaller range) are held to about an eighth of the `bf16`
//! tolerance where rounding to the storage type dominates ([`Tolerance::f16`]).
//!
//! | family | `f32` | `bf16` | worst seen | why |
//! |---|---|---|---|---|
//! | [`EXACT`]: upload, download, copy, fill, transpose, `add`, `scale`, embedding lookup, dispatch, the router's choices | 0 | 0 | 0 | each element is moved, or computed by one `f32` operation and rounded once to nearest even, which every backend must do the same way (a fused multiply-add cannot apply to a single operation) |
//! | [`POINTWISE`]: SwiGLU, squared ReLU, RoPE, AdamW, clipped gradients, the combine's `dye` | 4e-6 | 8e-3 | 2.5e-7, 3.9e-3 | a few `f32` operations per element, some transcendental (`exp`, the angles' `sin`/`cos`), which libraries round within 1–2 ulp (CUDA's `expf` 2 ulp) and a GPU may contract into fused multiply-adds: ~1e-6 at most, 4e-6 with room; `bf16` stores the `f32` result rounded once (2⁻⁹ relative), and a result next to a rounding boundary may round either way after an `f32` difference: two `bf16` ulps (2⁻⁷ = 7.8e-3) |
//! | [`REDUCTION`]: linear, norms, embedding backward, the router, the combine, cross-entropy | 1e-5 | 2e-2 | 2.2e-6, 7e-3 | `f32` sums of up to a few hundred terms (a thousand in the wide cases) in an order each backend picks (tiles, split reductions, warp trees): ~√n·2⁻²⁴ relative to the largest output, with room for outputs that cancel; `bf16` products may round intermediates (a chunk's logit gradient, a layer's output read by its own backward) to `bf16` before the next sum: a few `bf16` ulps relative to the largest output |
//! | [`ATTENTION`]: `O`, `LSE` | 2e-5 | 2e-2 | 4.4e-6, 3.4e-3 | the online softmax rescales its partial sums once per key tile and sums `P·V` over up to a few hundred keys in `f32`; a GPU's tiles and `exp` differ from the CPU's; `bf16` kernels may round the probabilities to `bf16` before `P·V` |
//! | [`ATTENTION_GRAD`]: `dQ`, `dK`, `dV` | 5e-5 | 2e-2 | 2.5e-6, 8e-3 | the backward recomputes `P` from the saved `LSE` and subtracts `rowsum(dO∘O)` (a cancellation that loses bits where a row's softmax is peaked), then sums over the other sequence, in tiles whose order differs by backend |
//! | [`HOST_SCALAR`]: the loss and its sum | 1e-5 | 1e-5 | 9e-8 | summed in `f64` from per-token losses computed in `f32` from `f32` logits (exact products of `bf16` inputs), measured on at least 1 |
//! | [`F64_SUM`]: `sum_squares`, the norm of `clip_grad_norm` | 1e-10 | 1e-10 | 2.6e-13 | `f64` sums of exact squares in an order each backend picks: at most `n·2⁻⁵³` relative for `n` positive terms, 1e-10 for a million |
//!
//! "Worst seen" is the largest error against the f64 reference over this crate's runs of the suite (`f32`, then
//! `bf16`): the CPU backend on 256 cases a property, the emulated CUDA backend on 64.
//!
//! A finite-difference check of a backend's own attention gradients uses [`FINITE_DIFFERENCES`].

use crate::dtype::DType;

/// A tolerance per element type.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// For cases of `f32` inputs.
    pub f32: f64,
    /// For cases of `bf16` inputs.
    pub bf16: f64,
    /// For cases of `f16` inputs: 3 more mantissa bits than `bf16` (2⁻¹¹ relative rounding), so an eighth of its
    /// tolerance where rounding dominates.
    pub f16: f64,
}

impl Tolerance {
    /// The tolerance of a case of `dtype` inputs.
    pub fn of(&self, dtype: DType) -> f64 {
        match dtype {
            DType::F32 => self.f32,
            DType::Bf16 => self.bf16,
            DType::F16 => self.f16,
        }
    }
}

/// Moves, and one rounded `f32` operation per element: bit for bit.
pub const EXACT: Tolerance = Tolerance { f32: 0.0, bf16: 0.0, f16: 0.0 };
/// A few `f32` operations per element, some transcendental.
pub const POINTWISE: Tolerance = Tolerance { f32: 4e-6, bf16: 8e-3, f16: 1e-3 };
/// `f32` sums in an order the backend picks.
pub const REDUCTION: Tolerance = Tolerance { f32: 1e-5, bf16: 2e-2, f16: 3e-3 };
/// Attention's forward: `O` and `LSE`.
pub const ATTENTION: Tolerance = Tolerance { f32: 2e-5, bf16: 2e-2, f16: 3e-3 };
/// Attention's backward: `dQ`, `dK`, `dV`.
pub const ATTENTION_GRAD: Tolerance = Tolerance { f32: 5e-5, bf16: 2e-2, f16: 3e-3 };
/// A loss or a norm returned to the host.
pub const HOST_SCALAR: Tolerance = Tolerance { f32: 1e-5, bf16: 1e-5, f16: 1e-5 };
/// Sums in `f64`.
pub const F64_SUM: Tolerance = Tolerance { f32: 1e-10, bf16: 1e-10, f16: 1e-10 };
/// A backend's attention gradients against central differences (step `1e-2`) of its own `f32` forward: the
/// differences carry the forward's rounding divided by the step, ~1e-5/1e-2 (worst seen 1.6e-4).
pub const FINITE_DIFFERENCES: f64 = 2e-3;
/// Against the CPU backend: each side within the tolerance of the truth.
pub const CPU_FACTOR: f64 = 2.0;
