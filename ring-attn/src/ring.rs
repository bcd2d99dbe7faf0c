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

use std::time::Instant;

use longctx_kernels::{GradMode, HostSlice};
use longctx_p2p::{CommError, Communicator, OwnedRequest, SendRequest};

use crate::block::KvPacking;
use crate::error::Result;
use crate::local::Local;
use crate::report::StepReport;

/// Message tags of the two streams.
const TAG_KV: u32 = 0x4b56;
const TAG_DKV: u32 = 0x644b;

/// The ring's buffers, kept by the plan between calls so a steady loop allocates nothing: the block in hand and
/// the one arriving, the travelling `f32` dK/dV accumulators (the one passed on, the one arriving) and `part`,
/// which is the forward's partial `O` and the backward's own dK/dV contribution: the two phases never overlap,
/// so one buffer serves both and the plan holds no more than a call needs at its peak. Each is sized when a call
/// starts; one that a failed call left behind in a request is simply allocated again.
#[derive(Debug, Default)]
pub(crate) struct RingBuffers {
    cur: Vec<u32>,
    nxt: Vec<u32>,
    part: Vec<f32>,
    lse_part: Vec<f32>,
    acc_out: Vec<f32>,
    acc_in: Vec<f32>,
}

/// `v` with `len` elements, keeping its allocation; what it holds is left as it was (for buffers that are
/// written whole before they are read: receives and outputs).
fn sized<T: Copy + Default>(v: &mut Vec<T>, len: usize) {
    v.resize(len, T::default());
}

/// Ring forward: `o` (`f32`, `[B, Hq, L, D]`) and `lse` receive this rank's rows of full attention.
pub(crate) fn ring_forward(
    comm: &Communicator,
    pb: &Local<'_>,
    [q, k, v]: [HostSlice<'_>; 3],
    o: &mut [f32],
    lse: &mut [f32],
    bufs: &mut RingBuffers,
    rep: &mut StepReport,
) -> Result<()> {
    let (n, r) = (comm.world_size(), comm.rank());
    if n == 1 {
        return single_forward(pb, [q, k, v], o, lse, rep);
    }
    let packing = KvPacking::for_block(k.dtype(), pb.shape.kv_elems(), pb.docs);
    let RingBuffers { cur, nxt, part: o_part, lse_part, .. } = bufs;
    packing.pack_into(cur, k, v, pb.docs);
    sized(nxt, cur.len());
    sized(o_part, o.len());
    sized(lse_part, lse.len());
    let mut have = false;
    for step in 0..n {
        let src = (r + n - step) % n;
        // One scope per step: the transfers borrow `cur` and `nxt` until they finish, which the scope ensures
        // before the swap.
        comm.scope(|s| -> Result<()> {
            // Post the next block's transfer before computing on this one.
            let reqs = if step + 1 < n {
                let t = Instant::now();
                let send = s.isend((r + 1) % n, TAG_KV, &cur[..])?;
                let recv = s.irecv((r + n - 1) % n, TAG_KV, &mut nxt[..])?;
                rep.comm_wait += t.elapsed();
                Some((send, recv))
            } else {
                None
            };
            let t = Instant::now();
            let (kb, vb, k_doc) = packing.view(cur);
            let p = pb.params(&pb.positions[src], k_doc);
            if p.mask.may_see_any(pb.shape.q_len, pb.shape.kv_len) {
                // The first visible block writes the result directly; later ones a partial, merged in.
                let (o_dst, lse_dst) = if have { (&mut o_part[..], &mut lse_part[..]) } else { (&mut *o, &mut *lse) };
                pb.attn_forward(&p, [q, kb, vb], o_dst, lse_dst)?;
                if have {
                    pb.merge(o, lse, o_part, lse_part)?;
                }
                have = true;
                rep.blocks_computed += 1;
            } else {
                rep.blocks_skipped += 1;
            }
            rep.compute += t.elapsed();
            if let Some((send, recv)) = reqs {
                let t = Instant::now();
                send.wait()?;
                recv.wait()?;
                rep.comm_wait += t.elapsed();
            }
            Ok(())
        })?;
        if step + 1 < n {
            std::mem::swap(cur, nxt);
        }
    }
    if !have {
        o.fill(0.0);
        lse.fill(f32::NEG_INFINITY);
    }
    Ok(())
}

/// Ring backward: `dq` (`[B, Hq, L, D]`), `dk`, `dv` (`[B, Hkv, L, D]`), all `f32`, receive this rank's
/// gradients (overwritten).
pub(crate) fn ring_backward(
    comm: &Communicator,
    pb: &Local<'_>,
    [q, k, v, o, d_o]: [HostSlice<'_>; 5],
    lse: &[f32],
    [dq, dk, dv]: [&mut [f32]; 3],
    bufs: &mut RingBuffers,
    rep: &mut StepReport,
) -> Result<()> {
    let (n, r) = (comm.world_size(), comm.rank());
    if n == 1 {
        return single_backward(pb, [q, k, v, o, d_o], lse, [dq, dk, dv], rep);
    }
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let packing = KvPacking::for_block(k.dtype(), pb.shape.kv_elems(), pb.docs);
    let kv_elems = pb.shape.kv_elems();
    // The buffers travel by value: each moves into a request and comes back from its `wait` (and then to
    // `bufs`, for the next call).
    let RingBuffers { cur, nxt, part: local, acc_out, acc_in, .. } = bufs;
    packing.pack_into(cur, k, v, pb.docs);
    sized(nxt, cur.len());
    // `local`: this step's contribution (zeroed at each step); `acc_out`: the accumulator to pass on (starts at
    // zero); `acc_in`: where the next arrives.
    sized(local, 2 * kv_elems);
    acc_out.clear();
    acc_out.resize(2 * kv_elems, 0.0);
    sized(acc_in, 2 * kv_elems);
    dq.fill(0.0);
    let mut acc_reqs = None;
    for step in 0..n {
        let src = (r + n - step) % n;
        let t = Instant::now();
        // Pass the block in hand on (we keep reading it in the send) and receive the next one.
        let kv_reqs = if step + 1 < n {
            let send = comm.isend(next, TAG_KV, std::mem::take(cur)).map_err(CommError::from)?;
            Some((send, comm.irecv(prev, TAG_KV, std::mem::take(nxt)).map_err(CommError::from)?))
        } else {
            None
        };
        rep.comm_wait += t.elapsed();

        // This rank's contribution to the block in hand, while the block's accumulator is still arriving.
        let t = Instant::now();
        let block = kv_reqs.as_ref().map_or(&cur[..], |(send, _)| send.buf());
        let (kb, vb, k_doc) = packing.view(block);
        let p = pb.params(&pb.positions[src], k_doc);
        local.fill(0.0);
        let (dk_loc, dv_loc) = local.split_at_mut(kv_elems);
        if p.mask.may_see_any(pb.shape.q_len, pb.shape.kv_len) {
            pb.attn_backward(&p, [q, kb, vb, o, d_o], lse, [dq, dk_loc, dv_loc], GradMode::Accumulate)?;
            rep.blocks_computed += 1;
        } else {
            rep.blocks_skipped += 1;
        }
        rep.compute += t.elapsed();

        let t = Instant::now();
        // The accumulator that arrived (zeros at the first step) plus ours goes on; the buffer that went out
        // last comes back to receive the next one.
        if let Some((s_req, r_req)) = acc_reqs.take() {
            (*acc_in, *acc_out) = wait_pair(s_req, r_req)?;
        }
        for (a, l) in acc_out.iter_mut().zip(local.iter()) {
            *a += *l;
        }
        let send = comm.isend(next, TAG_DKV, std::mem::take(acc_out)).map_err(CommError::from)?;
        acc_reqs = Some((send, comm.irecv(prev, TAG_DKV, std::mem::take(acc_in)).map_err(CommError::from)?));
        if let Some((ks, kr)) = kv_reqs {
            (*nxt, *cur) = wait_pair(ks, kr)?;
        }
        rep.comm_wait += t.elapsed();
    }
    // After n hops the accumulator arriving last is this rank's own block's, complete.
    if let Some((s_req, r_req)) = acc_reqs.take() {
        let t = Instant::now();
        (*acc_out, *acc_in) = wait_pair(s_req, r_req)?;
        rep.comm_wait += t.elapsed();
    }
    dk.copy_from_slice(&acc_in[..kv_elems]);
    dv.copy_from_slice(&acc_in[kv_elems..]);
    Ok(())
}

/// [`ring_forward`] on one rank: its own block, read where it lies (nothing travels, so nothing is packed).
fn single_forward(
    pb: &Local<'_>,
    [q, k, v]: [HostSlice<'_>; 3],
    o: &mut [f32],
    lse: &mut [f32],
    rep: &mut StepReport,
) -> Result<()> {
    let t = Instant::now();
    let p = pb.params(pb.my_positions(), pb.docs);
    if p.mask.may_see_any(pb.shape.q_len, pb.shape.kv_len) {
        pb.attn_forward(&p, [q, k, v], o, lse)?;
        rep.blocks_computed += 1;
    } else {
        o.fill(0.0);
        lse.fill(f32::NEG_INFINITY);
        rep.blocks_skipped += 1;
    }
    rep.compute += t.elapsed();
    Ok(())
}

/// [`ring_backward`] on one rank: the gradients written whole by the kernel, with no accumulator to clear,
/// pass on or copy out.
fn single_backward(
    pb: &Local<'_>,
    inputs: [HostSlice<'_>; 5],
    lse: &[f32],
    [dq, dk, dv]: [&mut [f32]; 3],
    rep: &mut StepReport,
) -> Result<()> {
    let t = Instant::now();
    let p = pb.params(pb.my_positions(), pb.docs);
    if p.mask.may_see_any(pb.shape.q_len, pb.shape.kv_len) {
        pb.attn_backward(&p, inputs, lse, [dq, dk, dv], GradMode::Overwrite)?;
        rep.blocks_computed += 1;
    } else {
        for g in [dq, dk, dv] {
            g.fill(0.0);
        }
        rep.blocks_skipped += 1;
    }
    rep.compute += t.elapsed();
    Ok(())
}

/// Finishes a send and a receive, handing back (sent buffer, received buffer).
fn wait_pair<S: longctx_p2p::OwnedBuf, R>(s: SendRequest<S>, r: OwnedRequest<R>) -> Result<(S, R)> {
    let sent = s.wait().map_err(CommError::from);
    let received = r.wait().map_err(CommError::from)?;
    Ok((sent?, received))
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
