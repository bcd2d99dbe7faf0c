//! Running one launch: the checks the GPU's driver makes before it accepts a launch, and the workers (OS threads)
//! that run its blocks, each with its fiber regions and a dynamic shared memory buffer, kept between launches.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicI32, AtomicU64};

use super::compile::{KernelInfo, Library};
use super::ffi::{EmuLaunch, EmuWorker, FIBER_HEADER_BYTES, FIBER_REGION_BYTES};
use super::memory::BACKEND;
use crate::cuda::device::LaunchConfig;
use crate::error::{KernelError, Result};

/// Threads per block (every architecture since sm_20).
pub(super) const MAX_THREADS_PER_BLOCK: u64 = 1024;
/// Block dimensions.
pub(super) const MAX_BLOCK: [u32; 3] = [1024, 1024, 64];
/// Grid dimensions.
pub(super) const MAX_GRID: [u32; 3] = [i32::MAX as u32, 65535, 65535];
/// Shared memory per block, static and dynamic together, on sm_90 (H100/H200: 227 KiB; sm_80 has 163 KiB). More than
/// 48 KiB of dynamic shared memory also needs the kernel's `MAX_DYNAMIC_SHARED_SIZE_BYTES` attribute on the GPU.
pub(super) const MAX_SHARED_BYTES: u64 = 227 * 1024;
/// Static (`__shared__`) memory per block: 48 KiB on every architecture.
pub(super) const MAX_STATIC_SHARED_BYTES: u64 = 48 * 1024;

pub(super) fn launch_error(kernel: &str, why: String) -> KernelError {
    KernelError::Device { backend: BACKEND, op: format!("launch of `{kernel}`"), why }
}

/// Refuses what `cuLaunchKernel` refuses: empty or oversized grids and blocks, too much shared memory.
pub(super) fn check_config(kernel: &str, cfg: &LaunchConfig, static_smem: usize) -> Result<()> {
    let err = |why: String| Err(launch_error(kernel, why));
    for (i, axis) in ["x", "y", "z"].into_iter().enumerate() {
        let (g, b) = (cfg.grid[i], cfg.block[i]);
        if g == 0 || b == 0 {
            return err(format!("grid {:?} and block {:?}: every dimension must be at least 1", cfg.grid, cfg.block));
        }
        if g > MAX_GRID[i] {
            return err(format!("grid.{axis} = {g} is more than the limit {}", MAX_GRID[i]));
        }
        if b > MAX_BLOCK[i] {
            return err(format!("block.{axis} = {b} is more than the limit {}", MAX_BLOCK[i]));
        }
    }
    let threads: u64 = cfg.block.iter().map(|&b| u64::from(b)).product();
    if threads > MAX_THREADS_PER_BLOCK {
        return err(format!(
            "a block of {threads} threads ({:?}) is more than the limit of {MAX_THREADS_PER_BLOCK}",
            cfg.block
        ));
    }
    if static_smem as u64 > MAX_STATIC_SHARED_BYTES {
        return err(format!(
            "the kernel's __shared__ variables take {static_smem} bytes, more than the limit of {MAX_STATIC_SHARED_BYTES}"
        ));
    }
    if static_smem as u64 + u64::from(cfg.shared_bytes) > MAX_SHARED_BYTES {
        return err(format!(
            "{} bytes of dynamic shared memory and {static_smem} of static are more than the limit of {MAX_SHARED_BYTES} \
             per block",
            cfg.shared_bytes
        ));
    }
    Ok(())
}

/// Refuses arguments whose count or sizes differ from the kernel's parameters.
pub(super) fn check_args(info: &KernelInfo, sizes: &[usize]) -> Result<()> {
    if sizes.len() != info.sizes.len() {
        return Err(launch_error(
            &info.name,
            format!(
                "{} arguments given, the kernel has {} parameters ({})",
                sizes.len(),
                info.sizes.len(),
                info.types.join(", ")
            ),
        ));
    }
    for (i, (&got, &want)) in sizes.iter().zip(&info.sizes).enumerate() {
        if got != want {
            return Err(launch_error(
                &info.name,
                format!("argument {i} is {got} bytes, but parameter {i} is `{}` of {want} bytes", info.types[i]),
            ));
        }
    }
    Ok(())
}

/// The fiber regions of one worker: `count` regions of [`FIBER_REGION_BYTES`], aligned to it, each with a guard
/// page (no access) between its header and its stack. Mapped without reserving swap; a fiber touches only the pages
/// its stack uses.
struct FiberRegions {
    map: *mut c_void,
    map_len: usize,
    regions: *mut u8,
    count: usize,
}

// SAFETY: the mapping is owned by this value alone; the worker using it runs on one thread at a time.
unsafe impl Send for FiberRegions {}

impl FiberRegions {
    fn new(count: usize) -> Result<Self> {
        let err = |what: &str| KernelError::Device {
            backend: BACKEND,
            op: "fiber stacks".into(),
            why: format!("{what} for {count} fibers failed: {}", std::io::Error::last_os_error()),
        };
        let map_len = (count + 1) * FIBER_REGION_BYTES;
        // SAFETY: an anonymous private mapping; the result is checked.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(err("mmap"));
        }
        let regions = ((map as usize).next_multiple_of(FIBER_REGION_BYTES)) as *mut u8;
        let me = Self { map, map_len, regions, count };
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let guard = FIBER_HEADER_BYTES.next_multiple_of(page);
        for i in 0..count {
            // SAFETY: the guard page lies inside region i, inside the mapping.
            let rc =
                unsafe { libc::mprotect(me.regions.add(i * FIBER_REGION_BYTES + guard).cast(), page, libc::PROT_NONE) };
            if rc != 0 {
                return Err(err("mprotect"));
            }
        }
        Ok(me)
    }
}

impl Drop for FiberRegions {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

/// What one OS thread running blocks owns, kept between launches (making fiber regions costs a system call per
/// fiber).
#[derive(Default)]
pub(super) struct Worker {
    regions: Option<FiberRegions>,
    dyn_smem: Vec<u8>,
}

impl Worker {
    /// Makes room for blocks of `threads` threads and `shared_bytes` of dynamic shared memory.
    fn reserve(&mut self, threads: usize, shared_bytes: usize, dyn_guard: usize) -> Result<()> {
        if self.regions.as_ref().is_none_or(|r| r.count < threads) {
            self.regions = None;
            self.regions = Some(FiberRegions::new(threads.next_power_of_two().max(128))?);
        }
        let need = shared_bytes + 2 * dyn_guard + 64;
        if self.dyn_smem.len() < need {
            self.dyn_smem = vec![0; need];
        }
        Ok(())
    }
}

/// The launch as the workers share it.
struct Shared(EmuLaunch);
// SAFETY: the raw pointers in EmuLaunch are the arguments (read-only during the launch) and two atomics.
unsafe impl Sync for Shared {}

impl Shared {
    // A method, so that closures capture the whole (Sync) value rather than its (non-Sync) field.
    fn get(&self) -> *const EmuLaunch {
        &self.0
    }
}

/// Runs every block of the launch on `workers` (the first on the calling thread, the others on scoped threads) and
/// returns the first failure's message.
///
/// # Safety
/// `args` points at the kernel's arguments, which match its parameters (checked by [`check_args`]), and every
/// address among them is valid for what the kernel does with it.
pub(super) unsafe fn run(
    lib: &Library,
    kernel: &KernelInfo,
    cfg: &LaunchConfig,
    args: *mut *mut c_void,
    workers: &mut [Worker],
) -> Result<(), String> {
    let threads = cfg.block.iter().map(|&b| b as usize).product::<usize>();
    for w in workers.iter_mut() {
        w.reserve(threads, cfg.shared_bytes as usize, lib.dyn_guard).map_err(|e| e.to_string())?;
    }
    let next = AtomicU64::new(0);
    let abort = AtomicI32::new(0);
    let launch = Shared(EmuLaunch {
        kernel: kernel.launch,
        args,
        grid: cfg.grid,
        block: cfg.block,
        shared_bytes: cfg.shared_bytes,
        nblocks: cfg.grid.iter().map(|&g| u64::from(g)).product(),
        next_block: next.as_ptr(),
        abort: abort.as_ptr(),
    });
    let run_on = |w: &mut Worker| -> Result<(), String> {
        let regions = w.regions.as_ref().ok_or("no fiber regions")?;
        let worker = EmuWorker {
            regions: regions.regions,
            nregions: regions.count as u64,
            dyn_smem: w.dyn_smem.as_mut_ptr(),
            dyn_capacity: w.dyn_smem.len() as u64,
        };
        let mut err = vec![0 as c_char; 4096];
        // SAFETY: `launch` and `worker` describe live memory for the whole call (the caller's contract for the
        // arguments; the regions and buffer are this worker's); `err` has the length passed.
        let rc: c_int = unsafe { (lib.run)(launch.get(), &worker, err.as_mut_ptr(), err.len()) };
        if rc == 0 {
            Ok(())
        } else {
            // SAFETY: the runtime wrote a NUL-terminated message within `err`.
            Err(unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned())
        }
    };
    let (first, rest) = workers.split_first_mut().ok_or("no workers")?;
    std::thread::scope(|s| {
        let handles: Vec<_> = rest
            .iter_mut()
            .map(|w| std::thread::Builder::new().name("longctx-emu".into()).spawn_scoped(s, || run_on(w)))
            .collect();
        let mut result = run_on(first);
        for h in handles {
            // A worker that could not start leaves its share to the others (they take blocks from one counter).
            let r = match h {
                Ok(h) => h.join().unwrap_or_else(|_| Err("a worker thread panicked".into())),
                Err(_) => Ok(()),
            };
            if result.is_ok() {
                result = r;
            }
        }
        result
    })
}
