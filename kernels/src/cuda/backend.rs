//! [`CudaBackend`]: the `Backend` trait on a [`Device`](super::device::Device). Each method runs the shared argument checks
//! ([`crate::checks`]), then hands the op, with the backend's [`Stream`], to its family in `ops/` (one file per
//! `.cu` source), which picks the kernel or the cuBLASLt product and enqueues it.

use std::sync::Arc;
use std::time::Duration;

use super::alloc::CudaAllocation;
use super::device::{DeviceEvent, MemoryStats};
use super::ops;
use super::path::{AttentionPath, WgmmaBackward};
use super::stream::Stream;
use crate::attention::{AttnGrads, AttnOptions, AttnOut, AttnPartial, AttnSaved, Qkv};
use crate::backend::{AdamwState, Backend, GradMode, LinearGrads, NormGrads, NormParams, ProjectionGrads};
use crate::buffer::Buffer;
use crate::dtype::DType;
use crate::error::Result;
use crate::event::{BackendEvent, Event};
use crate::ops::{AdamW, CrossEntropyOptions, CrossEntropyOutput, RopeTable, RouterOutput, Routing};
use crate::saved::{
    LayerNormSaved, LinearSaved, MoeCombineSaved, MoeRouterSaved, RmsNormSaved, SquaredReluSaved, SwigluSaved,
};
use crate::view::{Dims, Memory, View, ViewMut};

/// Whether [`Backend::empty`] fills its buffers with NaN: in debug builds (so the test suite), an op that leaves
/// part of an output unwritten shows as NaN rather than passing on stale values that happen to fit (as the CPU
/// backend does).
const POISON_EMPTY: bool = cfg!(debug_assertions);

/// A CUDA device and one stream on it (see the module docs).
#[derive(Debug, Clone)]
pub struct CudaBackend {
    stream: Stream,
}

impl CudaBackend {
    /// The backend on device `ordinal`, with its own stream.
    ///
    /// Errors: [`KernelError::NoDevice`](crate::KernelError::NoDevice) when no CUDA driver can be loaded or no device has that ordinal.
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(Self { stream: Stream::from_env(super::driver::DriverDevice::new(ordinal)?)? })
    }

    /// The backend on the host emulator: the same kernels compiled for this CPU by the system's C++ compiler
    /// (`$CXX`, else `c++`) and run with one fiber per CUDA thread, device memory being host memory with guard
    /// zones checked after every launch. Slow; for testing kernels and the backend without a GPU.
    ///
    /// Errors: [`KernelError::Compile`](crate::KernelError::Compile) when the kernels do not build with the host compiler.
    pub fn emulated() -> Result<Self> {
        Ok(Self { stream: Stream::from_env(super::emulated::EmulatedDevice::open()?)? })
    }

    /// This backend running the attention kernels of `path` (see [`AttentionPath`]; the default is
    /// `LONGCTX_CUDA_ATTN_PATH`'s, else [`AttentionPath::Auto`]); its forks inherit it:
    ///
    /// ```no_run
    /// # use longctx_kernels::{cuda::AttentionPath, CudaBackend};
    /// // The wgmma forward on the emulator (whose compute capability alone would pick the mma.sync one).
    /// let emu = CudaBackend::emulated()?.with_attention_path(AttentionPath::Wgmma);
    /// assert_eq!(emu.attention_path(), AttentionPath::Wgmma);
    /// # Ok::<(), longctx_kernels::KernelError>(())
    /// ```
    pub fn with_attention_path(mut self, path: AttentionPath) -> Self {
        self.stream.attn_path = path;
        self
    }

    /// Which attention kernels this backend runs ([`CudaBackend::with_attention_path`]).
    pub fn attention_path(&self) -> AttentionPath {
        self.stream.attn_path
    }

    /// This backend with the wgmma attention backward computing dQ by `how` (the default: [`WgmmaBackward::Split`],
    /// unless `LONGCTX_CUDA_ATTN_DETERMINISTIC` names another); its forks inherit it. Only the wgmma path has the
    /// choice; the others ignore it.
    ///
    /// The trade, in tile products per (query tile, key tile) pair the mask does not hide:
    /// - [`Split`](WgmmaBackward::Split): two kernels, dK/dV per key block and dQ per query block, each computing S
    ///   and dP (7 products a pair); every gradient element summed by one thread in a fixed order, so two runs give
    ///   the same bits. No workspace.
    /// - [`Ordered`](WgmmaBackward::Ordered): one kernel per key block of 128 keys (5 products a pair) that adds each
    ///   pair's dQ contribution to an f32 workspace, the key blocks taking turns for each (query tile, 64 columns of
    ///   D) through a flag in global memory, in a fixed order: the same bits every run. A block waits only for blocks
    ///   launched before it (the GPU dispatches blocks in order); the order (the last key block first) is the one in
    ///   which a causal mask's blocks reach each query tile, so their turns come without waiting, while with no mask
    ///   every block reaches query tile 0 at once and the k-th block of a head waits for k turns at the start.
    /// - [`Atomic`](WgmmaBackward::Atomic): the same kernel with the additions in whatever order they land: dQ's
    ///   bits vary from run to run.
    ///
    /// The two one-kernel variants take a workspace of 4 bytes per dQ element (`batch·q_heads·q_len·head_dim·4`
    /// bytes) for the call. The trainer keeps `Split` (it builds its backends with [`CudaBackend::new`] and never
    /// calls this; only `LONGCTX_CUDA_ATTN_DETERMINISTIC` in its environment would change it) until a GPU run shows
    /// which deterministic one is faster (none has run on a GPU yet).
    ///
    /// ```no_run
    /// # use longctx_kernels::{cuda::{AttentionPath, WgmmaBackward}, CudaBackend};
    /// let emu = CudaBackend::emulated()?.with_attention_path(AttentionPath::Wgmma).with_wgmma_backward(WgmmaBackward::Ordered);
    /// assert!(emu.deterministic_backward());
    /// # Ok::<(), longctx_kernels::KernelError>(())
    /// ```
    pub fn with_wgmma_backward(mut self, how: WgmmaBackward) -> Self {
        self.stream.attn_backward = how;
        self
    }

    /// How the wgmma attention backward computes dQ ([`CudaBackend::with_wgmma_backward`]).
    pub fn wgmma_backward(&self) -> WgmmaBackward {
        self.stream.attn_backward
    }

    /// This backend with a deterministic wgmma attention backward ([`WgmmaBackward::Split`]) or the atomic one
    /// ([`WgmmaBackward::Atomic`]): [`CudaBackend::with_wgmma_backward`] in two words.
    pub fn with_deterministic_backward(self, deterministic: bool) -> Self {
        self.with_wgmma_backward(if deterministic { WgmmaBackward::Split } else { WgmmaBackward::Atomic })
    }

    /// Whether the wgmma attention backward gives the same bits every run ([`WgmmaBackward::deterministic`]).
    pub fn deterministic_backward(&self) -> bool {
        self.stream.attn_backward.deterministic()
    }

    /// The backend as a shared `dyn Backend` (what ranks and plans hold); also in the build without the `cuda`
    /// feature, so code naming it builds either way.
    pub fn into_shared(self) -> std::sync::Arc<dyn crate::Backend> {
        std::sync::Arc::new(self)
    }

    /// The device's name, compute capability, multiprocessors and memory.
    pub fn device_name(&self) -> String {
        let i = self.stream.device.info();
        format!(
            "{} (sm_{}{}, {} SMs, {} GiB)",
            i.name,
            i.compute_capability.0,
            i.compute_capability.1,
            i.multiprocessors,
            i.total_memory >> 30
        )
    }

    /// Whether this is the host emulator ([`CudaBackend::emulated`]) rather than a GPU.
    pub fn is_emulated(&self) -> bool {
        self.stream.device.info().emulated
    }

    /// Compiles every kernel for this device now, on as many threads as the machine has, instead of each source at
    /// the first launch of one of its kernels (NVRTC takes about a minute of one core for each tensor-core attention
    /// source; compiled kernels are also cached on disk: [`crate::cuda`]): call it before timing anything, or to
    /// pay the cost up front. Nothing to do on the emulator, which builds every kernel when it is made.
    ///
    /// Errors: a source that does not compile ([`KernelError::Compile`](crate::KernelError::Compile)).
    pub fn compile_kernels(&self) -> Result<()> {
        self.stream.device.compile_kernels()
    }

    /// Compiles every kernel a GPU of architecture `arch` (`sm_90` for an H100 or H200) runs into the disk cache
    /// ([`crate::cuda`]: `LONGCTX_CUDA_CACHE`), with no GPU and no backend: NVRTC and the CUDA headers are all it
    /// needs. A process on that GPU with the same NVRTC release and headers then finds every kernel compiled (the
    /// key holds the headers' content, not their folder): `scripts/gpu-check --pack` ships such a cache so the
    /// lent machine's minutes go to tests and benchmarks. Returns how many sources were compiled or found.
    ///
    /// Errors: `arch` not an architecture ([`KernelError::InvalidArgument`](crate::KernelError::InvalidArgument)),
    /// NVRTC or the headers missing ([`KernelError::NoDevice`](crate::KernelError::NoDevice) or
    /// [`KernelError::Compile`](crate::KernelError::Compile), naming where they were looked for), a source that does
    /// not compile.
    pub fn precompile(arch: &str) -> Result<usize> {
        super::nvrtc::compile_all(arch)
    }

    /// How long the device took to run the ops `work` enqueues on this backend: the time between a stamp
    /// enqueued before `work` is called and one enqueued after it returns, waiting for the second (ops are
    /// asynchronous, so the host clock around `work` would time their launches, not their work). Ops enqueued
    /// before the call are not counted; ops on a [`fork`](Backend::fork) count only where this stream waits for
    /// them. On a GPU the stamps are CUDA events with timing (resolution about half a microsecond); on the
    /// emulator, whose ops have run when they return, the host clock. What `work` returns is returned:
    ///
    /// ```no_run
    /// # use longctx_kernels::{Backend, CudaBackend, DType, Dims};
    /// let gpu = CudaBackend::new(0)?;
    /// let dims = Dims::new(&[4096, 4096])?;
    /// let (mut x, y) = (gpu.empty(DType::Bf16, dims)?, gpu.zeros(DType::Bf16, dims)?);
    /// let took = gpu.time(|| gpu.copy(x.view_mut(), y.view()))?;
    /// println!("{:.1} GB/s", 2.0 * y.bytes() as f64 / took.as_secs_f64() / 1e9);
    /// # Ok::<(), longctx_kernels::KernelError>(())
    /// ```
    pub fn time(&self, work: impl FnOnce() -> Result<()>) -> Result<Duration> {
        let mut work = Some(work);
        self.stream.device.time(&mut || match work.take() {
            Some(w) => w(),
            None => Ok(()),
        })
    }

    /// What the device's pool holds now and at most (bytes).
    pub fn memory_stats(&self) -> MemoryStats {
        self.stream.device.memory_stats()
    }

    /// Gives the memory the pool keeps for reuse back to the driver (after the work enqueued so far).
    pub fn trim(&self) -> Result<()> {
        self.stream.device.trim()
    }

    fn buffer(&self, dtype: DType, dims: Dims) -> Result<Buffer> {
        let alloc = CudaAllocation::new(&self.stream.device, dims.numel() * dtype.size())?;
        Buffer::from_device(Box::new(alloc), dtype, dims)
    }
}

/// An event recorded on a CUDA stream.
#[derive(Debug)]
struct CudaEvent(Arc<dyn DeviceEvent>);

impl BackendEvent for CudaEvent {
    fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn elapsed_since(&self, earlier: &dyn BackendEvent) -> Result<Option<std::time::Duration>> {
        match earlier.as_any().downcast_ref::<CudaEvent>() {
            Some(e) => self.0.elapsed_since(e.0.as_ref()),
            None => Ok(None),
        }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn memory(&self) -> Memory {
        self.stream.device.memory()
    }

    fn upload(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        crate::checks::upload(self.stream.on(), &dst, &src)?;
        let host = src.as_host("src")?;
        let dst = dst.into_device("dst", self.memory())?;
        // SAFETY: `dst` is a view of live device memory of this device holding as many bytes as `src`.
        unsafe { self.stream.device.upload(dst.ptr(), host.as_bytes()) }
    }

    fn download(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        crate::checks::download(self.stream.on(), &dst, &src)?;
        let src = src.as_device("src", self.memory())?;
        let mut host = dst.into_host("dst")?;
        self.stream.download_bytes(host.as_bytes_mut(), src.ptr())
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.device.synchronize()
    }

    fn record_event(&self) -> Result<Event> {
        Ok(Event::new(Arc::new(CudaEvent(self.stream.device.record_event()?))))
    }

    fn record_timed_event(&self) -> Result<Event> {
        Ok(Event::new(Arc::new(CudaEvent(self.stream.device.record_timed_event()?))))
    }

    fn wait_event(&self, event: &Event) -> Result<()> {
        match event.marker() {
            None => Ok(()),
            Some(m) => match m.as_any().downcast_ref::<CudaEvent>() {
                // Waited for on the device: the host goes on.
                Some(e) => self.stream.device.wait_event(e.0.as_ref()),
                // Another backend's event: wait on the host, so that work enqueued from now on follows it.
                None => event.synchronize(),
            },
        }
    }

    fn fork(&self) -> Result<Arc<dyn Backend>> {
        // The fork keeps this backend's attention choices.
        let stream = Stream { device: self.stream.device.fork()?, ..self.stream.clone() };
        Ok(Arc::new(CudaBackend { stream }))
    }
    fn adopt(&self, buf: &mut Buffer) -> Result<()> {
        let Some(alloc) = buf.device_allocation_mut() else { return Ok(()) };
        let got = alloc.memory();
        let wrong = || crate::KernelError::Memory { name: "buf", backend: "cuda", expected: self.memory(), got };
        if got != self.memory() {
            return Err(wrong());
        }
        // Memory of this device but not of this backend's pool (another implementation's) cannot change hands.
        let ours = alloc.as_any_mut().and_then(|a| a.downcast_mut::<CudaAllocation>()).ok_or_else(wrong)?;
        ours.move_to(&self.stream.device)
    }
    fn device_memory(&self) -> Option<crate::MemoryStats> {
        Some(self.memory_stats())
    }
    unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: the trait's contract is the device's.
        unsafe { self.stream.device.register_host(ptr, len) }
    }
    unsafe fn unregister_host(&self, ptr: *mut u8, len: usize) {
        // SAFETY: as above.
        unsafe { self.stream.device.unregister_host(ptr, len) }
    }

    fn zeros(&self, dtype: DType, dims: Dims) -> Result<Buffer> {
        let mut b = self.buffer(dtype, dims)?;
        ops::elementwise::fill(&self.stream, b.view_mut(), 0.0)?;
        Ok(b)
    }

    fn empty(&self, dtype: DType, dims: Dims) -> Result<Buffer> {
        let mut b = self.buffer(dtype, dims)?;
        if POISON_EMPTY {
            ops::elementwise::fill(&self.stream, b.view_mut(), f32::NAN)?;
        }
        Ok(b)
    }

    fn copy(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        crate::checks::copy(self.stream.on(), &dst, &src)?;
        ops::elementwise::copy(&self.stream, dst, src)
    }

    fn fill(&self, dst: ViewMut<'_>, value: f32) -> Result<()> {
        crate::checks::fill(self.stream.on(), &dst)?;
        ops::elementwise::fill(&self.stream, dst, value)
    }

    fn add(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        crate::checks::copy(self.stream.on(), &dst, &src)?;
        ops::elementwise::add(&self.stream, dst, src)
    }

    fn scale(&self, x: ViewMut<'_>, a: f32) -> Result<()> {
        crate::checks::scale(self.stream.on(), &x, a)?;
        ops::elementwise::scale(&self.stream, x, a)
    }

    fn sum_squares(&self, xs: &[View<'_>]) -> Result<f64> {
        crate::checks::sum_squares(self.stream.on(), xs)?;
        ops::elementwise::sum_squares(&self.stream, xs)
    }

    fn transpose12(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        let dims = crate::checks::transpose12(self.stream.on(), &dst, &src)?;
        ops::elementwise::transpose12(&self.stream, dst, src, dims)
    }

    fn attention_forward(&self, opts: &AttnOptions<'_>, out: AttnOut<'_>, qkv: Qkv<'_>) -> Result<()> {
        let p = crate::checks::attention_forward(self.stream.on(), opts, &out, &qkv)?;
        ops::attention::forward(&self.stream, &p, out, qkv)
    }

    fn attention_backward(
        &self,
        opts: &AttnOptions<'_>,
        grads: AttnGrads<'_>,
        dout: View<'_>,
        saved: AttnSaved<'_>,
        mode: GradMode,
    ) -> Result<()> {
        let p = crate::checks::attention_backward(self.stream.on(), opts, &grads, &dout, &saved)?;
        ops::attention::backward(&self.stream, &p, grads, dout, saved, mode)
    }

    fn attention_merge(&self, acc: AttnOut<'_>, part: AttnPartial<'_>) -> Result<()> {
        let (rows, d) = crate::checks::attention_merge(self.stream.on(), &acc, &part)?;
        ops::attention::merge(&self.stream, acc, part, rows, d)
    }

    fn linear_forward(&self, y: ViewMut<'_>, x: View<'_>, w: View<'_>, bias: Option<View<'_>>) -> Result<()> {
        let l = crate::checks::linear_forward(self.stream.on(), &y, &x, &w, bias.as_ref())?;
        ops::linear::forward(&self.stream, l, y, x, w, bias)
    }

    fn linear_backward(
        &self,
        grads: LinearGrads<'_>,
        dy: View<'_>,
        saved: LinearSaved<'_>,
        w: View<'_>,
        mode: GradMode,
    ) -> Result<()> {
        let l = crate::checks::linear_backward(self.stream.on(), &grads, &dy, &saved, &w)?;
        ops::linear::backward(&self.stream, l, grads, dy, saved, w, mode)
    }

    fn rmsnorm_forward(&self, y: ViewMut<'_>, rstd: ViewMut<'_>, x: View<'_>, p: &NormParams<'_>) -> Result<()> {
        let r = crate::checks::rmsnorm_forward(self.stream.on(), &y, &rstd, &x, p)?;
        ops::norm::forward(&self.stream, r, y, None, rstd, x, p)
    }

    fn rmsnorm_backward(
        &self,
        grads: NormGrads<'_>,
        dy: View<'_>,
        saved: RmsNormSaved<'_>,
        weight: View<'_>,
        mode: GradMode,
    ) -> Result<()> {
        let r = crate::checks::rmsnorm_backward(self.stream.on(), &grads, &dy, &saved, &weight)?;
        ops::norm::backward(&self.stream, r, grads, dy, saved.x, None, saved.rstd, weight, mode)
    }

    fn layernorm_forward(
        &self,
        y: ViewMut<'_>,
        mean: ViewMut<'_>,
        rstd: ViewMut<'_>,
        x: View<'_>,
        p: &NormParams<'_>,
    ) -> Result<()> {
        let r = crate::checks::layernorm_forward(self.stream.on(), &y, &mean, &rstd, &x, p)?;
        ops::norm::forward(&self.stream, r, y, Some(mean), rstd, x, p)
    }

    fn layernorm_backward(
        &self,
        grads: NormGrads<'_>,
        dy: View<'_>,
        saved: LayerNormSaved<'_>,
        weight: View<'_>,
        mode: GradMode,
    ) -> Result<()> {
        let r = crate::checks::layernorm_backward(self.stream.on(), &grads, &dy, &saved, &weight)?;
        ops::norm::backward(&self.stream, r, grads, dy, saved.x, Some(saved.mean), saved.rstd, weight, mode)
    }

    fn rope_forward(&self, rope: &RopeTable, x: ViewMut<'_>, positions: &[i64]) -> Result<()> {
        let d = crate::checks::rope(self.stream.on(), rope, &x, positions)?;
        ops::rope::apply(&self.stream, rope, d, x, positions, 1.0)
    }

    fn rope_backward(&self, rope: &RopeTable, d: ViewMut<'_>, positions: &[i64]) -> Result<()> {
        let dims = crate::checks::rope(self.stream.on(), rope, &d, positions)?;
        ops::rope::apply(&self.stream, rope, dims, d, positions, -1.0)
    }

    fn swiglu_forward(&self, out: ViewMut<'_>, gate: View<'_>, up: View<'_>) -> Result<()> {
        crate::checks::swiglu_forward(self.stream.on(), &out, &gate, &up)?;
        ops::elementwise::swiglu_forward(&self.stream, out, gate, up)
    }

    fn swiglu_backward(
        &self,
        dgate: ViewMut<'_>,
        dup: ViewMut<'_>,
        dout: View<'_>,
        saved: SwigluSaved<'_>,
    ) -> Result<()> {
        crate::checks::swiglu_backward(self.stream.on(), &dgate, &dup, &dout, &saved)?;
        ops::elementwise::swiglu_backward(&self.stream, dgate, dup, dout, saved)
    }

    fn squared_relu_forward(&self, out: ViewMut<'_>, x: View<'_>) -> Result<()> {
        crate::checks::squared_relu_forward(self.stream.on(), &out, &x)?;
        ops::elementwise::squared_relu_forward(&self.stream, out, x)
    }

    fn squared_relu_backward(&self, dx: ViewMut<'_>, dout: View<'_>, saved: SquaredReluSaved<'_>) -> Result<()> {
        crate::checks::squared_relu_backward(self.stream.on(), &dx, &dout, &saved)?;
        ops::elementwise::squared_relu_backward(&self.stream, dx, dout, saved)
    }

    fn moe_router_forward(
        &self,
        probs: ViewMut<'_>,
        weights: ViewMut<'_>,
        logits: View<'_>,
        top_k: usize,
    ) -> Result<RouterOutput> {
        let (l, e) = crate::checks::moe_router_forward(self.stream.on(), &probs, &weights, &logits, top_k)?;
        ops::moe::router_forward(&self.stream, probs, weights, logits, l, e, top_k)
    }

    fn moe_router_backward(
        &self,
        dlogits: ViewMut<'_>,
        dweights: View<'_>,
        aux: Option<View<'_>>,
        saved: MoeRouterSaved<'_>,
    ) -> Result<()> {
        crate::checks::moe_router_backward(self.stream.on(), &dlogits, &dweights, aux.as_ref(), &saved)?;
        ops::moe::router_backward(&self.stream, dlogits, dweights, aux, saved)
    }

    fn moe_gather_forward(&self, xe: ViewMut<'_>, x: View<'_>, routing: &Routing) -> Result<()> {
        let c = crate::checks::moe_gather_forward(self.stream.on(), &xe, &x, routing)?;
        ops::moe::gather_forward(&self.stream, xe, x, routing, c)
    }

    fn moe_gather_backward(&self, dx: ViewMut<'_>, dxe: View<'_>, routing: &Routing) -> Result<()> {
        let c = crate::checks::moe_gather_backward(self.stream.on(), &dx, &dxe, routing)?;
        ops::moe::sum_rows(&self.stream, dx, dxe, None, routing, c)
    }

    fn moe_combine_forward(&self, out: ViewMut<'_>, ye: View<'_>, weights: View<'_>, routing: &Routing) -> Result<()> {
        let c = crate::checks::moe_combine_forward(self.stream.on(), &out, &ye, &weights, routing)?;
        ops::moe::sum_rows(&self.stream, out, ye, Some(weights), routing, c)
    }

    fn moe_combine_backward(
        &self,
        dye: ViewMut<'_>,
        dweights: ViewMut<'_>,
        dout: View<'_>,
        saved: MoeCombineSaved<'_>,
    ) -> Result<()> {
        let c = crate::checks::moe_combine_backward(self.stream.on(), &dye, &dweights, &dout, &saved)?;
        ops::moe::combine_backward(&self.stream, dye, dweights, dout, saved, c)
    }

    fn embedding_forward(&self, out: ViewMut<'_>, ids: &[u32], table: View<'_>) -> Result<()> {
        let (_, c) = crate::checks::embedding_forward(self.stream.on(), &out, ids, &table)?;
        ops::embedding::forward(&self.stream, out, ids, table, c)
    }

    fn embedding_backward(&self, dtable: ViewMut<'_>, dout: View<'_>, ids: &[u32], mode: GradMode) -> Result<()> {
        let (v, c) = crate::checks::embedding_backward(self.stream.on(), &dtable, &dout, ids)?;
        ops::embedding::backward(&self.stream, dtable, dout, ids, v, c, mode)
    }

    fn cross_entropy_fused(
        &self,
        grads: ProjectionGrads<'_>,
        hidden: View<'_>,
        weight: View<'_>,
        targets: &[i64],
        opts: &CrossEntropyOptions,
        mode: GradMode,
    ) -> Result<CrossEntropyOutput> {
        let d = crate::checks::cross_entropy_fused(self.stream.on(), &grads, &hidden, &weight, targets, opts)?;
        ops::cross_entropy::fused(&self.stream, d, grads, hidden, weight, targets, opts, mode)
    }

    fn adamw_step(
        &self,
        master: ViewMut<'_>,
        copy_to: Option<ViewMut<'_>>,
        grads: View<'_>,
        state: AdamwState<'_>,
        hp: &AdamW,
        step: u64,
    ) -> Result<()> {
        crate::checks::adamw_step(self.stream.on(), &master, copy_to.as_ref(), &grads, &state, hp, step)?;
        ops::elementwise::adamw(&self.stream, master, copy_to, grads, state, hp, step)
    }
}
