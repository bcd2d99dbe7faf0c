//! The disk tier: spill files in a private directory on local storage (see [`dir`] and [`file`]).

pub(crate) mod dir;
pub(crate) mod file;
pub(crate) mod format;
pub(crate) mod sys;

/// How the disk tier does its I/O (see [`crate::OffloadEngine::disk_io`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DiskIo {
    /// `O_DIRECT`: page-aligned transfers from a staging buffer, past the page cache.
    Direct,
    /// Buffered writes followed by `fdatasync` and `POSIX_FADV_DONTNEED` (the filesystem refused `O_DIRECT`,
    /// or it was turned off).
    Buffered,
}
