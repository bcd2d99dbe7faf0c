//! The process's allocator policy: freed tensors go back to the system, so peak RSS follows live memory.
//!
//! glibc's `malloc` serves an allocation from an `mmap` of its own only above a threshold, and by default it
//! raises that threshold to the size of each such block freed (up to 32 MiB). After the first step's tensors
//! are freed, every tensor of 32 MiB or less (at 16K tokens and d 256: x, q, o, the norms' outputs, the
//! gradients) comes from the heap, and a freed one stays there: the heap keeps the high-water mark of the
//! step's allocations, scattered, instead of returning it. Offloading then lowers what is live but not what is
//! resident (saved tensors sent to disk left their pages to the next layer's temporaries and the fetches).
//! Fixing the threshold turns the dynamic adjustment off: every large buffer is its own mapping, unmapped
//! when freed. What it costs is the first-touch faults of the fresh pages, which the heap's reused pages
//! avoided: measured on the bench model at 4K tokens, 13–27% of the step (`bench/log/2026-12-01-offload.md`).
//! So the trainer sets it only for a run that offloads, where resident memory following live memory is the
//! point; without offload glibc's default keeps the speed (and peak RSS is already below PyTorch's).

/// Buffers from this size up are mapped and unmapped one by one: every tensor of a long sequence, none of the
/// per-token vectors of a short one.
pub const MMAP_THRESHOLD: usize = 1 << 20;

/// Sets the policy (see the module docs) for this process, before the run allocates its tensors. A no-op
/// outside glibc (other allocators, musl, other systems have their own policies).
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only changes the allocator's parameters, under glibc's own arena lock (safe with
        // other threads allocating). It returns 0 on failure, which leaves the defaults: nothing breaks, peak
        // RSS is only higher.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) };
    }
}
