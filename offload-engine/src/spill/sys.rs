//! The few system calls `std` does not wrap, each turned into an `io::Result`.

use std::ffi::CString;
use std::fs::File;
use std::io;
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
