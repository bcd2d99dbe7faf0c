//! `longctx plan`: the recompute crate's planner on the command line (a table, `--json`, `--sweep`,
//! `--calibrate`).

use longctx_recompute::models::Mlp;
use longctx_recompute::planner::{korthikanti_layer_bytes, layer_for, parse_tokens, NEMO_LLAMA3_8B};
use longctx_recompute::{device, model, plan, Layout, ModelDesc, PlanInput, PlanReport, Policy};

use crate::error::{Result, TrainError};
use crate::recipe::{Family, ModelConfig, Recipe};

/// The command's options.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// A recipe (built-in name or TOML file) planned as written: its model, sequence length, global batch,
    /// recompute policy and parallel layout (GPUs = TP · PP · CP · DP); the other options then only pick the
    /// device and efficiency.
    #[arg(long, conflicts_with_all = ["model", "seq", "gpus", "cp", "tp", "pp", "global_batch", "sweep"])]
    pub recipe: Option<String>,
    /// llama3-8b, llama3-70b, mixtral-8x7b, nemotron4-15b, nemotron4-22b, tiny-llama.
    #[arg(long, default_value = "llama3-8b")]
    pub model: String,
    /// Tokens per sequence (8K, 128K, 1M).
    #[arg(long, default_value = "128K")]
    pub seq: String,
    /// Devices.
    #[arg(long, default_value_t = 8)]
    pub gpus: u64,
    /// Context parallelism.
    #[arg(long, default_value_t = 1)]
    pub cp: u64,
    /// Tensor parallelism.
    #[arg(long, default_value_t = 1)]
    pub tp: u64,
    /// Pipeline parallelism.
    #[arg(long, default_value_t = 1)]
    pub pp: u64,
    /// a100-80g, h100-80g, h200-141g, b200-180g.
    #[arg(long, default_value = "h100-80g")]
    pub device: String,
    /// A recompute policy; the cheapest that fits when absent.
    #[arg(long)]
    pub recompute: Option<String>,
    /// Sequences per step (default: one per data-parallel rank).
    #[arg(long)]
    pub global_batch: Option<u64>,
    /// Fraction of peak the kernels sustain.
    #[arg(long, default_value_t = 0.5)]
    pub efficiency: f64,
    /// Matrix products at the FP8 peak.
    #[arg(long)]
    pub fp8: bool,
    /// No sequence parallelism with TP.
    #[arg(long)]
    pub no_sequence_parallel: bool,
    /// Let the policy offload saved tensors to host memory over the device's host link (the solver weighs
    /// each transfer against recomputation; a recipe with `train.offload = "host"` implies it).
    #[arg(long)]
    pub offload: bool,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// One row per doubling: `seq=16K..1M`.
    #[arg(long)]
    pub sweep: Option<String>,
    /// The planner against Korthikanti's formula and NeMo's published Llama 3 8B throughput.
    #[arg(long)]
    pub calibrate: bool,
}

const GIB: f64 = (1u64 << 30) as f64;

/// The planner's description of a recipe's model.
pub fn model_desc(name: &str, m: &ModelConfig) -> ModelDesc {
    let moe = m.experts();
    ModelDesc {
        name: name.into(),
        layers: m.layers as u64,
        d_model: m.d_model as u64,
        heads: m.heads as u64,
        kv_heads: m.kv_heads as u64,
        head_dim: m.head_dim() as u64,
        ffn: m.ffn as u64,
        vocab: m.vocab as u64,
        experts: moe.map_or(1, |e| e.experts as u64),
        top_k: moe.map_or(1, |e| e.top_k as u64),
        mlp: if m.family == Family::Nemotron { Mlp::SquaredRelu } else { Mlp::SwiGlu },
        layernorm: m.family == Family::Nemotron,
        tied_embeddings: m.tie_embeddings,
    }
}

/// What `--recipe` plans: the recipe's model, length, batch, policy and layout.
fn recipe_input(a: &PlanArgs, name: &str) -> Result<PlanInput> {
    let r = Recipe::load(name, &[])?;
    let p = &r.parallel;
    let (tp, pp, cp, dp) = (p.tp as u64, p.pp as u64, p.cp as u64, p.dp as u64);
    let policy = match a.recompute.as_deref() {
        Some(s) => s.parse::<Policy>()?,
        None => r.train.recompute.parse::<Policy>()?,
    };
    Ok(PlanInput {
        model: model_desc(&r.name, &r.model),
        device: device(&a.device)?,
        layout: Layout {
            gpus: tp * pp * cp * dp,
            tp,
            cp,
            pp,
            sequence_parallel: !a.no_sequence_parallel && tp > 1,
            distributed_optimizer: true,
            global_batch: r.train.batch as u64,
        },
        seq_len: r.train.seq_len as u64,
        policy: Some(policy),
        efficiency: a.efficiency,
        fp8: a.fp8,
        loss_chunk: r.train.loss_chunk as u64,
        offload: a.offload || r.train.offload == "host",
    })
}

/// The planner's device memory for one rank of a run of `r` as the trainer runs it (its length, batch, CP and DP, its
/// recompute policy and offload tier; no TP or PP; every rank holds the whole optimizer state): the figure a run on
/// a device records beside the pool's measured high-water mark (`predicted_device_mib`), which calibrates the
/// planner. The planner models bf16 training (bf16 weights and activations, f32 master weights, gradients and
/// moments), the GPU's default; an f32 run holds less in weights and more in activations.
pub fn run_memory(r: &Recipe) -> Result<longctx_recompute::MemoryBreakdown> {
    let p = &r.parallel;
    let (cp, dp) = (p.cp as u64, p.dp as u64);
    let input = PlanInput {
        model: model_desc(&r.name, &r.model),
        // Only the memory is read: with the policy given, the device's figures change nothing in it.
        device: device("h200-141g")?,
        layout: Layout {
            gpus: cp * dp,
            tp: 1,
            cp,
            pp: 1,
            sequence_parallel: false,
            distributed_optimizer: false,
            global_batch: r.train.batch as u64,
        },
        seq_len: r.train.seq_len as u64,
        policy: Some(r.train.recompute.parse::<Policy>()?),
        efficiency: 0.5,
        fp8: false,
        loss_chunk: r.train.loss_chunk as u64,
        offload: r.train.offload == "host",
    };
    Ok(plan(&input)?.memory)
}

fn input(a: &PlanArgs, seq: u64) -> Result<PlanInput> {
    let policy = a.recompute.as_deref().map(|p| p.parse::<Policy>()).transpose()?;
    let dp = (a.gpus / (a.tp * a.cp * a.pp).max(1)).max(1);
    Ok(PlanInput {
        model: model(&a.model)?,
        device: device(&a.device)?,
        layout: Layout {
            gpus: a.gpus,
            tp: a.tp,
            cp: a.cp,
            pp: a.pp,
            sequence_parallel: !a.no_sequence_parallel && a.tp > 1,
            distributed_optimizer: true,
            global_batch: a.global_batch.unwrap_or(dp),
        },
        seq_len: seq,
        policy,
        efficiency: a.efficiency,
        fp8: a.fp8,
        loss_chunk: 1024,
        offload: a.offload,
    })
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / GIB)
}

fn print_report(r: &PlanReport) {
    let l = &r.input.layout;
    println!(
        "# {} at {} tokens on {} × {} (TP {} · CP {} · PP {} · DP {}, sequence parallel {}), global batch {}",
        r.input.model.name,
        r.input.seq_len,
        l.gpus,
        r.input.device.name,
        l.tp,
        l.cp,
        l.pp,
        l.dp(),
        l.sequence_parallel,
        l.global_batch
    );
    println!("# recompute policy: {}", r.policy);
    println!("| per device | bytes |");
    println!("|---|---|");
    let mem = &r.memory;
    for (k, v) in [
        ("weights (bf16)", mem.weights),
        ("gradients (f32)", mem.gradients),
        ("optimizer (f32 master + Adam, sharded over DP·CP)", mem.optimizer),
        ("activations per layer (kept)", mem.activations_per_layer),
        ("activations at peak (all layers, in flight, rebuilt)", mem.activations),
        ("loss working set (chunked cross-entropy)", mem.loss),
        ("ring buffers", mem.comm),
        ("total", mem.total),
        ("device memory", r.input.device.memory_bytes),
    ] {
        println!("| {k} | {} |", gib(v));
    }
    if r.input.offload {
        println!("| offloaded to host memory (end of forward) | {} |", gib(mem.host_offload));
        println!("| host memory per device | {} |", gib(r.input.device.host_memory_bytes));
    }
    println!("fits: {}", if r.fits { "yes" } else { "NO" });
    if let Some(s) = longctx_recompute::planner::suggest(r) {
        println!("smallest change that fits: {s}");
    }
    let t = &r.time;
    println!(
        "step {:.2} s: compute {:.2}, recompute {:.2}, offload exposed {:.3}, ring exposed {:.3}, TP {:.3}, bubble {:.3}; {:.0} TFLOP/s per device",
        t.step_seconds,
        t.compute_seconds,
        t.recompute_seconds,
        t.offload_exposed_seconds,
        t.ring_exposed_seconds,
        t.tp_seconds,
        t.bubble_seconds,
        t.tflops_per_device
    );
}

/// Runs the command.
pub fn run(a: &PlanArgs) -> Result<()> {
    if let Some(name) = &a.recipe {
        let r = plan(&recipe_input(a, name)?)?;
        if a.json {
            println!(
                "{}",
                serde_json::to_string_pretty(&r).map_err(|e| TrainError::Internal(format!("the plan as JSON: {e}")))?
            );
        } else {
            print_report(&r);
        }
        return Ok(());
    }
    let sweep = |detail: String| TrainError::InvalidOption { option: "--sweep".into(), detail };
    let seqs: Vec<u64> = match &a.sweep {
        Some(s) => {
            let range = s.strip_prefix("seq=").unwrap_or(s);
            let (lo, hi) = range.split_once("..").ok_or_else(|| sweep(format!("{s}: expected seq=16K..1M")))?;
            let (lo, hi) = (
                parse_tokens(lo).ok_or_else(|| sweep(format!("`{lo}` is not a length")))?,
                parse_tokens(hi).ok_or_else(|| sweep(format!("`{hi}` is not a length")))?,
            );
            std::iter::successors(Some(lo), |&s| (s * 2 <= hi).then_some(s * 2)).collect()
        }
        None => vec![parse_tokens(&a.seq).ok_or_else(|| TrainError::InvalidOption {
            option: "--seq".into(),
            detail: format!("{}: not a length (8K, 1M, 131072)", a.seq),
        })?],
    };
    let mut reports = Vec::new();
    for &s in &seqs {
        reports.push(plan(&input(a, s)?)?);
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&reports)
                .map_err(|e| TrainError::Internal(format!("the plans as JSON: {e}")))?
        );
        return Ok(());
    }
    if seqs.len() == 1 {
        print_report(&reports[0]);
        return Ok(());
    }
    println!("| seq | policy | activations | total | fits | step s | TFLOP/s per device |");
    println!("|---|---|---|---|---|---|---|");
    for r in &reports {
        println!(
            "| {} | {} | {} | {} | {} | {:.2} | {:.0} |",
            r.input.seq_len,
            r.policy,
            gib(r.memory.activations),
            gib(r.memory.total),
            if r.fits { "yes" } else { "no" },
            r.time.step_seconds,
            r.time.tflops_per_device
        );
    }
    Ok(())
}

/// `longctx plan --calibrate`: the planner against published figures.
pub fn calibrate(efficiency: f64) -> Result<()> {
    let m = model("llama3-8b")?;
    println!("# Activation bytes per layer, Llama 3 8B, bf16, batch 1, no recompute");
    println!(
        "| seq | TP | longctx's saved tensors | Korthikanti eq. 2 | ratio | Korthikanti without the a·s² scores |"
    );
    println!("|---|---|---|---|---|---|");
    for (s, t) in [(8192u64, 1u64), (8192, 4), (65536, 1)] {
        let layout = Layout {
            gpus: t,
            tp: t,
            cp: 1,
            pp: 1,
            sequence_parallel: t > 1,
            distributed_optimizer: true,
            global_batch: 1,
        };
        let ours = layer_for(&m, &layout, s).saved_bytes() as f64;
        let k = korthikanti_layer_bytes(s, 1, m.d_model, m.heads, t);
        let k_flash = (s * m.d_model) as f64 * 34.0 / t as f64;
        println!(
            "| {s} | {t} | {:.3} GiB | {:.3} GiB | {:.2} | {:.3} GiB |",
            ours / GIB,
            k / GIB,
            ours / k,
            k_flash / GIB
        );
    }
    println!();
    println!("# Llama 3 8B TFLOP/s per GPU: NeMo 25.04 on DGX-B200 (FP8, published) vs this planner (FP8 peak × {efficiency})");
    println!("| seq | CP | TP | GPUs | NeMo | planner | planner / NeMo |");
    println!("|---|---|---|---|---|---|---|");
    for &(seq, cp, tp, nemo) in NEMO_LLAMA3_8B {
        let gpus = (cp * tp).max(8);
        let a = PlanArgs {
            recipe: None,
            model: "llama3-8b".into(),
            seq: seq.to_string(),
            gpus,
            cp,
            tp,
            pp: 1,
            device: "b200-180g".into(),
            recompute: None,
            global_batch: None,
            efficiency,
            fp8: true,
            no_sequence_parallel: false,
            offload: false,
            json: false,
            sweep: None,
            calibrate: false,
        };
        let r = plan(&input(&a, seq)?)?;
        println!(
            "| {seq} | {cp} | {tp} | {gpus} | {nemo:.0} | {:.0} | {:.2} |",
            r.time.tflops_per_device,
            r.time.tflops_per_device / nemo
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        plan: PlanArgs,
    }

    /// The seed's full-size recipes with NeMo's GPU counts (nemo/collections/llm/recipes/*_{16k,64k,128k}.py).
    const NEMO_GPUS: &[(&str, u64)] = &[
        ("llama3-8b-16k", 16),
        ("llama3-8b-64k", 32),
        ("llama3-8b-128k", 64),
        ("llama3-70b-16k", 32),
        ("llama3-70b-64k", 256),
        ("mixtral-8x7b-16k", 32),
        ("mixtral-8x7b-64k", 128),
        ("nemotron4-15b-16k", 8),
        ("nemotron4-15b-64k", 32),
        ("nemotron4-22b-16k", 8),
        ("nemotron4-22b-64k", 32),
    ];

    #[test]
    fn full_size_recipes_plan_as_written_on_nemos_gpu_counts_and_fit_an_h100() {
        for &(name, gpus) in NEMO_GPUS {
            let cli = Cli::parse_from(["plan", "--recipe", name, "--device", "h100-80g"]);
            let input = recipe_input(&cli.plan, name).unwrap_or_else(|e| panic!("{name}: {e}"));
            let r = Recipe::load(name, &[]).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(input.layout.gpus, gpus, "{name}");
            assert_eq!(input.seq_len, r.train.seq_len as u64, "{name}");
            assert_eq!(input.layout.global_batch, r.train.batch as u64, "{name}");
            let report = plan(&input).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(report.fits, "{name}: {} GiB", report.memory.total as f64 / GIB);
            assert!(r.parallel.check_trainable().is_err(), "{name} has TP/PP and must not train as is");
        }
    }

    #[test]
    fn a_full_size_recipe_plans_as_the_planners_own_model() {
        for (recipe, builtin) in [
            ("mixtral-8x7b-16k", "mixtral-8x7b"),
            ("nemotron4-15b-16k", "nemotron4-15b"),
            ("nemotron4-22b-64k", "nemotron4-22b"),
            ("llama3-8b-128k", "llama3-8b"),
            ("llama3-70b-16k", "llama3-70b"),
        ] {
            let r = Recipe::load(recipe, &[]).unwrap();
            let want = model(builtin).unwrap();
            let got = ModelDesc { name: want.name.clone(), ..model_desc(recipe, &r.model) };
            assert_eq!(got, want, "{recipe}");
        }
    }
}
