//! The conformance suite of [`Backend`]: one call checks every op of any backend against an f64 reference written
//! as plain loops and against [`CpuBackend`] on the same inputs, on cases drawn by proptest.
//!
//! A framework that implements [`Backend`] (for its own device, or around its own kernels) runs [`check_all`] in
//! its tests and gets, per op, what this crate checks of its own two backends:
//! - **values**: each output against an f64 reference (attention's is [`crate::attention::reference`], the other
//!   ops' are loops in this module's files) within the tolerance of its family and element type, written down once
//!   with the reason for each in [`tolerance`]; and against [`CpuBackend`] given the same inputs, within twice that
//!   (each side is within the tolerance of the truth), or bit for bit where the reference is exact;
//! - **every element written**: each output is filled with NaN through the backend (`empty`, then `fill`) before
//!   the call, so an element the op skips fails the comparison;
//! - **memory**: inputs reach the backend only through `upload` and results leave only through `download`, as the
//!   trait's Memory rules say (so a device backend is tested as a caller uses it), and a view of other memory is
//!   [`KernelError::Memory`](crate::KernelError::Memory) naming the argument;
//! - **determinism**: an op run twice on the same inputs gives the same bits (every fourth case of each property);
//! - **NaN confinement** (attention): a NaN or infinity in `Q`, `K`, `V` or `dO` leaves every row it cannot reach
//!   bit-identical to a clean run on the same backend, and shows in the rows that see it;
//! - **typed errors**: bad dims, dtypes and scalars give the same [`KernelError`](crate::KernelError) as
//!   [`CpuBackend`] (the checks are shared), and an error leaves the outputs untouched.
//!
//! The cases: [`strategies`] has the building blocks (dtypes, [`GradMode`](crate::GradMode), positions including a
//! zigzag shard's two ranges, documents, masks), and each family's module its case type and the strategy that
//! draws it (e.g. [`attention::cases`]), bounded by [`Limits`], so a test can compose its own (the [`proptest`] they
//! are written with is re-exported, so its version is the suite's):
//! ```
//! use longctx_kernels::testing::conformance::{attention, proptest, Limits};
//! use proptest::strategy::{Strategy, ValueTree};
//!
//! let mut runner = proptest::test_runner::TestRunner::deterministic();
//! let case = attention::cases(&Limits::small()).new_tree(&mut runner).unwrap().current();
//! // Sizes, mask (positions, documents), scale, dtypes, mode and seed: `case.params()` for the f64 reference,
//! // `case.options()` for a backend call.
//! assert!(case.shape.q_len <= Limits::small().attn_len);
//! let _ = (case.params(), case.options());
//! ```
//!
//! # Running it on your backend
//! ```
//! use longctx_kernels::testing::conformance::{check_all, Config};
//! use longctx_kernels::CpuBackend;
//!
//! // Any `Backend`: your device's, or a wrapper around your kernels. `CpuBackend` stands in for it here.
//! let mine = CpuBackend::new();
//! // Few cases on small shapes (`Config::default()` is the full budget); a fixed seed, so a failure comes back.
//! let cfg = Config::quick().with_seed(7);
//! match check_all(&mine, &cfg) {
//!     Ok(report) => println!("{report}"), // every property, its cases, and the worst error against its tolerance
//!     Err(failure) => panic!("{failure}"), // the op, the case (shapes, mask, dtype, mode, seed) and the error
//! }
//! ```
//! [`check`] runs some [`Family`]s only, so a test suite can give each its own test (and thread).
//!
//! # Reading a failure
//! A [`Failure`] names the backend, the property, the op, the case (its `Debug`: shapes, mask, positions as ranges,
//! dtype, mode and the seed of its data, enough to rerun it) and what went wrong: an output beyond its tolerance
//! (where, by how much, the values), bits that changed between two runs or across a masked NaN, an unexpected
//! error, or an error that wrote an output. Proptest shrinks the case first, so it is small.

pub mod activation;
pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod data;
pub mod elementwise;
pub mod embedding;
mod errors;
mod failure;
mod harness;
pub mod linear;
pub mod memory;
pub mod moe;
pub mod nonfinite;
pub mod norm;
pub mod rope;
pub mod strategies;
pub mod tolerance;

pub use failure::{Against, CheckReport, Failure, FailureKind, Report, Worst};
/// The property-testing library the strategies are written with.
pub use proptest;

use crate::backend::Backend;
use crate::cpu::CpuBackend;
use harness::Ctx;

/// The groups of checks, one per op family (each is one module of this suite).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Family {
    /// `upload`/`download` round trips, `zeros` and `empty`.
    Memory,
    /// `copy`, `fill`, `add`, `scale`, `sum_squares`, `clip_grad_norm`, `transpose12`.
    Elementwise,
    /// Attention forward, backward and merge.
    Attention,
    /// Attention's NaN confinement.
    NonFinite,
    /// `linear_forward`/`linear_backward`.
    Linear,
    /// RMSNorm and LayerNorm.
    Norm,
    /// Rotary embeddings.
    Rope,
    /// SwiGLU and squared ReLU.
    Activation,
    /// The mixture-of-experts router, dispatch and combine.
    Moe,
    /// Token embeddings.
    Embedding,
    /// The fused chunked cross-entropy.
    CrossEntropy,
    /// AdamW.
    Adamw,
    /// Typed errors for bad input, outputs untouched.
    Errors,
}

impl Family {
    /// Every family, in the order [`check_all`] runs them: the data moves first, since every other check relies
    /// on them.
    pub const ALL: [Family; 13] = [
        Family::Memory,
        Family::Elementwise,
        Family::Activation,
        Family::Linear,
        Family::Norm,
        Family::Rope,
        Family::Embedding,
        Family::Moe,
        Family::CrossEntropy,
        Family::Adamw,
        Family::Attention,
        Family::NonFinite,
        Family::Errors,
    ];

    fn run(self, ctx: &Ctx<'_>) -> Result<(), Failure> {
        match self {
            Family::Memory => memory::check(ctx),
            Family::Elementwise => elementwise::check(ctx),
            Family::Attention => attention::check(ctx),
            Family::NonFinite => nonfinite::check(ctx),
            Family::Linear => linear::check(ctx),
            Family::Norm => norm::check(ctx),
            Family::Rope => rope::check(ctx),
            Family::Activation => activation::check(ctx),
            Family::Moe => moe::check(ctx),
            Family::Embedding => embedding::check(ctx),
            Family::CrossEntropy => cross_entropy::check(ctx),
            Family::Adamw => adamw::check(ctx),
            Family::Errors => errors::check(ctx),
        }
    }
}

/// How many cases, how large, from which seed.
#[derive(Debug, Clone)]
pub struct Config {
    /// Cases drawn per property (each family has a few properties).
    pub cases: u32,
    /// The seed every property's cases are drawn from (with the property's name mixed in).
    pub seed: u64,
    /// The largest shapes drawn.
    pub limits: Limits,
    /// Simplifications proptest tries on a failing case before it reports it (each one a run of the op).
    pub max_shrink_iters: u32,
    /// Also compare every output with [`CpuBackend`]'s on the same inputs.
    pub compare_cpu: bool,
    /// Also run every fourth case twice and require the same bits.
    pub determinism: bool,
    /// The backend the comparisons with the CPU run on (the best SIMD path on rayon's global pool by default).
    pub cpu: CpuBackend,
}

impl Default for Config {
    /// 32 cases per property on [`Limits::full`], seed 20261129: a few seconds on a CPU backend.
    fn default() -> Self {
        Config {
            cases: 32,
            seed: 20261129,
            limits: Limits::full(),
            max_shrink_iters: 256,
            compare_cpu: true,
            determinism: true,
            cpu: CpuBackend::new(),
        }
    }
}

impl Config {
    /// Eight cases per property on [`Limits::small`]: a smoke test, or a slow backend (an emulator).
    pub fn quick() -> Self {
        Config { cases: 8, limits: Limits::small(), max_shrink_iters: 64, ..Config::default() }
    }
    /// The same with `cases` per property.
    pub fn with_cases(mut self, cases: u32) -> Self {
        self.cases = cases;
        self
    }
    /// The same with another seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    /// The same with other limits.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }
}

/// The largest shapes the strategies draw. The suite's fixed cases (tile boundaries, long reductions) follow them
/// too, so a slow backend can be given small ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most query or key rows of an attention case.
    pub attn_len: usize,
    /// Most head dim of an attention case (a multiple of 8, at least 32).
    pub attn_head_dim: usize,
    /// Rows of the fixed attention cases that span many tiles (windows crossing tile borders, a long causal
    /// `bf16` run, the largest head dim); 0 leaves them out.
    pub attn_long: usize,
    /// Most elements of an element-wise case.
    pub elems: usize,
    /// Most tokens (rows) of a linear, norm, embedding, router or cross-entropy case.
    pub tokens: usize,
    /// Most features (columns) of those.
    pub features: usize,
    /// Tokens of the fixed cases whose reductions over tokens are long (weight gradients); 0 leaves them out.
    pub long_tokens: usize,
    /// Width of the fixed cases whose rows are wider than a GPU block (a norm's channels, a vocabulary, an
    /// embedding's or a dispatched row's channels), so that each thread of a block handles several elements.
    pub wide: usize,
    /// Elements of the fixed element-wise cases past the largest grid a backend launches (the CUDA backend's is
    /// 4096 blocks of 256 threads), so that its threads loop; 0 leaves them out.
    pub long_elems: usize,
}

impl Limits {
    /// The shapes this crate's CPU suite draws: past the CPU's tiles (128 rows) and parallel blocks.
    pub fn full() -> Self {
        Limits {
            attn_len: 150,
            attn_head_dim: 128,
            attn_long: 400,
            elems: 40_000,
            tokens: 40,
            features: 48,
            long_tokens: 4500,
            wide: 1100,
            long_elems: (1 << 20) + 77,
        }
    }
    /// Small shapes for a slow backend (an emulator): every code path a small case reaches, none of the long ones.
    pub fn small() -> Self {
        Limits {
            attn_len: 40,
            attn_head_dim: 64,
            attn_long: 0,
            elems: 2_000,
            tokens: 24,
            features: 32,
            long_tokens: 0,
            wide: 300,
            long_elems: 0,
        }
    }
}

/// Runs every family's checks on `backend`: the first failure (shrunk to a small case), or a report of every
/// property with its case count and worst errors.
pub fn check_all(backend: &dyn Backend, cfg: &Config) -> Result<Report, Failure> {
    check(backend, cfg, &Family::ALL)
}

/// Runs the checks of `families` only, in the order given.
pub fn check(backend: &dyn Backend, cfg: &Config, families: &[Family]) -> Result<Report, Failure> {
    let ctx = Ctx::new(backend, cfg);
    for &f in families {
        ctx.set_family(f);
        f.run(&ctx)?;
    }
    Ok(ctx.into_report())
}
