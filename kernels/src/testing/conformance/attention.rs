//! Attention: forward, backward and merge against [`crate::attention::reference`] (f64, softmax materialised row
//! by row) and the CPU backend.
//!
//! Properties:
//! - forward and backward, on drawn shapes (GQA, lengths that are no multiple of any tile), masks (causal, window,
//!   documents, explicit positions such as a zigzag shard's two ranges, rows that see no key), the softmax scale,
//!   every element type (gradients in `f32` or the inputs' type) and both [`GradMode`]s; rows that see no key must
//!   give exactly `O = 0`, `LSE = -inf` and no gradient;
//! - the merge of the forwards over two key sets equals the forward over their union;
//! - fixed cases: decoding shapes (`Sq = 1`, `Sk = 1`), windows crossing tile borders, the largest head dims, a
//!   long causal `bf16` run (sized by [`Limits`]); the shapes of a GPU's tensor-core path ([`tensor_core`]);
//!   extreme and `-inf` log-sum-exps in the merge; the gradients against central differences of the backend's own
//!   forward.

use std::fmt;

use proptest::prelude::*;

use super::data::DataRng;
use super::harness::{At, Ctx, Expect, Fault, Mem, Output};
use super::strategies::{self, MaskCase};
use super::tolerance::{ATTENTION, ATTENTION_GRAD, FINITE_DIFFERENCES};
use super::{Failure, Limits};
use crate::attention::{
    reference, AttnGrads, AttnOptions, AttnOut, AttnParams, AttnPartial, AttnSaved, AttnShape, Qkv,
};
use crate::backend::{Backend, GradMode};
use crate::dtype::DType;

/// One attention problem: sizes, element types, mask, scale, gradient mode and the seed of its data.
#[derive(Clone)]
pub struct AttnCase {
    /// Sizes.
    pub shape: AttnShape,
    /// `Q`, `K`, `V`, `O` and `dO`.
    pub dtype: DType,
    /// `dQ`, `dK`, `dV`: `f32`, or the inputs' type.
    pub grad_dtype: DType,
    /// The mask and the rows' positions and documents.
    pub mask: MaskCase,
    /// The softmax scale (`None`: `1/√D`).
    pub scale: Option<f32>,
    /// Whether the backward adds to gradients that hold values already.
    pub mode: GradMode,
    /// The seed of the data.
    pub seed: u64,
}

impl fmt::Debug for AttnCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.shape;
        write!(
            f,
            "AttnCase {{ B {} Hq {} Hkv {} Sq {} Sk {} D {}, {} (grads {}), {:?}, scale {:?}, {:?}, seed {:#x} }}",
            s.batch,
            s.q_heads,
            s.kv_heads,
            s.q_len,
            s.kv_len,
            s.head_dim,
            self.dtype.name(),
            self.grad_dtype.name(),
            self.mask,
            self.scale,
            self.mode,
            self.seed
        )
    }
}

impl AttnCase {
    /// A case of `shape` with `mask`, `f32`, the default scale, overwritten gradients.
    pub fn new(shape: AttnShape, mask: MaskCase, seed: u64) -> Self {
        AttnCase {
            shape,
            dtype: DType::F32,
            grad_dtype: DType::F32,
            mask,
            scale: None,
            mode: GradMode::Overwrite,
            seed,
        }
    }
    /// The options of the backend calls.
    pub fn options(&self) -> AttnOptions<'_> {
        AttnOptions { mask: self.mask.mask(), scale: self.scale }
    }
    /// The parameters of the reference (the default scale resolved).
    pub fn params(&self) -> AttnParams<'_> {
        self.options().params(self.shape).expect("a drawn case is valid")
    }
    /// `[q, k, v, dO]` and the gradients' starting values (used under [`GradMode::Accumulate`]), rounded to their types.
    fn data(&self) -> Data {
        let s = self.shape;
        let (dt, gt) = (self.dtype, self.grad_dtype);
        let mut r = DataRng::new(self.seed);
        Data {
            q: r.values(s.q_elems(), 1.0, dt),
            k: r.values(s.kv_elems(), 1.0, dt),
            v: r.values(s.kv_elems(), 1.0, dt),
            d_o: r.values(s.q_elems(), 1.0, dt),
            base: [r.values(s.q_elems(), 1.0, gt), r.values(s.kv_elems(), 1.0, gt), r.values(s.kv_elems(), 1.0, gt)],
        }
    }
}

struct Data {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    d_o: Vec<f64>,
    base: [Vec<f64>; 3],
}

/// Attention cases within `limits`: batch 1–2, 1–2 key/value heads each read by 1–3 query heads, 1 to
/// `attn_len` query and key rows (independently, so most lengths are no multiple of any tile), head dims 32 to
/// `attn_head_dim` in steps of 8, any [`strategies::mask`], the default scale or one in `0.05..2`, any element
/// type (the gradients in `f32` or the same), either [`GradMode`].
pub fn cases(limits: &Limits) -> impl Strategy<Value = AttnCase> {
    let (len, d8) = (limits.attn_len.max(1), (limits.attn_head_dim / 8).max(4));
    (
        (1usize..=2, 1usize..=2, 1usize..=3, 1usize..=len, 1usize..=len, 4usize..=d8),
        (strategies::dtype(), any::<bool>(), prop::option::of(0.05f32..2.0), strategies::grad_mode(), any::<u64>()),
    )
        .prop_flat_map(|((b, hkv, g, sq, sk, d8), rest)| {
            let shape =
                AttnShape { batch: b, q_heads: hkv * g, kv_heads: hkv, q_len: sq, kv_len: sk, head_dim: d8 * 8 };
            (Just(shape), strategies::mask(sq, sk), Just(rest))
        })
        .prop_map(|(shape, mask, (dtype, f32_grads, scale, mode, seed))| AttnCase {
            shape,
            dtype,
            grad_dtype: if f32_grads { DType::F32 } else { dtype },
            mask,
            scale,
            mode,
            seed,
        })
}

/// The checks of this family.
pub(crate) fn check(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let limits = ctx.cfg.limits;
    ctx.property("forward and backward against the reference", cases(&limits), |c| forward_backward(ctx, c))?;
    let merge = (cases(&limits).prop_filter("two key rows to split", |c| c.shape.kv_len >= 2), 0.0f64..1.0);
    ctx.property("the merge of two key sets is attention over both", merge, |(c, at)| merge_halves(ctx, c, *at))?;
    ctx.fixed("fixed shapes: decoding, rows without keys, tile borders, head dims", || {
        pinned(&limits).iter().try_for_each(|c| forward_backward(ctx, c))
    })?;
    ctx.fixed("the tensor-core shapes: 16-bit types, head dims 64 and 128, every mask", || {
        tensor_core(&limits).iter().try_for_each(|c| forward_backward(ctx, c))
    })?;
    ctx.fixed("the merge of extreme and empty log-sum-exps", || merge_extremes(ctx))?;
    ctx.fixed("gradients against finite differences of its own forward", || finite_differences(ctx))?;
    Ok(())
}

/// Runs the forward then the backward of `c` on `b`: `[O, LSE, dQ, dK, dV]`.
fn run(b: &dyn Backend, c: &AttnCase, x: &Data) -> Result<Vec<Output>, Fault> {
    let (s, dt, gt, m) = (c.shape, c.dtype, c.grad_dtype, Mem(b));
    let (q, k, v) =
        (m.input(dt, &s.q_dims(), &x.q)?, m.input(dt, &s.kv_dims(), &x.k)?, m.input(dt, &s.kv_dims(), &x.v)?);
    let (mut o, mut lse) = (m.poisoned(dt, &s.q_dims())?, m.poisoned(DType::F32, &s.lse_dims())?);
    let qkv = Qkv::new(q.view(), k.view(), v.view());
    b.attention_forward(&c.options(), AttnOut { o: o.view_mut(), lse: lse.view_mut() }, qkv).at("attention_forward")?;
    let dout = m.input(dt, &s.q_dims(), &x.d_o)?;
    let grad = |dims: &[usize], base: &[f64]| match c.mode {
        GradMode::Overwrite => m.poisoned(gt, dims),
        GradMode::Accumulate => m.input(gt, dims, base),
    };
    let (mut dq, mut dk, mut dv) =
        (grad(&s.q_dims(), &x.base[0])?, grad(&s.kv_dims(), &x.base[1])?, grad(&s.kv_dims(), &x.base[2])?);
    let grads = AttnGrads { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut() };
    let saved = AttnSaved { qkv, o: o.view(), lse: lse.view() };
    b.attention_backward(&c.options(), grads, dout.view(), saved, c.mode).at("attention_backward")?;
    Ok(vec![
        m.output("o", &o)?,
        m.output("lse", &lse)?,
        m.output("dq", &dq)?,
        m.output("dk", &dk)?,
        m.output("dv", &dv)?,
    ])
}

/// `c` on the backend against the reference (and the CPU backend), then the rows that see no key.
fn forward_backward(ctx: &Ctx<'_>, c: &AttnCase) -> Result<(), Failure> {
    let x = c.data();
    let p = c.params();
    let (o, lse) = reference::forward(&p, &x.q, &x.k, &x.v);
    let (mut dq, mut dk, mut dv) = reference::backward(&p, &x.q, &x.k, &x.v, &x.d_o);
    if c.mode == GradMode::Accumulate {
        for (g, base) in [&mut dq, &mut dk, &mut dv].into_iter().zip(&x.base) {
            g.iter_mut().zip(base).for_each(|(g, b)| *g += b);
        }
    }
    let (t, tg) = (ATTENTION.of(c.dtype), ATTENTION_GRAD.of(c.dtype));
    let want = [
        Expect::new("o", o, t),
        Expect::new("lse", lse.clone(), t),
        Expect::new("dq", dq, tg),
        Expect::new("dk", dk, tg),
        Expect::new("dv", dv, tg),
    ];
    let got = ctx.compare("attention_forward+backward", c, |b| run(b, c, &x), &want)?;
    // A row that sees no key: O exactly 0 (never NaN, never noise) and no gradient through it.
    let d = c.shape.head_dim;
    for (row, _) in lse.iter().enumerate().filter(|(_, l)| **l == f64::NEG_INFINITY) {
        let o_row = &got[0].vals[row * d..(row + 1) * d];
        let dq_row = &got[2].vals[row * d..(row + 1) * d];
        let base = match c.mode {
            GradMode::Overwrite => &[0.0][..],
            GradMode::Accumulate => &x.base[0][row * d..(row + 1) * d],
        };
        let untouched = dq_row.iter().zip(base.iter().cycle()).all(|(g, b)| g == b);
        ctx.ensure(o_row.iter().all(|&v| v == 0.0) && untouched, "attention_forward+backward", c, || {
            format!("row {row} sees no key: O must be exactly 0 and dQ untouched, got O {o_row:?}, dQ {dq_row:?}")
        })?;
    }
    Ok(())
}

/// The forward over keys `[0, at)` merged (on the backend) with the forward over `[at, Sk)` against the reference
/// forward over all keys.
fn merge_halves(ctx: &Ctx<'_>, c: &AttnCase, at: f64) -> Result<(), Failure> {
    let s = c.shape;
    let split = ((s.kv_len as f64 * at) as usize).clamp(1, s.kv_len - 1);
    let x = c.data();
    let (o, lse) = reference::forward(&c.params(), &x.q, &x.k, &x.v);
    let t = ATTENTION.of(c.dtype);
    let want = [Expect::new("o", o, t), Expect::new("lse", lse, t)];
    // The key rows `lo..hi` of each (batch, head) of a `[B, Hkv, Sk, D]` buffer.
    let keys = |x: &[f64], lo: usize, hi: usize| -> Vec<f64> {
        (0..s.batch * s.kv_heads)
            .flat_map(|bh| x[(bh * s.kv_len + lo) * s.head_dim..(bh * s.kv_len + hi) * s.head_dim].to_vec())
            .collect()
    };
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let q = m.input(c.dtype, &s.q_dims(), &x.q)?;
        let block = |lo: usize, hi: usize| -> Result<_, Fault> {
            let sh = AttnShape { kv_len: hi - lo, ..s };
            let k = m.input(c.dtype, &sh.kv_dims(), &keys(&x.k, lo, hi))?;
            let v = m.input(c.dtype, &sh.kv_dims(), &keys(&x.v, lo, hi))?;
            let (mut o, mut lse) = (m.poisoned(DType::F32, &s.q_dims())?, m.poisoned(DType::F32, &s.lse_dims())?);
            let mask = c.mask.keys(lo..hi);
            let opts = AttnOptions { mask: mask.mask(), scale: c.scale };
            let out = AttnOut { o: o.view_mut(), lse: lse.view_mut() };
            b.attention_forward(&opts, out, Qkv::new(q.view(), k.view(), v.view())).at("attention_forward")?;
            Ok((o, lse))
        };
        let ((mut o, mut lse), (o2, lse2)) = (block(0, split)?, block(split, s.kv_len)?);
        let part = AttnPartial { o: o2.view(), lse: lse2.view() };
        b.attention_merge(AttnOut { o: o.view_mut(), lse: lse.view_mut() }, part).at("attention_merge")?;
        Ok(vec![m.output("o", &o)?, m.output("lse", &lse)?])
    };
    ctx.compare("attention_merge", &(c, split), run, &want).map(drop)
}

/// Shapes a drawn case rarely hits, within `limits`: past regressions; decoding (`Sq = 1`) and a single key, causal and not; queries
/// before every key and queries of a document without keys; windows smaller than a tile crossing tile borders;
/// the head dims at the ends of the range; a long causal `bf16` run with four query heads per key head.
pub fn pinned(limits: &Limits) -> Vec<AttnCase> {
    let l = limits.attn_len.max(2);
    let shape =
        |hq, hkv, sq, sk, d| AttnShape { batch: 1, q_heads: hq, kv_heads: hkv, q_len: sq, kv_len: sk, head_dim: d };
    let at = |start: i64, n: usize| (start..start + n as i64).collect::<Vec<i64>>();
    // A regression: one query at position 1 over keys 0 and 1.
    let mut out = vec![AttnCase::new(shape(1, 1, 1, 2, 32), MaskCase::new(false, None, vec![1], vec![0, 1], None), 0)];
    for (sq, sk) in [(1, l), (l, 1), (1, 1)] {
        for causal in [false, true] {
            let mask = MaskCase::new(causal, None, at(sk as i64 - 1, sq), at(0, sk), None);
            out.push(AttnCase::new(shape(4, 2, sq, sk, 64.min(limits.attn_head_dim)), mask, 5));
        }
    }
    // Queries 0..n against keys n/2..3n/2, causal: the first half sees nothing. Then one document without keys.
    let n = l.min(70);
    out.push(AttnCase::new(shape(1, 1, n, n, 32), MaskCase::new(true, None, at(0, n), at(n as i64 / 2, n), None), 6));
    let mut c =
        AttnCase::new(shape(1, 1, n, n, 32), MaskCase::new(false, None, at(1000, n), at(0, n), Some(vec![500])), 7);
    c.mask = c.mask.explicit();
    out.push(c);
    if limits.attn_long >= 300 {
        for (w, causal) in [(5u64, true), (3, false), (64, true), (65, false)] {
            out.push(AttnCase::new(
                shape(2, 1, 300, 300, 40),
                MaskCase::new(causal, Some(w), at(0, 300), at(0, 300), None),
                w,
            ));
        }
        // Every tile height and the micro-kernel's column tails: 141 queries (at 59) over 200 keys, documents of 70;
        // two batches of 150 queries (at 20) over 170 keys, documents of 60, a window of 90. Causal and not.
        for causal in [false, true] {
            let docs = Some((1..4).map(|i| 70 * i).collect());
            let mask = MaskCase::new(causal, None, at(59, 141), at(0, 200), docs);
            out.push(AttnCase::new(shape(4, 2, 141, 200, 40), mask, 11));
            let docs = Some((1..4).map(|i| 60 * i).collect());
            let mask = MaskCase::new(causal, Some(90), at(20, 150), at(0, 170), docs);
            let mut c = AttnCase::new(shape(4, 2, 150, 170, 40), mask, 1);
            c.shape.batch = 2;
            out.push(c);
        }
        out.push(AttnCase::new(
            shape(4, 2, 200, 200, 64),
            MaskCase::new(true, Some(90), at(0, 200), at(0, 200), None),
            2,
        ));
    }
    for d in [32, 136, 256].into_iter().filter(|&d| d <= limits.attn_head_dim.max(32) || limits.attn_long >= 300) {
        let (sq, sk) = (l.min(70), l.min(130));
        let mask = MaskCase::new(true, None, at(sk as i64 - sq as i64, sq), at(0, sk), None).explicit();
        out.push(AttnCase::new(shape(2, 2, sq, sk, d), mask, d as u64));
    }
    if limits.attn_long >= 400 {
        let mut c =
            AttnCase::new(shape(4, 1, 400, 400, 64), MaskCase::new(true, None, at(0, 400), at(0, 400), None), 99);
        c.dtype = DType::Bf16;
        c.grad_dtype = DType::Bf16;
        out.push(c);
    }
    out
}

/// The shapes a GPU backend runs on its tensor-core path (`bf16` and `f16`, head dims 64 and 128 where `limits`
/// allow), which a drawn case reaches only now and then: GQA with the queries at the end of the keys, causal, the
/// gradients in `f32`; a zigzag shard's two ranges of positions (explicit), causal, accumulating into gradients of
/// the inputs' type; a window across documents in both directions. Lengths are no multiple of a 64-row tile.
pub fn tensor_core(limits: &Limits) -> Vec<AttnCase> {
    let (sq, sk) = (limits.attn_len.clamp(2, 70), limits.attn_len.clamp(2, 130));
    let at = |start: i64, n: usize| (start..start + n as i64).collect::<Vec<i64>>();
    let shape =
        |hq, hkv, sq, sk, d| AttnShape { batch: 1, q_heads: hq, kv_heads: hkv, q_len: sq, kv_len: sk, head_dim: d };
    let mut out = Vec::new();
    let dims = [64, 128].into_iter().filter(|&d| d <= limits.attn_head_dim.max(64));
    for (i, d) in dims.enumerate() {
        for (j, dtype) in [DType::Bf16, DType::F16].into_iter().enumerate() {
            let seed = 40 + 4 * i as u64 + j as u64;
            let case =
                |shape, mask, grad_dtype, mode| AttnCase { shape, dtype, grad_dtype, mask, scale: None, mode, seed };
            let mask = MaskCase::new(true, None, at((sk - sq) as i64, sq), at(0, sk), None);
            out.push(case(shape(4, 2, sq, sk, d), mask, DType::F32, GradMode::Overwrite));
            // Rank 0 of two under zigzag: the first and the last of four chunks, for the queries and the keys alike.
            let (qh, kh) = (sq / 2, sk / 2);
            let q_pos = [at(0, qh), at(3 * qh as i64, sq - qh)].concat();
            let k_pos = [at(0, kh), at(3 * kh as i64, sk - kh)].concat();
            let mask = MaskCase::new(true, None, q_pos, k_pos, None).explicit();
            out.push(case(shape(2, 1, sq, sk, d), mask, dtype, GradMode::Accumulate));
            let cuts = Some(vec![sk as i64 / 3, 2 * sk as i64 / 3]);
            let mask = MaskCase::new(false, Some(33), at(sk as i64 - sq as i64, sq), at(0, sk), cuts);
            out.push(case(shape(2, 2, sq, sk, d), mask, DType::F32, GradMode::Accumulate));
        }
    }
    out
}

/// The merge of extreme log-sum-exps: `1e30` twice, one side `-inf`, a partial without keys whose `O` is not
/// finite (it must get no weight): exact values.
fn merge_extremes(ctx: &Ctx<'_>) -> Result<(), Failure> {
    // (acc O, acc LSE, partial O, partial LSE, merged O, merged LSE), two elements per row.
    let ln2 = std::f32::consts::LN_2 as f64;
    let cases: Vec<[Vec<f64>; 6]> = vec![
        [
            vec![1.0, 2.0, 0.0, 0.0, 5.0, 5.0],
            vec![1e30, f64::NEG_INFINITY, 80.0],
            vec![3.0, 4.0, 7.0, 8.0, 1.0, 1.0],
            vec![1e30, 3.0, f64::NEG_INFINITY],
            vec![2.0, 3.0, 7.0, 8.0, 5.0, 5.0],
            vec![(1e30f32 + ln2 as f32) as f64, 3.0, 80.0],
        ],
        [
            vec![0.0, 0.0],
            vec![f64::NEG_INFINITY],
            vec![0.0, 0.0],
            vec![f64::NEG_INFINITY],
            vec![0.0, 0.0],
            vec![f64::NEG_INFINITY],
        ],
    ];
    let mut cases = cases;
    let o2 = vec![0.25, -3.0, 1.5, 0.0];
    let l2 = vec![0.7f32 as f64, -1.0];
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let inf2 = vec![f64::NEG_INFINITY; 2];
        cases.push([vec![bad, 1.0, 2.0, bad], inf2.clone(), o2.clone(), l2.clone(), o2.clone(), l2.clone()]);
        cases.push([o2.clone(), l2.clone(), vec![bad; 4], inf2, o2.clone(), l2.clone()]);
    }
    for case in &cases {
        let [o1, l1, o2, l2, o, l] = case;
        let (rows, d) = (l1.len(), o1.len() / l1.len());
        let (od, ld) = ([1, 1, rows, d], [1, 1, rows]);
        let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
            let m = Mem(b);
            let (mut ao, mut al) = (m.input(DType::F32, &od, o1)?, m.input(DType::F32, &ld, l1)?);
            let (po, pl) = (m.input(DType::F32, &od, o2)?, m.input(DType::F32, &ld, l2)?);
            let part = AttnPartial { o: po.view(), lse: pl.view() };
            b.attention_merge(AttnOut { o: ao.view_mut(), lse: al.view_mut() }, part).at("attention_merge")?;
            Ok(vec![m.output("o", &ao)?, m.output("lse", &al)?])
        };
        let want = [Expect::new("o", o.clone(), 0.0), Expect::new("lse", l.clone(), 0.0)];
        ctx.compare("attention_merge", &&case[..4], run, &want)?;
    }
    Ok(())
}

/// The backend's gradients against central differences of `Σ O∘dO` computed by its own `f32` forward (every
/// seventh element of `Q`, `K` and `V`), on a small causal, windowed, document-masked case.
fn finite_differences(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: 9, kv_len: 11, head_dim: 32 };
    let at = |start: i64, n: i64| (start..start + n).collect::<Vec<i64>>();
    let c = AttnCase::new(shape, MaskCase::new(true, Some(7), at(2, 9), at(0, 11), Some(vec![5, 6])), 11);
    let x = c.data();
    let op = "attention_backward";
    let m = ctx.mem();
    let b = ctx.backend;
    let got = run(b, &c, &x).map_err(|f| ctx.fault(op, &c, f, false))?;
    let loss = |q: &[f64], k: &[f64], v: &[f64]| -> Result<f64, Fault> {
        let s = c.shape;
        let (q, k, v) =
            (m.input(c.dtype, &s.q_dims(), q)?, m.input(c.dtype, &s.kv_dims(), k)?, m.input(c.dtype, &s.kv_dims(), v)?);
        let (mut o, mut lse) = (m.poisoned(DType::F32, &s.q_dims())?, m.poisoned(DType::F32, &s.lse_dims())?);
        let out = AttnOut { o: o.view_mut(), lse: lse.view_mut() };
        b.attention_forward(&c.options(), out, Qkv::new(q.view(), k.view(), v.view())).at("attention_forward")?;
        Ok(m.read(o.view())?.iter().zip(&x.d_o).map(|(a, b)| a * b).sum())
    };
    let h = 1e-2;
    for (which, name) in [(0usize, "dq"), (1, "dk"), (2, "dv")] {
        let grad = &got[2 + which];
        let (mut fd, mut an) = (Vec::new(), Vec::new());
        for idx in (0..grad.vals.len()).step_by(7) {
            let mut a = [x.q.clone(), x.k.clone(), x.v.clone()];
            a[which][idx] += h;
            let up = loss(&a[0], &a[1], &a[2]).map_err(|f| ctx.fault(op, &c, f, false))?;
            a[which][idx] -= 2.0 * h;
            let dn = loss(&a[0], &a[1], &a[2]).map_err(|f| ctx.fault(op, &c, f, false))?;
            fd.push((up - dn) / (2.0 * h));
            an.push(grad.vals[idx]);
        }
        let out = Output { name, dtype: Some(DType::F32), vals: an };
        ctx.within(op, &c, &out, &fd, FINITE_DIFFERENCES, super::Against::Reference)?;
    }
    Ok(())
}
