//! The all-gather schedule (Llama 3 style): gather the whole sequence's K and V, in slices of KV heads to
//! bound memory, and compute the local queries against them; backward gathers again and reduce-scatters
//! `dK`, `dV` back to their owners (an all-to-all of the `f32` slices, summed on the backend in rank order).

use longctx_kernels::{AttnGrads, AttnOut, AttnParams, AttnSaved, AttnShape, Buffer, DType, GradMode, Qkv, View};
use longctx_p2p::Communicator;

use crate::error::Result;
use crate::local::Local;
use crate::reshard::{empty, swap01};
use crate::transfer::{bytes, bytes_mut, BackendCopy};

/// Gathers a slice (`[hs, L, D]`) from every rank: returns `[hs, n·L, D]`, tokens in rank order.
fn gather(comm: &Communicator, loc: &Local<'_>, x: View<'_>, [hs, l, d]: [usize; 3]) -> Result<Buffer> {
    let (b, n) = (loc.backend, comm.world_size());
    let copy = BackendCopy(b);
    let mut all = empty(b, x.dtype(), &[n, hs, l, d])?;
    comm.all_gather_bytes(bytes(x, &copy), bytes_mut(all.view_mut(), &copy))?;
    // [n][hs][L·D] → [hs][n][L·D].
    let mut out = empty(b, x.dtype(), &[hs, n * l, d])?;
    swap01(b, out.view_mut(), all.view(), [n, hs, l * d])?;
    Ok(out)
}

/// The sum over ranks of the gathered gradient `g` (`[hs, n·L, D]`, `f32`) for this rank's tokens, into `dst`
/// (`[hs, L, D]`): chunk `j` goes to rank `j`, and the `n` chunks that arrive are added in rank order.
fn reduce_scatter(comm: &Communicator, loc: &Local<'_>, g: View<'_>, dst: longctx_kernels::ViewMut<'_>) -> Result<()> {
    let (b, n) = (loc.backend, comm.world_size());
    let [hs, nl, d] = <[usize; 3]>::try_from(g.dims()).expect("a gathered gradient has 3 dims");
    let l = nl / n;
    let copy = BackendCopy(b);
    // [hs][n][L·D] → [n][hs][L·D]: chunk j is rank j's tokens.
    let mut send = empty(b, DType::F32, &[n, hs, l, d])?;
    swap01(b, send.view_mut(), g, [hs, n, l * d])?;
    let mut recv = empty(b, DType::F32, &[n, hs, l, d])?;
    comm.all_to_all_bytes(bytes(send.view(), &copy), bytes_mut(recv.view_mut(), &copy))?;
    let mut dst = dst.reshape([1, hs, l, d])?;
    b.copy(dst.reborrow(), recv.view().rows(0, 1)?)?;
    for j in 1..n {
        b.add(dst.reborrow(), recv.view().rows(j, 1)?)?;
    }
    Ok(())
}

/// Forward over head slices of at most `slice` KV heads; `out` is this rank's rows (`f32`).
pub(crate) fn forward(
    comm: &Communicator,
    loc: &Local<'_>,
    slice: usize,
    qkv: Qkv<'_>,
    out: AttnOut<'_>,
) -> Result<()> {
    let s = loc.shape;
    let (l, d, g, n) = (s.q_len, s.head_dim, s.group(), comm.world_size());
    let all_pos: Vec<i64> = loc.positions.concat();
    let docs = gather_docs(comm, loc.docs)?;
    let (q, k, v) = (rows3(qkv.q, s.q_heads)?, rows3(qkv.k, s.kv_heads)?, rows3(qkv.v, s.kv_heads)?);
    let mut o = out.o.reshape([s.batch * s.q_heads, l, d])?;
    let mut lse = out.lse.reshape([s.batch * s.q_heads, l])?;
    for b in 0..s.batch {
        for h0 in (0..s.kv_heads).step_by(slice) {
            let hs = slice.min(s.kv_heads - h0);
            let kv_row = b * s.kv_heads + h0;
            let kg = gather(comm, loc, k.rows(kv_row, hs)?, [hs, l, d])?;
            let vg = gather(comm, loc, v.rows(kv_row, hs)?, [hs, l, d])?;
            let (q_row, rows) = (b * s.q_heads + h0 * g, hs * g);
            let shape = AttnShape { batch: 1, q_heads: rows, kv_heads: hs, q_len: l, kv_len: n * l, head_dim: d };
            let p = params(loc, shape, &all_pos, docs.as_deref());
            let kv = [1, hs, n * l, d];
            let qkv = Qkv::new(
                q.rows(q_row, rows)?.reshape([1, rows, l, d])?,
                kg.view().reshape(kv)?,
                vg.view().reshape(kv)?,
            );
            let out = AttnOut {
                o: o.reborrow().rows(q_row, rows)?.reshape([1, rows, l, d])?,
                lse: lse.reborrow().rows(q_row, rows)?.reshape([1, rows, l])?,
            };
            loc.attn_forward(&p, qkv, out)?;
        }
    }
    Ok(())
}

/// Backward: gradients of this rank's rows and tokens (`grads`, all `f32`, overwritten).
pub(crate) fn backward(
    comm: &Communicator,
    loc: &Local<'_>,
    slice: usize,
    saved: AttnSaved<'_>,
    d_o: View<'_>,
    grads: AttnGrads<'_>,
) -> Result<()> {
    let s = loc.shape;
    let (l, d, g, n) = (s.q_len, s.head_dim, s.group(), comm.world_size());
    let bk = loc.backend;
    let all_pos: Vec<i64> = loc.positions.concat();
    let docs = gather_docs(comm, loc.docs)?;
    let qkv = saved.qkv;
    let (q, k, v) = (rows3(qkv.q, s.q_heads)?, rows3(qkv.k, s.kv_heads)?, rows3(qkv.v, s.kv_heads)?);
    let (o, d_o) = (rows3(saved.o, s.q_heads)?, rows3(d_o, s.q_heads)?);
    let lse = saved.lse.reshape([s.batch * s.q_heads, l])?;
    let mut dq = grads.dq.reshape([s.batch * s.q_heads, l, d])?;
    let mut dk = grads.dk.reshape([s.batch * s.kv_heads, l, d])?;
    let mut dv = grads.dv.reshape([s.batch * s.kv_heads, l, d])?;
    bk.fill(dq.reborrow(), 0.0)?;
    for b in 0..s.batch {
        for h0 in (0..s.kv_heads).step_by(slice) {
            let hs = slice.min(s.kv_heads - h0);
            let kv_row = b * s.kv_heads + h0;
            let kg = gather(comm, loc, k.rows(kv_row, hs)?, [hs, l, d])?;
            let vg = gather(comm, loc, v.rows(kv_row, hs)?, [hs, l, d])?;
            let (q_row, rows) = (b * s.q_heads + h0 * g, hs * g);
            let shape = AttnShape { batch: 1, q_heads: rows, kv_heads: hs, q_len: l, kv_len: n * l, head_dim: d };
            let p = params(loc, shape, &all_pos, docs.as_deref());
            let (qd, kv) = ([1, rows, l, d], [1, hs, n * l, d]);
            let mut dkg = bk.zeros(DType::F32, longctx_kernels::Dims::new(&[hs, n * l, d])?)?;
            let mut dvg = bk.zeros(DType::F32, longctx_kernels::Dims::new(&[hs, n * l, d])?)?;
            let block = AttnSaved {
                qkv: Qkv::new(q.rows(q_row, rows)?.reshape(qd)?, kg.view().reshape(kv)?, vg.view().reshape(kv)?),
                o: o.rows(q_row, rows)?.reshape(qd)?,
                lse: lse.rows(q_row, rows)?.reshape([1, rows, l])?,
            };
            let into = AttnGrads {
                dq: dq.reborrow().rows(q_row, rows)?.reshape(qd)?,
                dk: dkg.view_mut().reshape(kv)?,
                dv: dvg.view_mut().reshape(kv)?,
            };
            loc.attn_backward(&p, block, d_o.rows(q_row, rows)?.reshape(qd)?, into, GradMode::Accumulate)?;
            reduce_scatter(comm, loc, dkg.view(), dk.reborrow().rows(kv_row, hs)?)?;
            reduce_scatter(comm, loc, dvg.view(), dv.reborrow().rows(kv_row, hs)?)?;
        }
    }
    Ok(())
}

/// `[B, H, L, D]` as `[B·H, L, D]`, so that a batch element's run of heads is a run of rows.
fn rows3(x: View<'_>, heads: usize) -> Result<View<'_>> {
    let [bs, _, l, d] = <[usize; 4]>::try_from(x.dims()).expect("checked by the plan");
    Ok(x.reshape([bs * heads, l, d])?)
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
pub(crate) fn expected_bytes(n: usize, kv_elems: usize, elem_size: usize, doc_len: usize, backward: bool) -> u64 {
    let gather = (n - 1) * (2 * kv_elems * elem_size + doc_len * 4);
    let scatter = if backward { (n - 1) * 2 * kv_elems * 4 } else { 0 };
    (gather + scatter) as u64
}
