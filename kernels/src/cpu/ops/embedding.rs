//! Token embedding lookup.
//!
//! Legend: `T` tokens, `V` vocabulary, `C` channels.
//!
//! ```text
//! forward:  out[t,:] = table[ids[t],:]
//! backward: dtable[v,:] (+)= Σ_{t : ids[t]=v} dout[t,:]      (summed in token order)
//! ```
//!
//! The backward groups tokens by id (a counting sort, stable in token order) and gives each table row to one
//! task, so no two threads touch a row and every row's sum runs in token order: bit-identical for any thread
//! count.

use rayon::prelude::*;

use super::ROWS_PER_TASK;
use crate::dtype::Element;

/// Embedding forward: `out[T,C] = table[ids[T], :]` with `table[V,C]`.
pub(crate) fn embedding_forward<T: Element>(out: &mut [T], ids: &[u32], table: &[T], c: usize) {
    out.par_chunks_mut(c * ROWS_PER_TASK).zip(ids.par_chunks(ROWS_PER_TASK)).for_each(|(o, ids)| {
        for (o, &id) in o.chunks_exact_mut(c).zip(ids) {
            let id = id as usize;
            o.copy_from_slice(&table[id * c..(id + 1) * c]);
        }
    });
}

/// Embedding backward: `dtable[V,C]` gets `dout[T,C]` row `t` added at row `ids[t]`. With `accumulate = false`
/// `dtable` is zeroed first; training normally passes `true`.
pub(crate) fn embedding_backward<T: Element, G: Element>(
    dtable: &mut [G],
    dout: &[T],
    ids: &[u32],
    v: usize,
    c: usize,
    accumulate: bool,
) {
    // Counting sort of token indices by id: tokens of id `v` are order[start[v]..start[v+1]], in token order.
    let mut start = vec![0usize; v + 1];
    for &id in ids {
        start[id as usize + 1] += 1;
    }
    for i in 0..v {
        start[i + 1] += start[i];
    }
    let mut fill = start.clone();
    let mut order = vec![0usize; ids.len()];
    for (t, &id) in ids.iter().enumerate() {
        order[fill[id as usize]] = t;
        fill[id as usize] += 1;
    }
    dtable.par_chunks_mut(c * ROWS_PER_TASK).enumerate().for_each(|(blk, rows)| {
        let mut acc = vec![0.0f32; c];
        for (j, row) in rows.chunks_exact_mut(c).enumerate() {
            let id = blk * ROWS_PER_TASK + j;
            let toks = &order[start[id]..start[id + 1]];
            if toks.is_empty() {
                if !accumulate {
                    row.fill(G::from_f32(0.0));
                }
                continue;
            }
            for (a, r) in acc.iter_mut().zip(row.iter()) {
                *a = if accumulate { r.to_f32() } else { 0.0 };
            }
            for &t in toks {
                for (a, d) in acc.iter_mut().zip(&dout[t * c..(t + 1) * c]) {
                    *a += d.to_f32();
                }
            }
            super::store(row, &acc, false);
        }
    });
}
