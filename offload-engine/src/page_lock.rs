//! Page-locking the host tier's buffers: what lets a device's copy engine move them by DMA while the CPU goes
//! on (a copy from pageable memory is staged through a locked bounce buffer and does not overlap).
//!
//! The engine asks a [`PageLocker`] to lock each pool buffer once, when the buffer is mapped, and to unlock it
//! before it is unmapped; since the pool reuses its buffers, steady-state training locks nothing per step
//! (locking per tensor is what makes pinned offload slow elsewhere). [`Mlock`] is the operating system's lock
//! (`mlock`: the pages are resident and are never swapped out); a device backend supplies its own, registering
//! the same memory with its driver (`cuMemHostRegister` with the CUDA backend, a later part of this project).

use std::fmt;
use std::io;

/// Locks and unlocks page-aligned host memory (see the module docs). Set with
/// [`OffloadEngineBuilder::page_lock`](crate::OffloadEngineBuilder::page_lock).
///
/// # Safety
/// An implementation must only pin, register or unregister the memory it is given: never read it in a way
/// that races with the engine's writes, write it, or unmap it.
pub unsafe trait PageLocker: Send + Sync + fmt::Debug {
    /// Checks, when the engine is built, that a host tier of `budget` bytes can be locked whole (a limit on
    /// locked memory below it is an error then, not at some later offload). The default accepts any budget.
    fn check_budget(&self, budget: u64) -> io::Result<()> {
        let _ = budget;
        Ok(())
    }

    /// Locks `len` bytes from `ptr`.
    ///
    /// # Safety
    /// `ptr` is page-aligned and `len` a non-zero multiple of the page size; the range is one mapping of this
    /// process that stays mapped, and is not locked by this locker, until the matching [`PageLocker::unlock`].
    unsafe fn lock(&self, ptr: *mut u8, len: usize) -> io::Result<()>;

    /// Unlocks a range that [`PageLocker::lock`] locked (the same `ptr` and `len`), just before it is unmapped.
    /// Errors cannot be acted on there and are not reported.
    ///
    /// # Safety
    /// The range was locked by this locker's `lock` and not unlocked since.
    unsafe fn unlock(&self, ptr: *mut u8, len: usize);
}

/// The operating system's page lock, `mlock(2)`: the pages are made resident at once and never swapped out.
/// Bounded by `RLIMIT_MEMLOCK` (`ulimit -l`) unless the process has `CAP_IPC_LOCK`;
/// [`PageLocker::check_budget`] refuses a host tier above that limit.
#[derive(Debug, Clone, Copy, Default)]
pub struct Mlock;

// SAFETY: mlock and munlock change only whether the pages may be swapped; they neither read nor write them.
unsafe impl PageLocker for Mlock {
    fn check_budget(&self, budget: u64) -> io::Result<()> {
        mlock_budget_fits(budget, memlock_limit()?, has_cap_ipc_lock())
    }

    unsafe fn lock(&self, ptr: *mut u8, len: usize) -> io::Result<()> {
        // SAFETY: the caller passes a range of its own mapping (see the trait); mlock does not access it.
        if unsafe { libc::mlock(ptr.cast::<libc::c_void>().cast_const(), len) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    unsafe fn unlock(&self, ptr: *mut u8, len: usize) {
        // SAFETY: as in `lock`; munmap would unlock the pages too, this only makes it explicit.
        unsafe {
            libc::munlock(ptr.cast::<libc::c_void>().cast_const(), len);
        }
    }
}

/// The soft `RLIMIT_MEMLOCK` in bytes (`u64::MAX`: unlimited).
fn memlock_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one `rlimit` into the struct passed, which lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(if lim.rlim_cur == libc::RLIM_INFINITY { u64::MAX } else { lim.rlim_cur })
}

/// Whether the process's effective capabilities include `CAP_IPC_LOCK` (bit 14), which lifts the limit.
fn has_cap_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else { return false };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

fn mlock_budget_fits(budget: u64, limit: u64, privileged: bool) -> io::Result<()> {
    if privileged || budget <= limit {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "RLIMIT_MEMLOCK allows {limit} bytes of locked memory (raise it with `ulimit -l`, or grant CAP_IPC_LOCK)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mlock_limit_binds_unless_the_process_may_lock_any_amount() {
        assert!(mlock_budget_fits(8 << 20, 8 << 20, false).is_ok());
        let err = mlock_budget_fits((8 << 20) + 1, 8 << 20, false).unwrap_err();
        assert!(err.to_string().contains("8388608 bytes"), "{err}");
        assert!(mlock_budget_fits(u64::MAX, 8 << 20, true).is_ok());
        assert!(mlock_budget_fits(1 << 40, u64::MAX, false).is_ok());
        assert!(memlock_limit().unwrap() > 0);
    }
}
