//! What a run reports: a progress bar (step, loss, tokens/s, MFU, memory) and `metrics.jsonl`, one JSON object
//! per step (`step`, `loss`, `lr`, `grad_norm`, `tokens_per_s`, `mfu`, `rss_mib`, `saved_mib_per_rank`; on a device
//! also `device_peak_mib` and `device_reserved_mib`, the high-water marks of the device memory pool the process's
//! ranks share; with CP, `cp_attention_s` and `cp_comm_wait_s`, rank 0's attention time and the communication it did
//! not hide, and on a GPU `cp_device_idle_s`, its compute queue's idle time in the ring on the device's clock; with
//! offload, `offload_wait_s`) and one per evaluation (`step`, `val_loss`).
//!
//! MFU is the model's FLOPs per second over the run's arithmetic peak on the device it computes on
//! ([`device_peak_flops`]), measured when the run starts and again at each evaluation, keeping the best, each
//! time while every rank waits at a barrier (a peak timed beside a busy rank is too low, and the MFU above it too
//! high), times the devices the ranks run on (machines for `cpu`, distinct GPUs for `cuda:N`):
//! - `cpu`: independent `f32` FMA chains in registers on every core of the machine at the widest vector width the
//!   kernels use ([`fma_peak_flops`]; a large GEMM's rate on a machine without one). A measured ceiling, not a
//!   datasheet figure, and not a GEMM's rate either: that is an attainable figure below the ceiling, and how far
//!   below depends on the GEMM library.
//! - `cuda:N`: the kernels crate has no peak figure of a device, so it is measured as its own benchmarks measure
//!   theirs (`kernels/examples/attn_bench.rs`): a 4096³ GEMM through the backend's linear layer (cuBLASLt) in the
//!   run's number format, best of three after a warm-up. An attainable rate, somewhat below the datasheet's
//!   dense peak (`longctx plan`'s device table lists those).
//!
//! The model's FLOPs per token are PaLM's count:
//! `6·N` for the `N` weights of the matrix products (the output projection included, the embedding gather
//! not) plus `6·layers·Hq·D·S` for causal attention (half of `12·…`, forward and backward).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use longctx_kernels::cpu::{fma_peak_flops, SimdPath};
use longctx_kernels::{Backend, DType, Dims, MemoryStats, View};

use crate::device::Device;
use crate::error::{Result, TrainError};
use crate::recipe::Recipe;

/// What the recompute crate's planner predicts for one rank's step under the run's policy.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Predicted {
    /// Activation bytes kept from the forward to the backward.
    pub saved_bytes: usize,
    /// The kept bytes plus the largest rebuilt working set of one backward.
    pub peak_bytes: usize,
    /// `peak_bytes` of the layers alone (without the final norm's tensors): what `budget:BYTES` bounds.
    pub layers_peak_bytes: usize,
    /// FLOPs the policy reruns during the backward.
    pub recompute_flops: f64,
    /// Activation bytes the policy sends to the offload tier (per micro-batch).
    pub offloaded_bytes: usize,
}

/// Rank 0's reporter.
#[derive(Debug)]
pub struct Meter {
    path: PathBuf,
    bar: ProgressBar,
    quiet: bool,
    flops_per_token: f64,
    peak_flops: f64,
    started: Instant,
    tokens: f64,
    /// The planner's device memory for the ranks sharing rank 0's memory pool, MiB ([`Meter::predict_device`]).
    predicted_device_mib: Option<f64>,
}

/// FLOPs of one token's forward and backward (see the module docs).
pub fn flops_per_token(recipe: &Recipe, weights: usize) -> f64 {
    let m = &recipe.model;
    // Norm weights (and LayerNorm biases) multiply nothing; the embedding is a lookup, unless it is also the
    // output projection; a token meets only its `top_k` experts of a mixture.
    let norms = (2 * m.layers + 1) * m.d_model * if m.family == crate::recipe::Family::Nemotron { 2 } else { 1 };
    let lookup = if m.tie_embeddings { 0 } else { m.vocab * m.d_model };
    let idle_experts = m.experts().map_or(0, |e| m.layers * (e.experts - e.top_k) * 3 * m.d_model * m.ffn);
    let matmul_weights = weights - lookup - norms - idle_experts;
    6.0 * matmul_weights as f64 + 6.0 * (m.layers * m.heads * m.head_dim() * recipe.train.seq_len) as f64
}

/// One machine's share of the denominator of MFU (see the module docs): the FMA ceiling, or
/// [`measure_gemm_flops`] where the CPU has no vector path, on the current rayon pool.
pub fn measure_peak_flops() -> Result<f64> {
    match fma_peak_flops(SimdPath::detect()) {
        Some(f) => Ok(f),
        None => measure_gemm_flops(),
    }
}

/// [`measure_peak_flops`] on a pool of one thread per core of this machine, whatever pool the caller runs on
/// (a rank's own pool holds only its share of the cores).
pub fn measure_machine_peak_flops() -> Result<f64> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(cores)
        .build()
        .map_err(|source| TrainError::ThreadPool { purpose: "a pool to time the FMA peak on".into(), source })?;
    pool.install(measure_peak_flops)
}

/// FLOP/s of a 1024³ `f32` GEMM on every core (the CPU backend on the current rayon pool), best of three.
pub fn measure_gemm_flops() -> Result<f64> {
    let cpu = crate::device::backend(Device::Cpu, 0)?;
    measure_gemm_flops_on(&*cpu, DType::F32, 1024, 0)
}

/// One device's share of the denominator of MFU for a run on `device` computing through `backend` in `dtype`
/// (see the module docs for where each figure comes from). On the CPU it takes every core of the machine.
pub fn device_peak_flops(device: Device, backend: &dyn Backend, dtype: DType) -> Result<f64> {
    match device {
        Device::Cpu => measure_machine_peak_flops(),
        Device::Cuda(_) => measure_gemm_flops_on(backend, dtype, 4096, 1),
        // The emulator's own rate, on a size it finishes quickly: MFU there says nothing about a GPU.
        Device::CudaEmulated => measure_gemm_flops_on(backend, dtype, 128, 0),
    }
}

/// The GEMM rate `f32` work gets on `device` (what the recompute solver prices a rerun at): [`measure_gemm_flops`]
/// on the CPU, a 4096³ `f32` GEMM through `backend` on a GPU.
pub fn device_gemm_flops(device: Device, backend: &dyn Backend) -> Result<f64> {
    match device {
        Device::Cpu => measure_gemm_flops(),
        Device::Cuda(_) => measure_gemm_flops_on(backend, DType::F32, 4096, 1),
        Device::CudaEmulated => measure_gemm_flops_on(backend, DType::F32, 128, 0),
    }
}

/// FLOP/s of an `n³` GEMM `[n, n]·[n, n]ᵀ` through `backend`'s linear layer in `dtype`, best of three timed
/// calls after `warmup` untimed ones. Each call is timed to the backend's `synchronize`, so a backend that
/// enqueues its work is timed for the work, not its launch.
pub fn measure_gemm_flops_on(backend: &dyn Backend, dtype: DType, n: usize, warmup: usize) -> Result<f64> {
    let b = backend;
    let dims = Dims::new(&[n, n])?;
    let host: Vec<f32> = (0..n * n).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
    let mut staged = b.empty(DType::F32, dims)?;
    b.upload(staged.view_mut(), View::new(&host, [n, n])?)?;
    let a = if dtype == DType::F32 {
        staged
    } else {
        let mut a = b.empty(dtype, dims)?;
        b.copy(a.view_mut(), staged.view())?;
        a
    };
    let mut c = b.zeros(dtype, dims)?;
    for _ in 0..warmup {
        b.linear_forward(c.view_mut(), a.view(), a.view(), None)?;
    }
    b.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        b.linear_forward(c.view_mut(), a.view(), a.view(), None)?;
        b.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (n * n * n) as f64 / best)
}

/// Peak resident memory of this process (`VmHWM`), in bytes; 0 where `/proc` is absent.
pub fn peak_rss_bytes() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else { return 0 };
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

const MIB: f64 = 1024.0 * 1024.0;

impl Meter {
    /// Opens `out/metrics.jsonl` (a fresh run empties it; a resumed one keeps the lines up to `start_step`) and
    /// writes the recipe beside it.
    pub fn open(
        out: &Path,
        recipe: &Recipe,
        start_step: u64,
        quiet: bool,
        weights: usize,
        peak_flops: f64,
    ) -> Result<Meter> {
        let device = recipe.device()?;
        let path = out.join("metrics.jsonl");
        let kept: String = if start_step > 0 && path.exists() {
            let text = std::fs::read_to_string(&path).map_err(|e| TrainError::io(&path, e))?;
            text.lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                        .is_some_and(|s| s <= start_step)
                })
                .map(|l| format!("{l}\n"))
                .collect()
        } else {
            String::new()
        };
        std::fs::write(&path, kept).map_err(|e| TrainError::io(&path, e))?;
        let recipe_path = out.join("recipe.toml");
        std::fs::write(&recipe_path, recipe.to_toml()).map_err(|e| TrainError::io(&recipe_path, e))?;
        let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new(recipe.train.steps) };
        bar.set_style(
            ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg}")
                .map_err(|e| TrainError::Internal(format!("the progress bar's template: {e}")))?,
        );
        bar.set_position(start_step);
        let m = Meter {
            path,
            bar,
            quiet,
            flops_per_token: flops_per_token(recipe, weights),
            peak_flops,
            started: Instant::now(),
            tokens: 0.0,
            predicted_device_mib: None,
        };
        m.note(&format!(
            "{}: {} weights, {} ranks (cp {} × dp {}) on {device}, {} tokens per step, {} {:.1} GFLOP/s",
            recipe.name,
            weights,
            recipe.parallel.cp * recipe.parallel.dp,
            recipe.parallel.cp,
            recipe.parallel.dp,
            recipe.train.batch * recipe.train.seq_len,
            match device {
                Device::Cpu => "FMA peak",
                Device::Cuda(_) | Device::CudaEmulated => "GEMM peak",
            },
            peak_flops / 1e9
        ));
        Ok(m)
    }

    /// The planner's prediction of the device memory the pool's high-water mark will show (the ranks that share the
    /// pool, each as [`crate::plan_cmd::run_memory`] plans it), recorded on every step line beside the measured
    /// `device_peak_mib` as `predicted_device_mib`, and said once.
    pub fn predict_device(&mut self, bytes: u64) {
        let mib = bytes as f64 / MIB;
        self.predicted_device_mib = Some(mib);
        self.note(&format!(
            "device memory predicted by the planner: {mib:.0} MiB (the pool's peak is recorded per step)"
        ));
    }

    /// Takes a peak measured again (at an evaluation) if it is higher: one timed while something else ran is
    /// too low.
    pub fn raise_peak(&mut self, peak_flops: f64) {
        self.peak_flops = self.peak_flops.max(peak_flops);
    }

    /// A line above the bar (or on stdout when there is no terminal).
    pub fn note(&self, msg: &str) {
        if self.quiet {
            return;
        }
        if self.bar.is_hidden() {
            println!("{msg}");
        } else {
            self.bar.println(msg);
        }
    }

    /// Records the held-out loss of the starting weights (step 0) of a run from a pretrained checkpoint.
    pub fn baseline(&mut self, val_loss: f64) -> Result<()> {
        append_line(&self.path, &serde_json::json!({ "step": 0, "val_loss": val_loss }).to_string())?;
        self.note(&format!("step 0: held-out {val_loss:.4} (the pretrained weights, before training)"));
        Ok(())
    }

    /// Records one step.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        step: u64,
        loss: f64,
        val_loss: Option<f64>,
        lr: f32,
        grad_norm: f64,
        tokens: f64,
        took: Duration,
        saved_bytes: usize,
        predicted: Predicted,
        offload_wait: Option<Duration>,
        device: Option<MemoryStats>,
        cp: Option<longctx_ring_attn::StepReport>,
    ) -> Result<()> {
        self.tokens += tokens;
        let tps = tokens / took.as_secs_f64().max(1e-9);
        let mfu = tps * self.flops_per_token / self.peak_flops;
        let rss = peak_rss_bytes() as f64 / MIB;
        let mut line = serde_json::json!({
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps, "mfu": mfu,
            "step_s": took.as_secs_f64(),
            "rss_mib": rss, "saved_mib_per_rank": saved_bytes as f64 / MIB,
            "predicted_mib_per_rank": predicted.saved_bytes as f64 / MIB,
            "predicted_peak_mib_per_rank": predicted.peak_bytes as f64 / MIB,
            "planned_layers_peak_mib": predicted.layers_peak_bytes as f64 / MIB,
            // The model's FLOPs of this step (all ranks) and the planner's rerun FLOPs on one rank: with the
            // step time they predict what a recompute policy adds.
            "step_gflop": tokens * self.flops_per_token / 1e9,
            "recompute_gflop_per_rank": predicted.recompute_flops / 1e9,
            "predicted_offload_mib_per_rank": predicted.offloaded_bytes as f64 / MIB,
        });
        if let Some(d) = device {
            // The device pool's high-water marks (every rank of this process on the device shares the pool):
            // bytes in live buffers at most, and bytes the pool held at most.
            line["device_peak_mib"] = serde_json::json!(d.used_high as f64 / MIB);
            line["device_reserved_mib"] = serde_json::json!(d.reserved_high as f64 / MIB);
            if let Some(p) = self.predicted_device_mib {
                line["predicted_device_mib"] = serde_json::json!(p);
            }
        }
        if let Some(w) = offload_wait {
            // Seconds rank 0's backward waited for offloaded tensors: the part of offload a step pays for.
            line["offload_wait_s"] = serde_json::json!(w.as_secs_f64());
        }
        if let Some(r) = cp {
            // Rank 0's attention through the CP plan this step: seconds in its kernels and merges, and seconds
            // blocked on communication they did not hide (the exposed communication, as the ring counts it).
            line["cp_attention_s"] = serde_json::json!(r.compute.as_secs_f64());
            line["cp_comm_wait_s"] = serde_json::json!(r.comm_wait.as_secs_f64());
            if let Some(idle) = r.device_idle {
                // On a GPU the host's waiting is not the device's: seconds rank 0's compute queue stood idle in
                // the ring, on the device's clock (what the overlap did not hide there).
                line["cp_device_idle_s"] = serde_json::json!(idle.as_secs_f64());
            }
        }
        append_line(&self.path, &line.to_string())?;
        if let Some(v) = val_loss {
            append_line(&self.path, &serde_json::json!({ "step": step, "val_loss": v }).to_string())?;
        }
        self.bar.set_position(step);
        let peak = match device {
            Some(d) => format!("peak device {:.0} MiB", d.used_high as f64 / MIB),
            None => format!("peak RSS {rss:.0} MiB"),
        };
        self.bar.set_message(format!("loss {loss:.4} | {tps:.0} tok/s | MFU {:.1}% | {peak}", 100.0 * mfu));
        if self.bar.is_hidden() || val_loss.is_some() {
            let v = val_loss.map_or(String::new(), |v| format!(" held-out {v:.4}"));
            let w = offload_wait.map_or(String::new(), |w| format!(" | offload wait {:.2} s", w.as_secs_f64()));
            self.note(&format!(
                "step {step}: loss {loss:.4}{v} | {tps:.0} tok/s | MFU {:.1}% | lr {lr:.2e}{w}",
                100.0 * mfu
            ));
        }
        Ok(())
    }

    /// Ends the bar and says where things went.
    pub fn finish(&mut self, out: &Path) {
        self.bar.finish_and_clear();
        let secs = self.started.elapsed().as_secs_f64();
        self.note(&format!(
            "{:.0} tokens in {secs:.1} s ({:.0} tok/s). Metrics: {}; checkpoints: {}; plot: longctx plot {} -o loss.png",
            self.tokens,
            self.tokens / secs.max(1e-9),
            self.path.display(),
            out.join("checkpoints").display(),
            self.path.display()
        ));
    }
}

/// Appends one line to a file (the metrics log).
fn append_line(path: &Path, line: &str) -> Result<()> {
    let mut f =
        std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(|e| TrainError::io(path, e))?;
    writeln!(f, "{line}").map_err(|e| TrainError::io(path, e))
}
