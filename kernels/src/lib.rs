//! `longctx-kernels`: the compute of long-context training.
//!
//! It owns flash-style attention (forward and backward with the log-sum-exp, and the exact merge of partial
//! results over disjoint key sets, which ring attention is built on) and the other transformer ops with their
//! backward: linear layers, RMSNorm and LayerNorm, rotary embeddings with context-extension scalings, SwiGLU
//! and squared ReLU, embeddings, chunked cross-entropy, AdamW and gradient norms.
//!
//! Main types:
//! - [`Backend`]: the one interface every caller computes through, with its memory and ordering rules (host
//!   data moves in and out by `upload`/`download`; [`Event`]s order work across queues); [`CpuBackend`] (SIMD
//!   micro-kernels on a rayon pool) and, with the `cuda` feature, [`CudaBackend`] (our NVRTC-compiled kernels and
//!   cuBLASLt on an NVIDIA GPU, or the same kernels on a host emulator for tests).
//! - [`View`] / [`ViewMut`]: buffers that carry their dims, dtype and [`Memory`] (host, or a device's
//!   [`DeviceSlice`]); [`Buffer`] owns one.
//! - Grouped arguments: [`Qkv`], [`AttnOut`], [`AttnSaved`] (what attention's forward saves), [`AttnGrads`];
//!   the other ops' saved tensors are in [`saved`], each with its size in bytes from the shapes.
//! - [`AttnMask`]: causal, sliding-window and document masks by global token positions.
//!
//! ```
//! use longctx_kernels::{AttnMask, AttnOptions, AttnOut, Backend, CpuBackend, Positions, Qkv, View, ViewMut};
//! let cpu = CpuBackend::new();
//! // Four query rows at positions 4..8 against two key blocks (positions 0..4 and 4..8), causal.
//! let (qd, kd) = ([1, 1, 4, 32], [1, 1, 4, 32]);
//! let q: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
//! let kv: Vec<f32> = (0..128).map(|i| (i as f32 * 0.11).cos()).collect();
//! let block = |k_start: i64| -> Result<(Vec<f32>, Vec<f32>), longctx_kernels::KernelError> {
//!     let mask = AttnMask::causal().with_positions(Positions::Offset(4), Positions::Offset(k_start));
//!     let (mut o, mut lse) = (vec![0f32; 128], vec![0f32; 4]);
//!     let qkv = Qkv::new(View::new(&q, qd)?, View::new(&kv, kd)?, View::new(&kv, kd)?);
//!     let out = AttnOut { o: ViewMut::new(&mut o, qd)?, lse: ViewMut::new(&mut lse, [1, 1, 4])? };
//!     cpu.attention_forward(&AttnOptions::new(mask), out, qkv)?;
//!     Ok((o, lse))
//! };
//! let (mut o, mut lse) = block(0)?;
//! let (o2, lse2) = block(4)?;
//! // Exact attention over all eight keys.
//! let acc = AttnOut { o: ViewMut::new(&mut o, qd)?, lse: ViewMut::new(&mut lse, [1, 1, 4])? };
//! cpu.attention_merge(acc, longctx_kernels::AttnPartial { o: View::new(&o2, qd)?, lse: View::new(&lse2, [1, 1, 4])? })?;
//! assert!(lse.iter().all(|x| x.is_finite()));
//! # Ok::<(), longctx_kernels::KernelError>(())
//! ```
//!
//! [`Backend`] is the only way to compute. The layout shows the split: the interface at the root ([`backend`],
//! [`view`], [`buffer`], [`event`], [`dtype`], [`saved`], the argument types in [`attention`] and [`ops`], and the
//! checks every backend runs before any element is written), the implementations side by side in [`cpu`] and
//! [`cuda`]. [`attention::reference`] is a plain f64 attention to check kernels against, and [`testing`] has seeded
//! data, the error measure and slice-level wrappers of a backend's attention for property tests, and (feature `conformance`) the
//! conformance suite any backend can be run through.
//!
//! # GPU check
//!
//! The CUDA backend's tests and benchmarks run on a GPU machine without a Rust toolchain in one command, from the
//! repository root: `scripts/gpu-check --pack .gpu-pack` builds them here (release, stripped, compressed, with a
//! `run` script), then on the GPU machine `.gpu-pack/run` runs the GPU tests (`LONGCTX_REQUIRE_GPU=1`) and the
//! `attn_bench`, `linear_bench` and `ops_bench` examples with `--device cuda` beside their PyTorch peers, and prints
//! one summary last (the repository's README says more). The benchmarks time device work with
//! [`CudaBackend::time`] (CUDA events with timing: ops are asynchronous, so the host clock would time their launch)
//! after [`CudaBackend::compile_kernels`].
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod attention;
pub mod backend;
pub mod buffer;
pub(crate) mod checks;
pub mod cpu;
pub mod cuda;
pub mod dtype;
pub mod error;
pub mod event;
mod host;
pub mod ops;
pub mod saved;
pub mod testing;
pub mod view;

pub use attention::{
    attention_work, AttnGrads, AttnMask, AttnOptions, AttnOut, AttnParams, AttnPartial, AttnSaved, AttnShape, AttnWork,
    Positions, Qkv,
};
pub use backend::{AdamwState, Backend, GradMode, LinearGrads, MemoryStats, NormGrads, NormParams, ProjectionGrads};
pub use buffer::{Buffer, HostVec};
pub use cpu::CpuBackend;
pub use cuda::CudaBackend;
pub use dtype::{DType, Element};
pub use error::{KernelError, Result};
pub use event::{BackendEvent, Event};
pub use host::{HostSlice, HostSliceMut};
pub use ops::{
    AdamW, CrossEntropyOptions, CrossEntropyOutput, RopeConfig, RopeScaling, RopeTable, RouterOutput, Routing,
};
pub use saved::{
    EmbeddingSaved, LayerNormSaved, LinearSaved, MoeCombineSaved, MoeRouterSaved, RmsNormSaved, SquaredReluSaved,
    SwigluSaved,
};
pub use view::{DeviceSlice, DeviceSliceMut, Dims, IntoDims, Memory, RawBytes, RawBytesMut, View, ViewMut};
