//! `longctx-kernels`: the compute kernels of long-context training.
//!
//! Flash-style attention (forward and backward returning the log-sum-exp, and the merge of partial results)
//! and the other transformer ops with their backward, on a multi-threaded SIMD CPU backend. Every kernel
//! computes in `f32`; buffers are `f32` or `bf16`.
//!
//! ```
//! use longctx_kernels::{attention_forward, merge_partial_attention, AttnMask, AttnParams, AttnShape, Positions};
//! // Four query rows at positions 4..8 against two key blocks (positions 0..4 and 4..8), causal.
//! let shape = AttnShape { batch: 1, q_heads: 1, kv_heads: 1, q_len: 4, kv_len: 4, head_dim: 32 };
//! let q: Vec<f32> = (0..shape.q_elems()).map(|i| (i as f32 * 0.37).sin()).collect();
//! let kv: Vec<f32> = (0..shape.kv_elems()).map(|i| (i as f32 * 0.11).cos()).collect();
//! let block = |k_start: i64| {
//!     let mask = AttnMask::causal().with_positions(Positions::Offset(4), Positions::Offset(k_start));
//!     let (mut o, mut lse) = (vec![0f32; shape.q_elems()], vec![0f32; shape.lse_elems()]);
//!     attention_forward(&AttnParams::new(shape).with_mask(mask), (&q).into(), (&kv).into(), (&kv).into(),
//!                       (&mut o).into(), &mut lse).unwrap();
//!     (o, lse)
//! };
//! let (mut o, mut lse) = block(0);
//! let (o2, lse2) = block(4);
//! merge_partial_attention(&mut o, &mut lse, &o2, &lse2)?; // exact attention over all eight keys
//! assert!(lse.iter().all(|x| x.is_finite()));
//! # Ok::<(), longctx_kernels::KernelError>(())
//! ```
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod attention;
pub mod backend;
pub mod dtype;
pub mod error;
pub mod ops;
pub mod testing;
pub mod view;

pub use attention::{
    attention_backward, attention_forward, attention_work, merge_partial_attention, AttnMask, AttnParams, AttnShape,
    AttnWork, Positions,
};
pub use backend::{AttentionBackend, CpuBackend};
pub use dtype::{DType, Element};
pub use error::{KernelError, Result};
pub use ops::{
    adamw_step, adamw_step_with_copy, clip_grad_norm, cross_entropy_fused, cross_entropy_logits, embedding_backward,
    embedding_forward, layernorm_backward, layernorm_forward, linear_backward, linear_forward, matmul, matmul_backward,
    rmsnorm_backward, rmsnorm_forward, squared_relu_backward, squared_relu_forward, swiglu_backward, swiglu_forward,
    AdamW, CrossEntropyOptions, CrossEntropyOutput, RopeConfig, RopeScaling, RopeTable,
};
pub use view::{HostSlice, HostSliceMut};
