//! Operand preparation shared by forward and backward: keys (or values) transposed into tiles, and buffers
//! widened to `f32` once per call so no tile is converted twice.

use std::borrow::Cow;

use rayon::prelude::*;

use super::{AttnShape, BC};
use crate::view::HostSlice;

/// `[B·Hkv][tile][D][BC]`: each key tile transposed (columns are keys), zero-padded to `BC` keys, so the
/// product `Q·Kᵀ` of a tile is a plain row-major product with unit-stride loads along the keys.
pub(crate) fn pack_transposed_tiles(x: HostSlice<'_>, s: &AttnShape) -> Vec<f32> {
    let d = s.head_dim;
    let tiles = s.kv_len.div_ceil(BC);
    let per_head = tiles * d * BC;
    let mut out = vec![0f32; s.batch * s.kv_heads * per_head];
    out.par_chunks_mut(per_head).enumerate().for_each(|(bh, dst)| {
        let mut row = vec![0f32; d];
        for t in 0..tiles {
            let j0 = t * BC;
            let bc = BC.min(s.kv_len - j0);
            let tile = &mut dst[t * d * BC..(t + 1) * d * BC];
            for j in 0..bc {
                x.load_f32((bh * s.kv_len + j0 + j) * d, &mut row);
                for (dd, v) in row.iter().enumerate() {
                    tile[dd * BC + j] = *v;
                }
            }
        }
    });
    out
}

/// The buffer as `f32`: borrowed when it already is, widened (in parallel) when it is `bf16`.
pub(crate) fn as_f32(x: HostSlice<'_>) -> Cow<'_, [f32]> {
    match x {
        HostSlice::F32(s) => Cow::Borrowed(s),
        HostSlice::Bf16(s) => {
            let mut out = vec![0f32; s.len()];
            out.par_chunks_mut(1 << 14).zip(s.par_chunks(1 << 14)).for_each(|(d, s)| {
                for (d, s) in d.iter_mut().zip(s) {
                    *d = s.to_f32();
                }
            });
            Cow::Owned(out)
        }
    }
}
