//! The few system calls `std` does not wrap, each turned into an `io::Result`.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// Reserves `len` bytes of blocks for `file`, so a full disk shows before any data is written. A filesystem
/// that cannot preallocate (`EOPNOTSUPP`) is not an error: the writes then report a full disk themselves.
pub(crate) fn preallocate(file: &File, len: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `fallocate` on a file descriptor that `file` keeps open; no memory is passed.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EOPNOTSUPP) => Ok(()),
        _ => Err(err),
    }
}

/// Fills `buf` from `file` at `offset` (`pread`, repeated after a short read or a signal), as
/// `FileExt::read_exact_at` does, but into memory that may never have been written: a fetch into a fresh
/// allocation reads straight into it. Returns `buf` as the bytes it now holds; a file that ends first is
/// `UnexpectedEof`.
pub(crate) fn read_exact_at<'a>(file: &File, buf: &'a mut [MaybeUninit<u8>], offset: u64) -> io::Result<&'a [u8]> {
    let mut done = 0;
    while done < buf.len() {
        let at = libc::off_t::try_from(offset + done as u64)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "read offset past off_t"))?;
        // SAFETY: the kernel writes at most `buf.len() - done` bytes into the rest of `buf`, which this call
        // borrows mutably; `MaybeUninit<u8>` may hold anything.
        let n = unsafe { libc::pread(file.as_raw_fd(), buf[done..].as_mut_ptr().cast(), buf.len() - done, at) };
        match n {
            0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "failed to fill whole buffer")),
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    // SAFETY: the loop ended with all `buf.len()` bytes written by the kernel.
    Ok(unsafe { std::slice::from_raw_parts(buf.as_ptr().cast(), buf.len()) })
}

/// Tells the kernel it may drop `file`'s cached pages (`POSIX_FADV_DONTNEED`; after `sync_data` they are clean,
/// so they really go) or should start reading all of it now (`POSIX_FADV_WILLNEED`).
pub(crate) fn fadvise(file: &File, advice: libc::c_int) -> io::Result<()> {
    // SAFETY: `posix_fadvise` on a file descriptor that `file` keeps open; no memory is passed.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, advice) };
    if rc == 0 {
        Ok(())
    } else {
        // posix_fadvise returns the error number instead of setting errno.
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Takes an exclusive `flock` on `file` without blocking: `Ok(false)` when another open file holds it. The lock
/// lasts until `file` is closed, including by the process dying, which is how leftovers of a crashed run are
/// told from a live engine's directory.
pub(crate) fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    // SAFETY: `flock` on a file descriptor that `file` keeps open; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Ok(false),
        _ => Err(err),
    }
}

/// Bytes free for an unprivileged user on the filesystem holding `path`.
pub(crate) fn available_bytes(path: &Path) -> io::Result<u64> {
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `statvfs` is plain old data; all zeros is a valid value that the call overwrites.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is a NUL-terminated string and `st` a valid, writable `statvfs`, both alive for the call.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// True for the errors that mean "no room": a full filesystem, a quota, or a file size limit.
pub(crate) fn is_out_of_space(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Reads into never-written memory from an offset, and a file that ends first is `UnexpectedEof`, as
    /// `FileExt::read_exact_at` reports it.
    #[test]
    fn read_exact_at_fills_fresh_memory_and_reports_a_short_file() {
        let mut file = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        file.write_all(&data).unwrap();
        let mut fresh: Vec<u8> = Vec::with_capacity(6000);
        let got = read_exact_at(&file, &mut fresh.spare_capacity_mut()[..6000], 3000).unwrap();
        assert_eq!(got, &data[3000..9000]);
        let mut past: Vec<u8> = Vec::with_capacity(6000);
        let err = read_exact_at(&file, &mut past.spare_capacity_mut()[..6000], 5000).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
