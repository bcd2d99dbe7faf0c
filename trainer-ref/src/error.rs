//! The trainer's errors: each names the file, the field or the value at fault.

use std::path::PathBuf;

/// Everything that can go wrong in the trainer.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A kernel rejected its input.
    #[error(transparent)]
    Kernel(#[from] longctx_kernels::KernelError),
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
    /// Anything else a user has to fix before work starts, naming the value.
    #[error("{0}")]
    Config(String),
}

impl TrainError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TrainError::Io { path: path.into(), source }
    }
}

/// The trainer's result type.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;
