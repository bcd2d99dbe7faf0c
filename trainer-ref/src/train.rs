//! The training loop over `cp × dp` ranks (threads of one process, or processes over UCX).
//!
//! Rank `r` is context-parallel rank `r mod cp` of data-parallel group `r / cp`. Each step, every group runs
//! `batch / dp` micro-batches of one sequence, each rank holding the sequence's tokens at its partition's
//! positions (RoPE and the loss use those global positions); the weight gradients are summed over all ranks,
//! already scaled by the global batch's token count, so the sum is the gradient of the mean loss; then the
//! gradient is clipped and every rank applies the same AdamW step to its replica of the weights.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};
use std::time::Instant;

use longctx_kernels::{AdamW, AdamwState, Backend, CpuBackend, DType, GradMode, View};
use longctx_p2p::{Communicator, ReduceOp, ThreadWorld};
use longctx_ring_attn::{ContextParallel, CpConfig, CpMask, CpPlan, CpShape};

use crate::checkpoint::{self, LoadedTensor};
use crate::data::{Corpus, Sequence, TextTokenizer, TokenStream};
use crate::error::{Result, TrainError};
use crate::hf::HfCheckpoint;
use crate::metrics::{Meter, Predicted};
use crate::model::{param_shapes, LayerSaved, LossSpec, Model, MoeStats, Params};
use crate::recipe::{Precision, Recipe};

/// How to run a recipe.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Output folder: `metrics.jsonl`, `checkpoints/`, `recipe.toml`.
    pub out: PathBuf,
    /// Continue from the newest checkpoint in `out`.
    pub resume: bool,
    /// No progress bar and no log lines (tests).
    pub quiet: bool,
    /// Stop after this step as if interrupted (a checkpoint is written; `--resume` continues), e.g. to split a
    /// long run into sessions.
    pub stop_at: Option<u64>,
}

/// What a run did, as rank 0 saw it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    /// `(step, mean training loss)` for each step run (1-based steps).
    pub losses: Vec<(u64, f64)>,
    /// `(step, held-out loss)` for each evaluation; a fresh run from pretrained weights starts with `(0, …)`,
    /// their loss before any training.
    pub val_losses: Vec<(u64, f64)>,
    /// The last step finished.
    pub last_step: u64,
    /// Whether a signal stopped the run early.
    pub interrupted: bool,
    /// Bytes of activations each rank saved for its backward over one micro-batch.
    pub saved_bytes_per_rank: usize,
    /// Tokens per second over the steps run (all ranks together).
    pub tokens_per_s: f64,
    /// What the recompute crate's planner predicts each rank keeps (its layers under the policy, and the
    /// final norm's tensors), for comparison with `saved_bytes_per_rank`.
    pub predicted_saved_bytes_per_rank: usize,
    /// The planner's peak: the kept bytes plus one layer's rebuilt tensors and backward working set.
    pub predicted_peak_bytes_per_rank: usize,
    /// The planner's bytes per rank that the recompute policy offloads (`offload` actions; `budget:` chooses
    /// them when the run has an offload tier).
    pub predicted_offloaded_bytes_per_rank: usize,
}

static STOP: AtomicBool = AtomicBool::new(false);
static HANDLER: Once = Once::new();

/// Installs the Ctrl-C / SIGTERM handler once per process: the step in flight finishes, a checkpoint is
/// written, and the run returns.
fn install_signal_handler() {
    HANDLER.call_once(|| {
        let _ = ctrlc::set_handler(|| STOP.store(true, Ordering::SeqCst));
    });
}

/// Runs `recipe`: in this process over `cp × dp` threads, or, when started by `longctx-launch` (the
/// environment names a rank), as one rank of a multi-process job over UCX.
pub fn train(recipe: &Recipe, opts: &RunOptions) -> Result<Summary> {
    train_from(recipe, opts, None)
}

/// [`train`], starting from the weights of a Hugging Face checkpoint (`--init-from DIR`) instead of fresh
/// ones when `init` is given; the recipe's model must have the checkpoint's shapes (see
/// [`crate::hf::recipe_from`]). `--resume` still wins: a resumed run continues from its own checkpoint. The
/// checkpoint's tokenizer, when it has one and an end-of-sequence token, reads the corpus and is saved in every
/// checkpoint of the run (a resumed run without `init` takes it from its own checkpoint).
pub fn train_from(recipe: &Recipe, opts: &RunOptions, init: Option<&HfCheckpoint>) -> Result<Summary> {
    recipe.validate()?;
    recipe.parallel.check_trainable()?;
    if let Some(hf) = init {
        crate::hf::check_model(&recipe.model, &hf.config)?;
    }
    // A pretrained model reads the corpus through its own tokenizer; a fresh one through bytes. A resumed run
    // without `--init-from` reads it as it did before, through the tokenizer its checkpoint saved (if any).
    let saved = match init {
        Some(hf) => hf.saved_tokenizer(),
        None if opts.resume => {
            checkpoint::latest(&opts.out)?.map(|d| checkpoint::load_tokenizer(&d)).transpose()?.flatten()
        }
        None => None,
    };
    let tokenizer = saved.as_ref().map_or(TextTokenizer::Bytes, checkpoint::SavedTokenizer::text_tokenizer);
    if init.is_some() && saved.is_none() {
        eprintln!("note: the checkpoint has no tokenizer (or no eos_token_id): the corpus is read as byte tokens");
    }
    let saved = saved.as_ref();
    let init = init.map(|hf| hf.tensors.as_slice());
    let corpus = Corpus::load(&recipe.data.corpus)?;
    let (train_stream, heldout) = corpus.split_with(recipe.data.heldout_every, &tokenizer)?;
    // A window longer than its split wraps round to the split's start: the model would see text it has just
    // read, and the loss would reward copying it. Refused rather than reported as a loss at that length.
    let seq = recipe.train.seq_len;
    let splits = [
        ("training", &train_stream, true, ""),
        ("held-out", &heldout, recipe.train.eval_every > 0, ", or a smaller data.heldout_every"),
    ];
    for (name, stream, used, or) in splits {
        if used && stream.len() <= seq {
            return Err(TrainError::Config(format!(
                "the corpus's {name} split has {} tokens, fewer than one window of train.seq_len = {seq} plus its \
                 last target (a longer corpus, a shorter window{or})",
                stream.len()
            )));
        }
    }
    let world = recipe.parallel.cp * recipe.parallel.dp;
    std::fs::create_dir_all(&opts.out).map_err(|e| TrainError::io(&opts.out, e))?;
    install_signal_handler();
    STOP.store(false, Ordering::SeqCst);
    let data = Data { train: train_stream, heldout };
    if std::env::var_os("WORLD_SIZE").is_some() {
        let comm = Communicator::from_env()?;
        if comm.world_size() != world {
            return Err(TrainError::Config(format!(
                "the launcher started {} ranks; the recipe needs parallel.cp × parallel.dp = {world}",
                comm.world_size()
            )));
        }
        // One rank per process: `parallel.threads` kernel threads, or (0) rayon's global pool.
        return Rank::run(comm, recipe, opts, &data, recipe.parallel.threads, init, saved);
    }
    let threads = per_rank_threads(recipe.parallel.threads, world);
    let results = ThreadWorld::try_run(world, |comm| Rank::run(comm, recipe, opts, &data, threads, init, saved))?;
    let mut first = None;
    for r in results {
        match r {
            Ok(s) if first.is_none() => first = Some(s),
            Ok(_) => {}
            Err(e) => return Err(e),
        }
    }
    first.ok_or_else(|| TrainError::Config("no ranks ran".into()))
}

/// The mean loss of one global batch and its gradient (summed over every rank, before clipping), as rank 0
/// holds them, for `recipe`'s layout: `sequences[i]` is micro-batch `i / dp` of data-parallel group `i % dp`
/// (`train.batch` of them). Every layout of the same batch gives the same loss and gradient: this is what the
/// context-parallel tests compare.
pub fn loss_and_gradients(recipe: &Recipe, sequences: &[Sequence]) -> Result<(f64, Vec<Vec<f32>>)> {
    loss_gradients_and_saved(recipe, sequences).map(|(l, g, _)| (l, g))
}

/// [`loss_and_gradients`], and the bytes of activations rank 0 kept for its backward (after the recompute
/// policy) over its largest micro-batch.
pub fn loss_gradients_and_saved(recipe: &Recipe, sequences: &[Sequence]) -> Result<(f64, Vec<Vec<f32>>, usize)> {
    recipe.validate()?;
    let (cp, dp) = (recipe.parallel.cp, recipe.parallel.dp);
    if sequences.len() != recipe.train.batch {
        return Err(TrainError::Config(format!(
            "{} sequences for train.batch = {}",
            sequences.len(),
            recipe.train.batch
        )));
    }
    let threads = per_rank_threads(recipe.parallel.threads, cp * dp);
    let out = ThreadWorld::try_run(cp * dp, |comm| -> Result<(f64, Vec<Vec<f32>>, usize)> {
        let spill = std::env::temp_dir().join(format!("longctx-offload-{}", std::process::id()));
        let mut rank = Rank::new(comm, recipe, threads, &spill, None)?;
        let (loss, saved, aux) = rank.gradients(|micro, group| sequences[micro * dp + group].clone())?;
        let mut l = [loss];
        rank.world.all_reduce(&mut l, ReduceOp::Sum)?;
        l[0] += aux * (recipe.train.batch * recipe.train.seq_len) as f64;
        let grads = rank
            .grads
            .tensors
            .iter()
            .map(|g| g.view().as_typed::<f32>("grad").map(<[f32]>::to_vec))
            .collect::<std::result::Result<_, _>>()?;
        Ok((l[0] / (recipe.train.batch * recipe.train.seq_len) as f64, grads, saved))
    })?;
    out.into_iter().next().ok_or_else(|| TrainError::Config("no ranks ran".into()))?
}

/// A 64-bit FNV-1a hash: enough to tell host names apart.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

fn per_rank_threads(asked: usize, world: usize) -> usize {
    if asked > 0 {
        return asked;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / world).max(1)
}

/// The two token streams.
#[derive(Debug)]
pub struct Data {
    /// Training documents.
    pub train: TokenStream,
    /// Held-out documents.
    pub heldout: TokenStream,
}

/// One rank's state: its communicators, model, gradients and optimizer.
struct Rank<'a> {
    recipe: &'a Recipe,
    world: Arc<Communicator>,
    dp_index: usize,
    model: Model,
    /// `f32` master weights for a `bf16` model (the model's own weights when it is `f32`).
    master: Option<Params>,
    grads: Params,
    m: Params,
    v: Params,
    plan: CpPlan,
    step: u64,
    /// The planner's kept and peak activation bytes and rerun FLOPs for this rank.
    predicted: Predicted,
    /// The tokenizer the corpus was read with, saved in every checkpoint (none for byte tokens).
    tokenizer: Option<&'a checkpoint::SavedTokenizer>,
    /// The weights came from a pretrained checkpoint: a fresh run measures their held-out loss before its
    /// first step, the baseline a continued training (a context extension) is judged against.
    pretrained: bool,
}

impl<'a> Rank<'a> {
    fn run(
        comm: Communicator,
        recipe: &'a Recipe,
        opts: &RunOptions,
        data: &Data,
        threads: usize,
        init: Option<&[LoadedTensor]>,
        tokenizer: Option<&'a checkpoint::SavedTokenizer>,
    ) -> Result<Summary> {
        let mut rank = Rank::new(comm, recipe, threads, &opts.out.join("offload"), init)?;
        rank.tokenizer = tokenizer;
        rank.pretrained = init.is_some();
        if opts.resume {
            rank.resume(&opts.out)?;
        }
        rank.train(opts, data)
    }

    /// A rank with fresh weights, or `init`'s (in [`param_shapes`] order, f32).
    fn new(
        comm: Communicator,
        recipe: &'a Recipe,
        threads: usize,
        spill_root: &Path,
        init: Option<&[LoadedTensor]>,
    ) -> Result<Self> {
        let cfg = &recipe.model;
        let cp = recipe.parallel.cp;
        let world = Arc::new(comm);
        let (dp_index, cp_index) = (world.rank() / cp, world.rank() % cp);
        let cp_comm = world.split(dp_index as u32, cp_index as u32)?;
        let backend: Arc<dyn Backend> =
            Arc::new(if threads > 0 { CpuBackend::with_threads(threads)? } else { CpuBackend::new() });
        let dtype = match recipe.train.precision {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::Bf16,
        };
        let init = match init {
            None => Params::init(&*backend, cfg, recipe.train.seed)?,
            Some(tensors) => {
                let mut p = Params::zeros(&*backend, cfg, DType::F32)?;
                for (dst, src) in p.tensors.iter_mut().zip(tensors) {
                    backend.copy(dst.view_mut(), View::new(&src.data, src.dims.as_slice())?)?;
                }
                p
            }
        };
        let (weights, master) = if dtype == DType::F32 {
            (init, None)
        } else {
            let mut w = Params::zeros(&*backend, cfg, dtype)?;
            for (dst, src) in w.tensors.iter_mut().zip(&init.tensors) {
                backend.copy(dst.view_mut(), src.view())?;
            }
            (w, Some(init))
        };
        let grads = Params::zeros(&*backend, cfg, DType::F32)?;
        let m = Params::zeros(&*backend, cfg, DType::F32)?;
        let v = Params::zeros(&*backend, cfg, DType::F32)?;
        let cpc = CpConfig { partition: recipe.partition()?, schedule: recipe.schedule()?, scale: None };
        let cp = ContextParallel::new(cp_comm, backend.clone(), cpc)?;
        let plan = plan_for(&cp, recipe, recipe.train.seq_len, dtype)?;
        let mut model = Model::new(cfg.clone(), weights, backend)?;
        model.set_sequence_length(recipe.train.seq_len)?;
        let policy = recipe.recompute_policy()?;
        let costs = {
            // `budget:` probes the tier's rate on an engine of its own, gone (its spill files with it) before the
            // run's is built.
            let probe = match policy {
                longctx_recompute::Policy::Budget(_) => offload_engine(recipe, world.rank(), spill_root, true)?,
                _ => None,
            };
            costs(&world, &policy, probe.as_deref())?
        };
        let actions = policy
            .resolve(&recipe.layer_spec(), cfg.layers, &costs)
            .map_err(|e| TrainError::Config(format!("train.recompute: {e}")))?;
        // A policy that names what to offload is followed layer by layer (the planner counts every layer's
        // offloaded bytes out); without one, everything kept goes out but the last layers' (`offload_layers`).
        let chosen = actions.iter().any(|a| a.actions.values().any(|&v| v == longctx_recompute::Action::Offload));
        let offload = offload_engine(recipe, world.rank(), spill_root, !chosen)?;
        let cost = longctx_recompute::plan_cost(&recipe.layer_spec(), &actions, &costs);
        let elem = if dtype == DType::Bf16 { 2 } else { 4 };
        let local = recipe.train.seq_len / recipe.parallel.cp;
        let final_norm = local * cfg.d_model * elem * 2 + local * 4;
        let predicted = Predicted {
            saved_bytes: cost.resident_bytes as usize + final_norm,
            peak_bytes: cost.peak_bytes as usize + final_norm,
            layers_peak_bytes: cost.peak_bytes as usize,
            // Per micro-batch in the cost; a rank runs `batch / dp` of them per step.
            recompute_flops: cost.recompute_flops * (recipe.train.batch / recipe.parallel.dp) as f64,
            offloaded_bytes: cost.offloaded_bytes as usize,
        };
        model.set_recompute(actions)?;
        model.set_offload(offload);
        Ok(Rank {
            recipe,
            world,
            dp_index,
            model,
            master,
            grads,
            m,
            v,
            plan,
            step: 0,
            predicted,
            tokenizer: None,
            pretrained: false,
        })
    }

    fn is_root(&self) -> bool {
        self.world.rank() == 0
    }

    /// The machines the ranks run on (distinct host names). Every rank calls it.
    fn hosts(&self) -> Result<usize> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let mut hosts = vec![0u64; self.world.world_size()];
        self.world.all_gather(&[fnv1a(host.trim().as_bytes())], &mut hosts)?;
        hosts.sort_unstable();
        hosts.dedup();
        Ok(hosts.len())
    }

    /// The run's arithmetic peak, the denominator of MFU: rank 0 times one machine's every core while all ranks
    /// wait at a barrier (so none of them competes for the cores), times the `hosts` machines the ranks run on
    /// (alike, as a cluster's nodes are). Every rank calls it; rank 0's answer is the one that counts.
    fn run_peak_flops(&self, hosts: usize) -> Result<f64> {
        let peak = if self.is_root() { crate::metrics::measure_machine_peak_flops()? } else { 0.0 };
        self.world.barrier()?;
        Ok(peak * hosts as f64)
    }

    /// This rank's share of a sequence: its tokens, targets and document ids at the plan's positions.
    fn local(&self, seq: &Sequence) -> (Vec<u32>, Vec<i64>, Vec<u32>) {
        local_share(self.plan.positions(), seq)
    }

    fn train(mut self, opts: &RunOptions, data: &Data) -> Result<Summary> {
        let t = &self.recipe.train;
        let (dp, s) = (self.recipe.parallel.dp, t.seq_len);
        let denominator = (t.batch * s) as f64;
        let hosts = self.hosts()?;
        let peak = self.run_peak_flops(hosts)?;
        let mut meter = if self.is_root() {
            Some(Meter::open(&opts.out, self.recipe, self.step, opts.quiet, self.model.weights.numel(), peak)?)
        } else {
            None
        };
        let mut summary = Summary::default();
        let started = Instant::now();
        let first_step = self.step;
        if self.pretrained && first_step == 0 && t.eval_every > 0 {
            let v = self.heldout_loss(&data.heldout)?;
            summary.val_losses.push((0, v));
            if let Some(m) = meter.as_mut() {
                m.baseline(v)?;
            }
        }
        while self.step < t.steps {
            let step_start = Instant::now();
            let fetch_wait_before = self.model.offload_engine().map(|e| e.stats().fetch_wait);
            let lr = lr_at(self.recipe, self.step);
            let step = self.step;
            let (loss_sum, saved_bytes, aux) = self.gradients(|micro, group| {
                data.train.sequence(step * t.batch as u64 + (micro * dp + group) as u64, s)
            })?;
            if summary.saved_bytes_per_rank == 0 {
                if let Some(m) = meter.as_ref() {
                    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
                    m.note(&format!(
                        "activations kept per rank: {:.1} MiB measured, {:.1} MiB predicted by the planner (recompute {}; peak with one layer rebuilt {:.1} MiB{})",
                        mib(saved_bytes),
                        mib(self.predicted.saved_bytes),
                        self.recipe.train.recompute,
                        mib(self.predicted.peak_bytes),
                        if self.predicted.offloaded_bytes > 0 {
                            format!("; {:.1} MiB offloaded", mib(self.predicted.offloaded_bytes))
                        } else {
                            String::new()
                        }
                    ));
                }
            }
            summary.saved_bytes_per_rank = saved_bytes;
            summary.predicted_saved_bytes_per_rank = self.predicted.saved_bytes;
            summary.predicted_peak_bytes_per_rank = self.predicted.peak_bytes;
            summary.predicted_offloaded_bytes_per_rank = self.predicted.offloaded_bytes;
            let stop = STOP.load(Ordering::SeqCst) || opts.stop_at.is_some_and(|s| step + 1 >= s);
            let mut reduced = [loss_sum, if stop { 1.0 } else { 0.0 }];
            self.world.all_reduce(&mut reduced, ReduceOp::Sum)?;
            let grad_norm = self.clip()?;
            self.adamw(lr)?;
            self.step += 1;
            let loss = reduced[0] / denominator + aux;
            let took = step_start.elapsed();
            // What offload cost this step: the backward's waits for tensors not yet back.
            let offload_wait = fetch_wait_before
                .zip(self.model.offload_engine().map(|e| e.stats().fetch_wait))
                .map(|(before, after)| after.saturating_sub(before));
            summary.losses.push((self.step, loss));
            let last = self.step == t.steps || reduced[1] > 0.0;
            let mut val = None;
            if t.eval_every > 0 && (self.step.is_multiple_of(t.eval_every) || last) {
                let v = self.heldout_loss(&data.heldout)?;
                summary.val_losses.push((self.step, v));
                val = Some(v);
                let peak = self.run_peak_flops(hosts)?;
                if let Some(m) = meter.as_mut() {
                    m.raise_peak(peak);
                }
            }
            if let Some(m) = meter.as_mut() {
                let tokens = (t.batch * s) as f64;
                m.step(
                    self.step,
                    loss,
                    val,
                    lr,
                    grad_norm,
                    tokens,
                    took,
                    summary.saved_bytes_per_rank,
                    self.predicted,
                    offload_wait,
                )?;
            }
            let ckpt_due = (t.checkpoint_every > 0 && self.step.is_multiple_of(t.checkpoint_every)) || last;
            if ckpt_due {
                self.save(&opts.out, meter.as_mut())?;
            }
            if reduced[1] > 0.0 {
                summary.interrupted = true;
                break;
            }
        }
        if let Some(m) = meter.as_mut() {
            if let Some(e) = self.model.offload_engine() {
                m.note(&format!("offload (rank 0): {}", e.stats()));
            }
            m.finish(&opts.out);
        }
        let steps = (self.step - first_step) as f64;
        summary.tokens_per_s = steps * (t.batch * s) as f64 / started.elapsed().as_secs_f64().max(1e-9);
        summary.last_step = self.step;
        Ok(summary)
    }

    /// This rank's micro-batches (`sequence(micro, dp_group)` gives each), their gradients summed over every
    /// rank into `self.grads`; returns this rank's cross-entropy sum (scaled by the global token count, so the
    /// sum over ranks is the mean loss), the bytes its forward saved over one micro-batch, and the
    /// load-balancing loss (Mixtral, already weighted by its coefficient; the same on every rank; 0 otherwise).
    fn gradients(&mut self, sequence: impl Fn(usize, usize) -> Sequence) -> Result<(f64, usize, f64)> {
        if self.recipe.model.experts().is_some() {
            return self.gradients_moe(sequence);
        }
        let t = &self.recipe.train;
        let accum = t.batch / self.recipe.parallel.dp;
        let denominator = (t.batch * t.seq_len) as f64;
        let (mut loss_sum, mut saved_bytes) = (0.0f64, 0);
        for micro in 0..accum {
            let (ids, targets, docs) = self.local(&sequence(micro, self.dp_index));
            if self.recipe.data.document_masking {
                self.plan.set_documents(&docs)?;
            }
            let saved = self.model.forward(&ids, &mut self.plan)?;
            saved_bytes = saved_bytes.max(saved.bytes());
            let mode = if micro == 0 { GradMode::Overwrite } else { GradMode::Accumulate };
            let spec = LossSpec { targets: &targets, denominator, chunk: t.loss_chunk, moe_aux: None };
            let loss = self.model.loss_and_backward(saved, &spec, &mut self.grads, mode, &mut self.plan)?;
            loss_sum += loss.sum;
        }
        self.all_reduce_grads()?;
        Ok((loss_sum, saved_bytes, 0.0))
    }

    /// [`Rank::gradients`] for a mixture of experts: the load-balancing loss is over the global batch (Hugging
    /// Face's, over every layer and token), and its gradient needs the global routing statistics, so every
    /// micro-batch's forward runs first, the statistics are summed over all ranks, then the backwards run. A rank
    /// holds its micro-batches' activations together (one micro-batch with `train.batch = parallel.dp`).
    fn gradients_moe(&mut self, sequence: impl Fn(usize, usize) -> Sequence) -> Result<(f64, usize, f64)> {
        let t = &self.recipe.train;
        let coef = self.recipe.model.experts().map_or(0.0, |m| m.aux_loss_coef);
        let accum = t.batch / self.recipe.parallel.dp;
        let denominator = (t.batch * t.seq_len) as f64;
        let (mut forwards, mut saved_bytes, mut stats) = (Vec::with_capacity(accum), 0, None::<MoeStats>);
        for micro in 0..accum {
            let (ids, targets, docs) = self.local(&sequence(micro, self.dp_index));
            if self.recipe.data.document_masking {
                self.plan.set_documents(&docs)?;
            }
            let saved = self.model.forward(&ids, &mut self.plan)?;
            saved_bytes = saved_bytes.max(saved.bytes());
            if let Some(s) = &saved.moe {
                stats.get_or_insert_with(|| MoeStats::zeros(s.experts())).merge(s);
            }
            forwards.push((saved, targets, docs));
        }
        let stats = stats.ok_or_else(|| TrainError::Config("a mixture of experts without router statistics".into()))?;
        let mut flat = stats.to_flat();
        self.world.all_reduce(&mut flat, ReduceOp::Sum)?;
        let global = MoeStats::from_flat(&flat);
        let aux_grad = global.prob_grad(coef);
        let mut loss_sum = 0.0f64;
        for (micro, (saved, targets, docs)) in forwards.into_iter().enumerate() {
            if self.recipe.data.document_masking {
                self.plan.set_documents(&docs)?;
            }
            let mode = if micro == 0 { GradMode::Overwrite } else { GradMode::Accumulate };
            let spec = LossSpec { targets: &targets, denominator, chunk: t.loss_chunk, moe_aux: Some(&aux_grad) };
            let loss = self.model.loss_and_backward(saved, &spec, &mut self.grads, mode, &mut self.plan)?;
            loss_sum += loss.sum;
        }
        self.all_reduce_grads()?;
        Ok((loss_sum, saved_bytes, coef * global.aux_loss()))
    }

    fn all_reduce_grads(&mut self) -> Result<()> {
        for g in self.grads.tensors.iter_mut() {
            self.world.all_reduce(g.view_mut().into_typed::<f32>("grad")?, ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// Clips the summed gradient to `train.clip` (PyTorch's `clip_grad_norm_`); returns the norm before.
    fn clip(&mut self) -> Result<f64> {
        let b = self.model.backend().clone();
        let norm = b.sum_squares(&self.grads.views())?.sqrt();
        let max = self.recipe.train.clip as f64;
        if !norm.is_finite() {
            return Err(TrainError::Config(format!(
                "step {}: the gradient norm is {norm} (the loss diverged; lower train.lr)",
                self.step + 1
            )));
        }
        if max > 0.0 && norm > max {
            let k = (max / (norm + 1e-6)) as f32;
            for g in self.grads.tensors.iter_mut() {
                b.scale(g.view_mut(), k)?;
            }
        }
        Ok(norm)
    }

    /// One AdamW step on every tensor; matrices and embeddings decay, norm weights do not.
    fn adamw(&mut self, lr: f32) -> Result<()> {
        let t = &self.recipe.train;
        let b = self.model.backend().clone();
        let step = self.step + 1;
        for i in 0..self.grads.tensors.len() {
            let decay = if self.grads.tensors[i].dims().len() > 1 { t.weight_decay } else { 0.0 };
            let hp = AdamW { lr, beta1: t.beta1, beta2: t.beta2, eps: t.eps, weight_decay: decay };
            let state = AdamwState { m: self.m.tensors[i].view_mut(), v: self.v.tensors[i].view_mut() };
            let g = self.grads.tensors[i].view();
            match self.master.as_mut() {
                None => b.adamw_step(self.model.weights.tensors[i].view_mut(), None, g, state, &hp, step)?,
                Some(master) => b.adamw_step(
                    master.tensors[i].view_mut(),
                    Some(self.model.weights.tensors[i].view_mut()),
                    g,
                    state,
                    &hp,
                    step,
                )?,
            }
        }
        Ok(())
    }

    /// The mean loss over the first `eval_seqs` held-out sequences, shared out over the data-parallel groups.
    fn heldout_loss(&mut self, heldout: &TokenStream) -> Result<f64> {
        let t = &self.recipe.train;
        let dp = self.recipe.parallel.dp;
        let mut sums = [0.0f64, 0.0];
        for i in (self.dp_index..t.eval_seqs).step_by(dp) {
            let (ids, targets, docs) = self.local(&heldout.sequence(i as u64, t.seq_len));
            if self.recipe.data.document_masking {
                self.plan.set_documents(&docs)?;
            }
            let l = self.model.loss(&ids, &targets, t.loss_chunk, &mut self.plan)?;
            sums[0] += l.sum;
            sums[1] += l.tokens as f64;
        }
        self.world.all_reduce(&mut sums, ReduceOp::Sum)?;
        Ok(sums[0] / sums[1].max(1.0))
    }

    fn master(&self) -> &Params {
        self.master.as_ref().unwrap_or(&self.model.weights)
    }

    /// Rank 0 writes the checkpoint; the others wait for it, so no rank runs ahead of a failed save.
    fn save(&self, out: &Path, meter: Option<&mut Meter>) -> Result<()> {
        let mut failed = [0i32];
        let mut failure = None;
        if self.is_root() {
            if let Err(e) = self.write_checkpoint(out) {
                failed[0] = 1;
                failure = Some(e);
            } else if let Some(m) = meter {
                m.note(&format!("checkpoint step {} written to {}", self.step, out.join("checkpoints").display()));
            }
        }
        self.world.all_reduce(&mut failed, ReduceOp::Max)?;
        match failure {
            Some(e) => Err(e),
            None if failed[0] != 0 => Err(TrainError::Config("rank 0 failed to write the checkpoint".into())),
            None => Ok(()),
        }
    }

    fn write_checkpoint(&self, out: &Path) -> Result<()> {
        let master = self.master();
        let model = tensors(master, "")?;
        let mut optim = tensors(&self.m, "exp_avg.")?;
        optim.extend(tensors(&self.v, "exp_avg_sq.")?);
        let state = serde_json::json!({
            "step": self.step,
            "sequences_consumed": self.step * self.recipe.train.batch as u64,
            "seed": self.recipe.train.seed,
            "recipe": self.recipe.to_toml(),
        });
        let keep = self.recipe.train.keep_checkpoints;
        checkpoint::save_with_tokenizer(out, self.step, &model, &optim, &state, keep, self.tokenizer)?;
        Ok(())
    }

    /// Loads the newest checkpoint in `out`: the recipe's model must be the checkpoint's, tensor for tensor.
    fn resume(&mut self, out: &Path) -> Result<()> {
        let Some(dir) = checkpoint::latest(out)? else {
            return Err(TrainError::Config(format!(
                "--resume: no checkpoint in {}",
                out.join("checkpoints").display()
            )));
        };
        let ck = checkpoint::load(&dir)?;
        let state_file = dir.join("state.json");
        if let Some(text) = ck.state.get("recipe").and_then(|r| r.as_str()) {
            let saved = Recipe::parse("checkpoint", text, &[]).map_err(|e| TrainError::Checkpoint {
                path: state_file.clone(),
                detail: format!("field `recipe`: {e}"),
            })?;
            if saved.model != self.recipe.model {
                return Err(TrainError::Checkpoint {
                    path: state_file,
                    detail: format!(
                        "field `recipe.model` is {:?}, the run's recipe has {:?}",
                        saved.model, self.recipe.model
                    ),
                });
            }
        }
        let shapes = param_shapes(&self.recipe.model);
        checkpoint::expect_tensors(&dir.join("model.safetensors"), &ck.model, &shapes)?;
        let mut want_optim: Vec<(String, Vec<usize>)> =
            shapes.iter().map(|(n, d)| (format!("exp_avg.{n}"), d.clone())).collect();
        want_optim.extend(shapes.iter().map(|(n, d)| (format!("exp_avg_sq.{n}"), d.clone())));
        checkpoint::expect_tensors(&dir.join("optim.safetensors"), &ck.optim, &want_optim)?;
        let b = self.model.backend().clone();
        let n = shapes.len();
        for i in 0..n {
            let w = View::new(&ck.model[i].data, ck.model[i].dims.as_slice())?;
            if let Some(master) = self.master.as_mut() {
                b.copy(master.tensors[i].view_mut(), w)?;
            }
            b.copy(self.model.weights.tensors[i].view_mut(), w)?;
            b.copy(self.m.tensors[i].view_mut(), View::new(&ck.optim[i].data, ck.optim[i].dims.as_slice())?)?;
            b.copy(self.v.tensors[i].view_mut(), View::new(&ck.optim[n + i].data, ck.optim[n + i].dims.as_slice())?)?;
        }
        self.step = ck.step;
        Ok(())
    }
}

/// The tensors of `p` for a checkpoint, each name prefixed.
fn tensors<'p>(p: &'p Params, prefix: &str) -> Result<Vec<checkpoint::Tensor<'p>>> {
    p.names
        .iter()
        .zip(&p.tensors)
        .map(|(name, t)| {
            Ok(checkpoint::Tensor {
                name: format!("{prefix}{name}"),
                dims: t.dims().to_vec(),
                data: t.view().as_typed::<f32>("checkpoint tensor")?,
            })
        })
        .collect()
}

/// Bytes free on the filesystem holding `dir` (its nearest existing ancestor).
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let existing = dir.ancestors().find(|d| d.exists())?;
    let c = std::ffi::CString::new(existing.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid C string and `st` a writable statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// Half of `MemAvailable` (bytes), or 1 GiB where `/proc/meminfo` is absent.
fn host_budget() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(1 << 30, |kb| kb * 1024 / 2)
}

/// The rates the recompute solver prices its choices at. Only `budget:` weighs them, and only against each
/// other once the run has an offload tier: then rank 0 measures both on this machine (a GEMM on every core, and
/// a 16 MiB round trip through the run's own tier, checksums and all) and every rank takes its figures, so all
/// ranks resolve the same plan (ring attention needs them to agree on what each layer reruns). Otherwise the
/// added time is FLOPs over a nominal rate, which only scales it.
fn costs(
    world: &Communicator,
    policy: &longctx_recompute::Policy,
    engine: Option<&longctx_offload::OffloadEngine>,
) -> Result<longctx_recompute::Costs> {
    let nominal = longctx_recompute::Costs { flops_per_s: 1e11, offload_bytes_per_s: 0.0 };
    let Some(engine) = engine.filter(|_| matches!(policy, longctx_recompute::Policy::Budget(_))) else {
        return Ok(nominal);
    };
    // Every rank of a run has a tier or none (one recipe), so either all reach this all-reduce or none does.
    let mut rates = [0.0f64; 2];
    if world.rank() == 0 {
        rates = [crate::metrics::measure_gemm_flops()?, tier_bytes_per_s(engine)?];
    }
    world.all_reduce(&mut rates, ReduceOp::Sum)?;
    Ok(longctx_recompute::Costs { flops_per_s: rates[0], offload_bytes_per_s: rates[1] })
}

/// Bytes per second each way through `engine`: a 16 MiB tensor offloaded and fetched back, timed.
fn tier_bytes_per_s(engine: &longctx_offload::OffloadEngine) -> Result<f64> {
    let n = 4 << 20;
    let probe = longctx_offload::HostTensor::f32(vec![1.0f32; n], vec![n])
        .map_err(|e| TrainError::Config(format!("offload probe: {e}")))?;
    let started = Instant::now();
    let ticket =
        engine.offload(0, "rate-probe", probe).map_err(|e| TrainError::Config(format!("offload probe: {e}")))?;
    engine.fetch(ticket).map_err(|e| TrainError::Config(format!("offload probe: {e}")))?;
    Ok(2.0 * (4 * n) as f64 / started.elapsed().as_secs_f64().max(1e-9))
}

/// The rank's offload engine for `train.offload` (`None` for `none`), spilling under `spill_root`. `keep_last`:
/// the layers past `train.offload_layers` stay resident; otherwise every layer's handed tensors go out.
fn offload_engine(
    recipe: &Recipe,
    rank: usize,
    spill_root: &Path,
    keep_last: bool,
) -> Result<Option<Arc<longctx_offload::OffloadEngine>>> {
    let t = &recipe.train;
    let layers = recipe.model.layers;
    let root = if t.offload_dir.is_empty() { spill_root.to_path_buf() } else { PathBuf::from(&t.offload_dir) };
    let dir = root.join(format!("rank{rank}"));
    let budget = match (t.offload_budget.as_str(), t.offload.as_str()) {
        ("auto", "disk") => free_bytes(&dir).map_or(1 << 30, |f| f / 10 * 9),
        ("auto", _) => host_budget(),
        (b, _) => longctx_recompute::parse_bytes(b)
            .ok_or_else(|| TrainError::Config(format!("train.offload_budget `{b}`")))?,
    };
    let offloaded = match (keep_last, t.offload_layers) {
        (false, _) => layers,
        (true, 0) => layers.saturating_sub(1),
        (true, n) => n,
    };
    let b = longctx_offload::OffloadEngine::builder()
        .workers(1)
        .prefetch_depth(1)
        .resident_layers(layers - offloaded, layers);
    let b = match t.offload.as_str() {
        "none" => return Ok(None),
        "host" => b.host_tier(budget),
        _ => {
            std::fs::create_dir_all(&root).map_err(|e| TrainError::io(&root, e))?;
            b.disk_tier(dir, budget)
        }
    };
    let engine = b.build().map_err(|e| TrainError::Config(format!("train.offload: {e}")))?;
    Ok(Some(Arc::new(engine)))
}

/// A plan for sequences of `seq_len` with the recipe's mask.
pub fn plan_for(cp: &ContextParallel, recipe: &Recipe, seq_len: usize, dtype: DType) -> Result<CpPlan> {
    let m = &recipe.model;
    let shape = CpShape { batch: 1, q_heads: m.heads, kv_heads: m.kv_heads, seq_len, head_dim: m.head_dim(), dtype };
    let mut mask = CpMask::causal();
    if recipe.data.document_masking {
        mask = mask.with_documents();
    }
    Ok(cp.plan(&shape, &mask)?)
}

/// The tokens, targets and document ids of `seq` at `positions`.
pub fn local_share(positions: &[i64], seq: &Sequence) -> (Vec<u32>, Vec<i64>, Vec<u32>) {
    let ids = positions.iter().map(|&p| seq.inputs[p as usize]).collect();
    let targets = positions.iter().map(|&p| seq.targets[p as usize]).collect();
    let docs = positions.iter().map(|&p| seq.docs[p as usize]).collect();
    (ids, targets, docs)
}

/// Linear warm-up to `train.lr` over `train.warmup` steps, then cosine decay to `train.min_lr` at the last step.
pub fn lr_at(recipe: &Recipe, step: u64) -> f32 {
    let t = &recipe.train;
    if step < t.warmup {
        return t.lr * (step + 1) as f32 / t.warmup as f32;
    }
    let span = t.steps.saturating_sub(t.warmup).max(1) as f64;
    let progress = ((step - t.warmup) as f64 / span).min(1.0);
    let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    (t.min_lr as f64 + (t.lr - t.min_lr) as f64 * cos) as f32
}

/// Bytes of activations one layer saves per rank for a micro-batch of the recipe.
pub fn layer_saved_bytes(recipe: &Recipe) -> usize {
    let l = recipe.train.seq_len / recipe.parallel.cp;
    let dtype = if recipe.train.precision == Precision::Bf16 { DType::Bf16 } else { DType::F32 };
    LayerSaved::bytes_for(&recipe.model, l, dtype)
}
