//! The ring schedule: `CP − 1` steps; at each, the next KV block is already in flight to us while the block in
//! hand is computed, and the partial result is merged with the kernels' LSE merge.
//!
//! Forward, on rank `r` of `n`: step `s` holds the KV block of rank `(r − s) mod n`. Before computing on it,
//! the block is posted to `r + 1` and the next one is posted for receipt from `r − 1` (double buffer), so the
//! transfer overlaps the compute. Blocks the mask hides entirely are skipped; the kernel skips the hidden
//! tiles of the others (with zigzag, an off-diagonal step touches only half of Q or half of KV).
//!
//! Backward: KV goes round again, and beside it travels an `f32` accumulator of `dK`, `dV` for that block;
//! each rank adds its queries' contribution and passes it on. After `n` hops the accumulator is back at its
//! owner, complete. The KV transfer of step `s + 1` overlaps the compute of step `s`; the accumulator's
//! transfer overlaps the compute of the next step.
//!
//! Ordering: the transfers' copies run on a queue of their own (the backend's
//! [`fork`](longctx_kernels::Backend::fork), kept by the plan, wrapped in the communicator's copier). The
//! communicator wants a device buffer idle from the post of its transfer until it finishes (see
//! `longctx_p2p::memory`): so before a step's transfers are posted, the compute queue is synchronised (the block
//! about to be sent and the accumulator are written, and the last reads of the buffers about to be received into
//! are done); then this step's attention is enqueued, and runs on the device beside the copies of the next block;
//! and a finished receive's bytes are in place for any queue (each copier call is finished when it returns). On
//! the CPU, synchronising is nothing and the order is the program's.

use std::sync::Arc;
use std::time::Instant;

use longctx_kernels::{AttnGrads, AttnOut, AttnPartial, AttnSaved, Backend, DType, GradMode, Qkv, View};
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

/// The ring's buffers, kept by the plan between calls so a steady loop allocates nothing: the block in hand and
/// the one arriving, the travelling `f32` dK/dV accumulators (the one passed on, the one arriving) and `part`,
/// which is the forward's partial `O` and the backward's own dK/dV contribution: the two phases never overlap,
/// so one buffer serves both and the plan holds no more than a call needs at its peak. All are backend buffers,
/// sized when a call first needs them. `xfer` is the transfers' queue (see the module docs), forked on first use.
#[derive(Debug, Default)]
pub(crate) struct RingBuffers {
    xfer: Option<Arc<dyn Backend>>,
    cur: KvBlock,
    nxt: KvBlock,
    part: Scratch,
    lse_part: Scratch,
    acc_out: Scratch,
    acc_in: Scratch,
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
    let RingBuffers { xfer, cur, nxt, part: o_part, lse_part, .. } = bufs;
    for blk in [&mut *cur, &mut *nxt] {
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
                b.synchronize()?;
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
                if have {
                    let part = AttnOut { o: o_part.view_mut(&qd)?, lse: lse_part.view_mut(&ld)? };
                    pb.attn_forward(&p, qkv, part)?;
                    let part = AttnPartial { o: o_part.view(&qd)?, lse: lse_part.view(&ld)? };
                    pb.merge(AttnOut { o: o.reborrow(), lse: lse.reborrow() }, part)?;
                } else {
                    pb.attn_forward(&p, qkv, AttnOut { o: o.reborrow(), lse: lse.reborrow() })?;
                }
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
            std::mem::swap(cur, nxt);
        }
    }
    if !have {
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
    let RingBuffers { xfer, cur, nxt, part: local, acc_out, acc_in, .. } = bufs;
    for blk in [&mut *cur, &mut *nxt] {
        blk.ensure(b, qkv.k.dtype(), s.kv_elems(), doc_len)?;
    }
    for acc in [&mut *local, &mut *acc_out, &mut *acc_in] {
        acc.ensure(b, DType::F32, 2 * s.kv_elems())?;
    }
    let xfer = transfer_queue(xfer, b)?;
    let copy = BackendCopy(&*xfer);
    let AttnGrads { mut dq, dk, dv } = grads;
    b.fill(dq.reborrow(), 0.0)?;
    for step in 0..n {
        let src = (r + n - step) % n;
        comm.scope(|sc| -> Result<()> {
            let (k, v, k_doc) = in_hand(step, &qkv, pb.docs, cur, &kd)?;
            let t = Instant::now();
            b.synchronize()?;
            let mut reqs = if step + 1 < n {
                post_block(sc, (next, prev), (k, v, k_doc), &mut *nxt, &kd, &copy)?
            } else {
                Vec::new()
            };
            if step > 0 {
                reqs.push(sc.isend_bytes(next, TAG_DKV, bytes(acc_out.view(&acc_dims)?, &copy))?);
                reqs.push(sc.irecv_bytes(prev, TAG_DKV, bytes_mut(acc_in.view_mut(&acc_dims)?, &copy))?);
            }
            rep.comm_wait += t.elapsed();

            // This rank's contribution to the block in hand, while the transfers run.
            let t = Instant::now();
            let p = pb.params(&pb.positions[src], k_doc);
            b.fill(local.view_mut(&acc_dims)?, 0.0)?;
            if p.mask.may_see_any(s.q_len, s.kv_len) {
                let (dk_loc, dv_loc) = local.halves_mut(&kd)?;
                let block = AttnSaved { qkv: Qkv::new(qkv.q, k, v), ..saved };
                let into = AttnGrads { dq: dq.reborrow(), dk: dk_loc, dv: dv_loc };
                pb.attn_backward(&p, block, d_o, into, GradMode::Accumulate)?;
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
        // The block's accumulator as it goes on at the next step: ours alone at the first step (the block is this
        // rank's own), else the one that arrived plus ours.
        if step == 0 {
            std::mem::swap(local, acc_out);
        } else {
            b.add(acc_in.view_mut(&acc_dims)?, local.view(&acc_dims)?)?;
            std::mem::swap(acc_in, acc_out);
        }
        if step + 1 < n {
            std::mem::swap(cur, nxt);
        }
    }
    // The last hop: the accumulator arriving is this rank's own block's, complete.
    let t = Instant::now();
    b.synchronize()?;
    comm.scope(|sc| -> Result<()> {
        let send = sc.isend_bytes(next, TAG_DKV, bytes(acc_out.view(&acc_dims)?, &copy))?;
        let recv = sc.irecv_bytes(prev, TAG_DKV, bytes_mut(acc_in.view_mut(&acc_dims)?, &copy))?;
        wait_all(vec![recv, send])
    })?;
    rep.comm_wait += t.elapsed();
    let (dk_all, dv_all) = acc_in.halves(&kd)?;
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
