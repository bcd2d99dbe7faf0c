//! `longctx-trainer` (not built yet).
//!
//! This crate will own the Llama-style reference trainer (dense, MoE and Nemotron-style variants) that uses
//! every other longctx crate together: built-in recipes, context-parallel and data-parallel ranks, bf16,
//! checkpoints and resume, and Hugging Face checkpoint import/export. Its binary is `longctx`.
