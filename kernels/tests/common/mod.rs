//! Shared by the kernels' test binaries: the backends a test runs on, and `test_device!`, which writes a test body
//! once over a [`Device`] and instantiates it per backend present (candle's `test_device!`):
//! - `cpu`: the CPU backend on every SIMD path this CPU supports, one after the other;
//! - `cuda_emulated` (feature `cuda`): the CUDA backend on the host emulator, which compiles our `.cu` kernels with
//!   the host C++ compiler; skipped, saying why, when there is none;
//! - `cuda` (feature `cuda`): the CUDA backend on device 0; skipped, saying why, when there is no GPU, unless
//!   `LONGCTX_REQUIRE_GPU=1` (set it on GPU machines, so that a broken setup fails instead of skipping).
//!
//! The emulator runs one fiber per CUDA thread, so its instances get smaller shapes and fewer cases: a [`Device`]
//! carries its budget ([`Device::config`], [`Device::cases`]).
#![allow(dead_code)] // each test binary uses its own part

use std::ops::Deref;

use longctx_kernels::cpu::SimdPath;
use longctx_kernels::testing::conformance::{self, Config, Family, Limits};
use longctx_kernels::{Backend, CpuBackend};

/// Which backend a [`Device`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The CPU backend on one SIMD path.
    Cpu(SimdPath),
    /// The CUDA backend on the host emulator.
    CudaEmulated,
    /// The CUDA backend on a GPU.
    Cuda,
}

/// A backend under test with its budget. Derefs to the backend, so a body calls `dev.linear_forward(...)` or
/// hands `&**dev` to what takes a `&dyn Backend`.
pub struct Device {
    backend: Box<dyn Backend>,
    kind: Kind,
}

impl Deref for Device {
    type Target = dyn Backend;
    fn deref(&self) -> &Self::Target {
        self.backend.as_ref()
    }
}

impl Device {
    /// Which backend this is.
    pub fn kind(&self) -> Kind {
        self.kind
    }
    /// The backend.
    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }
    /// The conformance suite's configuration for this backend: the full budget on the CPU and the GPU (`cases`
    /// from `PROPTEST_CASES` when set, for soak runs), a small one on the emulator; the seed from
    /// `PROPTEST_RNG_SEED` when set (scripts/test sets it), so a run is reproducible and another seed explores.
    pub fn config(&self) -> Config {
        let mut cfg = match self.kind {
            Kind::CudaEmulated => Config::quick().with_cases(12),
            Kind::Cpu(_) | Kind::Cuda => Config::default().with_cases(cases_from_env(32)),
        };
        if let Some(seed) = std::env::var("PROPTEST_RNG_SEED").ok().and_then(|s| s.parse().ok()) {
            cfg = cfg.with_seed(seed);
        }
        cfg
    }
    /// The limits of this backend's shapes.
    pub fn limits(&self) -> Limits {
        self.config().limits
    }
    /// `cpu` proptest cases on the CPU and the GPU, a quarter of them (at least 2) on the emulator.
    pub fn cases(&self, cpu: u32) -> u32 {
        match self.kind {
            Kind::CudaEmulated => (cpu / 4).max(2),
            _ => cases_from_env(cpu),
        }
    }
    /// Runs the conformance suite's `families` on this backend, panicking with the failure (the op, the shrunk
    /// case and the error) or printing the report's one-line-per-property summary.
    pub fn conformance(&self, families: &[Family]) {
        match conformance::check(self.backend(), &self.config(), families) {
            Ok(report) => eprintln!("{} ({:?}): {report}", self.name(), self.kind),
            Err(failure) => panic!("{:?}: {failure}", self.kind),
        }
    }
}

/// `PROPTEST_CASES` from the environment when set (for soak runs), else `default`.
pub fn cases_from_env(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// The CPU backend on each SIMD path this CPU supports.
pub fn cpus() -> Vec<Device> {
    SimdPath::supported()
        .into_iter()
        .map(|simd| {
            let cpu = CpuBackend::new().with_simd(simd);
            assert_eq!(cpu.simd(), simd, "{simd:?} is listed as supported");
            Device { backend: Box::new(cpu), kind: Kind::Cpu(simd) }
        })
        .collect()
}

/// The CUDA backend on the host emulator, or `None` (saying why) when there is no host C++ compiler to build it
/// with. With a compiler, a backend that fails to build is a failure.
#[cfg(feature = "cuda")]
pub fn cuda_emulated(test: &str) -> Option<Device> {
    cuda_emulated_backend(test).map(|b| Device { backend: Box::new(b), kind: Kind::CudaEmulated })
}

/// [`cuda_emulated`]'s backend itself, for tests of what only `CudaBackend` has.
#[cfg(feature = "cuda")]
pub fn cuda_emulated_backend(test: &str) -> Option<longctx_kernels::CudaBackend> {
    let cxx = std::env::var("CXX").ok().filter(|s| !s.trim().is_empty()).unwrap_or_else(|| "c++".into());
    let mut words = cxx.split_whitespace();
    let program = words.next().unwrap_or("c++");
    let runs =
        std::process::Command::new(program).args(words).arg("--version").output().is_ok_and(|o| o.status.success());
    if !runs {
        eprintln!(
            "{test}: cuda_emulated skipped: the host C++ compiler `{cxx}` cannot be run (install g++ or set CXX)"
        );
        return None;
    }
    match longctx_kernels::CudaBackend::emulated() {
        Ok(b) => Some(b),
        Err(e) => panic!("{test}: the emulated CUDA backend does not build: {e}"),
    }
}

/// The CUDA backend on device 0, or `None` (saying why) when there is no GPU, unless `LONGCTX_REQUIRE_GPU=1`.
#[cfg(feature = "cuda")]
pub fn cuda(test: &str) -> Option<Device> {
    cuda_backend(test).map(|b| Device { backend: Box::new(b), kind: Kind::Cuda })
}

/// [`cuda`]'s backend itself, for tests of what only `CudaBackend` has.
#[cfg(feature = "cuda")]
pub fn cuda_backend(test: &str) -> Option<longctx_kernels::CudaBackend> {
    match longctx_kernels::CudaBackend::new(0) {
        Ok(b) => {
            eprintln!("{test}: cuda on {}", b.device_name());
            Some(b)
        }
        Err(longctx_kernels::KernelError::NoDevice { why, .. }) => {
            if std::env::var("LONGCTX_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{test}: LONGCTX_REQUIRE_GPU=1 but there is no device: {why}");
            }
            eprintln!("{test}: cuda skipped, no GPU: {why}");
            None
        }
        Err(e) => panic!("{test}: {e}"),
    }
}

/// Without the `cuda` feature there is no CUDA instance; on a machine that must test one, that is a failure.
pub fn require_gpu_feature() {
    if cfg!(not(feature = "cuda")) && std::env::var("LONGCTX_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("LONGCTX_REQUIRE_GPU=1 but this build has no `cuda` feature: the CUDA instances are not compiled");
    }
}

/// `test_device!(body, ...)`: for each `fn body(dev: &Device)`, a module `body` with the tests `cpu`,
/// `cuda_emulated` and `cuda` (the last two with the `cuda` feature), each running `body` on the backends of its
/// kind that are present (see the module docs). Filter with `cargo test cuda_emulated`, `cargo test body::`.
macro_rules! test_device {
    ($($body:ident),+ $(,)?) => {
        $(
            mod $body {
                #[test]
                fn cpu() {
                    $crate::common::require_gpu_feature();
                    for dev in $crate::common::cpus() {
                        super::$body(&dev);
                    }
                }

                #[cfg(feature = "cuda")]
                #[test]
                fn cuda_emulated() {
                    if let Some(dev) = $crate::common::cuda_emulated(concat!(stringify!($body), "::cuda_emulated")) {
                        super::$body(&dev);
                    }
                }

                #[cfg(feature = "cuda")]
                #[test]
                fn cuda() {
                    if let Some(dev) = $crate::common::cuda(concat!(stringify!($body), "::cuda")) {
                        super::$body(&dev);
                    }
                }
            }
        )+
    };
}
