//! `longctx-kernels`: the compute kernels of long-context training.
//!
//! Flash-style attention (forward and backward returning the log-sum-exp, and the merge of partial results)
//! and the other transformer ops with their backward, on a multi-threaded SIMD CPU backend. Every kernel
//! computes in `f32`; buffers are `f32` or `bf16`.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod attention;
pub mod dtype;
pub mod error;
pub mod view;

pub use attention::{
    attention_backward, attention_forward, merge_partial_attention, AttnMask, AttnParams, AttnShape, Positions,
};
pub use dtype::{DType, Element};
pub use error::{KernelError, Result};
pub use view::{HostSlice, HostSliceMut};
