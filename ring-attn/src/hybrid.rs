//! All-to-all inside groups, ring across them. Ulysses is the case of one group holding every rank (the ring
//! has a single member and no steps).
//!
//! Inside a group of `u` ranks, an all-to-all turns sequence shards `[B, H, L, D]` into head shards
//! `[B, H/u, u·L, D]` over the group's `u·L` tokens; the ring then runs over the `CP/u` groups exactly as the
//! plain ring does over ranks, with each group's block of positions; a second all-to-all brings the output
//! (and in backward the gradients) back to sequence shards.

use std::time::Instant;

use longctx_kernels::{AttnGrads, AttnOut, AttnSaved, AttnShape, DType, Qkv, View};
use longctx_p2p::Communicator;

use crate::error::Result;
use crate::local::{kv_dims, lse_dims, q_dims, Local};
use crate::report::StepReport;
use crate::reshard::{all_to_all_bytes, empty, heads_to_seq, seq_to_heads};
use crate::ring::{self, RingBuffers};

fn gather_docs(inner: &Communicator, docs: Option<&[u32]>) -> Result<Option<Vec<u32>>> {
    Ok(match docs {
        Some(d) => {
            let mut all = vec![0u32; d.len() * inner.world_size()];
            inner.all_gather(d, &mut all)?;
            Some(all)
        }
        None => None,
    })
}

/// The block of a head shard: `1/u` of the heads over the group's `u·L` tokens.
pub(crate) fn head_shape(local: AttnShape, u: usize) -> AttnShape {
    AttnShape {
        q_heads: local.q_heads / u,
        kv_heads: local.kv_heads / u,
        q_len: local.q_len * u,
        kv_len: local.kv_len * u,
        ..local
    }
}

/// `x` (`[B, H, L, D]`, sequence-sharded) re-sharded into a new buffer of head shards.
fn to_heads(inner: &Communicator, loc: &Local<'_>, x: View<'_>, dims: [usize; 4]) -> Result<longctx_kernels::Buffer> {
    let u = inner.world_size();
    let [bs, h, l, d] = dims;
    let mut out = empty(loc.backend, x.dtype(), &[bs, h / u, u * l, d])?;
    seq_to_heads(inner, loc.backend, x, out.view_mut(), dims)?;
    Ok(out)
}

/// Forward: `ring` is the ring member's problem (its group's positions per member, the head-shard shape);
/// `local` this rank's sequence-shard block; `out` is `f32`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    inner: &Communicator,
    outer: &Communicator,
    ring: &Local<'_>,
    local: AttnShape,
    qkv: Qkv<'_>,
    out: AttnOut<'_>,
    bufs: &mut RingBuffers,
    rep: &mut StepReport,
) -> Result<()> {
    let b = ring.backend;
    let (qd, kd, ld) = (q_dims(&local), kv_dims(&local), lse_dims(&local));
    let t = Instant::now();
    let docs = gather_docs(inner, ring.docs)?;
    let qh = to_heads(inner, ring, qkv.q, qd)?;
    let kh = to_heads(inner, ring, qkv.k, kd)?;
    let vh = to_heads(inner, ring, qkv.v, kd)?;
    rep.comm_wait += t.elapsed();
    let hs = ring.shape;
    let loc = Local { docs: docs.as_deref(), ..*ring };
    let mut o_h = empty(b, DType::F32, &q_dims(&hs))?;
    let mut lse_h = empty(b, DType::F32, &lse_dims(&hs))?;
    let heads = Qkv::new(qh.view(), kh.view(), vh.view());
    ring::ring_forward(outer, &loc, heads, AttnOut { o: o_h.view_mut(), lse: lse_h.view_mut() }, bufs, rep)?;
    let t = Instant::now();
    heads_to_seq(inner, b, o_h.view(), out.o, qd)?;
    let [bs, h, l] = ld;
    heads_to_seq(inner, b, lse_h.view(), out.lse, [bs, h, l, 1])?;
    rep.comm_wait += t.elapsed();
    Ok(())
}

/// Backward (see [`forward`] for `ring` and `local`); `grads` are `f32`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    inner: &Communicator,
    outer: &Communicator,
    ring: &Local<'_>,
    local: AttnShape,
    saved: AttnSaved<'_>,
    d_o: View<'_>,
    grads: AttnGrads<'_>,
    bufs: &mut RingBuffers,
    rep: &mut StepReport,
) -> Result<()> {
    let b = ring.backend;
    let (qd, kd, [bs, h, l]) = (q_dims(&local), kv_dims(&local), lse_dims(&local));
    let t = Instant::now();
    let docs = gather_docs(inner, ring.docs)?;
    let qh = to_heads(inner, ring, saved.qkv.q, qd)?;
    let kh = to_heads(inner, ring, saved.qkv.k, kd)?;
    let vh = to_heads(inner, ring, saved.qkv.v, kd)?;
    let o_h = to_heads(inner, ring, saved.o, qd)?;
    let do_h = to_heads(inner, ring, d_o, qd)?;
    let lse_h = to_heads(inner, ring, saved.lse.reshape([bs, h, l, 1])?, [bs, h, l, 1])?;
    rep.comm_wait += t.elapsed();
    let hs = ring.shape;
    let loc = Local { docs: docs.as_deref(), ..*ring };
    let mut dq_h = empty(b, DType::F32, &q_dims(&hs))?;
    let mut dk_h = empty(b, DType::F32, &kv_dims(&hs))?;
    let mut dv_h = empty(b, DType::F32, &kv_dims(&hs))?;
    let heads = AttnSaved {
        qkv: Qkv::new(qh.view(), kh.view(), vh.view()),
        o: o_h.view(),
        lse: lse_h.view().reshape(lse_dims(&hs))?,
    };
    let into = AttnGrads { dq: dq_h.view_mut(), dk: dk_h.view_mut(), dv: dv_h.view_mut() };
    ring::ring_backward(outer, &loc, heads, do_h.view(), into, bufs, rep)?;
    let t = Instant::now();
    heads_to_seq(inner, b, dq_h.view(), grads.dq, qd)?;
    heads_to_seq(inner, b, dk_h.view(), grads.dk, kd)?;
    heads_to_seq(inner, b, dv_h.view(), grads.dv, kd)?;
    rep.comm_wait += t.elapsed();
    Ok(())
}

/// Bytes one rank sends in a hybrid forward with groups of `u` and `m` groups.
pub(crate) fn forward_bytes(u: usize, m: usize, local: &AttnShape, elem: usize, doc_len: usize) -> u64 {
    let (qe, kve, le) = (local.q_elems(), local.kv_elems(), local.lse_elems());
    let a2a = all_to_all_bytes(u, qe, elem) + 2 * all_to_all_bytes(u, kve, elem);
    let docs = ((u - 1) * doc_len * 4) as u64;
    // The ring block of a group member: its head slice over the group's tokens (same element count as the
    // local K) with the group's document ids.
    let back = all_to_all_bytes(u, qe, 4) + all_to_all_bytes(u, le, 4);
    a2a + docs + ring::forward_bytes(m, kve, elem, doc_len * u) + back
}

/// Bytes one rank sends in a hybrid backward.
/// `o_do`: the element sizes of the saved `O` and of `dO`, each re-sharded in its own type.
pub(crate) fn backward_bytes(
    u: usize,
    m: usize,
    local: &AttnShape,
    elem: usize,
    o_do: [usize; 2],
    doc_len: usize,
) -> u64 {
    let (qe, kve, le) = (local.q_elems(), local.kv_elems(), local.lse_elems());
    let a2a_in = all_to_all_bytes(u, qe, elem)
        + 2 * all_to_all_bytes(u, kve, elem)
        + all_to_all_bytes(u, qe, o_do[0])
        + all_to_all_bytes(u, qe, o_do[1])
        + all_to_all_bytes(u, le, 4);
    let docs = ((u - 1) * doc_len * 4) as u64;
    let a2a_out = all_to_all_bytes(u, qe, 4) + 2 * all_to_all_bytes(u, kve, 4);
    a2a_in + docs + ring::backward_bytes(m, kve, elem, doc_len * u) + a2a_out
}
