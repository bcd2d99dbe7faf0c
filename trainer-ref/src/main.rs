//! `longctx`: train a recipe, evaluate a checkpoint, list recipes, plot a run.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use longctx_trainer::device::Device;
use longctx_trainer::recipe::{Family, Recipe, RopeScalingConfig, BUILTIN};
use longctx_trainer::train::{train_from, RunOptions};
use longctx_trainer::{eval, hf, plot, Result, TrainError};

/// The system's allocator, keeping freed memory for reuse, except that a run that offloads maps its large
/// buffers one by one (see `longctx_trainer::alloc`).
#[global_allocator]
static ALLOCATOR: longctx_trainer::alloc::Allocator = longctx_trainer::alloc::Allocator;

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
        /// Where the ranks compute (`parallel.backend`): `cpu` or `cuda:N` (a build with `--features cuda`).
        #[arg(long, value_name = "cpu|cuda:N")]
        device: Option<Device>,
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
        /// Start from a pretrained checkpoint, a Hugging Face directory (`config.json`, safetensors) or a GGUF
        /// file: its model replaces the recipe's (`--set model.rope_scaling…`/`model.rope_theta` may still
        /// change the RoPE) and its tokenizer reads the corpus.
        #[arg(long, value_name = "DIR|FILE.gguf")]
        init_from: Option<PathBuf>,
        /// Context extension: `none`, `linear:F`, `ntk:F[,ORIG]`, `yarn:F[,ORIG]`, `llama3:F[,LOW,HIGH[,ORIG]]`
        /// (`ORIG` defaults to the pretrained checkpoint's trained context).
        #[arg(long, value_name = "TYPE:F")]
        rope_scaling: Option<String>,
    },
    /// Mean next-token cross-entropy of a checkpoint over a token file.
    Eval {
        /// A checkpoint folder, or a run's output folder (its newest checkpoint).
        #[arg(long, required_unless_present = "init_from", conflicts_with = "init_from")]
        checkpoint: Option<PathBuf>,
        /// A pretrained checkpoint instead: a Hugging Face directory (`config.json`, safetensors, optional
        /// `tokenizer.json`) or a GGUF file (`*.gguf`, its tokenizer in its metadata).
        #[arg(long, value_name = "DIR|FILE.gguf")]
        init_from: Option<PathBuf>,
        /// A `.npy` of integer token ids, or a text file (through the checkpoint's tokenizer: the pretrained
        /// one's, or the one a trainer checkpoint saved from its `--init-from`; byte tokens for a trainer
        /// checkpoint without one).
        #[arg(long)]
        tokens: PathBuf,
        /// Tokens per window.
        #[arg(long)]
        seq: usize,
        /// Context-parallel ranks.
        #[arg(long, default_value_t = 1)]
        cp: usize,
        /// Where the ranks compute: `cpu` or `cuda:N` (a build with `--features cuda`); the trainer checkpoint's
        /// `parallel.backend` when absent (`cpu` for `--init-from`).
        #[arg(long, value_name = "cpu|cuda:N")]
        device: Option<Device>,
        /// Context extension of the pretrained checkpoint's RoPE (as `train --rope-scaling`).
        #[arg(long, value_name = "TYPE:F", requires = "init_from")]
        rope_scaling: Option<String>,
    },
    /// Write a trainer checkpoint as a Hugging Face checkpoint directory: `config.json`, safetensors (f32 or
    /// bf16, sharded with `model.safetensors.index.json` past `--max-shard-size`; a Mixtral's experts per expert or
    /// fused), and the run's `tokenizer.json` when its checkpoint carries one; `--init-from` and transformers read
    /// it.
    Export {
        /// The directory to write (new or empty).
        #[arg(long, value_name = "DIR")]
        hf: PathBuf,
        /// A checkpoint folder, or a run's output folder (its newest checkpoint).
        #[arg(long)]
        checkpoint: PathBuf,
        /// Largest safetensors file (`5GB`, `500MiB`).
        #[arg(long, default_value = "5GB")]
        max_shard_size: String,
        /// The weights' format: `f32` (the checkpoint's values exactly) or `bf16` (each rounded to the nearest;
        /// half the size).
        #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
        dtype: String,
        /// A Mixtral's experts: `per-expert` (the Hub's `block_sparse_moe.experts.E.w1/w2/w3`) or `fused`
        /// (transformers 5's `mlp.experts.gate_up_proj`/`down_proj`; an error for a model without experts).
        #[arg(long, default_value = "per-expert", value_parser = ["per-expert", "fused"])]
        experts: String,
    },
    /// List the built-in recipes, or print one.
    Recipes {
        /// Print this recipe's TOML.
        #[arg(long)]
        show: Option<String>,
    },
    /// The trainer beside PyTorch eager (bench/peer_train.py) on the same tiny Llama: tokens/s, MFU, peak RSS; with
    /// `--device cuda:N`, on the GPU beside transformers' LlamaForCausalLM (bench/peer_train_gpu.py): tokens/s, MFU,
    /// peak device memory.
    Bench {
        /// Sequence lengths.
        #[arg(long, value_delimiter = ',', default_value = "4096,16384,65536")]
        seqs: Vec<usize>,
        /// Timed steps per run.
        #[arg(long, default_value_t = 2)]
        steps: u64,
        /// Number formats (the CPU table; the GPU table trains bf16, as the peer's autocast does).
        #[arg(long, value_delimiter = ',', default_value = "f32,bf16")]
        dtypes: Vec<String>,
        /// The Python with torch for the peer column (`none` leaves it out).
        #[arg(long, default_value = "python3")]
        python: String,
        /// Context-parallel ranks of the memory comparison at the longest length (0 skips it; default 4); with
        /// `--device`, our side's CP size (its ranks share the one GPU) at every length `--layout` does not name
        /// (default 1).
        #[arg(long)]
        cp: Option<usize>,
        /// Compare these recompute policies with `none` (our side only): `--recompute selective,full`; with
        /// `--device`, the one policy our side trains with at every length `--layout` does not name.
        #[arg(long, value_delimiter = ',')]
        recompute: Vec<String>,
        /// Compare training with this offload tier (`host` or `disk`) against training without (our side only):
        /// step time, the backward's wait for offloaded tensors, activations kept and peak RSS; with `--device`,
        /// the tier our side trains with at every length `--layout` does not name.
        #[arg(long)]
        offload: Option<String>,
        /// Alternating rounds per row (medians printed).
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// The model family: `llama` (the bench model), `mixtral` or `nemotron` (their tiny recipes).
        #[arg(long, default_value = "llama")]
        family: String,
        /// Bench the GPU: `cuda` or `cuda:N` (a build with `--features cuda`) beside bench/peer_train_gpu.py on the
        /// same GPU; `cuda-emulated` runs our side on the kernels' host emulator and the peer on the CPU (for
        /// testing the bench itself). `cpu` or absent: the CPU tables.
        #[arg(long, value_name = "cpu|cuda[:N]|cuda-emulated")]
        device: Option<String>,
        /// The GPU table's model: `llama3-8b-4l` (the Llama 3 8B shape cut to 4 layers; the default on cuda) or
        /// `tiny` (the CPU table's bench model; the default on cuda-emulated).
        #[arg(long, value_name = "tiny|llama3-8b-4l")]
        model: Option<String>,
        /// The GPU table's MFU peak, in TFLOP/s (default 989, the H200's dense bf16 datasheet figure, on cuda; the
        /// host's measured FMA peak on cuda-emulated).
        #[arg(long, value_name = "F")]
        peak_tflops: Option<f64>,
        /// The GPU table's layout of our side per length, each field defaulting to `--cp`, `--recompute`,
        /// `--offload`: `--layout "65536:cp=2,recompute=full,offload=host;131072:cp=4,recompute=full"`.
        #[arg(long, value_name = "SEQ:cp=N,recompute=P,offload=T;…")]
        layout: Option<String>,
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
            device,
            recompute,
            offload,
            offload_layers,
            offload_budget,
            resume,
            quiet,
            stop_at,
            init_from,
            rope_scaling,
        } => {
            if let Some(cp) = cp {
                set.push(format!("parallel.cp={cp}"));
            }
            if let Some(dp) = dp {
                set.push(format!("parallel.dp={dp}"));
            }
            if let Some(d) = device {
                set.push(format!("parallel.backend=\"{d}\""));
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
            let mut recipe = Recipe::load(&recipe, &set)?;
            let from_recipe = init_from.is_none() && !recipe.train.init_from.is_empty();
            let init_path = init_from.or_else(|| from_recipe.then(|| resolve_init(&recipe.train.init_from)));
            if let Some(p) = init_path.as_deref().filter(|p| !p.exists()) {
                let fetch = if p.to_string_lossy().contains("smollm2") {
                    " (fetch it with: bash trainer-ref/data/fetch-smollm2.sh)"
                } else {
                    ""
                };
                return Err(TrainError::NoPretrained { path: p.to_path_buf(), hint: fetch.into() });
            }
            let init = init_path.as_deref().map(hf::load_any).transpose()?;
            if let Some(ck) = &init {
                let scaling = recipe.model.rope_scaling.clone();
                recipe = hf::recipe_from(&recipe, &set, &ck.config)?;
                if from_recipe && scaling.is_some() {
                    // A recipe written for this checkpoint names the context extension it trains with.
                    recipe.model.rope_scaling = scaling;
                }
                for note in &ck.config.notes {
                    eprintln!("note: {note}");
                }
            }
            if let Some(spec) = &rope_scaling {
                let original = init.as_ref().and_then(|c| c.config.max_position_embeddings);
                recipe.model.rope_scaling = RopeScalingConfig::parse_cli(spec, original)?;
                recipe.validate()?;
            }
            let out = out.unwrap_or_else(|| PathBuf::from("runs").join(&recipe.name));
            let s = train_from(&recipe, &RunOptions { out: out.clone(), resume, quiet, stop_at }, init.as_ref())?;
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
        Command::Eval { checkpoint, init_from, tokens, seq, cp, device, rope_scaling } => {
            let r = match (checkpoint, init_from) {
                (_, Some(dir)) => {
                    let mut ck = hf::load_any(&dir)?;
                    if let Some(spec) = &rope_scaling {
                        let original = ck.config.max_position_embeddings;
                        ck.config.model.rope_scaling = RopeScalingConfig::parse_cli(spec, original)?;
                    }
                    for note in &ck.config.notes {
                        eprintln!("note: {note}");
                    }
                    let tokenizer = ck.tokenizer.as_ref();
                    let is_text = tokens.extension().is_none_or(|e| e != "npy");
                    if is_text && tokenizer.is_none() {
                        return Err(TrainError::TokenFile {
                            path: tokens,
                            detail: format!(
                                "text needs the checkpoint's tokenizer.json, and {} has none (give a .npy of ids)",
                                dir.display()
                            ),
                        });
                    }
                    let ids = eval::read_tokens_with(&tokens, tokenizer)?;
                    eval::evaluate_hf_on(&ck, &ids, seq, cp, device)?
                }
                (Some(dir), None) => {
                    let ck = longctx_trainer::checkpoint::load(&dir)?;
                    // Text as the run read its corpus: its saved tokenizer, else bytes.
                    eval::evaluate_checkpoint_on(&ck, &eval::read_checkpoint_tokens(&ck, &tokens)?, seq, cp, device)?
                }
                (None, None) => {
                    return Err(TrainError::InvalidOption {
                        option: "--checkpoint".into(),
                        detail: "give --checkpoint or --init-from".into(),
                    })
                }
            };
            println!(
                "loss {:.6} nats/token over {} tokens ({} windows of {seq}, cp {cp})",
                r.loss, r.tokens, r.windows
            );
        }
        Command::Export { hf: dir, checkpoint, max_shard_size, dtype, experts } => {
            let max_shard_bytes = longctx_recompute::parse_bytes(&max_shard_size)
                .ok_or_else(|| option("--max-shard-size", format!("`{max_shard_size}` is not a size")))?;
            let dtype = hf::export::WeightDtype::parse(&dtype)
                .ok_or_else(|| option("--dtype", format!("`{dtype}` (f32 or bf16)")))?;
            let experts = hf::export::ExpertLayout::parse(&experts)
                .ok_or_else(|| option("--experts", format!("`{experts}` (per-expert or fused)")))?;
            let opts = hf::export::ExportOptions { max_shard_bytes, dtype, experts };
            for f in hf::export::export_checkpoint(&checkpoint, &dir, &opts)? {
                println!("wrote {}", f.display());
            }
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
        Command::Bench {
            seqs,
            steps,
            dtypes,
            python,
            cp,
            recompute,
            offload,
            rounds,
            family,
            device,
            model,
            peak_tflops,
            layout,
        } => {
            let python = (python != "none").then_some(python);
            let family = match family.as_str() {
                "llama" => Family::Llama,
                "mixtral" => Family::Mixtral,
                "nemotron" => Family::Nemotron,
                other => {
                    return Err(option("--family", format!("`{other}` (llama, mixtral or nemotron)")));
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
                offload,
                rounds,
                family,
                device,
                model,
                peak_tflops,
                layout,
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
    // Before any thread exists, so that one heap serves every thread (large buffers are the allocator's own).
    longctx_trainer::alloc::reuse_freed_memory();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn option(option: &str, detail: String) -> TrainError {
    TrainError::InvalidOption { option: option.into(), detail }
}

/// A recipe's `train.init_from`: as given when it exists from here, else under the trainer crate (where the
/// fetch scripts put pretrained files).
fn resolve_init(path: &str) -> PathBuf {
    let p = PathBuf::from(path);
    if p.is_relative() && !p.exists() {
        let in_crate = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(&p);
        if in_crate.exists() {
            return in_crate;
        }
    }
    p
}
