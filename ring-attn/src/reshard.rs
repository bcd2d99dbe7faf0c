//! Re-sharding between "sequence split across ranks" and "heads split across ranks" (the all-to-all of
//! Ulysses), and the axis swaps that put gathered blocks into sequence order.

use bytemuck::Pod;
use longctx_p2p::Communicator;

use crate::error::Result;

/// `[a][b][rest]` → `[b][a][rest]`.
pub(crate) fn swap01<T: Copy>(x: &[T], a: usize, b: usize, rest: usize) -> Vec<T> {
    debug_assert_eq!(x.len(), a * b * rest);
    let mut out = Vec::with_capacity(x.len());
    for j in 0..b {
        for i in 0..a {
            out.extend_from_slice(&x[(i * b + j) * rest..(i * b + j + 1) * rest]);
        }
    }
    out
}

/// Sequence-sharded `[B, H, L, D]` on each of the `n` ranks of `comm` → head-sharded `[B, H/n, n·L, D]`, the
/// tokens in rank order (rank 0's `L` tokens, then rank 1's, …).
pub(crate) fn seq_to_heads<T: Pod>(
    comm: &Communicator,
    x: &[T],
    b: usize,
    h: usize,
    l: usize,
    d: usize,
) -> Result<Vec<T>> {
    let n = comm.world_size();
    if n == 1 {
        return Ok(x.to_vec());
    }
    let hn = h / n;
    // [B][n][H/n·L·D] → [n][B][H/n·L·D]: chunk i holds head slice i for every batch element.
    let send = swap01(x, b, n, hn * l * d);
    let mut recv = vec![T::zeroed(); send.len()];
    comm.all_to_all(&send, &mut recv)?;
    // [n(source rank)][B·H/n][L·D] → [B·H/n][n][L·D].
    Ok(swap01(&recv, n, b * hn, l * d))
}

/// The inverse of [`seq_to_heads`]: `[B, H/n, n·L, D]` → `[B, H, L, D]` for this rank's tokens.
pub(crate) fn heads_to_seq<T: Pod>(
    comm: &Communicator,
    x: &[T],
    b: usize,
    h: usize,
    l: usize,
    d: usize,
) -> Result<Vec<T>> {
    let n = comm.world_size();
    if n == 1 {
        return Ok(x.to_vec());
    }
    let hn = h / n;
    // [B·H/n][n][L·D] → [n][B·H/n][L·D]: chunk j holds rank j's tokens.
    let send = swap01(x, b * hn, n, l * d);
    let mut recv = vec![T::zeroed(); send.len()];
    comm.all_to_all(&send, &mut recv)?;
    // [n(source = head slice)][B][H/n·L·D] → [B][n][H/n·L·D] = [B, H, L, D].
    Ok(swap01(&recv, n, b, hn * l * d))
}

/// Bytes one rank sends in an all-to-all of `elems` elements of `size` bytes over `n` ranks.
pub(crate) fn all_to_all_bytes(n: usize, elems: usize, size: usize) -> u64 {
    (elems / n * (n - 1) * size) as u64
}
