//! `longctx`: train a recipe, evaluate a checkpoint, list recipes, plot a run.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use longctx_trainer::recipe::{Family, Recipe, BUILTIN};
use longctx_trainer::train::{train, RunOptions};
use longctx_trainer::{eval, plot, Result, TrainError};

#[derive(Parser)]
#[command(name = "longctx", version, about = "The longctx reference trainer")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a recipe (a built-in name or a TOML file).
    Train {
        /// `tiny-llama`, another built-in (see `longctx recipes`), or a path to a TOML recipe.
        #[arg(long, default_value = "tiny-llama")]
        recipe: String,
        /// Output folder (metrics, checkpoints); `runs/<recipe name>` when absent.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Override a recipe field: `--set train.steps=30 --set model.layers=2`.
        #[arg(long = "set", value_name = "FIELD=VALUE")]
        set: Vec<String>,
        /// Context-parallel ranks (`parallel.cp`).
        #[arg(long)]
        cp: Option<usize>,
        /// Data-parallel groups (`parallel.dp`).
        #[arg(long)]
        dp: Option<usize>,
        /// Activation recomputation (`train.recompute`): `none`, `full`, `selective[:MODULES]`, `uniform:K`, `block:N`,
        /// `budget:BYTES`.
        #[arg(long)]
        recompute: Option<String>,
        /// Offload kept activations (`train.offload`): none, host or disk.
        #[arg(long)]
        offload: Option<String>,
        /// Layers offloaded, from the first (`train.offload_layers`; default all but the last).
        #[arg(long)]
        offload_layers: Option<usize>,
        /// The offload tier's byte budget (`train.offload_budget`, e.g. 8GiB).
        #[arg(long)]
        offload_budget: Option<String>,
        /// Continue from the newest checkpoint in the output folder.
        #[arg(long)]
        resume: bool,
        /// No progress bar or log lines.
        #[arg(long)]
        quiet: bool,
        /// Stop after this step, saving a checkpoint (continue with `--resume`).
        #[arg(long, value_name = "STEP")]
        stop_at: Option<u64>,
    },
    /// Mean next-token cross-entropy of a checkpoint over a token file.
    Eval {
        /// A checkpoint folder, or a run's output folder (its newest checkpoint).
        #[arg(long)]
        checkpoint: PathBuf,
        /// A `.npy` of integer token ids, or a text file (byte tokens).
        #[arg(long)]
        tokens: PathBuf,
        /// Tokens per window.
        #[arg(long)]
        seq: usize,
        /// Context-parallel ranks.
        #[arg(long, default_value_t = 1)]
        cp: usize,
    },
    /// List the built-in recipes, or print one.
    Recipes {
        /// Print this recipe's TOML.
        #[arg(long)]
        show: Option<String>,
    },
    /// The trainer beside PyTorch eager (bench/peer_train.py) on the same tiny Llama: tokens/s, MFU, peak RSS.
    Bench {
        /// Sequence lengths.
        #[arg(long, value_delimiter = ',', default_value = "4096,16384,65536")]
        seqs: Vec<usize>,
        /// Timed steps per run.
        #[arg(long, default_value_t = 2)]
        steps: u64,
        /// Number formats.
        #[arg(long, value_delimiter = ',', default_value = "f32,bf16")]
        dtypes: Vec<String>,
        /// The Python with torch for the peer column (`none` leaves it out).
        #[arg(long, default_value = "python3")]
        python: String,
        /// Context-parallel ranks of the memory comparison at the longest length (0 skips it).
        #[arg(long, default_value_t = 4)]
        cp: usize,
        /// Compare these recompute policies with `none` (our side only): `--recompute selective,full`.
        #[arg(long, value_delimiter = ',')]
        recompute: Vec<String>,
        /// Alternating rounds per row (medians printed).
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// The model family: `llama` (the bench model), `mixtral` or `nemotron` (their tiny recipes).
        #[arg(long, default_value = "llama")]
        family: String,
    },
    /// Per-device memory and step time of a model at a length and layout, and the cheapest recompute policy
    /// that fits (longctx-recompute's planner).
    Plan(longctx_trainer::plan_cmd::PlanArgs),
    /// Draw the loss curves of a run's `metrics.jsonl` into a PNG.
    Plot {
        /// The metrics file.
        metrics: PathBuf,
        /// The image to write.
        #[arg(short, long, default_value = "loss.png")]
        output: PathBuf,
    },
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train {
            recipe,
            out,
            mut set,
            cp,
            dp,
            recompute,
            offload,
            offload_layers,
            offload_budget,
            resume,
            quiet,
            stop_at,
        } => {
            if let Some(cp) = cp {
                set.push(format!("parallel.cp={cp}"));
            }
            if let Some(dp) = dp {
                set.push(format!("parallel.dp={dp}"));
            }
            if let Some(r) = recompute {
                set.push(format!("train.recompute=\"{r}\""));
            }
            if let Some(o) = offload {
                set.push(format!("train.offload=\"{o}\""));
            }
            if let Some(n) = offload_layers {
                set.push(format!("train.offload_layers={n}"));
            }
            if let Some(b) = offload_budget {
                set.push(format!("train.offload_budget=\"{b}\""));
            }
            let recipe = Recipe::load(&recipe, &set)?;
            let out = out.unwrap_or_else(|| PathBuf::from("runs").join(&recipe.name));
            let s = train(&recipe, &RunOptions { out: out.clone(), resume, quiet, stop_at })?;
            if let (Some(first), Some(last)) = (s.losses.first(), s.losses.last()) {
                println!(
                    "trained steps {}..{}: loss {:.4} -> {:.4}{}",
                    first.0,
                    last.0,
                    first.1,
                    last.1,
                    s.val_losses.last().map_or(String::new(), |v| format!(", held-out {:.4}", v.1))
                );
            }
            if s.interrupted {
                println!("stopped: checkpoint of step {} saved; continue with --resume", s.last_step);
            }
            println!("output: {} (metrics.jsonl, checkpoints/, recipe.toml)", out.display());
        }
        Command::Eval { checkpoint, tokens, seq, cp } => {
            let ids = eval::read_tokens(&tokens)?;
            let r = eval::evaluate(&checkpoint, &ids, seq, cp)?;
            println!(
                "loss {:.6} nats/token over {} tokens ({} windows of {seq}, cp {cp})",
                r.loss, r.tokens, r.windows
            );
        }
        Command::Recipes { show: Some(name) } => {
            let r = Recipe::load(&name, &[])?;
            print!("{}", r.to_toml());
        }
        Command::Recipes { show: None } => {
            for (name, _) in BUILTIN {
                let r = Recipe::load(name, &[])?;
                println!("{name:<18} {}", r.description);
            }
        }
        Command::Bench { seqs, steps, dtypes, python, cp, recompute, rounds, family } => {
            let python = (python != "none").then_some(python);
            let family = match family.as_str() {
                "llama" => Family::Llama,
                "mixtral" => Family::Mixtral,
                "nemotron" => Family::Nemotron,
                other => {
                    return Err(TrainError::Config(format!("--family `{other}` (llama, mixtral or nemotron)")));
                }
            };
            let scratch = std::env::temp_dir().join(format!("longctx-bench-{}", std::process::id()));
            longctx_trainer::bench::run(&longctx_trainer::bench::BenchOptions {
                seqs,
                steps,
                dtypes,
                python,
                cp,
                scratch,
                recompute,
                rounds,
                family,
            })?;
        }
        Command::Plan(a) if a.calibrate => longctx_trainer::plan_cmd::calibrate(a.efficiency)?,
        Command::Plan(a) => longctx_trainer::plan_cmd::run(&a)?,
        Command::Plot { metrics, output } => {
            plot::plot_metrics(&metrics, &output)?;
            println!("wrote {}", output.display());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
