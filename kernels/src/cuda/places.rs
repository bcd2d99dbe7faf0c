//! Where CUDA's libraries and headers may be installed: the folders [`libraries`](super::libraries) loads
//! shared libraries from and [`headers`](super::headers) looks for `cuda_bf16.h` in.
//!
//! A machine may have the CUDA toolkit (`/usr/local/cuda`, `$CUDA_HOME`), NVIDIA's Python wheels (PyTorch's
//! virtual environment on the GPU machines: `…/site-packages/nvidia/cu13/{lib,include}`; CUDA 12's wheels use one
//! folder per package, `nvidia/cuda_nvrtc/lib`, `nvidia/cublas/lib`), or both. Nothing here runs Python: the
//! environments are found from `$VIRTUAL_ENV`, `$CONDA_PREFIX`, `$PYTHONPATH`, `/opt/*/.venv`, `/opt/*/venv`,
//! `/opt/conda`, `~/.local`, `/usr/local` and `/usr`, which costs a few directory listings.
//!
//! Order (first match wins): the folders the user names (`$LONGCTX_CUDA_LIB_DIRS`, `$LONGCTX_CUDA_INCLUDE`), then
//! the toolkit, then the wheels.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

/// The environment variables this module reads.
const VARS: &[&str] = &[
    "LONGCTX_CUDA_LIB_DIRS",
    "LONGCTX_CUDA_INCLUDE",
    "CUDA_HOME",
    "CUDA_PATH",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "PYTHONPATH",
    "HOME",
];

/// A snapshot of the environment and of the file-system roots to search, so that tests can point every root at
/// a temporary folder instead of changing the process's environment.
#[derive(Debug, Clone)]
pub(crate) struct Places {
    vars: HashMap<String, OsString>,
    /// Where `*/.venv`, `*/venv` and `conda` are looked for (`/opt`).
    opt: PathBuf,
    /// The toolkit's default location (`/usr/local/cuda`).
    cuda_default: PathBuf,
    /// Python prefixes of the system (`/usr/local`, `/usr`).
    system_prefixes: Vec<PathBuf>,
    /// Extra folders for the driver library (`/usr/lib/wsl/lib` on WSL).
    driver_extra: Vec<PathBuf>,
}

impl Places {
    /// The process's environment and the real roots.
    pub fn from_process() -> Self {
        let vars = VARS.iter().filter_map(|&k| std::env::var_os(k).map(|v| (k.to_string(), v))).collect();
        Self {
            vars,
            opt: PathBuf::from("/opt"),
            cuda_default: PathBuf::from("/usr/local/cuda"),
            system_prefixes: vec![PathBuf::from("/usr/local"), PathBuf::from("/usr")],
            driver_extra: vec![PathBuf::from("/usr/lib/wsl/lib")],
        }
    }

    /// `vars` as the environment and every root under `root` (`root/opt`, `root/usr/local/cuda`, …).
    #[cfg(test)]
    pub fn for_test(vars: &[(&str, &OsStr)], root: &Path) -> Self {
        Self {
            vars: vars.iter().map(|(k, v)| (k.to_string(), v.to_os_string())).collect(),
            opt: root.join("opt"),
            cuda_default: root.join("usr/local/cuda"),
            system_prefixes: vec![root.join("usr/local"), root.join("usr")],
            driver_extra: vec![root.join("usr/lib/wsl/lib")],
        }
    }

    fn var(&self, name: &str) -> Option<&OsStr> {
        self.vars.get(name).map(OsString::as_os_str).filter(|v| !v.is_empty())
    }

    /// The colon-separated folders in `name`, empty entries dropped.
    fn var_list(&self, name: &str) -> Vec<PathBuf> {
        self.var(name)
            .map(|v| std::env::split_paths(v).filter(|p| !p.as_os_str().is_empty()).collect())
            .unwrap_or_default()
    }

    /// Toolkit roots: `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`.
    fn toolkits(&self) -> Vec<PathBuf> {
        let mut roots: Vec<PathBuf> =
            ["CUDA_HOME", "CUDA_PATH"].iter().filter_map(|k| self.var(k)).map(PathBuf::from).collect();
        roots.push(self.cuda_default.clone());
        roots
    }

    /// Folders that may hold `nvidia/…` wheels' contents: `$PYTHONPATH` entries (a `pip install --target`
    /// folder is one), then every `site-packages`/`dist-packages` under the Python prefixes.
    fn site_packages(&self) -> Vec<PathBuf> {
        let mut roots = self.var_list("PYTHONPATH");
        let mut prefixes: Vec<PathBuf> = Vec::new();
        for k in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
            if let Some(v) = self.var(k) {
                prefixes.push(PathBuf::from(v));
            }
        }
        for env in subdirs(&self.opt) {
            prefixes.push(env.join(".venv"));
            prefixes.push(env.join("venv"));
            // `/opt/conda` itself is a prefix.
            prefixes.push(env);
        }
        if let Some(home) = self.var("HOME") {
            prefixes.push(Path::new(home).join(".local"));
        }
        prefixes.extend(self.system_prefixes.iter().cloned());
        for prefix in prefixes {
            for lib in ["lib", "lib64"] {
                for python in subdirs(&prefix.join(lib)) {
                    let is_python3 =
                        python.file_name().and_then(OsStr::to_str).is_some_and(|n| n.starts_with("python3"));
                    if is_python3 {
                        roots.push(python.join("site-packages"));
                        roots.push(python.join("dist-packages"));
                    }
                }
            }
        }
        roots
    }

    /// `nvidia/cu13/<leaf>` (CUDA 13's wheels), then `nvidia/*/<leaf>` (CUDA 12's, one folder per package) under
    /// every site-packages folder.
    fn wheels(&self, leaf: &str) -> Vec<PathBuf> {
        let mut dirs = Vec::new();
        for root in self.site_packages() {
            let nvidia = root.join("nvidia");
            dirs.push(nvidia.join("cu13").join(leaf));
            for package in subdirs(&nvidia) {
                if package.file_name() != Some(OsStr::new("cu13")) {
                    dirs.push(package.join(leaf));
                }
            }
        }
        dirs
    }

    /// Folders to load NVRTC and cuBLASLt from, in order, existing ones only, each once.
    pub fn library_dirs(&self) -> Vec<PathBuf> {
        let mut dirs = self.var_list("LONGCTX_CUDA_LIB_DIRS");
        for t in self.toolkits() {
            dirs.push(t.join("lib64"));
            dirs.push(t.join("lib"));
        }
        // conda installs the CUDA libraries straight into the prefix's `lib`.
        if let Some(conda) = self.var("CONDA_PREFIX") {
            dirs.push(Path::new(conda).join("lib"));
        }
        dirs.extend(self.wheels("lib"));
        existing_unique(dirs)
    }

    /// Folders to load the driver (`libcuda.so.1`) from when the loader does not find it: the user's folders and
    /// WSL's. The driver is not part of the toolkit or of a wheel (the toolkit's `lib64/stubs/libcuda.so` only
    /// satisfies the linker and fails every call), so nothing else is tried.
    pub fn driver_dirs(&self) -> Vec<PathBuf> {
        let mut dirs = self.var_list("LONGCTX_CUDA_LIB_DIRS");
        dirs.extend(self.driver_extra.iter().cloned());
        existing_unique(dirs)
    }

    /// Folders that may hold `cuda_bf16.h`, in order, existing ones only, each once.
    pub fn include_dirs(&self) -> Vec<PathBuf> {
        let mut dirs = self.var_list("LONGCTX_CUDA_INCLUDE");
        for t in self.toolkits() {
            dirs.push(t.join("include"));
        }
        if let Some(conda) = self.var("CONDA_PREFIX") {
            dirs.push(Path::new(conda).join("include"));
        }
        dirs.extend(self.wheels("include"));
        existing_unique(dirs)
    }

    /// For messages: the variables and roots behind the folders of `what`, so that a user whose folder is
    /// missing from the list sees why.
    pub fn describe(&self, what: Search) -> String {
        let user = match what {
            Search::Driver => {
                return format!(
                    "searched: $LONGCTX_CUDA_LIB_DIRS, {}; the driver library comes with the NVIDIA driver, not \
                     with the toolkit or a wheel",
                    self.driver_extra.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
                )
            }
            Search::Libraries => "$LONGCTX_CUDA_LIB_DIRS",
            Search::Headers => "$LONGCTX_CUDA_INCLUDE",
        };
        let mut s =
            format!("searched: {user}, $CUDA_HOME, $CUDA_PATH, {}, $CONDA_PREFIX, ", self.cuda_default.display());
        s.push_str("NVIDIA wheels (nvidia/cu13, nvidia/*) under $PYTHONPATH, $VIRTUAL_ENV, $CONDA_PREFIX, ");
        s.push_str(&format!("{0}/*/.venv, {0}/*/venv, {0}/*, ~/.local", self.opt.display()));
        for p in &self.system_prefixes {
            s.push_str(&format!(", {}", p.display()));
        }
        s
    }
}

/// What a [`Places::describe`] message is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Search {
    Driver,
    Libraries,
    Headers,
}

/// The sub-folders of `dir`, sorted by name (a missing or unreadable folder has none).
fn subdirs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut dirs: Vec<PathBuf> = entries.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_dir()).collect();
    dirs.sort();
    dirs
}

/// The folders of `dirs` that exist, in order, the first of each kept.
fn existing_unique(dirs: Vec<PathBuf>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for d in dirs {
        if d.is_dir() && !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A fresh folder under the system's temporary folder, removed on drop.
    pub(crate) struct TempDir(pub PathBuf);

    impl TempDir {
        pub fn new(tag: &str) -> Self {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static N: AtomicUsize = AtomicUsize::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("longctx-{tag}-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("creating a temporary folder");
            Self(dir)
        }
        /// Creates `rel` (and its parents) as an empty folder and returns its path.
        pub fn mkdir(&self, rel: &str) -> PathBuf {
            let p = self.0.join(rel);
            std::fs::create_dir_all(&p).expect("creating a folder");
            p
        }
        /// Writes `bytes` to `rel` (creating parents) and returns its path.
        pub fn file(&self, rel: &str, bytes: &[u8]) -> PathBuf {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().expect("a parent")).expect("creating a folder");
            std::fs::write(&p, bytes).expect("writing a file");
            p
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn library_dirs_user_first_then_toolkit_then_wheels() {
        let t = TempDir::new("places");
        let user = t.mkdir("mine/lib");
        let home_tk = t.mkdir("cudahome/lib64");
        let default_tk = t.mkdir("usr/local/cuda/lib64");
        let venv_cu13 = t.mkdir("venv/lib/python3.12/site-packages/nvidia/cu13/lib");
        let venv_cu12 = t.mkdir("venv/lib/python3.12/site-packages/nvidia/cublas/lib");
        let opt = t.mkdir("opt/torch/.venv/lib/python3.11/site-packages/nvidia/cu13/lib");
        let target = t.mkdir("target/nvidia/cu13/lib");
        let _not_python = t.mkdir("venv/lib/perl5/site-packages/nvidia/cu13/lib");
        let places = Places::for_test(
            &[
                ("LONGCTX_CUDA_LIB_DIRS", OsStr::new(&format!("{}::/does/not/exist", user.display()))),
                ("CUDA_HOME", t.0.join("cudahome").as_os_str()),
                ("VIRTUAL_ENV", t.0.join("venv").as_os_str()),
                ("PYTHONPATH", t.0.join("target").as_os_str()),
            ],
            &t.0,
        );
        let dirs = places.library_dirs();
        assert_eq!(dirs, vec![user, home_tk, default_tk, target, venv_cu13, venv_cu12, opt]);
    }

    #[test]
    fn driver_dirs_are_the_users_and_wsl_only() {
        let t = TempDir::new("places-driver");
        let user = t.mkdir("mine");
        let wsl = t.mkdir("usr/lib/wsl/lib");
        t.mkdir("usr/local/cuda/lib64/stubs");
        let places = Places::for_test(&[("LONGCTX_CUDA_LIB_DIRS", user.as_os_str())], &t.0);
        assert_eq!(places.driver_dirs(), vec![user, wsl]);
    }

    #[test]
    fn include_dirs_in_order() {
        let t = TempDir::new("places-inc");
        let user = t.mkdir("inc");
        let tk = t.mkdir("usr/local/cuda/include");
        let wheel = t.mkdir("usr/lib/python3.12/dist-packages/nvidia/cu13/include");
        // Debian's system packages: `python3` sorts before `python3.12`.
        let debian = t.mkdir("usr/lib/python3/dist-packages/nvidia/cuda_runtime/include");
        let places = Places::for_test(&[("LONGCTX_CUDA_INCLUDE", user.as_os_str())], &t.0);
        assert_eq!(places.include_dirs(), vec![user, tk, debian, wheel]);
    }

    #[test]
    fn empty_variables_are_ignored() {
        let t = TempDir::new("places-empty");
        let places =
            Places::for_test(&[("LONGCTX_CUDA_LIB_DIRS", OsStr::new("")), ("CUDA_HOME", OsStr::new(""))], &t.0);
        assert!(places.library_dirs().is_empty());
        assert!(places.describe(Search::Libraries).contains("$CUDA_HOME"));
        assert!(places.describe(Search::Headers).contains("$LONGCTX_CUDA_INCLUDE"));
        assert!(places.describe(Search::Driver).contains("wsl"));
    }
}
