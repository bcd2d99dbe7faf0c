//! Making CUDA's shared libraries loadable before cudarc touches them.
//!
//! cudarc (`dynamic-loading`) opens each library by name the first time one of its functions is called, and
//! **panics** when the loader does not find it. So before any cudarc call of a library, [`ensure`] checks that
//! cudarc's own search (`is_culib_present`) succeeds; if not, it looks in the [`Places`] a toolkit or NVIDIA's
//! Python wheels put the library and `dlopen`s it by full path with `RTLD_NOW | RTLD_GLOBAL`, keeping it loaded.
//! cudarc's later `dlopen("libnvrtc.so.13")` then finds it: glibc matches a requested name without a slash against
//! the `DT_SONAME` of the objects already loaded before it searches the disk, so the library loaded from
//! `…/nvidia/cu13/lib` answers to `libnvrtc.so.13` with no `LD_LIBRARY_PATH` (the test
//! `wheel_nvrtc_is_found_by_soname` checks this with the wheel's NVRTC).
//!
//! NVRTC opens its builtins library (`libnvrtc-builtins.so.13.0`) by name when it compiles, which fails the same
//! way when NVRTC came from a folder the loader does not search ("failed to open libnvrtc-builtins.so.13.0"), so
//! the builtins in the same folder are loaded first, by full path, for the same soname match.
//!
//! A library that cannot be found is a [`LibraryNotFound`] listing every folder looked in and why each library
//! file found failed to load; the callers turn it into their error: no driver is `KernelError::NoDevice`, no NVRTC a
//! `KernelError::Compile`, no cuBLASLt a `KernelError::Device`.

use std::ffi::{CStr, CString};
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use super::places::{Places, Search};

/// The CUDA libraries the backend loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum CudaLib {
    /// `libcuda.so.1`: the driver API.
    Driver,
    /// `libnvrtc.so.13`: the run-time compiler.
    Nvrtc,
    /// `libcublasLt.so.13`: matrix products.
    CublasLt,
}

impl CudaLib {
    /// The file (and soname) loaded: the major version matches cudarc's bindings (`cuda-13000`).
    pub fn soname(self) -> &'static str {
        match self {
            CudaLib::Driver => "libcuda.so.1",
            CudaLib::Nvrtc => "libnvrtc.so.13",
            CudaLib::CublasLt => "libcublasLt.so.13",
        }
    }

    /// For messages.
    pub fn name(self) -> &'static str {
        match self {
            CudaLib::Driver => "the CUDA driver",
            CudaLib::Nvrtc => "NVRTC",
            CudaLib::CublasLt => "cuBLASLt",
        }
    }

    fn index(self) -> usize {
        match self {
            CudaLib::Driver => 0,
            CudaLib::Nvrtc => 1,
            CudaLib::CublasLt => 2,
        }
    }

    /// Whether cudarc's own search (the loader's path, by the names cudarc tries) finds the library. This only
    /// opens and closes the library; it never panics.
    pub fn loader_finds(self) -> bool {
        // SAFETY: each `is_culib_present` only `dlopen`s candidate names and drops the handles; loading a CUDA
        // library runs no initialisation that could conflict with anything (the driver initialises in `cuInit`).
        unsafe {
            match self {
                CudaLib::Driver => cudarc::driver::sys::is_culib_present(),
                CudaLib::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
                CudaLib::CublasLt => cudarc::cublaslt::sys::is_culib_present(),
            }
        }
    }

    /// Libraries of the same folder that this one opens by name at run time, loaded with it (file-name prefix;
    /// the `.alt.` variants NVIDIA ships beside them are not the ones opened).
    fn companions(self) -> Option<&'static str> {
        match self {
            CudaLib::Nvrtc => Some("libnvrtc-builtins.so."),
            CudaLib::Driver | CudaLib::CublasLt => None,
        }
    }

    fn search_dirs(self, places: &Places) -> Vec<PathBuf> {
        match self {
            CudaLib::Driver => places.driver_dirs(),
            CudaLib::Nvrtc | CudaLib::CublasLt => places.library_dirs(),
        }
    }

    fn search(self) -> Search {
        match self {
            CudaLib::Driver => Search::Driver,
            CudaLib::Nvrtc | CudaLib::CublasLt => Search::Libraries,
        }
    }
}

/// A library neither the loader nor [`Places`] provided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LibraryNotFound {
    pub lib: CudaLib,
    /// Every folder looked in.
    pub looked: Vec<PathBuf>,
    /// Library files found that failed to load, with the loader's message.
    pub failed: Vec<(PathBuf, String)>,
    /// What the folder list was built from.
    pub searched: String,
}

impl fmt::Display for LibraryNotFound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}) is not on the loader's path", self.lib.name(), self.lib.soname())?;
        if self.looked.is_empty() {
            write!(f, " and none of the folders it may be installed in exists")?;
        } else {
            write!(f, " and was not loaded from any of: ")?;
            for (i, d) in self.looked.iter().enumerate() {
                write!(f, "{}{}", if i == 0 { "" } else { ", " }, d.display())?;
            }
        }
        for (p, why) in &self.failed {
            write!(f, "; {} failed to load: {why}", p.display())?;
        }
        write!(f, " ({}; set LONGCTX_CUDA_LIB_DIRS to the folder that has it)", self.searched)
    }
}

impl std::error::Error for LibraryNotFound {}

/// Libraries known to be loadable by cudarc, one slot per [`CudaLib`].
static READY: [OnceLock<()>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
/// One search at a time, so that two threads do not load two copies.
static SEARCH: Mutex<()> = Mutex::new(());

/// Makes `lib` loadable by cudarc (see the module docs). Cheap after the first success.
pub(crate) fn ensure(lib: CudaLib) -> Result<(), LibraryNotFound> {
    if READY[lib.index()].get().is_some() {
        return Ok(());
    }
    // A poisoned lock only means another search panicked; the search itself holds no state.
    let _guard = SEARCH.lock().unwrap_or_else(|e| e.into_inner());
    if READY[lib.index()].get().is_some() {
        return Ok(());
    }
    if !lib.loader_finds() {
        let places = Places::from_process();
        let dirs = lib.search_dirs(&places);
        let loaded = load_from(lib, &dirs).map_err(|mut e| {
            e.searched = places.describe(lib.search());
            e
        })?;
        if !lib.loader_finds() {
            // Loaded, but cudarc's names still do not match it: its soname is not the one cudarc asks for.
            return Err(LibraryNotFound {
                lib,
                looked: dirs,
                failed: vec![(loaded, format!("loaded, but it does not answer to the name {}", lib.soname()))],
                searched: places.describe(lib.search()),
            });
        }
    }
    let _ = READY[lib.index()].set(());
    Ok(())
}

/// Loads `lib` (and its companions) from the first folder of `dirs` where it loads; returns its path. The
/// libraries stay loaded for the life of the process, as cudarc's own handles do.
pub(crate) fn load_from(lib: CudaLib, dirs: &[PathBuf]) -> Result<PathBuf, LibraryNotFound> {
    let mut failed = Vec::new();
    for dir in dirs {
        let path = dir.join(lib.soname());
        if !path.is_file() {
            continue;
        }
        match dlopen_global(&path) {
            Ok(()) => {
                if let Some(prefix) = lib.companions() {
                    for companion in companions(dir, prefix) {
                        // A companion that fails to load is reported by the library itself when it needs it
                        // (NVRTC's "failed to open libnvrtc-builtins"), with a clearer message than ours.
                        let _ = dlopen_global(&companion);
                    }
                }
                return Ok(path);
            }
            Err(why) => failed.push((path, why)),
        }
    }
    Err(LibraryNotFound { lib, looked: dirs.to_vec(), failed, searched: String::new() })
}

/// Files of `dir` whose name starts with `prefix`, without NVIDIA's `.alt.` variants, sorted.
fn companions(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with(prefix) && !n.contains(".alt.")))
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

/// `dlopen(path, RTLD_NOW | RTLD_GLOBAL)`, the handle kept open for the life of the process. `RTLD_NOW`
/// resolves every symbol at once, so a library with a missing dependency fails here, with the loader's message,
/// instead of in the middle of a later call.
fn dlopen_global(path: &Path) -> Result<(), String> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| "the path has a NUL byte".to_string())?;
    // SAFETY: `c` is a valid C string; dlopen runs the library's initialisers, which for NVIDIA's libraries
    // only set up their own state. The handle is deliberately never closed.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns null or a C string valid until the next dl* call on this thread.
        let msg = unsafe { libc::dlerror() };
        let why = if msg.is_null() {
            "dlopen failed".to_string()
        } else {
            // SAFETY: non-null, NUL-terminated, read before any other dl* call.
            unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned()
        };
        return Err(why);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::places::tests::TempDir;

    #[test]
    fn a_broken_library_is_reported_with_the_loaders_message() {
        let t = TempDir::new("libs-broken");
        let empty = t.mkdir("empty");
        let broken = t.file("broken/libnvrtc.so.13", b"not an ELF file");
        let err = load_from(CudaLib::Nvrtc, &[empty.clone(), broken.parent().unwrap().to_path_buf()]).unwrap_err();
        assert_eq!(err.looked.len(), 2);
        assert_eq!(err.failed.len(), 1);
        assert_eq!(err.failed[0].0, broken);
        let msg = err.to_string();
        assert!(msg.contains("libnvrtc.so.13"), "{msg}");
        assert!(msg.contains(&empty.display().to_string()), "{msg}");
        assert!(msg.contains("failed to load"), "{msg}");
    }

    #[test]
    fn nothing_found_says_so() {
        let err = load_from(CudaLib::CublasLt, &[]).unwrap_err();
        assert!(err.to_string().contains("none of the folders"), "{err}");
    }

    #[test]
    fn companions_skip_alt_variants() {
        let t = TempDir::new("libs-comp");
        t.file("lib/libnvrtc-builtins.so.13.0", b"");
        t.file("lib/libnvrtc-builtins.alt.so.13.0", b"");
        t.file("lib/libnvrtc.so.13", b"");
        let found = companions(&t.0.join("lib"), "libnvrtc-builtins.so.");
        assert_eq!(found, vec![t.0.join("lib/libnvrtc-builtins.so.13.0")]);
    }

    /// Asking for the driver never panics: where there is none (this machine), the answer is an error listing
    /// the folders; where there is one, success.
    #[test]
    fn the_driver_is_found_or_reported() {
        match ensure(CudaLib::Driver) {
            Ok(()) => assert!(CudaLib::Driver.loader_finds()),
            Err(e) => {
                assert_eq!(e.lib, CudaLib::Driver);
                assert!(e.to_string().contains("libcuda.so.1"), "{e}");
            }
        }
    }

    /// cuBLASLt from NVIDIA's wheel (`nvidia/cu13/lib` of a virtual environment, as on the GPU machines, where
    /// it is only in PyTorch's environment) loads with its dependencies and answers to its soname.
    #[test]
    fn wheel_cublaslt_is_found_by_soname() {
        match ensure(CudaLib::CublasLt) {
            Ok(()) => assert!(CudaLib::CublasLt.loader_finds()),
            Err(e) => eprintln!("skipped: {e}"),
        }
    }

    /// The wheel's NVRTC, loaded by full path from a folder the loader does not search, answers to its soname:
    /// cudarc's presence check (which `dlopen`s `libnvrtc.so.13` by name) succeeds afterwards, and a compile
    /// works, which needs the builtins library found the same way.
    #[test]
    fn wheel_nvrtc_is_found_by_soname() {
        match ensure(CudaLib::Nvrtc) {
            Ok(()) => {
                assert!(CudaLib::Nvrtc.loader_finds());
                let prog = cudarc::nvrtc::result::create_program(c"extern \"C\" __global__ void k() {}", None)
                    .expect("nvrtcCreateProgram");
                // SAFETY: `prog` was just created and is destroyed once, below.
                let compiled = unsafe { cudarc::nvrtc::result::compile_program(prog, &["--gpu-architecture=sm_90"]) };
                // SAFETY: as above.
                let log = unsafe { cudarc::nvrtc::result::get_program_log(prog) }.unwrap_or_default();
                // SAFETY: as above.
                unsafe { cudarc::nvrtc::result::destroy_program(prog) }.expect("nvrtcDestroyProgram");
                let log: Vec<u8> = log.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                assert!(compiled.is_ok(), "{compiled:?}: {}", String::from_utf8_lossy(&log));
            }
            Err(e) => {
                assert!(std::env::var("LONGCTX_REQUIRE_NVRTC").as_deref() != Ok("1"), "{e}");
                eprintln!("skipped: {e}");
            }
        }
    }
}
