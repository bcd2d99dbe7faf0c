//! The trainer's errors: each names the file, the field or the value at fault.

use std::path::PathBuf;

/// Everything that can go wrong in the trainer.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A kernel rejected its input.
    #[error(transparent)]
    Kernel(#[from] longctx_kernels::KernelError),
    /// The device ran out of memory during a step: where, what was asked and what was free, beside the planner's
    /// prediction of the rank's activation peak.
    #[error(
        "step {step}, {phase}: out of memory on {memory}: {bytes} bytes asked, {free} free; the planner predicted \
         a peak of {predicted_peak_mib:.0} MiB of activations per rank (a recompute policy such as `--recompute \
         selective` or `budget:SIZE`, `--offload host`, or more CP ranks lowers it)"
    )]
    DeviceOutOfMemory {
        /// The step (1-based).
        step: u64,
        /// What the step was doing (`forward of layer 3`, `backward of layer 0`, `the loss`, …).
        phase: String,
        /// The memory that ran out.
        memory: longctx_kernels::Memory,
        /// Bytes the failed allocation asked.
        bytes: usize,
        /// Bytes the device reported free.
        free: usize,
        /// The planner's peak of kept and rebuilt activations per rank, MiB.
        predicted_peak_mib: f64,
    },
    /// Context-parallel attention failed.
    #[error(transparent)]
    Ring(#[from] longctx_ring_attn::RingError),
    /// A communication failed (a peer died, stalled or disagreed).
    #[error(transparent)]
    Comm(#[from] longctx_p2p::CommError),
    /// Reading or writing a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// A checkpoint that cannot be used: corrupt, truncated, or of another shape.
    #[error("checkpoint {path}: {detail}")]
    Checkpoint {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong, naming the field.
        detail: String,
    },
    /// A Hugging Face `config.json` field this trainer cannot honour (unsupported, out of range, malformed).
    #[error("{path}: field `{field}`: {detail}")]
    HfConfig {
        /// The `config.json`.
        path: PathBuf,
        /// The field, as the file spells it (`rope_scaling.factor`).
        field: String,
        /// What is wrong with it.
        detail: String,
    },
    /// A tensor of a Hugging Face checkpoint that cannot be used: missing, extra, of the wrong shape or dtype,
    /// or cut short.
    #[error("{path}: tensor `{tensor}`: {detail}")]
    HfTensor {
        /// The safetensors file (or the index that lists it).
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong with it.
        detail: String,
    },
    /// An export option the checkpoint cannot be written with (fused experts for a model without experts).
    #[error("export option `{option}`: {detail}")]
    ExportOption {
        /// The option, as the command line spells it (`--experts fused`).
        option: String,
        /// Why this checkpoint cannot take it.
        detail: String,
    },
    /// A token id the model has no embedding for, among ids given to it (a `.npy` of ids, or what a tokenizer
    /// made of a text): the first such id and its position.
    #[error("token {position} is id {id}, outside the model's vocabulary of {vocab} tokens")]
    TokenOutOfVocab {
        /// The id.
        id: u32,
        /// Its index in the ids.
        position: usize,
        /// The model's vocabulary size (`model.vocab`).
        vocab: usize,
    },
    /// A recipe field whose value cannot be used (out of range, malformed, or at odds with another field or with
    /// the corpus): the field by its dotted path (`train.seq_len`) and what is wrong with its value.
    #[error("recipe field `{field}`: {detail}")]
    InvalidField {
        /// The field's dotted path, as `--set` spells it.
        field: String,
        /// What is wrong with its value.
        detail: String,
    },
    /// A recipe that cannot be read: not TOML, an unknown or missing field, a value of the wrong type.
    #[error("{origin}: {detail}")]
    RecipeSyntax {
        /// Where the recipe came from (`built-in recipe \`tiny-llama\``, a path, `checkpoint`).
        origin: String,
        /// What the TOML reader said, naming the field.
        detail: String,
    },
    /// A recipe that is neither built in nor a file.
    #[error("no recipe `{name}`: not a built-in ({builtins}) and no such file")]
    UnknownRecipe {
        /// The name or path asked for.
        name: String,
        /// The built-in recipes' names.
        builtins: String,
    },
    /// A command-line option whose value cannot be used.
    #[error("{option}: {detail}")]
    InvalidOption {
        /// The option as the command line spells it (`--dtype`, `--set`).
        option: String,
        /// What is wrong with its value.
        detail: String,
    },
    /// An argument of a library call that cannot be used (the call's contract, not a recipe's value).
    #[error("{name}: {detail}")]
    InvalidArgument {
        /// The argument, or the item of it at fault.
        name: String,
        /// What is wrong with it.
        detail: String,
    },
    /// A file of token ids that cannot be read as such (a malformed `.npy`, or text without the tokenizer it needs).
    #[error("{path}: {detail}")]
    TokenFile {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the header field or the index at fault.
        detail: String,
    },
    /// A tokenizer that failed on its input, or that cannot be written out.
    #[error("{context}: {detail}")]
    Tokenizer {
        /// What it was doing (`the tokenizer failed on the corpus`).
        context: String,
        /// What the tokenizers library said.
        detail: String,
    },
    /// A run's `metrics.jsonl` that cannot be plotted: a malformed line, or nothing to draw.
    #[error("{path}: {detail}")]
    Metrics {
        /// The file (with `:LINE` where one line is at fault).
        path: String,
        /// What is wrong.
        detail: String,
    },
    /// The offload tier failed (a full tier, a spill file's I/O, a corrupt round trip, a closed engine).
    #[error("offload: {0}")]
    Offload(#[from] longctx_offload::OffloadError),
    /// The recompute planner or a policy failed.
    #[error(transparent)]
    Recompute(#[from] longctx_recompute::RecomputeError),
    /// The training diverged: the summed gradient's norm is not finite.
    #[error("step {step}: the gradient norm is {norm} (the loss diverged; lower train.lr)")]
    Diverged {
        /// The step (1-based) whose gradient it is.
        step: u64,
        /// The norm: NaN or infinite.
        norm: f64,
    },
    /// `longctx-launch` started another number of ranks than the recipe's layout has.
    #[error("the launcher started {launched} ranks; the recipe needs parallel.cp × parallel.dp = {needed}")]
    WorldSize {
        /// Ranks started.
        launched: usize,
        /// `parallel.cp × parallel.dp`.
        needed: usize,
    },
    /// Another rank failed at a step every rank takes part in; that rank reports its own error.
    #[error("rank {rank} failed to {what}")]
    PeerFailed {
        /// The rank that failed.
        rank: usize,
        /// What it failed to do.
        what: String,
    },
    /// `--resume` with no checkpoint to resume from.
    #[error("--resume: no checkpoint in {dir}")]
    NoCheckpoint {
        /// The folder searched (`OUT/checkpoints`).
        dir: PathBuf,
    },
    /// A pretrained checkpoint (`--init-from`, `train.init_from`) that is not there.
    #[error("no pretrained checkpoint at {path}{hint}")]
    NoPretrained {
        /// The path given.
        path: PathBuf,
        /// How to fetch it, where known (else empty).
        hint: String,
    },
    /// An output directory that would be overwritten.
    #[error("{path}: not empty; {why}")]
    OutputNotEmpty {
        /// The directory.
        path: PathBuf,
        /// What writes there and why it must not overwrite.
        why: String,
    },
    /// The run asks for a CUDA device and this build has no CUDA backend.
    #[error("`cuda:{ordinal}`: this build of longctx has no CUDA backend (build with `--features cuda`)")]
    CudaNotCompiled {
        /// The ordinal of the GPU asked for.
        ordinal: usize,
    },
    /// A thread pool the trainer needs could not be started.
    #[error("{purpose}: {source}")]
    ThreadPool {
        /// What the pool was for.
        purpose: String,
        /// What rayon said.
        source: rayon::ThreadPoolBuildError,
    },
    /// A child process (our own trainer run, or the PyTorch peer of `longctx bench`) failed or said something
    /// unreadable.
    #[error("{what}: {detail}")]
    Child {
        /// Which child, and what of it (`our run failed`, `peer output "…"`).
        what: String,
        /// Its stderr, or why its output cannot be read.
        detail: String,
    },
    /// A broken invariant of the trainer itself (a bug, not a setting to change): what did not hold.
    #[error("internal error (a bug in longctx): {0}")]
    Internal(String),
}

impl TrainError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TrainError::Io { path: path.into(), source }
    }
}

/// The trainer's result type.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;

impl TrainError {
    /// The failed allocation's memory, size and free bytes, if this error is a device running out of memory
    /// (from a kernel, or from ring attention's own buffers).
    fn out_of_memory(&self) -> Option<(longctx_kernels::Memory, usize, usize)> {
        use longctx_kernels::KernelError::OutOfMemory;
        match self {
            TrainError::Kernel(OutOfMemory { memory, bytes, free })
            | TrainError::Ring(longctx_ring_attn::RingError::Kernel(OutOfMemory { memory, bytes, free })) => {
                Some((*memory, *bytes, *free))
            }
            _ => None,
        }
    }

    /// This error with `phase` said, if it is a device running out of memory not placed yet (its step and the
    /// planner's figure are filled in by [`TrainError::in_step`]); any other error as it is.
    pub fn in_phase(self, phase: impl FnOnce() -> String) -> TrainError {
        match self.out_of_memory() {
            Some((memory, bytes, free)) => {
                TrainError::DeviceOutOfMemory { step: 0, phase: phase(), memory, bytes, free, predicted_peak_mib: 0.0 }
            }
            None => self,
        }
    }

    /// This error in step `step`, with the planner's predicted peak, if it is a device running out of memory (one
    /// no phase was said for is placed in `the step`); any other error as it is.
    pub fn in_step(self, step: u64, predicted_peak_mib: f64) -> TrainError {
        match self.in_phase(|| "the step".into()) {
            TrainError::DeviceOutOfMemory { phase, memory, bytes, free, .. } => {
                TrainError::DeviceOutOfMemory { step, phase, memory, bytes, free, predicted_peak_mib }
            }
            other => other,
        }
    }
}
