//! Attention's NaN confinement (the contract in [`crate::attention`]'s "Numerics"): masked pairs contribute nothing
//! even when an input is NaN or infinite, so a non-finite value placed in `Q`, `K`, `V` or `dO` leaves every
//! output row, `LSE` entry and gradient row that cannot see it bit-identical to a clean run **on the same
//! backend**; the rows that see a NaN show one.

use std::fmt;

use proptest::prelude::*;

use super::attention::AttnCase;
use super::data::DataRng;
use super::failure::{Against, FailureKind};
use super::harness::{At, Ctx, Fault, Mem, Output};
use super::strategies::{self, MaskCase};
use super::{Failure, Limits};
use crate::attention::{AttnGrads, AttnOut, AttnParams, AttnSaved, AttnShape, Qkv};
use crate::backend::{Backend, GradMode};
use crate::dtype::DType;

/// Which input holds the non-finite value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// A query row.
    Q,
    /// A key row.
    K,
    /// A value row.
    V,
    /// A row of the output's gradient.
    DO,
}

/// An attention case with one non-finite value in one input.
#[derive(Clone)]
pub struct PoisonCase {
    /// The problem (its mode is always [`GradMode::Overwrite`]).
    pub attn: AttnCase,
    /// The input poisoned.
    pub which: Input,
    /// Where, as a fraction of the input's length.
    pub at: f64,
    /// NaN, +inf or -inf.
    pub value: f32,
}

impl fmt::Debug for PoisonCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} in {:?} at {:.4} of it, {:?}", self.value, self.which, self.at, self.attn)
    }
}

/// Cases within `limits`: up to twice `attn_len` rows (the property is cheap: two runs per case), any mask.
pub fn cases(limits: &Limits) -> impl Strategy<Value = PoisonCase> {
    let (len, d8) = ((2 * limits.attn_len).max(1), (limits.attn_head_dim / 8).max(4));
    (
        (1usize..=2, 1usize..=2, 1usize..=2, 1usize..=len, 1usize..=len, 4usize..=d8),
        (strategies::dtype(), any::<u64>()),
        (prop_oneof![Just(Input::Q), Just(Input::K), Just(Input::V), Just(Input::DO)], 0.0f64..1.0),
        prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)],
    )
        .prop_flat_map(|((b, hkv, g, sq, sk, d8), dt, poison, value)| {
            let shape =
                AttnShape { batch: b, q_heads: hkv * g, kv_heads: hkv, q_len: sq, kv_len: sk, head_dim: d8 * 8 };
            (Just(shape), strategies::mask(sq, sk), Just(dt), Just(poison), Just(value))
        })
        .prop_map(|(shape, mask, (dtype, seed), (which, at), value)| PoisonCase {
            attn: AttnCase { shape, dtype, grad_dtype: dtype, mask, scale: None, mode: GradMode::Overwrite, seed },
            which,
            at,
            value,
        })
}

/// The checks of this family.
pub(crate) fn check(ctx: &Ctx<'_>) -> Result<(), Failure> {
    ctx.property("a non-finite input stays where the mask lets it", cases(&ctx.cfg.limits), |c| confined(ctx, c))?;
    // The fixed cases run in `f32` and in `bf16` (a GPU's tensor-core path, whose tiles hold the NaN beside
    // visible entries), each with a NaN and with an infinity.
    let types = [DType::F32, DType::Bf16];
    let values = [f32::NAN, f32::INFINITY];
    let each = |attn: &AttnCase, which: Input, at: f64| {
        types.into_iter().try_for_each(|dtype| {
            let attn = AttnCase { dtype, grad_dtype: dtype, ..attn.clone() };
            values.into_iter().try_for_each(|value| confined(ctx, &PoisonCase { attn: attn.clone(), which, at, value }))
        })
    };
    ctx.fixed("a NaN in one document stays there", || {
        // Documents [0, 100) and [100, 128): a NaN (then an infinity) in V at position 50.
        let shape = AttnShape { batch: 1, q_heads: 1, kv_heads: 1, q_len: 128, kv_len: 128, head_dim: 64 };
        let pos: Vec<i64> = (0..128).collect();
        let attn = AttnCase::new(shape, MaskCase::new(false, None, pos.clone(), pos, Some(vec![100])), 1);
        each(&attn, Input::V, (50.0 * 64.0 + 7.0) / (128.0 * 64.0))
    })?;
    ctx.fixed("a regression: a NaN in the gradient of a query that sees one key", || {
        let shape = AttnShape { batch: 1, q_heads: 1, kv_heads: 1, q_len: 1, kv_len: 86, head_dim: 32 };
        let attn = AttnCase::new(shape, MaskCase::new(true, None, vec![0], (0..86).collect(), None), 498);
        confined(ctx, &PoisonCase { attn, which: Input::DO, at: 0.0, value: f32::NAN })
    })?;
    ctx.fixed("a NaN query row leaves later keys alone", || {
        // Causal, a NaN (then an infinity) in Q row 77: keys 78.. never see it.
        let shape = AttnShape { batch: 1, q_heads: 1, kv_heads: 1, q_len: 128, kv_len: 128, head_dim: 64 };
        let pos: Vec<i64> = (0..128).collect();
        let attn = AttnCase::new(shape, MaskCase::new(true, None, pos.clone(), pos, None), 2);
        each(&attn, Input::Q, (77.0 * 64.0 + 3.0) / (128.0 * 64.0))
    })?;
    ctx.fixed("a NaN key behind the causal mask, f16, head dim 128, grouped queries", || {
        // Keys 0..130 at positions 0.., queries 0..70 at 60..: key 100 is hidden from the queries before it.
        let d = ctx.cfg.limits.attn_head_dim.clamp(64, 128);
        let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: 70, kv_len: 130, head_dim: d };
        let mask = MaskCase::new(true, None, (60..130).collect(), (0..130).collect(), None);
        let attn = AttnCase { dtype: DType::F16, grad_dtype: DType::F16, ..AttnCase::new(shape, mask, 3) };
        let at = (100.0 * d as f64 + 5.0) / (130.0 * d as f64);
        confined(ctx, &PoisonCase { attn, which: Input::K, at, value: f32::NAN })
    })
}

/// Forward then backward on `b` from `[q, k, v, dO]`: `[O, LSE, dQ, dK, dV]`.
fn run(b: &dyn Backend, c: &AttnCase, x: &[Vec<f64>; 4]) -> Result<Vec<Output>, Fault> {
    let (s, dt, m) = (c.shape, c.dtype, Mem(b));
    let (q, k, v) =
        (m.input(dt, &s.q_dims(), &x[0])?, m.input(dt, &s.kv_dims(), &x[1])?, m.input(dt, &s.kv_dims(), &x[2])?);
    let (mut o, mut lse) = (m.poisoned(dt, &s.q_dims())?, m.poisoned(DType::F32, &s.lse_dims())?);
    let qkv = Qkv::new(q.view(), k.view(), v.view());
    b.attention_forward(&c.options(), AttnOut { o: o.view_mut(), lse: lse.view_mut() }, qkv).at("attention_forward")?;
    let dout = m.input(dt, &s.q_dims(), &x[3])?;
    let (mut dq, mut dk, mut dv) =
        (m.poisoned(dt, &s.q_dims())?, m.poisoned(dt, &s.kv_dims())?, m.poisoned(dt, &s.kv_dims())?);
    let grads = AttnGrads { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut() };
    let saved = AttnSaved { qkv, o: o.view(), lse: lse.view() };
    b.attention_backward(&c.options(), grads, dout.view(), saved, GradMode::Overwrite).at("attention_backward")?;
    Ok(vec![
        m.output("o", &o)?,
        m.output("lse", &lse)?,
        m.output("dq", &dq)?,
        m.output("dk", &dk)?,
        m.output("dv", &dv)?,
    ])
}

/// Rows a poisoned input can reach: query rows (`O`, `LSE`, `dQ`) and key rows (`dK`, `dV`), each `[B·H·S]`.
struct Reach {
    q: Vec<bool>,
    k: Vec<bool>,
}

/// What a non-finite value at row `row` of head `bh` of `which` can reach. A query row (`Q`, `dO`) reaches itself
/// and, through `dK`/`dV`, the keys it sees. A key row (`K`, `V`) reaches the query rows that see it and, through
/// their probabilities, every key those rows see (and itself).
fn reach(p: &AttnParams<'_>, which: Input, bh: usize, row: usize) -> Reach {
    let s = p.shape;
    let g = s.group();
    let mut r = Reach { q: vec![false; s.lse_elems()], k: vec![false; s.batch * s.kv_heads * s.kv_len] };
    let vis = |i: usize, j: usize| p.mask.visible(i, j);
    match which {
        Input::Q | Input::DO => {
            let (b, hq) = (bh / s.q_heads, bh % s.q_heads);
            r.q[bh * s.q_len + row] = true;
            let bhk = b * s.kv_heads + hq / g;
            for j in (0..s.kv_len).filter(|&j| vis(row, j)) {
                r.k[bhk * s.kv_len + j] = true;
            }
        }
        Input::K | Input::V => {
            let (b, hk) = (bh / s.kv_heads, bh % s.kv_heads);
            r.k[bh * s.kv_len + row] = true;
            for i in (0..s.q_len).filter(|&i| vis(i, row)) {
                for hq in hk * g..(hk + 1) * g {
                    r.q[(b * s.q_heads + hq) * s.q_len + i] = true;
                }
                for j in (0..s.kv_len).filter(|&j| vis(i, j)) {
                    r.k[bh * s.kv_len + j] = true;
                }
            }
        }
    }
    r
}

/// Runs `c` clean and poisoned on the backend: every row out of the poison's reach is bit-identical, and a NaN
/// shows in the `O` rows that see a poisoned `Q`, `K` or `V` row and in the `dQ` row of a poisoned `dO` row.
fn confined(ctx: &Ctx<'_>, c: &PoisonCase) -> Result<(), Failure> {
    let (s, d, op) = (c.attn.shape, c.attn.shape.head_dim, "attention_forward+backward");
    let mut r = DataRng::new(c.attn.seed);
    let dt = c.attn.dtype;
    let clean = [
        r.values(s.q_elems(), 1.0, dt),
        r.values(s.kv_elems(), 1.0, dt),
        r.values(s.kv_elems(), 1.0, dt),
        r.values(s.q_elems(), 1.0, dt),
    ];
    let slot = match c.which {
        Input::Q => 0,
        Input::K => 1,
        Input::V => 2,
        Input::DO => 3,
    };
    let mut dirty = clean.clone();
    let idx = ((c.at * dirty[slot].len() as f64) as usize).min(dirty[slot].len() - 1);
    dirty[slot][idx] = c.value as f64;
    let len = if slot == 1 || slot == 2 { s.kv_len } else { s.q_len };
    let (bh, row) = (idx / d / len, idx / d % len);
    let p = c.attn.params();
    let reached = reach(&p, c.which, bh, row);
    let b = ctx.backend;
    let want = run(b, &c.attn, &clean).map_err(|f| ctx.fault(op, c, f, false))?;
    let got = run(b, &c.attn, &dirty).map_err(|f| ctx.fault(op, c, f, false))?;
    for (t, (g, w)) in got.iter().zip(&want).enumerate() {
        let (rows, width) = match t {
            0 | 2 => (&reached.q, d),
            1 => (&reached.q, 1),
            _ => (&reached.k, d),
        };
        for x in (0..rows.len()).filter(|&x| !rows[x]) {
            let span = x * width..(x + 1) * width;
            let first = (span.start..span.end)
                .find(|&i| g.vals[i].to_bits() != w.vals[i].to_bits() && !(g.vals[i].is_nan() && w.vals[i].is_nan()));
            if let Some(i) = first {
                return Err(ctx.failure(
                    op,
                    c,
                    FailureKind::Bits {
                        output: g.name,
                        against: Against::Rerun,
                        index: i,
                        got: g.vals[i],
                        want: w.vals[i],
                    },
                ));
            }
        }
    }
    if c.value.is_nan() {
        let (t, rows): (usize, Vec<usize>) = match c.which {
            Input::Q | Input::DO => {
                let sees = (0..s.kv_len).any(|j| p.mask.visible(row, j));
                (if c.which == Input::Q { 0 } else { 2 }, if sees { vec![bh * s.q_len + row] } else { vec![] })
            }
            Input::K | Input::V => (0, (0..s.lse_elems()).filter(|&x| reached.q[x]).collect()),
        };
        for x in rows {
            let shows = got[t].vals[x * d..(x + 1) * d].iter().any(|v| v.is_nan());
            ctx.ensure(shows, op, c, || {
                format!("{} row {x} (head·len + row) sees the NaN but holds none", got[t].name)
            })?;
        }
        // And the gradients reached from a poisoned query row: the dK rows of the keys it sees.
        if c.which == Input::Q {
            let (b, hq) = (bh / s.q_heads, bh % s.q_heads);
            let bhk = b * s.kv_heads + hq / s.group();
            for j in (0..s.kv_len).filter(|&j| p.mask.visible(row, j)) {
                let x = bhk * s.kv_len + j;
                let shows = got[3].vals[x * d..(x + 1) * d].iter().any(|v| v.is_nan());
                ctx.ensure(shows, op, c, || format!("dk row {x} is seen by the NaN query row but holds no NaN"))?;
            }
        }
    }
    // An infinite (or NaN) value reaches every output row that sees it: the O rows of the queries that see it.
    if c.which == Input::V {
        for x in (0..s.lse_elems()).filter(|&x| reached.q[x]) {
            let shows = got[0].vals[x * d..(x + 1) * d].iter().any(|v| !v.is_finite());
            ctx.ensure(shows, op, c, || format!("o row {x} sees a value of {} but is finite", c.value))?;
        }
    }
    Ok(())
}
