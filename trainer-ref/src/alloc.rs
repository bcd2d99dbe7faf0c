//! The `longctx` binary's allocator: every buffer of [`LARGE`] bytes or more (every tensor of a long sequence)
//! is a mapping of its own, backed by transparent huge pages, and a freed one is kept for reuse only while that
//! keeps the mappings within the most that was ever in use, so peak RSS follows live memory; smaller buffers
//! come from the system allocator, set to keep what it frees ([`reuse_freed_memory`]).
//!
//! Why not the system allocator for everything: glibc's `malloc` serves an allocation from an `mmap` of its own
//! only above a threshold, and by default raises that threshold to the size of each such block freed (up to 32
//! MiB), and gives the top of its heaps back to the kernel, so a step that frees and reallocates the same
//! tensors faults their pages in again every time. One heap that is never trimmed reuses its pages, but not
//! well: tensors of many sizes leave gaps that fit none of the next ones, so its resident size is the step's
//! high-water mark plus those gaps.
//!
//! Why freed mappings are kept, and resized to fit: a fresh mapping costs the kernel clearing its pages (and,
//! with 4 KiB pages, a fault for each), which unmapping every freed buffer would pay for every tensor of every
//! step. So a freed mapping is kept (up to `SLOTS` of them) while the bytes of the mappings in use plus those
//! kept stay within the most that was ever in use: peak RSS is what it would be without keeping any. A request
//! takes the kept mapping closest in size and `mremap`s it to fit (shrinking returns the tail to the kernel;
//! growing adds fresh pages only for the difference), so a kept mapping of any size serves the next tensor
//! instead of being unmapped to make room for a fresh one.
//!
//! The cost against the never-trimmed heap: a mapping of 2 MiB or more is rounded up to whole huge pages, and a
//! buffer that must be zeroed is cleared on the calling thread when it is a kept one (as glibc's `calloc` clears
//! a reused block).
//!
//! The measurements behind these choices are in `bench/log/comment-history-2026-12-05.md`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Buffers from this size up are mappings of their own: every tensor of a long sequence, none of the per-token
/// vectors of a short one.
pub const LARGE: usize = 1 << 20;

/// Transparent huge pages on x86-64 and most arm64 kernels: mappings of at least this size are rounded up to
/// a multiple of it, which the kernel aligns so that they can be backed by huge pages.
const HUGE_PAGE: usize = 2 << 20;

const PAGE: usize = 4096;

/// The allocator (`#[global_allocator]` in the `longctx` binary).
#[derive(Debug, Default, Clone, Copy)]
pub struct Allocator;

/// Makes the system allocator keep what is freed for reuse (small buffers; see the module docs): one arena for
/// all threads (a thread's own arena lives in heaps of at most 64 MiB, which glibc unmaps as they empty), no
/// trimming of the heap's top, and no separate mapping for any block under 2 GiB. Call it first thing in `main`,
/// before any thread starts. Returns whether every setting took; a no-op that returns false outside glibc.
pub fn reuse_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only changes the allocator's parameters; these three are valid at any time.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX) == 1
                && libc::mallopt(libc::M_MMAP_THRESHOLD, libc::c_int::MAX) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Whether a buffer of `layout` is a mapping of its own: a large one whose alignment a page covers.
fn is_mapped(layout: Layout) -> bool {
    layout.size() >= LARGE && layout.align() <= PAGE && cfg!(target_os = "linux")
}

/// The length of the mapping for `size` bytes.
fn mapping_len(size: usize) -> usize {
    let unit = if size >= HUGE_PAGE { HUGE_PAGE } else { PAGE };
    size.div_ceil(unit) * unit
}

#[cfg(target_os = "linux")]
mod mapping {
    use super::{mapping_len, HUGE_PAGE};

    /// A fresh zeroed mapping of at least `size` bytes, or null.
    pub fn map(size: usize) -> *mut u8 {
        let len = mapping_len(size);
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no existing
        // memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        if len >= HUGE_PAGE {
            // SAFETY: the range is the mapping just made. A failure (THP disabled) leaves 4 KiB pages.
            unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        }
        p.cast()
    }

    /// Unmaps what [`map`] or [`remap`] returned for `size` bytes.
    ///
    /// # Safety
    /// `p` must be such a mapping of `size` bytes, not used after.
    pub unsafe fn unmap(p: *mut u8, size: usize) {
        // SAFETY: the caller's contract; a failure cannot happen for a whole mapping and would only leak it.
        unsafe { libc::munmap(p.cast(), mapping_len(size)) };
    }

    /// Grows or shrinks the mapping `p` of `old` bytes to `new` bytes (maybe moving it), or null (`p` intact).
    ///
    /// # Safety
    /// `p` must be a mapping from [`map`] or [`remap`] of `old` bytes.
    pub unsafe fn remap(p: *mut u8, old: usize, new: usize) -> *mut u8 {
        let (from, to) = (mapping_len(old), mapping_len(new));
        if from == to {
            return p;
        }
        // SAFETY: the caller's contract; MREMAP_MAYMOVE keeps the contents and leaves `p` intact on failure.
        let q = unsafe { libc::mremap(p.cast(), from, to, libc::MREMAP_MAYMOVE) };
        if q == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        if to >= HUGE_PAGE {
            // SAFETY: the range is the mapping just made; failure only leaves 4 KiB pages.
            unsafe { libc::madvise(q, to, libc::MADV_HUGEPAGE) };
        }
        q.cast()
    }
}

#[cfg(not(target_os = "linux"))]
mod mapping {
    // Never called: no buffer is mapped outside Linux (`is_mapped`).
    pub fn map(_: usize) -> *mut u8 {
        std::ptr::null_mut()
    }
    pub unsafe fn unmap(_: *mut u8, _: usize) {}
    pub unsafe fn remap(_: *mut u8, _: usize, _: usize) -> *mut u8 {
        std::ptr::null_mut()
    }
}

/// Freed mappings kept for reuse (see the module docs), with the byte counts that bound them.
struct Pool {
    /// `(address, mapping length)`; a length of 0 is an empty slot.
    slots: [(usize, usize); SLOTS],
    /// Bytes of the mappings in use.
    live: usize,
    /// Bytes of the mappings kept in `slots`.
    kept: usize,
    /// The most `live` has been: what the mappings' resident size is never to exceed.
    high: usize,
}

/// Enough for the tensors several ranks of one process free at once (one rank of the bench model holds about
/// 40 mappings at the peak of its step); a mapping freed while every slot is taken is unmapped.
const SLOTS: usize = 256;

static POOL: Mutex<Pool> = Mutex::new(Pool { slots: [(0, 0); SLOTS], live: 0, kept: 0, high: 0 });

impl Pool {
    fn lock() -> MutexGuard<'static, Pool> {
        // A panic while the lock was held cannot leave the counts half-updated in a way that matters here.
        POOL.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The kept mapping to serve `len` bytes from: the smallest of `len` or more, else the largest (to grow).
    fn take(&mut self, len: usize) -> Option<(usize, usize)> {
        let kept = self.slots.iter().enumerate().filter(|(_, s)| s.1 != 0);
        let i = kept
            .clone()
            .filter(|(_, s)| s.1 >= len)
            .min_by_key(|(_, s)| s.1)
            .or_else(|| kept.max_by_key(|(_, s)| s.1))
            .map(|(i, _)| i)?;
        Some(self.remove(i))
    }

    fn remove(&mut self, i: usize) -> (usize, usize) {
        let slot = std::mem::take(&mut self.slots[i]);
        self.kept -= slot.1;
        slot
    }

    /// Counts a mapping in use going from `from` to `to` bytes (0 for none), then unmaps kept mappings, the
    /// largest first, until the total is within the high-water mark again.
    fn resized(&mut self, from: usize, to: usize) {
        self.live = self.live - from + to;
        self.high = self.high.max(self.live);
        while self.live + self.kept > self.high {
            let Some(i) =
                self.slots.iter().enumerate().filter(|(_, s)| s.1 != 0).max_by_key(|(_, s)| s.1).map(|(i, _)| i)
            else {
                break;
            };
            let (addr, had) = self.remove(i);
            // SAFETY: a kept mapping of `had` bytes, out of the pool.
            unsafe { mapping::unmap(addr as *mut u8, had) };
        }
    }
}

/// A large buffer of `size` bytes: a kept mapping resized to fit when there is one (cleared when `zeroed`; a
/// fresh mapping is zero), else a fresh mapping. The lock is not held while the kernel resizes or maps, nor while
/// a reused buffer is cleared, so that other threads' large buffers do not wait on them.
fn map_large(size: usize, zeroed: bool) -> *mut u8 {
    let len = mapping_len(size);
    let kept = Pool::lock().take(len);
    let (p, reused) = match kept {
        // SAFETY: a kept mapping of `had` bytes, owned here since `take`.
        Some((addr, had)) => match unsafe { mapping::remap(addr as *mut u8, had, len) } {
            q if q.is_null() => {
                // SAFETY: `remap` left the kept mapping intact.
                unsafe { mapping::unmap(addr as *mut u8, had) };
                (mapping::map(size), 0)
            }
            q => (q, had.min(len)),
        },
        None => (mapping::map(size), 0),
    };
    if p.is_null() {
        return p;
    }
    Pool::lock().resized(0, len);
    if zeroed {
        // SAFETY: the first `reused` bytes are the kept mapping's; a grown tail is fresh (zero).
        unsafe { std::ptr::write_bytes(p, 0, reused) };
    }
    p
}

/// Frees a large buffer: kept for reuse while a slot is free, else unmapped.
///
/// # Safety
/// `p` must be a mapping from [`map_large`] or [`remap_large`] of `size` bytes, not used after.
unsafe fn unmap_large(p: *mut u8, size: usize) {
    let len = mapping_len(size);
    let mut pool = Pool::lock();
    pool.live -= len;
    match pool.slots.iter_mut().find(|s| s.1 == 0) {
        Some(slot) => {
            *slot = (p as usize, len);
            pool.kept += len;
        }
        // SAFETY: the caller's contract.
        None => unsafe { mapping::unmap(p, size) },
    }
}

/// Resizes a large buffer, keeping the counts.
///
/// # Safety
/// `p` must be a mapping from [`map_large`] or [`remap_large`] of `old` bytes.
unsafe fn remap_large(p: *mut u8, old: usize, new: usize) -> *mut u8 {
    // SAFETY: the caller's contract.
    let q = unsafe { mapping::remap(p, old, new) };
    if !q.is_null() {
        Pool::lock().resized(mapping_len(old), mapping_len(new));
    }
    q
}

// SAFETY: every buffer is freed and resized by the allocator that made it, the system's for small ones and the
// pool's mappings for large ones (`is_mapped` is a function of the layout alone). Mappings are page-aligned,
// which covers every alignment `is_mapped` accepts; a fresh one is zeroed and a kept one is cleared for
// `alloc_zeroed`.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if is_mapped(layout) {
            map_large(layout.size(), false)
        } else {
            // SAFETY: the caller's contract, passed on.
            unsafe { System.alloc(layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if is_mapped(layout) {
            map_large(layout.size(), true)
        } else {
            // SAFETY: the caller's contract, passed on.
            unsafe { System.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if is_mapped(layout) {
            // SAFETY: a large buffer was mapped by `alloc` or `realloc` with this size.
            unsafe { unmap_large(ptr, layout.size()) }
        } else {
            // SAFETY: the caller's contract, passed on.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY (for the layout): `new_size` with the old alignment is a valid layout by realloc's contract.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (is_mapped(layout), is_mapped(new_layout)) {
            // SAFETY: the caller's contract, passed on.
            (false, false) => unsafe { System.realloc(ptr, layout, new_size) },
            // SAFETY: `ptr` is a mapping of `layout.size()` bytes.
            (true, true) => unsafe { remap_large(ptr, layout.size(), new_size) },
            // Between the two kinds: a new buffer of the other kind, the contents copied, the old one freed.
            _ => {
                // SAFETY: `new_layout` is valid and non-zero (realloc's contract).
                let new = unsafe { self.alloc(new_layout) };
                if !new.is_null() {
                    // SAFETY: both buffers hold at least the smaller size and do not overlap; `ptr` is freed
                    // with the layout it was allocated with.
                    unsafe {
                        std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                }
                new
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The test binary's allocator is the system's: the mapping functions and the pool are exercised directly.

    #[test]
    fn mappings_are_zeroed_grow_and_shrink_keeping_their_contents() {
        let size = 3 * HUGE_PAGE + 123;
        let p = mapping::map(size);
        assert!(!p.is_null() && (p as usize).is_multiple_of(PAGE));
        // SAFETY: `p` is a fresh mapping of at least `size` bytes.
        let s = unsafe { std::slice::from_raw_parts_mut(p, size) };
        assert!(s.iter().all(|&b| b == 0));
        for (i, b) in s.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        // SAFETY: `p` is a mapping of `size` bytes; the results are used as mappings of the new sizes.
        unsafe {
            let q = mapping::remap(p, size, 5 * HUGE_PAGE);
            assert!(!q.is_null());
            let t = std::slice::from_raw_parts(q, 5 * HUGE_PAGE);
            assert!(t[..size].iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
            assert!(t[size..].iter().all(|&b| b == 0));
            let r = mapping::remap(q, 5 * HUGE_PAGE, LARGE);
            assert!(!r.is_null());
            let u = std::slice::from_raw_parts(r, LARGE);
            assert!(u.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
            mapping::unmap(r, LARGE);
        }
    }

    #[test]
    fn freed_mappings_are_reused_resized_cleared_when_asked_and_kept_within_the_high_water_mark() {
        // The only test of the pool, which is process-wide.
        let counts = || {
            let p = Pool::lock();
            (p.live, p.kept, p.high)
        };
        let mb = HUGE_PAGE;
        let a = map_large(3 * mb, false);
        assert!(!a.is_null());
        // SAFETY: `a` holds 3 huge pages; every pointer below is a buffer of the pool of the size it was asked
        // for, freed once with that size.
        unsafe {
            std::ptr::write_bytes(a, 7, 3 * mb);
            unmap_large(a, 3 * mb);
            assert_eq!(counts(), (0, 3 * mb, 3 * mb));
            // Served from the kept mapping, shrunk in place, and cleared.
            let b = map_large(2 * mb, true);
            assert_eq!(b, a);
            assert!(std::slice::from_raw_parts(b, 2 * mb).iter().all(|&x| x == 0));
            assert_eq!(counts(), (2 * mb, 0, 3 * mb));
            let c = map_large(mb, false);
            std::ptr::write_bytes(b, 9, 2 * mb);
            unmap_large(b, 2 * mb);
            unmap_large(c, mb);
            assert_eq!(counts(), (0, 3 * mb, 3 * mb));
            // Nothing kept fits: the largest grows, and the other goes to keep the total within the mark.
            let d = map_large(5 * mb, true);
            let t = std::slice::from_raw_parts(d, 5 * mb);
            assert!(t.iter().all(|&x| x == 0));
            assert_eq!(counts(), (5 * mb, 0, 5 * mb));
            unmap_large(d, 5 * mb);
            assert_eq!(counts(), (0, 5 * mb, 5 * mb));
            // Every slot taken: what is freed after is unmapped.
            let many: Vec<*mut u8> = (0..SLOTS + 2).map(|_| map_large(LARGE, false)).collect();
            assert!(many.iter().all(|p| !p.is_null()));
            many.into_iter().for_each(|p| unmap_large(p, LARGE));
            let (live, kept, high) = counts();
            assert_eq!((live, kept), (0, SLOTS * LARGE));
            assert!(kept <= high);
        }
    }

    #[test]
    fn the_system_allocator_takes_the_reuse_settings_where_it_is_glibc() {
        // Only parameters change, so the test process's allocator (the system's) keeps working.
        assert_eq!(reuse_freed_memory(), cfg!(all(target_os = "linux", target_env = "gnu")));
        let v = vec![1u8; 3 * LARGE];
        assert_eq!(v.iter().map(|&b| b as usize).sum::<usize>(), 3 * LARGE);
    }

    #[test]
    fn only_large_page_aligned_buffers_are_mapped_and_lengths_round_to_their_pages() {
        let small = Layout::from_size_align(LARGE - 1, 8).unwrap();
        let aligned = Layout::from_size_align(LARGE, 2 * PAGE).unwrap();
        assert!(!is_mapped(small));
        assert!(!is_mapped(aligned));
        assert_eq!(mapping_len(LARGE + 1), LARGE + PAGE);
        assert_eq!(mapping_len(HUGE_PAGE + 1), 2 * HUGE_PAGE);
        assert_eq!(mapping_len(HUGE_PAGE), HUGE_PAGE);
    }
}
