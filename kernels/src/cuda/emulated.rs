//! [`EmulatedDevice`]: the [`Device`] of the host emulator (see `device.rs` and `emulator/`), so that the whole
//! CUDA backend above the seam runs, and is tested, without a GPU.
//!
//! - Kernels run on the [`Emulator`]: every launch is synchronous, so a fault is reported by the op that caused
//!   it (as the driver device does with checked launches).
//! - Memory is the emulator's (host memory with guard zones, poisoned when allocated; `$LONGCTX_EMULATED_MEMORY`,
//!   e.g. `64M`, bounds it, so that running out of device memory can be tested); copies check that they
//!   stay within one allocation, as the GPU's would fault. A guard zone found damaged when a buffer is freed is
//!   kept and reported by the next [`Device::synchronize`] (a sticky error, as CUDA's).
//! - Matrix products are computed on the host with cuBLAS's column-major semantics ([`Gemm`]): the `op(A)`/`op(B)`
//!   indexing, leading dimensions, batch strides, `alpha`/`beta` and the bias epilogue, accumulating in `f32` in
//!   `k` order, so that the backend's row-major-to-column-major mapping is tested against the real contract.
//! - One queue: every op has run when its call returns, so events are complete at once, a fork shares the
//!   device, and [`Device::time`] is the host clock around the work. The emulator presents itself as device 0
//!   (`Memory::Cuda { ordinal: 0 }`).

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use rayon::prelude::*;

use super::device::{
    Device, DeviceEvent, DeviceInfo, DevicePtr, Gemm, Kernel, KernelArgs, KernelSource, LaunchConfig, MemoryStats,
};
use super::emulator::Emulator;
use super::sources::{SM90A_SOURCES, SOURCES};
use super::tensor_map::{TensorMap, TensorMapDesc};
use crate::dtype::DType;
use crate::error::{KernelError, Result};
use crate::view::Memory;

/// The state the forks of one emulated device share.
#[derive(Debug)]
struct Shared {
    emulator: Emulator,
    info: DeviceInfo,
    /// A fault found outside an op (a damaged guard zone at a free), reported by the next synchronisation.
    fault: Mutex<Option<KernelError>>,
    /// The most bytes allocated at once.
    used_high: AtomicUsize,
}

/// The host emulator as a device (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct EmulatedDevice {
    shared: Arc<Shared>,
}

/// The emulated devices of this process share one emulator: building it compiles (or loads from the cache)
/// every kernel source.
static EMULATOR: Mutex<Option<Arc<Shared>>> = Mutex::new(None);

impl EmulatedDevice {
    pub fn open() -> Result<Arc<dyn Device>> {
        let mut slot = EMULATOR.lock().unwrap_or_else(|e| e.into_inner());
        let shared = match slot.as_ref() {
            Some(s) => s.clone(),
            None => {
                // Every source, the sm_90a-only ones too: the emulator runs wgmma, and a backend that asks for
                // the wgmma kernels (AttentionPath::Wgmma) gets them here.
                let sources: Vec<&'static KernelSource> = SOURCES.iter().chain(SM90A_SOURCES).copied().collect();
                let emulator = Emulator::new(&sources)?;
                let info = DeviceInfo {
                    name: "host emulator".into(),
                    emulated: true,
                    // What the emulator runs: sm_80's instructions (mma.sync, ldmatrix, cp.async).
                    compute_capability: (8, 0),
                    multiprocessors: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
                    total_memory: emulator.memory_capacity().unwrap_or(1 << 34),
                };
                let s = Arc::new(Shared { emulator, info, fault: Mutex::new(None), used_high: AtomicUsize::new(0) });
                *slot = Some(s.clone());
                s
            }
        };
        Ok(Arc::new(EmulatedDevice { shared }))
    }

    fn emu(&self) -> &Emulator {
        &self.shared.emulator
    }
}

#[derive(Debug)]
struct EmulatedEvent;

impl DeviceEvent for EmulatedEvent {
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn elapsed_since(&self, _earlier: &dyn DeviceEvent) -> Result<Option<Duration>> {
        // Every op has run when its call returns: there is no device clock apart from the host's.
        Ok(None)
    }
}

impl Device for EmulatedDevice {
    fn memory(&self) -> Memory {
        Memory::Cuda { ordinal: 0 }
    }
    fn info(&self) -> &DeviceInfo {
        &self.shared.info
    }

    fn alloc(&self, bytes: usize) -> Result<DevicePtr> {
        let p = self.emu().alloc(bytes)?;
        self.shared.used_high.fetch_max(self.emu().memory_used(), Ordering::Relaxed);
        Ok(p)
    }

    unsafe fn free(&self, ptr: DevicePtr) {
        // SAFETY: the caller's contract (no work uses `ptr` any more: every emulated op has run already).
        if let Err(e) = unsafe { self.emu().free(ptr) } {
            self.shared.fault.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
        }
    }

    unsafe fn upload(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.emu().check_range(dst, src.len(), "upload")?;
        // SAFETY: `dst` covers `src.len()` bytes of one live allocation (checked), host memory distinct from `src`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        self.emu().check_range(src, dst.len(), "download")?;
        // SAFETY: `src` covers `dst.len()` bytes of one live allocation (checked).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        // Host memory is all the emulator has: nothing to pin. The range is only checked as the driver would.
        if ptr.is_null() || len == 0 {
            return Err(KernelError::InvalidArgument { name: "ptr", why: format!("{len} bytes at {ptr:?}") });
        }
        Ok(())
    }

    unsafe fn unregister_host(&self, _ptr: *mut u8, _len: usize) {}

    unsafe fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
        self.emu().check_range(src, bytes, "copy (source)")?;
        self.emu().check_range(dst, bytes, "copy (destination)")?;
        // SAFETY: both ranges lie in live allocations (checked); `copy` tolerates an overlap the caller promised
        // not to make.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    unsafe fn memset32(&self, dst: DevicePtr, value: u32, count: usize) -> Result<()> {
        self.emu().check_range(dst, 4 * count, "memset")?;
        // SAFETY: `dst` covers `count` 4-byte words of one live, 4-byte aligned allocation (checked).
        let words = unsafe { std::slice::from_raw_parts_mut(dst as *mut u32, count) };
        words.fill(value);
        Ok(())
    }

    unsafe fn launch(&self, kernel: &Kernel, cfg: &LaunchConfig, args: &KernelArgs) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.emu().launch(kernel, cfg, args) }
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<()> {
        // SAFETY: the caller's contract, with every operand's range checked first.
        unsafe { host_gemm(self.emu(), g) }
    }

    fn synchronize(&self) -> Result<()> {
        match self.shared.fault.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
    fn record_event(&self) -> Result<Arc<dyn DeviceEvent>> {
        Ok(Arc::new(EmulatedEvent))
    }
    fn record_timed_event(&self) -> Result<Arc<dyn DeviceEvent>> {
        Ok(Arc::new(EmulatedEvent))
    }
    fn wait_event(&self, _event: &dyn DeviceEvent) -> Result<()> {
        Ok(())
    }
    fn fork(&self) -> Result<Arc<dyn Device>> {
        Ok(Arc::new(self.clone()))
    }
    fn tensor_map(&self, desc: &TensorMapDesc) -> Result<TensorMap> {
        let map = desc.encode_emulated()?;
        // The emulator's TMA reads and writes host memory wherever the map says: a map reaching past its buffer is
        // refused here (the driver does not check; a GPU would fault or read another buffer).
        let span = desc.span_bytes();
        self.shared.emulator.check_range(desc.address, usize::try_from(span).unwrap_or(usize::MAX), "tensor map")?;
        Ok(map)
    }

    fn compile_kernels(&self) -> Result<()> {
        // Every source was built (or loaded from the cache) when the emulator was made.
        Ok(())
    }
    fn time(&self, work: &mut dyn FnMut() -> Result<()>) -> Result<Duration> {
        // Every op has run when its call returns: the host clock around the calls is the work's time.
        let start = Instant::now();
        work()?;
        Ok(start.elapsed())
    }
    fn memory_stats(&self) -> MemoryStats {
        let used = self.emu().memory_used();
        let high = self.shared.used_high.load(Ordering::Relaxed).max(used);
        MemoryStats { used, used_high: high, reserved: used, reserved_high: high }
    }
    fn trim(&self) -> Result<()> {
        Ok(())
    }
}

/// A column-major matrix operand: `rows × cols` through `op`, stored with leading dimension `ld`.
struct Operand {
    ptr: DevicePtr,
    ld: usize,
    trans: bool,
    dtype: DType,
}

impl Operand {
    /// Bytes from `ptr` the stored matrix spans: `stored_cols − 1` columns of `ld` plus `stored_rows`.
    fn span(&self, rows: usize, cols: usize) -> usize {
        let (sr, sc) = if self.trans { (cols, rows) } else { (rows, cols) };
        if sr == 0 || sc == 0 {
            return 0;
        }
        ((sc - 1) * self.ld + sr) * self.dtype.size()
    }
    /// Element `(i, j)` of `op(X)` in batch `at` (bytes from `ptr`).
    ///
    /// # Safety
    /// The element lies within the checked span.
    unsafe fn get(&self, at: usize, i: usize, j: usize) -> f32 {
        let idx = if self.trans { j + i * self.ld } else { i + j * self.ld };
        // SAFETY: the caller's contract.
        unsafe { load(self.ptr + at as u64, idx, self.dtype) }
    }
}

/// # Safety
/// `ptr + idx` elements of `dtype` is readable.
unsafe fn load(ptr: DevicePtr, idx: usize, dtype: DType) -> f32 {
    // SAFETY: the caller's contract.
    unsafe {
        match dtype {
            DType::F32 => *(ptr as *const f32).add(idx),
            DType::Bf16 => (*(ptr as *const bf16).add(idx)).to_f32(),
            DType::F16 => (*(ptr as *const f16).add(idx)).to_f32(),
        }
    }
}

/// `D = alpha·op(A)·op(B) + beta·C (+ bias)` per batch, column-major, on the host (see the module docs).
///
/// # Safety
/// Every operand's address is emulated device memory (ranges checked before any access).
unsafe fn host_gemm(emu: &Emulator, g: &Gemm) -> Result<()> {
    if g.tf32 {
        return Err(KernelError::Unsupported("TF32 products on the emulator"));
    }
    let a = Operand { ptr: g.a, ld: g.lda, trans: g.trans_a, dtype: g.ab_type };
    let b = Operand { ptr: g.b, ld: g.ldb, trans: g.trans_b, dtype: g.ab_type };
    let (ct, cs) = (g.c_type, g.c_type.size());
    for batch in 0..g.batch {
        emu.check_range(g.a + (batch * g.stride_a * a.dtype.size()) as u64, a.span(g.m, g.k), "gemm A")?;
        emu.check_range(g.b + (batch * g.stride_b * b.dtype.size()) as u64, b.span(g.k, g.n), "gemm B")?;
        let c_span = if g.m == 0 || g.n == 0 { 0 } else { ((g.n - 1) * g.ldc + g.m) * cs };
        emu.check_range(g.c + (batch * g.stride_c * cs) as u64, c_span, "gemm C")?;
    }
    if let Some(bias) = g.bias {
        emu.check_range(bias, g.m * cs, "gemm bias")?;
    }
    for batch in 0..g.batch {
        let (ao, bo) = (batch * g.stride_a * a.dtype.size(), batch * g.stride_b * b.dtype.size());
        let c0 = g.c + (batch * g.stride_c * cs) as u64;
        // Columns of D in parallel; each element sums over k in order.
        let cols: Vec<Vec<f32>> = (0..g.n)
            .into_par_iter()
            .map(|j| {
                (0..g.m)
                    .map(|i| {
                        let mut acc = 0.0f32;
                        for kk in 0..g.k {
                            // SAFETY: (i, kk) and (kk, j) lie within the checked spans.
                            acc += unsafe { a.get(ao, i, kk) * b.get(bo, kk, j) };
                        }
                        let mut d = g.alpha * acc;
                        if g.beta != 0.0 {
                            // SAFETY: (i, j) of C lies within its checked span.
                            d += g.beta * unsafe { load(c0, i + j * g.ldc, ct) };
                        }
                        if let Some(bias) = g.bias {
                            // SAFETY: the bias holds `m` elements (checked).
                            d += unsafe { load(bias, i, ct) };
                        }
                        d
                    })
                    .collect()
            })
            .collect();
        for (j, col) in cols.iter().enumerate() {
            for (i, &d) in col.iter().enumerate() {
                let idx = i + j * g.ldc;
                // SAFETY: (i, j) of D (= C) lies within its checked span.
                unsafe {
                    match ct {
                        DType::F32 => *(c0 as *mut f32).add(idx) = d,
                        DType::Bf16 => *(c0 as *mut bf16).add(idx) = bf16::from_f32(d),
                        DType::F16 => *(c0 as *mut f16).add(idx) = f16::from_f32(d),
                    }
                }
            }
        }
    }
    Ok(())
}
