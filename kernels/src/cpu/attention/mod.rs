//! The CPU backend's attention: tiled forward and backward on SIMD micro-kernels, and the merge of partial
//! results. What they compute, their layout, numerics and determinism are the contract in [`crate::attention`];
//! this module is how the CPU meets it: tiles of [`BR`] query rows by [`BC`] key rows, each pair classified from
//! the mask's position and document ranges (skipped, unmasked or masked per element), `K` and `V` packed once per
//! call into the layout the micro-kernels read (`pack`), `bf16` widened to `f32` as tiles are loaded.
//!
//! Non-finite inputs (the contract's NaN confinement): each key tile's non-finite elements are found while `K`
//! and `V` are packed, each query tile's while its rows are loaded, and only tile pairs that hold one take the
//! slower exact path (masked entries selected away rather than multiplied by 0), so finite inputs run at full
//! speed.

mod backward;
mod forward;
mod merge;
mod pack;
pub(crate) mod simd;

pub(crate) use backward::attention_backward_on;
pub(crate) use forward::attention_forward_on;
pub(crate) use merge::merge_partial_attention;
pub use simd::SimdPath;

pub(crate) use crate::attention::{BC, BR};
