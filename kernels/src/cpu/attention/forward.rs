//! Attention forward: tiled, online softmax, never holding an `Sq × Sk` matrix.
//!
//! One task per (batch, KV head, query tile of `BR` rows) runs over the key tiles in order and, for every query
//! head of the group in turn (GQA: the K/V tile is loaded once for all of them), keeps the running row maximum `m`, row sum `l` and un-normalised output `acc`:
//! `S = c·Q·Kᵀ` (with `c = scale·log2 e`, so `exp2` replaces `exp`), `m' = max(m, rowmax S)`,
//! `P = 2^(S - m')`, `l = 2^(m - m')·l + rowsum P`, `acc = 2^(m - m')·acc + P·V`.
//! At the end `O = acc / l` and `LSE = ln 2 · (m + log2 l)`.
//! Key tiles the mask hides from the whole query tile are skipped; in a partly hidden tile each group of six
//! rows computes only the span of keys that some row of the group sees (about half of a causal diagonal tile).
//! Within a span, hidden scores are selected to -inf (so `P = 0` exactly) and `V` enters the product with its
//! non-finite elements as 0, added back afterwards to the rows that see them: a hidden NaN never meets a 0.

use std::f32::consts::{LN_2, LOG2_E};

use rayon::prelude::*;

use super::pack::{all_finite, pack_transposed_tiles, pack_value_strips, value_tile_len};
use super::simd::{prefetch_part, Simd, SimdPath, STRIP};
use super::{BC, BR};
use crate::attention::mask::{tile_summaries, TileClass};
use crate::attention::AttnParams;
use crate::host::{HostSlice, HostSliceMut};

/// Rows per register block of the micro-kernel; partial tiles are cut into groups of this many rows.
pub(crate) const GROUP: usize = 6;
/// Rows of a product between two slices of the next tile's prefetch (a multiple of `GROUP`).
const PF_ROWS: usize = 2 * GROUP;

/// Attention forward on the CPU, on the inner loops of `simd` (clamped to what this CPU supports, so `Avx512`
/// means "the best there is"): the kernel behind [`CpuBackend`](crate::CpuBackend)'s
/// [`attention_forward`](crate::Backend::attention_forward).
///
/// Inputs `q` `[B, Hq, Sq, D]`, `k`, `v` `[B, Hkv, Sk, D]` (each `f32` or `bf16`); writes `o` `[B, Hq, Sq, D]`
/// (`f32` or `bf16`) and `lse` `[B, Hq, Sq]`. Every element of both outputs is written.
pub(crate) fn attention_forward_on(
    simd: SimdPath,
    p: &AttnParams<'_>,
    q: HostSlice<'_>,
    k: HostSlice<'_>,
    v: HostSlice<'_>,
    o: HostSliceMut<'_>,
    lse: &mut [f32],
) {
    let simd = Simd::new(simd);
    let s = p.shape;
    let d = s.head_dim;
    let mask = &p.mask;
    let c = p.scale * LOG2_E;

    // V is packed with its non-finite elements as 0 and listed in `v_bad`, so that `P·V` over a span stays exact
    // for the rows that do not see them (0·NaN would be NaN); the rows that see one get it added back below.
    let (vp, v_bad) = pack_value_strips(v, &s);
    let v_len = value_tile_len(d);
    let (kt, k_bad) = pack_transposed_tiles(k, &s);
    let q_sum = tile_summaries(mask, true, s.q_len, BR);
    let k_sum = tile_summaries(mask, false, s.kv_len, BC);
    let k_tiles = s.kv_len.div_ceil(BC);

    // One task per (b, KV head, query tile), owning those rows of O and LSE for every query head of the group:
    // each K/V tile is loaded once and used by all of them while it is hot in cache.
    let g = s.group();
    let q_tiles = q_sum.len();
    let mut tasks: Vec<Vec<(usize, HostSliceMut<'_>, &mut [f32])>> =
        (0..s.batch * s.kv_heads * q_tiles).map(|_| Vec::with_capacity(g)).collect();
    for (bh, (o_head, lse_head)) in o.into_chunks(s.q_len * d).into_iter().zip(lse.chunks_mut(s.q_len)).enumerate() {
        let (b, hq) = (bh / s.q_heads, bh % s.q_heads);
        for (qt, (o_tile, lse_tile)) in o_head.into_chunks(BR * d).into_iter().zip(lse_head.chunks_mut(BR)).enumerate()
        {
            tasks[(b * s.kv_heads + hq / g) * q_tiles + qt].push((hq, o_tile, lse_tile));
        }
    }

    // Costliest tasks first (those seeing the most key tiles, e.g. the last query tiles under a causal mask), so
    // the cheap ones are what is left to even out the threads at the end. Each task writes only its own rows,
    // so the order cannot change any result.
    let cost: Vec<usize> = (0..q_tiles)
        .map(|qt| (0..k_tiles).filter(|&t| mask.classify(&q_sum[qt], &k_sum[t]) != TileClass::Hidden).count())
        .collect();
    let mut tasks: Vec<_> = tasks.into_iter().enumerate().collect();
    tasks.sort_by_key(|(task, _)| std::cmp::Reverse(cost[task % q_tiles]));

    tasks.into_par_iter().for_each_init(Scratch::new, |sc, (task, mut heads)| {
        let (kv_head, qt) = (task / q_tiles, task % q_tiles);
        let b = kv_head / s.kv_heads;
        let rows = heads[0].2.len();
        let q0 = qt * BR;
        sc.reset(heads.len(), rows, d);
        // The group's query tiles, widened once into one contiguous buffer: no bf16 copy of all of Q, and the
        // heads' tiles (a whole head apart in `q`, so on the same L2 sets) no longer compete for the same ways.
        for (h, (hq, _, _)) in heads.iter().enumerate() {
            let bh = b * s.q_heads + hq;
            q.load_f32((bh * s.q_len + q0) * d, &mut sc.q[h * BR * d..h * BR * d + rows * d]);
        }
        let q_bad = heads.iter().enumerate().any(|(h, _)| !all_finite(&sc.q[h * BR * d..h * BR * d + rows * d]));
        for t in 0..k_tiles {
            let class = mask.classify(&q_sum[qt], &k_sum[t]);
            if class == TileClass::Hidden {
                continue;
            }
            let j0 = t * BC;
            let bc = BC.min(s.kv_len - j0);
            let kt_tile = &kt[(kv_head * k_tiles + t) * d * BC..(kv_head * k_tiles + t + 1) * d * BC];
            let v_tile = &vp[(kv_head * k_tiles + t) * v_len..(kv_head * k_tiles + t + 1) * v_len];
            let v_bad_tile = &v_bad[kv_head * k_tiles + t];
            // Scores can only be non-finite when Q or K is: only then are the rows checked for them.
            let scores_bad = q_bad || !k_bad[kv_head * k_tiles + t].is_empty();
            // The next key tile, pulled into cache a slice at a time while this one is computed: once K and V of a
            // head outgrow the cache (S >= 4096 at D = 128) they come from DRAM on every task, and the products
            // would otherwise stall on each tile's first loads.
            let next = (t + 1 < k_tiles && mask.classify(&q_sum[qt], &k_sum[t + 1]) != TileClass::Hidden).then(|| {
                let kt1 = &kt[(kv_head * k_tiles + t + 1) * d * BC..(kv_head * k_tiles + t + 2) * d * BC];
                (kt1, &vp[(kv_head * k_tiles + t + 1) * v_len..(kv_head * k_tiles + t + 2) * v_len])
            });
            // Prefetch slices: one after each `PF_ROWS` rows of each product, so the requests are spread evenly
            // over the tile's compute rather than issued in one burst that the miss buffers cannot all hold.
            let chunks = rows.div_ceil(PF_ROWS);
            let parts = 2 * heads.len() * chunks;
            let fetch = |phase: usize, ci: usize| {
                if let Some((kt1, v1)) = next {
                    prefetch_part(kt1, phase * chunks + ci, parts);
                    prefetch_part(v1, phase * chunks + ci, parts);
                }
            };
            // The mask is shared by all heads: one set of spans (and visibility) serves the whole group.
            let spans = sc.spans(mask, class, rows, q0, j0, bc);
            for h in 0..heads.len() {
                let q_tile = &sc.q[h * BR * d..h * BR * d + rows * d];
                let (m, l) = (&mut sc.m[h * BR..h * BR + rows], &mut sc.l[h * BR..h * BR + rows]);
                let acc = &mut sc.acc[h * BR * d..h * BR * d + rows * d];
                let st = &mut sc.s;
                // S = Q·Kᵀ over each row group's span; a fully visible tile needs no spans, only the prefetch slices.
                if class == TileClass::Visible {
                    for (ci, r0) in (0..rows).step_by(PF_ROWS).enumerate() {
                        let r = PF_ROWS.min(rows - r0);
                        simd.matmul_packed_b(
                            r,
                            spans[0].1,
                            d,
                            &q_tile[r0 * d..],
                            d,
                            kt_tile,
                            d,
                            &mut st[r0 * BC..],
                            BC,
                            false,
                        );
                        fetch(2 * h, ci);
                    }
                } else {
                    (0..chunks).for_each(|ci| fetch(2 * h, ci));
                }
                for (gi, &(lo, hi)) in spans.iter().enumerate().filter(|_| class != TileClass::Visible) {
                    if lo >= hi {
                        continue;
                    }
                    let r0 = gi * GROUP;
                    let gr = GROUP.min(rows - r0);
                    let dst = &mut st[r0 * BC + lo..];
                    simd.matmul_packed_b(gr, hi - lo, d, &q_tile[r0 * d..], d, &kt_tile[lo * d..], d, dst, BC, false);
                }
                // Online softmax, row by row.
                for i in 0..rows {
                    let (lo, hi) = spans[i / GROUP];
                    let hi = hi.min(bc);
                    if lo >= hi {
                        continue;
                    }
                    let srow = &mut st[i * BC + lo..i * BC + hi];
                    if class == TileClass::Partial {
                        // A select, not a product: a hidden score is -inf whatever Q·K gave (NaN included).
                        for (x, &ok) in srow.iter_mut().zip(&sc.vis[i * BC + lo..i * BC + hi]) {
                            if !ok {
                                *x = f32::NEG_INFINITY;
                            }
                        }
                    }
                    // A NaN or +inf score the row sees poisons the row. The SIMD `exp2` would turn it into 0 (and
                    // `max` skips NaN), silently dropping the key, so it is marked and the row made NaN at the end.
                    if scores_bad && srow.iter().any(|x| x.is_nan() || *x == f32::INFINITY) {
                        sc.poisoned[h * BR + i] = true;
                    }
                    let mx = simd.max(srow) * c;
                    if mx == f32::NEG_INFINITY {
                        srow.fill(0.0);
                        continue;
                    }
                    let m_new = m[i].max(mx);
                    let sum = simd.exp2_scaled_sum(srow, c, m_new);
                    // Rescale what was accumulated under the old maximum only when it rose: after the first few
                    // key tiles a row's maximum rarely moves, and this skips a scalar `exp2` call per row and
                    // tile. (`m[i]` starts at -inf, which gives 0.) The same values as always rescaling, since
                    // `exp2(0) = 1` exactly.
                    if m_new > m[i] {
                        let alpha = (m[i] - m_new).exp2();
                        l[i] *= alpha;
                        simd.scale(&mut acc[i * d..(i + 1) * d], alpha);
                        m[i] = m_new;
                    }
                    l[i] += sum;
                }
                // acc += P·V over each row group's span (one product when the tile is fully visible).
                if class == TileClass::Visible {
                    for (ci, r0) in (0..rows).step_by(PF_ROWS).enumerate() {
                        let r = PF_ROWS.min(rows - r0);
                        simd.matmul_packed_b(r, d, bc, &st[r0 * BC..], BC, v_tile, BC, &mut acc[r0 * d..], d, true);
                        fetch(2 * h + 1, ci);
                    }
                } else {
                    (0..chunks).for_each(|ci| fetch(2 * h + 1, ci));
                }
                for (gi, &(lo, hi)) in spans.iter().enumerate().filter(|_| class != TileClass::Visible) {
                    let hi = hi.min(bc);
                    if lo >= hi {
                        continue;
                    }
                    let r0 = gi * GROUP;
                    let gr = GROUP.min(rows - r0);
                    let p_rows = &st[r0 * BC + lo..];
                    simd.matmul_packed_b(
                        gr,
                        d,
                        hi - lo,
                        p_rows,
                        BC,
                        &v_tile[lo * STRIP..],
                        BC,
                        &mut acc[r0 * d..],
                        d,
                        true,
                    );
                }
                // The non-finite values of V, added to the rows that see them (their P is in `st`).
                for &(j, dd, x) in v_bad_tile {
                    for i in 0..rows {
                        if class == TileClass::Visible || sc.vis[i * BC + j] {
                            acc[i * d + dd] += st[i * BC + j] * x;
                        }
                    }
                }
            }
            sc.spans = spans;
        }
        // O = acc / l, LSE = ln2·(m + log2 l); rows that saw nothing get O = 0, LSE = -inf, rows that saw a
        // non-finite score NaN.
        for (h, (_, o_tile, lse_tile)) in heads.iter_mut().enumerate() {
            let acc = &mut sc.acc[h * BR * d..h * BR * d + rows * d];
            for (i, lse_i) in lse_tile.iter_mut().enumerate() {
                let row = &mut acc[i * d..(i + 1) * d];
                let (m, l) = (sc.m[h * BR + i], sc.l[h * BR + i]);
                if sc.poisoned[h * BR + i] || l.is_nan() {
                    row.fill(f32::NAN);
                    *lse_i = f32::NAN;
                } else if l > 0.0 {
                    simd.scale(row, 1.0 / l);
                    *lse_i = LN_2 * (m + l.log2());
                } else {
                    row.fill(0.0);
                    *lse_i = f32::NEG_INFINITY;
                }
            }
            o_tile.store_f32(0, acc, false);
        }
    });
}

/// Per-task buffers, reused across the tasks one worker runs.
pub(crate) struct Scratch {
    pub s: Vec<f32>,
    pub acc: Vec<f32>,
    /// The forward task's query tiles, `f32`, head `h` at offset `h·BR·d`.
    pub q: Vec<f32>,
    pub m: Vec<f32>,
    pub l: Vec<f32>,
    /// Rows (head `h` at offset `h·BR`) that saw a non-finite score.
    pub poisoned: Vec<bool>,
    pub vis: Vec<bool>,
    pub spans: Vec<(usize, usize)>,
}

impl Scratch {
    pub fn new() -> Self {
        Self {
            s: vec![0.0; BR * BC],
            acc: Vec::new(),
            q: Vec::new(),
            m: vec![0.0; BR],
            l: vec![0.0; BR],
            poisoned: Vec::new(),
            vis: vec![false; BR * BC],
            spans: Vec::with_capacity(BR.div_ceil(GROUP)),
        }
    }

    /// Fresh softmax state for `heads` heads of `rows` rows (head `h` at offset `h·BR` rows).
    fn reset(&mut self, heads: usize, rows: usize, d: usize) {
        self.acc.clear();
        self.acc.resize(heads * BR * d, 0.0);
        self.q.resize(heads * BR * d, 0.0);
        self.m.clear();
        self.m.resize(heads * BR, f32::NEG_INFINITY);
        self.l.clear();
        self.l.resize(heads * BR, 0.0);
        self.poisoned.clear();
        self.poisoned.resize(heads * BR, false);
        debug_assert!(rows <= BR);
    }

    /// For each group of `GROUP` rows, the span `[lo, hi)` of key columns that some row of the group sees: `lo`
    /// a multiple of `STRIP` (where a strip of the packed keys starts), `hi` of 8, within the tile padded to a
    /// multiple of 8. For partial tiles it also fills `vis`.
    pub fn spans(
        &mut self,
        mask: &crate::attention::AttnMask<'_>,
        class: TileClass,
        rows: usize,
        q0: usize,
        j0: usize,
        bc: usize,
    ) -> Vec<(usize, usize)> {
        let bcp = bc.next_multiple_of(8);
        let groups = rows.div_ceil(GROUP);
        let mut spans = std::mem::take(&mut self.spans);
        spans.clear();
        if class == TileClass::Visible {
            spans.resize(groups, (0, bcp));
            return spans;
        }
        for g in 0..groups {
            let (mut lo, mut hi) = (usize::MAX, 0);
            for i in g * GROUP..((g + 1) * GROUP).min(rows) {
                for j in 0..bc {
                    let ok = mask.visible(q0 + i, j0 + j);
                    self.vis[i * BC + j] = ok;
                    if ok {
                        lo = lo.min(j);
                        hi = hi.max(j + 1);
                    }
                }
            }
            if lo == usize::MAX {
                spans.push((0, 0));
            } else {
                spans.push((lo / STRIP * STRIP, hi.next_multiple_of(8).min(bcp)));
            }
        }
        spans
    }
}
