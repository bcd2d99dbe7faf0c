//! [`DriverDevice`]: the [`Device`] seam on a real GPU, through cudarc's driver API (`result`/`sys` layers with raw
//! device pointers; cudarc's `CudaContext` only owns the primary context and binds it to calling threads).
//!
//! **Context and streams.** A device is the device's primary context (the one the CUDA runtime, and so cuBLASLt,
//! uses too) and one non-blocking stream per handle: [`Device::fork`] makes another handle on a new stream that
//! shares the context, the memory pool, the loaded modules and cuBLASLt's handle and algorithm cache. Every call
//! first makes the context current on the calling thread, so handles can be used from any thread.
//!
//! **Memory.** Allocations come from a memory pool made for this device (`cuMemPoolCreate`, not the device's
//! default pool, whose settings other libraries in the process share), stream-ordered on the handle's stream
//! (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync`). The pool's release threshold is `u64::MAX`: memory freed
//! returns to the pool and **stays reserved** for later allocations of any handle of this device (reuse across
//! streams follows the stream order or the driver's own dependencies); the pool gives memory back to the driver
//! only when asked: [`Device::trim`] (`cuMemPoolTrimTo(0)` after a context synchronise, so that pending frees
//! have landed), and once automatically when an allocation fails with `CUDA_ERROR_OUT_OF_MEMORY` (trim, then one
//! retry; a second failure is `KernelError::OutOfMemory` with the free memory `cuMemGetInfo` reports; an
//! allocation larger than the device's whole memory fails the same way without asking the driver).
//! [`Device::memory_stats`] reads the pool's used/reserved current/high attributes. Allocations are checked to
//! be 256-byte aligned, as the seam promises.
//!
//! **Copies.** `cuMemcpyHtoDAsync` from pageable memory is not guaranteed to be done with the source when it
//! returns: the driver API's "API synchronization behavior" page says such a copy "might be synchronous", and
//! older releases said pageable sources are staged "asynchronously with a worker thread". So [`Device::upload`]
//! copies through two page-locked staging buffers of [`STAGING_BYTES`] per handle (allocated at the first
//! upload): each chunk is copied into a buffer by the CPU, then enqueued from it, and a buffer is refilled only
//! after the event recorded behind its last copy completed; when `upload` returns, `src` has been read entirely.
//! [`Device::download`] enqueues the copy on the stream and synchronises the stream.
//!
//! **Kernels.** A source is compiled by [`nvrtc`] for the device's exact `sm_XY` (or
//! `$LONGCTX_CUDA_ARCH`, e.g. `sm_90a` for `wgmma`) at the first launch of one of its kernels, as CUBIN, loaded
//! with `cuModuleLoadData` and kept for the context's life; each function is looked up once. Launches check the
//! arguments against the kernel's declaration: `cuFuncGetParamInfo` (driver ≥ 12.4) gives every parameter's size,
//! compared with [`KernelArgs::sizes`]; with an older driver the check is skipped. A launch asking more than
//! 48 KiB of dynamic shared memory first raises the function's `MAX_DYNAMIC_SHARED_SIZE_BYTES`. A refused launch
//! is `KernelError::Device` naming the kernel.
//!
//! **Checked launches.** With [`DriverOptions::checked`] (`LONGCTX_CUDA_SYNC=1`) every launch and product is
//! followed by a stream synchronise, so a fault is reported by the call that caused it, naming the kernel; tests
//! run this way. Without it a fault surfaces at the next synchronising call. A fault (illegal address, trap) is
//! sticky: the context is unusable afterwards and every later call fails.
//!
//! **Events.** [`Device::record_event`] events are made with `CU_EVENT_DISABLE_TIMING` (cheaper, ordering only);
//! [`DriverDevice::timing_event`] and [`elapsed_ms`] time with `CU_EVENT_DEFAULT` events, and [`Device::time`] is
//! the two around the work it times (an event without timing is refused by `cuEventElapsedTime` with
//! `CUDA_ERROR_INVALID_HANDLE`).

use std::any::Any;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use super::tensor_map::{TensorMap, TensorMapDesc};

use super::device::{
    Device, DeviceEvent, DeviceInfo, DevicePtr, Gemm, Kernel, KernelArgs, KernelSource, LaunchConfig, MemoryStats,
};
use super::gemm::{Blas, WORKSPACE_BYTES};
use super::libraries::{self, CudaLib};
use super::nvrtc;
use crate::error::{KernelError, Result};
use crate::view::Memory;

const BACKEND: &str = "cuda";

/// Bytes of each of the two page-locked buffers an upload is staged through.
pub(crate) const STAGING_BYTES: usize = 8 << 20;

/// Dynamic shared memory a launch may ask for without raising the function's limit.
const DEFAULT_DYNAMIC_SHARED: u32 = 48 << 10;

/// The alignment the seam promises for allocations.
const ALLOC_ALIGN: u64 = 256;

/// `name: description` of a driver error.
fn describe(e: DriverError) -> String {
    match (e.error_name(), e.error_string()) {
        (Ok(name), Ok(what)) => format!("{}: {}", name.to_string_lossy(), what.to_string_lossy()),
        _ => format!("{:?}", e.0),
    }
}

fn device_err(op: impl Into<String>, e: DriverError) -> KernelError {
    KernelError::Device { backend: BACKEND, op: op.into(), why: describe(e) }
}

/// Whether the loaded driver exports `name` (cudarc's bindings panic on a missing symbol, so functions newer than
/// the oldest driver we may meet are checked first).
fn driver_has(name: &str) -> bool {
    // SAFETY: only called once the driver is loaded (`DriverDevice::with_options` ensures it); looking a symbol
    // up calls nothing.
    unsafe { sys::culib().get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok()
}

/// How a [`DriverDevice`] runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct DriverOptions {
    /// Synchronise after every launch and product, so that a fault is reported by the call that caused it.
    pub checked: bool,
}

impl DriverOptions {
    /// `checked` when `LONGCTX_CUDA_SYNC=1`.
    pub fn from_env() -> Self {
        Self { checked: std::env::var("LONGCTX_CUDA_SYNC").as_deref() == Ok("1") }
    }
}

/// A loaded module and its functions.
struct Module {
    handle: sys::CUmodule,
    functions: Mutex<HashMap<&'static str, Arc<Function>>>,
}

/// One kernel of a loaded module.
struct Function {
    handle: sys::CUfunction,
    /// Each parameter's size as the kernel declares it; `None` when the driver cannot tell.
    params: Option<Vec<usize>>,
    /// The dynamic shared memory the function is allowed (raised on demand, never lowered).
    dynamic_shared: Mutex<u32>,
}

// SAFETY: module and function handles are usable from any thread once their context is current, which every use
// ensures; the mutable state is behind mutexes.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}
// SAFETY: as above.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

/// A module slot, filled at the first launch of one of the source's kernels.
type ModuleSlot = Arc<Mutex<Option<Arc<Module>>>>;

/// What a device and its forks share.
struct Shared {
    ordinal: usize,
    info: DeviceInfo,
    /// What sources are compiled for.
    arch: String,
    /// `cuDriverGetVersion` (e.g. 13000).
    driver_version: i32,
    /// `CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`.
    max_shared_optin: u32,
    checked: bool,
    pool: sys::CUmemoryPool,
    /// By source (file name and text address, so two sources never share a slot).
    modules: Mutex<HashMap<(&'static str, usize), ModuleSlot>>,
    blas: Mutex<Option<Arc<Blas>>>,
    /// Last, so that it is released after everything above is torn down.
    ctx: Arc<CudaContext>,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared").field("ordinal", &self.ordinal).field("arch", &self.arch).finish_non_exhaustive()
    }
}

impl Shared {
    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| device_err("binding the context to this thread", e))
    }

    /// The device's cuBLASLt, made at the first product.
    fn blas(&self) -> Result<Arc<Blas>> {
        let mut slot = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = &*slot {
            return Ok(b.clone());
        }
        let b = Arc::new(Blas::new()?);
        *slot = Some(b.clone());
        Ok(b)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Teardown cannot report errors; a failure here means the context is already broken, and the driver frees
        // everything of a context when it is released.
        let _ = self.ctx.bind_to_thread();
        drop(self.blas.get_mut().unwrap_or_else(|e| e.into_inner()).take());
        for slot in self.modules.get_mut().unwrap_or_else(|e| e.into_inner()).values() {
            if let Some(m) = slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
                // SAFETY: loaded by cuModuleLoadData in this context; no handle that could launch from it is left.
                let _ = unsafe { cu::module::unload(m.handle) };
            }
        }
        // SAFETY: made by cuMemPoolCreate; memory still allocated from it is released by the driver once freed.
        let _ = unsafe { cu::mem_pool::destroy(self.pool) };
    }
}

// SAFETY: the raw handles (pool, modules, functions) are usable from any thread once the context is current,
// which every use ensures; the mutable state is behind mutexes.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// Page-locked buffers uploads are staged through, with the event behind each one's last copy.
struct Staging {
    buffers: Vec<(*mut u8, sys::CUevent, bool)>,
    next: usize,
}

/// The CUDA driver's device (see the module docs).
pub(crate) struct DriverDevice {
    stream: sys::CUstream,
    staging: Mutex<Option<Staging>>,
    /// This stream's cuBLASLt workspace of [`WORKSPACE_BYTES`], allocated at the first product.
    workspace: Mutex<Option<DevicePtr>>,
    shared: Arc<Shared>,
}

// SAFETY: the stream and the staging buffers are usable from any thread once the context is current, which every
// method ensures; the mutable state is behind mutexes.
unsafe impl Send for DriverDevice {}
// SAFETY: as above.
unsafe impl Sync for DriverDevice {}

impl fmt::Debug for DriverDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DriverDevice")
            .field("ordinal", &self.shared.ordinal)
            .field("name", &self.shared.info.name)
            .field("arch", &self.shared.arch)
            .field("checked", &self.shared.checked)
            .finish_non_exhaustive()
    }
}

fn no_device(why: String) -> KernelError {
    KernelError::NoDevice { backend: BACKEND, why }
}

impl DriverDevice {
    /// Device `ordinal`, checked launches when `LONGCTX_CUDA_SYNC=1`.
    pub fn new(ordinal: usize) -> Result<Arc<Self>> {
        Self::with_options(ordinal, DriverOptions::from_env())
    }

    /// Device `ordinal` with `options`. No driver, a driver that fails to initialise, or no device of that ordinal
    /// is `KernelError::NoDevice` saying which; this never panics.
    pub fn with_options(ordinal: usize, options: DriverOptions) -> Result<Arc<Self>> {
        libraries::ensure(CudaLib::Driver).map_err(|e| no_device(e.to_string()))?;
        cu::init().map_err(|e| no_device(format!("the CUDA driver is present but cuInit failed: {}", describe(e))))?;
        let count = cu::device::get_count().map_err(|e| no_device(format!("cuDeviceGetCount: {}", describe(e))))?;
        if ordinal >= usize::try_from(count).unwrap_or(0) {
            return Err(no_device(format!("device {ordinal} was asked for; the driver reports {count} device(s)")));
        }
        // Retains the primary context and makes it current on this thread.
        let ctx =
            CudaContext::new(ordinal).map_err(|e| device_err(format!("retaining device {ordinal}'s context"), e))?;
        if !ctx.has_async_alloc() {
            return Err(no_device(format!("device {ordinal} has no stream-ordered memory pools")));
        }
        let attr = |a: sys::CUdevice_attribute| {
            ctx.attribute(a).map_err(|e| device_err(format!("cuDeviceGetAttribute({a:?})"), e))
        };
        use sys::CUdevice_attribute as A;
        let cc = (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32,
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32,
        );
        let info = DeviceInfo {
            name: ctx.name().map_err(|e| device_err("cuDeviceGetName", e))?,
            emulated: false,
            compute_capability: cc,
            multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
            total_memory: ctx.total_mem().map_err(|e| device_err("cuDeviceTotalMem", e))?,
        };
        let max_shared_optin = attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32;
        let mut driver_version = 0;
        // SAFETY: the driver is initialised; the pointer is valid for a write.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(|e| device_err("cuDriverGetVersion", e))?;
        let arch = match std::env::var("LONGCTX_CUDA_ARCH") {
            Ok(a) if !a.is_empty() => {
                nvrtc::check_arch(&a)?;
                a
            }
            _ => format!("sm_{}{}", cc.0, cc.1),
        };
        // SAFETY: the context is current (CudaContext::new binds it) and `ordinal` is a device of it.
        let pool = unsafe { create_pool(ordinal) }?;
        let shared = Arc::new(Shared {
            ordinal,
            info,
            arch,
            driver_version,
            max_shared_optin,
            checked: options.checked,
            pool,
            modules: Mutex::new(HashMap::new()),
            blas: Mutex::new(None),
            ctx,
        });
        Ok(Arc::new(Self::on_new_stream(shared)?))
    }

    /// A handle on a new non-blocking stream of `shared`'s context (non-blocking: no implicit ordering with the
    /// legacy default stream, which synchronous copies elsewhere in the process may use).
    fn on_new_stream(shared: Arc<Shared>) -> Result<Self> {
        shared.bind()?;
        let stream =
            cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| device_err("cuStreamCreate", e))?;
        Ok(Self { stream, staging: Mutex::new(None), workspace: Mutex::new(None), shared })
    }

    /// The same device on a new stream (what [`Device::fork`] returns, typed).
    pub fn fork_driver(&self) -> Result<Arc<Self>> {
        Ok(Arc::new(Self::on_new_stream(self.shared.clone())?))
    }

    /// `desc` encoded by the driver (`cuTensorMapEncodeTiled`) for this device's kernels to take as a
    /// `const __grid_constant__ CUtensorMap` parameter; a typed error naming the field when `desc` breaks the driver's
    /// documented rules (checked first), an error when the driver has no TMA (before CUDA 12).
    pub(crate) fn encode_tensor_map(&self, desc: &TensorMapDesc) -> Result<TensorMap> {
        self.shared.bind()?;
        if !driver_has("cuTensorMapEncodeTiled") {
            return Err(KernelError::Device {
                backend: BACKEND,
                op: "cuTensorMapEncodeTiled".to_string(),
                why: "the loaded CUDA driver does not export it (tensor maps need CUDA 12 or later)".to_string(),
            });
        }
        desc.encode_driver()
    }

    /// What kernels are compiled for (`sm_90`).
    pub fn arch(&self) -> &str {
        &self.shared.arch
    }

    /// `cuDriverGetVersion` (13000 for CUDA 13.0).
    pub fn driver_version(&self) -> i32 {
        self.shared.driver_version
    }

    /// Resets the pool's high-water marks (the driver only accepts zero; they count from there).
    pub fn reset_peak_memory(&self) -> Result<()> {
        self.shared.bind()?;
        for attr in [
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        ] {
            // The only value these attributes accept is 0, which resets them.
            let mut zero: u64 = 0;
            // SAFETY: a live pool; the attribute is a cuuint64_t.
            unsafe { cu::mem_pool::set_attribute(self.shared.pool, attr, (&mut zero as *mut u64).cast()) }
                .map_err(|e| device_err(format!("cuMemPoolSetAttribute({attr:?})"), e))?;
        }
        Ok(())
    }

    /// An event that records when the work enqueued so far has run, with timing (`CU_EVENT_DEFAULT`), for
    /// [`elapsed_ms`].
    pub fn timing_event(&self) -> Result<TimingEvent> {
        Ok(TimingEvent(self.recorded_event(true)?))
    }

    /// An event recorded on this stream now: with timing (`CU_EVENT_DEFAULT`) when `timed`, else without
    /// (`CU_EVENT_DISABLE_TIMING`, cheaper to record and wait for; the driver refuses to time it).
    fn recorded_event(&self, timed: bool) -> Result<DriverEvent> {
        self.shared.bind()?;
        let flags =
            if timed { sys::CUevent_flags::CU_EVENT_DEFAULT } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING };
        let event = cu::event::create(flags).map_err(|e| device_err("cuEventCreate", e))?;
        let event = DriverEvent { event, shared: self.shared.clone(), timed };
        // SAFETY: a live event and stream of the current context.
        unsafe { cu::event::record(event.event, self.stream) }.map_err(|e| device_err("cuEventRecord", e))?;
        Ok(event)
    }

    fn synchronize_stream(&self, op: &str) -> Result<()> {
        // SAFETY: a live stream of the current context.
        unsafe { cu::stream::synchronize(self.stream) }.map_err(|e| device_err(op, e))
    }

    /// With checked launches, waits for `op` to have run and reports its fault.
    fn check(&self, op: &str) -> Result<()> {
        if !self.shared.checked {
            return Ok(());
        }
        // SAFETY: as in `synchronize_stream`.
        unsafe { cu::stream::synchronize(self.stream) }.map_err(|e| KernelError::Device {
            backend: BACKEND,
            op: op.to_string(),
            why: format!("failed while running (checked: synchronised after the launch): {}", describe(e)),
        })
    }

    /// The function `kernel`, its source compiled and loaded at the first call.
    fn function(&self, kernel: &Kernel) -> Result<Arc<Function>> {
        let src = kernel.source;
        let slot = {
            let mut modules = self.shared.modules.lock().unwrap_or_else(|e| e.into_inner());
            modules.entry((src.file, src.code.as_ptr() as usize)).or_default().clone()
        };
        let module = {
            let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
            match &*slot {
                Some(m) => m.clone(),
                None => {
                    let m = Arc::new(self.load_module(src)?);
                    *slot = Some(m.clone());
                    m
                }
            }
        };
        let mut functions = module.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = functions.get(kernel.name) {
            return Ok(f.clone());
        }
        let name = CString::new(kernel.name).map_err(|_| KernelError::InvalidArgument {
            name: "kernel",
            why: format!("`{}` has a NUL byte", kernel.name),
        })?;
        // SAFETY: a module loaded in this context, which is current.
        let handle = unsafe { cu::module::get_function(module.handle, name) }.map_err(|e| KernelError::Device {
            backend: BACKEND,
            op: kernel.name.to_string(),
            why: format!("not a kernel of {} ({})", src.file, describe(e)),
        })?;
        // SAFETY: a function of a loaded module.
        let params = unsafe { param_sizes(handle) };
        let f = Arc::new(Function { handle, params, dynamic_shared: Mutex::new(DEFAULT_DYNAMIC_SHARED) });
        functions.insert(kernel.name, f.clone());
        Ok(f)
    }

    fn load_module(&self, src: &KernelSource) -> Result<Module> {
        let arch = nvrtc::arch_for(src, &self.shared.arch)?;
        let compiled = nvrtc::compile(src, &arch)?;
        // The image is parsed as ELF; give it the 8-byte alignment its headers have in a file.
        let mut image = vec![0u64; compiled.cubin.len().div_ceil(8)];
        // SAFETY: `image` has at least `cubin.len()` bytes; the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                compiled.cubin.as_ptr(),
                image.as_mut_ptr().cast::<u8>(),
                compiled.cubin.len(),
            )
        };
        // SAFETY: the context is current (the caller bound it); the image is a CUBIN for this device's
        // architecture, read only during the call.
        let handle = unsafe { cu::module::load_data(image.as_ptr().cast::<c_void>()) }.map_err(|e| {
            let nvrtc = nvrtc::nvrtc_version().map(|(a, b)| format!("{a}.{b}")).unwrap_or_else(|e| e);
            KernelError::Device {
                backend: BACKEND,
                op: format!("loading {} compiled for {arch}", src.file),
                why: format!(
                    "{} (the driver supports CUDA {}.{}; the module was compiled by NVRTC {nvrtc})",
                    describe(e),
                    self.shared.driver_version / 1000,
                    self.shared.driver_version % 1000 / 10
                ),
            }
        })?;
        Ok(Module { handle, functions: Mutex::new(HashMap::new()) })
    }

    /// Allocates `bytes` on this stream, from the pool.
    fn alloc_once(&self, bytes: usize) -> std::result::Result<DevicePtr, DriverError> {
        // SAFETY: a live pool and stream of the current context.
        unsafe { cu::mem_pool::alloc_async(self.shared.pool, bytes, self.stream) }
    }

    /// The staging buffers, made at the first upload.
    fn staging<'a>(&self, slot: &'a mut Option<Staging>) -> Result<&'a mut Staging> {
        let staging = match slot.take() {
            Some(s) => s,
            None => {
                let mut buffers: Vec<(*mut u8, sys::CUevent, bool)> = Vec::new();
                let release = |buffers: Vec<(*mut u8, sys::CUevent, bool)>| {
                    for (ptr, event, _) in buffers {
                        // SAFETY: made below and never used.
                        unsafe {
                            let _ = cu::free_host(ptr.cast());
                            let _ = cu::event::destroy(event);
                        }
                    }
                };
                for _ in 0..2 {
                    // Flags 0: ordinary (cached, not write-combined) page-locked memory.
                    // SAFETY: the context is current; the size is non-zero.
                    let ptr = match unsafe { cu::malloc_host(STAGING_BYTES, 0) } {
                        Ok(p) => p.cast::<u8>(),
                        Err(e) => {
                            release(buffers);
                            return Err(device_err("cuMemHostAlloc", e));
                        }
                    };
                    match cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) {
                        Ok(event) => buffers.push((ptr, event, false)),
                        Err(e) => {
                            // SAFETY: just allocated, unused.
                            let _ = unsafe { cu::free_host(ptr.cast()) };
                            release(buffers);
                            return Err(device_err("cuEventCreate", e));
                        }
                    }
                }
                Staging { buffers, next: 0 }
            }
        };
        Ok(slot.insert(staging))
    }
}

/// Each parameter's size as `f` declares it, or `None` when the driver cannot tell (older than 12.4).
///
/// # Safety
/// `f` is a function of a loaded module; its context is current.
unsafe fn param_sizes(f: sys::CUfunction) -> Option<Vec<usize>> {
    if !driver_has("cuFuncGetParamInfo") {
        return None;
    }
    let mut sizes = Vec::new();
    // A kernel's parameters take at most 32 KiB, so this bound is never reached by a real kernel.
    for index in 0..32768 {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: `f` is live (the caller); both pointers are valid for writes.
        match unsafe { sys::cuFuncGetParamInfo(f, index, &mut offset, &mut size) } {
            sys::CUresult::CUDA_SUCCESS => sizes.push(size),
            // Past the last parameter the driver answers "invalid value" (how PyTorch and LLVM's offload count
            // them too).
            sys::CUresult::CUDA_ERROR_INVALID_VALUE => return Some(sizes),
            _ => return None,
        }
    }
    None
}

/// A pool for device `ordinal` that keeps freed memory (release threshold `u64::MAX`).
///
/// # Safety
/// The device's context is current.
unsafe fn create_pool(ordinal: usize) -> Result<sys::CUmemoryPool> {
    // SAFETY: CUmemPoolProps is plain data whose all-zero value is valid (enums with a 0 variant, null pointer).
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = ordinal as i32;
    // SAFETY: `props` is a valid CUmemPoolProps (maxSize 0: the driver's default limit).
    let pool = unsafe { cu::mem_pool::create(&props) }.map_err(|e| device_err("cuMemPoolCreate", e))?;
    let mut keep_all: u64 = u64::MAX;
    // SAFETY: a live pool; RELEASE_THRESHOLD is a cuuint64_t.
    let set = unsafe {
        cu::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep_all as *mut u64).cast(),
        )
    };
    if let Err(e) = set {
        // SAFETY: made above, nothing allocated from it.
        let _ = unsafe { cu::mem_pool::destroy(pool) };
        return Err(device_err("cuMemPoolSetAttribute(RELEASE_THRESHOLD)", e));
    }
    Ok(pool)
}

impl Drop for DriverDevice {
    fn drop(&mut self) {
        // Teardown cannot report errors (see `Shared`'s drop).
        let _ = self.shared.bind();
        if let Some(ws) = self.workspace.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            // SAFETY: allocated on this stream; the products using it were enqueued before this free.
            let _ = unsafe { cu::free_async(ws, self.stream) };
        }
        // Pending copies may still read the staging buffers, and the stream must be idle before it is destroyed
        // for its pending frees to be ordered.
        let _ = self.synchronize_stream("dropping the device");
        if let Some(staging) = self.staging.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            for (ptr, event, _) in staging.buffers {
                // SAFETY: allocated by cuMemHostAlloc and created by cuEventCreate; the stream is idle.
                unsafe {
                    let _ = cu::free_host(ptr.cast());
                    let _ = cu::event::destroy(event);
                }
            }
        }
        // SAFETY: created by cuStreamCreate, destroyed once.
        let _ = unsafe { cu::stream::destroy(self.stream) };
    }
}

impl Device for DriverDevice {
    fn memory(&self) -> Memory {
        Memory::Cuda { ordinal: self.shared.ordinal }
    }

    fn info(&self) -> &DeviceInfo {
        &self.shared.info
    }

    fn alloc(&self, bytes: usize) -> Result<DevicePtr> {
        self.shared.bind()?;
        let out_of_memory = || {
            let free = cu::mem_get_info().map(|(free, _)| free).unwrap_or(0);
            KernelError::OutOfMemory { memory: self.memory(), bytes, free }
        };
        if bytes > self.shared.info.total_memory {
            // No trim can make room; the driver is not asked.
            return Err(out_of_memory());
        }
        // The driver refuses 0 bytes; a 1-byte allocation keeps `free` uniform.
        let size = bytes.max(1);
        let ptr = match self.alloc_once(size) {
            Ok(p) => p,
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                // Let every stream's pending frees land, give the pool's reserve back, and try once more.
                self.shared.ctx.synchronize().map_err(|e| device_err("synchronising before trimming the pool", e))?;
                // SAFETY: a live pool.
                unsafe { cu::mem_pool::trim_to(self.shared.pool, 0) }.map_err(|e| device_err("cuMemPoolTrimTo", e))?;
                match self.alloc_once(size) {
                    Ok(p) => p,
                    Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => return Err(out_of_memory()),
                    Err(e) => return Err(device_err("cuMemAllocFromPoolAsync", e)),
                }
            }
            Err(e) => return Err(device_err("cuMemAllocFromPoolAsync", e)),
        };
        if !ptr.is_multiple_of(ALLOC_ALIGN) {
            // SAFETY: just allocated on this stream, unused.
            let _ = unsafe { cu::free_async(ptr, self.stream) };
            return Err(KernelError::Device {
                backend: BACKEND,
                op: "cuMemAllocFromPoolAsync".to_string(),
                why: format!("returned {ptr:#x}, not {ALLOC_ALIGN}-byte aligned as the backend assumes"),
            });
        }
        Ok(ptr)
    }

    unsafe fn free(&self, ptr: DevicePtr) {
        // A failure means the context is broken; the next synchronising call reports that.
        if self.shared.bind().is_ok() {
            // SAFETY: the caller guarantees `ptr` came from `alloc` of this device and is not used afterwards.
            let _ = unsafe { cu::free_async(ptr, self.stream) };
        }
    }

    unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        self.shared.bind()?;
        // SAFETY: the caller's contract: host memory of this process, mapped until unregistered.
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) }
            .result()
            .map_err(|e| device_err(format!("cuMemHostRegister of {len} bytes"), e))?;
        pinned::insert(ptr as usize, len);
        Ok(())
    }

    unsafe fn unregister_host(&self, ptr: *mut u8, _len: usize) {
        pinned::remove(ptr as usize);
        if self.shared.bind().is_ok() {
            // SAFETY: registered by `register_host` (the caller's contract), no copy uses it any more.
            let _ = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
        }
    }

    unsafe fn upload(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.shared.bind()?;
        if pinned::contains(src.as_ptr() as usize, src.len()) {
            // Registered memory (a host tier's buffer): one copy by DMA, straight from it; done when the stream
            // has run it, which is when `src` may change.
            // SAFETY: `src` is page-locked and valid until the synchronise below; the caller guarantees `dst`.
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast::<c_void>(), src.len(), self.stream) }
                .result()
                .map_err(|e| device_err("upload from registered memory (cuMemcpyHtoDAsync)", e))?;
            return self.synchronize_stream("upload from registered memory");
        }
        let mut slot = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let staging = self.staging(&mut slot)?;
        for (i, chunk) in src.chunks(STAGING_BYTES).enumerate() {
            let which = staging.next;
            staging.next = (staging.next + 1) % staging.buffers.len();
            let (buf, event, pending) = &mut staging.buffers[which];
            if *pending {
                // SAFETY: a live event of this context.
                unsafe { cu::event::synchronize(*event) }.map_err(|e| device_err("upload", e))?;
                *pending = false;
            }
            // SAFETY: `buf` holds STAGING_BYTES ≥ chunk.len() bytes and no copy reads it (its event completed).
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), *buf, chunk.len()) };
            let at = dst + (i * STAGING_BYTES) as u64;
            // SAFETY: page-locked source valid until the event below completes; the caller guarantees `dst`.
            unsafe { sys::cuMemcpyHtoDAsync_v2(at, buf.cast::<c_void>(), chunk.len(), self.stream) }
                .result()
                .map_err(|e| device_err("upload (cuMemcpyHtoDAsync)", e))?;
            // SAFETY: a live event and stream of this context.
            unsafe { cu::event::record(*event, self.stream) }.map_err(|e| device_err("upload (cuEventRecord)", e))?;
            *pending = true;
        }
        Ok(())
    }

    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.shared.bind()?;
        // SAFETY: `dst` is valid for writes of its length until the synchronise below returns; the caller
        // guarantees `src`.
        unsafe { cu::memcpy_dtoh_async(dst, src, self.stream) }.map_err(|e| device_err("download", e))?;
        self.synchronize_stream("download")
    }

    unsafe fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.shared.bind()?;
        // SAFETY: the caller guarantees both ranges.
        unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.stream) }.map_err(|e| device_err("copy", e))?;
        self.check("copy")
    }

    unsafe fn memset32(&self, dst: DevicePtr, value: u32, count: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        if !dst.is_multiple_of(4) {
            return Err(KernelError::InvalidArgument {
                name: "dst",
                why: format!("{dst:#x} is not 4-byte aligned for 32-bit words"),
            });
        }
        self.shared.bind()?;
        // SAFETY: the caller guarantees `count` words at `dst`.
        unsafe { sys::cuMemsetD32Async(dst, value, count, self.stream) }
            .result()
            .map_err(|e| device_err("memset32", e))?;
        self.check("memset32")
    }

    unsafe fn launch(&self, kernel: &Kernel, cfg: &LaunchConfig, args: &KernelArgs) -> Result<()> {
        self.shared.bind()?;
        let refused = |why: String| KernelError::Device { backend: BACKEND, op: kernel.name.to_string(), why };
        if cfg.grid.contains(&0) || cfg.block.contains(&0) {
            return Err(refused(format!("empty launch: grid {:?}, block {:?}", cfg.grid, cfg.block)));
        }
        let f = self.function(kernel)?;
        if let Some(declared) = &f.params {
            if declared.as_slice() != args.sizes() {
                return Err(refused(format!(
                    "the kernel declares parameters of {declared:?} bytes, the launch passes {:?}",
                    args.sizes()
                )));
            }
        }
        if cfg.shared_bytes > DEFAULT_DYNAMIC_SHARED {
            let mut allowed = f.dynamic_shared.lock().unwrap_or_else(|e| e.into_inner());
            if cfg.shared_bytes > *allowed {
                if cfg.shared_bytes > self.shared.max_shared_optin {
                    return Err(refused(format!(
                        "{} bytes of dynamic shared memory asked; the device allows {} per block",
                        cfg.shared_bytes, self.shared.max_shared_optin
                    )));
                }
                // SAFETY: a live function of the current context.
                unsafe {
                    cu::function::set_function_attribute(
                        f.handle,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        cfg.shared_bytes as i32,
                    )
                }
                .map_err(|e| {
                    refused(format!(
                        "raising its dynamic shared memory to {} bytes: {} (the kernel's static shared memory \
                         counts against the device's {} bytes)",
                        cfg.shared_bytes,
                        describe(e),
                        self.shared.max_shared_optin
                    ))
                })?;
                *allowed = cfg.shared_bytes;
            }
        }
        // The driver reads every parameter during the call, so a copy whose addresses live until it returns is
        // enough.
        let args = args.clone();
        let mut params = args.pointers();
        let params_ptr = if params.is_empty() { std::ptr::null_mut() } else { params.as_mut_ptr() };
        // SAFETY: `f` is a loaded function of the current context; `params_ptr` points to one valid address per
        // declared parameter (sizes checked above where the driver can tell); the caller guarantees the device
        // addresses among them.
        unsafe {
            sys::cuLaunchKernel(
                f.handle,
                cfg.grid[0],
                cfg.grid[1],
                cfg.grid[2],
                cfg.block[0],
                cfg.block[1],
                cfg.block[2],
                cfg.shared_bytes,
                self.stream,
                params_ptr,
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| {
            refused(format!(
                "launch refused (grid {:?}, block {:?}, {} bytes of shared memory): {}",
                cfg.grid,
                cfg.block,
                cfg.shared_bytes,
                describe(e)
            ))
        })?;
        self.check(kernel.name)
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<()> {
        self.shared.bind()?;
        let blas = self.shared.blas()?;
        let workspace = {
            let mut ws = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
            match *ws {
                Some(p) => p,
                None => {
                    let p = self.alloc(WORKSPACE_BYTES)?;
                    *ws = Some(p);
                    p
                }
            }
        };
        // SAFETY: the context is current; the stream is this handle's; the workspace is this stream's alone; the
        // caller guarantees `g`'s addresses.
        unsafe { blas.matmul(g, self.stream, workspace, WORKSPACE_BYTES) }?;
        self.check("cublasLtMatmul")
    }

    fn synchronize(&self) -> Result<()> {
        self.shared.bind()?;
        self.synchronize_stream("synchronize")
    }

    fn record_event(&self) -> Result<Arc<dyn DeviceEvent>> {
        Ok(Arc::new(self.recorded_event(false)?))
    }

    fn record_timed_event(&self) -> Result<Arc<dyn DeviceEvent>> {
        Ok(Arc::new(self.recorded_event(true)?))
    }

    fn wait_event(&self, event: &dyn DeviceEvent) -> Result<()> {
        let Some(ev) = event.as_any().downcast_ref::<DriverEvent>() else {
            return Err(KernelError::InvalidArgument {
                name: "event",
                why: format!("{event:?} was not recorded by a CUDA driver device"),
            });
        };
        if !Arc::ptr_eq(&ev.shared, &self.shared) {
            return Err(KernelError::InvalidArgument {
                name: "event",
                why: "recorded on another device (only this device and its forks share events)".to_string(),
            });
        }
        self.shared.bind()?;
        // SAFETY: a live stream and event of the current context.
        unsafe { cu::stream::wait_event(self.stream, ev.event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| device_err("cuStreamWaitEvent", e))
    }

    fn fork(&self) -> Result<Arc<dyn Device>> {
        Ok(self.fork_driver()?)
    }

    fn tensor_map(&self, desc: &TensorMapDesc) -> Result<TensorMap> {
        self.encode_tensor_map(desc)
    }

    fn compile_kernels(&self) -> Result<()> {
        nvrtc::compile_all(&self.shared.arch).map(|_| ())
    }

    fn time(&self, work: &mut dyn FnMut() -> Result<()>) -> Result<Duration> {
        let start = self.timing_event()?;
        work()?;
        let end = self.timing_event()?;
        let ms = elapsed_ms(&start, &end)?;
        // The driver's milliseconds are an f32 that is never negative for events recorded in order on one stream;
        // a value that is not a duration is reported rather than turned into a panic.
        Duration::try_from_secs_f64(f64::from(ms) / 1e3).map_err(|_| KernelError::Device {
            backend: BACKEND,
            op: "time".to_string(),
            why: format!("cuEventElapsedTime_v2 gave {ms} ms"),
        })
    }

    fn memory_stats(&self) -> MemoryStats {
        if self.shared.bind().is_err() {
            return MemoryStats::default();
        }
        let get = |attr: sys::CUmemPool_attribute| -> usize {
            let mut v: u64 = 0;
            // SAFETY: a live pool; these attributes are cuuint64_t.
            match unsafe { cu::mem_pool::get_attribute(self.shared.pool, attr, (&mut v as *mut u64).cast()) } {
                Ok(()) => v as usize,
                Err(_) => 0,
            }
        };
        use sys::CUmemPool_attribute as P;
        MemoryStats {
            used: get(P::CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
            used_high: get(P::CU_MEMPOOL_ATTR_USED_MEM_HIGH),
            reserved: get(P::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
            reserved_high: get(P::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH),
        }
    }

    fn trim(&self) -> Result<()> {
        self.shared.bind()?;
        // Frees still pending on any stream would keep their memory; let them land first.
        self.shared.ctx.synchronize().map_err(|e| device_err("synchronising before trimming the pool", e))?;
        // SAFETY: a live pool.
        unsafe { cu::mem_pool::trim_to(self.shared.pool, 0) }.map_err(|e| device_err("cuMemPoolTrimTo", e))
    }
}

/// An ordering event ([`Device::record_event`]).
pub(crate) struct DriverEvent {
    event: sys::CUevent,
    shared: Arc<Shared>,
    /// Made with timing (`CU_EVENT_DEFAULT`).
    timed: bool,
}

// SAFETY: an event handle is usable from any thread once its context is current, which every use ensures.
unsafe impl Send for DriverEvent {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for DriverEvent {}

impl fmt::Debug for DriverEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DriverEvent(cuda:{})", self.shared.ordinal)
    }
}

impl DeviceEvent for DriverEvent {
    fn synchronize(&self) -> Result<()> {
        self.shared.bind()?;
        // SAFETY: a live event of the current context.
        unsafe { cu::event::synchronize(self.event) }.map_err(|e| device_err("cuEventSynchronize", e))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn elapsed_since(&self, earlier: &dyn DeviceEvent) -> Result<Option<Duration>> {
        match earlier.as_any().downcast_ref::<DriverEvent>() {
            Some(start) if start.timed && self.timed => {
                let ms = elapsed_between(start, self)?;
                Ok(Duration::try_from_secs_f64(f64::from(ms) / 1e3).ok())
            }
            _ => Ok(None),
        }
    }
}

impl Drop for DriverEvent {
    fn drop(&mut self) {
        let _ = self.shared.bind();
        // SAFETY: created by cuEventCreate, destroyed once; an event not yet complete is released by the driver
        // once it completes (cuEventDestroy docs).
        let _ = unsafe { cu::event::destroy(self.event) };
    }
}

/// A timing event ([`DriverDevice::timing_event`]).
#[derive(Debug)]
pub(crate) struct TimingEvent(DriverEvent);

impl TimingEvent {
    /// Blocks until the event is complete.
    pub fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }
}

/// Milliseconds between `start` and `end` (both recorded, `end` after `start`); waits for `end`.
pub(crate) fn elapsed_ms(start: &TimingEvent, end: &TimingEvent) -> Result<f32> {
    elapsed_between(&start.0, &end.0)
}

/// Milliseconds between two timed events of one context, `end` recorded after `start`; waits for `end`.
fn elapsed_between(start: &DriverEvent, end: &DriverEvent) -> Result<f32> {
    end.synchronize()?;
    // CUDA 13's name for it (12.8 added it); a driver without it is older than the CUDA 13 modules this backend
    // compiles need, so there is no fallback to the first version.
    if !driver_has("cuEventElapsedTime_v2") {
        return Err(KernelError::Device {
            backend: BACKEND,
            op: "elapsed_ms".to_string(),
            why: "the driver has no cuEventElapsedTime_v2 (CUDA 12.8 or later)".to_string(),
        });
    }
    // SAFETY: both events are live timing events of this context, current since `synchronize`; `end` is
    // complete, and `start` was recorded before it on the stream.
    unsafe { cu::event::elapsed(start.event, end.event) }.map_err(|e| device_err("cuEventElapsedTime_v2", e))
}

/// The host ranges registered through [`Device::register_host`] in this process (by any device handle: a
/// portable registration holds for every context), so that an upload knows when its source needs no staging.
mod pinned {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    static RANGES: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

    pub(super) fn insert(start: usize, len: usize) {
        RANGES.lock().unwrap_or_else(|e| e.into_inner()).insert(start, len);
    }

    pub(super) fn remove(start: usize) {
        RANGES.lock().unwrap_or_else(|e| e.into_inner()).remove(&start);
    }

    /// Whether `len` bytes from `start` lie within one registered range.
    pub(super) fn contains(start: usize, len: usize) -> bool {
        within(&RANGES.lock().unwrap_or_else(|e| e.into_inner()), start, len)
    }

    pub(super) fn within(ranges: &BTreeMap<usize, usize>, start: usize, len: usize) -> bool {
        ranges.range(..=start).next_back().is_some_and(|(&s, &l)| start.checked_add(len).is_some_and(|e| e <= s + l))
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn a_range_is_pinned_only_within_one_registration() {
            let ranges = [(4096, 8192), (65536, 4096)].into_iter().collect();
            for (start, len, want) in [
                (4096, 8192, true),
                (8192, 100, true),
                (4095, 10, false),
                (12000, 300, false),
                (12288, 1, false),
                (65536, 4096, true),
                (0, 1, false),
                (usize::MAX - 1, 8, false),
            ] {
                assert_eq!(super::within(&ranges, start, len), want, "{len} bytes at {start}");
            }
        }
    }
}

#[cfg(test)]
mod tests;
