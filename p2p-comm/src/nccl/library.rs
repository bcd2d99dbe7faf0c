//! NCCL's C API, loaded at run time.
//!
//! The library is opened by its soname, `libnccl.so.2` (what every NCCL 2 release installs, NVIDIA's
//! `nvidia-nccl-cu13` wheel included), then `libnccl.so`, first where the loader looks and then in each folder of
//! `LONGCTX_CUDA_LIB_DIRS` (the variable the kernels crate reads) and the CUDA toolkit's. Nothing is needed at
//! build time. cudarc's NCCL bindings are not used because their loader never tries `libnccl.so.2` and panics when
//! it finds nothing.
//!
//! Only the functions this crate calls are resolved; their signatures are NCCL 2's stable C API (`nccl.h`).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::error::CommError;

/// `ncclComm_t`.
pub(crate) type RawComm = *mut c_void;
/// `ncclResult_t`: 0 is success, 7 `ncclInProgress`.
pub(crate) type NcclResult = c_int;
/// `cudaStream_t` (the driver's `CUstream` is the same handle).
pub(crate) type RawStream = *mut c_void;

/// `ncclUniqueId`: the 128 opaque bytes every rank of a new communicator must be given.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    pub internal: [c_char; 128],
}

/// `ncclDataType_t` values.
pub(crate) mod dtype {
    pub const UINT8: i32 = 1;
    pub const INT32: i32 = 2;
    pub const INT64: i32 = 4;
    pub const UINT64: i32 = 5;
    pub const FLOAT32: i32 = 7;
    pub const FLOAT64: i32 = 8;
    pub const BFLOAT16: i32 = 9;
}

/// `ncclRedOp_t` values.
pub(crate) mod redop {
    pub const SUM: i32 = 0;
    pub const MAX: i32 = 2;
}

type Version = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type CommInitRank = unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult;
type CommFn = unsafe extern "C" fn(RawComm) -> NcclResult;
type AsyncError = unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult;
type ErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;
type LastError = unsafe extern "C" fn(RawComm) -> *const c_char;
type PointToPoint = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
type AllReduce =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
type AllGather = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> NcclResult;
type Group = unsafe extern "C" fn() -> NcclResult;

/// The resolved functions (the library stays loaded for the life of the process).
pub(crate) struct Nccl {
    pub get_version: Version,
    pub get_unique_id: GetUniqueId,
    pub comm_init_rank: CommInitRank,
    pub comm_destroy: CommFn,
    pub comm_abort: CommFn,
    pub comm_get_async_error: AsyncError,
    pub get_error_string: ErrorString,
    pub get_last_error: LastError,
    /// `ncclSend` takes a `const void*`; the one type serves both (the pointer is only passed on).
    pub send: PointToPoint,
    pub recv: PointToPoint,
    pub all_reduce: AllReduce,
    pub all_gather: AllGather,
    pub group_start: Group,
    pub group_end: Group,
    /// Where the library was found.
    pub path: String,
    _lib: libloading::Library,
}

/// The library, loaded once; the error (every place tried) is kept and returned again.
pub(crate) fn nccl() -> Result<&'static Nccl, CommError> {
    static LIB: OnceLock<Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(|e| CommError::Nccl(e.clone()))
}

fn candidates() -> Vec<PathBuf> {
    let names = ["libnccl.so.2", "libnccl.so"];
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("LONGCTX_CUDA_LIB_DIRS") {
        dirs.extend(std::env::split_paths(&v));
    }
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        dirs.push(PathBuf::from(home).join("lib64"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    // Bare names first: the loader's own search (LD_LIBRARY_PATH, ld.so.cache).
    let mut out: Vec<PathBuf> = names.iter().map(PathBuf::from).collect();
    for d in dirs {
        out.extend(names.iter().map(|n| d.join(n)));
    }
    out
}

fn load() -> Result<Nccl, String> {
    let mut tried = Vec::new();
    for path in candidates() {
        if path.is_absolute() && !path.exists() {
            continue;
        }
        // SAFETY: loading NCCL runs its static constructors, which only set up its own state.
        match unsafe { libloading::Library::new(&path) } {
            Ok(lib) => {
                return resolve(lib, path.display().to_string())
                    .map_err(|e| format!("{} was found but lacks {e}", path.display()))
            }
            Err(e) => tried.push(format!("{}: {e}", path.display())),
        }
    }
    Err(format!(
        "NCCL (libnccl.so.2) was not found; put its folder on LD_LIBRARY_PATH or LONGCTX_CUDA_LIB_DIRS (tried: {})",
        tried.join("; ")
    ))
}

fn resolve(lib: libloading::Library, path: String) -> Result<Nccl, String> {
    /// SAFETY (for each use): the symbol has the signature of `nccl.h` that the type alias spells.
    unsafe fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
        // SAFETY: the caller names the symbol's true type.
        unsafe { lib.get::<T>(name.as_bytes()).map(|s| *s).map_err(|e| format!("{name} ({e})")) }
    }
    // SAFETY: each name below is resolved to the type of its declaration in `nccl.h`.
    unsafe {
        Ok(Nccl {
            get_version: sym(&lib, "ncclGetVersion")?,
            get_unique_id: sym(&lib, "ncclGetUniqueId")?,
            comm_init_rank: sym(&lib, "ncclCommInitRank")?,
            comm_destroy: sym(&lib, "ncclCommDestroy")?,
            comm_abort: sym(&lib, "ncclCommAbort")?,
            comm_get_async_error: sym(&lib, "ncclCommGetAsyncError")?,
            get_error_string: sym(&lib, "ncclGetErrorString")?,
            get_last_error: sym(&lib, "ncclGetLastError")?,
            send: sym(&lib, "ncclSend")?,
            recv: sym(&lib, "ncclRecv")?,
            all_reduce: sym(&lib, "ncclAllReduce")?,
            all_gather: sym(&lib, "ncclAllGather")?,
            group_start: sym(&lib, "ncclGroupStart")?,
            group_end: sym(&lib, "ncclGroupEnd")?,
            path,
            _lib: lib,
        })
    }
}

impl Nccl {
    /// `Ok(())` for `ncclSuccess`, else an error naming the call, NCCL's name for the result and its last error.
    pub fn check(&self, what: &str, r: NcclResult, comm: RawComm) -> Result<(), CommError> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: both return pointers to static (or thread-local) NUL-terminated strings, or null.
        let (name, last) = unsafe { (cstr((self.get_error_string)(r)), cstr((self.get_last_error)(comm))) };
        Err(CommError::Nccl(if last.is_empty() {
            format!("{what}: {name} ({r})")
        } else {
            format!("{what}: {name} ({r}): {last}")
        }))
    }

    /// NCCL's version as a number, e.g. 22703 for 2.27.3.
    pub fn version(&self) -> Result<i32, CommError> {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        let r = unsafe { (self.get_version)(&mut v) };
        self.check("ncclGetVersion", r, std::ptr::null_mut())?;
        Ok(v)
    }
}

/// # Safety
/// `p` is null or a NUL-terminated string that outlives the call.
unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: the caller's promise.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}
