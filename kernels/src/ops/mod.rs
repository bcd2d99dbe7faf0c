//! Transformer ops other than attention, each with its backward: what they compute, and the types their
//! [`Backend`](crate::Backend) methods take ([`AdamW`], [`CrossEntropyOptions`], [`CrossEntropyOutput`], the rotary
//! tables [`RopeConfig`], [`RopeScaling`], [`RopeTable`], the expert dispatch [`Routing`], [`RouterOutput`]). The
//! computing is the backend's ([`CpuBackend`](crate::CpuBackend)'s kernels are under `cpu/ops`, the CUDA backend's under
//! `cuda/kernels`); the checks of every op's arguments are shared by both.
//!
//! Legend: `B` batch, `S` sequence, `H` heads, `D` head dim, `T` tokens (`B·S` flattened), `C` channels (model
//! dim), `F` hidden (FFN) dim, `V` vocabulary, `P` parameters. Every buffer is row-major, last dimension innermost.
//!
//! ```text
//! matmul                c[M,N] = a[M,K]·b[K,N]
//! matmul_backward       da = dc·bᵀ                  db (+)= aᵀ·dc
//! linear_forward        y[T,OUT] = x[T,IN]·wᵀ + bias (w is [OUT,IN])
//! linear_backward       dx = dy·w                   dw (+)= dyᵀ·x          dbias (+)= Σ_t dy[t,:]
//! rmsnorm_forward       y[N,C] = x·rstd·weight      rstd[N] = 1/√(mean(x²) + eps)
//! layernorm_forward     y[N,C] = (x − mean)·rstd·weight + bias
//! rope_forward          y[B,H,S,D] = x rotated by the angles of positions[S]; rope_backward rotates back
//! swiglu_forward        out = silu(gate) ∘ up
//! squared_relu_forward  out = max(x, 0)²
//! embedding_forward     out[T,C] = table[ids[t], :]  embedding_backward: dtable[ids[t], :] (+)= dout[t, :]
//! moe_router_forward    p[T,E] = softmax(logits), top-k per token, weights renormalised (Mixtral)
//! moe_gather/combine    xe[n] = x[row[n]] (tokens grouped by expert); out[t] = Σ_j w[t,j]·ye[row(t,j)]
//! cross_entropy_fused   the loss of hidden[T,C]·weightᵀ (weight [V,C]) in chunks of tokens, never all [T,V]
//! adamw_step            m, v and the f32 master weights (and a rounded copy) take one AdamW step
//! clip_grad_norm        ‖g‖ = √(Σ g²) in f64; if ‖g‖ > max: g *= max / (‖g‖ + 1e-6)
//! ```
//!
//! Conventions (llm.c `train_gpt2.c`), the same for every backend:
//! - Outputs first, then the upstream gradient, then what the forward saved ([`crate::saved`]), then parameters
//!   and options; gradients are named `dx`, `dw`, `dout`, ….
//! - Storage is `f32` or `bf16` ([`crate::DType`]); every op computes and accumulates in `f32` (reductions that
//!   decide a loss or a norm in `f64`). Weight gradients may have their own element type, so a `bf16` model can
//!   accumulate `f32` gradients across micro-batches; [`GradMode`](crate::GradMode) says whether a backward
//!   overwrites the weight gradients or adds to them. Activation gradients are always overwritten.
//! - Every shape and length is checked before any element is written: an `Err` leaves outputs untouched.
//! - Results are bit-identical for any number of rayon threads: work is split into pieces whose boundaries
//!   depend only on the shapes, and partial sums are combined in a fixed order on one thread.
//!
//! ```
//! use longctx_kernels::{Backend, CpuBackend, GradMode, LinearGrads, LinearSaved, View, ViewMut};
//! let cpu = CpuBackend::new();
//! // y[T,OUT] = x[T,IN]·wᵀ with T = 2, IN = 3, OUT = 2, then the backward with dy = 1.
//! let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
//! let w = [1.0f32, 0.0, 0.0, 0.0, 1.0, 1.0];
//! let (xv, wv) = (View::new(&x, [2, 3])?, View::new(&w, [2, 3])?);
//! let mut y = [0.0f32; 4];
//! cpu.linear_forward(ViewMut::new(&mut y, [2, 2])?, xv, wv, None)?;
//! assert_eq!(y, [1.0, 5.0, 4.0, 11.0]);
//! let (mut dx, mut dw) = ([0.0f32; 6], [0.0f32; 6]);
//! let (dxv, dwv) = (ViewMut::new(&mut dx, [2, 3])?, ViewMut::new(&mut dw, [2, 3])?);
//! let grads = LinearGrads { dx: Some(dxv), dw: dwv, dbias: None };
//! let dy = [1.0f32; 4];
//! cpu.linear_backward(grads, View::new(&dy, [2, 2])?, LinearSaved { x: xv }, wv, GradMode::Overwrite)?;
//! assert_eq!(dx, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
//! assert_eq!(dw, [5.0, 7.0, 9.0, 5.0, 7.0, 9.0]);
//! # Ok::<(), longctx_kernels::KernelError>(())
//! ```

mod adamw;
mod cross_entropy;
mod moe;
mod rope;

pub use adamw::AdamW;
pub(crate) use cross_entropy::check_targets;
pub use cross_entropy::{CrossEntropyOptions, CrossEntropyOutput};
pub use moe::{RouterOutput, Routing};
pub use rope::{RopeConfig, RopeScaling, RopeTable};
