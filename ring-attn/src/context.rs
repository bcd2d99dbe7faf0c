//! The entry point: [`ContextParallel`], its configuration and what a call reports.

use std::sync::Arc;
use std::time::Duration;

use longctx_kernels::{AttnMask, AttnParams, AttnShape, HostSlice, HostSliceMut, Positions};
use longctx_p2p::Communicator;

use crate::error::{check_len, Result, RingError};
use crate::partition::{Partition, SeqLayout};
use crate::{allgather, hybrid, ring};

/// Runs `body` with `q`, `k`, `v` bound to typed slices of their common dtype (checked before).
macro_rules! dispatch_qkv {
    ($q:expr, $k:expr, $v:expr, |$qq:ident, $kk:ident, $vv:ident| $body:expr) => {
        match ($q, $k, $v) {
            (HostSlice::F32($qq), HostSlice::F32($kk), HostSlice::F32($vv)) => $body,
            (HostSlice::Bf16($qq), HostSlice::Bf16($kk), HostSlice::Bf16($vv)) => $body,
            _ => unreachable!("q, k and v dtypes are checked to agree before dispatch"),
        }
    };
}

/// Sizes of the whole problem (all ranks together). Local buffers are `[B, H, S/CP, D]` in the layout of
/// `longctx-kernels`, holding this rank's tokens in the order [`SeqLayout::positions`] gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpShape {
    /// `B`.
    pub batch: usize,
    /// `Hq`.
    pub q_heads: usize,
    /// `Hkv`.
    pub kv_heads: usize,
    /// Total tokens `S` of the sequence.
    pub seq_len: usize,
    /// `D`.
    pub head_dim: usize,
}

impl CpShape {
    /// Tokens per rank.
    pub fn local_len(&self, world: usize) -> usize {
        self.seq_len / world.max(1)
    }
    fn local(&self, world: usize) -> AttnShape {
        let l = self.local_len(world);
        AttnShape {
            batch: self.batch,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            q_len: l,
            kv_len: l,
            head_dim: self.head_dim,
        }
    }
}

/// The mask: causal and/or sliding window over global positions, and document ids of this rank's tokens
/// for packed sequences (they travel with the KV blocks).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpMask<'a> {
    /// Keys after the query are hidden.
    pub causal: bool,
    /// Sliding window in positions.
    pub window: Option<u64>,
    /// Document id of each local token (length `S/CP`).
    pub docs: Option<&'a [u32]>,
}

impl<'a> CpMask<'a> {
    /// Causal, one document.
    pub fn causal() -> Self {
        Self { causal: true, ..Self::default() }
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
pub(crate) struct Local<'a> {
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
        let mut mask =
            AttnMask::full().with_positions(Positions::Explicit(self.my_positions()), Positions::Explicit(k_pos));
        mask.causal = self.causal;
        mask.window = self.window;
        mask.q_doc = self.docs;
        mask.k_doc = k_doc;
        AttnParams { shape: self.shape, mask, scale: self.scale }
    }
}

/// Context-parallel attention over a communicator. Construction is collective (the hybrid and Ulysses
/// schedules split the communicator): every rank must call [`ContextParallel::new`] with the same config.
pub struct ContextParallel<'c> {
    comm: &'c Communicator,
    cfg: CpConfig,
    /// For Ulysses and hybrid: (all-to-all group, ring across groups).
    groups: Option<(Communicator, Communicator)>,
    /// The kernels' thread pool when the caller gives one (ranks sharing a process each get their own).
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl<'c> ContextParallel<'c> {
    /// Checks the configuration against the communicator and sets up sub-communicators.
    pub fn new(comm: &'c Communicator, cfg: CpConfig) -> Result<Self> {
        let n = comm.world_size();
        let group = match cfg.schedule {
            Schedule::Ulysses => Some(n),
            Schedule::Hybrid { group } => {
                if group == 0 || !n.is_multiple_of(group) {
                    return Err(RingError::GroupSize { group, world: n });
                }
                Some(group)
            }
            Schedule::AllGather { kv_heads_per_step: 0 } => {
                return Err(RingError::Config("all-gather needs at least one KV head per step".into()))
            }
            _ => None,
        };
        if let Some(s) = cfg.scale {
            if !(s.is_finite() && s > 0.0) {
                return Err(RingError::Config(format!("softmax scale {s} is not positive and finite")));
            }
        }
        let groups = match group {
            Some(u) => {
                let r = comm.rank();
                // Groups of `u` consecutive ranks share an all-to-all; ranks with the same index in their group
                // form a ring, ordered by group.
                let inner = comm.split((r / u) as u32, r as u32)?;
                let outer = comm.split((r % u) as u32, r as u32)?;
                Some((inner, outer))
            }
            None => None,
        };
        Ok(Self { comm, cfg, groups, pool: None })
    }

    /// Runs the attention kernels on `pool` instead of rayon's global pool.
    pub fn with_pool(mut self, pool: Arc<rayon::ThreadPool>) -> Self {
        self.pool = Some(pool);
        self
    }

    fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }

    /// The layout of a sequence of `seq_len` tokens over this communicator.
    pub fn layout(&self, seq_len: usize) -> Result<SeqLayout> {
        SeqLayout::new(self.cfg.partition, self.comm.world_size(), seq_len)
    }

    fn check(&self, shape: &CpShape, mask: &CpMask<'_>) -> Result<(SeqLayout, AttnShape)> {
        let layout = self.layout(shape.seq_len)?;
        let local = shape.local(self.comm.world_size());
        local.validate()?;
        if let Some((inner, _)) = &self.groups {
            let u = inner.world_size();
            if !shape.q_heads.is_multiple_of(u) {
                return Err(RingError::HeadsNotDivisible { what: "query", heads: shape.q_heads, group: u });
            }
            if !shape.kv_heads.is_multiple_of(u) {
                return Err(RingError::HeadsNotDivisible { what: "key/value", heads: shape.kv_heads, group: u });
            }
        }
        if let Some(d) = mask.docs {
            check_len("docs", d.len(), local.q_len)?;
        }
        if mask.window == Some(0) {
            return Err(RingError::Config("a window of 0 hides every key".into()));
        }
        Ok((layout, local))
    }

    fn scale(&self, shape: &CpShape) -> f32 {
        self.cfg.scale.unwrap_or(1.0 / (shape.head_dim as f32).sqrt())
    }

    fn measured_bytes(&self) -> u64 {
        let mut b = self.comm.stats().bytes_sent;
        if let Some((i, o)) = &self.groups {
            b += i.stats().bytes_sent + o.stats().bytes_sent;
        }
        b
    }

    /// Forward: `o` (`[B, Hq, S/CP, D]`, `f32` or `bf16`) and `lse` (`[B, Hq, S/CP]`) receive this rank's rows
    /// of full attention over the whole sequence. `q`, `k`, `v` are this rank's shards, all of one dtype.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        shape: &CpShape,
        mask: &CpMask<'_>,
        q: HostSlice<'_>,
        k: HostSlice<'_>,
        v: HostSlice<'_>,
        o: HostSliceMut<'_>,
        lse: &mut [f32],
    ) -> Result<StepReport> {
        self.install(|| self.forward_impl(shape, mask, q, k, v, o, lse))
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_impl(
        &self,
        shape: &CpShape,
        mask: &CpMask<'_>,
        q: HostSlice<'_>,
        k: HostSlice<'_>,
        v: HostSlice<'_>,
        mut o: HostSliceMut<'_>,
        lse: &mut [f32],
    ) -> Result<StepReport> {
        let (layout, local) = self.check(shape, mask)?;
        check_len("q", q.len(), local.q_elems())?;
        check_len("k", k.len(), local.kv_elems())?;
        check_len("v", v.len(), local.kv_elems())?;
        check_len("o", o.len(), local.q_elems())?;
        check_len("lse", lse.len(), local.lse_elems())?;
        same_dtype(&[q, k, v])?;
        let n = self.comm.world_size();
        let positions: Vec<Vec<i64>> = (0..n).map(|r| layout.positions(r)).collect();
        let mut rep = StepReport::default();
        let before = self.measured_bytes();
        let mut o_acc = vec![0f32; local.q_elems()];
        let elem = elem_size(&q);
        let doc_len = mask.docs.map_or(0, |d| d.len());
        match self.cfg.schedule {
            Schedule::Ring => {
                let loc = self.local(local, mask, shape, &positions, self.comm.rank(), mask.docs);
                ring::ring_forward(self.comm, &loc, q, k, v, &mut o_acc, lse, &mut rep)?;
                rep.expected_bytes = ring::forward_bytes(n, local.kv_elems(), elem, doc_len);
            }
            Schedule::AllGather { kv_heads_per_step } => {
                let loc = self.local(local, mask, shape, &positions, self.comm.rank(), mask.docs);
                let t = std::time::Instant::now();
                dispatch_qkv!(q, k, v, |q, k, v| allgather::forward(
                    self.comm,
                    &loc,
                    kv_heads_per_step,
                    q,
                    k,
                    v,
                    &mut o_acc,
                    lse
                )?);
                rep.compute += t.elapsed();
                rep.expected_bytes = allgather::bytes(n, local.kv_elems(), elem, doc_len, false);
            }
            Schedule::Ulysses | Schedule::Hybrid { .. } => {
                let (inner, outer) = self.groups.as_ref().expect("groups are set up for these schedules");
                rep.expected_bytes =
                    hybrid::forward_bytes(inner.world_size(), outer.world_size(), &local, elem, doc_len);
                hybrid::forward(inner, outer, &layout, self, shape, mask, local, q, k, v, &mut o_acc, lse, &mut rep)?;
            }
        }
        o.store_f32(0, &o_acc, false);
        rep.bytes_sent = self.measured_bytes() - before;
        Ok(rep)
    }

    /// Backward: from this rank's `d_o`, the forward's `o` and `lse`, computes this rank's `dq`
    /// (`[B, Hq, S/CP, D]`), `dk`, `dv` (`[B, Hkv, S/CP, D]`), overwriting them. Gradients are accumulated in
    /// `f32` and rounded once when stored.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        shape: &CpShape,
        mask: &CpMask<'_>,
        q: HostSlice<'_>,
        k: HostSlice<'_>,
        v: HostSlice<'_>,
        o: HostSlice<'_>,
        d_o: HostSlice<'_>,
        lse: &[f32],
        dq: HostSliceMut<'_>,
        dk: HostSliceMut<'_>,
        dv: HostSliceMut<'_>,
    ) -> Result<StepReport> {
        self.install(|| self.backward_impl(shape, mask, q, k, v, o, d_o, lse, dq, dk, dv))
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_impl(
        &self,
        shape: &CpShape,
        mask: &CpMask<'_>,
        q: HostSlice<'_>,
        k: HostSlice<'_>,
        v: HostSlice<'_>,
        o: HostSlice<'_>,
        d_o: HostSlice<'_>,
        lse: &[f32],
        mut dq: HostSliceMut<'_>,
        mut dk: HostSliceMut<'_>,
        mut dv: HostSliceMut<'_>,
    ) -> Result<StepReport> {
        let (layout, local) = self.check(shape, mask)?;
        for (name, len, want) in [
            ("q", q.len(), local.q_elems()),
            ("k", k.len(), local.kv_elems()),
            ("v", v.len(), local.kv_elems()),
            ("o", o.len(), local.q_elems()),
            ("d_o", d_o.len(), local.q_elems()),
            ("lse", lse.len(), local.lse_elems()),
            ("dq", dq.len(), local.q_elems()),
            ("dk", dk.len(), local.kv_elems()),
            ("dv", dv.len(), local.kv_elems()),
        ] {
            check_len(name, len, want)?;
        }
        same_dtype(&[q, k, v])?;
        let n = self.comm.world_size();
        let positions: Vec<Vec<i64>> = (0..n).map(|r| layout.positions(r)).collect();
        let mut rep = StepReport::default();
        let before = self.measured_bytes();
        let mut dq_acc = vec![0f32; local.q_elems()];
        let mut dk_acc = vec![0f32; local.kv_elems()];
        let mut dv_acc = vec![0f32; local.kv_elems()];
        let elem = elem_size(&q);
        let doc_len = mask.docs.map_or(0, |d| d.len());
        match self.cfg.schedule {
            Schedule::Ring => {
                let loc = self.local(local, mask, shape, &positions, self.comm.rank(), mask.docs);
                ring::ring_backward(
                    self.comm,
                    &loc,
                    q,
                    k,
                    v,
                    o,
                    d_o,
                    lse,
                    &mut dq_acc,
                    &mut dk_acc,
                    &mut dv_acc,
                    &mut rep,
                )?;
                rep.expected_bytes = ring::backward_bytes(n, local.kv_elems(), elem, doc_len);
            }
            Schedule::AllGather { kv_heads_per_step } => {
                let loc = self.local(local, mask, shape, &positions, self.comm.rank(), mask.docs);
                let (of, dof) = (o.to_f32_vec(), d_o.to_f32_vec());
                let t = std::time::Instant::now();
                let grads = (&mut dq_acc[..], &mut dk_acc[..], &mut dv_acc[..]);
                dispatch_qkv!(q, k, v, |q, k, v| allgather::backward(
                    self.comm,
                    &loc,
                    kv_heads_per_step,
                    [q, k, v],
                    &of,
                    &dof,
                    lse,
                    grads
                )?);
                rep.compute += t.elapsed();
                rep.expected_bytes = allgather::bytes(n, local.kv_elems(), elem, doc_len, true);
            }
            Schedule::Ulysses | Schedule::Hybrid { .. } => {
                let (inner, outer) = self.groups.as_ref().expect("groups are set up for these schedules");
                rep.expected_bytes =
                    hybrid::backward_bytes(inner.world_size(), outer.world_size(), &local, elem, doc_len);
                let grads = hybrid::Grads { dq: &mut dq_acc, dk: &mut dk_acc, dv: &mut dv_acc };
                hybrid::backward(
                    inner, outer, &layout, self, shape, mask, local, q, k, v, o, d_o, lse, grads, &mut rep,
                )?;
            }
        }
        dq.store_f32(0, &dq_acc, false);
        dk.store_f32(0, &dk_acc, false);
        dv.store_f32(0, &dv_acc, false);
        rep.bytes_sent = self.measured_bytes() - before;
        Ok(rep)
    }

    pub(crate) fn local<'a>(
        &self,
        shape: AttnShape,
        mask: &CpMask<'_>,
        cp: &CpShape,
        positions: &'a [Vec<i64>],
        me: usize,
        docs: Option<&'a [u32]>,
    ) -> Local<'a> {
        Local { shape, causal: mask.causal, window: mask.window, scale: self.scale(cp), positions, me, docs }
    }
}

fn same_dtype(xs: &[HostSlice<'_>]) -> Result<()> {
    let d = xs[0].dtype();
    if xs.iter().any(|x| x.dtype() != d) {
        return Err(RingError::Config("q, k and v must have the same dtype".into()));
    }
    Ok(())
}

fn elem_size(x: &HostSlice<'_>) -> usize {
    match x {
        HostSlice::F32(_) => 4,
        HostSlice::Bf16(_) => 2,
    }
}
