//! The error type of every fallible operation. Errors about one tensor name it by its [`TensorTag`].

use std::io;
use std::path::PathBuf;

use crate::memory::Tensor;
use crate::tag::TensorTag;
use crate::tensor::ShapeMismatch;

/// Everything that can go wrong building an engine, offloading or fetching.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OffloadError {
    /// The builder's options do not make an engine.
    #[error("invalid offload engine configuration: {reason}")]
    InvalidConfig {
        /// What is wrong, in words.
        reason: &'static str,
    },
    /// A tensor's data length is not the product of its dims.
    #[error(transparent)]
    ShapeMismatch(#[from] ShapeMismatch),
    /// The tensor is larger than every tier's whole budget, so it could never be placed. The tensor is handed
    /// back untouched.
    #[error("{tensor} ({bytes} bytes) is larger than every tier's budget")]
    TooLarge {
        /// The tensor.
        tensor: TensorTag,
        /// Its size in bytes.
        bytes: u64,
        /// The tensor itself, handed back.
        returned: Box<Tensor>,
    },
    /// A device tensor was handed to an engine built without a
    /// [`DeviceCopier`](crate::DeviceCopier) ([`OffloadEngineBuilder::device`](crate::OffloadEngineBuilder::device)).
    /// The tensor is handed back untouched.
    #[error("{tensor} is in device memory, but the offload engine was built without a device copier")]
    NoDeviceCopier {
        /// The tensor.
        tensor: TensorTag,
        /// The tensor itself, handed back.
        returned: Box<Tensor>,
    },
    /// The [`DeviceCopier`](crate::DeviceCopier) failed to copy the tensor out of device memory (the tensor is
    /// lost: its device buffer was handed over) or back into a new device buffer.
    #[error("device copy of {tensor} failed: {source}")]
    DeviceCopy {
        /// The tensor.
        tensor: TensorTag,
        /// The copier's error.
        #[source]
        source: io::Error,
    },
    /// The spill directory cannot be created, written or locked.
    #[error("spill directory {path} is not usable: {source}")]
    SpillDir {
        /// The directory (or the file in it that failed).
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The disk tier's budget is larger than the free space of its filesystem.
    #[error("disk tier budget of {budget} bytes exceeds the {available} bytes free under {path}")]
    DiskTooSmall {
        /// The spill directory.
        path: PathBuf,
        /// The budget asked for.
        budget: u64,
        /// Bytes free for this user on its filesystem.
        available: u64,
    },
    /// Spilling a tensor failed because its filesystem has no room (`ENOSPC`, `EDQUOT` or `EFBIG`).
    #[error("no room to spill {tensor} to {path}: {source}")]
    DiskFull {
        /// The tensor.
        tensor: TensorTag,
        /// Its spill file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Spilling or reading back a tensor failed for another I/O reason.
    #[error("I/O error on the spill file {path} of {tensor}: {source}")]
    Io {
        /// The tensor.
        tensor: TensorTag,
        /// Its spill file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A spill file read back does not hold what was written: its checksum, header or length is wrong.
    #[error("spill file {path} of {tensor} is corrupt: {reason}")]
    Corrupt {
        /// The tensor.
        tensor: TensorTag,
        /// Its spill file.
        path: PathBuf,
        /// What does not match, in words.
        reason: String,
    },
    /// The ticket was issued by another engine (a fetch then drops it, which frees it in its own engine).
    #[error("{tensor}: the ticket belongs to another offload engine")]
    ForeignTicket {
        /// The tensor.
        tensor: TensorTag,
    },
    /// No host buffer could be mapped for the tensor (the system is out of memory); the tensor is lost.
    #[error("cannot map a host buffer for {tensor}: {source}")]
    HostAlloc {
        /// The tensor.
        tensor: TensorTag,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The host buffer for the tensor could not be page-locked (see [`PageLocker`](crate::PageLocker)); the
    /// tensor is lost.
    #[error("cannot page-lock a host buffer of {bytes} bytes for {tensor}: {source}")]
    PageLock {
        /// The tensor.
        tensor: TensorTag,
        /// Its size in bytes.
        bytes: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The host tier's budget cannot be page-locked whole (a limit on locked memory is below it).
    #[error("a host tier of {budget} bytes cannot be page-locked: {source}")]
    PageLockBudget {
        /// The host tier's budget.
        budget: u64,
        /// The cause, naming the limit.
        #[source]
        source: io::Error,
    },
    /// A worker thread could not be started.
    #[error("cannot start an offload worker thread: {0}")]
    Spawn(#[source] io::Error),
    /// A worker panicked while copying the tensor (a bug in this crate); the tensor is lost.
    #[error("an offload worker panicked while copying {tensor}")]
    WorkerPanicked {
        /// The tensor.
        tensor: TensorTag,
    },
}

/// `Result` with [`OffloadError`].
pub type Result<T, E = OffloadError> = std::result::Result<T, E>;
