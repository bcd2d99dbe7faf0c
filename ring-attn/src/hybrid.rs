//! All-to-all inside groups, ring across them. Ulysses is the case of one group holding every rank (the ring
//! has a single member and no steps).
//!
//! Inside a group of `u` ranks, an all-to-all turns sequence shards `[B, H, L, D]` into head shards
//! `[B, H/u, u·L, D]` over the group's `u·L` tokens; the ring then runs over the `CP/u` groups exactly as the
//! plain ring does over ranks, with each group's block of positions; a second all-to-all brings the output
//! (and in backward the gradients) back to sequence shards.

use std::time::Instant;

use bytemuck::Pod;
use half::{bf16, f16};
use longctx_kernels::{AttnShape, Element, HostSlice};
use longctx_p2p::Communicator;

use crate::error::Result;
use crate::local::Local;
use crate::report::StepReport;
use crate::reshard::{all_to_all_bytes, heads_to_seq, seq_to_heads};
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

/// Re-shards q, k, v (one dtype) to head shards.
fn qkv_to_heads<T: Pod>(inner: &Communicator, s: AttnShape, q: &[T], k: &[T], v: &[T]) -> Result<[Vec<T>; 3]> {
    let (b, l, d) = (s.batch, s.q_len, s.head_dim);
    Ok([
        seq_to_heads(inner, q, b, s.q_heads, l, d)?,
        seq_to_heads(inner, k, b, s.kv_heads, l, d)?,
        seq_to_heads(inner, v, b, s.kv_heads, l, d)?,
    ])
}

enum Qkv {
    F32([Vec<f32>; 3]),
    Bf16([Vec<bf16>; 3]),
    F16([Vec<f16>; 3]),
}

impl Qkv {
    fn new(inner: &Communicator, s: AttnShape, q: HostSlice<'_>, k: HostSlice<'_>, v: HostSlice<'_>) -> Result<Self> {
        Ok(match (q, k, v) {
            (HostSlice::F32(q), HostSlice::F32(k), HostSlice::F32(v)) => Qkv::F32(qkv_to_heads(inner, s, q, k, v)?),
            (HostSlice::Bf16(q), HostSlice::Bf16(k), HostSlice::Bf16(v)) => Qkv::Bf16(qkv_to_heads(inner, s, q, k, v)?),
            (HostSlice::F16(q), HostSlice::F16(k), HostSlice::F16(v)) => Qkv::F16(qkv_to_heads(inner, s, q, k, v)?),
            _ => unreachable!("dtypes checked by the caller"),
        })
    }
    fn views(&self) -> [HostSlice<'_>; 3] {
        fn v<T: Element>(x: &[Vec<T>; 3]) -> [HostSlice<'_>; 3] {
            [T::host(&x[0]), T::host(&x[1]), T::host(&x[2])]
        }
        match self {
            Qkv::F32(x) => v(x),
            Qkv::Bf16(x) => v(x),
            Qkv::F16(x) => v(x),
        }
    }
}

/// Forward: `ring` is the ring member's problem (its group's positions per member, the head-shard shape);
/// `local` this rank's sequence-shard block.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    inner: &Communicator,
    outer: &Communicator,
    ring: &Local<'_>,
    local: AttnShape,
    [q, k, v]: [HostSlice<'_>; 3],
    (o, lse): (&mut [f32], &mut [f32]),
    bufs: &mut RingBuffers,
    rep: &mut StepReport,
) -> Result<()> {
    let t = Instant::now();
    let docs = gather_docs(inner, ring.docs)?;
    let heads = Qkv::new(inner, local, q, k, v)?;
    rep.comm_wait += t.elapsed();
    let hs = ring.shape;
    let loc = Local { docs: docs.as_deref(), ..*ring };
    let [qh, kh, vh] = heads.views();
    let mut o_h = vec![0f32; hs.q_elems()];
    let mut lse_h = vec![0f32; hs.lse_elems()];
    ring::ring_forward(outer, &loc, [qh, kh, vh], &mut o_h, &mut lse_h, bufs, rep)?;
    let t = Instant::now();
    o.copy_from_slice(&heads_to_seq(inner, &o_h, local.batch, local.q_heads, local.q_len, local.head_dim)?);
    lse.copy_from_slice(&heads_to_seq(inner, &lse_h, local.batch, local.q_heads, local.q_len, 1)?);
    rep.comm_wait += t.elapsed();
    Ok(())
}

/// Backward (see [`forward`] for `ring` and `local`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    inner: &Communicator,
    outer: &Communicator,
    ring: &Local<'_>,
    local: AttnShape,
    [q, k, v, o, d_o]: [HostSlice<'_>; 5],
    lse: &[f32],
    [dq, dk, dv]: [&mut [f32]; 3],
    bufs: &mut RingBuffers,
    rep: &mut StepReport,
) -> Result<()> {
    let (b, l, d) = (local.batch, local.q_len, local.head_dim);
    let t = Instant::now();
    let docs = gather_docs(inner, ring.docs)?;
    let heads = Qkv::new(inner, local, q, k, v)?;
    let o_h = seq_to_heads(inner, &o.to_f32_vec(), b, local.q_heads, l, d)?;
    let do_h = seq_to_heads(inner, &d_o.to_f32_vec(), b, local.q_heads, l, d)?;
    let lse_h = seq_to_heads(inner, lse, b, local.q_heads, l, 1)?;
    rep.comm_wait += t.elapsed();
    let hs = ring.shape;
    let loc = Local { docs: docs.as_deref(), ..*ring };
    let [qh, kh, vh] = heads.views();
    let mut dq_h = vec![0f32; hs.q_elems()];
    let mut dk_h = vec![0f32; hs.kv_elems()];
    let mut dv_h = vec![0f32; hs.kv_elems()];
    let inputs = [qh, kh, vh, (&o_h).into(), (&do_h).into()];
    ring::ring_backward(outer, &loc, inputs, &lse_h, [&mut dq_h, &mut dk_h, &mut dv_h], bufs, rep)?;
    let t = Instant::now();
    dq.copy_from_slice(&heads_to_seq(inner, &dq_h, b, local.q_heads, l, d)?);
    dk.copy_from_slice(&heads_to_seq(inner, &dk_h, b, local.kv_heads, l, d)?);
    dv.copy_from_slice(&heads_to_seq(inner, &dv_h, b, local.kv_heads, l, d)?);
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
pub(crate) fn backward_bytes(u: usize, m: usize, local: &AttnShape, elem: usize, doc_len: usize) -> u64 {
    let (qe, kve, le) = (local.q_elems(), local.kv_elems(), local.lse_elems());
    let a2a_in = all_to_all_bytes(u, qe, elem)
        + 2 * all_to_all_bytes(u, kve, elem)
        + 2 * all_to_all_bytes(u, qe, 4)
        + all_to_all_bytes(u, le, 4);
    let docs = ((u - 1) * doc_len * 4) as u64;
    let a2a_out = all_to_all_bytes(u, qe, 4) + 2 * all_to_all_bytes(u, kve, 4);
    a2a_in + docs + ring::backward_bytes(m, kve, elem, doc_len * u) + a2a_out
}
