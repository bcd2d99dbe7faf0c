//! `longctx bench`: the trainer beside PyTorch eager on CPU (`bench/peer_train.py`), the same tiny model at
//! several sequence lengths, in one run: tokens/s, MFU against the FMA peak measured here, and peak RSS, each
//! side in its own process so its peak memory is its own; then the per-rank activation memory of CP 4 beside
//! CP 1 at the longest length. `--family mixtral|nemotron` benches that family's tiny recipe (`tiny-mixtral`,
//! `tiny-nemotron`) against the peer's model of the same family. `--recompute` and `--offload` compare our own
//! runs instead: recompute policies, or an offload tier, against training with neither.

use std::path::{Path, PathBuf};
use std::process::Command;

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
    /// Context-parallel ranks for the memory comparison at the longest length (0 skips it).
    pub cp: usize,
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
        "train.keep_checkpoints=1".into(),
        format!("train.loss_chunk={}", 1024.min(seq)),
        format!("train.precision=\"{dtype}\""),
    ]
    .into()
}

/// One side of one row.
#[derive(Debug, Clone, Copy, Default)]
struct Side {
    tokens_per_s: f64,
    peak_rss_mib: f64,
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
}

fn ours(exe: &Path, out: &Path, recipe: &str, sets: &[String], cp: usize) -> Result<Side> {
    let _ = std::fs::remove_dir_all(out);
    let mut cmd = Command::new(exe);
    cmd.args(["train", "--recipe", recipe, "--quiet", "--out"]).arg(out).args(["--cp", &cp.to_string()]);
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
        saved_mib_per_rank: steps.iter().map(|r| f(r, "saved_mib_per_rank")).fold(0.0, f64::max),
        predicted_mib_per_rank: steps.iter().map(|r| f(r, "predicted_mib_per_rank")).fold(0.0, f64::max),
        predicted_peak_mib_per_rank: steps.iter().map(|r| f(r, "predicted_peak_mib_per_rank")).fold(0.0, f64::max),
        planned_layers_peak_mib: steps.iter().map(|r| f(r, "planned_layers_peak_mib")).fold(0.0, f64::max),
        step_gflop: steps.first().map_or(0.0, |r| f(r, "step_gflop")),
        recompute_gflop_per_rank: steps.first().map_or(0.0, |r| f(r, "recompute_gflop_per_rank")),
        loss_first: steps.first().map_or(0.0, |r| f(r, "loss")),
        loss_last: steps.last().map_or(0.0, |r| f(r, "loss")),
        offload_wait_s: timed.iter().map(|r| f(r, "offload_wait_s")).sum::<f64>() / timed.len().max(1) as f64,
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
                runs.push(ours(exe, &opts.scratch.join(format!("off-{seq}")), name, &sets_of(side), 1)?);
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
                r.push(ours(exe, &opts.scratch.join(format!("rc-{seq}")), name, &sets_of(p), 1)?);
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

/// Runs the comparison and prints its tables.
pub fn run(opts: &BenchOptions) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| TrainError::io("longctx", e))?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/peer_train.py");
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
                us_runs.push(ours(&exe, &opts.scratch.join(format!("ours-{seq}-{dtype}")), name, &sets, 1)?);
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
    if opts.cp > 1 {
        let seq = *opts.seqs.iter().max().unwrap_or(&4096);
        let dtype = opts.dtypes.first().map_or("f32", String::as_str);
        let sets = family_overrides(opts.family, seq, 0, dtype);
        println!();
        println!("| seq | dtype | CP | activations saved per rank | step-1 loss | process peak RSS |");
        println!("|---|---|---|---|---|---|");
        for cp in [1, opts.cp] {
            let s = ours(&exe, &opts.scratch.join(format!("cp{cp}-{seq}")), name, &sets, cp)?;
            println!(
                "| {seq} | {dtype} | {cp} | {:.1} MiB | {:.6} | {:.0} MiB (all {cp} ranks) |",
                s.saved_mib_per_rank, s.loss_first, s.peak_rss_mib
            );
        }
    }
    Ok(())
}
