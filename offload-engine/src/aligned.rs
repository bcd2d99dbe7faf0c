//! Page-aligned host buffers: the host tier's slots and the disk tier's direct-I/O staging buffers.
//!
//! Each buffer is its own anonymous mapping. That gives the alignment `O_DIRECT` needs (and that a later
//! `cudaHostRegister` wants), zeroed memory without a `memset` (pages are filled on first touch), and an
//! `munmap` on drop, so a freed buffer's memory really goes back to the system instead of staying in the
//! allocator's heap.

use std::io;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::page_lock::PageLocker;

/// Alignment of every buffer, of every direct-I/O transfer and of the spill file layout.
pub(crate) const ALIGN: usize = 4096;

/// Rounds `n` up to a multiple of [`ALIGN`], or `None` on overflow.
pub(crate) fn align_up(n: usize) -> Option<usize> {
    n.checked_add(ALIGN - 1).map(|m| m & !(ALIGN - 1))
}

/// `bytes` as memory to overwrite. Sound because a `&mut [MaybeUninit<u8>]` cannot be used to write anything but
/// bytes, every one of which is a valid `u8`: the readers that fill a fetch's destination take this type so that
/// a fresh allocation need not be zeroed first, and a destination that already holds data is passed through it.
pub(crate) fn as_unfilled(bytes: &mut [u8]) -> &mut [MaybeUninit<u8>] {
    // SAFETY: same memory, same length; `MaybeUninit<u8>` has `u8`'s layout. What can be written through it
    // (`MaybeUninit::write`, copies of initialised slices) leaves initialised bytes, except
    // `MaybeUninit::uninit()`, which no caller writes.
    unsafe { &mut *(bytes as *mut [u8] as *mut [MaybeUninit<u8>]) }
}

/// Copies `src` into `dst` (equal lengths), which may never have been written.
pub(crate) fn fill(dst: &mut [MaybeUninit<u8>], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "fill: lengths differ");
    // SAFETY: both ranges are `src.len()` bytes long and valid (one borrowed shared, one mutably, so they cannot
    // overlap).
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast(), src.len()) }
}

/// Below this a buffer is not worth a huge-page hint.
const HUGE_HINT_MIN: usize = 4 << 20;

/// Asks the kernel to back the whole pages of `bytes` with transparent huge pages (`MADV_HUGEPAGE`; a no-op
/// where THP is off). A fresh allocation then takes one fault per 2 MiB instead of one per 4 KiB on its first
/// write: under virtualisation the faults, not the copy, set the speed of filling fresh memory. Contents are
/// unchanged; errors are ignored (it is advice).
pub(crate) fn advise_hugepages(bytes: &mut [MaybeUninit<u8>]) {
    if bytes.len() < HUGE_HINT_MIN {
        return;
    }
    let start = bytes.as_mut_ptr() as usize;
    let (first, end) = ((start + ALIGN - 1) & !(ALIGN - 1), (start + bytes.len()) & !(ALIGN - 1));
    if end > first {
        // SAFETY: [first, end) lies within `bytes`, memory this process owns and keeps mapped for the call;
        // MADV_HUGEPAGE changes how the kernel backs it, never what it holds.
        unsafe {
            libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
        }
    }
}

/// An owned, zero-initialised, page-aligned byte buffer whose length is a multiple of [`ALIGN`].
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// Who locked the buffer's pages, to unlock them before the unmapping.
    locked_by: Option<Arc<dyn PageLocker>>,
}

// SAFETY: the buffer is plain memory owned by this value alone (like a `Box<[u8]>`); `&AlignedBuf` only gives
// out `&[u8]`, so sharing it between threads is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of at least `min_len` bytes (rounded up to [`ALIGN`]; at least one page).
    pub(crate) fn zeroed(min_len: usize) -> io::Result<Self> {
        let len = align_up(min_len.max(1)).ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        // SAFETY: an anonymous private mapping with no address hint touches no existing memory; the result is
        // checked against MAP_FAILED before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        let mut buf = Self { ptr, len, locked_by: None };
        advise_hugepages(as_unfilled(buf.as_mut_slice()));
        Ok(buf)
    }

    /// Page-locks the whole buffer with `locker`, until it is dropped.
    pub(crate) fn lock(&mut self, locker: &Arc<dyn PageLocker>) -> io::Result<()> {
        debug_assert!(self.locked_by.is_none(), "a buffer is locked once");
        // SAFETY: `ptr`/`len` are this buffer's whole mapping (page-aligned, a non-zero multiple of the page),
        // mapped until `drop`, which unlocks it first; it is not locked yet.
        unsafe { locker.lock(self.ptr.as_ptr(), self.len)? };
        self.locked_by = Some(Arc::clone(locker));
        Ok(())
    }

    /// Bytes in the buffer.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` bytes mapped readable and writable for as long as `self` lives; an
        // anonymous mapping is zero-filled, so every byte is initialised.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(locker) = self.locked_by.take() {
            // SAFETY: locked by this locker in `lock` with the same range, and still mapped.
            unsafe { locker.unlock(self.ptr.as_ptr(), self.len) };
        }
        // SAFETY: `ptr`/`len` are exactly the mapping made in `zeroed`, unmapped once, here. No slice of it can
        // outlive `self`. A failure could only mean a bad argument, which this cannot pass; there is nothing to do
        // about it in a destructor.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_writable() {
        let mut b = AlignedBuf::zeroed(5000).unwrap();
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[8191] = 7;
        assert_eq!(b.as_slice()[8191], 7);
        assert_eq!(AlignedBuf::zeroed(0).unwrap().len(), ALIGN);
        assert_eq!(align_up(usize::MAX), None);
    }
}
