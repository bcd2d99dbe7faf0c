//! The entry point: [`ContextParallel`] (a communicator, a backend and a configuration, owned, so a model can
//! hold it), the problem it is planned for ([`CpShape`], [`CpMask`]) and what a call reports.

use std::sync::Arc;
use std::time::Duration;

use longctx_kernels::{AttnGrads, AttnSaved, Qkv, View, ViewMut};
use longctx_kernels::{AttnMask, AttnOptions, AttnOut, AttnParams, AttnShape, Backend, DType, HostSlice, Positions};
use longctx_p2p::Communicator;

use crate::agree::agree_on_schedule;
use crate::error::{Result, RingError};
use crate::partition::{Partition, SeqLayout};
use crate::plan::CpPlan;

/// Sizes of the whole problem (all ranks together) and the element type of `Q`, `K`, `V`. Each rank's views are
/// `[B, H, L, D]` with `L = S / CP` ([`CpPlan::local_len`]), holding its tokens in the order
/// [`SeqLayout::positions`] gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpShape {
    /// `B`.
    pub batch: usize,
    /// `Hq`: a multiple of `Hkv` (grouped-query attention: query head `h` reads KV head `h / (Hq / Hkv)`).
    pub q_heads: usize,
    /// `Hkv`.
    pub kv_heads: usize,
    /// Total tokens `S` of the sequence: a multiple of `2·CP` for zigzag, of `CP` for the other partitions.
    pub seq_len: usize,
    /// `D`: 32 to 256 in steps of 8.
    pub head_dim: usize,
    /// The element type of `Q`, `K`, `V`, `O` and the gradients (`LSE` is always `f32`).
    pub dtype: DType,
}

/// The mask, by global token positions: causal and/or a sliding window, and whether the sequence packs several
/// documents (their ids are given per batch with [`CpPlan::set_documents`]).
///
/// Conventions (those of `longctx-kernels`' `AttnMask`): a query at position `i` sees the key at `j` when
/// - causal: `j ≤ i`;
/// - with a window `w`: `i − j < w` when causal (the query itself and the `w − 1` keys before it), and
///   `|i − j| < w` when not (the query itself and the `w − 1` keys on each side of it: `2w − 1` positions);
/// - with documents: both tokens have the same document id.
///
/// A row that sees no key gets `O = 0` and `LSE = −inf`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpMask {
    /// Keys after the query are hidden.
    pub causal: bool,
    /// Sliding window in positions (at least 1): keys less than this far from the query, before it when causal,
    /// on either side when not.
    pub window: Option<u64>,
    /// The sequence packs documents that must not see each other.
    pub documents: bool,
}

impl CpMask {
    /// Causal, one document.
    pub fn causal() -> Self {
        Self { causal: true, ..Self::default() }
    }
    /// With a sliding window of `window` positions (one-sided when causal, on both sides when not; see
    /// [`CpMask`]).
    pub fn with_window(mut self, window: u64) -> Self {
        self.window = Some(window);
        self
    }
    /// With packed documents.
    pub fn with_documents(mut self) -> Self {
        self.documents = true;
        self
    }
}

/// How the ranks exchange what attention needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// KV blocks passed around a ring, overlapped with compute (`CP − 1` steps).
    #[default]
    Ring,
    /// Gather all K/V (this many KV heads at a time, bounding memory), compute the local queries.
    AllGather {
        /// KV heads gathered per step (at least 1).
        kv_heads_per_step: usize,
    },
    /// All-to-all from sequence shards to head shards, local full attention, and back. Needs both head
    /// counts divisible by CP.
    Ulysses,
    /// All-to-all inside groups of `group` consecutive ranks (a fast link) and ring across the groups.
    /// Needs `group` to divide CP and both head counts divisible by `group`.
    Hybrid {
        /// Ranks per all-to-all group.
        group: usize,
    },
}

/// Partition, schedule and softmax scale.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CpConfig {
    /// How the sequence is cut.
    pub partition: Partition,
    /// How the ranks exchange.
    pub schedule: Schedule,
    /// Softmax scale; `1/sqrt(D)` when `None`.
    pub scale: Option<f32>,
}

/// What one call did, for benchmarks and for checking communication volume.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepReport {
    /// Bytes this rank sent (measured by the communicators).
    pub bytes_sent: u64,
    /// Bytes the schedule's formula says this rank sends.
    pub expected_bytes: u64,
    /// Time in attention kernels and merges.
    pub compute: Duration,
    /// Time waiting for (or posting) communication that compute did not hide.
    pub comm_wait: Duration,
    /// KV blocks computed.
    pub blocks_computed: usize,
    /// KV blocks skipped because the mask hides them entirely.
    pub blocks_skipped: usize,
}

/// One rank's side of the problem as a schedule runs it on some communicator.
#[derive(Clone, Copy)]
pub(crate) struct Local<'a> {
    pub backend: &'a dyn Backend,
    /// Block sizes on this rank (`q_len == kv_len`).
    pub shape: AttnShape,
    pub causal: bool,
    pub window: Option<u64>,
    pub scale: f32,
    /// Global positions of every rank's block, indexed by rank in the communicator the schedule uses.
    pub positions: &'a [Vec<i64>],
    /// This rank's index there.
    pub me: usize,
    /// Document ids of this rank's block.
    pub docs: Option<&'a [u32]>,
}

impl Local<'_> {
    pub fn my_positions(&self) -> &[i64] {
        &self.positions[self.me]
    }
    /// Kernel parameters for this rank's queries against a key block at `k_pos`.
    pub fn params<'b>(&'b self, k_pos: &'b [i64], k_doc: Option<&'b [u32]>) -> AttnParams<'b> {
        self.params_for(self.shape, self.my_positions(), k_pos, k_doc)
    }
    /// Kernel parameters of another block shape (a gathered KV slice).
    pub fn params_for<'b>(
        &'b self,
        shape: AttnShape,
        q_pos: &'b [i64],
        k_pos: &'b [i64],
        k_doc: Option<&'b [u32]>,
    ) -> AttnParams<'b> {
        let mut mask = AttnMask::full().with_positions(Positions::Explicit(q_pos), Positions::Explicit(k_pos));
        mask.causal = self.causal;
        mask.window = self.window;
        mask.q_doc = self.docs;
        mask.k_doc = k_doc;
        AttnParams { shape, mask, scale: self.scale }
    }

    /// Attention of host blocks through the backend: `o` and `lse` are `f32`.
    pub fn attn_forward(
        &self,
        p: &AttnParams<'_>,
        [q, k, v]: [HostSlice<'_>; 3],
        o: &mut [f32],
        lse: &mut [f32],
    ) -> Result<()> {
        let s = p.shape;
        let (qd, kd) = (q_dims(&s), kv_dims(&s));
        let qkv = Qkv::new(View::host(q, qd)?, View::host(k, kd)?, View::host(v, kd)?);
        let out = AttnOut { o: ViewMut::new(o, qd)?, lse: ViewMut::new(lse, [s.batch, s.q_heads, s.q_len])? };
        self.backend.attention_forward(&AttnOptions { mask: p.mask, scale: Some(p.scale) }, out, qkv)?;
        Ok(())
    }

    /// The backward of host blocks through the backend, into the `f32` gradients (added to them with
    /// [`GradMode::Accumulate`](longctx_kernels::GradMode), written whole with `Overwrite`).
    pub fn attn_backward(
        &self,
        p: &AttnParams<'_>,
        [q, k, v, o, d_o]: [HostSlice<'_>; 5],
        lse: &[f32],
        [dq, dk, dv]: [&mut [f32]; 3],
        mode: longctx_kernels::GradMode,
    ) -> Result<()> {
        let s = p.shape;
        let (qd, kd) = (q_dims(&s), kv_dims(&s));
        let qkv = Qkv::new(View::host(q, qd)?, View::host(k, kd)?, View::host(v, kd)?);
        let saved = AttnSaved { qkv, o: View::host(o, qd)?, lse: View::new(lse, [s.batch, s.q_heads, s.q_len])? };
        let grads = AttnGrads { dq: ViewMut::new(dq, qd)?, dk: ViewMut::new(dk, kd)?, dv: ViewMut::new(dv, kd)? };
        let opts = AttnOptions { mask: p.mask, scale: Some(p.scale) };
        self.backend.attention_backward(&opts, grads, View::host(d_o, qd)?, saved, mode)?;
        Ok(())
    }

    /// Merges a partial result into the accumulator through the backend.
    pub fn merge(&self, o: &mut [f32], lse: &mut [f32], o2: &[f32], lse2: &[f32]) -> Result<()> {
        let s = self.shape;
        let (qd, ld) = (q_dims(&s), [s.batch, s.q_heads, s.q_len]);
        let acc = AttnOut { o: ViewMut::new(o, qd)?, lse: ViewMut::new(lse, ld)? };
        let part = longctx_kernels::AttnPartial { o: View::new(o2, qd)?, lse: View::new(lse2, ld)? };
        self.backend.attention_merge(acc, part)?;
        Ok(())
    }
}

fn q_dims(s: &AttnShape) -> [usize; 4] {
    [s.batch, s.q_heads, s.q_len, s.head_dim]
}
fn kv_dims(s: &AttnShape) -> [usize; 4] {
    [s.batch, s.kv_heads, s.kv_len, s.head_dim]
}

/// Context-parallel attention over a communicator, on a backend. It owns both (the communicator as an `Arc`,
/// so a model struct can hold it beside everything else) and is planned once per problem with
/// [`ContextParallel::plan`]; the plan runs the forward and backward.
///
/// Construction is collective (the ranks check that they chose the same schedule, and the hybrid and Ulysses
/// schedules split the communicator): every rank calls [`ContextParallel::new`] with the same config, and then
/// [`ContextParallel::plan`] with the same shape and mask, which checks that they agree on the rest. Cloning is cheap (shared handles); a plan holds a clone, so a model can
/// own its `ContextParallel` and its plans side by side.
#[derive(Clone)]
pub struct ContextParallel {
    pub(crate) comm: Arc<Communicator>,
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) cfg: CpConfig,
    /// For Ulysses and hybrid: (all-to-all group, ring across groups).
    pub(crate) groups: Option<Arc<(Communicator, Communicator)>>,
}

impl std::fmt::Debug for ContextParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextParallel")
            .field("rank", &self.comm.rank())
            .field("world", &self.comm.world_size())
            .field("backend", &self.backend.name())
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl ContextParallel {
    /// Checks the configuration against the communicator and sets up sub-communicators (collective: ranks that
    /// chose different schedules all fail with [`RingError::RanksDisagree`] naming `schedule`).
    pub fn new(comm: impl Into<Arc<Communicator>>, backend: Arc<dyn Backend>, cfg: CpConfig) -> Result<Self> {
        let comm = comm.into();
        let n = comm.world_size();
        let group = match cfg.schedule {
            Schedule::Ulysses => Some(n),
            Schedule::Hybrid { group } => {
                if group == 0 || !n.is_multiple_of(group) {
                    return Err(RingError::GroupSize { group, world: n });
                }
                Some(group)
            }
            Schedule::AllGather { kv_heads_per_step: 0 } => return Err(RingError::ZeroKvHeadsPerStep),
            _ => None,
        };
        if let Some(s) = cfg.scale {
            if !(s.is_finite() && s > 0.0) {
                return Err(RingError::Scale(s));
            }
        }
        // Before the split, which only the all-to-all schedules make: a rank that split while a peer went on to
        // plan would meet a collective of another size and fail as a bare mismatch, not naming the schedule.
        agree_on_schedule(&comm, cfg.schedule)?;
        let groups = match group {
            Some(u) => {
                let r = comm.rank();
                // Groups of `u` consecutive ranks share an all-to-all; ranks with the same index in their group
                // form a ring, ordered by group.
                let inner = comm.split((r / u) as u32, r as u32)?;
                let outer = comm.split((r % u) as u32, r as u32)?;
                Some(Arc::new((inner, outer)))
            }
            None => None,
        };
        Ok(Self { comm, backend, cfg, groups })
    }

    /// The communicator.
    pub fn comm(&self) -> &Arc<Communicator> {
        &self.comm
    }
    /// The backend the kernels run on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }
    /// The configuration.
    pub fn config(&self) -> &CpConfig {
        &self.cfg
    }

    /// The layout of a sequence of `seq_len` tokens over this communicator.
    pub fn layout(&self, seq_len: usize) -> Result<SeqLayout> {
        SeqLayout::new(self.cfg.partition, self.comm.world_size(), seq_len)
    }

    /// Plans the problem (collective): checks the shape and mask, checks that every rank planned the same
    /// problem (a typed [`RingError::RanksDisagree`] naming the field and the ranks otherwise), computes every
    /// rank's positions and sizes the workspace. The plan's [`CpPlan::forward`] and [`CpPlan::backward`] then
    /// take only the data.
    pub fn plan(&self, shape: &CpShape, mask: &CpMask) -> Result<CpPlan> {
        CpPlan::new(self.clone(), *shape, *mask)
    }

    pub(crate) fn measured_bytes(&self) -> u64 {
        let mut b = self.comm.stats().bytes_sent;
        if let Some(g) = &self.groups {
            b += g.0.stats().bytes_sent + g.1.stats().bytes_sent;
        }
        b
    }
}
