//! Building and loading the emulator's libraries: each kernel source becomes one shared library made of its
//! translation unit (the same text NVRTC compiles, see [`translation_unit`]) compiled by the host C++ compiler with
//! `-DLONGCTX_EMU` and emu.h prepended, a generated registry of its kernels, and the runtime (runtime.cpp, compiled
//! once). One library per unit, not one for all: two units may define the same names, as two NVRTC modules may, and
//! each unit's `__shared__` variables are then its own library's TLS segment, which the runtime poisons per block.
//!
//! Everything is cached in `$LONGCTX_EMU_CACHE` or `<temp>/longctx-cuda-emu-<uid>`, keyed by a hash of what went
//! into it (the text, emu.h and the runtime, the compiler's `--version`, the flags), so a test process pays the
//! compiler once per change. Files are written under a temporary name and renamed, so processes building at once
//! only duplicate work. The default directory is private to the user (mode 0700, owner checked): a library loaded
//! from a directory others can write would run their code.

use std::collections::HashMap;
use std::collections::VecDeque;
use std::ffi::{c_void, CStr, CString};
use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::ffi::{self, AbiFn, EmuAbi, KernelsFn, RunFn};
use crate::cuda::device::KernelSource;
use crate::cuda::sources::translation_unit;
use crate::error::{KernelError, Result};

const EMU_H: &str = include_str!("emu.h");
const RUNTIME_CPP: &str = include_str!("runtime.cpp");
const TARGET: &str = "host emulator";
/// The `file` of errors that are not about one kernel source.
const RUNTIME_FILE: &str = "emulator runtime";

/// Flags of every compile. `-Wall -Werror` as NVRTC's log is checked for warnings too; `#pragma unroll` is CUDA's
/// and `threadIdx.x < n` with an `int n` is everywhere in CUDA code (NVRTC does not warn about either).
/// `-ffp-contract=off`: no fused multiply-adds, whatever the target, so results do not depend on the host CPU.
/// `-fstack-clash-protection`: a frame bigger than the guard page still touches it, so a fiber overflowing its stack
/// faults there instead of writing into the next fiber's header.
const COMMON_FLAGS: &[&str] = &[
    "-std=c++17",
    "-g",
    "-fPIC",
    "-pthread",
    "-Wall",
    "-Werror",
    "-Wno-unknown-pragmas",
    "-Wno-sign-compare",
    "-fno-strict-aliasing",
    "-ffp-contract=off",
    "-fvisibility=hidden",
    "-fstack-clash-protection",
    "-DLONGCTX_EMU",
];
/// Kernels at -O1: they compile fast and run fast enough (the time goes to the collectives, which are in the runtime).
const UNIT_FLAGS: &[&str] = &["-O1"];
const RUNTIME_FLAGS: &[&str] = &["-O2"];
const LINK_FLAGS: &[&str] = &["-shared", "-pthread", "-Wl,-z,now"];

/// One unit's library, loaded: its entry points and registry.
pub(super) struct Library {
    /// The kernel source it was built from.
    pub file: &'static str,
    pub run: RunFn,
    pub kernels: Vec<KernelInfo>,
    /// Bytes of the unit's `__shared__` variables.
    pub static_smem: usize,
    /// Guard bytes the runtime keeps on each side of a block's dynamic shared memory.
    pub dyn_guard: usize,
}

/// One kernel of a library's registry.
pub(super) struct KernelInfo {
    pub name: String,
    pub launch: unsafe extern "C" fn(*mut *mut c_void),
    /// `sizeof` of each parameter, in order.
    pub sizes: Vec<usize>,
    /// Each parameter's type, as the compiler spells it.
    pub types: Vec<String>,
}

/// Libraries already loaded by this process, by path (the path is the content's hash). Never unloaded: a library's
/// TLS may be live in threads we do not own, and the handle costs nothing.
static LOADED: OnceLock<Mutex<HashMap<PathBuf, Arc<Library>>>> = OnceLock::new();
/// Builds in this process take turns, so that two threads needing the same library compile it once.
static BUILD: Mutex<()> = Mutex::new(());

/// The libraries of `sources`, in order: loaded, built, or both, in the cache directory.
pub(super) fn build(sources: &[&'static KernelSource]) -> Result<Vec<Arc<Library>>> {
    build_in(sources, &cache_dir()?)
}

/// [`build`] with the cache in `dir`.
pub(super) fn build_in(sources: &[&'static KernelSource], dir: &Path) -> Result<Vec<Arc<Library>>> {
    let _turn = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let cxx = Compiler::from_env()?;
    let runtime_text = format!("#line 1 \"emu.h\"\n{EMU_H}\n#line 1 \"runtime.cpp\"\n{RUNTIME_CPP}\n");
    let runtime_key = hash(&[&cxx.version, &COMMON_FLAGS.join(" "), &RUNTIME_FLAGS.join(" "), &runtime_text]);
    let runtime_obj = dir.join(format!("runtime-{runtime_key}.o"));

    struct Unit {
        src: &'static KernelSource,
        text: String,
        lib: PathBuf,
    }
    let units: Vec<Unit> = sources
        .iter()
        .map(|&src| {
            let text = unit_text(src);
            let key = hash(&[
                &cxx.version,
                &COMMON_FLAGS.join(" "),
                &UNIT_FLAGS.join(" "),
                &LINK_FLAGS.join(" "),
                &runtime_key,
                &text,
            ]);
            Unit { src, text, lib: dir.join(format!("{}-{key}.so", stem(src.file))) }
        })
        .collect();

    // Compile what is missing, in parallel (the runtime and the units), then link. A unit's object is this
    // process's own (a temporary name, removed after the link): only the runtime's is shared, and never removed.
    let missing: Vec<&Unit> = units.iter().filter(|u| !u.lib.exists()).collect();
    let mut jobs = Vec::new();
    if !missing.is_empty() && !runtime_obj.exists() {
        let job = cxx.compile_job(RUNTIME_FILE, &runtime_text, RUNTIME_FLAGS, &runtime_obj.with_extension("cpp"))?;
        jobs.push(Job { out: Some(runtime_obj.clone()), ..job });
    }
    let mut objects = Vec::new();
    for u in &missing {
        let job = cxx.compile_job(u.src.file, &u.text, UNIT_FLAGS, &u.lib.with_extension("cpp"))?;
        objects.push(job.tmp.clone());
        jobs.push(job);
    }
    let compiled = run_jobs(jobs);
    let linked = compiled.and_then(|()| {
        let links = missing
            .iter()
            .zip(&objects)
            .map(|(u, obj)| {
                let tmp = temp_name(&u.lib);
                let mut cmd = cxx.command();
                cmd.args(LINK_FLAGS).arg("-o").arg(&tmp).arg(obj).arg(&runtime_obj);
                Job { file: u.src.file, cmd, tmp, out: Some(u.lib.clone()) }
            })
            .collect();
        run_jobs(links)
    });
    for obj in &objects {
        let _ = fs::remove_file(obj);
    }
    linked?;

    let loaded = LOADED.get_or_init(Default::default);
    units
        .iter()
        .map(|u| {
            let mut map = loaded.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(lib) = map.get(&u.lib) {
                return Ok(lib.clone());
            }
            let lib = Arc::new(load(u.src, &u.lib)?);
            map.insert(u.lib.clone(), lib.clone());
            Ok(lib)
        })
        .collect()
}

/// The text compiled for `src`: emu.h, the translation unit, the registry of its kernels.
fn unit_text(src: &KernelSource) -> String {
    let mut t = format!("#line 1 \"emu.h\"\n{EMU_H}\n");
    t.push_str(&translation_unit(src));
    t.push_str("#line 1 \"<emulator registry>\"\n");
    if src.kernels.is_empty() {
        t.push_str("static const ::emu::KernelEntry* const longctx_emu_kernel_table = nullptr;\n");
        t.push_str("static const unsigned int longctx_emu_kernel_count = 0;\n");
    } else {
        t.push_str("static const ::emu::KernelEntry longctx_emu_kernel_table[] = {\n");
        for k in src.kernels {
            t.push_str(&format!("    ::emu::KernelThunk<decltype(&{k}), &{k}>::entry(\"{k}\"),\n"));
        }
        t.push_str("};\n");
        t.push_str(&format!("static const unsigned int longctx_emu_kernel_count = {};\n", src.kernels.len()));
    }
    t.push_str(
        "extern \"C\" __attribute__((visibility(\"default\"))) const ::emu::KernelEntry* \
         longctx_emu_kernels(unsigned int* count) {\n    *count = longctx_emu_kernel_count;\n    \
         return longctx_emu_kernel_table;\n}\n",
    );
    t
}

/// A file name's stem made safe for a path.
fn stem(file: &str) -> String {
    let base = file.rsplit('/').next().unwrap_or(file);
    let base = base.strip_suffix(".cu").unwrap_or(base);
    base.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' }).collect()
}

/// FNV-1a over length-prefixed parts, 128 bits, as hex: a cache key (not a defence against collisions on purpose).
fn hash(parts: &[&str]) -> String {
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;
    let mut h: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    for p in parts {
        for b in (p.len() as u64).to_le_bytes().iter().chain(p.as_bytes()) {
            h ^= u128::from(*b);
            h = h.wrapping_mul(PRIME);
        }
    }
    format!("{h:032x}")
}

fn cache_dir() -> Result<PathBuf> {
    let err = |why: String| KernelError::Compile { file: RUNTIME_FILE, target: TARGET.into(), log: why };
    if let Some(dir) = std::env::var_os("LONGCTX_EMU_CACHE") {
        let dir = PathBuf::from(dir);
        fs::create_dir_all(&dir).map_err(|e| err(format!("creating the cache directory {}: {e}", dir.display())))?;
        return Ok(dir);
    }
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    let dir = std::env::temp_dir().join(format!("longctx-cuda-emu-{uid}"));
    match fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(err(format!("creating the cache directory {}: {e}", dir.display()))),
    }
    let meta = fs::symlink_metadata(&dir).map_err(|e| err(format!("{}: {e}", dir.display())))?;
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o022 != 0 {
        return Err(err(format!(
            "the cache directory {} is not a directory of this user (uid {uid}) that only it can write; remove it or \
             set LONGCTX_EMU_CACHE",
            dir.display()
        )));
    }
    Ok(dir)
}

/// A name next to `path` for writing it before the rename, unique across processes and threads.
fn temp_name(path: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".tmp-{}-{n}", std::process::id()));
    PathBuf::from(name)
}

/// Writes `path` atomically (a temporary file, then a rename).
fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = temp_name(path);
    fs::write(&tmp, text)?;
    fs::rename(&tmp, path)
}

/// The host C++ compiler: `$CXX` (words: a program and its arguments, e.g. `ccache g++`) or `c++`.
struct Compiler {
    program: String,
    args: Vec<String>,
    /// Its `--version` output, part of every cache key.
    version: String,
}

impl Compiler {
    fn from_env() -> Result<Self> {
        let spec = std::env::var("CXX").ok().filter(|s| !s.trim().is_empty()).unwrap_or_else(|| "c++".into());
        let mut words = spec.split_whitespace().map(String::from);
        let program = words.next().unwrap_or_else(|| "c++".into());
        let args: Vec<String> = words.collect();
        let out = Command::new(&program).args(&args).arg("--version").stdin(Stdio::null()).output();
        let version = match out {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
            Ok(o) => {
                return Err(KernelError::Compile {
                    file: RUNTIME_FILE,
                    target: TARGET.into(),
                    log: format!("`{spec} --version` failed: {}", String::from_utf8_lossy(&o.stderr)),
                })
            }
            Err(e) => {
                return Err(KernelError::Compile {
                    file: RUNTIME_FILE,
                    target: TARGET.into(),
                    log: format!("the host C++ compiler `{spec}` could not be run ({e}): install g++ or set CXX"),
                })
            }
        };
        Ok(Self { program, args, version })
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.program);
        c.args(&self.args).args(COMMON_FLAGS);
        c
    }

    /// A job compiling `text`, written to `cpp` (which debuggers then find), into an object of this process's own
    /// (the job's `tmp`, not renamed).
    fn compile_job(&self, file: &'static str, text: &str, flags: &[&str], cpp: &Path) -> Result<Job> {
        write_atomic(cpp, text).map_err(|e| KernelError::Compile {
            file,
            target: TARGET.into(),
            log: format!("writing {}: {e}", cpp.display()),
        })?;
        let tmp = temp_name(&cpp.with_extension("o"));
        let mut cmd = self.command();
        cmd.args(flags).arg("-c").arg(cpp).arg("-o").arg(&tmp);
        Ok(Job { file, cmd, tmp, out: None })
    }
}

/// One compiler run writing `tmp`, renamed to `out` (if any) when it succeeds.
struct Job {
    file: &'static str,
    cmd: Command,
    tmp: PathBuf,
    out: Option<PathBuf>,
}

/// Runs `jobs`, as many at once as the machine has cores; the first failure (in job order) is the error.
fn run_jobs(jobs: Vec<Job>) -> Result<()> {
    let parallel = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut pending: VecDeque<Job> = jobs.into();
    let mut running: VecDeque<(Job, std::io::Result<Child>)> = VecDeque::new();
    let mut first_err = None;
    while !pending.is_empty() || !running.is_empty() {
        while running.len() < parallel {
            let Some(mut job) = pending.pop_front() else { break };
            let child = job.cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
            running.push_back((job, child));
        }
        let Some((job, child)) = running.pop_front() else { break };
        let result = child.and_then(Child::wait_with_output);
        let err = match result {
            Ok(out) if out.status.success() => match &job.out {
                None => None,
                Some(dst) => fs::rename(&job.tmp, dst)
                    .err()
                    .map(|e| format!("renaming {} to {}: {e}", job.tmp.display(), dst.display())),
            },
            Ok(out) => Some(format!(
                "{}{}\n(command: {:?})",
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout),
                job.cmd
            )),
            Err(e) => Some(format!("running {:?}: {e}", job.cmd)),
        };
        if let Some(log) = err {
            let _ = fs::remove_file(&job.tmp);
            first_err.get_or_insert(KernelError::Compile { file: job.file, target: TARGET.into(), log });
        }
    }
    first_err.map_or(Ok(()), Err)
}

fn dlerror() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl* call on this thread.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".into()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// Opens the library at `path`, checks its ABI and reads its registry.
fn load(src: &'static KernelSource, path: &Path) -> Result<Library> {
    let err = |log: String| KernelError::Compile { file: src.file, target: TARGET.into(), log };
    let cpath = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| err(format!("{} has a NUL byte", path.display())))?;
    // SAFETY: dlopen with a valid path; the library's initialisers are the registry table's, which only take
    // addresses of its own functions.
    let handle = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(err(format!("loading {}: {}", path.display(), dlerror())));
    }
    let sym = |name: &CStr| -> Result<*mut c_void> {
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
        if p.is_null() {
            Err(err(format!("{} has no symbol {name:?}: {}", path.display(), dlerror())))
        } else {
            Ok(p)
        }
    };
    // SAFETY: these symbols are the runtime's and the registry's functions with exactly these signatures (ffi.rs
    // mirrors runtime.cpp and emu.h, built from this crate's text).
    let (abi_fn, kernels_fn, run) = unsafe {
        (
            std::mem::transmute::<*mut c_void, AbiFn>(sym(c"longctx_emu_abi")?),
            std::mem::transmute::<*mut c_void, KernelsFn>(sym(c"longctx_emu_kernels")?),
            std::mem::transmute::<*mut c_void, RunFn>(sym(c"longctx_emu_run")?),
        )
    };
    let mut abi = EmuAbi::default();
    // SAFETY: abi_fn writes one EmuAbi.
    unsafe { abi_fn(&mut abi) };
    if abi.version != ffi::ABI_VERSION
        || abi.fiber_region_bytes as usize != ffi::FIBER_REGION_BYTES
        || abi.fiber_header_bytes as usize != ffi::FIBER_HEADER_BYTES
    {
        return Err(err(format!(
            "{} was built for another emulator ABI (version {}, fiber regions of {} bytes)",
            path.display(),
            abi.version,
            abi.fiber_region_bytes
        )));
    }
    let mut count = 0;
    // SAFETY: the registry function returns `count` entries in static storage (or null for none).
    let entries = unsafe { kernels_fn(&mut count) };
    let mut kernels = Vec::with_capacity(count as usize);
    for i in 0..count as usize {
        // SAFETY: i < count; an entry's name and type names are NUL-terminated strings in static storage (literals,
        // __PRETTY_FUNCTION__), and its `sizes` and `types` arrays have `nparams` elements (emu.h, KernelThunk).
        let info = unsafe {
            let k = &*entries.add(i);
            let n = k.nparams as usize;
            KernelInfo {
                name: CStr::from_ptr(k.name).to_string_lossy().into_owned(),
                launch: k.launch,
                sizes: (0..n).map(|j| *k.sizes.add(j) as usize).collect(),
                types: (0..n).map(|j| type_from_pretty(&CStr::from_ptr(*k.types.add(j)).to_string_lossy())).collect(),
            }
        };
        kernels.push(info);
    }
    let expected: Vec<&str> = src.kernels.to_vec();
    let got: Vec<&str> = kernels.iter().map(|k| k.name.as_str()).collect();
    if expected != got {
        return Err(err(format!("the registry lists {got:?}, the source declares {expected:?}")));
    }
    Ok(Library {
        file: src.file,
        run,
        kernels,
        static_smem: abi.static_smem_bytes as usize,
        dyn_guard: abi.dyn_guard_bytes as usize,
    })
}

/// `float*` from `const char* emu::type_name() [with T = float*]`.
fn type_from_pretty(pretty: &str) -> String {
    match pretty.rfind("T = ") {
        Some(i) => pretty[i + 4..].trim_end_matches([']', ';', ' ']).to_string(),
        None => pretty.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_names() {
        assert_eq!(hash(&["a", "b"]), hash(&["a", "b"]));
        assert_ne!(hash(&["ab", ""]), hash(&["a", "b"]));
        assert_eq!(stem("attn/flash fwd.cu"), "flash_fwd");
        assert_eq!(type_from_pretty("const char* emu::type_name() [with T = const float*]"), "const float*");
    }
}
