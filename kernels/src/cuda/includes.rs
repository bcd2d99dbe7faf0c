//! The headers a kernel source includes by name (`KernelSource::includes`), beside the shared ones every source gets
//! (`sources::HEADERS`): the Hopper PTX wrappers. A module of their own, below both the registry of sources
//! (`sources.rs`, which decides from them what a source compiles for) and the ops that declare sources with them.

/// The header of the sm_90a-only wrappers (`wgmma`, `setmaxnreg`): an include of the sources that use it, which makes
/// them sm_90a-only (`sources::needs_sm90a`).
pub(crate) const PTX_HOPPER: (&str, &str) = ("ptx_hopper.cuh", include_str!("kernels/ptx_hopper.cuh"));

/// The header of the TMA and mbarrier wrappers (`cp.async.bulk.tensor`, `mbarrier.try_wait`): an include of the
/// sources that use it. Its instructions are plain sm_90 PTX, not sm_90a, so a source including it alone compiles for
/// sm_90 and sm_90a but not for sm_80 (`sources::needs_sm90`); one that also includes [`PTX_HOPPER`] (as the TMA probe
/// and the wgmma attention forward do, for `setmaxnreg`) is sm_90a-only like any source including that.
pub(crate) const PTX_TMA: (&str, &str) = ("ptx_tma.cuh", include_str!("kernels/ptx_tma.cuh"));
