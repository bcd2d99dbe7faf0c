//! The CUDA emulator: our own `.cu` kernels compiled by the host C++ compiler and run on the CPU, slowly but with
//! the semantics the GPU gives them, so that every kernel is tested against the CPU backend on machines without a GPU
//! (nvcc's old `-deviceemu`, rebuilt because our kernels use inline PTX: `mma.sync`, `ldmatrix`, `cp.async`).
//!
//! - **Build** ([`compile`]): each [`KernelSource`]'s translation unit, the very text NVRTC gets, compiled with
//!   `-DLONGCTX_EMU` after `emu.h` (the CUDA built-ins for the host), plus a generated registry of its kernels, linked
//!   with the runtime (`runtime.cpp`) into one shared library per source, cached on disk by content hash.
//! - **Execution**: a launch's blocks run on a few OS threads (`LONGCTX_EMU_THREADS`, default: the machine's cores),
//!   one block at a time per thread; every CUDA thread of a block is a fiber with its own stack (over 170 KiB, a guard
//!   page below it), scheduled cooperatively: a fiber runs until it waits at a barrier or a warp collective.
//!   `__syncthreads` waits for every thread that has not exited; warp collectives (`__shfl*_sync`, votes, `__syncwarp`,
//!   `mma.sync`, `ldmatrix`) gather all 32 lanes and compute at one instant with the PTX ISA's fragment layouts;
//!   `wgmma.mma_async` (ptx_hopper.cuh) gathers its warpgroup's 128 threads, decodes the shared-memory descriptors (no
//!   swizzle or 128B; others refused) or takes A from the threads' registers (the RS form, read at issue) and
//!   computes at once, but writes each thread's accumulators (NaN until then) only at the `wgmma.wait_group` that
//!   covers the op, after checking that the shared memory (and the A registers) it read were not overwritten; a
//!   wgmma without a `wgmma.fence` since the thread's last wait, or a thread exiting with one in flight, is an error.
//!   Descriptors hold addresses of an emulated shared-state window (static shared memory from 1024, dynamic from a
//!   1024-byte boundary + 16). `setmaxnreg` (ptx_hopper.cuh) is a warpgroup collective that checks convergence and does
//!   nothing else. mbarriers (ptx_tma.cuh) live in a table of the block keyed by their shared address, with the PTX
//!   ISA's phase, pending and expected arrivals and tx-count exactly; `mbarrier.try_wait` (and the `mbarrier_wait`
//!   loop) is a scheduling point: a thread whose phase has not completed sleeps until the barrier changes (an arrive, a
//!   copy issued on it), so spinning on an mbarrier works as on the GPU; a single try_wait answers false once every
//!   live thread of the block waits (its time limit, on the GPU), and a try_wait loop with nothing else happening in
//!   between is a deadlock. TMA loads (`cp.async.bulk.tensor`, with the emulator's own tensor-map format,
//!   tensor_map.rs) are checked when issued (the map, the destination's alignment, 128 bytes or 1024 for the 128B
//!   swizzle, and range, an initialised barrier) and land, reading global memory then (zeros out of bounds, the swizzle
//!   applied to the shared address), when a thread polls the barrier they complete on, which then gets their bytes'
//!   complete-tx. Named barriers (`bar.sync` / `bar.arrive` with an id 1..15 and a thread count, ptx.cuh) complete a
//!   phase when that many threads have arrived (exited threads do not count); `bar.sync` is a scheduling point,
//!   `bar.arrive` is not; arrivals of one phase with different counts are an error, and so is a phase still open when
//!   every thread has exited (arrivals no sync matched: counts that do not balance, which the GPU would let pass).
//!   A barrier that can never complete (divergent `__syncthreads`, a collective some lanes never reach or reach in
//!   another collective, a lane that exited, an mbarrier phase whose arrivals or transaction bytes never come, a named
//!   barrier's phase short of its count) is an error naming the threads and source lines (and each waited-on mbarrier's
//!   and open named barrier's state), never a hang. Masks other
//!   than the full warp are refused rather than guessed at.
//! - **Memory** ([`memory`]): device memory is host memory with guard zones around each allocation, checked after
//!   every launch ("wrote outside a buffer", naming the kernel); contents, `__shared__` variables and dynamic shared
//!   memory start poisoned (0xFF bytes: NaN as floats), cp.async copies land only at the wait that covers them and
//!   TMA loads only when their mbarrier is polled, so a kernel reading what it did not write, or did not wait for,
//!   gets NaNs in tests rather than luck.
//! - **Errors**: a `__trap()`, a failed `assert`, a refused collective or a deadlock ends the launch with
//!   [`KernelError::Device`] naming the kernel, block, thread and line; a bad configuration or arguments of the wrong
//!   sizes are refused before anything runs; a compile error is [`KernelError::Compile`] naming the file.
//!
//! What is approximate: `mma.sync` sums exactly (double) and rounds once, where tensor cores have their own order and
//! truncation; `ex2.approx`, `__expf` and the other fast intrinsics are exact; there is no FMA contraction (nvcc
//! contracts by default); atomics are sequentially consistent; within a block, threads only interleave at barriers,
//! collectives and mbarrier waits (so a spin-wait on a plain shared variable written by another thread of the block
//! hangs, where the GPU's independent thread scheduling would let it finish; spin on an mbarrier instead); a block
//! waits for another only through ptx.cuh's flags (`flag_wait_eq`: the workers take blocks in the order of their
//! linear index, as the GPU dispatches them, so a block waiting for one of lower index waits for a block that runs or
//! has run; the wait yields the OS thread, and ends the launch with an error after 60 seconds). TMA: one proxy (the proxy fences are no-ops, so a missing `fence.proxy.async` is
//! not caught), a copy lands whole at a poll (never partly, never without a poll), and its global reads are not checked
//! against the allocations (`EmulatedDevice::tensor_map` refuses a map reaching past its buffer; a map encoded
//! otherwise may read past it); TMA stores (`cp.async.bulk.tensor` shared → global, bulk async-groups) are performed
//! whole, reading shared memory then, at the `cp.async.bulk.wait_group` that covers them or when their thread exits (so
//! reusing their source before `wait_group.read` shows in the output), and so are the bulk reduce-adds of f32
//! (`cp.reduce.async.bulk .add.f32`, each float added atomically); no multicast, clusters, tensor reductions or im2col;
//! the emulator's maps are its own format (a driver-encoded map is refused). A swizzled box is laid out densely with
//! the swizzle applied to the shared address; the probe's GPU cases (not yet run on a GPU) check that reading only for
//! boxes whose inner dimension is the swizzle's whole span. `setmaxnreg` changes nothing (there is no register file to
//! resize). Out-of-bounds reads and writes that miss every guard zone are not caught (a wild one can crash the process,
//! as can a fiber overflowing its stack).
//!
//! Costs, measured on the 2-core dev machine (the `emulator_figures` test): building the 8 test sources from nothing
//! 2.7-4.4 s (once per change; finding them in the cache 3 ms); a launch of one small block 2.6 us, of 64 blocks
//! 110 us; 28 ns per thread per `__syncthreads` in a 128-thread block that also touches shared memory (17 ns for the
//! barrier alone); 2.1 us per warp-wide `mma.m16n8k16`. Tests should use small shapes.
//!
//! This is not the `Device` trait: `EmulatedDevice` (with the host GEMM, events, streams) wraps an [`Emulator`].
//! Launches are synchronous and may run concurrently from several threads.

mod compile;
mod ffi;
mod launch;
mod memory;
#[cfg(test)]
mod tests;

use std::sync::{Arc, Mutex};

use self::compile::Library;
use self::launch::Worker;
use self::memory::DeviceMemory;
use crate::cuda::device::{DevicePtr, Kernel, KernelArgs, KernelSource, LaunchConfig};
use crate::error::{KernelError, Result};

/// The emulated device: the compiled kernel sources, the device memory, the workers that run blocks.
pub(crate) struct Emulator {
    libraries: Vec<Arc<Library>>,
    memory: DeviceMemory,
    /// OS threads a launch may use.
    threads: usize,
    /// Workers kept between launches.
    workers: Mutex<Vec<Worker>>,
}

impl std::fmt::Debug for Emulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let files: Vec<&str> = self.libraries.iter().map(|l| l.file).collect();
        f.debug_struct("Emulator").field("sources", &files).field("threads", &self.threads).finish_non_exhaustive()
    }
}

impl Emulator {
    /// The emulator of `sources`, each compiled (or found in the cache) and loaded. Errors: a compile error
    /// ([`KernelError::Compile`] naming the file), no host compiler, two sources with one file name, a bad
    /// `LONGCTX_EMU_THREADS`.
    pub fn new(sources: &[&'static KernelSource]) -> Result<Self> {
        for (i, a) in sources.iter().enumerate() {
            if sources[..i].iter().any(|b| b.file == a.file) {
                return Err(KernelError::InvalidArgument {
                    name: "sources",
                    why: format!("two kernel sources are named `{}`", a.file),
                });
            }
        }
        let threads = match std::env::var("LONGCTX_EMU_THREADS") {
            Ok(s) => s.trim().parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| KernelError::InvalidArgument {
                name: "LONGCTX_EMU_THREADS",
                why: format!("`{s}` is not a positive number of threads"),
            })?,
            Err(_) => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        Ok(Self {
            libraries: compile::build(sources)?,
            memory: DeviceMemory::with_capacity(memory::capacity_from_env()),
            threads,
            workers: Mutex::new(Vec::new()),
        })
    }

    /// `bytes` of device memory: 256-byte aligned, poisoned (0xFF bytes), between guard zones. The address is a host
    /// address: the caller copies to and from it directly (after [`Emulator::check_range`]).
    pub fn alloc(&self, bytes: usize) -> Result<DevicePtr> {
        self.memory.alloc(bytes)
    }

    /// Frees `ptr`; an error if it is not a live allocation, or if its guard zones were overwritten since the last
    /// launch (it is freed anyway).
    ///
    /// # Safety
    /// No launch running now uses `ptr`, and nothing uses it afterwards.
    pub unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.memory.free(ptr) }
    }

    /// Whether `[ptr, ptr + bytes)` lies within one live allocation: for the device's copies, which should fail as
    /// the GPU's would instead of writing outside a buffer. `op` names the copy in the error.
    pub fn check_range(&self, ptr: DevicePtr, bytes: usize, op: &str) -> Result<()> {
        self.memory.check_range(ptr, bytes, op)
    }

    /// The device memory's capacity, when `$LONGCTX_EMULATED_MEMORY` set one.
    pub fn memory_capacity(&self) -> Option<usize> {
        self.memory.capacity()
    }

    /// Bytes allocated and not freed.
    pub fn memory_used(&self) -> usize {
        self.memory.used()
    }

    /// Runs `kernel` over the grid and returns when every block has run (or the first error). Checks first what the
    /// GPU's driver checks (the configuration, the shared memory) and the arguments against the kernel's parameter
    /// sizes; after the run, the guard zones of every allocation.
    ///
    /// # Safety
    /// Every address among the arguments is valid for everything the kernel does with it (an allocation of this
    /// emulator, or host memory that outlives the call).
    pub unsafe fn launch(&self, kernel: &Kernel, cfg: &LaunchConfig, args: &KernelArgs) -> Result<()> {
        let lib = self.libraries.iter().find(|l| l.file == kernel.source.file).ok_or_else(|| {
            launch::launch_error(
                kernel.name,
                format!("its source `{}` is not one of this emulator's", kernel.source.file),
            )
        })?;
        let info = lib.kernels.iter().find(|k| k.name == kernel.name).ok_or_else(|| {
            launch::launch_error(kernel.name, format!("`{}` defines no kernel of that name", lib.file))
        })?;
        launch::check_args(info, args.sizes())?;
        launch::check_config(kernel.name, cfg, lib.static_smem)?;

        let nblocks: u64 = cfg.grid.iter().map(|&g| u64::from(g)).product();
        let nworkers = self.threads.min(usize::try_from(nblocks).unwrap_or(usize::MAX)).max(1);
        let mut workers: Vec<Worker> = {
            let mut pool = self.workers.lock().unwrap_or_else(|e| e.into_inner());
            let keep = pool.len().saturating_sub(nworkers);
            pool.split_off(keep)
        };
        workers.resize_with(nworkers, Worker::default);
        let args = args.clone();
        let mut pointers = args.pointers();
        // SAFETY: the arguments match the kernel's parameters (checked above) and their addresses are valid (the
        // caller's contract); `pointers` and `args` live until `run` returns.
        let ran = unsafe { launch::run(lib, info, cfg, pointers.as_mut_ptr(), &mut workers) };
        self.workers.lock().unwrap_or_else(|e| e.into_inner()).append(&mut workers);
        let guards = self.memory.check_guards(kernel.name);
        match (ran, guards) {
            (Ok(()), guards) => guards,
            (Err(why), Ok(())) => {
                Err(KernelError::Device { backend: memory::BACKEND, op: format!("kernel `{}`", kernel.name), why })
            }
            (Err(why), Err(e)) => Err(KernelError::Device {
                backend: memory::BACKEND,
                op: format!("kernel `{}`", kernel.name),
                why: format!("{why}; and {e}"),
            }),
        }
    }
}
