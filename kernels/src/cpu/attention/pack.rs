//! Operand preparation shared by forward and backward: keys (or values) transposed into tiles, and buffers
//! widened to `f32` once per call so no tile is converted twice.

use std::borrow::Cow;

use rayon::prelude::*;

use super::simd::STRIP;
use super::BC;
use crate::attention::AttnShape;

/// The non-finite elements of one tile of `BC` key (or value) rows: `(row in the tile, dimension, value)`.
/// Empty for every tile of finite data, which is all the kernels check on their normal path.
pub(crate) type NonFinite = Vec<(usize, usize, f32)>;
use crate::host::HostSlice;

/// `[B·Hkv][tile][BC / STRIP][D][STRIP]`: each key tile transposed (columns are keys), zero-padded to `BC` keys
/// and strip-packed for [`super::simd::Simd::matmul_packed_b`] (key `j` of the tile, dimension `dd` at
/// `(j / STRIP)·STRIP·D + dd·STRIP + j % STRIP`), so the product `Q·Kᵀ` of a tile reads each strip of keys as
/// one contiguous block. A block of keys starting at `j` (a multiple of `STRIP`) starts at offset `j·D`.
/// Also returns each tile's non-finite elements (`[B·Hkv][tile]`), which stay in the packed data.
pub(crate) fn pack_transposed_tiles(x: HostSlice<'_>, s: &AttnShape) -> (Vec<f32>, Vec<NonFinite>) {
    let d = s.head_dim;
    pack_key_tiles(x, s, d * BC, false, |tile, j, row| {
        let strip = &mut tile[j / STRIP * STRIP * d + j % STRIP..];
        for (dd, v) in row.iter().enumerate() {
            strip[dd * STRIP] = *v;
        }
    })
}

/// `[B·Hkv][tile][D / STRIP][BC][STRIP]` (`D` rounded up to a whole strip): each value tile (keys × `D`) split
/// into strips of `STRIP` columns, each strip's rows contiguous and zero-padded to `BC` keys, for
/// [`super::simd::Simd::matmul_packed_b`] with `strip_rows = BC` (key `j` of the tile, dimension `dd` at
/// `(dd / STRIP)·STRIP·BC + j·STRIP + dd % STRIP`). Keys from `j` on start at offset `j·STRIP`.
/// Non-finite elements are packed as 0 and returned per tile (`[B·Hkv][tile]`) instead: a product over a span
/// of keys then gives exactly 0 for the keys a row does not see, and the caller adds the rest back to the rows
/// that do.
pub(crate) fn pack_value_strips(x: HostSlice<'_>, s: &AttnShape) -> (Vec<f32>, Vec<NonFinite>) {
    pack_key_tiles(x, s, value_tile_len(s.head_dim), true, |tile, j, row| put_in_strips(tile, BC, j, row))
}

/// The layout of [`pack_value_strips`] for keys, with non-finite elements kept in place (the backward's `dS·K`
/// lets them reach the rows that see them through the product itself).
pub(crate) fn pack_key_strips(x: HostSlice<'_>, s: &AttnShape) -> Vec<f32> {
    pack_key_tiles(x, s, value_tile_len(s.head_dim), false, |tile, j, row| put_in_strips(tile, BC, j, row)).0
}

/// `rows` rows of `d` floats (`x`, row-major) into `[D / STRIP][strip_rows][STRIP]` in `out` (`D` rounded up
/// to a whole strip), the strip-packed `B` of [`super::simd::Simd::matmul_at_packed_b`]: row `i`, dimension
/// `dd` at `(dd / STRIP)·STRIP·strip_rows + i·STRIP + dd % STRIP`. Read row by row, a tile of 64-float rows
/// walks its column strip 256 bytes at a time, which falls into a quarter of the L1 sets.
pub(crate) fn pack_row_strips(x: &[f32], d: usize, strip_rows: usize, out: &mut Vec<f32>) {
    let strips = d.div_ceil(STRIP);
    out.resize(strips * strip_rows * STRIP, 0.0);
    for (i, row) in x.chunks_exact(d).enumerate() {
        put_in_strips(out, strip_rows, i, row);
    }
}

/// Row `i` of a strip-packed operand whose strips hold `strip_rows` rows: its `STRIP`-wide pieces at
/// `(st·strip_rows + i)·STRIP` for strip `st`.
fn put_in_strips(out: &mut [f32], strip_rows: usize, i: usize, row: &[f32]) {
    for (st, part) in row.chunks(STRIP).enumerate() {
        out[(st * strip_rows + i) * STRIP..][..part.len()].copy_from_slice(part);
    }
}

/// `[B·Hkv][tile][tile_len]`, zero-filled, with `place(tile, j, row)` putting row `j` of each tile of `BC` keys
/// (as `f32`) where the layout wants it, and the non-finite elements of each tile (with `zero_bad`, placed as
/// 0). Heads are packed in parallel.
fn pack_key_tiles(
    x: HostSlice<'_>,
    s: &AttnShape,
    tile_len: usize,
    zero_bad: bool,
    place: impl Fn(&mut [f32], usize, &[f32]) + Sync,
) -> (Vec<f32>, Vec<NonFinite>) {
    let tiles = s.kv_len.div_ceil(BC);
    let per_head = tiles * tile_len;
    let mut out = vec![0f32; s.batch * s.kv_heads * per_head];
    let bad: Vec<Vec<NonFinite>> = out
        .par_chunks_mut(per_head)
        .enumerate()
        .map(|(bh, dst)| {
            let mut row = vec![0f32; s.head_dim];
            let mut bad = vec![NonFinite::new(); tiles];
            for (t, bad) in bad.iter_mut().enumerate() {
                let j0 = t * BC;
                let tile = &mut dst[t * tile_len..(t + 1) * tile_len];
                for j in 0..BC.min(s.kv_len - j0) {
                    x.load_f32((bh * s.kv_len + j0 + j) * s.head_dim, &mut row);
                    if !all_finite(&row) {
                        for (dd, v) in row.iter_mut().enumerate().filter(|(_, v)| !v.is_finite()) {
                            bad.push((j, dd, *v));
                            if zero_bad {
                                *v = 0.0;
                            }
                        }
                    }
                    place(tile, j, &row);
                }
            }
            bad
        })
        .collect();
    (out, bad.into_iter().flatten().collect())
}

/// Whether every element is finite (no NaN, no infinity). Branch-free, in 8 lanes, so it vectorises: `0·x` is
/// ±0 for a finite `x` and NaN otherwise, and a NaN stays in its lane's sum.
pub(crate) fn all_finite(x: &[f32]) -> bool {
    let mut lanes = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for ch in &mut chunks {
        for l in 0..8 {
            lanes[l] += ch[l] * 0.0;
        }
    }
    let rest = chunks.remainder().iter().fold(0f32, |a, v| a + v * 0.0);
    lanes.iter().sum::<f32>() + rest == 0.0
}

/// A copy of `x` with its non-finite elements as 0 (in `clean`), and those elements as `(row, dimension,
/// value)` for rows of `d` elements (in `bad`). For the rare tile pairs that need it, so not optimised.
pub(crate) fn finite_copy(x: &[f32], d: usize, clean: &mut Vec<f32>, bad: &mut NonFinite) {
    clean.clear();
    bad.clear();
    clean.extend(x.iter().enumerate().map(|(e, &v)| {
        if v.is_finite() {
            v
        } else {
            bad.push((e / d, e % d, v));
            0.0
        }
    }));
}

/// Floats per tile of [`pack_value_strips`].
pub(crate) fn value_tile_len(d: usize) -> usize {
    d.next_multiple_of(STRIP) * BC
}

/// The buffer as `f32`: borrowed when it already is, widened (in parallel) when it is 16-bit.
pub(crate) fn as_f32(x: HostSlice<'_>) -> Cow<'_, [f32]> {
    fn widened<T: crate::dtype::Element>(s: &[T]) -> Vec<f32> {
        let mut out = vec![0f32; s.len()];
        out.par_chunks_mut(1 << 14).zip(s.par_chunks(1 << 14)).for_each(|(d, s)| {
            for (d, s) in d.iter_mut().zip(s) {
                *d = s.to_f32();
            }
        });
        out
    }
    match x {
        HostSlice::F32(s) => Cow::Borrowed(s),
        HostSlice::Bf16(s) => Cow::Owned(widened(s)),
        HostSlice::F16(s) => Cow::Owned(widened(s)),
    }
}
