//! The utilities: `copy` (converting), `fill`, `add`, `scale`, `transpose12` bit for bit against their definition
//! (one `f32` operation per element, rounded to nearest even); `sum_squares` and `clip_grad_norm` against `f64`
//! sums.

use std::fmt;

use proptest::prelude::*;

use super::data::{round, store, DataRng};
use super::harness::{At, Ctx, Expect, Fault, Mem, Output};
use super::tolerance::{EXACT, F64_SUM, POINTWISE};
use super::{strategies, Failure, Limits};
use crate::backend::Backend;
use crate::dtype::DType;
use crate::view::ViewMut;

/// A flat element-wise case: the destination's and the source's types, the length, a scalar and a seed.
#[derive(Debug, Clone)]
pub struct FlatCase {
    /// The output's (or the updated buffer's) type.
    pub dst: DType,
    /// The input's type.
    pub src: DType,
    /// Elements (0 allowed).
    pub n: usize,
    /// The scalar of `fill` and `scale`.
    pub value: f32,
    /// Elements before each buffer's view (so that a view starts at any alignment).
    pub offset: usize,
    /// The seed of the data.
    pub seed: u64,
}

/// Flat cases within `limits.elems`; the scalar is drawn among values whose rounding matters (`-0`, `±inf`,
/// values past `bf16`'s precision) and ordinary ones.
pub fn flat_cases(limits: &Limits) -> impl Strategy<Value = FlatCase> {
    let value = prop_oneof![
        Just(0.0f32),
        Just(-0.0),
        Just(f32::NEG_INFINITY),
        Just(f32::INFINITY),
        Just(1.0 + 1.0 / 256.0 + 1.0 / 512.0),
        Just(3.0e38),
        -4.0f32..4.0
    ];
    (strategies::dtype(), strategies::dtype(), 0..=limits.elems, value, 0usize..4, any::<u64>())
        .prop_map(|(dst, src, n, value, offset, seed)| FlatCase { dst, src, n, value, offset, seed })
}

/// Views of a gradient norm: their types and lengths, and the clipping threshold.
#[derive(Debug, Clone)]
pub struct NormCase {
    /// Each view's type and length.
    pub views: Vec<(DType, usize)>,
    /// `clip_grad_norm`'s `max_norm`, as a fraction of the norm (below 1: clipped).
    pub max_frac: f64,
    /// The seed of the data.
    pub seed: u64,
}

/// 1 to 4 views of up to `limits.elems` elements each (some empty).
pub fn norm_cases(limits: &Limits) -> impl Strategy<Value = NormCase> {
    let view = (strategies::dtype(), 0..=limits.elems);
    (prop::collection::vec(view, 1..=4), 0.0f64..2.0, any::<u64>()).prop_map(|(views, max_frac, seed)| NormCase {
        views,
        max_frac,
        seed,
    })
}

/// A `[A, B, C, D]` transpose with its two types.
#[derive(Clone)]
pub struct TransposeCase {
    /// The dims of the source.
    pub dims: [usize; 4],
    /// The destination's type.
    pub dst: DType,
    /// The source's type.
    pub src: DType,
    /// The seed of the data.
    pub seed: u64,
}

impl fmt::Debug for TransposeCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} {} -> {}, seed {:#x}", self.dims, self.src.name(), self.dst.name(), self.seed)
    }
}

/// Dims 1 to 9 each (the product kept within `limits.elems`).
pub fn transpose_cases(limits: &Limits) -> impl Strategy<Value = TransposeCase> {
    let cap = limits.elems.max(1);
    ([1usize..10, 1..10, 1..10, 1..10], strategies::dtype(), strategies::dtype(), any::<u64>())
        .prop_filter("fits the limits", move |(d, ..)| d.iter().product::<usize>() <= cap)
        .prop_map(|(dims, dst, src, seed)| TransposeCase { dims, dst, src, seed })
}

/// The checks of this family.
pub(crate) fn check(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let l = ctx.cfg.limits;
    ctx.property("copy converts by rounding to nearest even", flat_cases(&l), |c| copy(ctx, c))?;
    ctx.property("fill writes every element", flat_cases(&l), |c| fill(ctx, c))?;
    ctx.property("add and scale are one f32 operation per element", flat_cases(&l), |c| add_scale(ctx, c))?;
    ctx.property("transpose12 swaps the middle dims", transpose_cases(&l), |c| transpose(ctx, c))?;
    ctx.property("sum_squares and clip_grad_norm against f64 sums", norm_cases(&l), |c| norms(ctx, c))?;
    if l.long_elems > 0 {
        ctx.fixed("past the largest grid: copy, fill, add, scale, sum_squares, clip_grad_norm", || {
            let c = FlatCase { dst: DType::Bf16, src: DType::F32, n: l.long_elems, value: 0.75, offset: 1, seed: 9 };
            copy(ctx, &c)?;
            fill(ctx, &c)?;
            add_scale(ctx, &c)?;
            norms(ctx, &NormCase { views: vec![(DType::F32, l.long_elems), (DType::Bf16, 3)], max_frac: 0.5, seed: 10 })
        })?;
    }
    ctx.fixed("a norm past f32's range is a number, and clips", || {
        // Four elements of f32::MAX: the f64 norm is finite (2·MAX), the scale a subnormal f32.
        let c = NormCase { views: vec![(DType::F32, 4)], max_frac: 0.0, seed: 0 };
        norms_of(ctx, &c, vec![vec![f32::MAX as f64; 4]], 1.0)
    })
}

fn copy(ctx: &Ctx<'_>, c: &FlatCase) -> Result<(), Failure> {
    let x = DataRng::new(c.seed).values(c.n, 3.0, c.src);
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let src = m.input_at(c.src, &[c.n], &x, c.offset)?;
        let mut dst = m.poisoned_at(c.dst, &[c.n], c.offset)?;
        b.copy(dst.view_mut(), src.view()).at("copy")?;
        Ok(m.output_at("dst", "around dst", &dst)?.to_vec())
    };
    let want = x.iter().map(|&v| round(c.dst, v)).collect();
    ctx.compare("copy", c, run, &[Expect::new("dst", want, EXACT.of(c.dst)), Expect::guard("around dst", c.offset, 1)])
        .map(drop)
}

fn fill(ctx: &Ctx<'_>, c: &FlatCase) -> Result<(), Failure> {
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        // Other values first (drawn from the seed), so that an element `fill` skips shows.
        let mut dst = m.input(c.dst, &[c.n], &DataRng::new(c.seed).values(c.n, 1.0, c.dst))?;
        b.fill(dst.view_mut(), c.value).at("fill")?;
        Ok(vec![m.output("dst", &dst)?])
    };
    let want = vec![store(c.dst, c.value); c.n];
    ctx.compare("fill", c, run, &[Expect::new("dst", want, 0.0)]).map(drop)
}

fn add_scale(ctx: &Ctx<'_>, c: &FlatCase) -> Result<(), Failure> {
    let mut r = DataRng::new(c.seed);
    let (d, s) = (r.values(c.n, 2.0, c.dst), r.values(c.n, 2.0, c.src));
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let (mut dst, src) = (m.input_at(c.dst, &[c.n], &d, c.offset)?, m.input_at(c.src, &[c.n], &s, c.offset)?);
        b.add(dst.view_mut(), src.view()).at("add")?;
        let [sum, _] = m.output_at("dst += src", "", &dst)?;
        b.scale(dst.view_mut(), c.value).at("scale")?;
        let [scaled, guard] = m.output_at("dst *= a", "around dst", &dst)?;
        Ok(vec![sum, scaled, guard])
    };
    let sum: Vec<f64> = d.iter().zip(&s).map(|(&a, &b)| store(c.dst, a as f32 + b as f32)).collect();
    let scaled = sum.iter().map(|&x| store(c.dst, x as f32 * c.value)).collect();
    let want = [
        Expect::new("dst += src", sum, 0.0),
        Expect::new("dst *= a", scaled, 0.0),
        Expect::guard("around dst", c.offset, 1),
    ];
    ctx.compare("add/scale", c, run, &want).map(drop)
}

fn transpose(ctx: &Ctx<'_>, c: &TransposeCase) -> Result<(), Failure> {
    let [a, b_, cc, d] = c.dims;
    let x = DataRng::new(c.seed).values(a * b_ * cc * d, 1.0, c.src);
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let src = m.input(c.src, &c.dims, &x)?;
        let mut dst = m.poisoned(c.dst, &[a, cc, b_, d])?;
        b.transpose12(dst.view_mut(), src.view()).at("transpose12")?;
        Ok(vec![m.output("dst", &dst)?])
    };
    let mut want = vec![0.0; x.len()];
    for (ai, bi, ci, di) in (0..a)
        .flat_map(|ai| (0..b_).flat_map(move |bi| (0..cc).flat_map(move |ci| (0..d).map(move |di| (ai, bi, ci, di)))))
    {
        want[((ai * cc + ci) * b_ + bi) * d + di] = round(c.dst, x[((ai * b_ + bi) * cc + ci) * d + di]);
    }
    ctx.compare("transpose12", c, run, &[Expect::new("dst", want, 0.0)]).map(drop)
}

/// The names of `clip_grad_norm`'s outputs, one per view.
const CLIPPED: [&str; 4] = ["clipped[0]", "clipped[1]", "clipped[2]", "clipped[3]"];

fn norms(ctx: &Ctx<'_>, c: &NormCase) -> Result<(), Failure> {
    let mut r = DataRng::new(c.seed);
    let data: Vec<Vec<f64>> = c.views.iter().map(|&(dt, n)| r.values(n, 1.0, dt)).collect();
    let norm = data.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
    norms_of(ctx, c, data, (norm * c.max_frac) as f32)
}

fn norms_of(ctx: &Ctx<'_>, c: &NormCase, data: Vec<Vec<f64>>, max_norm: f32) -> Result<(), Failure> {
    let norm = data.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let mut bufs =
            c.views.iter().zip(&data).map(|(&(dt, n), x)| m.input(dt, &[n], x)).collect::<Result<Vec<_>, _>>()?;
        let views: Vec<_> = bufs.iter().map(|b| b.view()).collect();
        let ss = b.sum_squares(&views).at("sum_squares")?;
        let mut grads: Vec<ViewMut<'_>> = bufs.iter_mut().map(|b| b.view_mut()).collect();
        let n = b.clip_grad_norm(&mut grads, max_norm).at("clip_grad_norm")?;
        let mut out = vec![Output::host("sum_squares", vec![ss]), Output::host("norm", vec![n])];
        for (buf, name) in bufs.iter().zip(CLIPPED) {
            out.push(m.output(name, buf)?);
        }
        Ok(out)
    };
    // The scale is an `f32` computed from the `f64` norm: a backend whose norm differs in its last bits may round
    // it differently, hence the point-wise tolerance for the clipped gradients.
    let k = if norm > max_norm as f64 { (max_norm as f64 / (norm + 1e-6)) as f32 } else { 1.0 };
    let mut want =
        vec![Expect::new("sum_squares", vec![norm * norm], F64_SUM.f32), Expect::new("norm", vec![norm], F64_SUM.f32)];
    for ((x, &(dt, _)), name) in data.iter().zip(&c.views).zip(CLIPPED) {
        want.push(Expect::new(name, x.iter().map(|&v| store(dt, v as f32 * k)).collect(), POINTWISE.of(dt)));
    }
    ctx.compare("sum_squares/clip_grad_norm", c, run, &want).map(drop)
}
