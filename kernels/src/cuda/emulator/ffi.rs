//! The C ABI between the emulator's Rust side and its runtime (runtime.cpp, emu.h): the structures both lay out and
//! the functions every unit library exports. Both sides are built from this crate's text, so only the constants that
//! tie the layouts to Rust's memory management ([`ABI_VERSION`], the fiber region size) are checked at load time.

use std::ffi::{c_char, c_int, c_uint, c_ulong, c_void};

/// `emu::kAbiVersion` in runtime.cpp.
pub(super) const ABI_VERSION: u32 = 1;
/// `emu::kFiberRegionBytes` in emu.h: each CUDA thread's region (header, guard page, stack), aligned to its size.
pub(super) const FIBER_REGION_BYTES: usize = 256 * 1024;
/// `emu::kFiberHeaderBytes` in emu.h: the header at the bottom of each region, below the guard page.
pub(super) const FIBER_HEADER_BYTES: usize = 16 * 1024;

/// `LongctxEmuLaunch`: one launch, read by every worker.
#[repr(C)]
pub(super) struct EmuLaunch {
    pub kernel: unsafe extern "C" fn(*mut *mut c_void),
    pub args: *mut *mut c_void,
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
    pub shared_bytes: c_uint,
    pub nblocks: u64,
    /// The next block index to run (atomic, shared by the workers).
    pub next_block: *mut u64,
    /// Set by the first worker that fails (atomic).
    pub abort: *mut c_int,
}

/// `LongctxEmuWorker`: what one OS thread running blocks owns.
#[repr(C)]
pub(super) struct EmuWorker {
    /// `nregions` fiber regions of [`FIBER_REGION_BYTES`], aligned to it.
    pub regions: *mut u8,
    pub nregions: u64,
    /// The block's dynamic shared memory with its guards.
    pub dyn_smem: *mut u8,
    pub dyn_capacity: u64,
}

/// `LongctxEmuAbi`: what a unit library says about itself.
#[repr(C)]
#[derive(Default)]
pub(super) struct EmuAbi {
    pub version: c_uint,
    pub fiber_region_bytes: c_uint,
    pub fiber_header_bytes: c_uint,
    pub dyn_guard_bytes: c_uint,
    /// The unit's `__shared__` variables (its TLS segment), bytes.
    pub static_smem_bytes: u64,
}

/// `emu::KernelEntry`: one kernel of a unit's registry.
#[repr(C)]
pub(super) struct EmuKernelEntry {
    pub name: *const c_char,
    pub launch: unsafe extern "C" fn(*mut *mut c_void),
    pub nparams: c_uint,
    pub sizes: *const c_ulong,
    pub types: *const *const c_char,
}

/// `longctx_emu_abi`.
pub(super) type AbiFn = unsafe extern "C" fn(*mut EmuAbi);
/// `longctx_emu_kernels`: the registry and its length.
pub(super) type KernelsFn = unsafe extern "C" fn(*mut c_uint) -> *const EmuKernelEntry;
/// `longctx_emu_run`: runs blocks until none are left; 0, or 1 with a message.
pub(super) type RunFn = unsafe extern "C" fn(*const EmuLaunch, *const EmuWorker, *mut c_char, usize) -> c_int;
