//! The run: the ranks launched (threads of this process, or this process as one rank of a UCX job), each
//! set up, resumed if asked, then the loop: steps, evaluations, metrics and checkpoints on schedule, until the
//! last step or a signal.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;
use std::time::Instant;

use longctx_p2p::{Communicator, ReduceOp, ThreadWorld};

use super::ckpt::download_f32;
use super::optim::lr_at;
use super::rank::Rank;
use crate::checkpoint::{self, LoadedTensor, SavedTokenizer};
use crate::data::{Corpus, Sequence, TextTokenizer, TokenStream};
use crate::device::{Device, RankBackends};
use crate::error::{Result, TrainError};
use crate::hf::HfCheckpoint;
use crate::metrics::Meter;
use crate::recipe::Recipe;

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
    crate::device::check_compiled(recipe.device()?)?;
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
    tokenizer.check_vocab(recipe.model.vocab)?;
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
            return Err(TrainError::InvalidField {
                field: "train.seq_len".into(),
                detail: format!(
                    "the corpus's {name} split has {} tokens, fewer than one window of train.seq_len = {seq} plus \
                     its last target (a longer corpus, a shorter window{or})",
                    stream.len()
                ),
            });
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
            return Err(TrainError::WorldSize { launched: comm.world_size(), needed: world });
        }
        // One rank per process: `parallel.threads` kernel threads, or (0) rayon's global pool.
        let backends = RankBackends::new(recipe.device()?, recipe.parallel.threads)?;
        return run_rank(comm, recipe, opts, &data, &backends, init, saved);
    }
    let backends = RankBackends::new(recipe.device()?, per_rank_threads(recipe.parallel.threads, world))?;
    let backends = &backends;
    let results = ThreadWorld::try_run(world, |comm| run_rank(comm, recipe, opts, &data, backends, init, saved))?;
    let mut first = None;
    for r in results {
        match r {
            Ok(s) if first.is_none() => first = Some(s),
            Ok(_) => {}
            Err(e) => return Err(e),
        }
    }
    first.ok_or_else(|| TrainError::Internal("no ranks ran".into()))
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
        return Err(TrainError::InvalidArgument {
            name: "sequences".into(),
            detail: format!("{} sequences for train.batch = {}", sequences.len(), recipe.train.batch),
        });
    }
    let backends = RankBackends::new(recipe.device()?, per_rank_threads(recipe.parallel.threads, cp * dp))?;
    let backends = &backends;
    let out = ThreadWorld::try_run(cp * dp, |comm| -> Result<(f64, Vec<Vec<f32>>, usize)> {
        let spill = std::env::temp_dir().join(format!("longctx-offload-{}", std::process::id()));
        let mut rank = Rank::new(comm, recipe, backends, &spill, None)?;
        let g = rank.gradients(|micro, group| sequences[micro * dp + group].clone())?;
        let mut l = [g.loss_sum];
        rank.world.all_reduce(&mut l, ReduceOp::Sum)?;
        l[0] += g.aux_loss * (recipe.train.batch * recipe.train.seq_len) as f64;
        let b = rank.model.backend().clone();
        let grads = rank.grads.tensors.iter().map(|t| download_f32(&*b, t)).collect::<Result<_>>()?;
        Ok((l[0] / (recipe.train.batch * recipe.train.seq_len) as f64, grads, g.saved_bytes))
    })?;
    out.into_iter().next().ok_or_else(|| TrainError::Internal("no ranks ran".into()))?
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

/// One rank of a run: set up, resumed if asked, then the loop.
fn run_rank(
    comm: Communicator,
    recipe: &Recipe,
    opts: &RunOptions,
    data: &Data,
    backends: &RankBackends,
    init: Option<&[LoadedTensor]>,
    tokenizer: Option<&SavedTokenizer>,
) -> Result<Summary> {
    let mut rank = Rank::new(comm, recipe, backends, &opts.out.join("offload"), init)?;
    rank.tokenizer = tokenizer;
    rank.pretrained = init.is_some();
    if opts.resume {
        rank.resume(&opts.out)?;
    }
    rank.train(opts, data)
}

impl Rank<'_> {
    /// The devices the ranks compute on: distinct machines for the CPU, distinct GPUs (machine and ordinal)
    /// for CUDA. Every rank calls it.
    fn devices(&self) -> Result<usize> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let key = match self.device {
            Device::Cpu => host.trim().to_string(),
            Device::Cuda(n) => format!("{}/cuda:{n}", host.trim()),
            // The emulator runs on the host's cores, which every rank on it shares.
            Device::CudaEmulated => format!("{}/cuda-emulated", host.trim()),
        };
        let mut keys = vec![0u64; self.world.world_size()];
        self.world.all_gather(&[fnv1a(key.as_bytes())], &mut keys)?;
        keys.sort_unstable();
        keys.dedup();
        Ok(keys.len())
    }

    /// How device memory moves between the ranks of a run on a GPU, said once in the log: NCCL when every rank
    /// has a GPU of its own and it attaches ([`Self::attach_nccl`]); else the transport itself (thread ranks on one
    /// GPU: one device copy; UCX with CUDA support: `cuda_ipc`, `cuda_copy`) or staging through host memory.
    fn device_transport(&self, devices: usize) -> Result<Option<String>> {
        // The backend's memory: the GPU's, or the emulator's (whose device memory moves the same way).
        let longctx_kernels::Memory::Cuda { ordinal } = self.model.backend().memory() else { return Ok(None) };
        if self.world.world_size() < 2 {
            return Ok(None);
        }
        if let Device::Cuda(_) = self.device {
            if let Some(note) = self.attach_nccl(ordinal, devices)? {
                return Ok(Some(note));
            }
        }
        let cp = self.plan.context().comm();
        let how = if cp.reaches_device(ordinal as u32) {
            "moved by the transport itself"
        } else {
            "staged through host memory"
        };
        Ok(Some(format!("device memory between ranks ({} transport): {how}", cp.transport())))
    }

    /// Gives the ranks' communicators (all ranks', and the CP group's) NCCL for device memory when every rank has a
    /// GPU of its own (NCCL refuses two ranks on one GPU, so CP ranks sharing one keep the threads transport's device
    /// copies), so the gradients' all-reduce and the ring's transfers run on the GPUs rather than through host
    /// memory. `LONGCTX_NCCL=0` keeps the host path. Where
    /// NCCL cannot be loaded it is a note, not an error: the run reduces through host memory, as without it. Every
    /// rank calls it; returns the note for the log, `None` when NCCL does not apply.
    fn attach_nccl(&self, ordinal: usize, devices: usize) -> Result<Option<String>> {
        let n = self.world.world_size();
        if devices < n || std::env::var("LONGCTX_NCCL").is_ok_and(|v| v == "0") {
            return Ok(None);
        }
        let cp = self.plan.context().comm();
        let attached = self.world.attach_nccl(ordinal as u32).and_then(|()| {
            if cp.world_size() > 1 {
                cp.attach_nccl(ordinal as u32)
            } else {
                Ok(())
            }
        });
        Ok(Some(match attached {
            Ok(()) => format!("gradients (and the CP ranks' attention transfers) through NCCL across {n} GPUs"),
            Err(e @ (longctx_p2p::CommError::Nccl(_) | longctx_p2p::CommError::NotCompiled(_))) => {
                format!("gradients reduced through host memory: {e}")
            }
            Err(e) => return Err(e.into()),
        }))
    }

    /// The run's arithmetic peak, the denominator of MFU: rank 0 times its device (for the CPU, one machine's
    /// every core) while all ranks wait at a barrier (so none of them competes for it), times the `devices` the
    /// ranks run on (alike, as a cluster's nodes are). Every rank calls it; rank 0's answer is the one that counts.
    fn run_peak_flops(&self, devices: usize) -> Result<f64> {
        let dtype = self.recipe.dtype();
        let peak = if self.is_root() {
            crate::metrics::device_peak_flops(self.device, &**self.model.backend(), dtype)?
        } else {
            0.0
        };
        self.world.barrier()?;
        Ok(peak * devices as f64)
    }

    /// The loop: a step at a time until the last, or until a rank is asked to stop (a checkpoint is written
    /// then, as after the last step).
    fn train(mut self, opts: &RunOptions, data: &Data) -> Result<Summary> {
        let t = &self.recipe.train;
        let (dp, s) = (self.recipe.parallel.dp, t.seq_len);
        let devices = self.devices()?;
        let transport = self.device_transport(devices)?;
        let peak = self.run_peak_flops(devices)?;
        let mut meter = if self.is_root() {
            Some(Meter::open(&opts.out, self.recipe, self.step, opts.quiet, self.model.weights.numel(), peak)?)
        } else {
            None
        };
        if let (Some(m), Some(note)) = (meter.as_ref(), transport) {
            m.note(&note);
        }
        if let Some(m) = meter.as_mut().filter(|_| self.model.backend().device_memory().is_some()) {
            // Thread ranks on one device share its pool; each process has a pool of its own.
            let sharing =
                if self.world.transport() == "threads" { self.world.world_size() / devices.max(1) } else { 1 };
            m.predict_device(crate::plan_cmd::run_memory(self.recipe)?.total * sharing as u64);
        }
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
            // Counted from here: not the held-out passes before.
            self.plan.take_totals();
            let lr = lr_at(self.recipe, self.step);
            let step = self.step;
            let stop = STOP.load(Ordering::SeqCst) || opts.stop_at.is_some_and(|s| step + 1 >= s);
            let out = self.run_step(lr, stop, |micro, group| {
                data.train.sequence(step * t.batch as u64 + (micro * dp + group) as u64, s)
            })?;
            let (loss, saved_bytes, grad_norm) = (out.loss, out.saved_bytes, out.grad_norm);
            // This step's attention calls (before the held-out loss adds its own): with CP, the ring's time blocked
            // on communication its compute did not hide.
            let cp_report = Some(self.plan.take_totals()).filter(|_| self.recipe.parallel.cp > 1);
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
            let took = step_start.elapsed();
            // What offload cost this step: the backward's waits for tensors not yet back.
            let offload_wait = fetch_wait_before
                .zip(self.model.offload_engine().map(|e| e.stats().fetch_wait))
                .map(|(before, after)| after.saturating_sub(before));
            summary.losses.push((self.step, loss));
            let last = self.step == t.steps || out.stop;
            let mut val = None;
            if t.eval_every > 0 && (self.step.is_multiple_of(t.eval_every) || last) {
                let v = self.heldout_loss(&data.heldout)?;
                summary.val_losses.push((self.step, v));
                val = Some(v);
                let peak = self.run_peak_flops(devices)?;
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
                    self.model.backend().device_memory(),
                    cp_report,
                )?;
            }
            // `train.keep_checkpoints = 0` keeps none: a benchmark's run, whose weights nobody wants back.
            let ckpt_due = t.keep_checkpoints > 0
                && ((t.checkpoint_every > 0 && self.step.is_multiple_of(t.checkpoint_every)) || last);
            if ckpt_due {
                self.save(&opts.out, meter.as_mut())?;
            }
            if out.stop {
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
}
