//! `longctx-offload` (not built yet).
//!
//! This crate will own moving activations and inactive weights out of accelerator memory: to pinned host
//! memory drawn from a pool, or to disk, on background streams, with prefetch ahead of the backward pass so
//! the data is back before it is needed. It depends on no other longctx crate.
