//! `longctx-ring-attn` (being built).
//!
//! This crate owns context-parallel attention: the sequence split across ranks with causal load balance, KV
//! passed around a ring while the current block is computed, exact forward and backward; also all-gather,
//! all-to-all (Ulysses) and hybrid schedules. It builds on `longctx-kernels` and `longctx-p2p`.
