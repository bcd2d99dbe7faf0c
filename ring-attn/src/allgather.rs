//! The all-gather schedule (Llama 3 style): gather the whole sequence's K and V, in slices of KV heads to
//! bound memory, and compute the local queries against them; backward gathers again and reduce-scatters
//! `dK`, `dV` back to their owners.

use bytemuck::Pod;
use longctx_kernels::{AttnParams, AttnShape, Element, GradMode, HostSlice};
use longctx_p2p::{Communicator, ReduceOp};

use crate::error::Result;
use crate::local::Local;
use crate::reshard::swap01;

/// Gathers this slice's K and V from every rank: returns `[hs, n·L, D]` for each, tokens in rank order.
fn gather_kv<T: Element + Pod>(
    comm: &Communicator,
    k: &[T],
    v: &[T],
    hs: usize,
    l: usize,
    d: usize,
) -> Result<(Vec<T>, Vec<T>)> {
    let n = comm.world_size();
    // One gather carries [K | V] of every rank.
    let send = [k, v].concat();
    let mut recv = vec![T::zeroed(); send.len() * n];
    comm.all_gather(&send, &mut recv)?;
    let (mut kg, mut vg) = (Vec::with_capacity(k.len() * n), Vec::with_capacity(v.len() * n));
    for chunk in recv.chunks(send.len()) {
        kg.extend_from_slice(&chunk[..k.len()]);
        vg.extend_from_slice(&chunk[k.len()..]);
    }
    Ok((swap01(&kg, n, hs, l * d), swap01(&vg, n, hs, l * d)))
}

/// Runs `$body` with `$q`, `$k`, `$v` bound to typed slices of their common dtype (checked before).
macro_rules! typed_qkv {
    ([$q:expr, $k:expr, $v:expr], |$qq:ident, $kk:ident, $vv:ident| $body:expr) => {
        match ($q, $k, $v) {
            (HostSlice::F32($qq), HostSlice::F32($kk), HostSlice::F32($vv)) => $body,
            (HostSlice::Bf16($qq), HostSlice::Bf16($kk), HostSlice::Bf16($vv)) => $body,
            (HostSlice::F16($qq), HostSlice::F16($kk), HostSlice::F16($vv)) => $body,
            _ => unreachable!("q, k and v dtypes are checked to agree before a schedule runs"),
        }
    };
}

/// Forward over head slices of at most `slice` KV heads; `o` and `lse` are this rank's rows (`f32`).
pub(crate) fn forward(
    comm: &Communicator,
    loc: &Local<'_>,
    slice: usize,
    [q, k, v]: [HostSlice<'_>; 3],
    o: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    typed_qkv!([q, k, v], |q, k, v| forward_typed(comm, loc, slice, [q, k, v], o, lse))
}

fn forward_typed<T: Element + Pod>(
    comm: &Communicator,
    loc: &Local<'_>,
    slice: usize,
    [q, k, v]: [&[T]; 3],
    o: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let s = loc.shape;
    let (l, d, g, n) = (s.q_len, s.head_dim, s.group(), comm.world_size());
    let all_pos: Vec<i64> = loc.positions.concat();
    let docs = gather_docs(comm, loc.docs)?;
    for b in 0..s.batch {
        for h0 in (0..s.kv_heads).step_by(slice) {
            let hs = slice.min(s.kv_heads - h0);
            let kv_off = (b * s.kv_heads + h0) * l * d;
            let (kg, vg) = gather_kv(comm, &k[kv_off..kv_off + hs * l * d], &v[kv_off..kv_off + hs * l * d], hs, l, d)?;
            let q_off = (b * s.q_heads + h0 * g) * l * d;
            let rows = hs * g * l;
            let shape = AttnShape { batch: 1, q_heads: hs * g, kv_heads: hs, q_len: l, kv_len: n * l, head_dim: d };
            let p = params(loc, shape, &all_pos, docs.as_deref());
            let lse_off = (b * s.q_heads + h0 * g) * l;
            loc.attn_forward(
                &p,
                [T::host(&q[q_off..q_off + rows * d]), T::host(&kg), T::host(&vg)],
                &mut o[q_off..q_off + rows * d],
                &mut lse[lse_off..lse_off + rows],
            )?;
        }
    }
    Ok(())
}

/// Backward: gradients of this rank's rows and tokens (`dq`, `dk`, `dv`, all `f32`, overwritten).
pub(crate) fn backward(
    comm: &Communicator,
    loc: &Local<'_>,
    slice: usize,
    [q, k, v, o, d_o]: [HostSlice<'_>; 5],
    lse: &[f32],
    grads: [&mut [f32]; 3],
) -> Result<()> {
    let (o, d_o) = (o.to_f32_vec(), d_o.to_f32_vec());
    typed_qkv!([q, k, v], |q, k, v| backward_typed(comm, loc, slice, [q, k, v], [&o, &d_o], lse, grads))
}

fn backward_typed<T: Element + Pod>(
    comm: &Communicator,
    loc: &Local<'_>,
    slice: usize,
    [q, k, v]: [&[T]; 3],
    [o, d_o]: [&[f32]; 2],
    lse: &[f32],
    [dq, dk, dv]: [&mut [f32]; 3],
) -> Result<()> {
    dq.fill(0.0);
    let s = loc.shape;
    let (l, d, g, n) = (s.q_len, s.head_dim, s.group(), comm.world_size());
    let all_pos: Vec<i64> = loc.positions.concat();
    let docs = gather_docs(comm, loc.docs)?;
    for b in 0..s.batch {
        for h0 in (0..s.kv_heads).step_by(slice) {
            let hs = slice.min(s.kv_heads - h0);
            let kv_off = (b * s.kv_heads + h0) * l * d;
            let kv_len = hs * l * d;
            let (kg, vg) = gather_kv(comm, &k[kv_off..kv_off + kv_len], &v[kv_off..kv_off + kv_len], hs, l, d)?;
            let q_off = (b * s.q_heads + h0 * g) * l * d;
            let rows = hs * g * l;
            let lse_off = (b * s.q_heads + h0 * g) * l;
            let shape = AttnShape { batch: 1, q_heads: hs * g, kv_heads: hs, q_len: l, kv_len: n * l, head_dim: d };
            let p = params(loc, shape, &all_pos, docs.as_deref());
            let mut dkg = vec![0f32; kg.len()];
            let mut dvg = vec![0f32; vg.len()];
            loc.attn_backward(
                &p,
                [
                    T::host(&q[q_off..q_off + rows * d]),
                    T::host(&kg),
                    T::host(&vg),
                    (&o[q_off..q_off + rows * d]).into(),
                    (&d_o[q_off..q_off + rows * d]).into(),
                ],
                &lse[lse_off..lse_off + rows],
                [&mut dq[q_off..q_off + rows * d], &mut dkg, &mut dvg],
                GradMode::Accumulate,
            )?;
            // [hs][n][L·D] → [n][hs][L·D], then [dK_j | dV_j] per destination rank j.
            let dkr = swap01(&dkg, hs, n, l * d);
            let dvr = swap01(&dvg, hs, n, l * d);
            let mut send = Vec::with_capacity(2 * dkr.len());
            for j in 0..n {
                send.extend_from_slice(&dkr[j * kv_len..(j + 1) * kv_len]);
                send.extend_from_slice(&dvr[j * kv_len..(j + 1) * kv_len]);
            }
            let mut mine = vec![0f32; 2 * kv_len];
            comm.reduce_scatter(&send, &mut mine, ReduceOp::Sum)?;
            dk[kv_off..kv_off + kv_len].copy_from_slice(&mine[..kv_len]);
            dv[kv_off..kv_off + kv_len].copy_from_slice(&mine[kv_len..]);
        }
    }
    Ok(())
}

fn gather_docs(comm: &Communicator, docs: Option<&[u32]>) -> Result<Option<Vec<u32>>> {
    Ok(match docs {
        Some(d) => {
            let mut all = vec![0u32; d.len() * comm.world_size()];
            comm.all_gather(d, &mut all)?;
            Some(all)
        }
        None => None,
    })
}

fn params<'a>(loc: &'a Local<'_>, shape: AttnShape, all_pos: &'a [i64], docs: Option<&'a [u32]>) -> AttnParams<'a> {
    loc.params_for(shape, loc.my_positions(), all_pos, docs)
}

/// Bytes one rank sends: forward gathers K and V once (and the document ids); backward gathers them again
/// and reduce-scatters `f32` `dK`, `dV`.
pub(crate) fn bytes(n: usize, kv_elems: usize, elem_size: usize, doc_len: usize, backward: bool) -> u64 {
    let gather = (n - 1) * (2 * kv_elems * elem_size + doc_len * 4);
    let scatter = if backward { (n - 1) * 2 * kv_elems * 4 } else { 0 };
    (gather + scatter) as u64
}
