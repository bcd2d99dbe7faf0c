//! The include folder NVRTC needs for `cuda_bf16.h` and `cuda_fp16.h`.
//!
//! NVRTC ships no CUDA headers of its own beyond its builtins: `#include <cuda_bf16.h>` without an include path
//! fails with "no directories in search list". The headers come with the toolkit (`/usr/local/cuda/include`) or
//! the `nvidia-cuda-runtime` wheel (`nvidia/cu13/include`); they are found at run time in the [`Places`] order,
//! `$LONGCTX_CUDA_INCLUDE` first. The folder must match NVRTC's version closely enough to compile (13.x headers
//! with NVRTC 13.x); nothing checks that beyond the compile itself.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::hash::Fnv128;
use super::places::{Places, Search};
use crate::error::KernelError;

/// The headers a folder must have.
pub(crate) const REQUIRED: &[&str] = &["cuda_bf16.h", "cuda_fp16.h"];

/// The headers whose text a compile depends on: the [`REQUIRED`] ones and the definitions they include (the
/// conversions and operators the kernels use), each where present.
const FINGERPRINTED: &[&str] = &["cuda_bf16.h", "cuda_bf16.hpp", "cuda_fp16.h", "cuda_fp16.hpp"];

/// A hash of the names, sizes and bytes of the [`FINGERPRINTED`] headers in `dir`, for the compile cache's key
/// (nvrtc.rs): the headers' content, not the folder's path, so that a cache filled on one machine serves another
/// with the same headers (the GPU check's pack fills one here for the H200 machine, whose folder differs). Read once
/// per folder and process. A header that cannot be read hashes as absent (the compile then says what is wrong).
pub(crate) fn fingerprint(dir: &Path) -> u128 {
    static SEEN: OnceLock<std::sync::Mutex<Vec<(PathBuf, u128)>>> = OnceLock::new();
    let seen = SEEN.get_or_init(Default::default);
    if let Some((_, f)) = seen.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(d, _)| d == dir) {
        return *f;
    }
    let mut h = Fnv128::new();
    for name in FINGERPRINTED {
        h.part(name.as_bytes());
        match std::fs::read(dir.join(name)) {
            Ok(text) => h.part(&text),
            Err(_) => h.part(b"(absent)"),
        }
    }
    let f = h.finish();
    seen.lock().unwrap_or_else(|e| e.into_inner()).push((dir.to_path_buf(), f));
    f
}

/// No folder with the [`REQUIRED`] headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeadersNotFound {
    /// Every folder looked in.
    pub looked: Vec<PathBuf>,
    /// What the folder list was built from.
    pub searched: String,
}

impl HeadersNotFound {
    /// The error of compiling `file` for `target` without the headers: the log says every place looked in.
    pub fn into_compile_error(self, file: &'static str, target: &str) -> KernelError {
        let mut log = format!("{} were not found", REQUIRED.join(" and "));
        if self.looked.is_empty() {
            log.push_str(": none of the folders they may be installed in exists");
        } else {
            log.push_str(" in any of:");
            for d in &self.looked {
                log.push_str(&format!("\n  {}", d.display()));
            }
        }
        log.push_str(&format!(
            "\n({}; set LONGCTX_CUDA_INCLUDE to the folder that has them, e.g. the nvidia-cuda-runtime wheel's \
             nvidia/cu13/include)",
            self.searched
        ));
        KernelError::Compile { file, target: target.to_string(), log }
    }
}

/// The include folder for this process (found once, then remembered).
pub(crate) fn include_dir() -> Result<PathBuf, HeadersNotFound> {
    static FOUND: OnceLock<PathBuf> = OnceLock::new();
    if let Some(dir) = FOUND.get() {
        return Ok(dir.clone());
    }
    let places = Places::from_process();
    let dir = find(&places.include_dirs()).map_err(|mut e| {
        e.searched = places.describe(Search::Headers);
        e
    })?;
    Ok(FOUND.get_or_init(|| dir).clone())
}

/// The first of `dirs` that has every [`REQUIRED`] header.
pub(crate) fn find(dirs: &[PathBuf]) -> Result<PathBuf, HeadersNotFound> {
    dirs.iter()
        .find(|d| has_headers(d))
        .cloned()
        .ok_or_else(|| HeadersNotFound { looked: dirs.to_vec(), searched: String::new() })
}

fn has_headers(dir: &Path) -> bool {
    REQUIRED.iter().all(|h| dir.join(h).is_file())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::places::tests::TempDir;
    use std::ffi::OsStr;

    #[test]
    fn the_first_folder_with_both_headers_wins() {
        let t = TempDir::new("headers");
        let only_bf16 = t.mkdir("inc");
        t.file("inc/cuda_bf16.h", b"");
        t.file("usr/local/cuda/include/cuda_bf16.h", b"");
        t.file("usr/local/cuda/include/cuda_fp16.h", b"");
        t.file("usr/lib/python3.12/site-packages/nvidia/cu13/include/cuda_bf16.h", b"");
        t.file("usr/lib/python3.12/site-packages/nvidia/cu13/include/cuda_fp16.h", b"");
        let places = Places::for_test(&[("LONGCTX_CUDA_INCLUDE", only_bf16.as_os_str())], &t.0);
        assert_eq!(find(&places.include_dirs()).unwrap(), t.0.join("usr/local/cuda/include"));
    }

    #[test]
    fn the_fingerprint_is_of_the_headers_not_their_folder() {
        let t = TempDir::new("headers-fingerprint");
        for dir in ["a", "b", "c"] {
            t.file(&format!("{dir}/cuda_bf16.h"), b"bf16");
            t.file(&format!("{dir}/cuda_bf16.hpp"), b"bf16 definitions");
            t.file(&format!("{dir}/cuda_fp16.h"), b"fp16");
            t.file(&format!("{dir}/unrelated.h"), dir.as_bytes());
        }
        t.file("c/cuda_fp16.h", b"fp16 of another release");
        let (a, b, c) = (fingerprint(&t.0.join("a")), fingerprint(&t.0.join("b")), fingerprint(&t.0.join("c")));
        assert_eq!(a, b, "the same headers in two folders (another header differing)");
        assert_ne!(a, c, "one header differs");
        // A header present in one folder and absent from another.
        t.file("d/cuda_bf16.h", b"bf16");
        t.file("d/cuda_fp16.h", b"fp16");
        assert_ne!(a, fingerprint(&t.0.join("d")));
    }

    #[test]
    fn the_wheel_is_found_without_a_toolkit() {
        let t = TempDir::new("headers-wheel");
        let venv = t.mkdir("venv");
        t.file("venv/lib/python3.12/site-packages/nvidia/cu13/include/cuda_bf16.h", b"");
        t.file("venv/lib/python3.12/site-packages/nvidia/cu13/include/cuda_fp16.h", b"");
        let places = Places::for_test(&[("VIRTUAL_ENV", venv.as_os_str())], &t.0);
        assert_eq!(
            find(&places.include_dirs()).unwrap(),
            venv.join("lib/python3.12/site-packages/nvidia/cu13/include")
        );
    }

    #[test]
    fn missing_headers_are_a_compile_error_listing_every_place() {
        let t = TempDir::new("headers-missing");
        let a = t.mkdir("a");
        let b = t.mkdir("usr/local/cuda/include");
        let places = Places::for_test(&[("LONGCTX_CUDA_INCLUDE", OsStr::new(&a))], &t.0);
        let mut err = find(&places.include_dirs()).unwrap_err();
        err.searched = places.describe(Search::Headers);
        match err.into_compile_error("x.cu", "sm_90") {
            KernelError::Compile { file, target, log } => {
                assert_eq!((file, target.as_str()), ("x.cu", "sm_90"));
                assert!(log.contains("cuda_bf16.h"), "{log}");
                assert!(log.contains(&a.display().to_string()), "{log}");
                assert!(log.contains(&b.display().to_string()), "{log}");
                assert!(log.contains("LONGCTX_CUDA_INCLUDE"), "{log}");
            }
            other => panic!("{other:?}"),
        }
    }
}
