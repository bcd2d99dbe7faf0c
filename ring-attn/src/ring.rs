//! The ring schedule: `CP − 1` steps; at each, the next KV block is already in flight to us while the block in
//! hand is computed, and the partial result is merged with the kernels' LSE merge.
//!
//! Forward, on rank `r` of `n`: step `s` holds the KV block of rank `(r − s) mod n`. Before computing on it,
//! the block is posted to `r + 1` and the next one is posted for receipt from `r − 1` (double buffer; triple on a
//! device, see Ordering), so the transfer overlaps the compute. Blocks the mask hides entirely are skipped; the
//! kernel skips the hidden tiles of the others (with zigzag, an off-diagonal step touches only half of Q or half
//! of KV).
//!
//! Backward: KV goes round again, and beside it travels an `f32` accumulator of `dK`, `dV` for that block;
//! each rank adds its queries' contribution and passes it on. After `n` hops the accumulator is back at its
//! owner, complete. The KV transfer of step `s + 1` overlaps the compute of step `s`; the accumulator's
//! transfer overlaps the compute of the next step.
//!
//! Ordering: the transfers' copies run on a queue of their own (the backend's
//! [`fork`](longctx_kernels::Backend::fork), kept by the plan, wrapped in the communicator's copier). The
//! communicator wants a device buffer idle from the post of its transfer until it finishes (see
//! `longctx_p2p::memory`): the work that wrote a send's bytes has run, and no work enqueued before the post still
//! reads or writes a receive's buffer. A block in hand was written by a receive (in place once it finished), so
//! only the rank's own block at the first step needs the compute queue drained; what a receive overwrites is the
//! block an earlier step computed on. With two blocks that is the previous step's, whose attention may still be
//! running: the host would have to wait for it, and the device would sit idle from its end until the host had
//! posted the transfers and enqueued the next attention (a launch gap, plus the copy itself when this rank's post
//! is the one that makes it). On a device the ring therefore keeps three blocks ([`Pipeline`]): step `s` receives
//! into the block of step `s − 2`, waiting only for the event recorded after that step's attention, which the
//! device passed as soon as it started step `s − 1`'s; so the compute queue never drains between steps. The
//! backward's accumulator is different: the one a step passes on holds the previous step's contribution, so its
//! transfer is posted after this step's attention is enqueued, once the event after the previous step's sum has
//! passed (the device is busy with this step meanwhile). A finished receive's bytes are in place for any queue
//! (each copier call is finished when it returns). On the CPU every event is complete when recorded, two blocks
//! suffice and the order is the program's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use longctx_kernels::{
    AttnGrads, AttnOut, AttnPartial, AttnSaved, Backend, DType, Event, GradMode, Memory, Qkv, View, ViewMut,
};
use longctx_p2p::{BytesRequest, Communicator, Scope};

use crate::block::{KvBlock, Scratch};
use crate::error::Result;
use crate::local::{kv_dims, lse_dims, q_dims, Local};
use crate::report::StepReport;
use crate::transfer::{bytes, bytes_mut, BackendCopy};

/// Message tags: K, V and the document ids of a travelling block, and the dK/dV accumulator.
const TAG_K: u32 = 0x4b56;
const TAG_V: u32 = 0x4b57;
const TAG_DOCS: u32 = 0x4b58;
const TAG_DKV: u32 = 0x644b;

/// The ring's buffers, kept by the plan between calls so a steady loop allocates nothing: the block in hand, the
/// one arriving and, on a device, the one the step before computed on (`spare`, see [`Pipeline`]), the travelling `f32` dK/dV accumulators (the one passed on, the one arriving) and `part`,
/// which is the forward's partial `O` and the backward's own dK/dV contribution: the two phases never overlap,
/// so one buffer serves both and the plan holds no more than a call needs at its peak. All are backend buffers,
/// sized when a call first needs them. `xfer` is the transfers' queue (see the module docs), forked on first use.
#[derive(Debug)]
pub(crate) struct RingBuffers {
    xfer: Option<Arc<dyn Backend>>,
    cur: KvBlock,
    nxt: KvBlock,
    spare: KvBlock,
    part: Scratch,
    lse_part: Scratch,
    acc_out: Scratch,
    acc_in: Scratch,
    /// On a device: the compute queue's idle spans in the calls since [`RingBuffers::take_idle`] (each from the
    /// end of one piece of the ring's work to the start of the next, as timed events), see [`Pipeline`].
    idle: Vec<(Event, Event)>,
    /// What the spans resolved early (to bound `idle`) added up to: `None` once one carried no time.
    idle_resolved: Option<Duration>,
}

/// Idle spans kept unresolved at most; past it the oldest half is resolved (their events are long complete).
const MAX_IDLE_SPANS: usize = 4096;

/// The device time the spans add up to: `None` if one carries no time (the emulator) or cannot be timed.
fn idle_time(spans: impl Iterator<Item = (Event, Event)>) -> Option<Duration> {
    let mut sum = Duration::ZERO;
    for (from, until) in spans {
        sum += until.elapsed_since(&from).ok().flatten()?;
    }
    Some(sum)
}

impl Default for RingBuffers {
    fn default() -> Self {
        Self {
            xfer: None,
            cur: KvBlock::default(),
            nxt: KvBlock::default(),
            spare: KvBlock::default(),
            part: Scratch::default(),
            lse_part: Scratch::default(),
            acc_out: Scratch::default(),
            acc_in: Scratch::default(),
            idle: Vec::new(),
            idle_resolved: Some(Duration::ZERO),
        }
    }
}

impl RingBuffers {
    /// The compute queue's idle time in the ring calls since the last take, on the device's clock (waits for the
    /// last span's end: call it after a step's work has been waited for anyway), and starts again. `None` off a
    /// device, or where the device's events carry no time (the emulator).
    pub(crate) fn take_idle(&mut self) -> Option<Duration> {
        let spans = std::mem::take(&mut self.idle);
        let early = self.idle_resolved.replace(Duration::ZERO);
        if spans.is_empty() && early == Some(Duration::ZERO) {
            return None;
        }
        Some(early? + idle_time(spans.into_iter())?)
    }

    /// Keeps the unresolved spans bounded for a caller that never takes them.
    fn bound_idle(&mut self) {
        if self.idle.len() > MAX_IDLE_SPANS {
            let old: Vec<_> = self.idle.drain(..MAX_IDLE_SPANS / 2).collect();
            self.idle_resolved = self.idle_resolved.and_then(|d| Some(d + idle_time(old.into_iter())?));
        }
    }
}

/// How the steps of one call order their buffers against the compute queue (see the module docs): on a device,
/// three KV blocks in rotation and the event after each step's attention (and, backward, after each step's
/// accumulator), so that a step waits for the step before last rather than draining the queue; on the CPU, two
/// blocks and nothing to wait for.
///
/// It also measures what overlap is for, on the device's clock: the compute queue's idle time in the ring (the
/// communication it exposes, per rank). A timed event is recorded at the start of the call and after each piece
/// of work, and another just before the next piece is enqueued; the device time between the two is how long the
/// queue ran dry waiting for the host (posting, or waiting for transfers). When the host is ahead, the second is
/// enqueued before the device reaches the first and the span is nothing.
pub(crate) struct Pipeline {
    on_device: bool,
    /// Indexed by step modulo 3: complete once that step's attention has read its block.
    read: [Event; 3],
    /// On a device: the timed event after the last work enqueued.
    idle_from: Option<Event>,
}

impl Pipeline {
    fn new(b: &dyn Backend) -> Result<Self> {
        let on_device = b.memory() != Memory::Host;
        let idle_from = if on_device { Some(b.record_timed_event()?) } else { None };
        Ok(Self { on_device, read: Default::default(), idle_from })
    }

    /// Before enqueueing work: closes the idle span that began after the last work (a no-op off a device).
    fn work_starts(&mut self, b: &dyn Backend, idle: &mut Vec<(Event, Event)>) -> Result<()> {
        if let Some(from) = self.idle_from.take() {
            idle.push((from, b.record_timed_event()?));
        }
        Ok(())
    }

    /// After enqueueing work: an idle span may begin (a no-op off a device).
    fn work_ends(&mut self, b: &dyn Backend) -> Result<()> {
        if self.on_device {
            self.idle_from = Some(b.record_timed_event()?);
        }
        Ok(())
    }

    /// Makes the buffers about to be posted at `step` idle: at the first step (the rank's own block, written by
    /// earlier work, and buffers of an earlier call) and on the CPU the whole queue; else the attention that last
    /// read the block about to be received into, that of step `step − 2`.
    fn before_post(&self, b: &dyn Backend, step: usize) -> Result<()> {
        if step == 0 || !self.on_device {
            b.synchronize()?;
        } else if step >= 2 {
            self.read[(step - 2) % 3].synchronize()?;
        }
        Ok(())
    }

    /// Records that step `step`'s attention has been enqueued (a no-op off a device).
    fn after_attention(&mut self, b: &dyn Backend, step: usize) -> Result<()> {
        if self.on_device {
            self.read[step % 3] = b.record_event()?;
        }
        Ok(())
    }

    /// After a step: the block received becomes the one in hand; on a device the one just computed on waits as
    /// the spare, and the spare becomes the next to receive into.
    fn rotate(&self, cur: &mut KvBlock, nxt: &mut KvBlock, spare: &mut KvBlock) {
        std::mem::swap(cur, nxt);
        if self.on_device {
            // (cur, nxt, spare) = (nxt, spare, cur)
            std::mem::swap(nxt, spare);
        }
    }

    /// The KV blocks a call keeps: three on a device, two on the CPU.
    pub(crate) fn blocks(on_device: bool) -> usize {
        if on_device {
            3
        } else {
            2
        }
    }
}

/// Posts the sends of a block (`k`, `v` and its document ids) to `to` and the receives of the next one into
/// `nxt` from `from`.
fn post_block<'s>(
    sc: &'s Scope<'s, '_>,
    (to, from): (usize, usize),
    (k, v, docs): (View<'s>, View<'s>, Option<&'s [u32]>),
    nxt: &'s mut KvBlock,
    kd: &[usize],
    copy: &'s BackendCopy<'_>,
) -> Result<Vec<BytesRequest<'s>>> {
    let mut reqs = Vec::with_capacity(6);
    reqs.push(sc.isend_bytes(to, TAG_K, bytes(k, copy))?);
    reqs.push(sc.isend_bytes(to, TAG_V, bytes(v, copy))?);
    let KvBlock { kv, docs: nxt_docs } = nxt;
    let (nk, nv) = kv.halves_mut(kd)?;
    reqs.push(sc.irecv_bytes(from, TAG_K, bytes_mut(nk, copy))?);
    reqs.push(sc.irecv_bytes(from, TAG_V, bytes_mut(nv, copy))?);
    if let Some(d) = docs {
        reqs.push(sc.isend_bytes(to, TAG_DOCS, longctx_p2p::Bytes::Host(bytemuck::cast_slice(d)))?);
        let nd: &mut [u8] = bytemuck::cast_slice_mut(&mut nxt_docs[..]);
        reqs.push(sc.irecv_bytes(from, TAG_DOCS, longctx_p2p::BytesMut::Host(nd))?);
    }
    Ok(reqs)
}

/// Posts the send of the travelling dK/dV accumulator to `to` and the receive of the next one from `from`.
fn post_acc<'s>(
    sc: &'s Scope<'s, '_>,
    (to, from): (usize, usize),
    (send, recv): (View<'s>, ViewMut<'s>),
    copy: &'s BackendCopy<'_>,
) -> Result<[BytesRequest<'s>; 2]> {
    Ok([sc.isend_bytes(to, TAG_DKV, bytes(send, copy))?, sc.irecv_bytes(from, TAG_DKV, bytes_mut(recv, copy))?])
}

/// The block in hand at `step`: this rank's own K, V and document ids at the first step, read where the caller
/// keeps them, then the block received.
#[allow(clippy::type_complexity)]
fn in_hand<'a>(
    step: usize,
    qkv: &Qkv<'a>,
    docs: Option<&'a [u32]>,
    cur: &'a KvBlock,
    kd: &[usize],
) -> Result<(View<'a>, View<'a>, Option<&'a [u32]>)> {
    if step == 0 {
        return Ok((qkv.k, qkv.v, docs));
    }
    let (k, v) = cur.kv.halves(kd)?;
    Ok((k, v, docs.map(|_| &cur.docs[..])))
}

/// The transfers' queue: forked from `compute` once and kept.
fn transfer_queue(kept: &mut Option<Arc<dyn Backend>>, compute: &dyn Backend) -> Result<Arc<dyn Backend>> {
    if let Some(q) = kept {
        return Ok(q.clone());
    }
    let q = compute.fork()?;
    *kept = Some(q.clone());
    Ok(q)
}

/// Finishes every request, returning the first error (the others are still finished).
fn wait_all(reqs: Vec<BytesRequest<'_>>) -> Result<()> {
    let mut first = Ok(());
    for r in reqs {
        let done = r.wait();
        if first.is_ok() {
            first = done;
        }
    }
    Ok(first?)
}

/// Ring forward: `out.o` (`f32`, `[B, Hq, L, D]`) and `out.lse` receive this rank's rows of full attention.
pub(crate) fn ring_forward(
    comm: &Communicator,
    pb: &Local<'_>,
    qkv: Qkv<'_>,
    out: AttnOut<'_>,
    bufs: &mut RingBuffers,
    rep: &mut StepReport,
) -> Result<()> {
    let (n, r) = (comm.world_size(), comm.rank());
    if n == 1 {
        return single_forward(pb, qkv, out, rep);
    }
    let (b, s) = (pb.backend, pb.shape);
    let (qd, kd, ld) = (q_dims(&s), kv_dims(&s), lse_dims(&s));
    let doc_len = pb.docs.map_or(0, |d| d.len());
    bufs.bound_idle();
    let RingBuffers { xfer, cur, nxt, spare, part: o_part, lse_part, idle, .. } = bufs;
    let mut pipe = Pipeline::new(b)?;
    for blk in [&mut *cur, &mut *nxt, &mut *spare].into_iter().take(Pipeline::blocks(pipe.on_device)) {
        blk.ensure(b, qkv.k.dtype(), s.kv_elems(), doc_len)?;
    }
    o_part.ensure(b, DType::F32, s.q_elems())?;
    lse_part.ensure(b, DType::F32, s.lse_elems())?;
    let xfer = transfer_queue(xfer, b)?;
    let copy = BackendCopy(&*xfer);
    let AttnOut { mut o, mut lse } = out;
    let mut have = false;
    for step in 0..n {
        let src = (r + n - step) % n;
        // One scope per step: the transfers borrow the blocks until they finish, which the scope ensures before
        // the swap.
        comm.scope(|sc| -> Result<()> {
            let (k, v, k_doc) = in_hand(step, &qkv, pb.docs, cur, &kd)?;
            // Post the next block's transfer before computing on this one.
            let t = Instant::now();
            let reqs = if step + 1 < n {
                pipe.before_post(b, step)?;
                post_block(sc, ((r + 1) % n, (r + n - 1) % n), (k, v, k_doc), &mut *nxt, &kd, &copy)?
            } else {
                Vec::new()
            };
            rep.comm_wait += t.elapsed();
            let t = Instant::now();
            let p = pb.params(&pb.positions[src], k_doc);
            if p.mask.may_see_any(s.q_len, s.kv_len) {
                // The first visible block writes the result directly; later ones a partial, merged in.
                let qkv = Qkv::new(qkv.q, k, v);
                pipe.work_starts(b, idle)?;
                if have {
                    let part = AttnOut { o: o_part.view_mut(&qd)?, lse: lse_part.view_mut(&ld)? };
                    pb.attn_forward(&p, qkv, part)?;
                    pipe.after_attention(b, step)?;
                    let part = AttnPartial { o: o_part.view(&qd)?, lse: lse_part.view(&ld)? };
                    pb.merge(AttnOut { o: o.reborrow(), lse: lse.reborrow() }, part)?;
                } else {
                    pb.attn_forward(&p, qkv, AttnOut { o: o.reborrow(), lse: lse.reborrow() })?;
                    pipe.after_attention(b, step)?;
                }
                pipe.work_ends(b)?;
                have = true;
                rep.blocks_computed += 1;
            } else {
                rep.blocks_skipped += 1;
            }
            rep.compute += t.elapsed();
            let t = Instant::now();
            wait_all(reqs)?;
            rep.comm_wait += t.elapsed();
            Ok(())
        })?;
        if step + 1 < n {
            pipe.rotate(cur, nxt, spare);
        }
    }
    if !have {
        pipe.work_starts(b, idle)?;
        b.fill(o, 0.0)?;
        b.fill(lse, f32::NEG_INFINITY)?;
    }
    Ok(())
}

/// Ring backward: `grads.dq` (`[B, Hq, L, D]`), `grads.dk`, `grads.dv` (`[B, Hkv, L, D]`), all `f32`, receive
/// this rank's gradients (overwritten).
///
/// Each step posts the next block's transfer and the accumulator of the block computed at the step before
/// (with this rank's contribution added), computes this rank's contribution to the block in hand, and waits:
/// both transfers overlap the compute. After the last step the accumulator goes once more, and the one that
/// arrives is this rank's own block's, complete.
pub(crate) fn ring_backward(
    comm: &Communicator,
    pb: &Local<'_>,
    saved: AttnSaved<'_>,
    d_o: View<'_>,
    grads: AttnGrads<'_>,
    bufs: &mut RingBuffers,
    rep: &mut StepReport,
) -> Result<()> {
    let (n, r) = (comm.world_size(), comm.rank());
    if n == 1 {
        return single_backward(pb, saved, d_o, grads, rep);
    }
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let (b, s) = (pb.backend, pb.shape);
    let kd = kv_dims(&s);
    let acc_dims = [2, s.batch * s.kv_heads, s.kv_len, s.head_dim];
    let doc_len = pb.docs.map_or(0, |d| d.len());
    let qkv = saved.qkv;
    bufs.bound_idle();
    let RingBuffers { xfer, cur, nxt, spare, part: local, acc_out, acc_in, idle, .. } = bufs;
    let mut pipe = Pipeline::new(b)?;
    for blk in [&mut *cur, &mut *nxt, &mut *spare].into_iter().take(Pipeline::blocks(pipe.on_device)) {
        blk.ensure(b, qkv.k.dtype(), s.kv_elems(), doc_len)?;
    }
    for acc in [&mut *local, &mut *acc_out, &mut *acc_in] {
        acc.ensure(b, DType::F32, 2 * s.kv_elems())?;
    }
    // On a device: complete once the accumulator to pass on at the next step is written (the sum ending a step).
    let mut summed = Event::complete();
    let xfer = transfer_queue(xfer, b)?;
    let copy = BackendCopy(&*xfer);
    let AttnGrads { mut dq, dk, dv } = grads;
    pipe.work_starts(b, idle)?;
    b.fill(dq.reborrow(), 0.0)?;
    pipe.work_ends(b)?;
    for step in 0..n {
        let src = (r + n - step) % n;
        comm.scope(|sc| -> Result<()> {
            let (k, v, k_doc) = in_hand(step, &qkv, pb.docs, cur, &kd)?;
            let t = Instant::now();
            pipe.before_post(b, step)?;
            let mut reqs = if step + 1 < n {
                post_block(sc, (next, prev), (k, v, k_doc), &mut *nxt, &kd, &copy)?
            } else {
                Vec::new()
            };
            // The accumulator passed on holds the step before's contribution. On the CPU it is written (and the
            // transfer overlaps this step's compute only if posted now); on a device it is posted after this
            // step's attention is enqueued, once its sum has run (while the attention runs).
            let mut acc = if step > 0 { Some((acc_out.view(&acc_dims)?, acc_in.view_mut(&acc_dims)?)) } else { None };
            if !pipe.on_device {
                if let Some(a) = acc.take() {
                    reqs.extend(post_acc(sc, (next, prev), a, &copy)?);
                }
            }
            rep.comm_wait += t.elapsed();

            // This rank's contribution to the block in hand, while the transfers run.
            let t = Instant::now();
            let p = pb.params(&pb.positions[src], k_doc);
            pipe.work_starts(b, idle)?;
            b.fill(local.view_mut(&acc_dims)?, 0.0)?;
            if p.mask.may_see_any(s.q_len, s.kv_len) {
                let (dk_loc, dv_loc) = local.halves_mut(&kd)?;
                let block = AttnSaved { qkv: Qkv::new(qkv.q, k, v), ..saved };
                let into = AttnGrads { dq: dq.reborrow(), dk: dk_loc, dv: dv_loc };
                pb.attn_backward(&p, block, d_o, into, GradMode::Accumulate)?;
                pipe.after_attention(b, step)?;
                rep.blocks_computed += 1;
            } else {
                rep.blocks_skipped += 1;
            }
            pipe.work_ends(b)?;
            rep.compute += t.elapsed();
            let t = Instant::now();
            if let Some(a) = acc.take() {
                summed.synchronize()?;
                reqs.extend(post_acc(sc, (next, prev), a, &copy)?);
            }
            wait_all(reqs)?;
            rep.comm_wait += t.elapsed();
            Ok(())
        })?;
        // The block's accumulator as it goes on at the next step: ours alone at the first step (the block is this
        // rank's own), else the one that arrived plus ours.
        if step == 0 {
            std::mem::swap(local, acc_out);
        } else {
            pipe.work_starts(b, idle)?;
            b.add(acc_in.view_mut(&acc_dims)?, local.view(&acc_dims)?)?;
            pipe.work_ends(b)?;
            std::mem::swap(acc_in, acc_out);
        }
        if pipe.on_device {
            summed = b.record_event()?;
        }
        if step + 1 < n {
            pipe.rotate(cur, nxt, spare);
        }
    }
    // The last hop: the accumulator arriving is this rank's own block's, complete.
    let t = Instant::now();
    b.synchronize()?;
    comm.scope(|sc| -> Result<()> {
        let hop = post_acc(sc, (next, prev), (acc_out.view(&acc_dims)?, acc_in.view_mut(&acc_dims)?), &copy)?;
        wait_all(hop.into())
    })?;
    rep.comm_wait += t.elapsed();
    let (dk_all, dv_all) = acc_in.halves(&kd)?;
    pipe.work_starts(b, idle)?;
    b.copy(dk, dk_all)?;
    b.copy(dv, dv_all)?;
    Ok(())
}

/// [`ring_forward`] on one rank: its own block, read where it lies (nothing travels).
fn single_forward(pb: &Local<'_>, qkv: Qkv<'_>, out: AttnOut<'_>, rep: &mut StepReport) -> Result<()> {
    let t = Instant::now();
    let p = pb.params(pb.my_positions(), pb.docs);
    if p.mask.may_see_any(pb.shape.q_len, pb.shape.kv_len) {
        pb.attn_forward(&p, qkv, out)?;
        rep.blocks_computed += 1;
    } else {
        pb.backend.fill(out.o, 0.0)?;
        pb.backend.fill(out.lse, f32::NEG_INFINITY)?;
        rep.blocks_skipped += 1;
    }
    rep.compute += t.elapsed();
    Ok(())
}

/// [`ring_backward`] on one rank: the gradients written whole by the kernel, with no accumulator to clear,
/// pass on or copy out.
fn single_backward(
    pb: &Local<'_>,
    saved: AttnSaved<'_>,
    d_o: View<'_>,
    grads: AttnGrads<'_>,
    rep: &mut StepReport,
) -> Result<()> {
    let t = Instant::now();
    let p = pb.params(pb.my_positions(), pb.docs);
    if p.mask.may_see_any(pb.shape.q_len, pb.shape.kv_len) {
        pb.attn_backward(&p, saved, d_o, grads, GradMode::Overwrite)?;
        rep.blocks_computed += 1;
    } else {
        for g in [grads.dq, grads.dk, grads.dv] {
            pb.backend.fill(g, 0.0)?;
        }
        rep.blocks_skipped += 1;
    }
    rep.compute += t.elapsed();
    Ok(())
}

/// 32-bit words of one travelling block: K and V of `kv_elems` elements of `elem` bytes, and `doc_len` ids.
fn block_words(kv_elems: usize, elem: usize, doc_len: usize) -> usize {
    (2 * kv_elems * elem).div_ceil(4) + doc_len
}

/// Bytes one rank sends in a ring forward over `n` ranks.
pub(crate) fn forward_bytes(n: usize, kv_elems: usize, elem: usize, doc_len: usize) -> u64 {
    (n.saturating_sub(1) * block_words(kv_elems, elem, doc_len) * 4) as u64
}

/// Bytes one rank sends in a ring backward: the blocks again, plus the `f32` dK/dV accumulator for `n` hops.
pub(crate) fn backward_bytes(n: usize, kv_elems: usize, elem: usize, doc_len: usize) -> u64 {
    if n == 1 {
        0
    } else {
        ((n - 1) * block_words(kv_elems, elem, doc_len) * 4 + n * 2 * kv_elems * 4) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rotation on a device: at every step the block received into is neither the one in hand nor the one
    /// the step before computed on (its attention may still run), but the one of two steps before, whose event
    /// `before_post` waits for; on the CPU (two blocks) it is the previous step's, whose work has run.
    #[test]
    fn a_receive_never_overwrites_a_block_the_device_may_still_read() {
        for on_device in [true, false] {
            let pipe = Pipeline { on_device, read: Default::default(), idle_from: None };
            let mut blocks: [KvBlock; 3] = Default::default();
            for (i, b) in blocks.iter_mut().enumerate() {
                b.docs = vec![i as u32];
            }
            let [mut cur, mut nxt, mut spare] = blocks;
            let mut in_hand = Vec::new();
            for step in 0..12 {
                let into = nxt.docs[0];
                // Step 0's block in hand is the caller's own; the buffer `cur` is idle then.
                in_hand.push(if step == 0 { None } else { Some(cur.docs[0]) });
                assert_ne!(Some(into), in_hand[step], "step {step}: receives into the block in hand");
                if on_device && step >= 1 {
                    assert_ne!(Some(into), in_hand[step - 1], "step {step}: receives into the previous step's block");
                }
                if on_device && step >= 3 {
                    assert_eq!(Some(into), in_hand[step - 2], "step {step}: not the block whose event is waited for");
                }
                pipe.rotate(&mut cur, &mut nxt, &mut spare);
                assert_eq!(cur.docs[0], into, "step {step}: the block received is in hand next");
            }
            if !on_device {
                assert_eq!(spare.docs[0], 2, "the CPU's rotation leaves the third block alone");
            }
        }
    }
}
