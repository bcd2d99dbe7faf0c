//! Exact flash-style attention: forward returning the log-sum-exp, backward, and the merge of partial results
//! over disjoint key sets. The computing is [`Backend::attention_forward`](crate::Backend::attention_forward),
//! [`attention_backward`](crate::Backend::attention_backward) and
//! [`attention_merge`](crate::Backend::attention_merge); this module holds what those calls take (the grouped
//! views [`Qkv`], [`AttnOut`], [`AttnSaved`], [`AttnGrads`], the [`AttnMask`] and [`AttnOptions`]), the sizes and
//! parameters of one problem ([`AttnShape`], [`AttnParams`]), the exact work count [`attention_work`], and the
//! plain f64 [`reference`](mod@reference) every kernel is checked against. The layout, numerics and determinism
//! below are the contract every backend meets (the CPU's kernels are under `cpu/attention`, the GPU's under
//! `cuda/kernels`).
//!
//! # Layout
//! Legend: `B` batch, `Hq` query heads, `Hkv` key/value heads, `Sq` query rows, `Sk` key rows, `D` head dim.
//! - `Q`, `O`, `dQ`, `dO`: `[B, Hq, Sq, D]`, row-major, contiguous.
//! - `K`, `V`, `dK`, `dV`: `[B, Hkv, Sk, D]`. Query head `h` reads key/value head `h / (Hq / Hkv)`
//!   (grouped-query attention; K/V are never copied per query head).
//! - `LSE`: `[B, Hq, Sq]`, `f32`, natural log: `LSE[i] = ln Σ_j exp(scale · q_i·k_j)` over the visible keys.
//!
//! # Numerics
//! Every product, softmax statistic and gradient is accumulated in `f32` (`bf16` inputs are widened, and their
//! products are exact in `f32`). A query row that sees no key gets `O = 0` and `LSE = -inf` (never NaN), and
//! contributes nothing to any gradient.
//!
//! Masked pairs contribute nothing, even when an input is NaN or infinite: a masked entry is selected away,
//! never multiplied by 0 (`0·NaN` is NaN). So with document masking a non-finite value in one document's `Q`,
//! `K`, `V` or `dO` leaves every output, `LSE` and gradient row of the other documents bit-identical to a run
//! without it; the same holds for rows a causal or window mask separates from it. The rows that do see a
//! non-finite value get NaN (or ±inf): the `O` and `LSE` of a query row that sees a non-finite score or value,
//! and the gradients reached from it. The merge likewise gives a partial with `LSE = -inf` no weight even when
//! its `O` is not finite.
//!
//! # Determinism
//! Every output element is produced by exactly one task (a CPU task, a GPU thread block), which reduces in a
//! fixed order, so results are bit-identical from run to run whatever the number of threads.

pub(crate) mod groups;
pub mod mask;
pub mod reference;
mod work;

pub use groups::{AttnGrads, AttnOptions, AttnOut, AttnPartial, AttnSaved, Qkv};
pub use mask::{AttnMask, Positions};
pub use work::{attention_work, AttnWork};

use crate::error::{KernelError, Result};

/// Query rows per tile. 128 rather than 64: a forward task then reuses every key/value tile it streams in for
/// twice as many rows (per query head), halving the K/V traffic, which at long contexts comes from DRAM;
/// the task's `Q` and accumulators (4 query heads × 128 rows) still fit in a 1 MiB L2.
pub(crate) const BR: usize = 128;
/// Query rows per tile of the forward and backward (public for [`attention_work`]'s callers).
pub const QUERY_TILE: usize = BR;
/// Key rows per tile. 128 rather than 64: the products over keys (`P·V`, `dS·K`) run twice as long per
/// load and store of their accumulators, and the per-row softmax bookkeeping is paid half as often.
pub(crate) const BC: usize = 128;
/// Key rows per tile of the forward and backward.
pub const KEY_TILE: usize = BC;

/// The sizes of one attention call (see the module docs for the layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    /// `B`.
    pub batch: usize,
    /// `Hq`.
    pub q_heads: usize,
    /// `Hkv`; `Hq` must be a multiple of it.
    pub kv_heads: usize,
    /// `Sq`.
    pub q_len: usize,
    /// `Sk`.
    pub kv_len: usize,
    /// `D`: 32 to 256 in steps of 8.
    pub head_dim: usize,
}

impl AttnShape {
    /// Elements of `Q` (and `O`, `dQ`, `dO`).
    pub fn q_elems(&self) -> usize {
        self.batch * self.q_heads * self.q_len * self.head_dim
    }
    /// Elements of `K` (and `V`, `dK`, `dV`).
    pub fn kv_elems(&self) -> usize {
        self.batch * self.kv_heads * self.kv_len * self.head_dim
    }
    /// Elements of `LSE`.
    pub fn lse_elems(&self) -> usize {
        self.batch * self.q_heads * self.q_len
    }
    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }
    /// The dims of `Q` (and `O`, `dQ`, `dO`): `[B, Hq, Sq, D]`, for their [`View`](crate::View)s.
    pub fn q_dims(&self) -> [usize; 4] {
        [self.batch, self.q_heads, self.q_len, self.head_dim]
    }
    /// The dims of `K` (and `V`, `dK`, `dV`): `[B, Hkv, Sk, D]`.
    pub fn kv_dims(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.kv_len, self.head_dim]
    }
    /// The dims of `LSE`: `[B, Hq, Sq]`.
    pub fn lse_dims(&self) -> [usize; 3] {
        [self.batch, self.q_heads, self.q_len]
    }

    /// Checks every dimension.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("batch", self.batch),
            ("q_heads", self.q_heads),
            ("kv_heads", self.kv_heads),
            ("q_len", self.q_len),
            ("kv_len", self.kv_len),
        ] {
            if v == 0 {
                return Err(KernelError::ZeroDim(name));
            }
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(KernelError::HeadsNotDivisible { q_heads: self.q_heads, kv_heads: self.kv_heads });
        }
        if !(32..=256).contains(&self.head_dim) || !self.head_dim.is_multiple_of(8) {
            return Err(KernelError::HeadDim(self.head_dim));
        }
        Ok(())
    }
}

/// One attention problem: sizes, mask and softmax scale.
#[derive(Debug, Clone, Copy)]
pub struct AttnParams<'a> {
    /// Sizes.
    pub shape: AttnShape,
    /// Which keys each query sees.
    pub mask: AttnMask<'a>,
    /// Multiplies `q·k` before the softmax; positive and finite.
    pub scale: f32,
}

impl<'a> AttnParams<'a> {
    /// No mask, scale `1/sqrt(D)`.
    pub fn new(shape: AttnShape) -> Self {
        Self { shape, mask: AttnMask::full(), scale: 1.0 / (shape.head_dim as f32).sqrt() }
    }
    /// Replaces the mask.
    pub fn with_mask(mut self, mask: AttnMask<'a>) -> Self {
        self.mask = mask;
        self
    }
    /// Replaces the softmax scale.
    pub fn with_scale(mut self, scale: f32) -> Self {
        self.scale = scale;
        self
    }
    /// The mask and scale as the options of a [`Backend`](crate::Backend) call, whose views give the sizes.
    pub fn options(&self) -> AttnOptions<'a> {
        AttnOptions { mask: self.mask, scale: Some(self.scale) }
    }

    /// Checks the shape, mask and scale.
    pub fn validate(&self) -> Result<()> {
        self.shape.validate()?;
        self.mask.validate(self.shape.q_len, self.shape.kv_len)?;
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return Err(KernelError::InvalidArgument {
                name: "scale",
                why: format!("{} is not a positive finite number", self.scale),
            });
        }
        Ok(())
    }
}
