//! `longctx-recompute`: activation recomputation, decided per saved tensor.
//!
//! A layer describes its forward as named segments with the tensors each saves for the backward and the
//! compute each costs ([`LayerSpec`], [`Segment`], [`SavedTensor`]; [`llama_layer`] describes longctx's own
//! Llama layer). A [`Policy`] maps every saved tensor of every layer to [`Action::Keep`],
//! [`Action::Recompute`] (rerun its segment before the backward) or [`Action::Offload`] (move it out and back,
//! through `longctx-offload`). The built-in policies are Megatron's and PyTorch's (`none`, `full`,
//! `selective` by module, `uniform:K`, `block:N`, per-tensor `custom`), and `budget:BYTES` runs an exact
//! per-layer solver ([`solver`]) for the least added time within a peak-memory budget. [`cost`] says what a
//! choice costs in resident bytes, peak bytes and added seconds. [`planner`] predicts per-device memory and
//! step time of the seed's models ([`models`]) at real scale (`longctx plan`). The crate depends on no other
//! longctx crate:
//! a framework author describes their own layers to it; the trainer is its first user.
//!
//! ```
//! use longctx_recompute::{llama_layer, plan_cost, Costs, LlamaLayerShape, Policy};
//! // Llama 3 8B's layer at 8K tokens per rank, bf16.
//! let spec = llama_layer(&LlamaLayerShape {
//!     tokens: 8192, seq_len: 8192, d_model: 4096, heads: 32, kv_heads: 8, head_dim: 128, ffn: 14336,
//!     elem_bytes: 2, seq_shard: 1,
//! });
//! let costs = Costs { flops_per_s: 400e12, offload_bytes_per_s: 0.0 };
//! let none = plan_cost(&spec, &"none".parse::<Policy>()?.resolve(&spec, 32, &costs)?, &costs);
//! let full = plan_cost(&spec, &"full".parse::<Policy>()?.resolve(&spec, 32, &costs)?, &costs);
//! assert_eq!(none.resident_bytes, 32 * 139_400 * 8192);
//! assert_eq!(full.resident_bytes, 32 * 8192 * 8192);
//! let budget = Policy::Budget(none.peak_bytes / 2).resolve(&spec, 32, &costs)?;
//! assert!(plan_cost(&spec, &budget, &costs).peak_bytes <= none.peak_bytes / 2);
//! # Ok::<(), longctx_recompute::RecomputeError>(())
//! ```
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]

pub mod action;
pub mod cost;
pub mod error;
pub mod layer;
pub mod models;
pub mod planner;
pub mod policy;
pub mod solver;

pub use action::{Action, LayerActions};
pub use cost::{layer_cost, plan_cost, Costs, LayerCost, PlanCost};
pub use error::{RecomputeError, Result};
pub use layer::{llama_layer, LayerSpec, LlamaLayerShape, SavedTensor, Segment};
pub use models::{device, model, Device, ModelDesc};
pub use planner::{plan, Layout, MemoryBreakdown, PlanInput, PlanReport, TimeEstimate};
pub use policy::{parse_bytes, Policy, DEFAULT_SELECTIVE};
pub use solver::{solve, solve_within, Solution};
