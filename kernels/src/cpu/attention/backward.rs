//! Attention backward, recomputing the probabilities tile by tile from the saved `LSE`.
//!
//! With `P = exp(scale·Q·Kᵀ − LSE)` (rows), `Dᵢ = dOᵢ·Oᵢ`:
//! `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ∘ (dP − D)`, `dQ = scale·dS·K`, `dK = scale·dSᵀ·Q`.
//!
//! One pass computes `P` and `dS` once per tile pair (5 tile products). Determinism without atomics: a task
//! per (batch, KV head, query chunk) owns its query tiles' `dQ` and writes its contributions to `dK`, `dV`
//! into a partial buffer of its own; the partials are then summed in chunk order. The number of chunks
//! depends on the shape alone (see `query_chunks`), never on the thread count.
//!
//! Non-finite inputs: a tile pair with a non-finite operand (noted per key tile while K and V are packed, per
//! query row while `D` is computed) that the mask cuts through sets hidden `P` and `dS` to exactly 0 and runs
//! each product with its other operand's non-finite elements as 0, adding their terms back for the visible pairs
//! only; every other pair runs as if all were finite.

use std::f32::consts::LOG2_E;

use rayon::prelude::*;

use super::forward::{Scratch, GROUP};
use super::pack::all_finite;
use super::pack::{
    as_f32, finite_copy, pack_key_strips, pack_row_strips, pack_transposed_tiles, value_tile_len, NonFinite,
};
use super::simd::{dot, prefetch_part, Simd, SimdPath, STRIP};
use super::{BC, BR};
use crate::attention::mask::{tile_summaries, TileClass};
use crate::attention::{AttnMask, AttnParams};
use crate::host::{HostSlice, HostSliceMut};

/// Attention backward on the CPU, on the inner loops of `simd` (clamped to what this CPU supports): the kernel
/// behind [`CpuBackend`](crate::CpuBackend)'s [`attention_backward`](crate::Backend::attention_backward).
///
/// From `q`, `k`, `v`, the forward output `o`, its gradient `d_o` and the forward `lse`, computes `d_q`
/// `[B, Hq, Sq, D]`, `d_k`, `d_v` `[B, Hkv, Sk, D]` (`d_k`/`d_v` summed over the query heads sharing a KV
/// head). With `accumulate`, the gradients are added to what the buffers hold (ring attention sums several
/// key blocks into one buffer); otherwise they are overwritten.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward_on(
    simd: SimdPath,
    p: &AttnParams<'_>,
    q: HostSlice<'_>,
    k: HostSlice<'_>,
    v: HostSlice<'_>,
    o: HostSlice<'_>,
    d_o: HostSlice<'_>,
    lse: &[f32],
    d_q: HostSliceMut<'_>,
    d_k: HostSliceMut<'_>,
    d_v: HostSliceMut<'_>,
    accumulate: bool,
) {
    let simd = Simd::new(simd);
    let s = p.shape;
    let d = s.head_dim;

    let qf = as_f32(q);
    let kf = as_f32(k);
    let dof = as_f32(d_o);
    let of = as_f32(o);
    let (kt, k_bad) = pack_transposed_tiles(k, &s);
    let (vt, v_bad) = pack_transposed_tiles(v, &s);
    // K again, as the strip-packed right operand of `dS·K` (the transposed tiles above serve `Q·Kᵀ`).
    let ks = pack_key_strips(k, &s);
    let ks_len = value_tile_len(d);
    // Dᵢ = dOᵢ·Oᵢ, and the LSE in base 2 (−inf stays −inf). A row is tainted when its D (so dO or O), its LSE
    // (NaN or +inf; -inf is a row that saw nothing) or its Q holds a non-finite value.
    let mut delta = vec![0f32; s.lse_elems()];
    let mut row_bad = vec![false; s.lse_elems()];
    delta.par_chunks_mut(1024).zip(row_bad.par_chunks_mut(1024)).enumerate().for_each(|(c, (ch, bad))| {
        for (r, (x, b)) in ch.iter_mut().zip(bad).enumerate() {
            let row = c * 1024 + r;
            *x = dot(&dof[row * d..(row + 1) * d], &of[row * d..(row + 1) * d]);
            *b = !x.is_finite()
                || lse[row].is_nan()
                || lse[row] == f32::INFINITY
                || !all_finite(&qf[row * d..(row + 1) * d]);
        }
    });
    let q_tiles = s.q_len.div_ceil(BR);
    let q_tile_bad: Vec<bool> = (0..s.batch * s.q_heads * q_tiles)
        .map(|x| {
            let r0 = (x / q_tiles) * s.q_len + (x % q_tiles) * BR;
            row_bad[r0..r0 + BR.min(s.q_len - (x % q_tiles) * BR)].iter().any(|&b| b)
        })
        .collect();
    let kv_bad: Vec<bool> = k_bad.iter().zip(&v_bad).map(|(k, v)| !k.is_empty() || !v.is_empty()).collect();
    let lse2: Vec<f32> = lse.iter().map(|x| x * LOG2_E).collect();
    let ctx = Ctx {
        p,
        simd,
        c: p.scale * LOG2_E,
        q: &qf,
        d_o: &dof,
        kt: &kt,
        vt: &vt,
        ks: &ks,
        lse2: &lse2,
        delta: &delta,
        q_tile_bad: &q_tile_bad,
        kv_bad: &kv_bad,
        k_bad: &k_bad,
        q_sum: tile_summaries(&p.mask, true, s.q_len, BR),
        k_sum: tile_summaries(&p.mask, false, s.kv_len, BC),
    };
    let k_tiles = s.kv_len.div_ceil(BC);

    let g = s.group();
    let z = query_chunks(&s);
    let heads = s.batch * s.kv_heads;

    // One task per (b, KV head, query chunk z); chunk z holds the query tiles `qt ≡ z (mod Z)` (striped, so a
    // causal mask gives every chunk the same work). The task owns those tiles' dQ for every query head of the
    // group, and sums its contributions to dK, dV of the whole head into its own partial buffer.
    let mut dq_tiles: Vec<Vec<(usize, usize, HostSliceMut<'_>)>> = (0..heads * z).map(|_| Vec::new()).collect();
    for (bh, dq_head) in d_q.into_chunks(s.q_len * d).into_iter().enumerate() {
        let (b, hq) = (bh / s.q_heads, bh % s.q_heads);
        for (qt, dq_t) in dq_head.into_chunks(BR * d).into_iter().enumerate() {
            dq_tiles[(b * s.kv_heads + hq / g) * z + qt % z].push((hq % g, qt, dq_t));
        }
    }
    let part_len = 2 * s.kv_len * d;
    let mut partials = vec![0f32; heads * z * part_len];
    dq_tiles.into_par_iter().zip(partials.par_chunks_mut(part_len)).enumerate().for_each_init(
        || {
            let mut sc = Scratch::new();
            sc.s.resize(BR * LDS, 0.0);
            (sc, BwdScratch::new())
        },
        |(sc, bs), (task, (mut my_dq, part))| {
            let bhk = task / z;
            let b = bhk / s.kv_heads;
            let hk = bhk % s.kv_heads;
            bs.dq.clear();
            bs.dq.resize(my_dq.len() * BR * d, 0.0);
            let (dk_part, dv_part) = part.split_at_mut(s.kv_len * d);
            let slots = my_dq.len();
            let kt_block = key_tiles_per_block(d);
            for t_blk in (0..k_tiles).step_by(kt_block) {
                let blk = t_blk..(t_blk + kt_block).min(k_tiles);
                let next_blk = blk.end..(blk.end + kt_block).min(k_tiles);
                let sees = |x: usize, tiles: std::ops::Range<usize>| {
                    tiles
                        .into_iter()
                        .any(|u| p.mask.classify(&ctx.q_sum[my_dq[x].1], &ctx.k_sum[u]) != TileClass::Hidden)
                };
                for (slot, &(hq_in_group, qt, _)) in my_dq.iter().enumerate() {
                    let bh = b * s.q_heads + hk * g + hq_in_group;
                    let q0 = qt * BR;
                    let rows = BR.min(s.q_len - q0);
                    // The next slot this task computes (later in this block of key tiles, or first in the next
                    // block): its Q, dO and dQ rows are pulled into cache in three slices while this slot's products
                    // run. A task cycles through more rows than L2 holds, so at long contexts they come back from
                    // DRAM on every block.
                    let next = (slot + 1..slots)
                        .find(|&x| sees(x, blk.clone()))
                        .or_else(|| (0..slots).find(|&x| sees(x, next_blk.clone())))
                        .map(|x| {
                            let (h1, qt1) = (my_dq[x].0, my_dq[x].1);
                            let r1 = (b * s.q_heads + hk * g + h1) * s.q_len * d + qt1 * BR * d;
                            let n1 = BR.min(s.q_len - qt1 * BR) * d;
                            (r1, n1, x)
                        });
                    let fetch = |part: usize, dq_all: &[f32]| {
                        if let Some((r1, n1, x)) = next {
                            prefetch_part(&ctx.q[r1..r1 + n1], part, 3);
                            prefetch_part(&ctx.d_o[r1..r1 + n1], part, 3);
                            prefetch_part(&dq_all[x * BR * d..x * BR * d + n1], part, 3);
                        }
                    };
                    let rq = (bh * s.q_len + q0) * d;
                    // This slot's dO and Q rows as strips for `Pᵀ·dO` and `dSᵀ·Q`, packed at its first visible
                    // tile of the block and reused by the rest.
                    let mut packed = false;
                    for t in blk.clone() {
                        let class = p.mask.classify(&ctx.q_sum[qt], &ctx.k_sum[t]);
                        if class == TileClass::Hidden {
                            continue;
                        }
                        if !packed {
                            pack_row_strips(&ctx.d_o[rq..rq + rows * d], d, BR, &mut bs.do_strips);
                            pack_row_strips(&ctx.q[rq..rq + rows * d], d, BR, &mut bs.q_strips);
                            packed = true;
                        }
                        let j0 = t * BC;
                        let bc = BC.min(s.kv_len - j0);
                        let k_tile = &kf[(bhk * s.kv_len + j0) * d..(bhk * s.kv_len + j0 + bc) * d];
                        let dk_t = &mut dk_part[j0 * d..(j0 + bc) * d];
                        let dv_t = &mut dv_part[j0 * d..(j0 + bc) * d];
                        let q_bad = ctx.q_tile_bad[bh * q_tiles + qt];
                        let tainted = q_bad || ctx.kv_bad[bhk * k_tiles + t];
                        let spans = ctx.probs_and_ds(sc, bs, class, bh, bhk, q0, rows, t, tainted);
                        // A partial tile pair with a non-finite operand: P and dS are exactly 0 where hidden (see
                        // `probs_and_ds`), but 0·NaN is NaN, so each product takes its other operand with the
                        // non-finite elements as 0 and adds their terms back for the pairs that are visible.
                        let exact = tainted && class == TileClass::Partial;
                        let (mut d_o_t, mut q_t) = (&ctx.d_o[rq..rq + rows * d], &ctx.q[rq..rq + rows * d]);
                        if exact && q_bad {
                            finite_copy(d_o_t, d, &mut bs.do_clean, &mut bs.do_bad);
                            finite_copy(q_t, d, &mut bs.q_clean, &mut bs.q_bad);
                            (d_o_t, q_t) = (&bs.do_clean, &bs.q_clean);
                        } else {
                            bs.do_bad.clear();
                            bs.q_bad.clear();
                        }
                        let cleaned_q = exact && q_bad;
                        let mut k_t = k_tile;
                        bs.k_bad.clear();
                        if exact && !ctx.k_bad[bhk * k_tiles + t].is_empty() {
                            finite_copy(k_tile, d, &mut bs.k_clean, &mut bs.k_bad);
                            k_t = &bs.k_clean;
                        }
                        let cleaned_k = !bs.k_bad.is_empty();
                        let k_strips = &ctx.ks[(bhk * k_tiles + t) * ks_len..(bhk * k_tiles + t + 1) * ks_len];
                        let vis = |i: usize, j: usize| sc.vis[i * BC + j];
                        fetch(0, &bs.dq);
                        // dV += Pᵀ·dO and dK += dSᵀ·Q, reading P and dS transposed in place (zero outside the spans).
                        // Cleaned copies (rare) are read row-major; everything else from the strips (same sums).
                        if cleaned_q {
                            simd.matmul_at(bc, d, rows, &sc.s, LDS, d_o_t, d, dv_t, d, true);
                        } else {
                            simd.matmul_at_packed_b(bc, d, rows, &sc.s, LDS, &bs.do_strips, BR, dv_t, d, true);
                        }
                        for &(i, dd, x) in &bs.do_bad {
                            (0..bc).filter(|&j| vis(i, j)).for_each(|j| dv_t[j * d + dd] += sc.s[i * LDS + j] * x);
                        }
                        fetch(1, &bs.dq);
                        if cleaned_q {
                            simd.matmul_at(bc, d, rows, &bs.dp, LDS, q_t, d, dk_t, d, true);
                        } else {
                            simd.matmul_at_packed_b(bc, d, rows, &bs.dp, LDS, &bs.q_strips, BR, dk_t, d, true);
                        }
                        for &(i, dd, x) in &bs.q_bad {
                            (0..bc).filter(|&j| vis(i, j)).for_each(|j| dk_t[j * d + dd] += bs.dp[i * LDS + j] * x);
                        }
                        fetch(2, &bs.dq);
                        // dQ += dS·K over each group's span.
                        let dq = &mut bs.dq[slot * BR * d..];
                        for (r0, gr, lo, hi) in product_groups(class, &spans, rows) {
                            let a = &bs.dp[r0 * LDS + lo..];
                            if cleaned_k {
                                simd.matmul(gr, d, hi - lo, a, LDS, &k_t[lo * d..], d, &mut dq[r0 * d..], d, true);
                            } else {
                                let kk = &k_strips[lo * STRIP..];
                                simd.matmul_packed_b(gr, d, hi - lo, a, LDS, kk, BC, &mut dq[r0 * d..], d, true);
                            }
                        }
                        for &(j, dd, x) in &bs.k_bad {
                            (0..rows).filter(|&i| vis(i, j)).for_each(|i| dq[i * d + dd] += bs.dp[i * LDS + j] * x);
                        }
                        sc.spans = spans;
                    }
                }
            }
            for (slot, (_, _, dq_t)) in my_dq.iter_mut().enumerate() {
                let acc = &mut bs.dq[slot * BR * d..slot * BR * d + dq_t.len()];
                simd.scale(acc, p.scale);
                dq_t.store_f32(0, acc, accumulate);
            }
        },
    );

    // dK, dV: the chunks' partials summed in chunk order (fixed, so the result does not depend on threads).
    let mut out = Vec::with_capacity(heads * k_tiles);
    for (bhk, (dk_head, dv_head)) in
        d_k.into_chunks(s.kv_len * d).into_iter().zip(d_v.into_chunks(s.kv_len * d)).enumerate()
    {
        for (t, (dk_t, dv_t)) in dk_head.into_chunks(BC * d).into_iter().zip(dv_head.into_chunks(BC * d)).enumerate() {
            out.push((bhk, t, dk_t, dv_t));
        }
    }
    out.into_par_iter().for_each_init(Vec::new, |acc, (bhk, t, mut dk_t, mut dv_t)| {
        let n = dk_t.len();
        for (which, dst) in [(0usize, &mut dk_t), (1, &mut dv_t)] {
            acc.clear();
            acc.resize(n, 0.0);
            for zi in 0..z {
                let base = (bhk * z + zi) * part_len + which * s.kv_len * d + t * BC * d;
                for (a, x) in acc.iter_mut().zip(&partials[base..base + n]) {
                    *a += *x;
                }
            }
            if which == 0 {
                simd.scale(acc, p.scale);
            }
            dst.store_f32(0, acc, accumulate);
        }
    });
}

/// The leading dimension of the backward's `P` and `dS` tiles (`sc.s`, `bs.dp`): `BC` plus a 64-byte line. The
/// transposed products (`Pᵀ·dO`, `dSᵀ·Q`) pack each block of keys from a 32-byte piece of every query row of the
/// tile; at a stride of `BC` floats (512 bytes) those rows fall into 8 of the 64 L1 sets, 128 lines into 64
/// slots, so every block's packing came from L2. At 576 bytes they spread over all the sets.
const LDS: usize = BC + 16;

/// Key tiles a slot (one query head's query tile) runs through before the task moves to its next slot, so the
/// slot's Q, dO and dQ rows, which at long contexts come from DRAM or L3, are loaded once per block rather than
/// once per key tile. The order of every sum is unchanged (each dK/dV tile still adds the slots in slot order,
/// each dQ tile the key tiles in key order), so results are bit-identical for any block. The block is as long
/// as the block's dK/dV tiles and one slot's rows still fit the 512 KiB L2 of the bench machine: at D = 128
/// that is 2 tiles, at D = 64 (half the bytes per row) 4. Longer blocks only add L2 misses once the tiles no
/// longer fit. Head dims above 128 take 2 (the paired measurements are in bench/log/attention.md).
fn key_tiles_per_block(head_dim: usize) -> usize {
    if head_dim <= 64 {
        4
    } else {
        2
    }
}

/// The row groups `(first row, rows, lo, hi)` a product over one tile runs on, skipping empty spans: a fully
/// visible tile is one group of all its rows (every span is the whole tile), so the micro-kernel takes its
/// tallest register tile (12 rows with AVX-512, where the row groups are only 6); other tiles go group by group
/// over their spans.
fn product_groups(
    class: TileClass,
    spans: &[(usize, usize)],
    rows: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
    let visible = class == TileClass::Visible;
    let groups = if visible { &spans[..spans.len().min(1)] } else { spans };
    groups.iter().enumerate().filter(|(_, &(lo, hi))| lo < hi).map(move |(g, &(lo, hi))| {
        if visible {
            (0, rows, lo, hi)
        } else {
            (g * GROUP, GROUP.min(rows - g * GROUP), lo, hi)
        }
    })
}

/// Query chunks per KV head, from the shape alone (never the thread count, so results stay bit-identical):
/// enough tasks to keep 16 threads busy, but no more partial `dK`, `dV` memory than twice what `dQ` itself
/// takes in `f32` (so memory stays linear in the sequence), one chunk at least, and no more chunks than query
/// tiles. With two query heads per KV head, one chunk per head would be a single task per KV head: equal
/// halves on two threads, so whichever core runs slower (another tenant, a lower clock) leaves the other
/// idle at the end of every call; two chunks let the threads even out.
fn query_chunks(s: &crate::attention::AttnShape) -> usize {
    const TASKS: usize = 16;
    let heads = s.batch * s.kv_heads;
    let for_threads = TASKS.div_ceil(heads);
    let for_memory = (2 * s.q_elems() / (heads * 2 * s.kv_len * s.head_dim)).max(1);
    for_threads.min(for_memory).min(s.q_len.div_ceil(BR)).max(1)
}

/// What the tasks read.
struct Ctx<'a> {
    p: &'a AttnParams<'a>,
    simd: Simd,
    c: f32,
    q: &'a [f32],
    d_o: &'a [f32],
    kt: &'a [f32],
    vt: &'a [f32],
    /// K strip-packed per tile (`pack_key_strips`), for `dS·K`.
    ks: &'a [f32],
    lse2: &'a [f32],
    delta: &'a [f32],
    /// `[B·Hq][query tile]`: the tile has a row with a non-finite Q, dO, O or LSE.
    q_tile_bad: &'a [bool],
    /// `[B·Hkv][key tile]`: the tile has a non-finite K or V.
    kv_bad: &'a [bool],
    /// `[B·Hkv][key tile]`: the non-finite elements of K.
    k_bad: &'a [NonFinite],
    q_sum: Vec<crate::attention::mask::RangeSummary>,
    k_sum: Vec<crate::attention::mask::RangeSummary>,
}

impl Ctx<'_> {
    /// For query rows `q0..q0+rows` of head `bh` against key tile `t` of KV head `bhk`: leaves `P` in `sc.s`
    /// and `dS` in `bs.dp`, both valid inside the returned spans (clipped to the tile's keys). With `tainted`
    /// (an operand of the pair is not finite), hidden entries are set to exactly 0 (rather than computed as
    /// `0·(dP − D)`, NaN when `dP` or `D` is), and a row that sees a non-finite score or has a non-finite LSE
    /// gets NaN at every entry it sees (the SIMD `exp2` would give 0 there, hiding the NaN).
    #[allow(clippy::too_many_arguments)]
    fn probs_and_ds(
        &self,
        sc: &mut Scratch,
        bs: &mut BwdScratch,
        class: TileClass,
        bh: usize,
        bhk: usize,
        q0: usize,
        rows: usize,
        t: usize,
        tainted: bool,
    ) -> Vec<(usize, usize)> {
        let s = self.p.shape;
        let d = s.head_dim;
        let mask: &AttnMask<'_> = &self.p.mask;
        let k_tiles = s.kv_len.div_ceil(BC);
        let j0 = t * BC;
        let bc = BC.min(s.kv_len - j0);
        let tile = (bhk * k_tiles + t) * d * BC;
        let kt_tile = &self.kt[tile..tile + d * BC];
        let vt_tile = &self.vt[tile..tile + d * BC];
        let rq = (bh * s.q_len + q0) * d;
        let q_tile = &self.q[rq..rq + rows * d];
        let do_tile = &self.d_o[rq..rq + rows * d];
        let mut spans = sc.spans(mask, class, rows, q0, j0, bc);
        for (r0, gr, lo, hi) in product_groups(class, &spans, rows) {
            self.simd.matmul_packed_b(
                gr,
                hi - lo,
                d,
                &q_tile[r0 * d..],
                d,
                &kt_tile[lo * d..],
                d,
                &mut sc.s[r0 * LDS + lo..],
                LDS,
                false,
            );
            self.simd.matmul_packed_b(
                gr,
                hi - lo,
                d,
                &do_tile[r0 * d..],
                d,
                &vt_tile[lo * d..],
                d,
                &mut bs.dp[r0 * LDS + lo..],
                LDS,
                false,
            );
        }
        for span in spans.iter_mut() {
            span.1 = span.1.min(bc);
        }
        for i in 0..rows {
            let (lo, hi) = spans[i / GROUP];
            // Outside its span a row has no probability mass: zero it so products over whole rows are exact.
            let (lo_z, hi_z) = if lo >= hi { (bc, bc) } else { (lo, hi) };
            sc.s[i * LDS..i * LDS + lo_z].fill(0.0);
            sc.s[i * LDS + hi_z.max(lo_z)..i * LDS + bc].fill(0.0);
            bs.dp[i * LDS..i * LDS + lo_z].fill(0.0);
            bs.dp[i * LDS + hi_z.max(lo_z)..i * LDS + bc].fill(0.0);
            if lo >= hi {
                continue;
            }
            let row = bh * s.q_len + q0 + i;
            let srow = &mut sc.s[i * LDS + lo..i * LDS + hi];
            let lse2 = self.lse2[row];
            if lse2 == f32::NEG_INFINITY {
                // The row saw no key in the forward pass: it has no probability mass anywhere.
                srow.fill(0.0);
                bs.dp[i * LDS + lo..i * LDS + hi].fill(0.0);
                continue;
            }
            if class == TileClass::Partial {
                for (x, &ok) in srow.iter_mut().zip(&sc.vis[i * BC + lo..i * BC + hi]) {
                    if !ok {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
            let poisoned = tainted
                && (lse2.is_nan() || lse2 == f32::INFINITY || srow.iter().any(|x| x.is_nan() || *x == f32::INFINITY));
            let dprow = &mut bs.dp[i * LDS + lo..i * LDS + hi];
            self.simd.probs_and_ds(srow, dprow, self.c, lse2, self.delta[row]);
            if tainted {
                let partial = class == TileClass::Partial;
                for (j, (pr, ds)) in (lo..hi).zip(srow.iter_mut().zip(dprow.iter_mut())) {
                    if partial && !sc.vis[i * BC + j] {
                        (*pr, *ds) = (0.0, 0.0);
                    } else if poisoned {
                        (*pr, *ds) = (f32::NAN, f32::NAN);
                    }
                }
            }
        }
        spans
    }
}

/// Buffers of the backward tasks, reused across the tasks of one worker.
struct BwdScratch {
    dp: Vec<f32>,
    dq: Vec<f32>,
    /// A tile pair's dO, Q and K with non-finite elements as 0, and those elements (tainted pairs only).
    do_clean: Vec<f32>,
    do_bad: NonFinite,
    q_clean: Vec<f32>,
    q_bad: NonFinite,
    k_clean: Vec<f32>,
    k_bad: NonFinite,
    /// The current slot's dO and Q rows, strip-packed (`pack_row_strips`).
    do_strips: Vec<f32>,
    q_strips: Vec<f32>,
}

impl BwdScratch {
    fn new() -> Self {
        Self {
            dp: vec![0.0; BR * LDS],
            dq: Vec::new(),
            do_clean: Vec::new(),
            do_bad: Vec::new(),
            q_clean: Vec::new(),
            q_bad: Vec::new(),
            k_clean: Vec::new(),
            k_bad: Vec::new(),
            do_strips: Vec::new(),
            q_strips: Vec::new(),
        }
    }
}
