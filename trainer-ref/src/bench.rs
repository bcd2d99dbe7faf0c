//! `longctx bench`: the trainer beside PyTorch eager on CPU (`bench/peer_train.py`), the same tiny model at
//! several sequence lengths, in one run: tokens/s, MFU against the FMA peak measured here, and peak RSS, each
//! side in its own process so its peak memory is its own; then the per-rank activation memory of CP 4 beside
//! CP 1 at the longest length. `--family mixtral|nemotron` benches that family's tiny recipe (`tiny-mixtral`,
//! `tiny-nemotron`) against the peer's model of the same family. `--recompute` and `--offload` compare our own
//! runs instead: recompute policies, or an offload tier, against training with neither.
//!
//! `--device cuda:N` (or `cuda-emulated`, the same code on the kernels' host emulator, for testing the plumbing)
//! benches the GPU instead: by default the Llama 3 8B shape cut to 4 layers, trained in bf16 on the device, beside
//! transformers' `LlamaForCausalLM` under bf16 autocast with fused AdamW (`bench/peer_train_gpu.py`): tokens/s,
//! MFU against a stated peak, and peak device memory, each length with the layout our side ran it in
//! (`--layout`), a peer out of memory as `OOM`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

use crate::device::{Device, ParseDeviceError};
use crate::error::{Result, TrainError};
use crate::metrics::{flops_per_token, measure_gemm_flops, measure_peak_flops};
use crate::model::param_shapes;
use crate::recipe::{Family, Recipe};

/// What to compare.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Sequence lengths.
    pub seqs: Vec<usize>,
    /// Timed steps per run (after one untimed step).
    pub steps: u64,
    /// `f32`, `bf16`.
    pub dtypes: Vec<String>,
    /// The Python that runs the peer (`None`: no peer column).
    pub python: Option<String>,
    /// Context-parallel ranks: on the CPU, of the memory comparison at the longest length (0 skips it; 4 when
    /// absent); on a GPU, our side's CP size of every length `--layout` does not name (1 when absent).
    pub cp: Option<usize>,
    /// Scratch folder for the runs.
    pub scratch: PathBuf,
    /// Recompute policies to compare with `none` (our side only) instead of the PyTorch table.
    pub recompute: Vec<String>,
    /// An offload tier (`host`, `disk`) to compare with training without offload (our side only) instead of the
    /// PyTorch table.
    pub offload: Option<String>,
    /// Times each side runs per row, alternating (medians are printed).
    pub rounds: usize,
    /// The model family (its tiny recipe; the Llama rows use the bench model below).
    pub family: Family,
    /// Where our side trains (`--device`): absent or `cpu` for the CPU tables; `cuda`, `cuda:N` or
    /// `cuda-emulated` for the GPU table ([`parse_device`]).
    pub device: Option<String>,
    /// The GPU table's model (`tiny`, `llama3-8b-4l`; absent: [`GpuModel::default_for`] the device).
    pub model: Option<String>,
    /// The GPU table's MFU peak in TFLOP/s (absent: [`DATASHEET_TFLOPS`] on `cuda:N`, the host's measured FMA
    /// peak on `cuda-emulated`).
    pub peak_tflops: Option<f64>,
    /// The GPU table's per-length layouts of our side: `SEQ:cp=N,recompute=P,offload=T;SEQ:…` ([`parse_layouts`]).
    pub layout: Option<String>,
}

/// The recipe a family's rows train.
pub fn bench_recipe(family: Family) -> &'static str {
    match family {
        Family::Llama => "tiny-llama",
        Family::Mixtral => "tiny-mixtral",
        Family::Nemotron => "tiny-nemotron",
    }
}

/// The overrides of a family's row: the bench model for Llama, the tiny recipe's own model otherwise; batch 1,
/// `steps + 1` steps, no evaluation or checkpoint beyond the last.
pub fn family_overrides(family: Family, seq: usize, steps: u64, dtype: &str) -> Vec<String> {
    let mut sets = bench_overrides(seq, steps, dtype);
    if family != Family::Llama {
        sets.retain(|s| !s.starts_with("model."));
    }
    sets
}

/// The peer's model arguments for `recipe`'s model.
fn peer_model_args(recipe: &Recipe) -> Vec<String> {
    let m = &recipe.model;
    let mut a = vec![
        "--family".to_string(),
        m.family.name().into(),
        "--layers".into(),
        m.layers.to_string(),
        "--d-model".into(),
        m.d_model.to_string(),
        "--heads".into(),
        m.heads.to_string(),
        "--kv-heads".into(),
        m.kv_heads.to_string(),
        "--ffn".into(),
        m.ffn.to_string(),
        "--vocab".into(),
        m.vocab.to_string(),
        "--theta".into(),
        m.rope_theta.to_string(),
    ];
    if let Some(e) = m.experts() {
        a.extend(["--experts".into(), e.experts.to_string(), "--top-k".into(), e.top_k.to_string()]);
        a.extend(["--aux-coef".into(), e.aux_loss_coef.to_string()]);
    }
    if let Some(f) = m.partial_rotary_factor {
        a.extend(["--rotary-factor".into(), f.to_string()]);
    }
    a
}

/// The bench model: the peer's (4 layers, d 256, 4 heads / 2 KV heads, SwiGLU 688, byte vocabulary).
pub fn bench_overrides(seq: usize, steps: u64, dtype: &str) -> Vec<String> {
    [
        "model.layers=4".to_string(),
        "model.d_model=256".into(),
        "model.heads=4".into(),
        "model.kv_heads=2".into(),
        "model.ffn=688".into(),
        format!("train.seq_len={seq}"),
        "train.batch=1".into(),
        format!("train.steps={}", steps + 1),
        "train.eval_every=0".into(),
        "train.checkpoint_every=0".into(),
        // No checkpoint: nothing reads it, and the 8B-shaped model's would be 23 GB.
        "train.keep_checkpoints=0".into(),
        format!("train.loss_chunk={}", 1024.min(seq)),
        format!("train.precision=\"{dtype}\""),
    ]
    .into()
}

/// One side of one row.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Side {
    tokens_per_s: f64,
    peak_rss_mib: f64,
    /// Peak device memory, MiB: ours the device pool's high-water mark (`device_peak_mib`, 0 on the CPU), the
    /// GPU peer's `torch.cuda.max_memory_allocated` (0 on the CPU).
    device_peak_mib: f64,
    saved_mib_per_rank: f64,
    predicted_mib_per_rank: f64,
    predicted_peak_mib_per_rank: f64,
    /// The planner's peak over the layers alone (what a `budget:` policy bounds).
    planned_layers_peak_mib: f64,
    step_gflop: f64,
    recompute_gflop_per_rank: f64,
    loss_first: f64,
    loss_last: f64,
    /// Seconds the backward waited for offloaded tensors, per timed step (rank 0).
    offload_wait_s: f64,
    /// With CP: the share of rank 0's step time lost to communication its compute did not hide, over the timed
    /// steps: on a GPU its compute queue's idle time in the ring (`cp_device_idle_s`, the device's clock), else
    /// its ring attention's time blocked on transfers (`cp_comm_wait_s`); over `step_s`. 0 without CP.
    cp_exposed: f64,
    /// The planner's device memory for the run (`predicted_device_mib`, MiB; 0 on the CPU).
    predicted_device_mib: f64,
}

fn ours(exe: &Path, out: &Path, recipe: &str, sets: &[String], cp: usize, device: Option<Device>) -> Result<Side> {
    let _ = std::fs::remove_dir_all(out);
    let mut cmd = Command::new(exe);
    cmd.args(["train", "--recipe", recipe, "--quiet", "--out"]).arg(out).args(["--cp", &cp.to_string()]);
    if let Some(d) = device {
        cmd.args(["--device", &d.to_string()]);
    }
    for s in sets {
        cmd.args(["--set", s]);
    }
    let o = cmd.output().map_err(|e| TrainError::io(exe, e))?;
    if !o.status.success() {
        return Err(TrainError::Child {
            what: "our run failed".into(),
            detail: String::from_utf8_lossy(&o.stderr).into_owned(),
        });
    }
    let path = out.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).map_err(|e| TrainError::io(&path, e))?;
    let rows: Vec<serde_json::Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let steps: Vec<&serde_json::Value> = rows.iter().filter(|r| r.get("loss").is_some()).collect();
    let timed = &steps[1.min(steps.len())..];
    let f = |r: &serde_json::Value, k: &str| r.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
    let secs_per_token: f64 = timed.iter().map(|r| 1.0 / f(r, "tokens_per_s").max(1e-9)).sum::<f64>();
    Ok(Side {
        tokens_per_s: timed.len() as f64 / secs_per_token.max(1e-12),
        peak_rss_mib: steps.iter().map(|r| f(r, "rss_mib")).fold(0.0, f64::max),
        device_peak_mib: steps.iter().map(|r| f(r, "device_peak_mib")).fold(0.0, f64::max),
        saved_mib_per_rank: steps.iter().map(|r| f(r, "saved_mib_per_rank")).fold(0.0, f64::max),
        predicted_mib_per_rank: steps.iter().map(|r| f(r, "predicted_mib_per_rank")).fold(0.0, f64::max),
        predicted_peak_mib_per_rank: steps.iter().map(|r| f(r, "predicted_peak_mib_per_rank")).fold(0.0, f64::max),
        planned_layers_peak_mib: steps.iter().map(|r| f(r, "planned_layers_peak_mib")).fold(0.0, f64::max),
        step_gflop: steps.first().map_or(0.0, |r| f(r, "step_gflop")),
        recompute_gflop_per_rank: steps.first().map_or(0.0, |r| f(r, "recompute_gflop_per_rank")),
        loss_first: steps.first().map_or(0.0, |r| f(r, "loss")),
        loss_last: steps.last().map_or(0.0, |r| f(r, "loss")),
        offload_wait_s: timed.iter().map(|r| f(r, "offload_wait_s")).sum::<f64>() / timed.len().max(1) as f64,
        cp_exposed: {
            let on_device = timed.iter().any(|r| r.get("cp_device_idle_s").is_some());
            let key = if on_device { "cp_device_idle_s" } else { "cp_comm_wait_s" };
            timed.iter().map(|r| f(r, key)).sum::<f64>() / timed.iter().map(|r| f(r, "step_s")).sum::<f64>().max(1e-12)
        },
        predicted_device_mib: steps.iter().map(|r| f(r, "predicted_device_mib")).fold(0.0, f64::max),
    })
}

/// Training with an offload tier beside training without, on our side: step time, the backward's wait for
/// offloaded tensors (the part of offload a step pays for), activations the model keeps per rank, and peak RSS,
/// with the losses compared bit for bit. The two alternate within each round; medians are printed.
fn offload_table(exe: &Path, opts: &BenchOptions, tier: &str) -> Result<()> {
    if !matches!(tier, "host" | "disk") {
        return Err(TrainError::InvalidOption {
            option: "--offload".into(),
            detail: format!("`{tier}` (host or disk)"),
        });
    }
    println!(
        "| seq | step s, none | step s, offload {tier} | ratio | offload wait s per step | kept per rank, none | offload | peak RSS, none | offload | ratio | same losses |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let dtype = opts.dtypes.first().map_or("f32", String::as_str);
    let name = bench_recipe(opts.family);
    for &seq in &opts.seqs {
        let sets_of = |offload: &str| {
            let mut sets = family_overrides(opts.family, seq, opts.steps, dtype);
            sets.push(format!("train.offload=\"{offload}\""));
            sets
        };
        let (mut plain, mut moved) = (Vec::new(), Vec::new());
        for round in 0..opts.rounds.max(1) {
            // Alternate which side runs first, so a host that speeds up or slows down falls on both.
            for first in [round % 2 == 0, round % 2 == 1] {
                let (side, runs) = if first { ("none", &mut plain) } else { (tier, &mut moved) };
                runs.push(ours(exe, &opts.scratch.join(format!("off-{seq}")), name, &sets_of(side), 1, None)?);
            }
        }
        let (a, b) = (median_side(&plain), median_side(&moved));
        let step_s = |s: &Side| seq as f64 / s.tokens_per_s;
        let same = plain.iter().chain(&moved).all(|s| {
            s.loss_first.to_bits() == a.loss_first.to_bits() && s.loss_last.to_bits() == a.loss_last.to_bits()
        });
        println!(
            "| {seq} | {:.2} | {:.2} | {:.2}× | {:.2} | {:.1} MiB | {:.1} MiB | {:.0} MiB | {:.0} MiB | {:.2}× | {} |",
            step_s(&a),
            step_s(&b),
            step_s(&b) / step_s(&a),
            b.offload_wait_s,
            a.saved_mib_per_rank,
            b.saved_mib_per_rank,
            a.peak_rss_mib,
            b.peak_rss_mib,
            b.peak_rss_mib / a.peak_rss_mib,
            if same { "yes" } else { "NO" }
        );
    }
    Ok(())
}

/// Each policy beside `none` on our side: step time measured and predicted (none's measured step plus the
/// planner's rerun FLOPs at none's measured rate), activations kept per rank (measured and predicted), the
/// planner's peak, process peak RSS. Policies alternate within each round, so load that comes and goes falls
/// on all of them; medians are printed. Each `budget:BYTES` row is then set against the built-in policies of
/// the same run whose planned peak fits the same budget.
fn recompute_table(exe: &Path, opts: &BenchOptions) -> Result<()> {
    println!(
        "| seq | policy | step s | vs none | predicted step s | kept per rank | predicted | vs none | planned peak | peak RSS |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let dtype = opts.dtypes.first().map_or("f32", String::as_str);
    let name = bench_recipe(opts.family);
    let mut policies = vec!["none".to_string()];
    policies.extend(opts.recompute.iter().filter(|p| *p != "none").cloned());
    let parsed: Vec<longctx_recompute::Policy> = policies
        .iter()
        .map(|p| {
            p.parse()
                .map_err(|e| TrainError::InvalidOption { option: "--recompute".into(), detail: format!("{p}: {e}") })
        })
        .collect::<Result<_>>()?;
    let mut budget_lines = Vec::new();
    for &seq in &opts.seqs {
        let sets_of = |p: &str| {
            let mut sets = family_overrides(opts.family, seq, opts.steps, dtype);
            sets.push(format!("train.recompute=\"{p}\""));
            sets
        };
        let mut runs: Vec<Vec<Side>> = vec![Vec::new(); policies.len()];
        for _ in 0..opts.rounds.max(1) {
            for (p, r) in policies.iter().zip(runs.iter_mut()) {
                r.push(ours(exe, &opts.scratch.join(format!("rc-{seq}")), name, &sets_of(p), 1, None)?);
            }
        }
        let sides: Vec<Side> = runs.iter().map(|r| median_side(r)).collect();
        let step_s = |s: &Side| seq as f64 / s.tokens_per_s;
        let base = sides[0];
        // none's measured rate: the model's FLOPs of a step over its measured time.
        let rate = base.step_gflop / step_s(&base);
        for (p, s) in policies.iter().zip(&sides) {
            println!(
                "| {seq} | {p} | {:.2} | {:.2}× | {:.2} | {:.1} MiB | {:.1} MiB | {:.2}× | {:.1} MiB | {:.0} MiB |",
                step_s(s),
                step_s(s) / step_s(&base),
                step_s(&base) + s.recompute_gflop_per_rank / rate,
                s.saved_mib_per_rank,
                s.predicted_mib_per_rank,
                s.saved_mib_per_rank / base.saved_mib_per_rank,
                s.predicted_peak_mib_per_rank,
                s.peak_rss_mib
            );
        }
        // The budget is on the planner's peak of the layers (the final norm's tensors, the same under every
        // policy, are outside it), so a built-in fits it when its planned peak, less that common part, does.
        let outside = base.predicted_peak_mib_per_rank - base.planned_layers_peak_mib;
        for (i, policy) in parsed.iter().enumerate() {
            let longctx_recompute::Policy::Budget(bytes) = policy else { continue };
            let limit = *bytes as f64 / (1024.0 * 1024.0) + outside;
            let best = policies
                .iter()
                .zip(&parsed)
                .zip(&sides)
                .filter(|((_, q), s)| {
                    !matches!(q, longctx_recompute::Policy::Budget(_)) && s.predicted_peak_mib_per_rank <= limit
                })
                .min_by(|(_, a), (_, b)| step_s(a).total_cmp(&step_s(b)));
            budget_lines.push(match best {
                Some(((q, _), b)) => format!(
                    "{seq}: {} {:.2} s against the fastest built-in within the same budget, {q} {:.2} s ({:.2}×)",
                    policies[i],
                    step_s(&sides[i]),
                    step_s(b),
                    step_s(&sides[i]) / step_s(b)
                ),
                None => format!(
                    "{seq}: {} {:.2} s; no built-in policy of this run fits its budget",
                    policies[i],
                    step_s(&sides[i])
                ),
            });
        }
    }
    for l in budget_lines {
        println!("{l}");
    }
    Ok(())
}

fn peer(python: &str, script: &Path, model: &[String], seq: usize, steps: u64, dtype: &str) -> Result<Option<Side>> {
    let o = Command::new(python)
        .arg(script)
        .args(["--seq", &seq.to_string(), "--steps", &steps.to_string(), "--dtype", dtype])
        .args(model)
        .output()
        .map_err(|e| TrainError::io(python, e))?;
    let text = String::from_utf8_lossy(&o.stdout);
    let Some(line) = text.lines().rev().find(|l| l.starts_with('{')) else {
        eprintln!("# peer: {}", String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("no output"));
        return Ok(None);
    };
    let v: serde_json::Value = serde_json::from_str(line)
        .map_err(|e| TrainError::Child { what: format!("peer output {line:?}"), detail: e.to_string() })?;
    let f = |k: &str| v.get(k).and_then(|x| x.as_f64()).unwrap_or(0.0);
    Ok(Some(Side {
        tokens_per_s: f("tokens_per_s"),
        peak_rss_mib: f("peak_rss_mib"),
        saved_mib_per_rank: 0.0,
        loss_first: f("loss_first"),
        ..Side::default()
    }))
}

/// The run with the median tokens/s (its other figures with it).
fn median_side(runs: &[Side]) -> Side {
    let mut v = runs.to_vec();
    v.sort_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s));
    v[v.len() / 2]
}

/// The MFU peak of the GPU table on `cuda:N` unless `--peak-tflops` gives another: the H200's dense bf16 figure
/// from NVIDIA's datasheet, in TFLOP/s (the GPU this bench was written for; an H100 SXM's is the same).
pub const DATASHEET_TFLOPS: f64 = 989.0;

/// The Llama 3 8B shape cut to 4 layers: what `bench/peer_train_gpu.py` builds by default.
const LLAMA3_8B_4L: [&str; 7] = [
    "model.layers=4",
    "model.d_model=4096",
    "model.heads=32",
    "model.kv_heads=8",
    "model.ffn=14336",
    // Byte tokens are all below 257, so a larger vocabulary is valid; it costs what the real one costs (the
    // embedding, and the output projection and loss over 128,256 logits per token).
    "model.vocab=128256",
    "model.rope_theta=500000.0",
];

/// `longctx bench --device`: `cpu`, `cuda` (the GPU of ordinal `LOCAL_RANK`, else 0), `cuda:N` or
/// `cuda-emulated`, through [`Device`]'s parser; [`TrainError::InvalidOption`] naming `--device` otherwise.
pub fn parse_device(s: &str) -> Result<Device> {
    s.parse()
        .map_err(|e: ParseDeviceError| TrainError::InvalidOption { option: "--device".into(), detail: e.to_string() })
}

/// The model of the GPU table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuModel {
    /// The CPU table's bench model ([`bench_overrides`]): seconds per step on the host emulator.
    Tiny,
    /// The Llama 3 8B shape cut to 4 layers (1.92 B parameters with its 128,256-token vocabulary).
    Llama3_8b4l,
}

impl GpuModel {
    /// The model a device benches when `--model` is absent: the 8B-shaped one on a GPU, the tiny one on the
    /// emulator (whose steps of the large one would take hours).
    pub fn default_for(device: Device) -> GpuModel {
        match device {
            Device::Cuda(_) => GpuModel::Llama3_8b4l,
            Device::Cpu | Device::CudaEmulated => GpuModel::Tiny,
        }
    }

    /// The name `--model` takes.
    pub fn name(self) -> &'static str {
        match self {
            GpuModel::Tiny => "tiny",
            GpuModel::Llama3_8b4l => "llama3-8b-4l",
        }
    }
}

impl FromStr for GpuModel {
    type Err = TrainError;

    fn from_str(s: &str) -> Result<GpuModel> {
        match s {
            "tiny" => Ok(GpuModel::Tiny),
            "llama3-8b-4l" => Ok(GpuModel::Llama3_8b4l),
            _ => Err(TrainError::InvalidOption {
                option: "--model".into(),
                detail: format!("`{s}` (tiny or llama3-8b-4l)"),
            }),
        }
    }
}

/// The overrides of one length of the GPU table on `tiny-llama`: `model`'s shape, bf16, batch 1, `steps + 1`
/// steps, and what the peer trains with besides: plain RoPE (transformers' default, no Llama 3.1 scaling) and a
/// constant learning rate of 3e-4.
pub fn gpu_overrides(model: GpuModel, seq: usize, steps: u64) -> Vec<String> {
    let mut sets = bench_overrides(seq, steps, "bf16");
    if model == GpuModel::Llama3_8b4l {
        sets.retain(|s| !s.starts_with("model."));
        sets.extend(LLAMA3_8B_4L.iter().map(|s| s.to_string()));
    }
    sets.extend(
        ["model.rope_scaling={ rope_type = \"default\" }", "train.lr=3e-4", "train.min_lr=3e-4", "train.warmup=0"]
            .map(String::from),
    );
    sets
}

/// How our side runs one length of the GPU table: CP ranks (all on the one GPU), recompute policy, offload tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Context-parallel ranks.
    pub cp: usize,
    /// `train.recompute` (the recipe's, `none`, when absent).
    pub recompute: Option<String>,
    /// `train.offload` (the recipe's, `none`, when absent).
    pub offload: Option<String>,
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cp {}", self.cp)?;
        if let Some(r) = &self.recompute {
            write!(f, ", recompute {r}")?;
        }
        if let Some(o) = &self.offload {
            write!(f, ", offload {o}")?;
        }
        Ok(())
    }
}

impl Layout {
    /// The recipe overrides of the layout (its CP goes to `--cp`).
    fn sets(&self) -> Vec<String> {
        let mut sets = Vec::new();
        if let Some(r) = &self.recompute {
            sets.push(format!("train.recompute=\"{r}\""));
        }
        if let Some(o) = &self.offload {
            sets.push(format!("train.offload=\"{o}\""));
        }
        sets
    }

    /// What is wrong with a field, if anything, so that a typo fails before the first run.
    fn problem(&self) -> Option<String> {
        if self.cp == 0 {
            return Some("cp must be at least 1".into());
        }
        if let Some(r) = &self.recompute {
            if let Err(e) = r.parse::<longctx_recompute::Policy>() {
                return Some(format!("recompute={r}: {e}"));
            }
        }
        match self.offload.as_deref() {
            Some(o) if !matches!(o, "none" | "host" | "disk") => Some(format!("offload={o} (none, host or disk)")),
            _ => None,
        }
    }
}

/// `--layout SEQ:cp=N,recompute=P,offload=T;SEQ:…`: each named length's layout, its unnamed fields `base`'s
/// (`--cp`, `--recompute`, `--offload`). Every length must be one of `seqs`, named once. A policy's own commas
/// (`selective:norm,mlp_act`) stay in its value: a comma starts a new field only before `cp=`, `recompute=` or
/// `offload=`.
pub fn parse_layouts(spec: &str, base: &Layout, seqs: &[usize]) -> Result<BTreeMap<usize, Layout>> {
    let bad = |detail: String| TrainError::InvalidOption { option: "--layout".into(), detail };
    let mut layouts = BTreeMap::new();
    for entry in spec.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        let (seq_text, fields) =
            entry.split_once(':').ok_or_else(|| bad(format!("`{entry}`: expected SEQ:cp=N,recompute=P,offload=T")))?;
        let seq: usize = seq_text.trim().parse().map_err(|_| bad(format!("`{seq_text}` is not a sequence length")))?;
        if !seqs.contains(&seq) {
            return Err(bad(format!("{seq} is not one of --seqs {seqs:?}")));
        }
        let mut pairs: Vec<(String, String)> = Vec::new();
        for piece in fields.split(',') {
            let starts_field = ["cp=", "recompute=", "offload="].iter().any(|k| piece.trim_start().starts_with(k));
            match pairs.last_mut() {
                Some((_, value)) if !starts_field => {
                    value.push(',');
                    value.push_str(piece.trim());
                }
                _ => {
                    let (k, v) = piece.split_once('=').ok_or_else(|| {
                        bad(format!("{seq}: `{piece}` (fields are cp=N, recompute=POLICY, offload=TIER)"))
                    })?;
                    pairs.push((k.trim().to_string(), v.trim().to_string()));
                }
            }
        }
        let mut layout = base.clone();
        for (k, v) in pairs {
            match k.as_str() {
                "cp" => layout.cp = v.parse().map_err(|_| bad(format!("{seq}: cp={v} is not a whole number")))?,
                "recompute" => layout.recompute = Some(v),
                "offload" => layout.offload = Some(v),
                _ => return Err(bad(format!("{seq}: unknown field `{k}` (cp, recompute, offload)"))),
            }
        }
        if let Some(why) = layout.problem() {
            return Err(bad(format!("{seq}: {why}")));
        }
        if layouts.insert(seq, layout).is_some() {
            return Err(bad(format!("{seq} is named twice")));
        }
    }
    Ok(layouts)
}

/// One side's result at one length of the GPU table.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    /// It ran: the median of its rounds.
    Ran(Side),
    /// The peer ran out of device memory (`torch.cuda.OutOfMemoryError`) with this much allocated at its peak.
    Oom { peak_alloc_mib: f64, detail: String },
    /// It ran and failed (ours: out of device memory, say; the peer: a crash, or output it cannot be read from):
    /// why, as one table cell.
    Failed(String),
    /// Not run (`--python none`), or the peer could not start (no torch): no figures.
    Absent,
}

/// Reads the GPU peer's JSON line: `status` `ok` with its figures, or `oom` with its peak and message.
fn parse_gpu_peer(line: &str) -> Result<Outcome> {
    let bad = |detail: String| TrainError::Child { what: format!("peer output {line:?}"), detail };
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
    // Absent or null (the peer on the CPU has no device peak): 0, which the table prints as `–`.
    let f = |k: &str| v.get(k).and_then(|x| x.as_f64()).unwrap_or(0.0);
    match v.get("status").and_then(|s| s.as_str()) {
        Some("ok") => {
            let tokens_per_s = v.get("tokens_per_s").and_then(|x| x.as_f64()).filter(|t| *t > 0.0);
            let tokens_per_s = tokens_per_s.ok_or_else(|| bad("status ok without a positive `tokens_per_s`".into()))?;
            Ok(Outcome::Ran(Side {
                tokens_per_s,
                peak_rss_mib: f("peak_rss_mib"),
                device_peak_mib: f("peak_alloc_mib"),
                loss_first: f("loss_first"),
                loss_last: f("loss_last"),
                ..Side::default()
            }))
        }
        Some("oom") => Ok(Outcome::Oom {
            peak_alloc_mib: f("peak_alloc_mib"),
            detail: v.get("detail").and_then(|d| d.as_str()).unwrap_or("").to_string(),
        }),
        other => Err(bad(format!("`status` is {other:?}, neither \"ok\" nor \"oom\""))),
    }
}

/// Runs the GPU peer once: its outcome; [`Outcome::Absent`] when it printed no JSON and exited with status 0 (torch
/// or transformers missing, by design), [`Outcome::Failed`] with the last line of its stderr when it crashed. Either
/// way the reason goes to stderr too.
fn gpu_peer(python: &str, script: &Path, model: &[String], seq: usize, steps: u64, device: &str) -> Result<Outcome> {
    let o = Command::new(python)
        .arg(script)
        .args(["--seq", &seq.to_string(), "--steps", &steps.to_string(), "--device", device])
        .args(model)
        .output()
        .map_err(|e| TrainError::io(python, e))?;
    let text = String::from_utf8_lossy(&o.stdout);
    if let Some(line) = text.lines().rev().find(|l| l.trim_start().starts_with('{')) {
        return parse_gpu_peer(line.trim());
    }
    let err = String::from_utf8_lossy(&o.stderr);
    let why = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output");
    eprintln!("# peer at {seq} ({}): {why}", o.status);
    Ok(if o.status.success() { Outcome::Absent } else { Outcome::Failed(cell(&format!("{why} ({})", o.status))) })
}

/// The GPU peer's model flags for `recipe`'s model.
fn gpu_peer_args(recipe: &Recipe) -> Vec<String> {
    let m = &recipe.model;
    [
        ("--layers", m.layers.to_string()),
        ("--d-model", m.d_model.to_string()),
        ("--heads", m.heads.to_string()),
        ("--kv-heads", m.kv_heads.to_string()),
        ("--ffn", m.ffn.to_string()),
        ("--vocab", m.vocab.to_string()),
        ("--theta", m.rope_theta.to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect()
}

/// A peer script: in `$LONGCTX_PEER_SCRIPTS` (where the GPU check unpacks them), else this checkout's `bench/`.
fn peer_script(name: &str) -> PathBuf {
    std::env::var_os("LONGCTX_PEER_SCRIPTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench"))
        .join(name)
}

/// One line of a failure, fit for a table cell: the last line of a child's stderr (its `error: …`), else the
/// error itself ([`cell`]).
fn cell_text(e: &TrainError) -> String {
    let text = match e {
        TrainError::Child { detail, .. } => {
            detail.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no message").to_string()
        }
        other => other.to_string(),
    };
    cell(text.trim().trim_start_matches("error: "))
}

/// `text` as one markdown table cell: `|` escaped, line breaks as spaces, cut to 160 characters.
fn cell(text: &str) -> String {
    let text = text.trim().replace('|', "\\|").replace(['\n', '\r'], " ");
    match text.char_indices().nth(160) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

/// The three cells of one side (tokens/s, MFU, peak device MiB) at `flops_per_token` over `peak_flops`.
fn side_cells(o: &Outcome, flops_per_token: f64, peak_flops: f64) -> [String; 3] {
    let dash = || "–".to_string();
    match o {
        Outcome::Ran(s) => [
            format!("{:.0}", s.tokens_per_s),
            format!("{:.1}%", 100.0 * s.tokens_per_s * flops_per_token / peak_flops),
            if s.device_peak_mib > 0.0 { format!("{:.0} MiB", s.device_peak_mib) } else { dash() },
        ],
        Outcome::Oom { peak_alloc_mib, .. } if *peak_alloc_mib > 0.0 => {
            ["OOM".into(), "OOM".into(), format!("OOM ({peak_alloc_mib:.0} MiB allocated)")]
        }
        Outcome::Oom { .. } => ["OOM".into(), "OOM".into(), "OOM".into()],
        Outcome::Failed(why) => [format!("failed: {why}"), dash(), dash()],
        Outcome::Absent => [dash(), dash(), dash()],
    }
}

/// One row of the GPU table: `| seq | layout | ours ×3 | peer ×3 | tok/s ratio | memory ratio |`, the ratios ours
/// over the peer's where both ran (the memory ratio where both report a device peak), else `–`.
fn gpu_row(
    seq: usize,
    layout: &Layout,
    ours: &Outcome,
    peer: &Outcome,
    flops_per_token: f64,
    peak_flops: f64,
) -> String {
    let [ut, um, up] = side_cells(ours, flops_per_token, peak_flops);
    let [pt, pm, pp] = side_cells(peer, flops_per_token, peak_flops);
    let (speed, memory) = match (ours, peer) {
        (Outcome::Ran(u), Outcome::Ran(p)) => (
            format!("{:.2}×", u.tokens_per_s / p.tokens_per_s),
            if u.device_peak_mib > 0.0 && p.device_peak_mib > 0.0 {
                format!("{:.2}×", u.device_peak_mib / p.device_peak_mib)
            } else {
                "–".into()
            },
        ),
        _ => ("–".into(), "–".into()),
    };
    format!("| {seq} | {layout} | {ut} | {um} | {up} | {pt} | {pm} | {pp} | {speed} | {memory} |")
}

/// The line after the GPU table: the longest length at which each side ran (ours with its layout).
fn longest_line(rows: &[(usize, Layout, Outcome, Outcome)], peer_run: bool) -> String {
    let ran = |o: &Outcome| matches!(o, Outcome::Ran(_));
    let ours = rows.iter().filter(|r| ran(&r.2)).max_by_key(|r| r.0);
    let peer = rows.iter().filter(|r| ran(&r.3)).map(|r| r.0).max();
    let ours = ours.map_or("none".to_string(), |r| format!("{} ({})", r.0, r.1));
    let peer = match peer {
        Some(seq) => seq.to_string(),
        None if peer_run => "none".into(),
        None => "not run (--python none)".into(),
    };
    format!("longest length each side ran: longctx {ours}; PyTorch {peer}")
}

/// Our side beside transformers' `LlamaForCausalLM` on the GPU (`bench/peer_train_gpu.py`), each length in its
/// layout: tokens/s, MFU over one stated peak for both sides, peak device memory. The sides alternate `rounds`
/// times (medians printed); a side that fails at a length stops there and its row says so, and the bench goes on
/// to the next length. Every length's recipe and layout is checked before the first run.
fn gpu_table(exe: &Path, opts: &BenchOptions, device: Device) -> Result<()> {
    let option = |option: &str, detail: String| TrainError::InvalidOption { option: option.into(), detail };
    if opts.family != Family::Llama {
        return Err(option("--family", format!("{}: the GPU peer trains a Llama only", opts.family.name())));
    }
    let model = match &opts.model {
        Some(m) => m.parse()?,
        None => GpuModel::default_for(device),
    };
    let base = Layout {
        cp: opts.cp.unwrap_or(1),
        recompute: match opts.recompute.as_slice() {
            [] => None,
            [one] => Some(one.clone()),
            _ => {
                return Err(option(
                    "--recompute",
                    "the GPU table runs one policy per length (name others per length in --layout)".into(),
                ))
            }
        },
        offload: opts.offload.clone(),
    };
    if let Some(why) = base.problem() {
        return Err(option("--cp, --recompute or --offload", why));
    }
    let layouts = parse_layouts(opts.layout.as_deref().unwrap_or(""), &base, &opts.seqs)?;
    let (peak_flops, peak_source) = match (opts.peak_tflops, device) {
        (Some(t), _) if t.is_finite() && t > 0.0 => (t * 1e12, "given with --peak-tflops".to_string()),
        (Some(t), _) => return Err(option("--peak-tflops", format!("{t} (a positive number of TFLOP/s)"))),
        (None, Device::Cuda(_)) => (
            DATASHEET_TFLOPS * 1e12,
            "the H200's dense bf16 datasheet figure, the default on cuda (--peak-tflops F for another GPU)".into(),
        ),
        (None, _) => {
            (measure_peak_flops()?, "the host's FMA peak measured now: the emulator computes on the host".into())
        }
    };
    let script = peer_script("peer_train_gpu.py");
    if let Some(py) = &opts.python {
        if !script.is_file() {
            return Err(option(
                "--python",
                format!(
                    "the peer {} is not there (set LONGCTX_PEER_SCRIPTS to the folder of the peer scripts, or \
                     --python none)",
                    script.display()
                ),
            ));
        }
        // A Python that does not start is found now, not after the first of our runs.
        Command::new(py).arg("--version").output().map_err(|e| TrainError::io(py, e))?;
    }
    // The peer on the GPU we train on; beside the emulator, on the CPU (its figures then say nothing about a GPU).
    let peer_device = match device {
        Device::Cuda(n) => format!("cuda:{n}"),
        Device::Cpu | Device::CudaEmulated => "cpu".to_string(),
    };
    // Every length's recipe first: a refused length or layout fails in a second, not after an hour of others.
    let mut plans = Vec::new();
    for &seq in &opts.seqs {
        let layout = layouts.get(&seq).unwrap_or(&base).clone();
        let mut sets = gpu_overrides(model, seq, opts.steps);
        sets.extend(layout.sets());
        sets.push(format!("parallel.cp={}", layout.cp));
        let recipe = Recipe::load("tiny-llama", &sets)?;
        plans.push((seq, layout, sets, recipe));
    }
    let Some((_, _, _, first)) = plans.first() else {
        return Err(option("--seqs", "no sequence length given".into()));
    };
    let m = &first.model;
    let weights: usize = param_shapes(m).iter().map(|(_, d)| d.iter().product::<usize>()).sum();
    let params = if weights >= 1_000_000_000 {
        format!("{:.2} B", weights as f64 / 1e9)
    } else {
        format!("{:.1} M", weights as f64 / 1e6)
    };
    let adamw = if peer_device == "cpu" { "AdamW (not fused on the CPU)" } else { "fused AdamW" };
    println!(
        "# longctx bench --device {device}: {} ({} layers, d {}, {}/{} heads, SwiGLU {}, vocab {}, RoPE θ {}, {params} \
         parameters), bf16 with f32 master weights, batch 1; peer: transformers LlamaForCausalLM, SDPA, bf16 autocast, \
         {adamw} (bench/peer_train_gpu.py) on {peer_device}",
        model.name(),
        m.layers,
        m.d_model,
        m.heads,
        m.kv_heads,
        m.ffn,
        m.vocab,
        m.rope_theta,
    );
    // The emulator's host peak is some GFLOP/s: printed as TFLOP/s it would read 0.
    let peak = if peak_flops >= 1e13 {
        format!("{:.0} TFLOP/s", peak_flops / 1e12)
    } else {
        format!("{:.1} GFLOP/s", peak_flops / 1e9)
    };
    println!(
        "# MFU = tokens/s × model FLOPs per token (6N + causal attention, as longctx train counts them) over {peak}: \
         {peak_source}; {} timed steps after one untimed; median of {} alternating rounds; peak device MiB: ours the \
         device pool's high-water mark, the peer's torch.cuda.max_memory_allocated",
        opts.steps,
        opts.rounds.max(1)
    );
    println!("| seq | layout | longctx tok/s | MFU | peak device MiB | PyTorch tok/s | PyTorch MFU | PyTorch peak MiB (max_memory_allocated) | tok/s ratio | memory ratio |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let out = opts.scratch.join("gpu");
    let mut rows = Vec::new();
    for (seq, layout, sets, recipe) in plans {
        let fpt = flops_per_token(&recipe, weights);
        let peer_args = gpu_peer_args(&recipe);
        let (mut us_runs, mut them_runs) = (Vec::new(), Vec::new());
        let (mut us_failed, mut them_other) = (None, None);
        for _ in 0..opts.rounds.max(1) {
            if us_failed.is_none() {
                match ours(exe, &out, "tiny-llama", &sets, layout.cp, Some(device)) {
                    Ok(s) => us_runs.push(s),
                    Err(e) => us_failed = Some(cell_text(&e)),
                }
                // The final checkpoint of an 8B-shaped run is 23 GB (weights and AdamW moments): gone before the
                // next run writes its own.
                let _ = std::fs::remove_dir_all(&out);
            }
            if let (Some(py), None) = (&opts.python, &them_other) {
                // A peer that says something unreadable fails its row, not the bench.
                match gpu_peer(py, &script, &peer_args, seq, opts.steps, &peer_device) {
                    Ok(Outcome::Ran(s)) => them_runs.push(s),
                    Ok(other) => them_other = Some(other),
                    Err(e) => them_other = Some(Outcome::Failed(cell_text(&e))),
                }
            }
        }
        let us = match (us_runs.is_empty(), us_failed) {
            (false, _) => Outcome::Ran(median_side(&us_runs)),
            (true, Some(why)) => Outcome::Failed(why),
            (true, None) => Outcome::Absent,
        };
        let them = match (them_runs.is_empty(), them_other) {
            (false, _) => Outcome::Ran(median_side(&them_runs)),
            (true, Some(other)) => other,
            (true, None) => Outcome::Absent,
        };
        if let Outcome::Oom { detail, .. } = &them {
            eprintln!("# peer at {seq}: {detail}");
        }
        println!("{}", gpu_row(seq, &layout, &us, &them, fpt, peak_flops));
        rows.push((seq, layout, us, them));
    }
    println!();
    println!("{}", longest_line(&rows, opts.python.is_some()));
    if let Some(line) = exposed_line(&rows) {
        println!("{line}");
    }
    if let Some(line) = planner_line(&rows) {
        println!("{line}");
    }
    Ok(())
}

/// The line after the GPU table: the planner's device memory for each row ours ran beside the pool's measured
/// peak (the issue's goal: within 10%), which calibrates `longctx plan`.
fn planner_line(rows: &[(usize, Layout, Outcome, Outcome)]) -> Option<String> {
    let parts: Vec<String> = rows
        .iter()
        .filter_map(|(seq, layout, ours, _)| match ours {
            Outcome::Ran(s) if s.predicted_device_mib > 0.0 && s.device_peak_mib > 0.0 => Some(format!(
                "{seq} ({layout}) {:.0} / {:.0} MiB = {:.2}",
                s.predicted_device_mib,
                s.device_peak_mib,
                s.predicted_device_mib / s.device_peak_mib
            )),
            _ => None,
        })
        .collect();
    (!parts.is_empty()).then(|| format!("planner's device memory / measured peak: {}", parts.join("; ")))
}

/// The line after the GPU table on the rows run with CP: the share of rank 0's step its compute queue stood idle
/// in ring attention for want of communication, on the device's clock (the issue's goal: under 5%).
fn exposed_line(rows: &[(usize, Layout, Outcome, Outcome)]) -> Option<String> {
    let parts: Vec<String> = rows
        .iter()
        .filter_map(|(seq, layout, ours, _)| match ours {
            Outcome::Ran(s) if layout.cp > 1 => Some(format!("{seq} ({layout}) {:.1}%", 100.0 * s.cp_exposed)),
            _ => None,
        })
        .collect();
    (!parts.is_empty()).then(|| {
        format!(
            "exposed CP communication (rank 0's compute queue idle in ring attention, device clock; share of its step): {}",
            parts.join("; ")
        )
    })
}

/// Runs the comparison and prints its tables: the GPU table when `--device` names a GPU, else the CPU ones.
///
/// Errors, before anything runs: [`TrainError::CudaNotCompiled`] for `cuda:N` in a build without the `cuda`
/// feature; [`TrainError::InvalidOption`] naming the option for a device that does not parse, a GPU table's option
/// given to the CPU tables, or a `--layout` that does not parse; the recipe's own error for a length or layout it
/// refuses.
pub fn run(opts: &BenchOptions) -> Result<()> {
    let device = opts.device.as_deref().map(parse_device).transpose()?.unwrap_or(Device::Cpu);
    if device != Device::Cpu {
        // Before any work: a build that cannot reach the GPU says so at once rather than in every row.
        crate::device::check_compiled(device)?;
        let exe = std::env::current_exe().map_err(|e| TrainError::io("longctx", e))?;
        return gpu_table(&exe, opts, device);
    }
    for (option, given) in [
        ("--model", opts.model.is_some()),
        ("--peak-tflops", opts.peak_tflops.is_some()),
        ("--layout", opts.layout.is_some()),
    ] {
        if given {
            return Err(TrainError::InvalidOption {
                option: option.into(),
                detail: "is an option of the GPU table (--device cuda:N or cuda-emulated); the CPU tables have none"
                    .into(),
            });
        }
    }
    let exe = std::env::current_exe().map_err(|e| TrainError::io("longctx", e))?;
    let script = peer_script("peer_train.py");
    if !opts.recompute.is_empty() {
        return recompute_table(&exe, opts);
    }
    if let Some(tier) = &opts.offload {
        return offload_table(&exe, opts, tier);
    }
    let (peak, gemm) = (measure_peak_flops()?, measure_gemm_flops()?);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let name = bench_recipe(opts.family);
    match opts.family {
        Family::Llama => println!(
            "# longctx bench: tiny Llama (4 layers, d 256, 4/2 heads, SwiGLU 688, vocab 257), batch 1, {threads} threads"
        ),
        _ => println!(
            "# longctx bench: {name} ({}), batch 1, {threads} threads",
            Recipe::load(name, &[])?.description
        ),
    }
    println!(
        "# peak measured here: FMA chains {:.1} GFLOP/s (MFU = model FLOPs/s over it), a 1024³ GEMM {:.1} GFLOP/s \
         ({:.0}% of it); {} timed steps after one untimed; median of {} alternating rounds",
        peak / 1e9,
        gemm / 1e9,
        100.0 * gemm / peak,
        opts.steps,
        opts.rounds.max(1)
    );
    println!("| seq | dtype | longctx tok/s | PyTorch tok/s | ratio | longctx MFU | PyTorch MFU | longctx peak RSS | PyTorch peak RSS | RSS ratio |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for &seq in &opts.seqs {
        for dtype in &opts.dtypes {
            let sets = family_overrides(opts.family, seq, opts.steps, dtype);
            let recipe = Recipe::load(name, &sets)?;
            let model_args = peer_model_args(&recipe);
            let weights: usize = param_shapes(&recipe.model).iter().map(|(_, d)| d.iter().product::<usize>()).sum();
            let fpt = flops_per_token(&recipe, weights);
            // Alternate the two sides `rounds` times and keep each side's median, so load that comes and goes
            // falls on both.
            let (mut us_runs, mut them_runs) = (Vec::new(), Vec::new());
            for _ in 0..opts.rounds.max(1) {
                us_runs.push(ours(&exe, &opts.scratch.join(format!("ours-{seq}-{dtype}")), name, &sets, 1, None)?);
                if let Some(py) = &opts.python {
                    if let Some(p) = peer(py, &script, &model_args, seq, opts.steps, dtype)? {
                        them_runs.push(p);
                    }
                }
            }
            let us = median_side(&us_runs);
            let them = (!them_runs.is_empty()).then(|| median_side(&them_runs));
            let mfu = |tps: f64| format!("{:.1}%", 100.0 * tps * fpt / peak);
            let (pt, pm, pr, ratio, rss_ratio) = match them {
                Some(p) => (
                    format!("{:.0}", p.tokens_per_s),
                    mfu(p.tokens_per_s),
                    format!("{:.0} MiB", p.peak_rss_mib),
                    format!("{:.2}×", us.tokens_per_s / p.tokens_per_s),
                    format!("{:.2}×", us.peak_rss_mib / p.peak_rss_mib),
                ),
                None => ("–".into(), "–".into(), "–".into(), "–".into(), "–".into()),
            };
            println!(
                "| {seq} | {dtype} | {:.0} | {pt} | {ratio} | {} | {pm} | {:.0} MiB | {pr} | {rss_ratio} |",
                us.tokens_per_s,
                mfu(us.tokens_per_s),
                us.peak_rss_mib
            );
        }
    }
    let cp = opts.cp.unwrap_or(4);
    if cp > 1 {
        let seq = *opts.seqs.iter().max().unwrap_or(&4096);
        let dtype = opts.dtypes.first().map_or("f32", String::as_str);
        let sets = family_overrides(opts.family, seq, 0, dtype);
        println!();
        println!("| seq | dtype | CP | activations saved per rank | step-1 loss | process peak RSS |");
        println!("|---|---|---|---|---|---|");
        for cp in [1, cp] {
            let s = ours(&exe, &opts.scratch.join(format!("cp{cp}-{seq}")), name, &sets, cp, None)?;
            println!(
                "| {seq} | {dtype} | {cp} | {:.1} MiB | {:.6} | {:.0} MiB (all {cp} ranks) |",
                s.saved_mib_per_rank, s.loss_first, s.peak_rss_mib
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipe::{Precision, RopeScalingConfig};

    fn option_of(e: &TrainError) -> &str {
        match e {
            TrainError::InvalidOption { option, .. } => option,
            other => panic!("not an InvalidOption: {other}"),
        }
    }

    fn side(tokens_per_s: f64, device_peak_mib: f64) -> Side {
        Side { tokens_per_s, device_peak_mib, ..Side::default() }
    }

    fn opts(device: &str) -> BenchOptions {
        BenchOptions {
            seqs: vec![128],
            steps: 1,
            dtypes: vec!["bf16".into()],
            // A Python that does not exist and a scratch folder that cannot be made: anything that ran would fail
            // on them, so the test sees that nothing did.
            python: Some("/nonexistent/python3".into()),
            cp: None,
            scratch: PathBuf::from("/nonexistent/longctx-bench-scratch"),
            recompute: Vec::new(),
            offload: None,
            rounds: 1,
            family: Family::Llama,
            device: Some(device.into()),
            model: None,
            peak_tflops: None,
            layout: None,
        }
    }

    #[test]
    fn the_device_parses_with_cuda_meaning_ordinal_0_and_a_bad_one_names_the_option() {
        for (s, d) in [
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:0", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
            ("cuda-emulated", Device::CudaEmulated),
        ] {
            assert_eq!(parse_device(s).unwrap(), d, "{s}");
        }
        for s in ["gpu", "cuda:", "cuda:x", "CUDA"] {
            let e = parse_device(s).unwrap_err();
            assert_eq!(option_of(&e), "--device", "{s}");
            assert!(e.to_string().contains(s), "{e}");
        }
        let e = run(&opts("tpu")).unwrap_err();
        assert_eq!(option_of(&e), "--device");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_in_a_build_without_the_feature_fails_typed_before_running_anything() {
        for device in ["cuda:0", "cuda"] {
            let e = run(&opts(device)).unwrap_err();
            assert!(matches!(e, TrainError::CudaNotCompiled { ordinal: 0 }), "{device}: {e}");
        }
        assert!(!Path::new("/nonexistent/longctx-bench-scratch").exists());
    }

    #[test]
    fn the_gpu_options_are_refused_by_the_cpu_tables() {
        for (o, set) in [
            ("--model", (|o: &mut BenchOptions| o.model = Some("tiny".into())) as fn(&mut BenchOptions)),
            ("--peak-tflops", |o| o.peak_tflops = Some(989.0)),
            ("--layout", |o| o.layout = Some("128:cp=1".into())),
        ] {
            let mut opts = opts("cpu");
            set(&mut opts);
            let e = run(&opts).unwrap_err();
            assert_eq!(option_of(&e), o, "{e}");
        }
    }

    #[test]
    fn the_gpu_models_are_the_peers_with_plain_rope_bf16_and_its_learning_rate() {
        assert_eq!("tiny".parse::<GpuModel>().unwrap(), GpuModel::Tiny);
        assert_eq!("llama3-8b-4l".parse::<GpuModel>().unwrap(), GpuModel::Llama3_8b4l);
        assert_eq!(option_of(&"llama3".parse::<GpuModel>().unwrap_err()), "--model");
        assert_eq!(GpuModel::default_for(Device::Cuda(1)), GpuModel::Llama3_8b4l);
        assert_eq!(GpuModel::default_for(Device::CudaEmulated), GpuModel::Tiny);

        let r = Recipe::load("tiny-llama", &gpu_overrides(GpuModel::Llama3_8b4l, 16384, 2)).unwrap();
        let m = &r.model;
        assert_eq!((m.layers, m.d_model, m.heads, m.kv_heads, m.ffn, m.vocab), (4, 4096, 32, 8, 14336, 128256));
        assert_eq!((m.head_dim(), m.rope_theta, m.tie_embeddings), (128, 500000.0, false));
        assert_eq!(m.rope_scaling, Some(RopeScalingConfig::Default));
        assert_eq!((r.train.seq_len, r.train.batch, r.train.steps, r.train.precision), (16384, 1, 3, Precision::Bf16));
        assert_eq!((r.train.lr, r.train.min_lr, r.train.warmup), (3e-4, 3e-4, 0));
        // The parameters transformers counts for this LlamaConfig: 1.92 B.
        let weights: usize = param_shapes(m).iter().map(|(_, d)| d.iter().product::<usize>()).sum();
        assert_eq!(weights, 1_923_125_248);
        // 6 × the matrix weights (the embedding gather and the norms multiply nothing) + causal attention.
        let matmul = weights - 128256 * 4096 - 9 * 4096;
        assert_eq!(flops_per_token(&r, weights), 6.0 * matmul as f64 + 6.0 * (4 * 32 * 128 * 16384) as f64);
        let args = gpu_peer_args(&r).join(" ");
        assert_eq!(args, "--layers 4 --d-model 4096 --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256 --theta 500000");

        let r = Recipe::load("tiny-llama", &gpu_overrides(GpuModel::Tiny, 256, 1)).unwrap();
        assert_eq!(
            (r.model.d_model, r.model.heads, r.model.kv_heads, r.model.ffn, r.model.vocab),
            (256, 4, 2, 688, 257)
        );
        assert_eq!(r.model.rope_scaling, Some(RopeScalingConfig::Default));
    }

    #[test]
    fn layouts_parse_per_length_over_the_base_and_a_bad_one_names_the_option() {
        let base = Layout { cp: 1, recompute: None, offload: Some("host".into()) };
        let seqs = [16384, 65536, 131072];
        let l = parse_layouts(
            " 65536:cp=2,recompute=selective:norm,mlp_act,offload=disk ; 131072:recompute=full;",
            &base,
            &seqs,
        )
        .unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(
            l[&65536],
            Layout { cp: 2, recompute: Some("selective:norm,mlp_act".into()), offload: Some("disk".into()) }
        );
        assert_eq!(l[&131072], Layout { cp: 1, recompute: Some("full".into()), offload: Some("host".into()) });
        assert_eq!(l[&65536].to_string(), "cp 2, recompute selective:norm,mlp_act, offload disk");
        assert_eq!(Layout { cp: 4, recompute: None, offload: None }.to_string(), "cp 4");
        assert_eq!(l[&131072].sets(), ["train.recompute=\"full\"", "train.offload=\"host\""]);
        assert!(parse_layouts("", &base, &seqs).unwrap().is_empty());
        for (spec, says) in [
            ("8192:cp=2", "not one of --seqs"),
            ("16384", "expected SEQ:"),
            ("16k:cp=2", "not a sequence length"),
            ("16384:cp=two", "not a whole number"),
            ("16384:cp=0", "at least 1"),
            ("16384:tp=2", "unknown field `tp`"),
            ("16384:recompute=most", "recompute=most"),
            ("16384:offload=ssd", "none, host or disk"),
            ("16384:cp=2;16384:cp=4", "named twice"),
            ("16384:full", "fields are cp=N"),
        ] {
            let e = parse_layouts(spec, &base, &seqs).unwrap_err();
            assert_eq!(option_of(&e), "--layout", "{spec}");
            assert!(e.to_string().contains(says), "{spec}: {e}");
        }
    }

    #[test]
    fn the_peers_json_reads_as_a_run_or_an_oom() {
        let ok = r#"{"seq": 16384, "tokens_per_s": 45472.5, "step_s": 0.36, "peak_alloc_mib": 64512.0,
            "peak_reserved_mib": 70000.0, "loss_first": 11.9, "loss_last": 9.5, "params": 1923125248,
            "status": "ok"}"#
            .replace('\n', " ");
        let Outcome::Ran(s) = parse_gpu_peer(&ok).unwrap() else { panic!("not a run") };
        assert_eq!((s.tokens_per_s, s.device_peak_mib, s.loss_first, s.loss_last), (45472.5, 64512.0, 11.9, 9.5));
        // On the CPU the device fields are null.
        let cpu = r#"{"seq": 128, "tokens_per_s": 900.0, "peak_alloc_mib": null, "status": "ok"}"#;
        let Outcome::Ran(s) = parse_gpu_peer(cpu).unwrap() else { panic!("not a run") };
        assert_eq!(s.device_peak_mib, 0.0);
        let oom = r#"{"seq": 65536, "status": "oom", "peak_alloc_mib": 120000.5, "detail": "CUDA out of memory. Tried to allocate 31.31 GiB"}"#;
        assert_eq!(
            parse_gpu_peer(oom).unwrap(),
            Outcome::Oom { peak_alloc_mib: 120000.5, detail: "CUDA out of memory. Tried to allocate 31.31 GiB".into() }
        );
        for bad in [r#"{"seq": 1, "status": "error"}"#, r#"{"seq": 1}"#, r#"{"seq": 1, "status": "ok"}"#, "{oops"] {
            assert!(matches!(parse_gpu_peer(bad), Err(TrainError::Child { .. })), "{bad}");
        }
    }

    #[test]
    fn gpu_rows_print_both_sides_and_their_ratios_or_dashes() {
        let cp1 = Layout { cp: 1, recompute: None, offload: None };
        // 1e9 FLOPs per token over a 1e15 peak: 1000 tokens/s is 0.1% MFU.
        let (fpt, peak) = (1e9, 1e15);
        let row = |u: &Outcome, p: &Outcome| gpu_row(16384, &cp1, u, p, fpt, peak);
        assert_eq!(
            row(&Outcome::Ran(side(2000.0, 30000.0)), &Outcome::Ran(side(1000.0, 60000.0))),
            "| 16384 | cp 1 | 2000 | 0.2% | 30000 MiB | 1000 | 0.1% | 60000 MiB | 2.00× | 0.50× |"
        );
        // No device peak on our side yet (a run without `device_peak_mib`): a dash, and no memory ratio.
        assert_eq!(
            row(&Outcome::Ran(side(2000.0, 0.0)), &Outcome::Ran(side(1000.0, 60000.0))),
            "| 16384 | cp 1 | 2000 | 0.2% | – | 1000 | 0.1% | 60000 MiB | 2.00× | – |"
        );
        let oom = Outcome::Oom { peak_alloc_mib: 131000.0, detail: "CUDA out of memory".into() };
        let layout = Layout { cp: 4, recompute: Some("full".into()), offload: Some("host".into()) };
        assert_eq!(
            gpu_row(65536, &layout, &Outcome::Ran(side(500.0, 70000.0)), &oom, fpt, peak),
            "| 65536 | cp 4, recompute full, offload host | 500 | 0.1% | 70000 MiB | OOM | OOM | OOM (131000 MiB \
             allocated) | – | – |"
        );
        let oom0 = Outcome::Oom { peak_alloc_mib: 0.0, detail: String::new() };
        assert!(row(&Outcome::Absent, &oom0).ends_with("| – | – | – | OOM | OOM | OOM | – | – |"));
        assert_eq!(
            row(&Outcome::Failed("out of device memory".into()), &Outcome::Ran(side(1000.0, 60000.0))),
            "| 16384 | cp 1 | failed: out of device memory | – | – | 1000 | 0.1% | 60000 MiB | – | – |"
        );
        assert_eq!(
            row(&Outcome::Ran(side(2000.0, 1.0)), &Outcome::Absent),
            "| 16384 | cp 1 | 2000 | 0.2% | 1 MiB | – | – | – | – | – |"
        );
    }

    #[test]
    fn a_failure_is_one_escaped_line_of_the_childs_stderr() {
        let e = TrainError::Child {
            what: "our run failed".into(),
            detail: "note: something\nerror: cuda:0: out of memory | allocating 31 GiB\n\n".into(),
        };
        assert_eq!(cell_text(&e), "cuda:0: out of memory \\| allocating 31 GiB");
        let long = TrainError::Child { what: "x".into(), detail: "é".repeat(400) };
        assert_eq!(cell_text(&long).chars().count(), 161);
        assert_eq!(cell_text(&TrainError::Internal("x".into())), "internal error (a bug in longctx): x");
        assert_eq!(cell(" two\nlines | here "), "two lines \\| here");
    }

    #[test]
    fn the_peer_process_reads_as_a_run_an_oom_a_crash_or_absent() {
        // `sh` stands in for Python: each script ignores the flags and says what the peer would.
        let dir = tempfile::tempdir().unwrap();
        let peer = |name: &str, body: &str| {
            let script = dir.path().join(name);
            std::fs::write(&script, body).unwrap();
            gpu_peer("sh", &script, &["--layers".into(), "1".into()], 64, 1, "cpu").unwrap()
        };
        let ran = peer("ok.sh", "echo 'log line'\necho '{\"seq\": 64, \"tokens_per_s\": 10.5, \"status\": \"ok\"}'\n");
        assert!(matches!(ran, Outcome::Ran(s) if s.tokens_per_s == 10.5), "{ran:?}");
        let oom =
            peer("oom.sh", "echo '{\"seq\": 64, \"status\": \"oom\", \"peak_alloc_mib\": 5, \"detail\": \"x\"}'\n");
        assert_eq!(oom, Outcome::Oom { peak_alloc_mib: 5.0, detail: "x".into() });
        let crash = peer("crash.sh", "echo 'Traceback' >&2\necho 'TypeError: a | b' >&2\nexit 1\n");
        assert_eq!(crash, Outcome::Failed("TypeError: a \\| b (exit status: 1)".into()));
        assert_eq!(peer("absent.sh", "echo '# no torch' >&2\n"), Outcome::Absent);
        let e = gpu_peer("sh", &dir.path().join("bad.sh"), &[], 64, 1, "cpu");
        assert!(matches!(e, Ok(Outcome::Failed(_))), "{e:?}");
    }

    #[test]
    fn the_longest_length_of_each_side_follows_the_table() {
        let cp = |n| Layout { cp: n, recompute: None, offload: None };
        let oom = Outcome::Oom { peak_alloc_mib: 1.0, detail: String::new() };
        let rows = vec![
            (16384, cp(1), Outcome::Ran(side(1.0, 1.0)), Outcome::Ran(side(1.0, 1.0))),
            (32768, cp(1), Outcome::Ran(side(1.0, 1.0)), Outcome::Ran(side(1.0, 1.0))),
            (65536, cp(2), Outcome::Ran(side(1.0, 1.0)), oom.clone()),
            (131072, cp(4), Outcome::Failed("out of memory".into()), oom.clone()),
        ];
        assert_eq!(longest_line(&rows, true), "longest length each side ran: longctx 65536 (cp 2); PyTorch 32768");
        let none = vec![(128, cp(1), Outcome::Failed("x".into()), Outcome::Absent)];
        assert_eq!(
            longest_line(&none, false),
            "longest length each side ran: longctx none; PyTorch not run (--python none)"
        );
        // The exposed-communication line names the CP rows ours ran, and only those.
        let exposed = |share| Outcome::Ran(Side { cp_exposed: share, ..side(1.0, 1.0) });
        let rows = vec![
            (16384, cp(1), exposed(0.0), Outcome::Absent),
            (65536, cp(2), exposed(0.031), Outcome::Absent),
            (131072, cp(4), Outcome::Failed("x".into()), Outcome::Absent),
        ];
        assert_eq!(
            exposed_line(&rows).as_deref(),
            Some(
                "exposed CP communication (rank 0's compute queue idle in ring attention, device clock; share of its step): \
                 65536 (cp 2) 3.1%"
            )
        );
        assert_eq!(exposed_line(&rows[..1]), None);
        let planned = |p, m| Outcome::Ran(Side { predicted_device_mib: p, device_peak_mib: m, ..side(1.0, 1.0) });
        let rows = vec![
            (16384, cp(1), planned(1100.0, 1000.0), Outcome::Absent),
            (32768, cp(1), planned(0.0, 5.0), oom.clone()),
        ];
        assert_eq!(
            planner_line(&rows).as_deref(),
            Some("planner's device memory / measured peak: 16384 (cp 1) 1100 / 1000 MiB = 1.10")
        );
    }
}
