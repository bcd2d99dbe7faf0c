//! `longctx-kernels`: the compute kernels of long-context training.
//!
//! Flash-style attention (forward and backward returning the log-sum-exp, and the merge of partial results)
//! and the other transformer ops with their backward, on a multi-threaded SIMD CPU backend. Every kernel
//! computes in `f32`; buffers are `f32` or `bf16`.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod dtype;
pub mod error;
pub mod ops;
pub mod view;

pub use dtype::{DType, Element};
pub use error::{KernelError, Result};
pub use ops::{
    adamw_step, adamw_step_with_copy, clip_grad_norm, cross_entropy_fused, cross_entropy_logits,
    embedding_backward, embedding_forward, layernorm_backward, layernorm_forward, linear_backward,
    linear_forward, matmul, matmul_backward, rmsnorm_backward, rmsnorm_forward,
    squared_relu_backward, squared_relu_forward, swiglu_backward, swiglu_forward, AdamW,
    CrossEntropyOptions, CrossEntropyOutput, RopeConfig, RopeScaling, RopeTable,
};
pub use view::{HostSlice, HostSliceMut};
