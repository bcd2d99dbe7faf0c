//! `longctx-p2p` (being built).
//!
//! This crate owns the `Communicator`: ranks, point-to-point send/recv (blocking and async), ring exchange,
//! collectives and sub-communicators, over in-process threads (default), UCX between processes and hosts
//! (`ucx` feature) and NCCL on GPUs (`nccl` feature), with a launcher and a rendezvous. It depends on no other
//! longctx crate.
