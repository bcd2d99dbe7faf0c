//! Token embeddings: the lookup bit for bit, and the backward's scatter-add (many repeated ids) per [`GradMode`],
//! into a table gradient of `f32` or the table's type, against f64 sums.
//!
//! Legend: `V` vocabulary, `C` channels, `T` tokens.

use std::fmt;

use proptest::prelude::*;

use super::data::DataRng;
use super::harness::{At, Ctx, Expect, Fault, Mem, Output};
use super::tolerance::{EXACT, REDUCTION};
use super::{strategies, Failure, Limits};
use crate::backend::{Backend, GradMode};
use crate::dtype::DType;

/// An embedding case: sizes, the ids' spread, types, mode and the seed.
#[derive(Clone)]
pub struct EmbeddingCase {
    /// Vocabulary `V`.
    pub v: usize,
    /// Channels `C`.
    pub c: usize,
    /// Tokens `T` (0 allowed).
    pub t: usize,
    /// Ids are drawn below this (≤ `V`), so that repeats are common.
    pub distinct: usize,
    /// The table's, the output's and `dout`'s type.
    pub dtype: DType,
    /// The table gradient's type.
    pub grad_dtype: DType,
    /// Overwrite or accumulate the table gradient.
    pub mode: GradMode,
    /// The seed of the data and ids.
    pub seed: u64,
}

impl fmt::Debug for EmbeddingCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "EmbeddingCase {{ V {} C {} T {}, ids below {}, {} (grad {}), {:?}, seed {:#x} }}",
            self.v,
            self.c,
            self.t,
            self.distinct,
            self.dtype.name(),
            self.grad_dtype.name(),
            self.mode,
            self.seed
        )
    }
}

/// Cases within `limits`: `V` up to 60, `C` up to `features`, `T` 0 to twice `tokens`.
pub fn cases(limits: &Limits) -> impl Strategy<Value = EmbeddingCase> {
    (
        (1usize..60, 1..=limits.features.max(1), 0..=2 * limits.tokens, 0.0f64..1.0),
        (strategies::dtype(), any::<bool>(), strategies::grad_mode(), any::<u64>()),
    )
        .prop_map(|((v, c, t, spread), (dtype, f32_grads, mode, seed))| EmbeddingCase {
            v,
            c,
            t,
            distinct: 1 + (spread * (v - 1) as f64) as usize,
            dtype,
            grad_dtype: if f32_grads { DType::F32 } else { dtype },
            mode,
            seed,
        })
}

/// The checks of this family.
pub(crate) fn check(ctx: &Ctx<'_>) -> Result<(), Failure> {
    ctx.property("lookup and scatter-add against f64", cases(&ctx.cfg.limits), |c| embedding(ctx, c))?;
    ctx.fixed("rows wider than a GPU block", || {
        [(DType::F32, GradMode::Overwrite), (DType::Bf16, GradMode::Accumulate)].into_iter().try_for_each(
            |(dtype, mode)| {
                let c = EmbeddingCase {
                    v: 50,
                    c: ctx.cfg.limits.wide,
                    t: 30,
                    distinct: 10,
                    dtype,
                    grad_dtype: DType::F32,
                    mode,
                    seed: 6,
                };
                embedding(ctx, &c)
            },
        )
    })
}

fn embedding(ctx: &Ctx<'_>, c: &EmbeddingCase) -> Result<(), Failure> {
    let (v, ch, t, dt, gt) = (c.v, c.c, c.t, c.dtype, c.grad_dtype);
    let mut r = DataRng::new(c.seed);
    let ids: Vec<u32> = (0..t).map(|_| r.below(c.distinct) as u32).collect();
    let (table, dout, base) = (r.values(v * ch, 1.0, dt), r.values(t * ch, 1.0, dt), r.values(v * ch, 1.0, gt));
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let tb = m.input(dt, &[v, ch], &table)?;
        let mut out = m.poisoned(dt, &[t, ch])?;
        b.embedding_forward(out.view_mut(), &ids, tb.view()).at("embedding_forward")?;
        let db = m.input(dt, &[t, ch], &dout)?;
        let mut dtable = match c.mode {
            GradMode::Overwrite => m.poisoned(gt, &[v, ch])?,
            GradMode::Accumulate => m.input(gt, &[v, ch], &base)?,
        };
        b.embedding_backward(dtable.view_mut(), db.view(), &ids, c.mode).at("embedding_backward")?;
        Ok(vec![m.output("out", &out)?, m.output("dtable", &dtable)?])
    };
    let out = ids.iter().flat_map(|&id| table[id as usize * ch..(id as usize + 1) * ch].to_vec()).collect();
    let mut dtable = match c.mode {
        GradMode::Overwrite => vec![0.0; v * ch],
        GradMode::Accumulate => base.clone(),
    };
    for (k, &id) in ids.iter().enumerate() {
        for j in 0..ch {
            dtable[id as usize * ch + j] += dout[k * ch + j];
        }
    }
    let want =
        [Expect::new("out", out, EXACT.of(dt)), Expect::new("dtable", dtable, REDUCTION.of(dt).max(REDUCTION.of(gt)))];
    ctx.compare("embedding_forward+backward", &(c, &ids), run, &want).map(drop)
}
