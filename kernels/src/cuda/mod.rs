//! The CUDA backend: [`CudaBackend`], every [`Backend`](crate::Backend) op on an NVIDIA GPU.
//!
//! - Memory: buffers are device memory from a stream-ordered caching pool (the driver's memory pool, kept
//!   across frees; see `driver.rs` for what it keeps and when it gives memory back), so no op allocates from the
//!   driver on the hot path. Views of it are [`DeviceSlice`](crate::DeviceSlice)s over
//!   [`Memory::Cuda`](crate::Memory::Cuda).
//! - Work: every op is enqueued on the backend's stream and returns ([`Backend`](crate::Backend)'s "Ordering");
//!   [`CudaBackend::fork`](crate::Backend::fork) gives another stream on the same device and pool.
//! - Kernels: our own `.cu` sources under `cuda/kernels/` (one file per kernel family, the pipeline described
//!   at the top of each), embedded in the binary and compiled by NVRTC for the device's architecture the first
//!   time one of their kernels runs (cached on disk by a hash of source and options). Linear layers and the
//!   cross-entropy's products go to cuBLASLt (`f32` accumulation; TF32 only when asked).
//! - Host-typed arguments (positions, ids, targets, mask positions and documents, the RoPE table's frequencies,
//!   a routing) are uploaded per call into pool memory, a few bytes per token.
//!
//! Without the `cuda` feature the type exists but [`CudaBackend::new`] returns [`KernelError::NotCompiled`](crate::KernelError::NotCompiled), so
//! callers that probe for a GPU compile everywhere (candle's `dummy_cuda_backend`). With it, no CUDA install is
//! needed to build: the driver, NVRTC and cuBLASLt are loaded when a backend is made, and a missing one is a
//! typed error ([`KernelError::NoDevice`](crate::KernelError::NoDevice)), never a panic.
//!
//! [`CudaBackend::emulated`] runs the same kernels on the host (see `device.rs`): it is how this crate tests
//! every kernel on machines without a GPU.
//!
//! Environment (all optional):
//! - `LONGCTX_CUDA_LIB_DIRS`, `LONGCTX_CUDA_INCLUDE`: folders searched first for the CUDA libraries (NVRTC,
//!   cuBLASLt) and for `cuda_bf16.h`, before `CUDA_HOME`, `/usr/local/cuda` and NVIDIA's Python wheels; a
//!   missing one is an error naming every folder tried.
//! - `LONGCTX_CUDA_ARCH`: the architecture kernels are compiled for (default: the device's own, e.g. `sm_90`).
//! - `LONGCTX_CUDA_CACHE`: where compiled kernels are kept between runs (`off`: nowhere).
//! - `LONGCTX_CUDA_SYNC=1`: every launch and product is checked at once, so a failing kernel is reported by the op
//!   that launched it (slow; for debugging and for the GPU check's tests).
//! - `LONGCTX_CUDA_ATTN_ROWS=64|128`: the tensor-core forward's query rows per block at head dim 64.
//! - `LONGCTX_CUDA_ATTN_PATH=auto|wgmma|mma|general`: which attention kernels run ([`AttentionPath`]; a backend's
//!   own choice, [`CudaBackend::with_attention_path`], overrides it).
//! - `LONGCTX_CUDA_ATTN_DETERMINISTIC=1|split|ordered|0|atomic`: how the wgmma attention backward computes dQ
//!   ([`WgmmaBackward`]; [`CudaBackend::with_wgmma_backward`] states the trade). Unset, `1` or `split`: the two
//!   deterministic kernels, which the trainer keeps; `ordered`: one kernel, deterministic, fewer FLOPs, a workspace;
//!   `0` or `atomic`: one kernel, not deterministic in dQ.
//! - `LONGCTX_EMU_THREADS`, `LONGCTX_EMU_CACHE`: the emulator's worker threads and its compiled-kernel cache.
//! - `LONGCTX_NVRTC_ARCHS` (tests): the architectures the NVRTC compile tests cover (default `sm_80,sm_90`).
//!
//! [`KernelError::NotCompiled`]: crate::KernelError::NotCompiled
//! [`KernelError::NoDevice`]: crate::KernelError::NoDevice

#[cfg(feature = "cuda")]
mod alloc;
#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
#[allow(dead_code)] // parts of the seam used only by one of the two devices
pub(crate) mod device;
#[cfg(feature = "cuda")]
#[allow(dead_code)] // the driver's version and peak reset, for tools not written yet
mod driver;
#[cfg(feature = "cuda")]
mod emulated;
#[cfg(feature = "cuda")]
#[allow(dead_code)] // wrapped into the backend's EmulatedDevice
pub(crate) mod emulator;
#[cfg(feature = "cuda")]
#[allow(dead_code)]
mod gemm;
#[cfg(feature = "cuda")]
mod hash;
#[cfg(feature = "cuda")]
mod headers;
#[cfg(feature = "cuda")]
mod includes;
#[cfg(feature = "cuda")]
mod libraries;
#[cfg(feature = "cuda")]
#[allow(dead_code)]
pub(crate) mod nvrtc;
#[cfg(feature = "cuda")]
mod ops;
mod path;
#[cfg(feature = "cuda")]
mod places;
#[cfg(all(test, feature = "cuda"))]
mod probe;
#[cfg(feature = "cuda")]
#[allow(dead_code)]
pub(crate) mod sources;
#[cfg(feature = "cuda")]
mod stream;
#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(feature = "cuda")]
#[allow(dead_code)] // used by the TMA probe's tests until a kernel uses the TMA
pub(crate) mod tensor_map;
#[cfg(all(test, feature = "cuda"))]
mod tma_probe;
#[cfg(all(test, feature = "cuda"))]
mod wgmma_attention;
#[cfg(all(test, feature = "cuda"))]
mod wgmma_probe;

#[cfg(feature = "cuda")]
pub use backend::CudaBackend;
#[cfg(feature = "cuda")]
pub use device::MemoryStats;
pub use path::{AttentionPath, WgmmaBackward};
#[cfg(not(feature = "cuda"))]
pub use stub::{CudaBackend, MemoryStats};
