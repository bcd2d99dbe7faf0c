//! Where a run computes: `cpu`, `cuda:N` or `cuda-emulated`, named by the recipe (`parallel.backend`) or the command line
//! (`--device`, which overrides it), and [`backend`], the one function that builds the kernels' backend for it.
//! Everything else (the ranks, `longctx eval`, the MFU peak) takes the backend it makes.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use longctx_kernels::{Backend, CpuBackend};

use crate::error::{Result, TrainError};

/// A device to compute on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The host's cores ([`CpuBackend`]).
    #[default]
    Cpu,
    /// The NVIDIA GPU of this ordinal ([`CudaBackend`](longctx_kernels::CudaBackend); the trainer's `cuda` feature).
    Cuda(usize),
    /// The CUDA backend's kernels and device memory on its host emulator
    /// ([`CudaBackend::emulated`](longctx_kernels::CudaBackend::emulated); the kernels' `cuda` feature and a host C++
    /// compiler): the GPU path's code without a GPU, far slower than the CPU backend. For tests, and for checking
    /// that a recipe runs on the GPU path before a GPU is at hand.
    CudaEmulated,
}

/// A device string that is neither `cpu` nor `cuda:N`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{value}` is not a device (cpu; cuda:N for the GPU of ordinal N, e.g. cuda:0; cuda for cuda:LOCAL_RANK; cuda-emulated)"
)]
pub struct ParseDeviceError {
    /// The string given.
    pub value: String,
}

impl FromStr for Device {
    type Err = ParseDeviceError;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let bad = || ParseDeviceError { value: s.to_string() };
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(local_rank())),
            "cuda-emulated" => Ok(Device::CudaEmulated),
            _ => {
                let ordinal = s.strip_prefix("cuda:").ok_or_else(bad)?;
                // Digits only: `usize::from_str` would also take `+0`.
                if ordinal.is_empty() || !ordinal.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                ordinal.parse().map(Device::Cuda).map_err(|_| bad())
            }
        }
    }
}

/// The process's rank on its machine, from `LOCAL_RANK` (set by `longctx-launch` and torchrun), else 0: `cuda`
/// without an ordinal is the GPU of that ordinal, so that one recipe gives each process of a launch a GPU of its own
/// (as torchrun users write `cuda:{LOCAL_RANK}`).
fn local_rank() -> usize {
    std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
            Device::CudaEmulated => f.write_str("cuda-emulated"),
        }
    }
}

/// The backend every rank of a run on `device` computes through. `threads` sizes the CPU backend's pool (0:
/// rayon's global pool); a CUDA backend runs on its own stream of the device.
///
/// Errors: [`TrainError::CudaNotCompiled`] for `cuda:N` in a build without the `cuda` feature; the kernels'
/// [`KernelError::NoDevice`](longctx_kernels::KernelError::NoDevice) when no driver or no device of that ordinal is
/// found; for `cuda-emulated`, the kernels' `NotCompiled` without their `cuda` feature, `Compile` when the host
/// compiler cannot build the kernels.
pub fn backend(device: Device, threads: usize) -> Result<Arc<dyn Backend>> {
    match device {
        Device::Cpu => Ok(Arc::new(if threads > 0 { CpuBackend::with_threads(threads)? } else { CpuBackend::new() })),
        Device::Cuda(ordinal) => cuda(ordinal),
        Device::CudaEmulated => Ok(longctx_kernels::CudaBackend::emulated()?.into_shared()),
    }
}

/// Errors unless this build can compute on `device` ([`TrainError::CudaNotCompiled`] for `cuda:N` without the
/// `cuda` feature): what a command checks before any work, since the backend itself is built by each rank.
pub fn check_compiled(device: Device) -> Result<()> {
    match device {
        Device::Cuda(ordinal) if !cfg!(feature = "cuda") => Err(TrainError::CudaNotCompiled { ordinal }),
        _ => Ok(()),
    }
}

/// The backends of a run's thread ranks. On a GPU (or the emulator) they are streams of one device handle
/// ([`Backend::fork`]): the ranks of a process then share the device's memory pool, so memory one rank frees
/// another reuses, and the pool's high-water mark ([`Backend::device_memory`]) is the process's device peak. On the
/// CPU each rank gets a backend of its own with `threads` kernel threads, so ranks do not contend for one pool.
pub struct RankBackends {
    device: Device,
    threads: usize,
    /// The device handle the ranks fork (none for the CPU).
    shared: Option<Arc<dyn Backend>>,
}

impl RankBackends {
    /// The ranks' backends on `device` (errors as [`backend`]).
    pub fn new(device: Device, threads: usize) -> Result<Self> {
        let shared = match device {
            Device::Cpu => None,
            _ => Some(backend(device, threads)?),
        };
        Ok(Self { device, threads, shared })
    }

    /// A backend for one more rank.
    pub fn for_rank(&self) -> Result<Arc<dyn Backend>> {
        match &self.shared {
            Some(device) => Ok(device.fork()?),
            None => backend(self.device, self.threads),
        }
    }
}

/// The CUDA backend on the GPU of `ordinal`.
#[cfg(feature = "cuda")]
fn cuda(ordinal: usize) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(longctx_kernels::CudaBackend::new(ordinal)?))
}

/// A build without the `cuda` feature has no CUDA backend (the kernels' stub type computes nothing).
#[cfg(not(feature = "cuda"))]
fn cuda(ordinal: usize) -> Result<Arc<dyn Backend>> {
    Err(TrainError::CudaNotCompiled { ordinal })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for (s, d) in [
            ("cpu", Device::Cpu),
            ("cuda:0", Device::Cuda(0)),
            ("cuda:12", Device::Cuda(12)),
            ("cuda-emulated", Device::CudaEmulated),
        ] {
            assert_eq!(s.parse::<Device>(), Ok(d));
            assert_eq!(d.to_string(), s);
        }
        // `cuda` is the GPU of this process's LOCAL_RANK (the test process has none unless launched).
        let local = std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        assert_eq!("cuda".parse::<Device>(), Ok(Device::Cuda(local)));
        for s in ["", "gpu", "cuda:", "cuda:+1", "cuda:-1", "cuda:x", "CPU", " cpu", "cuda "] {
            assert_eq!(s.parse::<Device>(), Err(ParseDeviceError { value: s.into() }), "{s:?}");
        }
    }

    /// Two ranks' backends on a device share its memory pool: what one allocates shows in the other's stats, and
    /// the pool's high-water mark counts both. On the emulator (whose memory is one per process anyway) and on a
    /// GPU, where each `CudaBackend::new` would make a pool of its own.
    mod rank_backends_share_one_device_pool {
        use super::*;
        use longctx_kernels::DType;

        fn check(device: Device) {
            let backends = RankBackends::new(device, 1).expect("the device opened once already");
            let (a, b) = (backends.for_rank().unwrap(), backends.for_rank().unwrap());
            let before = b.device_memory().expect("a device backend reports its pool").used;
            let x = a.zeros(DType::F32, longctx_kernels::Dims::new(&[1 << 18]).unwrap()).unwrap();
            let during = b.device_memory().unwrap();
            assert!(during.used >= before + (1 << 20), "{during:?} after 1 MiB on the other rank (from {before})");
            assert!(during.used_high >= during.used);
            drop(x);
            a.synchronize().unwrap();
        }

        #[test]
        fn cuda_emulated() {
            match backend(Device::CudaEmulated, 1) {
                Ok(_) => check(Device::CudaEmulated),
                Err(e) => eprintln!("rank_backends_share_one_device_pool::cuda_emulated: skipped: {e}"),
            }
        }

        #[test]
        fn cuda() {
            match backend(Device::Cuda(0), 1) {
                Ok(_) => check(Device::Cuda(0)),
                Err(e) if std::env::var("LONGCTX_REQUIRE_GPU").as_deref() == Ok("1") => {
                    panic!("rank_backends_share_one_device_pool::cuda: LONGCTX_REQUIRE_GPU=1 but: {e}")
                }
                Err(e) => eprintln!("rank_backends_share_one_device_pool::cuda: skipped, no GPU: {e}"),
            }
        }

        #[test]
        fn cpu_has_no_device_pool() {
            let backends = RankBackends::new(Device::Cpu, 1).unwrap();
            assert!(backends.for_rank().unwrap().device_memory().is_none());
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_a_typed_error() {
        assert!(matches!(check_compiled(Device::Cuda(3)), Err(TrainError::CudaNotCompiled { .. })));
        check_compiled(Device::Cpu).unwrap();
        let e = backend(Device::Cuda(0), 0).unwrap_err();
        assert!(matches!(e, TrainError::CudaNotCompiled { ordinal: 0 }), "{e}");
        assert!(e.to_string().contains("--features cuda"), "{e}");
    }
}
