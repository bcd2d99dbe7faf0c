//! Compiling kernel sources with NVRTC, to CUBIN for one real architecture, with a cache in memory and on disk.
//!
//! [`compile`] takes a [`KernelSource`] and an architecture (`sm_80`, `sm_90`, `sm_90a`: a real one, so that the
//! result is machine code for exactly that GPU and the driver never JIT-compiles PTX, whose version could be
//! newer than the driver accepts) and returns the CUBIN, the PTX (for checks: every kernel the source lists must
//! be an `.entry` of it) and NVRTC's log, whose warnings are kept (the test `nvrtc_compiles_every_source` fails on
//! any). Nothing here needs a GPU: CI compiles every source with the NVRTC of the `nvidia-cuda-nvrtc` wheel.
//!
//! NVRTC 13 itself opens `libcuda.so.1` when one is there and calls its `cuInit` and `cuGetExportTable` (seen in
//! its imports, and when the test driver stand-in lacked the latter: NVRTC crashed), so compiling involves the
//! driver on a GPU machine; nothing here depends on it.
//!
//! Options: `--gpu-architecture=<arch> --std=c++17 -lineinfo --include-path=<cuda headers>`. `-lineinfo` costs
//! nothing at run time and lets `compute-sanitizer` and `ncu` name source lines; `--use_fast_math` is not used
//! (a kernel that wants fast intrinsics calls them by name). Kernels are `extern "C" __global__`, so their names
//! are not mangled and no `-default-device` is needed.
//!
//! The cache: in memory per key, and on disk under `$LONGCTX_CUDA_CACHE` (`off` or empty: no disk cache), else
//! `$XDG_CACHE_HOME/longctx/cuda`, else `~/.cache/longctx/cuda`. The key is a 128-bit hash of the translation
//! unit, the options but the include folder's path, the CUDA headers' content ([`headers::fingerprint`]), the
//! architecture and NVRTC's version, so a changed source, header or NVRTC misses, and a cache filled on one machine
//! serves another with the same NVRTC release and headers wherever they lie: `scripts/gpu-check --pack` fills one
//! with NVIDIA's wheels here and ships it with those headers, so the GPU machine compiles nothing. Files are written to a temporary name and renamed into place (atomic on one file
//! system), so a reader sees a whole entry or none; each carries its key and a checksum, and an entry that cannot
//! be read or does not check out is compiled again and overwritten, never an error.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::sys;

use super::device::KernelSource;
use super::hash::Fnv128;
use super::headers;
use super::libraries::{self, CudaLib};
use super::sources::translation_unit;
use crate::error::{KernelError, Result};

/// The result of one compile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Compiled {
    /// The architecture compiled for (`sm_90`).
    pub arch: String,
    /// Machine code for `arch`, for `cuModuleLoadData`.
    pub cubin: Vec<u8>,
    /// The PTX the CUBIN was assembled from.
    pub ptx: String,
    /// NVRTC's messages (warnings) of a successful compile; empty when there were none.
    pub log: String,
}

/// Compiles `src` for `arch` through the process's cache (see the module docs).
pub(crate) fn compile(src: &KernelSource, arch: &str) -> Result<Arc<Compiled>> {
    static GLOBAL: OnceLock<Compiler> = OnceLock::new();
    GLOBAL.get_or_init(|| Compiler::new(cache_dir_from_env())).compile(src, arch)
}

/// The disk cache folder the environment asks for (see the module docs); `None` disables it.
pub(crate) fn cache_dir_from_env() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    match std::env::var_os("LONGCTX_CUDA_CACHE") {
        Some(v) if v.is_empty() || v == "off" => None,
        Some(v) => Some(PathBuf::from(v)),
        None => var("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|c| c.join("longctx").join("cuda")),
    }
}

/// Checks that `arch` names a real architecture: `sm_` followed by its number and an optional `a`/`f` (the
/// architecture-specific and family-specific feature sets, e.g. `sm_90a` for `wgmma`).
pub(crate) fn check_arch(arch: &str) -> Result<()> {
    let digits = arch.strip_prefix("sm_").map(|rest| rest.strip_suffix(['a', 'f']).unwrap_or(rest));
    if digits.is_some_and(|d| (2..=3).contains(&d.len()) && d.bytes().all(|b| b.is_ascii_digit())) {
        Ok(())
    } else {
        Err(KernelError::InvalidArgument {
            name: "arch",
            why: format!("`{arch}` is not a real GPU architecture such as sm_80, sm_90 or sm_90a"),
        })
    }
}

/// The architecture to compile `src` for on a device whose kernels are compiled for `device_arch`: that one, except
/// for the sm_90a-only sources ([`super::sources::needs_sm90a`]), which get `sm_90a` on an sm_90 device (and an
/// error naming the source on any other), and the sources of plain sm_90 PTX ([`super::sources::needs_sm90`]), an
/// error below sm_90.
pub(crate) fn arch_for(src: &KernelSource, device_arch: &str) -> Result<String> {
    if !super::sources::needs_sm90a(src) {
        // A source of sm_90 PTX (ptx_tma.cuh) on an older device: refused here, with the reason, rather than by
        // NVRTC's #error.
        let digits: String = device_arch.trim_start_matches("sm_").chars().take_while(|c| c.is_ascii_digit()).collect();
        let old = digits.parse::<u32>().is_ok_and(|cc| cc < 90);
        if super::sources::needs_sm90(src) && old {
            return Err(KernelError::Compile {
                file: src.file,
                target: device_arch.to_string(),
                log: format!(
                    "{} uses the TMA and mbarriers (ptx_tma.cuh), which need sm_90; this device is {device_arch}",
                    src.file
                ),
            });
        }
        return Ok(device_arch.to_string());
    }
    match device_arch {
        "sm_90" | "sm_90a" => Ok("sm_90a".to_string()),
        other => Err(KernelError::Compile {
            file: src.file,
            target: other.to_string(),
            log: format!("{} uses wgmma (ptx_hopper.cuh), which only sm_90a has; this device is {other}", src.file),
        }),
    }
}

/// Compiles every source a device compiling for `device_arch` launches (the sm_90a-only attention kernels too on
/// sm_90; not the probes, which only their tests launch) through the process's cache, on as many threads as the
/// machine has, and returns how many. Needs no GPU: [`CudaBackend::precompile`](crate::CudaBackend::precompile).
pub(crate) fn compile_all(device_arch: &str) -> Result<usize> {
    check_arch(device_arch)?;
    // Largest sources first (a fair proxy for NVRTC's time), so that the slow ones do not start last.
    let mut sources: Vec<&'static KernelSource> = super::sources::SOURCES.to_vec();
    if arch_for(&super::ops::attention::FORWARD_WGMMA, device_arch).is_ok() {
        sources.extend([&super::ops::attention::FORWARD_WGMMA, &super::ops::attention::BACKWARD_WGMMA]);
    }
    sources.sort_by_key(|src| std::cmp::Reverse(src.code.len()));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(sources.len());
    let next = AtomicUsize::new(0);
    let failed = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                while let Some(src) = sources.get(next.fetch_add(1, Ordering::Relaxed)) {
                    // Fills the process's cache (and the disk's), where the first launch will find it.
                    if let Err(e) = arch_for(src, device_arch).and_then(|a| compile(src, &a)) {
                        failed.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
                    }
                }
            });
        }
    });
    match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(sources.len()),
    }
}

/// NVRTC's options for `arch` with the CUDA headers in `include`.
pub(crate) fn options(arch: &str, include: &Path) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "-lineinfo".to_string(),
        format!("--include-path={}", include.display()),
    ]
}

/// The names of the kernels (`.entry`) a PTX module defines.
pub(crate) fn ptx_entries(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|line| {
            let rest = line.split(".entry").nth(1)?;
            let name = rest.trim_start().split(|c: char| c == '(' || c.is_whitespace()).next()?;
            (!name.is_empty()).then_some(name)
        })
        .collect()
}

/// Checks that every kernel `src` lists is an entry of `ptx`.
pub(crate) fn check_entries(src: &KernelSource, arch: &str, ptx: &str) -> Result<()> {
    let entries = ptx_entries(ptx);
    for name in src.kernels {
        if !entries.contains(name) {
            return Err(KernelError::Compile {
                file: src.file,
                target: arch.to_string(),
                log: format!(
                    "kernel `{name}` is listed for {} but the compiled module has no entry of that name (entries: {})",
                    src.file,
                    entries.join(", ")
                ),
            });
        }
    }
    Ok(())
}

/// NVRTC's version `(major, minor)`.
pub(crate) fn nvrtc_version() -> std::result::Result<(i32, i32), String> {
    libraries::ensure(CudaLib::Nvrtc).map_err(|e| e.to_string())?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loadable (above); the two pointers are valid for writes.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(|e| format!("nvrtcVersion: {e:?}"))?;
    Ok((major, minor))
}

/// A compiler with its own caches: [`compile`] uses one per process; tests make their own.
#[derive(Debug)]
pub(crate) struct Compiler {
    memory: Mutex<HashMap<u128, Arc<Compiled>>>,
    disk: Option<DiskCache>,
    /// How many times NVRTC actually ran (the cache tests count misses with it).
    runs: AtomicUsize,
}

impl Compiler {
    /// A compiler caching on disk under `disk` (none: memory only).
    pub fn new(disk: Option<PathBuf>) -> Self {
        Self { memory: Mutex::new(HashMap::new()), disk: disk.map(|dir| DiskCache { dir }), runs: AtomicUsize::new(0) }
    }

    /// How many times NVRTC ran.
    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::Relaxed)
    }

    /// `src` compiled for `arch`, from the memory cache, else the disk cache, else NVRTC.
    pub fn compile(&self, src: &KernelSource, arch: &str) -> Result<Arc<Compiled>> {
        check_arch(arch)?;
        let compile_err = |log: String| KernelError::Compile { file: src.file, target: arch.to_string(), log };
        let version = nvrtc_version().map_err(compile_err)?;
        let include = headers::include_dir().map_err(|e| e.into_compile_error(src.file, arch))?;
        let options = options(arch, &include);
        let tu = translation_unit(src);
        let key = cache_key(&tu, &options, arch, version, headers::fingerprint(&include));

        if let Some(hit) = self.memory.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(hit.clone());
        }
        let compiled = match self.disk.as_ref().and_then(|d| d.load(key)) {
            // An entry is only stored after its entries were checked, but the source's list of kernels is not
            // part of the key: check again.
            Some(c) if check_entries(src, arch, &c.ptx).is_ok() => c,
            _ => {
                self.runs.fetch_add(1, Ordering::Relaxed);
                let c = run_nvrtc(&tu, src.file, arch, &options)?;
                check_entries(src, arch, &c.ptx)?;
                if let Some(d) = &self.disk {
                    // The disk cache only saves time: a folder that cannot be written costs a compile next time.
                    let _ = d.store(key, &c);
                }
                c
            }
        };
        let compiled = Arc::new(compiled);
        self.memory.lock().unwrap_or_else(|e| e.into_inner()).insert(key, compiled.clone());
        Ok(compiled)
    }
}

/// Bumped when the key's recipe or the file layout changes, so old entries miss.
const CACHE_FORMAT: u32 = 2;
const MAGIC: &[u8; 8] = b"LCXCUBIN";

/// The cache key of one compile: the include folder enters by its headers' content (`headers`, from
/// [`headers::fingerprint`]), not by the path among the options.
pub(crate) fn cache_key(tu: &str, options: &[String], arch: &str, nvrtc: (i32, i32), headers: u128) -> u128 {
    let mut h = Fnv128::new();
    h.part(&CACHE_FORMAT.to_le_bytes());
    h.part(&nvrtc.0.to_le_bytes());
    h.part(&nvrtc.1.to_le_bytes());
    h.part(arch.as_bytes());
    h.part(&headers.to_le_bytes());
    let options: Vec<&String> = options.iter().filter(|o| !o.starts_with("--include-path=")).collect();
    h.part(&(options.len() as u64).to_le_bytes());
    for o in options {
        h.part(o.as_bytes());
    }
    h.part(tu.as_bytes());
    h.finish()
}

/// Compiled modules on disk, one file per key: `MAGIC | format | key | (len, bytes) × {arch, cubin, ptx, log} |
/// checksum of everything before it`.
#[derive(Debug, Clone)]
pub(crate) struct DiskCache {
    pub dir: PathBuf,
}

impl DiskCache {
    pub fn path(&self, key: u128) -> PathBuf {
        self.dir.join(format!("{key:032x}.cubin"))
    }

    /// The entry for `key`, or `None` when it is missing, unreadable, truncated, of another format or key, or
    /// fails its checksum.
    pub fn load(&self, key: u128) -> Option<Compiled> {
        let bytes = std::fs::read(self.path(key)).ok()?;
        decode(&bytes, key)
    }

    /// Writes the entry for `key` atomically (temporary file, then rename).
    pub fn store(&self, key: u128, c: &Compiled) -> std::io::Result<()> {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        std::fs::create_dir_all(&self.dir)?;
        let tmp =
            self.dir.join(format!(".{key:032x}.{}.{}.tmp", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed)));
        let result = std::fs::write(&tmp, encode(key, c)).and_then(|()| std::fs::rename(&tmp, self.path(key)));
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}

fn encode(key: u128, c: &Compiled) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + c.cubin.len() + c.ptx.len() + c.log.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&CACHE_FORMAT.to_le_bytes());
    out.extend_from_slice(&key.to_le_bytes());
    for field in [c.arch.as_bytes(), &c.cubin, c.ptx.as_bytes(), c.log.as_bytes()] {
        out.extend_from_slice(&(field.len() as u64).to_le_bytes());
        out.extend_from_slice(field);
    }
    let mut h = Fnv128::new();
    h.write(&out);
    out.extend_from_slice(&h.finish().to_le_bytes());
    out
}

fn decode(bytes: &[u8], key: u128) -> Option<Compiled> {
    let body_len = bytes.len().checked_sub(16)?;
    let (body, sum) = bytes.split_at(body_len);
    let mut h = Fnv128::new();
    h.write(body);
    if h.finish().to_le_bytes() != sum {
        return None;
    }
    let mut rest = body.strip_prefix(MAGIC)?;
    let mut take = |n: usize| -> Option<&[u8]> {
        if rest.len() < n {
            return None;
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Some(head)
    };
    if take(4)? != CACHE_FORMAT.to_le_bytes() || take(16)? != key.to_le_bytes() {
        return None;
    }
    let mut field = || -> Option<Vec<u8>> {
        let len = u64::from_le_bytes(take(8)?.try_into().ok()?);
        Some(take(usize::try_from(len).ok()?)?.to_vec())
    };
    let arch = String::from_utf8(field()?).ok()?;
    let cubin = field()?;
    let ptx = String::from_utf8(field()?).ok()?;
    let log = String::from_utf8(field()?).ok()?;
    if !rest.is_empty() || cubin.is_empty() {
        return None;
    }
    Some(Compiled { arch, cubin, ptx, log })
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed only here.
        let _ = unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

impl Program {
    /// The program's log (NUL dropped, trailing white space trimmed).
    fn log(&self) -> String {
        let mut size = 0usize;
        // SAFETY: a live program; `size` is valid for writes.
        if unsafe { sys::nvrtcGetProgramLogSize(self.0, &mut size) }.result().is_err() || size == 0 {
            return String::new();
        }
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` has the `size` bytes NVRTC asked for.
        if unsafe { sys::nvrtcGetProgramLog(self.0, buf.as_mut_ptr().cast::<c_char>()) }.result().is_err() {
            return String::new();
        }
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).trim_end().to_string()
    }

    /// One of NVRTC's outputs, through its size and copy functions.
    fn output(
        &self,
        what: &str,
        size_of: unsafe fn(sys::nvrtcProgram, *mut usize) -> sys::nvrtcResult,
        copy: unsafe fn(sys::nvrtcProgram, *mut c_char) -> sys::nvrtcResult,
    ) -> std::result::Result<Vec<u8>, String> {
        let mut size = 0usize;
        // SAFETY: a live, compiled program; `size` is valid for writes.
        unsafe { size_of(self.0, &mut size) }.result().map_err(|e| format!("nvrtcGet{what}Size: {e:?}"))?;
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` has the `size` bytes NVRTC asked for.
        unsafe { copy(self.0, buf.as_mut_ptr().cast::<c_char>()) }
            .result()
            .map_err(|e| format!("nvrtcGet{what}: {e:?}"))?;
        Ok(buf)
    }
}

/// Runs NVRTC on the translation unit `tu` of `file`.
fn run_nvrtc(tu: &str, file: &'static str, arch: &str, options: &[String]) -> Result<Compiled> {
    let err = |log: String| KernelError::Compile { file, target: arch.to_string(), log };
    let src = CString::new(tu).map_err(|_| err("the source has a NUL byte".to_string()))?;
    let name = CString::new(file).map_err(|_| err("the file name has a NUL byte".to_string()))?;
    let opts = options
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| err("an option has a NUL byte".to_string()))?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();

    let mut raw = std::ptr::null_mut();
    // SAFETY: NVRTC is loaded (the caller asked for its version); `src` and `name` outlive the program (NVRTC may
    // keep pointers into them until it is destroyed, which `Program` does before they drop); no headers are
    // passed (the translation unit has them inline).
    unsafe { sys::nvrtcCreateProgram(&mut raw, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null()) }
        .result()
        .map_err(|e| err(format!("nvrtcCreateProgram: {e:?}")))?;
    let prog = Program(raw);
    let n = c_int::try_from(opt_ptrs.len()).map_err(|_| err("too many options".to_string()))?;
    // SAFETY: a live program; `opt_ptrs` holds `n` valid C strings that outlive the call.
    let status = unsafe { sys::nvrtcCompileProgram(prog.0, n, opt_ptrs.as_ptr()) };
    let log = prog.log();
    match status {
        sys::nvrtcResult::NVRTC_SUCCESS => {}
        sys::nvrtcResult::NVRTC_ERROR_COMPILATION => return Err(err(log)),
        other => return Err(err(format!("nvrtcCompileProgram: {other:?}\n{log}"))),
    }
    let cubin = prog.output("CUBIN", sys::nvrtcGetCUBINSize, sys::nvrtcGetCUBIN).map_err(err)?;
    if cubin.is_empty() {
        return Err(err(format!("NVRTC produced no CUBIN for {arch} (is it a real architecture?)")));
    }
    let mut ptx = prog.output("PTX", sys::nvrtcGetPTXSize, sys::nvrtcGetPTX).map_err(err)?;
    if let Some(end) = ptx.iter().position(|&b| b == 0) {
        ptx.truncate(end);
    }
    let ptx = String::from_utf8(ptx).map_err(|_| err("NVRTC's PTX is not UTF-8".to_string()))?;
    Ok(Compiled { arch: arch.to_string(), cubin, ptx, log })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cuda::places::tests::TempDir;
    use crate::cuda::sources::{SM90A_SOURCES, SOURCES};

    /// Whether NVRTC and the CUDA headers are here; when not, says why on stderr, or fails when
    /// `LONGCTX_REQUIRE_NVRTC=1` (CI sets it once it has installed the wheels).
    pub(crate) fn nvrtc_or_skip(test: &str) -> bool {
        let missing = match (nvrtc_version(), headers::include_dir()) {
            (Ok(_), Ok(_)) => return true,
            (Err(e), _) => e,
            (_, Err(e)) => e.into_compile_error("-", "-").to_string(),
        };
        if std::env::var("LONGCTX_REQUIRE_NVRTC").as_deref() == Ok("1") {
            panic!("{test}: LONGCTX_REQUIRE_NVRTC=1 but NVRTC cannot compile here: {missing}");
        }
        eprintln!("{test}: skipped, NVRTC cannot compile here: {missing}");
        false
    }

    /// A unit of the shared headers and the CUDA headers alone.
    static HEADERS_ONLY: KernelSource = KernelSource {
        file: "headers_only.cu",
        code: r#"#include <cuda_bf16.h>
#include <cuda_fp16.h>
extern "C" __global__ void longctx_headers_only(float* out, const __nv_bfloat16* a, const __half* b) {
    out[threadIdx.x] = __bfloat162float(a[threadIdx.x]) + __half2float(b[threadIdx.x]);
}
"#,
        kernels: &["longctx_headers_only"],
        includes: &[],
    };

    /// The architectures the compile tests cover: `$LONGCTX_NVRTC_ARCHS` (comma-separated), else sm_80 and sm_90.
    /// The sm_90a-only sources ([`SM90A_SOURCES`]) are compiled for sm_90a whatever this list says; the others for
    /// sm_90a too cost as much again: `LONGCTX_NVRTC_ARCHS=sm_80,sm_90,sm_90a`.
    pub(crate) fn test_archs() -> Vec<String> {
        match std::env::var("LONGCTX_NVRTC_ARCHS") {
            Ok(list) if !list.trim().is_empty() => {
                list.split(',').map(|a| a.trim().to_string()).filter(|a| !a.is_empty()).collect()
            }
            _ => vec!["sm_80".to_string(), "sm_90".to_string()],
        }
    }

    /// One source compiled for one architecture by [`every_source_compiled`].
    pub(crate) struct TestCompile {
        pub arch: String,
        pub src: &'static KernelSource,
        pub result: Result<Compiled>,
    }

    /// Every source (and [`HEADERS_ONLY`]) compiled for every [`test_archs`] architecture, once per process: the
    /// tests that look at the results share them, since the two tensor-core attention sources take over a minute
    /// of NVRTC's time each per architecture. Compiled with `--ptxas-options=-v` (ptxas's report of each kernel's
    /// registers and stack, which [`warnings`] leaves out) on as many threads as the machine has (NVRTC compiles
    /// distinct programs concurrently), the slowest sources first.
    pub(crate) fn every_source_compiled() -> &'static [TestCompile] {
        static ALL: OnceLock<Vec<TestCompile>> = OnceLock::new();
        ALL.get_or_init(|| {
            let include = headers::include_dir().expect("nvrtc_or_skip checked the headers");
            let mut jobs: Vec<(String, &'static KernelSource)> = Vec::new();
            for arch in test_archs() {
                for src in SOURCES.iter().copied().chain([&HEADERS_ONLY]) {
                    jobs.push((arch.clone(), src));
                }
            }
            // The sm_90a-only sources, for sm_90a whatever the list says (they compile for nothing else).
            for src in SM90A_SOURCES.iter().copied() {
                jobs.push(("sm_90a".to_string(), src));
            }
            // Longest first (by source size, a fair proxy), so that the two slow sources do not start last.
            jobs.sort_by_key(|(_, src)| std::cmp::Reverse(src.code.len()));
            let next = AtomicUsize::new(0);
            let done = Mutex::new(Vec::new());
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(jobs.len());
            std::thread::scope(|s| {
                for _ in 0..threads {
                    s.spawn(|| {
                        while let Some((arch, src)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                            let started = std::time::Instant::now();
                            let mut opts = options(arch, &include);
                            opts.push("--ptxas-options=-v".into());
                            let result = check_arch(arch)
                                .and_then(|()| run_nvrtc(&translation_unit(src), src.file, arch, &opts))
                                .and_then(|c| check_entries(src, arch, &c.ptx).map(|()| c));
                            eprintln!("NVRTC {arch} {}: {:.1} s", src.file, started.elapsed().as_secs_f64());
                            let compiled = TestCompile { arch: arch.clone(), src, result };
                            done.lock().unwrap_or_else(|e| e.into_inner()).push(compiled);
                        }
                    });
                }
            });
            done.into_inner().unwrap_or_else(|e| e.into_inner())
        })
    }

    /// ptxas's `-v` report in an NVRTC log, as (entry function, line) for each line after the entry's name.
    pub(crate) fn ptxas_report(log: &str) -> Vec<(&str, &str)> {
        let mut entry = "";
        let mut out = Vec::new();
        for line in log.lines() {
            if let Some(at) = line.find("Compiling entry function '") {
                entry = line[at + 26..].split('\'').next().unwrap_or("");
            } else if !entry.is_empty() {
                out.push((entry, line));
            }
        }
        out
    }

    /// The lines of an NVRTC log that are not ptxas's `-v` report (`ptxas info …` and its indented `ptxas .`
    /// continuation lines): its warnings.
    pub(crate) fn warnings(log: &str) -> String {
        let info = |l: &str| {
            l.starts_with("ptxas info") || l.strip_prefix("ptxas").is_some_and(|r| r.trim_start().starts_with('.'))
        };
        log.lines().filter(|l| !l.trim().is_empty() && !info(l)).collect::<Vec<_>>().join("\n")
    }

    /// Every kernel source compiles for sm_80 and sm_90 (or `$LONGCTX_NVRTC_ARCHS`), and every sm_90a-only source
    /// for sm_90a, with no error, no warning, and every kernel it lists an entry of the module.
    #[test]
    fn nvrtc_compiles_every_source() {
        if !nvrtc_or_skip("nvrtc_compiles_every_source") {
            return;
        }
        let mut failures = Vec::new();
        for TestCompile { arch, src, result } in every_source_compiled() {
            match result {
                Ok(c) if !warnings(&c.log).is_empty() => {
                    failures.push(format!("{} for {arch}: warnings:\n{}", src.file, warnings(&c.log)))
                }
                Ok(c) => {
                    assert_eq!(&c.arch, arch);
                    // An ELF object for NVIDIA's machine (EM_CUDA = 190), not PTX text.
                    assert!(c.cubin.starts_with(b"\x7fELF") && c.cubin[18..20] == 190u16.to_le_bytes());
                }
                Err(e) => failures.push(e.to_string()),
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    }

    #[test]
    fn only_ptxas_reports_are_left_out_of_warnings() {
        let log =
            "ptxas info    : Compiling entry function 'k' for 'sm_90'\nptxas info    : Function properties for k\n\
                   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   x.cu(3): warning #177-D: variable \"unused\" was declared but never referenced\n\
                   ptxas warning : Registers are spilled to local memory\n";
        assert_eq!(
            warnings(log),
            "x.cu(3): warning #177-D: variable \"unused\" was declared but never referenced\n\
             ptxas warning : Registers are spilled to local memory"
        );
    }

    #[test]
    fn warnings_are_kept_in_the_log() {
        if !nvrtc_or_skip("warnings_are_kept_in_the_log") {
            return;
        }
        static WARNS: KernelSource = KernelSource {
            file: "warns.cu",
            code: "extern \"C\" __global__ void longctx_warns(float* out) { int unused = 3; out[0] = 1.0f; }\n",
            kernels: &["longctx_warns"],
            includes: &[],
        };
        let c = Compiler::new(None).compile(&WARNS, "sm_90").unwrap();
        assert!(c.log.contains("warning") && c.log.contains("warns.cu"), "{}", c.log);
    }

    #[test]
    fn an_error_names_the_file_and_line() {
        if !nvrtc_or_skip("an_error_names_the_file_and_line") {
            return;
        }
        static BAD: KernelSource = KernelSource {
            file: "bad.cu",
            code: "extern \"C\" __global__ void longctx_bad(float* out) {\n  out[0] = undeclared;\n}\n",
            kernels: &["longctx_bad"],
            includes: &[],
        };
        match Compiler::new(None).compile(&BAD, "sm_80") {
            Err(KernelError::Compile { file: "bad.cu", target, log }) => {
                assert_eq!(target, "sm_80");
                assert!(log.contains("bad.cu(2)") && log.contains("undeclared"), "{log}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_listed_kernel_missing_from_the_module_is_an_error() {
        if !nvrtc_or_skip("a_listed_kernel_missing_from_the_module_is_an_error") {
            return;
        }
        static MISSING: KernelSource = KernelSource {
            file: "missing.cu",
            code: "extern \"C\" __global__ void longctx_here(float* out) { out[0] = 1.0f; }\n",
            kernels: &["longctx_here", "longctx_not_here"],
            includes: &[],
        };
        let err = Compiler::new(None).compile(&MISSING, "sm_90").unwrap_err().to_string();
        assert!(err.contains("longctx_not_here") && err.contains("longctx_here"), "{err}");
    }

    /// A second compile of the same source is a memory hit; a new compiler on the same folder a disk hit; a
    /// corrupt entry is compiled again and rewritten.
    #[test]
    fn the_cache_hits_in_memory_and_on_disk_and_recovers_from_corruption() {
        if !nvrtc_or_skip("the_cache_hits_in_memory_and_on_disk_and_recovers_from_corruption") {
            return;
        }
        let t = TempDir::new("nvrtc-cache");
        let first = Compiler::new(Some(t.0.clone()));
        let a = first.compile(&HEADERS_ONLY, "sm_90").unwrap();
        let b = first.compile(&HEADERS_ONLY, "sm_90").unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(first.runs(), 1);
        let _ = first.compile(&HEADERS_ONLY, "sm_80").unwrap();
        assert_eq!(first.runs(), 2, "another architecture is another entry");

        let second = Compiler::new(Some(t.0.clone()));
        let c = second.compile(&HEADERS_ONLY, "sm_90").unwrap();
        assert_eq!(second.runs(), 0, "a disk hit");
        assert_eq!(*c, *a);

        let files: Vec<PathBuf> = std::fs::read_dir(&t.0).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(files.len(), 2, "{files:?}");
        for f in &files {
            let mut bytes = std::fs::read(f).unwrap();
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0x40;
            std::fs::write(f, &bytes).unwrap();
        }
        let third = Compiler::new(Some(t.0.clone()));
        let d = third.compile(&HEADERS_ONLY, "sm_90").unwrap();
        assert_eq!(third.runs(), 1, "a corrupt entry is compiled again");
        assert_eq!(d.cubin, a.cubin, "NVRTC is deterministic");
        let fourth = Compiler::new(Some(t.0.clone()));
        fourth.compile(&HEADERS_ONLY, "sm_90").unwrap();
        assert_eq!(fourth.runs(), 0, "and rewritten");
    }

    #[test]
    fn arch_names() {
        for ok in ["sm_80", "sm_90", "sm_90a", "sm_100a", "sm_120f"] {
            assert!(check_arch(ok).is_ok(), "{ok}");
        }
        for bad in ["compute_90", "sm_9", "sm_90aa", "sm_", "90", "sm_9x", "sm_1000"] {
            assert!(check_arch(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sm90a_only_sources_get_sm90a_on_sm90_and_an_error_elsewhere() {
        use crate::cuda::sources::WGMMA_PROBE;
        assert_eq!(arch_for(&WGMMA_PROBE, "sm_90").unwrap(), "sm_90a");
        assert_eq!(arch_for(&WGMMA_PROBE, "sm_90a").unwrap(), "sm_90a");
        let err = arch_for(&WGMMA_PROBE, "sm_80").unwrap_err().to_string();
        assert!(err.contains("wgmma_probe.cu") && err.contains("sm_90a"), "{err}");
        for src in SOURCES {
            assert_eq!(arch_for(src, "sm_80").unwrap(), "sm_80", "{}", src.file);
        }
    }

    #[test]
    fn sm90_sources_are_refused_below_sm90() {
        use crate::cuda::includes::PTX_TMA;
        static TMA_ONLY: KernelSource =
            KernelSource { file: "tma_only.cu", code: "", kernels: &[], includes: &[PTX_TMA] };
        assert_eq!(arch_for(&TMA_ONLY, "sm_90").unwrap(), "sm_90");
        assert_eq!(arch_for(&TMA_ONLY, "sm_100a").unwrap(), "sm_100a");
        let err = arch_for(&TMA_ONLY, "sm_80").unwrap_err().to_string();
        assert!(err.contains("tma_only.cu") && err.contains("sm_90"), "{err}");
    }

    #[test]
    fn ptx_entries_are_parsed() {
        let ptx =
            "//\n.version 9.0\n.visible .entry longctx_a(\n\t.param .u64 p\n)\n.entry longctx_b (\n)\n.func f()\n";
        assert_eq!(ptx_entries(ptx), vec!["longctx_a", "longctx_b"]);
        let src = KernelSource { file: "x.cu", code: "", kernels: &["longctx_a", "longctx_c"], includes: &[] };
        let err = check_entries(&src, "sm_90", ptx).unwrap_err().to_string();
        assert!(err.contains("longctx_c"), "{err}");
    }

    #[test]
    fn the_key_covers_every_input() {
        let opts = options("sm_90", Path::new("/inc"));
        let base = cache_key("tu", &opts, "sm_90", (13, 0), 7);
        assert_eq!(base, cache_key("tu", &opts, "sm_90", (13, 0), 7));
        assert_ne!(base, cache_key("tu ", &opts, "sm_90", (13, 0), 7));
        assert_ne!(base, cache_key("tu", &opts, "sm_80", (13, 0), 7));
        assert_ne!(base, cache_key("tu", &opts, "sm_90", (13, 1), 7));
        assert_ne!(base, cache_key("tu", &opts, "sm_90", (13, 0), 8), "other headers");
        assert_ne!(base, cache_key("tu", &[], "sm_90", (13, 0), 7), "other options");
        assert_ne!(cache_key("ab", &[], "", (0, 0), 0), cache_key("b", &["a".into()], "", (0, 0), 0));
        // The headers' folder enters by their content only: the same headers elsewhere hit.
        assert_eq!(base, cache_key("tu", &options("sm_90", Path::new("/elsewhere")), "sm_90", (13, 0), 7));
    }

    fn sample(tag: u8) -> Compiled {
        Compiled {
            arch: "sm_90".into(),
            cubin: (0..4096u32).map(|i| (i as u8) ^ tag).collect(),
            ptx: ".visible .entry k(\n)".into(),
            log: String::new(),
        }
    }

    #[test]
    fn disk_entries_round_trip_and_reject_damage() {
        let t = TempDir::new("disk-cache");
        let cache = DiskCache { dir: t.0.join("nested/cache") };
        assert!(cache.load(7).is_none(), "missing");
        let c = sample(1);
        cache.store(7, &c).unwrap();
        assert_eq!(cache.load(7), Some(c.clone()));
        assert!(cache.load(8).is_none(), "another key");

        // The file of key 7 under the name of key 8: its key does not match.
        std::fs::copy(cache.path(7), cache.path(8)).unwrap();
        assert!(cache.load(8).is_none());

        let good = std::fs::read(cache.path(7)).unwrap();
        for damage in
            [good[..good.len() - 1].to_vec(), good[..good.len() / 2].to_vec(), Vec::new(), b"garbage".to_vec(), {
                let mut b = good.clone();
                b[40] ^= 1;
                b
            }]
        {
            std::fs::write(cache.path(7), &damage).unwrap();
            assert!(cache.load(7).is_none(), "{} bytes", damage.len());
        }
        cache.store(7, &c).unwrap();
        assert_eq!(cache.load(7), Some(c));
    }

    /// Writers racing on one key never leave a reader a partial entry, and no temporary file is left behind.
    #[test]
    fn concurrent_writers_never_expose_a_partial_entry() {
        let t = TempDir::new("disk-race");
        let cache = DiskCache { dir: t.0.clone() };
        let c = sample(3);
        std::thread::scope(|s| {
            for _ in 0..6 {
                s.spawn(|| {
                    for _ in 0..30 {
                        cache.store(42, &c).unwrap();
                    }
                });
            }
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..200 {
                        if let Some(got) = cache.load(42) {
                            assert_eq!(got, c);
                        }
                    }
                });
            }
        });
        assert_eq!(cache.load(42), Some(c));
        let names: Vec<String> =
            std::fs::read_dir(&t.0).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names, vec![format!("{:032x}.cubin", 42u128)]);
    }

    #[test]
    fn the_cache_folder_follows_the_environment() {
        // Only reads the environment; the variables it depends on are not changed by any test.
        let dir = cache_dir_from_env();
        match std::env::var_os("LONGCTX_CUDA_CACHE") {
            Some(v) if v.is_empty() || v == "off" => assert!(dir.is_none()),
            Some(v) => assert_eq!(dir, Some(PathBuf::from(v))),
            None => assert!(dir.is_none_or(|d| d.ends_with("longctx/cuda"))),
        }
    }
}

/// The tensor-core attention kernels keep every fragment and accumulator in registers: ptxas (through NVRTC, no GPU
/// needed) reports no stack frame and no spills for any of them, for every architecture the compile tests cover
/// (sm_80 and sm_90; the wgmma ones for sm_90a, the only one they compile for). An array indexed at run time, or a register budget the compiler cannot meet, shows here as
/// local memory, which would cost those kernels most of their speed. Reads the compiles `nvrtc_compiles_every_source`
/// makes (with ptxas's report), so each source is compiled once.
#[cfg(test)]
mod register_budget {
    use super::tests::{every_source_compiled, nvrtc_or_skip, ptxas_report, TestCompile};

    #[test]
    fn tensor_core_attention_uses_no_local_memory() {
        if !nvrtc_or_skip("tensor_core_attention_uses_no_local_memory") {
            return;
        }
        use crate::cuda::ops::attention::{BACKWARD_TC, BACKWARD_WGMMA, FORWARD_TC, FORWARD_WGMMA};
        let tensor_core = [&FORWARD_TC, &BACKWARD_TC, &FORWARD_WGMMA, &BACKWARD_WGMMA];
        let mut seen = 0;
        for TestCompile { arch, src, result } in every_source_compiled() {
            if !tensor_core.iter().any(|tc| std::ptr::eq(*tc, *src)) {
                continue;
            }
            seen += 1;
            let c = result.as_ref().unwrap_or_else(|e| panic!("{e}"));
            for (entry, line) in ptxas_report(&c.log) {
                if line.contains("stack frame") {
                    assert!(
                        line.contains("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"),
                        "{arch} {entry}: {line}"
                    );
                }
                if line.contains("Used") && line.contains("registers") {
                    eprintln!("{arch} {entry}: {}", line.trim());
                }
            }
        }
        let want = 2 * super::tests::test_archs().len() + 2;
        assert_eq!(seen, want, "the mma.sync sources for every architecture, the wgmma ones for sm_90a");
    }
}

/// The Hopper kernels do on the machine what their PTX asks: every kernel of an sm_90a source whose PTX issues
/// `wgmma.mma_async` has `HGMMA` in its machine code (ptxas may otherwise lower or serialise what a kernel meant
/// for the tensor cores' asynchronous path), and no sm_90a kernel spills registers (ptxas's report). The machine
/// code is read with NVIDIA's `cuobjdump` and `nvdisasm` (scripts/cuda-wheels fetches them beside NVRTC, no GPU
/// needed): found as `$LONGCTX_CUOBJDUMP`, else in the `bin` folder beside each of `$LONGCTX_CUDA_LIB_DIRS`, else
/// on the `PATH`. Without them the machine-code half is skipped, saying so (failed under `LONGCTX_REQUIRE_NVRTC=1`,
/// as CI has them). Reads the compiles `nvrtc_compiles_every_source` makes.
#[cfg(test)]
mod hopper_machine_code {
    use std::path::PathBuf;
    use std::process::Command;

    use super::tests::{every_source_compiled, nvrtc_or_skip, ptxas_report, TestCompile};
    use crate::cuda::places::tests::TempDir;
    use crate::cuda::sources::needs_sm90a;

    /// `cuobjdump` and the folder it should find `nvdisasm` in, or why not.
    fn disassembler() -> Result<(PathBuf, Option<PathBuf>), String> {
        if let Some(p) = std::env::var_os("LONGCTX_CUOBJDUMP") {
            let p = PathBuf::from(p);
            let dir = p.parent().map(PathBuf::from);
            return Ok((p, dir));
        }
        let libs = std::env::var("LONGCTX_CUDA_LIB_DIRS").unwrap_or_default();
        for lib in libs.split(':').filter(|d| !d.is_empty()) {
            let bin = PathBuf::from(lib).join("../bin");
            if bin.join("cuobjdump").is_file() && bin.join("nvdisasm").is_file() {
                return Ok((bin.join("cuobjdump"), Some(bin)));
            }
        }
        match Command::new("cuobjdump").arg("--version").output() {
            Ok(o) if o.status.success() => Ok((PathBuf::from("cuobjdump"), None)),
            _ => Err(format!(
                "no cuobjdump: not $LONGCTX_CUOBJDUMP, not in the bin folder beside $LONGCTX_CUDA_LIB_DIRS ({libs:?}), \
                 not on the PATH"
            )),
        }
    }

    /// The machine code of `cubin`, by function name.
    fn sass(cubin: &[u8], tool: &(PathBuf, Option<PathBuf>)) -> Vec<(String, String)> {
        let dir = TempDir::new("sass");
        let file = dir.file("k.cubin", cubin);
        let mut cmd = Command::new(&tool.0);
        cmd.arg("--dump-sass").arg(&file);
        if let Some(bin) = &tool.1 {
            let path = std::env::var("PATH").unwrap_or_default();
            cmd.env("PATH", format!("{}:{path}", bin.display()));
        }
        let out = cmd.output().unwrap_or_else(|e| panic!("running {}: {e}", tool.0.display()));
        assert!(out.status.success(), "cuobjdump failed: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.split("Function : ")
            .skip(1)
            .map(|f| {
                let (name, body) = f.split_once('\n').unwrap_or((f, ""));
                (name.trim().to_string(), body.to_string())
            })
            .collect()
    }

    /// The names of the PTX entries whose bodies issue `wgmma.mma_async`.
    fn wgmma_entries(ptx: &str) -> Vec<String> {
        ptx.split(".entry ")
            .skip(1)
            .filter(|body| body.contains("wgmma.mma_async"))
            .filter_map(|body| body.split('(').next().map(|n| n.trim().to_string()))
            .collect()
    }

    #[test]
    fn wgmma_kernels_issue_hgmma_and_nothing_spills() {
        if !nvrtc_or_skip("wgmma_kernels_issue_hgmma_and_nothing_spills") {
            return;
        }
        let tool = match disassembler() {
            Ok(t) => Some(t),
            Err(e) if std::env::var("LONGCTX_REQUIRE_NVRTC").as_deref() == Ok("1") => {
                panic!("wgmma_kernels_issue_hgmma_and_nothing_spills: LONGCTX_REQUIRE_NVRTC=1 but {e}")
            }
            Err(e) => {
                eprintln!("wgmma_kernels_issue_hgmma_and_nothing_spills: machine code not checked: {e}");
                None
            }
        };
        let mut checked = 0;
        for TestCompile { arch, src, result } in every_source_compiled() {
            if !needs_sm90a(src) {
                continue;
            }
            let c = result.as_ref().unwrap_or_else(|e| panic!("{e}"));
            for (entry, line) in ptxas_report(&c.log) {
                if line.contains("spill stores") {
                    assert!(line.contains("0 bytes spill stores, 0 bytes spill loads"), "{arch} {entry}: {line}");
                }
            }
            let Some(tool) = &tool else { continue };
            let functions = sass(&c.cubin, tool);
            for name in wgmma_entries(&c.ptx) {
                let code = functions.iter().find(|(f, _)| *f == name).map(|(_, body)| body.as_str());
                let code = code.unwrap_or_else(|| panic!("{} {arch}: no machine code for {name}", src.file));
                let hgmma = code.lines().filter(|l| l.contains("HGMMA")).count();
                eprintln!("{} {arch} {name}: {hgmma} HGMMA", src.file);
                assert!(
                    hgmma > 0,
                    "{} {arch}: {name} issues wgmma in its PTX but no HGMMA in its machine code",
                    src.file
                );
                checked += 1;
            }
        }
        if tool.is_some() {
            assert!(checked > 0, "no sm_90a kernel issues wgmma (the wgmma probe does)");
        }
    }
}
