//! [`CpPlan`]: one context-parallel attention problem, checked, agreed between the ranks and sized once; its
//! forward and backward take only the data.

use longctx_kernels::{AttnGrads, AttnOut, AttnSaved, AttnShape, Buffer, DType, Dims, Memory, Qkv, View};

use crate::agree::agree;
use longctx_p2p::Communicator;

use crate::config::{CpMask, CpShape, Schedule};
use crate::context::ContextParallel;
use crate::error::{Result, RingError};
use crate::local::Local;
use crate::partition::SeqLayout;
use crate::report::StepReport;
use crate::ring::RingBuffers;
use crate::{allgather, hybrid, ring};

/// Bytes a plan needs beyond the caller's views (see [`CpPlan::workspace_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkspaceBytes {
    /// During [`CpPlan::forward`].
    pub forward: usize,
    /// During [`CpPlan::backward`].
    pub backward: usize,
    /// Kept allocated by the plan between calls (its accumulators and the ring's buffers, reused by every
    /// call): one plan serves every layer of a model with this shape, so this is held once, not per layer.
    pub held: usize,
}

impl ContextParallel {
    /// Plans the problem (collective): checks the shape and mask, checks that every rank planned the same
    /// problem (a typed [`RingError::RanksDisagree`] naming the field and the ranks otherwise), computes every
    /// rank's positions and sizes the workspace. The plan's [`CpPlan::forward`] and [`CpPlan::backward`] then
    /// take only the data.
    pub fn plan(&self, shape: &CpShape, mask: &CpMask) -> Result<CpPlan> {
        CpPlan::new(self.clone(), *shape, *mask)
    }
}

/// A planned context-parallel attention problem (see [`ContextParallel::plan`]). It holds a clone of its
/// [`ContextParallel`], every rank's positions, and its `f32` accumulators, reused by every call.
pub struct CpPlan {
    cp: ContextParallel,
    shape: CpShape,
    mask: CpMask,
    layout: SeqLayout,
    /// This rank's block: `q_len == kv_len == L`.
    local: AttnShape,
    scale: f32,
    /// Every rank's global positions (ring and all-gather), indexed by rank.
    positions: Vec<Vec<i64>>,
    /// Hybrid and Ulysses: each ring member's positions (its group's tokens in member order) and the head
    /// shard's block shape.
    groups: Option<(Vec<Vec<i64>>, AttnShape)>,
    docs: Option<Vec<u32>>,
    /// Out of the plan only during a call (whose schedules borrow the plan meanwhile).
    ws: Option<Workspace>,
    /// The calls' reports since [`CpPlan::take_totals`].
    totals: StepReport,
}

/// What a plan keeps between calls, as buffers of its backend: one `f32` accumulator of `Q`'s size (the
/// forward's `O`, then the backward's `dQ`: never needed at once), the `f32` `dK` and `dV`, and the ring's
/// buffers (see [`RingBuffers`]).
#[derive(Debug)]
struct Workspace {
    q_acc: Buffer,
    dk: Buffer,
    dv: Buffer,
    ring: RingBuffers,
}

impl std::fmt::Debug for CpPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpPlan").field("shape", &self.shape).field("mask", &self.mask).field("cp", &self.cp).finish()
    }
}

impl CpPlan {
    pub(crate) fn new(cp: ContextParallel, shape: CpShape, mask: CpMask) -> Result<Self> {
        let layout = cp.layout(shape.seq_len)?;
        let l = layout.local_len();
        let local = AttnShape {
            batch: shape.batch,
            q_heads: shape.q_heads,
            kv_heads: shape.kv_heads,
            q_len: l,
            kv_len: l,
            head_dim: shape.head_dim,
        };
        local.validate()?;
        if mask.window == Some(0) {
            return Err(RingError::ZeroWindow);
        }
        let groups = match &cp.groups {
            Some(g) => {
                let u = g.0.world_size();
                if !shape.q_heads.is_multiple_of(u) {
                    return Err(RingError::HeadsNotDivisibleByGroup { what: "query", heads: shape.q_heads, group: u });
                }
                if !shape.kv_heads.is_multiple_of(u) {
                    return Err(RingError::HeadsNotDivisibleByGroup {
                        what: "key/value",
                        heads: shape.kv_heads,
                        group: u,
                    });
                }
                // Ring member `g` holds its group's tokens in member order.
                let all = layout.all_positions();
                let pos = all.chunks(u).map(|members| members.concat()).collect();
                Some((pos, hybrid::head_shape(local, u)))
            }
            None => None,
        };
        let scale = cp.cfg.scale.unwrap_or(1.0 / (shape.head_dim as f32).sqrt());
        // Every rank must plan the same problem: exchanged before anything is sized, so a disagreement is one
        // typed error on every rank rather than wrong numbers or a timeout.
        agree(&cp.comm, &cp.cfg, &shape, &mask, scale)?;
        let b = &cp.backend;
        let (qd, kd) =
            ([local.batch, local.q_heads, l, local.head_dim], [local.batch, local.kv_heads, l, local.head_dim]);
        let ws = Workspace {
            q_acc: b.zeros(DType::F32, Dims::new(&qd)?)?,
            dk: b.zeros(DType::F32, Dims::new(&kd)?)?,
            dv: b.zeros(DType::F32, Dims::new(&kd)?)?,
            ring: RingBuffers::default(),
        };
        Ok(Self {
            positions: layout.all_positions(),
            ws: Some(ws),
            cp,
            shape,
            mask,
            layout,
            local,
            scale,
            groups,
            docs: None,
            totals: StepReport::default(),
        })
    }

    /// The context-parallel group the plan runs on (its communicator, backend and configuration).
    pub fn context(&self) -> &ContextParallel {
        &self.cp
    }

    /// The problem's shape.
    pub fn shape(&self) -> &CpShape {
        &self.shape
    }
    /// The mask planned.
    pub fn mask(&self) -> &CpMask {
        &self.mask
    }
    /// How the sequence is cut.
    pub fn layout(&self) -> &SeqLayout {
        &self.layout
    }
    /// Tokens on each rank (`L`).
    pub fn local_len(&self) -> usize {
        self.local.q_len
    }
    /// Global positions of this rank's tokens, in the order its views hold them (use them for RoPE and for
    /// the loss targets).
    pub fn positions(&self) -> &[i64] {
        &self.positions[self.cp.comm.rank()]
    }
    /// Dims of this rank's `Q`, `O`, `dQ`, `dO`: `[B, Hq, L, D]`.
    pub fn q_dims(&self) -> [usize; 4] {
        let s = &self.local;
        [s.batch, s.q_heads, s.q_len, s.head_dim]
    }
    /// Dims of this rank's `K`, `V`, `dK`, `dV`: `[B, Hkv, L, D]`.
    pub fn kv_dims(&self) -> [usize; 4] {
        let s = &self.local;
        [s.batch, s.kv_heads, s.kv_len, s.head_dim]
    }
    /// Dims of this rank's `LSE`: `[B, Hq, L]`.
    pub fn lse_dims(&self) -> [usize; 3] {
        let s = &self.local;
        [s.batch, s.q_heads, s.q_len]
    }
    /// Bytes the forward saves for the backward on this rank ([`AttnSaved::bytes_for`] of the local block).
    pub fn saved_bytes(&self) -> usize {
        AttnSaved::bytes_for(&self.local, self.shape.dtype)
    }

    /// Document ids of this rank's tokens for the next calls (packed sequences; length `L`, in the order of
    /// [`CpPlan::positions`]). Only for a plan made with [`CpMask::with_documents`].
    pub fn set_documents(&mut self, ids: &[u32]) -> Result<()> {
        if !self.mask.documents {
            return Err(RingError::Documents("document ids given to a plan made without documents"));
        }
        crate::error::check_len("documents", ids.len(), self.local.q_len)?;
        let d = self.docs.get_or_insert_with(Vec::new);
        d.clear();
        d.extend_from_slice(ids);
        Ok(())
    }

    /// Bytes this rank needs beyond the caller's views during a forward and a backward, and what the plan keeps
    /// between calls. For the ring everything is kept (the `f32` accumulators, the travelling KV blocks — two on the
    /// CPU, three on a device —, the partial result and the travelling dK/dV accumulators), so a steady loop
    /// allocates nothing; all-gather, Ulysses and hybrid allocate their gathered or re-sharded copies per call.
    pub fn workspace_bytes(&self) -> WorkspaceBytes {
        let s = &self.local;
        let (qe, kve, le) = (s.q_elems(), s.kv_elems(), s.lse_elems());
        let elem = self.shape.dtype.size();
        let doc_len = if self.mask.documents { s.q_len } else { 0 };
        let (plan_fwd, plan_bwd) = (qe * 4, (qe + 2 * kve) * 4);
        let block = |kv: usize, docs: usize| (2 * kv * elem).div_ceil(4) * 4 + docs * 4;
        // Travelling KV blocks: three on a device (so the compute queue never drains between steps), two on the CPU.
        let blocks = ring::Pipeline::blocks(self.cp.backend.memory() != Memory::Host);
        let ring_fwd =
            |sh: &AttnShape, docs: usize| blocks * block(sh.kv_elems(), docs) + (sh.q_elems() + sh.lse_elems()) * 4;
        let ring_bwd = |sh: &AttnShape, docs: usize| blocks * block(sh.kv_elems(), docs) + 3 * 2 * sh.kv_elems() * 4;
        // What `RingBuffers` keeps: the blocks, the shared partial (`O` or this step's dK/dV), LSE, two accumulators.
        let ring_held = |sh: &AttnShape, docs: usize| {
            blocks * block(sh.kv_elems(), docs)
                + (sh.q_elems().max(2 * sh.kv_elems()) + sh.lse_elems() + 4 * sh.kv_elems()) * 4
        };
        let plan_held = (qe + 2 * kve) * 4;
        let n = self.cp.comm.world_size();
        let (fwd, bwd, held) = match self.cp.cfg.schedule {
            Schedule::Ring => (ring_fwd(s, doc_len), ring_bwd(s, doc_len), ring_held(s, doc_len)),
            Schedule::AllGather { kv_heads_per_step } => {
                // Per head slice: [K|V] sent, n of them received, split and reordered (two copies of n·[K|V]).
                let hs = kv_heads_per_step.min(s.kv_heads);
                let slice = 2 * hs * s.kv_len * s.head_dim;
                let gather = (slice + 3 * n * slice) * elem + n * doc_len * 4;
                // Backward: f32 dK/dV of the gathered slice, reordered to send, received, and this rank's share.
                let scatter = (3 * n * slice + slice) * 4;
                (gather, gather + scatter + 2 * qe * 4, 0)
            }
            Schedule::Ulysses | Schedule::Hybrid { .. } => {
                let (_, hs) = self.groups.as_ref().expect("planned with groups");
                let u = hs.q_len / s.q_len;
                let heads = (qe + 2 * kve) * elem + u * doc_len * 4;
                let fwd = heads + (hs.q_elems() + hs.lse_elems()) * 4 + ring_fwd(hs, u * doc_len) + (qe + le) * 4;
                let bwd = heads
                    + (2 * qe + le) * 4 * 2
                    + (hs.q_elems() + 2 * hs.kv_elems()) * 4
                    + ring_bwd(hs, u * doc_len)
                    + (qe + 2 * kve) * 4;
                (fwd, bwd, ring_held(hs, u * doc_len))
            }
        };
        WorkspaceBytes { forward: plan_fwd + fwd, backward: plan_bwd + bwd, held: plan_held + held }
    }

    fn docs(&self) -> Result<Option<&[u32]>> {
        match (self.mask.documents, &self.docs) {
            (false, _) => Ok(None),
            (true, Some(d)) => Ok(Some(d)),
            (true, None) => Err(RingError::Documents("a plan made with documents needs set_documents before a call")),
        }
    }

    /// Checks that each view has the dims the plan gives it, naming the first that does not. Every misfit is
    /// then the one [`RingError::NotAsPlanned`] naming the view, with its dims and the plan's: checked here,
    /// before the views are grouped into an [`AttnShape`] (whose checks compare the views with each other, so
    /// a wrong `k` is reported as `v` disagreeing with it, in a kernel error that names no field).
    fn check_dims(&self, views: &[(&'static str, &[usize])]) -> Result<()> {
        let (q, kv, lse) = (self.q_dims(), self.kv_dims(), self.lse_dims());
        for &(name, got) in views {
            let planned: &[usize] = match name {
                "k" | "v" | "dk" | "dv" => &kv,
                "lse" => &lse,
                _ => &q,
            };
            if got != planned {
                let why = format!("dims {got:?}, but the plan has {planned:?}");
                return Err(RingError::NotAsPlanned { name, why });
            }
        }
        Ok(())
    }

    /// Checks a call's dtype against the plan (the dims were checked by [`CpPlan::check_dims`]).
    fn check_dtype(&self, qkv: &Qkv<'_>) -> Result<()> {
        if qkv.q.dtype() != self.shape.dtype {
            return Err(RingError::NotAsPlanned {
                name: "qkv",
                why: format!("dtype {} but the plan has {}", qkv.q.dtype().name(), self.shape.dtype.name()),
            });
        }
        Ok(())
    }

    fn local_problem<'a>(&'a self, docs: Option<&'a [u32]>) -> Local<'a> {
        Local {
            backend: &*self.cp.backend,
            shape: self.local,
            causal: self.mask.causal,
            window: self.mask.window,
            scale: self.scale,
            positions: &self.positions,
            me: self.cp.comm.rank(),
            docs,
        }
    }

    /// Forward: `out.o` (`[B, Hq, L, D]`, the plan's dtype) and `out.lse` (`[B, Hq, L]`, `f32`) receive this
    /// rank's rows of full attention over the whole sequence. A view whose dims are not the plan's
    /// ([`CpPlan::q_dims`], [`CpPlan::kv_dims`], [`CpPlan::lse_dims`]) is [`RingError::NotAsPlanned`] naming it.
    pub fn forward(&mut self, out: AttnOut<'_>, qkv: Qkv<'_>) -> Result<StepReport> {
        let (o, l) = (out.o.dims(), out.lse.dims());
        self.check_dims(&[("q", qkv.q.dims()), ("k", qkv.k.dims()), ("v", qkv.v.dims()), ("o", o), ("lse", l)])?;
        // What is left to the kernels' checks: element types and memory.
        qkv.shape()?;
        self.check_dtype(&qkv)?;
        out.check(&self.local)?;
        check_f32("lse", out.lse.dtype())?;
        let AttnOut { o, lse } = out;
        let mut ws = self.ws.take().expect("a call puts the workspace back");
        let Workspace { q_acc, ring, .. } = &mut ws;
        let r = self.forward_into(qkv, AttnOut { o: q_acc.view_mut(), lse }, ring);
        let stored = r.and_then(|rep| {
            self.cp.backend.copy(o, q_acc.view())?;
            Ok(rep)
        });
        self.ws = Some(ws);
        stored.inspect(|rep| self.totals.add(rep))
    }

    /// The reports of every [`forward`](Self::forward) and [`backward`](Self::backward) since the last call (or
    /// since the plan was made), added up, and starts counting again: a trainer's attention time and exposed
    /// communication per step. On a GPU it also resolves [`StepReport::device_idle`], which waits for the device
    /// to reach the end of the last call's ring: call it after the step's work has been waited for.
    pub fn take_totals(&mut self) -> StepReport {
        let mut totals = std::mem::take(&mut self.totals);
        totals.device_idle = self.ws.as_mut().and_then(|ws| ws.ring.take_idle());
        totals
    }

    fn forward_into(&self, qkv: Qkv<'_>, out: AttnOut<'_>, bufs: &mut RingBuffers) -> Result<StepReport> {
        let docs = self.docs()?;
        let (kve, elem, doc_len) = (self.local.kv_elems(), self.shape.dtype.size(), docs.map_or(0, |d| d.len()));
        self.measured(|rep| match self.exchange(docs) {
            Exchange::Ring { comm, loc } => {
                ring::ring_forward(comm, &loc, qkv, out, bufs, rep)?;
                rep.expected_bytes = ring::forward_bytes(comm.world_size(), kve, elem, doc_len);
                Ok(())
            }
            Exchange::AllGather { comm, loc, slice } => {
                let t = std::time::Instant::now();
                allgather::forward(comm, &loc, slice, qkv, out)?;
                rep.compute += t.elapsed();
                rep.expected_bytes = allgather::expected_bytes(comm.world_size(), kve, elem, doc_len, false);
                Ok(())
            }
            Exchange::Groups { inner, outer, ring } => {
                let (u, m) = (inner.world_size(), outer.world_size());
                rep.expected_bytes = hybrid::forward_bytes(u, m, &self.local, elem, doc_len);
                hybrid::forward(inner, outer, &ring, self.local, qkv, out, bufs, rep)
            }
        })
    }

    /// The schedule's communicators and this rank's problem on them, for one call.
    fn exchange<'a>(&'a self, docs: Option<&'a [u32]>) -> Exchange<'a> {
        let loc = self.local_problem(docs);
        match self.cp.cfg.schedule {
            Schedule::Ring => Exchange::Ring { comm: &self.cp.comm, loc },
            Schedule::AllGather { kv_heads_per_step } => {
                Exchange::AllGather { comm: &self.cp.comm, loc, slice: kv_heads_per_step }
            }
            Schedule::Ulysses | Schedule::Hybrid { .. } => {
                let g = self.cp.groups.as_ref().expect("ContextParallel::new splits the groups for these schedules");
                let (pos, hs) = self.groups.as_ref().expect("planned with the groups");
                let ring = Local { positions: pos, me: g.1.rank(), shape: *hs, ..loc };
                Exchange::Groups { inner: &g.0, outer: &g.1, ring }
            }
        }
    }

    /// Runs `call` and reports the bytes the communicators measured it send.
    fn measured(&self, call: impl FnOnce(&mut StepReport) -> Result<()>) -> Result<StepReport> {
        let mut rep = StepReport::default();
        let before = self.cp.measured_bytes();
        call(&mut rep)?;
        rep.bytes_sent = self.cp.measured_bytes() - before;
        Ok(rep)
    }

    /// Backward: from `dout` and what the forward saved, `grads.dq` (`[B, Hq, L, D]`), `grads.dk` and
    /// `grads.dv` (`[B, Hkv, L, D]`) receive this rank's gradients (overwritten; accumulated in `f32` and
    /// rounded once when stored). A view whose dims are not the plan's is [`RingError::NotAsPlanned`] naming
    /// it, as in the forward.
    pub fn backward(&mut self, grads: AttnGrads<'_>, dout: View<'_>, saved: AttnSaved<'_>) -> Result<StepReport> {
        let qkv = saved.qkv;
        self.check_dims(&[
            ("dq", grads.dq.dims()),
            ("dk", grads.dk.dims()),
            ("dv", grads.dv.dims()),
            ("dout", dout.dims()),
            ("q", qkv.q.dims()),
            ("k", qkv.k.dims()),
            ("v", qkv.v.dims()),
            ("o", saved.o.dims()),
            ("lse", saved.lse.dims()),
        ])?;
        // What is left to the kernels' checks: element types and memory.
        saved.shape()?;
        self.check_dtype(&qkv)?;
        check_f32("lse", saved.lse.dtype())?;
        let mut ws = self.ws.take().expect("a call puts the workspace back");
        let Workspace { q_acc: dq, dk, dv, ring } = &mut ws;
        let into = AttnGrads { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut() };
        let r = self.backward_into(saved, dout, into, ring);
        let stored = r.and_then(|rep| {
            let b = &self.cp.backend;
            b.copy(grads.dq, dq.view())?;
            b.copy(grads.dk, dk.view())?;
            b.copy(grads.dv, dv.view())?;
            Ok(rep)
        });
        self.ws = Some(ws);
        stored.inspect(|rep| self.totals.add(rep))
    }

    fn backward_into(
        &self,
        saved: AttnSaved<'_>,
        d_o: View<'_>,
        grads: AttnGrads<'_>,
        bufs: &mut RingBuffers,
    ) -> Result<StepReport> {
        let docs = self.docs()?;
        let (kve, elem, doc_len) = (self.local.kv_elems(), self.shape.dtype.size(), docs.map_or(0, |d| d.len()));
        let o_do = [saved.o.dtype().size(), d_o.dtype().size()];
        self.measured(|rep| match self.exchange(docs) {
            Exchange::Ring { comm, loc } => {
                ring::ring_backward(comm, &loc, saved, d_o, grads, bufs, rep)?;
                rep.expected_bytes = ring::backward_bytes(comm.world_size(), kve, elem, doc_len);
                Ok(())
            }
            Exchange::AllGather { comm, loc, slice } => {
                let t = std::time::Instant::now();
                allgather::backward(comm, &loc, slice, saved, d_o, grads)?;
                rep.compute += t.elapsed();
                rep.expected_bytes = allgather::expected_bytes(comm.world_size(), kve, elem, doc_len, true);
                Ok(())
            }
            Exchange::Groups { inner, outer, ring } => {
                let (u, m) = (inner.world_size(), outer.world_size());
                rep.expected_bytes = hybrid::backward_bytes(u, m, &self.local, elem, o_do, doc_len);
                hybrid::backward(inner, outer, &ring, self.local, saved, d_o, grads, bufs, rep)
            }
        })
    }
}

/// How one call exchanges: over the whole communicator (ring, all-gather), or all-to-all inside groups and a
/// ring across them (Ulysses, hybrid), whose ring member's problem is the head shard over its group's tokens.
enum Exchange<'a> {
    Ring { comm: &'a Communicator, loc: Local<'a> },
    AllGather { comm: &'a Communicator, loc: Local<'a>, slice: usize },
    Groups { inner: &'a Communicator, outer: &'a Communicator, ring: Local<'a> },
}

/// `LSE` is `f32` whatever the plan's dtype.
fn check_f32(name: &'static str, dtype: DType) -> Result<()> {
    if dtype == DType::F32 {
        Ok(())
    } else {
        Err(RingError::NotAsPlanned { name, why: format!("dtype {} but LSE is always f32", dtype.name()) })
    }
}
