//! Rotary embeddings in place, forward and backward, against the f64 rotation by the table's own frequencies and
//! attention factor (so every scaling is the same op with other numbers: the tables themselves are host code,
//! checked against Hugging Face's in this crate's tests), full and partial rotary, at explicit positions.
//!
//! Legend: `B` batch, `H` heads, `S` positions, `D` head dim, `R` rotating dims.

use std::fmt;

use proptest::prelude::*;

use super::data::DataRng;
use super::harness::{At, Ctx, Expect, Fault, Mem, Output};
use super::tolerance::POINTWISE;
use super::{strategies, Failure, Limits};
use crate::backend::Backend;
use crate::dtype::DType;
use crate::ops::{RopeConfig, RopeScaling, RopeTable};

/// One rotation: sizes, positions, the table's configuration, the element type and the seed of the data.
#[derive(Clone)]
pub struct RopeCase {
    /// Batch.
    pub b: usize,
    /// Heads.
    pub h: usize,
    /// The table's configuration (its head dim is `D`).
    pub config: RopeConfig,
    /// The rotating dims `R` (`D` for full rotary).
    pub rotary_dim: usize,
    /// One position per row of `S`.
    pub positions: Vec<i64>,
    /// The element type of `x`.
    pub dtype: DType,
    /// The seed of the data.
    pub seed: u64,
}

impl fmt::Debug for RopeCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RopeCase {{ B {} H {} S {} D {} R {}, base {}, {:?}, positions {:?}, {}, seed {:#x} }}",
            self.b,
            self.h,
            self.positions.len(),
            self.config.head_dim,
            self.rotary_dim,
            self.config.base,
            self.config.scaling,
            self.positions,
            self.dtype.name(),
            self.seed
        )
    }
}

impl RopeCase {
    /// The table (full or partial rotary).
    pub fn table(&self) -> RopeTable {
        RopeTable::with_rotary_dim(&self.config, self.rotary_dim).expect("a drawn configuration is valid")
    }
}

/// Every scaling with parameters that matter at the drawn head dim (`kind` 0–7: none, linear, NTK-aware, Llama 3,
/// YaRN truncated, YaRN not, dynamic NTK, LongRoPE).
pub fn scaling(kind: u8, factor: f64, rotary_dim: usize) -> RopeScaling {
    let half = rotary_dim / 2;
    match kind {
        0 => RopeScaling::None,
        1 => RopeScaling::Linear { factor },
        2 if rotary_dim > 2 => RopeScaling::NtkAware { factor },
        3 => RopeScaling::Llama3 { factor, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 64 },
        4 | 5 => RopeScaling::Yarn {
            factor,
            original_max_position: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            truncate: kind == 4,
        },
        6 if rotary_dim > 2 => {
            RopeScaling::DynamicNtk { factor, original_max_position: 64, seq_len: 64 + (factor * 40.0) as usize }
        }
        7 => RopeScaling::LongRope {
            short_factor: (0..half).map(|i| 1.0 + 0.1 * i as f64).collect(),
            long_factor: (0..half).map(|i| factor * (1.0 + i as f64)).collect(),
            factor,
            original_max_position: 64,
            seq_len: if factor > 8.0 { 128 } else { 64 },
            attention_factor: None,
        },
        _ => RopeScaling::None,
    }
}

/// Rope cases: `B` 1–2, `H` 1–3, `D` 2 to 32 (even), partial rotary half the time, 1 to 8 positions anywhere in
/// `-50..200000` (so the angles are large), either base, every [`scaling`], either element type.
pub fn cases(_limits: &Limits) -> impl Strategy<Value = RopeCase> {
    (
        (1usize..3, 1usize..4, 1usize..17, any::<bool>(), prop::collection::vec(-50i64..200_000, 1..9)),
        (prop::sample::select(vec![10_000.0, 500_000.0]), 0u8..8, 1.5f64..16.0, strategies::dtype(), any::<u64>()),
    )
        .prop_map(|((b, h, half, partial, positions), (base, kind, factor, dtype, seed))| {
            let head_dim = 2 * half;
            let rotary_dim = if partial && half > 1 { 2 * (half / 2) } else { head_dim };
            let config = RopeConfig { head_dim, base, scaling: scaling(kind, factor, rotary_dim) };
            RopeCase { b, h, config, rotary_dim, positions, dtype, seed }
        })
}

/// The checks of this family.
pub(crate) fn check(ctx: &Ctx<'_>) -> Result<(), Failure> {
    ctx.property("forward and backward against the f64 rotation", cases(&ctx.cfg.limits), |c| rotate(ctx, c))?;
    ctx.fixed("the head dims of real models: 128 (half of it rotating) and 256", || {
        [(128, 64, RopeScaling::Linear { factor: 4.0 }), (256, 256, RopeScaling::None)].into_iter().try_for_each(
            |(head_dim, rotary_dim, scaling)| {
                let config = RopeConfig { head_dim, base: 500_000.0, scaling };
                let positions = (0..17).map(|i| 3 * i * i + 5).collect();
                rotate(ctx, &RopeCase { b: 1, h: 2, config, rotary_dim, positions, dtype: DType::Bf16, seed: 8 })
            },
        )
    })?;
    ctx.fixed("the backward inverts the forward", || inverse(ctx))?;
    ctx.fixed("one table rotates each call by its own positions", || positions_per_call(ctx))
}

/// `y = m·R(pos·inv_freq)·x` on each row's first `R` dims (pairs `(i, i + R/2)`), the rest passed through; `sign`
/// −1 is the transposed rotation (the backward).
fn reference(x: &[f64], table: &RopeTable, pos: &[i64], sign: f64) -> Vec<f64> {
    let (d, half) = (table.head_dim(), table.rotary_dim() / 2);
    let (inv, m) = (table.inv_freq(), table.attention_factor());
    let mut y = x.to_vec();
    for (r, row) in y.chunks_mut(d).enumerate() {
        let p = pos[r % pos.len()] as f64;
        for i in 0..half {
            // The angles as the table makes them: f64, then the factor, rounded to f32.
            let (s, c) = (p * inv[i]).sin_cos();
            let (c, s) = ((c * m) as f32 as f64, sign * (s * m) as f32 as f64);
            let (x1, x2) = (row[i], row[i + half]);
            row[i] = x1 * c - x2 * s;
            row[i + half] = x2 * c + x1 * s;
        }
    }
    y
}

fn rotate(ctx: &Ctx<'_>, c: &RopeCase) -> Result<(), Failure> {
    let table = c.table();
    let dims = [c.b, c.h, c.positions.len(), c.config.head_dim];
    let n = dims.iter().product();
    let mut r = DataRng::new(c.seed);
    let (x, dy) = (r.values(n, 1.0, c.dtype), r.values(n, 1.0, c.dtype));
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let (mut y, mut dx) = (m.input(c.dtype, &dims, &x)?, m.input(c.dtype, &dims, &dy)?);
        b.rope_forward(&table, y.view_mut(), &c.positions).at("rope_forward")?;
        b.rope_backward(&table, dx.view_mut(), &c.positions).at("rope_backward")?;
        Ok(vec![m.output("y", &y)?, m.output("dx", &dx)?])
    };
    let tol = POINTWISE.of(c.dtype);
    let want = [
        Expect::new("y", reference(&x, &table, &c.positions, 1.0), tol),
        Expect::new("dx", reference(&dy, &table, &c.positions, -1.0), tol),
    ];
    ctx.compare("rope_forward/rope_backward", c, run, &want).map(drop)
}

/// Forward then backward with no attention factor gives the input back (within rounding), at positions past a
/// million.
fn inverse(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let config = RopeConfig { head_dim: 8, base: 10_000.0, scaling: RopeScaling::Linear { factor: 4.0 } };
    let c = RopeCase {
        b: 1,
        h: 2,
        rotary_dim: 8,
        positions: vec![3, 17, 1_000_000, 9],
        config,
        dtype: DType::F32,
        seed: 5,
    };
    let (table, dims) = (c.table(), [1, 2, 4, 8]);
    let x = DataRng::new(c.seed).values(64, 1.0, DType::F32);
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let mut z = m.input(DType::F32, &dims, &x)?;
        b.rope_forward(&table, z.view_mut(), &c.positions).at("rope_forward")?;
        b.rope_backward(&table, z.view_mut(), &c.positions).at("rope_backward")?;
        Ok(vec![m.output("x", &z)?])
    };
    ctx.compare("rope_forward+rope_backward", &c, run, &[Expect::new("x", x.clone(), POINTWISE.f32)]).map(drop)
}

/// A table used at alternating position sets (a context-parallel rank's zigzag halves, a new length) rotates by
/// each call's positions: the same bits as a fresh table's.
fn positions_per_call(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let config = RopeConfig { head_dim: 8, base: 10_000.0, scaling: RopeScaling::None };
    let shared = RopeTable::new(&config).expect("a valid table");
    let x: Vec<f64> = (0..2 * 3 * 8).map(|i| (i as f32 * 0.37).sin() as f64).collect();
    let sets: [&[i64]; 4] = [&[0, 1, 2], &[7, 100, 3], &[0, 1, 2], &[5, 6, 7]];
    let m = ctx.mem();
    for pos in sets {
        let fresh = RopeTable::new(&config).expect("a valid table");
        let rotate = |t: &RopeTable| -> Result<Output, Fault> {
            let mut z = m.input(DType::F32, &[1, 2, 3, 8], &x)?;
            ctx.backend.rope_forward(t, z.view_mut(), pos).at("rope_forward")?;
            m.output("y", &z)
        };
        let (a, b) = (rotate(&shared), rotate(&fresh));
        let (a, b) = (
            a.map_err(|f| ctx.fault("rope_forward", &pos, f, false))?,
            b.map_err(|f| ctx.fault("rope_forward", &pos, f, false))?,
        );
        ctx.same_bits("rope_forward", &pos, &[a], &[b], super::Against::Rerun)?;
    }
    Ok(())
}
