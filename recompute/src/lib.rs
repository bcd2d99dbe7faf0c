//! `longctx-recompute` (not built yet).
//!
//! This crate will own activation-checkpoint policies (none, full, selective, block/uniform, per-tensor
//! keep/recompute/offload), a solver that picks a policy under a memory budget, and a memory/time planner for
//! real model recipes. It depends on no other longctx crate.
