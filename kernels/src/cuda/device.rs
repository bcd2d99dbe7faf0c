//! The seam between the CUDA backend's ops and what runs them: [`Device`].
//!
//! The ops (shape checks done, sizes known) decide which kernel to launch with which arguments, or which
//! matrix product to ask cuBLASLt for; a `Device` allocates, copies, launches and multiplies. Two implement it:
//! - `driver::DriverDevice`: a real GPU through cudarc (the driver API, NVRTC, cuBLASLt), one stream;
//! - `emulator::EmulatedDevice`: the same kernel sources compiled for the host by the system's C++ compiler
//!   and run with one fiber per CUDA thread (blocks, warps, barriers, shuffles and the `mma.sync`/`ldmatrix`
//!   fragment layouts emulated), device memory being host memory with guard zones. It exists so that every
//!   kernel and every line of the backend above this seam is tested on machines without a GPU, against the
//!   CPU backend, before a GPU minute is spent; it is not fast and not a product path.
//!
//! Everything here is stream-ordered: a call enqueues work on the device's one stream and returns; work runs
//! in the order it was enqueued. [`Device::download`] and [`Device::synchronize`] wait for it.

use std::any::Any;
use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::tensor_map::{TensorMap, TensorMapDesc};
use crate::dtype::DType;
use crate::error::Result;
use crate::view::Memory;

/// A device address (`CUdeviceptr`); in the emulator, a host address.
pub(crate) type DevicePtr = u64;

/// One `.cu` source embedded in the binary and the `extern "C"` kernels it defines. The backend compiles a
/// source (NVRTC, or the host compiler for the emulator) the first time one of its kernels is launched.
#[derive(Debug)]
pub(crate) struct KernelSource {
    /// File name under `src/cuda/kernels/`, for messages and `#line` directives.
    pub file: &'static str,
    /// The source text.
    pub code: &'static str,
    /// The kernels it defines (their `extern "C"` names), checked against the compiled module.
    pub kernels: &'static [&'static str],
    /// Headers of its own (name, text), placed after the shared ones (e.g. attention's mask).
    pub includes: &'static [(&'static str, &'static str)],
}

/// One kernel: its source and its name.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kernel {
    pub source: &'static KernelSource,
    pub name: &'static str,
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaunchConfig {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Bytes of dynamic shared memory.
    pub shared_bytes: u32,
}

impl LaunchConfig {
    /// A 1-D grid of `blocks` blocks of `threads` threads, no dynamic shared memory.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        Self { grid: [blocks, 1, 1], block: [threads, 1, 1], shared_bytes: 0 }
    }
}

/// One parameter's storage unit: 64 bytes, 64-byte aligned, so that a parameter of any alignment up to 64 (a tensor
/// map, `CUtensorMap`) is read in place by the emulator's launch, which dereferences it as its C++ type.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct ArgWord([u8; 64]);

/// A kernel's parameters in declaration order, each stored at its own 64-byte aligned address, as
/// `cuLaunchKernel`'s `kernelParams` takes them; with each parameter's size, which a device checks against the
/// kernel's declaration where it can (the emulator always does).
#[derive(Clone, Default)]
pub(crate) struct KernelArgs {
    /// One boxed run of 64-byte words per parameter (boxed so their addresses stay put as more are pushed).
    slots: Vec<Box<[ArgWord]>>,
    sizes: Vec<usize>,
}

impl KernelArgs {
    pub fn new() -> Self {
        Self::default()
    }
    /// Appends a parameter: a plain value whose bytes are what the kernel's parameter of that type holds
    /// (`u64` for a pointer, `i32` for an `int`, `f32` for a `float`, a `#[repr(C)]` struct for a struct).
    pub fn push<T: Copy + 'static>(&mut self, v: T) -> &mut Self {
        let size = std::mem::size_of::<T>();
        assert!(std::mem::align_of::<T>() <= 64, "a kernel parameter aligned past 64 bytes");
        let mut slot = vec![ArgWord([0; 64]); size.div_ceil(64).max(1)].into_boxed_slice();
        // SAFETY: `slot` is 64-byte aligned and holds at least `size` bytes; `T: Copy` has no drop glue.
        unsafe { std::ptr::write(slot.as_mut_ptr().cast::<T>(), v) };
        self.slots.push(slot);
        self.sizes.push(size);
        self
    }
    /// The size of each parameter, in order.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }
    /// The address of each parameter's storage, valid while `self` lives and is not changed.
    pub fn pointers(&self) -> Vec<*mut c_void> {
        self.slots.iter().map(|s| s.as_ptr().cast_mut().cast::<c_void>()).collect()
    }
}

impl fmt::Debug for KernelArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KernelArgs({} parameters, sizes {:?})", self.sizes.len(), self.sizes)
    }
}

/// One matrix product in cuBLAS's column-major terms:
/// `D[m,n] = alpha · op(A)[m,k] · op(B)[k,n] + beta · C[m,n] (+ bias[m] broadcast over columns)`, with `C` and
/// `D` the same buffer, repeated `batch` times at the given strides. `op(X)` is `X` or, when `trans_x`, `Xᵀ`;
/// `A` is stored `lda × (trans_a ? m : k)` (leading dimension first), `B` `ldb × (trans_b ? k : n)`, `C` `ldc × n`.
/// Products accumulate in `f32` (TF32 inputs only when `tf32` is set and the inputs are `f32`).
///
/// A row-major `Y[M,N] = X[M,K]·W[K,N]` is the column-major `Yᵀ = Wᵀ·Xᵀ`: `m = N, n = M`, `A = W`, `B = X`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: DevicePtr,
    pub lda: usize,
    pub trans_a: bool,
    pub stride_a: usize,
    pub b: DevicePtr,
    pub ldb: usize,
    pub trans_b: bool,
    pub stride_b: usize,
    pub c: DevicePtr,
    pub ldc: usize,
    pub stride_c: usize,
    /// `A` and `B` share one element type.
    pub ab_type: DType,
    pub c_type: DType,
    pub batch: usize,
    pub alpha: f32,
    pub beta: f32,
    /// `[m]` of `c_type`, added to every column (a linear layer's bias in the row-major picture).
    pub bias: Option<DevicePtr>,
    pub tf32: bool,
}

/// What a device says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeviceInfo {
    pub name: String,
    /// The host emulator rather than a GPU.
    pub emulated: bool,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (u32, u32),
    pub multiprocessors: u32,
    pub total_memory: usize,
}

pub use crate::backend::MemoryStats;

/// A point in a device's stream: complete once everything enqueued before it has run.
pub(crate) trait DeviceEvent: Send + Sync + fmt::Debug {
    /// Blocks until the event is complete.
    fn synchronize(&self) -> Result<()>;
    /// For a device to recognise its own events.
    fn as_any(&self) -> &dyn Any;
    /// The device time from `earlier` to this event when both were recorded with timing
    /// ([`Device::record_timed_event`]); waits for this one. `None` where they carry no time.
    fn elapsed_since(&self, earlier: &dyn DeviceEvent) -> Result<Option<Duration>>;
}

/// What runs the CUDA backend's work (see the module docs). Every `unsafe` method takes device addresses that
/// the caller guarantees are live allocations of this device (or of a fork of it) of at least the bytes the
/// call touches, not freed before the enqueued work has run.
pub(crate) trait Device: Send + Sync + fmt::Debug {
    /// `Memory::Cuda { ordinal }`.
    fn memory(&self) -> Memory;
    /// Name, compute capability, multiprocessors, memory.
    fn info(&self) -> &DeviceInfo;

    /// `bytes` of device memory, 256-byte aligned, from the device's caching pool, ordered on this stream
    /// (usable by work enqueued after this call). Errors: out of memory, after the pool gave back what it keeps.
    fn alloc(&self, bytes: usize) -> Result<DevicePtr>;
    /// Returns `ptr` to the pool once the work enqueued so far on this stream has run.
    ///
    /// # Safety
    /// `ptr` came from [`Device::alloc`] of this device and is not used afterwards; work on other streams that
    /// uses it was ordered before this call.
    unsafe fn free(&self, ptr: DevicePtr);

    /// Copies `src` (host memory) to `dst`; returns once `src` may be changed or freed.
    ///
    /// # Safety
    /// See the trait docs.
    unsafe fn upload(&self, dst: DevicePtr, src: &[u8]) -> Result<()>;
    /// Copies `dst.len()` bytes at `src` to `dst` (host memory) after the work enqueued before it; returns once
    /// `dst` holds them.
    ///
    /// # Safety
    /// See the trait docs.
    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr) -> Result<()>;
    /// Page-locks `len` bytes of host memory at `ptr` and registers them with the driver for every context
    /// (`cuMemHostRegister`, portable): copies to and from them then run by DMA, and an [`upload`](Device::upload)
    /// from them is one copy with no staging of ours. The emulator accepts it and changes nothing.
    ///
    /// # Safety
    /// The range is host memory of this process, not registered already, that stays mapped until
    /// [`unregister_host`](Device::unregister_host).
    unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()>;
    /// Undoes [`register_host`](Device::register_host) of the same range (errors cannot be acted on and are not
    /// reported).
    ///
    /// # Safety
    /// The range was registered by `register_host` and not unregistered since; no copy uses it any more.
    unsafe fn unregister_host(&self, ptr: *mut u8, len: usize);
    /// Copies `bytes` from `src` to `dst` (device memory, not overlapping).
    ///
    /// # Safety
    /// See the trait docs.
    unsafe fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()>;
    /// Sets `count` 32-bit words at `dst` to `value`.
    ///
    /// # Safety
    /// See the trait docs.
    unsafe fn memset32(&self, dst: DevicePtr, value: u32, count: usize) -> Result<()>;

    /// Launches `kernel` (compiling its source at first use). A launch the device refuses (a bad
    /// configuration, parameters that do not match the kernel's) is an error here; a fault while the kernel
    /// runs is reported by a later synchronising call.
    ///
    /// # Safety
    /// The parameters are what the kernel declares, and every address among them satisfies the trait docs
    /// for every byte the kernel touches.
    unsafe fn launch(&self, kernel: &Kernel, cfg: &LaunchConfig, args: &KernelArgs) -> Result<()>;
    /// Enqueues one matrix product (see [`Gemm`]).
    ///
    /// # Safety
    /// Every address covers the bytes the product touches.
    unsafe fn gemm(&self, g: &Gemm) -> Result<()>;

    /// Blocks until all work enqueued so far has run; reports a fault from any of it.
    fn synchronize(&self) -> Result<()>;
    /// An event complete once the work enqueued so far has run.
    fn record_event(&self) -> Result<Arc<dyn DeviceEvent>>;
    /// As [`Device::record_event`], with timing (see [`DeviceEvent::elapsed_since`]).
    fn record_timed_event(&self) -> Result<Arc<dyn DeviceEvent>>;
    /// Work enqueued after this call waits for `event` (recorded on this device or a fork of it).
    fn wait_event(&self, event: &dyn DeviceEvent) -> Result<()>;
    /// The same device, pool and compiled kernels on a new stream.
    fn fork(&self) -> Result<Arc<dyn Device>>;

    /// The tensor map of `desc` for this device's kernels (a `const __grid_constant__ CUtensorMap` parameter of
    /// those using the TMA, ptx_tma.cuh): encoded by the driver on a GPU, in the emulator's own format on the
    /// emulator. A typed error naming the field when `desc` breaks `cuTensorMapEncodeTiled`'s documented rules.
    fn tensor_map(&self, desc: &TensorMapDesc) -> Result<TensorMap>;

    /// Compiles every kernel source for this device now, in parallel, rather than each at the first launch of one
    /// of its kernels (NVRTC takes about a minute of one core for each tensor-core attention source): what a
    /// benchmark calls before it times anything. A source already compiled (in this process, or found in the disk
    /// cache) costs nothing. The emulator builds every source when it is made, so it has nothing to do here.
    fn compile_kernels(&self) -> Result<()>;

    /// How long the device took to run the work `work` enqueues on this stream: the time between a stamp
    /// enqueued before `work` is called and one enqueued after it returns, waiting for the second. Work enqueued
    /// earlier is not counted (the first stamp is taken once it has run); work on other streams counts only
    /// where this stream waits for it. What `work` costs the host counts only where the device waits for the
    /// host, which is what a benchmark of device work wants: a launch-bound op shows as slow, a queue kept full
    /// does not show its launch cost. A failure of `work` is returned as it is.
    ///
    /// The driver stamps with CUDA events made with timing (`CU_EVENT_DEFAULT`: [`Device::record_event`]'s
    /// events have none, and the driver refuses to time them), resolution about half a microsecond; the
    /// emulator, whose work has run when each call returns, reads the host clock around `work`.
    fn time(&self, work: &mut dyn FnMut() -> Result<()>) -> Result<Duration>;

    /// What the pool holds now and at most.
    fn memory_stats(&self) -> MemoryStats;
    /// Gives the memory the pool keeps for reuse back to the driver.
    fn trim(&self) -> Result<()>;
}
