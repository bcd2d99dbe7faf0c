//! What the benchmarks' `--device` paths share: the device to run on, buffers of random values in its memory,
//! timing that is right for asynchronous work, and the Python peers.
//!
//! - `--device cpu|cuda|cuda-emulated` ([`DeviceKind`]): the CPU backend, the CUDA backend on GPU 0, or the CUDA
//!   backend on the host emulator (slow: tiny sizes only, a smoke test of the benchmark's code path).
//! - Timing ([`measure`]): a device's ops return before they have run, so the host clock around a call times its
//!   launch; [`Device::time`] uses the CUDA backend's events (`CudaBackend::time`) and the host clock on the CPU.
//!   Each figure is the median of repetitions after warm-up calls (which also compile kernels and fill the
//!   backend's memory pool), as many as fit a time budget.
//! - Inputs ([`random`]) are random, never zeros (which hide unwritten outputs and make some kernels faster);
//!   outputs are poisoned with NaN first ([`poisoned`]), and the benchmarks check that what they timed wrote
//!   finite values.
//! - The peers are Python scripts under `bench/` (`$LONGCTX_PEER_SCRIPTS`, else the repository's `bench/` as
//!   built), run with `$LONGCTX_PEER_PYTHON`, else `python3`.
#![allow(dead_code)] // each benchmark uses its own part

use std::path::PathBuf;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use longctx_kernels::{Backend, Buffer, CpuBackend, DType, Dims, KernelError, Result, View};
use rayon::prelude::*;

/// Which backend `--device` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU backend.
    Cpu,
    /// The CUDA backend on GPU 0.
    Cuda,
    /// The CUDA backend on the host emulator.
    CudaEmulated,
}

impl DeviceKind {
    /// `--device X` among `args` (default `cpu`).
    pub fn from_args(args: &[String]) -> std::result::Result<Self, String> {
        match args.iter().position(|a| a == "--device") {
            None => Ok(DeviceKind::Cpu),
            Some(i) => match args.get(i + 1).map(String::as_str) {
                Some("cpu") => Ok(DeviceKind::Cpu),
                Some("cuda") => Ok(DeviceKind::Cuda),
                Some("cuda-emulated") => Ok(DeviceKind::CudaEmulated),
                Some(other) => Err(format!("--device takes cpu, cuda or cuda-emulated, not `{other}`")),
                None => Err("--device needs a value: cpu, cuda or cuda-emulated".into()),
            },
        }
    }
}

/// The backend a benchmark runs on.
pub enum Device {
    /// The CPU backend.
    Cpu(CpuBackend),
    /// The CUDA backend (a GPU or the emulator).
    #[cfg(feature = "cuda")]
    Cuda(longctx_kernels::CudaBackend),
}

impl Device {
    /// Opens `kind`; on a CUDA device also compiles every kernel (NVRTC, in parallel, cached on disk), so that no
    /// timed call pays for it, and says how long that took on stderr. Errors: no device, or a build without the
    /// `cuda` feature ([`KernelError::NotCompiled`]).
    pub fn open(kind: DeviceKind) -> Result<Self> {
        match kind {
            DeviceKind::Cpu => Ok(Device::Cpu(CpuBackend::new())),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda | DeviceKind::CudaEmulated => {
                let b = if kind == DeviceKind::Cuda {
                    longctx_kernels::CudaBackend::new(0)?
                } else {
                    longctx_kernels::CudaBackend::emulated()?
                };
                let t = Instant::now();
                b.compile_kernels()?;
                eprintln!("# {}: kernels compiled in {:.1} s", b.device_name(), t.elapsed().as_secs_f64());
                Ok(Device::Cuda(b))
            }
            #[cfg(not(feature = "cuda"))]
            DeviceKind::Cuda | DeviceKind::CudaEmulated => {
                Err(KernelError::NotCompiled { backend: "cuda", feature: "cuda" })
            }
        }
    }

    /// The backend, to compute through.
    pub fn backend(&self) -> &dyn Backend {
        match self {
            Device::Cpu(b) => b,
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => b,
        }
    }

    /// What runs, for the table's header: the CPU's threads or the GPU's name and properties.
    pub fn describe(&self) -> String {
        match self {
            Device::Cpu(b) => format!("CPU, {} threads, {:?} kernels", rayon::current_num_threads(), b.simd()),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => b.device_name(),
        }
    }

    /// The attention kernels this device's backend runs (its path, and how the wgmma backward computes dQ), for a
    /// benchmark's title; empty on the CPU, which has one kind.
    pub fn attention_kernels(&self) -> String {
        match self {
            Device::Cpu(_) => String::new(),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => {
                format!("attention path {:?}, wgmma backward {:?}", b.attention_path(), b.wgmma_backward())
            }
        }
    }

    /// Whether this is the host emulator (for which a benchmark keeps its sizes tiny).
    pub fn is_emulated(&self) -> bool {
        match self {
            Device::Cpu(_) => false,
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => b.is_emulated(),
        }
    }

    /// How long the device took to run the ops `work` enqueues (see the module docs).
    pub fn time(&self, work: impl FnOnce() -> Result<()>) -> Result<Duration> {
        match self {
            Device::Cpu(_) => {
                let t = Instant::now();
                work()?;
                Ok(t.elapsed())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => b.time(work),
        }
    }

    /// Gives the memory the device's pool keeps back (before a peer process needs the GPU's memory).
    pub fn trim(&self) -> Result<()> {
        match self {
            Device::Cpu(_) => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => b.trim(),
        }
    }
}

/// A time per call: the median of `reps` repetitions, each timed on its own, after the warm-up.
#[derive(Debug, Clone, Copy)]
pub struct Timed {
    pub median: Duration,
    pub reps: usize,
}

impl Timed {
    /// Seconds per call.
    pub fn secs(&self) -> f64 {
        self.median.as_secs_f64()
    }
}

/// Times `f` on `dev`: `warmup` calls (at least one), then as many repetitions as fit `budget` at the speed the
/// last warm-up call ran (between `min_reps` and `max_reps`), each timed by [`Device::time`]; their median.
pub fn measure(
    dev: &Device,
    warmup: usize,
    budget: Duration,
    (min_reps, max_reps): (usize, usize),
    mut f: impl FnMut() -> Result<()>,
) -> Result<Timed> {
    let mut last = Duration::ZERO;
    for _ in 0..warmup.max(1) {
        last = dev.time(&mut f)?;
    }
    let fit = (budget.as_secs_f64() / last.as_secs_f64().max(1e-9)).floor() as usize;
    let reps = fit.clamp(min_reps.max(1), max_reps.max(min_reps).max(1));
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        times.push(dev.time(&mut f)?);
    }
    times.sort();
    let n = times.len();
    let median = if n % 2 == 1 { times[n / 2] } else { (times[n / 2 - 1] + times[n / 2]) / 2 };
    Ok(Timed { median, reps })
}

/// `n` values uniform in `[-scale, scale)`, from `seed`, generated on all threads (chunks seeded apart).
pub fn random_f32(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    const CHUNK: usize = 1 << 16;
    let mut out = vec![0f32; n];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| {
        // SplitMix64 of (seed, chunk) seeds an xorshift per chunk, so the values do not depend on the threads.
        let mut z = seed.wrapping_add((c as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let mut x = (z ^ (z >> 31)) | 1;
        for v in chunk {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *v = ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale;
        }
    });
    out
}

/// A buffer of `dtype` with `dims` in `dev`'s memory holding [`random_f32`] values (rounded to `dtype`).
pub fn random(dev: &Device, dtype: DType, dims: &[usize], seed: u64, scale: f32) -> Result<Buffer> {
    let dims = Dims::new(dims)?;
    let mut buf = dev.backend().empty(dtype, dims)?;
    let v = random_f32(dims.numel(), seed, scale);
    match dtype {
        DType::F32 => dev.backend().upload(buf.view_mut(), View::new(&v, dims)?)?,
        DType::Bf16 => {
            let h: Vec<bf16> = v.par_iter().map(|&x| bf16::from_f32(x)).collect();
            dev.backend().upload(buf.view_mut(), View::new(&h, dims)?)?
        }
        DType::F16 => {
            let h: Vec<f16> = v.par_iter().map(|&x| f16::from_f32(x)).collect();
            dev.backend().upload(buf.view_mut(), View::new(&h, dims)?)?
        }
    }
    Ok(buf)
}

/// A buffer of `dtype` with `dims` in `dev`'s memory filled with NaN: an output that a timed op must overwrite.
pub fn poisoned(dev: &Device, dtype: DType, dims: &[usize]) -> Result<Buffer> {
    let mut buf = dev.backend().empty(dtype, Dims::new(dims)?)?;
    dev.backend().fill(buf.view_mut(), f32::NAN)?;
    Ok(buf)
}

/// Checks that `views` (outputs of `what`) hold only finite values: `Σ x²` over them, on the device.
pub fn check_finite(dev: &Device, what: &str, views: &[View<'_>]) -> Result<()> {
    let s = dev.backend().sum_squares(views)?;
    if s.is_finite() {
        Ok(())
    } else {
        Err(KernelError::InvalidArgument {
            name: "output",
            why: format!("{what} left a non-finite value (Σx² = {s}): an element it should write is unwritten"),
        })
    }
}

/// A Python with `torch` and a CUDA device, for the GPU peers: `$LONGCTX_PEER_PYTHON`, else `python3`; with
/// torch's version and device name, or why there is none.
pub fn python_with_cuda_torch() -> std::result::Result<(String, String), String> {
    let python = std::env::var("LONGCTX_PEER_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; \
                 print(torch.__version__, torch.cuda.get_device_name(0))";
    let out = std::process::Command::new(&python)
        .args(["-c", probe])
        .output()
        .map_err(|e| format!("cannot run `{python}`: {e} (set LONGCTX_PEER_PYTHON)"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("it failed");
        return Err(format!("`{python}` has no torch with CUDA: {}", last.trim()));
    }
    Ok((python, String::from_utf8_lossy(&out.stdout).trim().to_string()))
}

/// The peer script `name` (`$LONGCTX_PEER_SCRIPTS/name`, else the repository's `bench/name`), if it exists.
pub fn peer_script(name: &str) -> std::result::Result<PathBuf, String> {
    let dir = std::env::var_os("LONGCTX_PEER_SCRIPTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench"));
    let path = dir.join(name);
    if path.is_file() {
        Ok(path.canonicalize().unwrap_or(path))
    } else {
        Err(format!("{} is not there (set LONGCTX_PEER_SCRIPTS to the folder of the peer scripts)", path.display()))
    }
}

/// Runs `python script args…` and returns its stdout, or why it failed (its exit status and last stderr lines).
pub fn run_peer(python: &str, script: &std::path::Path, args: &[String]) -> std::result::Result<String, String> {
    let out = std::process::Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {python} {}: {e}", script.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(5).collect();
        Err(format!(
            "{} failed ({}): {}",
            script.display(),
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
        ))
    }
}

/// A figure with `prec` decimals, or a dash when it is missing (NaN).
pub fn fmt(x: f64, prec: usize) -> String {
    if x.is_finite() {
        format!("{x:.prec$}")
    } else {
        "–".into()
    }
}

/// A rate with one decimal, or in scientific notation below 1 (the emulator's TFLOP/s), or a dash.
pub fn rate(x: f64) -> String {
    if x.is_finite() && x.abs() < 1.0 && x != 0.0 {
        format!("{x:.1e}")
    } else {
        fmt(x, 1)
    }
}

/// `x / of` as a percentage, or a dash.
pub fn pct(x: f64, of: f64) -> String {
    if (x / of).is_finite() {
        format!("{:.0}%", 100.0 * x / of)
    } else {
        "–".into()
    }
}

/// The value after `name` among `args`, parsed; `default` when absent. Errors: a missing or unparsable value.
pub fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> std::result::Result<T, String>
where
    T::Err: std::fmt::Display,
{
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => {
            let v = args.get(i + 1).ok_or(format!("{name} needs a value"))?;
            v.parse().map_err(|e| format!("{name} {v}: {e}"))
        }
    }
}

/// The comma-separated list after `name` (e.g. `--seqs 8192,16384`); `default` when absent.
pub fn arg_list(args: &[String], name: &str, default: &[usize]) -> std::result::Result<Vec<usize>, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(default.to_vec()),
        Some(i) => {
            let v = args.get(i + 1).ok_or(format!("{name} needs a value"))?;
            v.split(',').map(|x| x.trim().parse::<usize>().map_err(|e| format!("{name} {v}: {e}"))).collect()
        }
    }
}
