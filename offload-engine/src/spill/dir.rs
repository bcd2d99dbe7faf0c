//! The spill directory: one private subdirectory per engine, locked while the engine lives, removed when it is
//! dropped, and removed by the next engine to start when its owner died without removing it.
//!
//! The engine works in `ROOT/longctx-offload-PID-NONCE/`, holding an exclusive `flock` on its `lock` file.
//! At start it scans `ROOT` for other `longctx-offload-*` directories and tries each one's lock: one it can take
//! belongs to no live process (the kernel drops a lock when its holder dies, however it dies), so its spill
//! files are removed. One without a lock file is removed only when it is more than a minute old (an engine
//! creates its lock right after its directory). Only files this crate names (`*.spill`, `lock`, `probe`) are
//! deleted, then the directory if that left it empty: nothing of the user's is touched.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::aligned::{AlignedBuf, ALIGN};
use crate::error::OffloadError;
use crate::slot::SlotId;
use crate::spill::{sys, DiskIo};

const PREFIX: &str = "longctx-offload-";
const LOCK: &str = "lock";
const PROBE: &str = "probe";
const SUFFIX: &str = ".spill";
const LOCKLESS_GRACE: Duration = Duration::from_secs(60);

/// One engine's spill directory (see the module docs).
pub(crate) struct SpillDir {
    dir: PathBuf,
    mode: DiskIo,
    /// Holds the `flock` for as long as the engine lives.
    _lock: File,
    stale_removed: u64,
}

fn dir_err(path: &Path) -> impl FnOnce(io::Error) -> OffloadError + '_ {
    move |source| OffloadError::SpillDir { path: path.to_owned(), source }
}

impl SpillDir {
    /// Creates `root` if needed, removes crashed runs' leftovers in it, checks that `budget` bytes are free,
    /// makes this engine's directory and finds out whether `O_DIRECT` works there (when `try_direct`).
    pub(crate) fn open(root: &Path, budget: u64, try_direct: bool) -> Result<Self, OffloadError> {
        fs::create_dir_all(root).map_err(dir_err(root))?;
        let stale_removed = remove_stale(root).map_err(dir_err(root))?;
        let available = sys::available_bytes(root).map_err(dir_err(root))?;
        if budget > available {
            return Err(OffloadError::DiskTooSmall { path: root.to_owned(), budget, available });
        }
        let nonce = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let dir = root.join(format!("{PREFIX}{}-{nonce:x}", std::process::id()));
        fs::create_dir(&dir).map_err(dir_err(&dir))?;
        let lock_path = dir.join(LOCK);
        let lock = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&lock_path);
        let lock = match lock.and_then(|f| sys::try_lock_exclusive(&f).map(|locked| (f, locked))) {
            Ok((f, true)) => f,
            Ok((_, false)) => {
                let source = io::Error::new(io::ErrorKind::WouldBlock, "lock held by another process");
                return Err(cleanup_failed_open(&dir, dir_err(&lock_path)(source)));
            }
            Err(e) => return Err(cleanup_failed_open(&dir, dir_err(&lock_path)(e))),
        };
        let mode = match probe(&dir, try_direct) {
            Ok(mode) => mode,
            Err(e) => return Err(cleanup_failed_open(&dir, e)),
        };
        Ok(Self { dir, mode, _lock: lock, stale_removed })
    }

    /// This engine's directory.
    pub(crate) fn path(&self) -> &Path {
        &self.dir
    }

    /// Whether files here are written with direct or buffered I/O.
    pub(crate) fn mode(&self) -> DiskIo {
        self.mode
    }

    /// Spill files of crashed runs removed when this one started.
    pub(crate) fn stale_removed(&self) -> u64 {
        self.stale_removed
    }

    /// The file of one slot.
    pub(crate) fn file(&self, slot: SlotId) -> PathBuf {
        self.dir.join(format!("{slot:016x}{SUFFIX}"))
    }
}

impl Drop for SpillDir {
    fn drop(&mut self) {
        // Files of tickets still alive go too: their tier is gone (fetching them reports `EngineClosed`).
        let _ = remove_ours(&self.dir);
    }
}

fn cleanup_failed_open(dir: &Path, err: OffloadError) -> OffloadError {
    let _ = remove_ours(dir);
    err
}

/// Writes (and reads back) one page with `O_DIRECT`; a filesystem that refuses it (`EINVAL`: tmpfs before
/// Linux 6.6, some network and FUSE filesystems) gets buffered I/O. Any other failure means the directory is
/// not usable.
fn probe(dir: &Path, try_direct: bool) -> Result<DiskIo, OffloadError> {
    let path = dir.join(PROBE);
    let result = (|| {
        if try_direct {
            match probe_direct(&path) {
                Ok(()) => return Ok(DiskIo::Direct),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => return Err(e),
            }
            let _ = fs::remove_file(&path);
        }
        let f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
        std::io::Write::write_all(&mut &f, &[0u8; ALIGN])?;
        f.sync_data()?;
        Ok(DiskIo::Buffered)
    })();
    let _ = fs::remove_file(&path);
    result.map_err(dir_err(&path))
}

fn probe_direct(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut page = AlignedBuf::zeroed(ALIGN)?;
    let f = OpenOptions::new().write(true).create_new(true).mode(0o600).custom_flags(libc::O_DIRECT).open(path)?;
    f.write_all_at(page.as_slice(), 0)?;
    drop(f);
    let f = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path)?;
    f.read_exact_at(page.as_mut_slice(), 0)
}

/// Removes the files this crate names in `dir`, then `dir` if it is empty. Returns the spill files removed.
fn remove_ours(dir: &Path) -> io::Result<u64> {
    let mut spills = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let ours = name.ends_with(SUFFIX) || name == LOCK || name == PROBE;
        if ours && entry.file_type()?.is_file() && fs::remove_file(entry.path()).is_ok() && name.ends_with(SUFFIX) {
            spills += 1;
        }
    }
    // Fails, leaving it, when something else is in it.
    let _ = fs::remove_dir(dir);
    Ok(spills)
}

/// Removes other engines' directories under `root` whose owner is gone (see the module docs). An entry that
/// cannot be inspected is left alone.
fn remove_stale(root: &Path) -> io::Result<u64> {
    let mut removed = 0;
    for entry in fs::read_dir(root)? {
        removed += entry.and_then(|entry| remove_if_stale(&entry)).unwrap_or(0);
    }
    Ok(removed)
}

fn remove_if_stale(entry: &fs::DirEntry) -> io::Result<u64> {
    if !entry.file_name().to_string_lossy().starts_with(PREFIX) || !entry.file_type()?.is_dir() {
        return Ok(0);
    }
    let dir = entry.path();
    let stale = match File::open(dir.join(LOCK)) {
        // The lock is released when `lock` closes, at the end of this arm: its holder is gone either way.
        Ok(lock) => sys::try_lock_exclusive(&lock)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            entry.metadata()?.modified()?.elapsed().unwrap_or_default() > LOCKLESS_GRACE
        }
        Err(e) => return Err(e),
    };
    // Another engine starting at the same moment may be removing it too; `remove_ours` tolerates that.
    if stale {
        remove_ours(&dir)
    } else {
        Ok(0)
    }
}
