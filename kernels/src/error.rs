//! The one error type of this crate.

use thiserror::Error;

/// What went wrong in a kernel call. Every check happens before any work starts, so an `Err` never leaves an
/// output half written.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum KernelError {
    /// A buffer's length does not match the shape it is used with.
    #[error("buffer `{name}` has {got} elements, expected {expected} for the given shape")]
    BufferLength {
        /// The argument's name, e.g. `q` or `d_k`.
        name: &'static str,
        /// Elements the shape implies.
        expected: usize,
        /// Elements the buffer has.
        got: usize,
    },
    /// A dimension that must be positive is zero.
    #[error("dimension `{0}` must be at least 1")]
    ZeroDim(&'static str),
    /// Grouped-query attention needs the query heads to be a multiple of the key/value heads.
    #[error("query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})")]
    HeadsNotDivisible {
        /// Query heads.
        q_heads: usize,
        /// Key/value heads.
        kv_heads: usize,
    },
    /// Head dimension outside 32..=256 or not a multiple of 8.
    #[error("head dim {0} unsupported: must be 32..=256 in steps of 8")]
    HeadDim(usize),
    /// The buffers of one call disagree in element type, or a buffer has a type the op does not take.
    #[error("dtype mismatch for `{name}`: expected {expected}, got {got}")]
    DType {
        /// The argument's name.
        name: &'static str,
        /// The type required.
        expected: &'static str,
        /// The type given.
        got: &'static str,
    },
    /// A scalar argument is out of its domain (e.g. a non-finite softmax scale or a zero window).
    #[error("invalid argument `{name}`: {why}")]
    InvalidArgument {
        /// The argument's name.
        name: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// A shape relation between arguments does not hold (e.g. matmul inner dimensions).
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// The operation is not available in this build or on this backend.
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    /// A view lives in other memory than the backend it is given to computes on.
    #[error("buffer `{name}` is in {got} memory, but the {backend} backend computes on {expected} memory")]
    Memory {
        /// The argument's name.
        name: &'static str,
        /// The backend's name.
        backend: &'static str,
        /// The backend's memory.
        expected: crate::Memory,
        /// The view's memory.
        got: crate::Memory,
    },
    /// The backend was not compiled into this build (e.g. `CudaBackend` without the `cuda` feature).
    #[error("the {backend} backend is not compiled into this build (enable the `{feature}` feature)")]
    NotCompiled {
        /// The backend's name.
        backend: &'static str,
        /// The cargo feature that adds it.
        feature: &'static str,
    },
    /// The backend is compiled in but finds no device (no driver, or no device with that ordinal).
    #[error("the {backend} backend found no device: {why}")]
    NoDevice {
        /// The backend's name.
        backend: &'static str,
        /// What was looked for and not found.
        why: String,
    },
    /// The device ran out of memory, even after its pool gave back what it kept for reuse.
    #[error("out of {memory} memory allocating {bytes} bytes ({free} bytes free on the device)")]
    OutOfMemory {
        /// The memory asked.
        memory: crate::Memory,
        /// Bytes asked for.
        bytes: usize,
        /// Bytes the device reported free.
        free: usize,
    },
    /// A call into the device's driver or libraries failed: a launch refused, a fault while a kernel ran
    /// (reported by the next synchronising call, or by the op itself with checked launches), a library error.
    #[error("{backend}: {op} failed: {why}")]
    Device {
        /// The backend's name.
        backend: &'static str,
        /// The op or driver call that failed (a kernel's name for a launch).
        op: String,
        /// The driver's or library's message.
        why: String,
    },
    /// A kernel source failed to compile (NVRTC's log, or the host compiler's for the emulator), or the headers
    /// it needs were not found.
    #[error("compiling `{file}` for {target} failed:\n{log}")]
    Compile {
        /// The kernel source.
        file: &'static str,
        /// What it was compiled for (`sm_90`, `host emulator`).
        target: String,
        /// The compiler's messages, or where the missing headers were looked for.
        log: String,
    },
}

/// Result alias of this crate.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;

/// Checks a buffer length against the shape's expectation.
pub(crate) fn check_len(name: &'static str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(KernelError::BufferLength { name, expected, got })
    }
}
