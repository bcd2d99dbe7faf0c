//! Attention backward, recomputing the probabilities tile by tile from the saved `LSE`.
//!
//! With `P = exp(scale·Q·Kᵀ − LSE)` (rows), `Dᵢ = dOᵢ·Oᵢ`:
//! `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ∘ (dP − D)`, `dQ = scale·dS·K`, `dK = scale·dSᵀ·Q`.
//!
//! Two passes keep every output element owned by one task, so no atomics and no thread-count-dependent
//! reduction order: pass A, one task per (batch, KV head, key tile), sums `dK`, `dV` over the query heads of
//! the group and every query tile, in order; pass B, one task per (batch, query head, query tile), sums `dQ`
//! over the key tiles. Both recompute `P` and `dS` (7 tile products instead of 5), the price of determinism.

use std::f32::consts::LOG2_E;

use rayon::prelude::*;

use super::forward::{Scratch, GROUP};
use super::mask::{tile_summaries, TileClass};
use super::pack::{as_f32, pack_transposed_tiles};
use super::simd;
use super::{AttnMask, AttnParams, BC, BR};
use crate::error::Result;
use crate::view::{HostSlice, HostSliceMut};

/// Attention backward on the CPU.
///
/// From `q`, `k`, `v`, the forward output `o`, its gradient `d_o` and the forward `lse`, computes `d_q`
/// `[B, Hq, Sq, D]`, `d_k`, `d_v` `[B, Hkv, Sk, D]` (`d_k`/`d_v` summed over the query heads sharing a KV
/// head). With `accumulate`, the gradients are added to what the buffers hold (ring attention sums several
/// key blocks into one buffer); otherwise they are overwritten.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
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
) -> Result<()> {
    p.validate()?;
    p.check_q("q", q.len())?;
    p.check_kv("k", k.len())?;
    p.check_kv("v", v.len())?;
    p.check_q("o", o.len())?;
    p.check_q("d_o", d_o.len())?;
    p.check_lse("lse", lse.len())?;
    p.check_q("d_q", d_q.len())?;
    p.check_kv("d_k", d_k.len())?;
    p.check_kv("d_v", d_v.len())?;
    let s = p.shape;
    let d = s.head_dim;

    let qf = as_f32(q);
    let kf = as_f32(k);
    let dof = as_f32(d_o);
    let of = as_f32(o);
    let kt = pack_transposed_tiles(k, &s);
    let vt = pack_transposed_tiles(v, &s);
    // Dᵢ = dOᵢ·Oᵢ, and the LSE in base 2 (−inf stays −inf).
    let mut delta = vec![0f32; s.lse_elems()];
    delta.par_chunks_mut(1024).enumerate().for_each(|(c, ch)| {
        for (r, x) in ch.iter_mut().enumerate() {
            let row = c * 1024 + r;
            *x = simd::dot(&dof[row * d..(row + 1) * d], &of[row * d..(row + 1) * d]);
        }
    });
    let lse2: Vec<f32> = lse.iter().map(|x| x * LOG2_E).collect();
    let ctx = Ctx {
        p,
        c: p.scale * LOG2_E,
        q: &qf,
        d_o: &dof,
        kt: &kt,
        vt: &vt,
        lse2: &lse2,
        delta: &delta,
        q_sum: tile_summaries(&p.mask, true, s.q_len, BR),
        k_sum: tile_summaries(&p.mask, false, s.kv_len, BC),
    };
    let k_tiles = s.kv_len.div_ceil(BC);
    let q_tiles = s.q_len.div_ceil(BR);

    // Pass A: dK, dV per (b, hkv, key tile).
    let mut tasks = Vec::with_capacity(s.batch * s.kv_heads * k_tiles);
    for (bh, (dk_head, dv_head)) in
        d_k.into_chunks(s.kv_len * d).into_iter().zip(d_v.into_chunks(s.kv_len * d)).enumerate()
    {
        for (t, (dk_t, dv_t)) in dk_head.into_chunks(BC * d).into_iter().zip(dv_head.into_chunks(BC * d)).enumerate() {
            tasks.push((bh, t, dk_t, dv_t));
        }
    }
    tasks.into_par_iter().for_each_init(
        || (Scratch::new(), BwdScratch::new()),
        |(sc, bs), (bhk, t, mut dk_t, mut dv_t)| {
            let (b, hk) = (bhk / s.kv_heads, bhk % s.kv_heads);
            let j0 = t * BC;
            let bc = BC.min(s.kv_len - j0);
            bs.dk.clear();
            bs.dk.resize(bc * d, 0.0);
            bs.dv.clear();
            bs.dv.resize(bc * d, 0.0);
            for hq in hk * s.group()..(hk + 1) * s.group() {
                let bh = b * s.q_heads + hq;
                for qt in 0..q_tiles {
                    let class = p.mask.classify(&ctx.q_sum[qt], &ctx.k_sum[t]);
                    if class == TileClass::Hidden {
                        continue;
                    }
                    let q0 = qt * BR;
                    let rows = BR.min(s.q_len - q0);
                    let spans = ctx.probs_and_ds(sc, bs, class, bh, bhk, q0, rows, t);
                    sc.spans = spans;
                    // dV += Pᵀ·dO and dK += dSᵀ·Q, reading P and dS transposed in place (zero outside the spans).
                    let rq = (bh * s.q_len + q0) * d;
                    simd::matmul_at(bc, d, rows, &sc.s, BC, &ctx.d_o[rq..rq + rows * d], d, &mut bs.dv, d, true);
                    simd::matmul_at(bc, d, rows, &bs.dp, BC, &ctx.q[rq..rq + rows * d], d, &mut bs.dk, d, true);
                }
            }
            simd::scale(&mut bs.dk, p.scale);
            dk_t.store_f32(0, &bs.dk, accumulate);
            dv_t.store_f32(0, &bs.dv, accumulate);
        },
    );

    // Pass B: dQ per (b, hq, query tile).
    let mut tasks = Vec::with_capacity(s.batch * s.q_heads * q_tiles);
    for (bh, dq_head) in d_q.into_chunks(s.q_len * d).into_iter().enumerate() {
        for (qt, dq_t) in dq_head.into_chunks(BR * d).into_iter().enumerate() {
            tasks.push((bh, qt, dq_t));
        }
    }
    tasks.into_par_iter().for_each_init(
        || (Scratch::new(), BwdScratch::new()),
        |(sc, bs), (bh, qt, mut dq_t)| {
            let (b, hq) = (bh / s.q_heads, bh % s.q_heads);
            let bhk = b * s.kv_heads + hq / s.group();
            let q0 = qt * BR;
            let rows = BR.min(s.q_len - q0);
            bs.dq.clear();
            bs.dq.resize(rows * d, 0.0);
            for t in 0..k_tiles {
                let class = p.mask.classify(&ctx.q_sum[qt], &ctx.k_sum[t]);
                if class == TileClass::Hidden {
                    continue;
                }
                let j0 = t * BC;
                let bc = BC.min(s.kv_len - j0);
                let spans = ctx.probs_and_ds(sc, bs, class, bh, bhk, q0, rows, t);
                let k_tile = &kf[(bhk * s.kv_len + j0) * d..(bhk * s.kv_len + j0 + bc) * d];
                for (g, &(lo, hi)) in spans.iter().enumerate() {
                    let hi = hi.min(bc);
                    if lo >= hi {
                        continue;
                    }
                    let r0 = g * GROUP;
                    let gr = GROUP.min(rows - r0);
                    simd::matmul(
                        gr,
                        d,
                        hi - lo,
                        &bs.dp[r0 * BC + lo..],
                        BC,
                        &k_tile[lo * d..],
                        d,
                        &mut bs.dq[r0 * d..],
                        d,
                        true,
                    );
                }
                sc.spans = spans;
            }
            simd::scale(&mut bs.dq, p.scale);
            dq_t.store_f32(0, &bs.dq, accumulate);
        },
    );
    Ok(())
}

/// What both passes read.
struct Ctx<'a> {
    p: &'a AttnParams<'a>,
    c: f32,
    q: &'a [f32],
    d_o: &'a [f32],
    kt: &'a [f32],
    vt: &'a [f32],
    lse2: &'a [f32],
    delta: &'a [f32],
    q_sum: Vec<super::mask::RangeSummary>,
    k_sum: Vec<super::mask::RangeSummary>,
}

impl Ctx<'_> {
    /// For query rows `q0..q0+rows` of head `bh` against key tile `t` of KV head `bhk`: leaves `P` in `sc.s`
    /// and `dS` in `bs.dp`, both valid inside the returned spans (clipped to the tile's keys).
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
        for (g, span) in spans.iter_mut().enumerate() {
            let (lo, hi) = *span;
            if lo >= hi {
                continue;
            }
            let r0 = g * GROUP;
            let gr = GROUP.min(rows - r0);
            simd::matmul(
                gr,
                hi - lo,
                d,
                &q_tile[r0 * d..],
                d,
                &kt_tile[lo..],
                BC,
                &mut sc.s[r0 * BC + lo..],
                BC,
                false,
            );
            simd::matmul(
                gr,
                hi - lo,
                d,
                &do_tile[r0 * d..],
                d,
                &vt_tile[lo..],
                BC,
                &mut bs.dp[r0 * BC + lo..],
                BC,
                false,
            );
            span.1 = hi.min(bc);
        }
        for i in 0..rows {
            let (lo, hi) = spans[i / GROUP];
            // Outside its span a row has no probability mass: zero it so products over whole rows are exact.
            let (lo_z, hi_z) = if lo >= hi { (bc, bc) } else { (lo, hi) };
            sc.s[i * BC..i * BC + lo_z].fill(0.0);
            sc.s[i * BC + hi_z.max(lo_z)..i * BC + bc].fill(0.0);
            bs.dp[i * BC..i * BC + lo_z].fill(0.0);
            bs.dp[i * BC + hi_z.max(lo_z)..i * BC + bc].fill(0.0);
            if lo >= hi {
                continue;
            }
            let row = bh * s.q_len + q0 + i;
            let srow = &mut sc.s[i * BC + lo..i * BC + hi];
            let lse2 = self.lse2[row];
            if lse2 == f32::NEG_INFINITY {
                // The row saw no key in the forward pass: it has no probability mass anywhere.
                srow.fill(0.0);
                bs.dp[i * BC + lo..i * BC + hi].fill(0.0);
                continue;
            }
            if class == TileClass::Partial {
                for (x, &ok) in srow.iter_mut().zip(&sc.vis[i * BC + lo..i * BC + hi]) {
                    if !ok {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
            simd::exp2_scaled_sum(srow, self.c, lse2);
            let di = self.delta[row];
            for (dp, &pr) in bs.dp[i * BC + lo..i * BC + hi].iter_mut().zip(srow.iter()) {
                *dp = pr * (*dp - di);
            }
        }
        spans
    }
}

/// Buffers of the backward tasks, reused across the tasks of one worker.
struct BwdScratch {
    dp: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    dq: Vec<f32>,
}

impl BwdScratch {
    fn new() -> Self {
        Self { dp: vec![0.0; BR * BC], dk: Vec::new(), dv: Vec::new(), dq: Vec::new() }
    }
}
