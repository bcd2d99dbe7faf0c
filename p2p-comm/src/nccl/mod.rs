//! NCCL beside the host transport (feature `nccl`): [`Communicator::attach_nccl`] gives a communicator an NCCL
//! communicator over one device, and from then on the device memory of that device that its byte-level
//! operations ([`memory`](crate::memory)) are given moves through NCCL: point-to-point transfers, all-gather,
//! all-to-all and all-reduce, on NCCL's stream, with no copy of ours and no staging. Host messages (the set-up,
//! the trainer's metrics, the collectives of host memory) stay on the host transport, threads or UCX, which also
//! carries NCCL's unique id at set-up, as PyTorch pairs Gloo with NCCL.
//!
//! NCCL takes one rank per device and refuses two ranks on one device ("Duplicate GPU detected"), so CP ranks that
//! share one GPU use the threads transport's device copies instead; the NCCL path is for one rank per GPU, ranks as
//! processes (`longctx-launch`, Slurm) or as threads of one process each with its own device, and runs unchanged
//! on one machine with several GPUs or several machines. On a one-GPU machine it is tested at world size 1.
//!
//! The library is loaded at run time ([`library`]); a machine without it, or without the driver, gets
//! [`CommError::Nccl`](crate::CommError::Nccl) from `attach_nccl`, on every rank.

pub(crate) mod comm;
pub(crate) mod library;

use crate::error::CommError;

/// NCCL's version (e.g. `2.27.3`) and the file it was loaded from, or why it could not be loaded. Loads the library
/// (once per process) and needs no device.
pub fn nccl_version() -> Result<(String, String), CommError> {
    let lib = library::nccl()?;
    let v = lib.version()?;
    // NCCL_VERSION(X,Y,Z) is X*10000 + Y*100 + Z since 2.9.
    Ok((format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100), lib.path.clone()))
}

/// NCCL's data type for the element type `T` of a reduction.
pub(crate) fn dtype_of<T: 'static>() -> Option<i32> {
    use std::any::TypeId;
    let t = TypeId::of::<T>();
    Some(if t == TypeId::of::<f32>() {
        library::dtype::FLOAT32
    } else if t == TypeId::of::<f64>() {
        library::dtype::FLOAT64
    } else if t == TypeId::of::<i32>() {
        library::dtype::INT32
    } else if t == TypeId::of::<i64>() {
        library::dtype::INT64
    } else if t == TypeId::of::<u64>() {
        library::dtype::UINT64
    } else if t == TypeId::of::<half::bf16>() {
        library::dtype::BFLOAT16
    } else {
        return None;
    })
}

/// NCCL's reduction for `op`.
pub(crate) fn redop_of(op: crate::reduce::ReduceOp) -> i32 {
    match op {
        crate::reduce::ReduceOp::Sum => library::redop::SUM,
        crate::reduce::ReduceOp::Max => library::redop::MAX,
    }
}
