//! `longctx-trainer`: the reference trainer, where every longctx crate meets (binary `longctx`).
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]

pub mod checkpoint;
pub mod error;
pub mod npy;
pub mod plot;

pub use error::{Result, TrainError};
