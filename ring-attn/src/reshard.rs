//! Re-sharding between "sequence split across ranks" and "heads split across ranks" (the all-to-all of
//! Ulysses), and the axis swaps that put gathered blocks into sequence order, all on the backend: the swaps are
//! its `transpose12` on `[1, a, b, rest]` views, the exchange an all-to-all of the bytes where they lie.

use longctx_kernels::{Backend, Buffer, DType, Dims, View, ViewMut};
use longctx_p2p::Communicator;

use crate::error::Result;
use crate::transfer::{bytes, bytes_mut, BackendCopy};

/// `dst[b][a][rest] = src[a][b][rest]` for `src` of `a·b·rest` elements (the backend's `transpose12`).
pub(crate) fn swap01(b: &dyn Backend, dst: ViewMut<'_>, src: View<'_>, [x, y, rest]: [usize; 3]) -> Result<()> {
    b.transpose12(dst.reshape([1, y, x, rest])?, src.reshape([1, x, y, rest])?)?;
    Ok(())
}

/// A new backend buffer of `dims`.
pub(crate) fn empty(b: &dyn Backend, dtype: DType, dims: &[usize]) -> Result<Buffer> {
    Ok(b.empty(dtype, Dims::new(dims)?)?)
}

/// Sequence-sharded `x` (`[B, H, L, D]` on each of the `n` ranks of `comm`) → head-sharded `dst`
/// (`[B, H/n, n·L, D]`, the tokens in rank order: rank 0's `L` tokens, then rank 1's, …).
pub(crate) fn seq_to_heads(
    comm: &Communicator,
    b: &dyn Backend,
    x: View<'_>,
    dst: ViewMut<'_>,
    [bs, h, l, d]: [usize; 4],
) -> Result<()> {
    let n = comm.world_size();
    if n == 1 {
        b.copy(dst.reshape(x.dims())?, x)?;
        return Ok(());
    }
    let hn = h / n;
    let copy = BackendCopy(b);
    // [B][n][H/n·L·D] → [n][B][H/n·L·D]: chunk i holds head slice i for every batch element.
    let mut send = empty(b, x.dtype(), &[x.len()])?;
    swap01(b, send.view_mut(), x, [bs, n, hn * l * d])?;
    let mut recv = empty(b, x.dtype(), &[x.len()])?;
    comm.all_to_all_bytes(bytes(send.view(), &copy), bytes_mut(recv.view_mut(), &copy))?;
    // [n(source rank)][B·H/n][L·D] → [B·H/n][n][L·D].
    swap01(b, dst, recv.view(), [n, bs * hn, l * d])
}

/// The inverse of [`seq_to_heads`]: `x` (`[B, H/n, n·L, D]`) → `dst` (`[B, H, L, D]`) for this rank's tokens.
pub(crate) fn heads_to_seq(
    comm: &Communicator,
    b: &dyn Backend,
    x: View<'_>,
    dst: ViewMut<'_>,
    [bs, h, l, d]: [usize; 4],
) -> Result<()> {
    let n = comm.world_size();
    if n == 1 {
        b.copy(dst.reshape(x.dims())?, x)?;
        return Ok(());
    }
    let hn = h / n;
    let copy = BackendCopy(b);
    // [B·H/n][n][L·D] → [n][B·H/n][L·D]: chunk j holds rank j's tokens.
    let mut send = empty(b, x.dtype(), &[x.len()])?;
    swap01(b, send.view_mut(), x, [bs * hn, n, l * d])?;
    let mut recv = empty(b, x.dtype(), &[x.len()])?;
    comm.all_to_all_bytes(bytes(send.view(), &copy), bytes_mut(recv.view_mut(), &copy))?;
    // [n(source = head slice)][B][H/n·L·D] → [B][n][H/n·L·D] = [B, H, L, D].
    swap01(b, dst, recv.view(), [n, bs, hn * l * d])
}

/// Bytes one rank sends in an all-to-all of `elems` elements of `size` bytes over `n` ranks.
pub(crate) fn all_to_all_bytes(n: usize, elems: usize, size: usize) -> u64 {
    (elems / n * (n - 1) * size) as u64
}
