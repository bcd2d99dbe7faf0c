//! Linear layers: `y = x·wᵀ + bias` and its backward (`dx`, optional; `dw`, `dbias` per [`GradMode`], in `f32` or
//! the inputs' type) against f64 loops. Every tensor may start a few rows into its buffer, as a dispatched expert's
//! rows do: a product on a pointer that is not at an allocation's start (2-byte aligned in `bf16`) must give the same
//! result and write nothing outside its view.
//!
//! Legend: `T` rows, `IN`/`OUT` features.

use std::fmt;

use proptest::prelude::*;

use super::data::DataRng;
use super::harness::{At, Ctx, Expect, Fault, Mem, Output};
use super::tolerance::REDUCTION;
use super::{strategies, Failure, Limits};
use crate::backend::{Backend, GradMode, LinearGrads};
use crate::dtype::DType;
use crate::saved::LinearSaved;

/// One linear layer: sizes, types, what the backward computes, and the seed of its data.
#[derive(Clone)]
pub struct LinearCase {
    /// Rows `T`.
    pub t: usize,
    /// `IN`.
    pub d_in: usize,
    /// `OUT`.
    pub d_out: usize,
    /// `x`, `w`, `bias`, `y`, `dy`, `dx`.
    pub dtype: DType,
    /// `dw` and `dbias`.
    pub grad_dtype: DType,
    /// With a bias (and `dbias`).
    pub bias: bool,
    /// With `dx` (the first layer skips it).
    pub dx: bool,
    /// Overwrite or accumulate `dw`, `dbias`.
    pub mode: GradMode,
    /// Rows before each tensor in its buffer (see the module docs).
    pub offset: usize,
    /// The seed of the data.
    pub seed: u64,
}

impl fmt::Debug for LinearCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "LinearCase {{ T {} IN {} OUT {}, {} (weight grads {}), bias {}, dx {}, {:?}, offset {}, seed {:#x} }}",
            self.t,
            self.d_in,
            self.d_out,
            self.dtype.name(),
            self.grad_dtype.name(),
            self.bias,
            self.dx,
            self.mode,
            self.offset,
            self.seed
        )
    }
}

/// Linear cases within `limits` (`T` up to `tokens`, `IN`/`OUT` up to `features`); the weight gradients `f32` or
/// the inputs' type (a `bf16` model accumulating `f32` gradients).
pub fn cases(limits: &Limits) -> impl Strategy<Value = LinearCase> {
    (
        (1..=limits.tokens.max(1), 1..=limits.features.max(1), 1..=limits.features.max(1)),
        (
            strategies::dtype(),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            strategies::grad_mode(),
            0usize..4,
            any::<u64>(),
        ),
    )
        .prop_map(|((t, d_in, d_out), (dtype, f32_grads, bias, dx, mode, offset, seed))| LinearCase {
            t,
            d_in,
            d_out,
            dtype,
            grad_dtype: if f32_grads { DType::F32 } else { dtype },
            bias,
            dx,
            mode,
            offset,
            seed,
        })
}

/// The checks of this family.
pub(crate) fn check(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let l = ctx.cfg.limits;
    ctx.property("forward and backward against f64 loops", cases(&l), |c| forward_backward(ctx, c))?;
    ctx.fixed("fixed shapes: many output tiles, long reductions over tokens", || {
        pinned(&l).iter().try_for_each(|c| forward_backward(ctx, c))
    })
}

/// Shapes past the CPU's 128×256 output tiles in both directions, and weight gradients over many tokens (the CPU
/// cuts such a reduction into chunks), within `limits`.
pub fn pinned(limits: &Limits) -> Vec<LinearCase> {
    let case = |t, d_in, d_out, dtype, grad_dtype, bias, mode, seed| LinearCase {
        t,
        d_in,
        d_out,
        dtype,
        grad_dtype,
        bias,
        dx: true,
        mode,
        offset: 0,
        seed,
    };
    let (f, b, o, a) = (DType::F32, DType::Bf16, GradMode::Overwrite, GradMode::Accumulate);
    let mut out = vec![case(3, 5, 7, f, f, true, a, 0)];
    if limits.tokens >= 40 {
        out.extend([
            case(200, 19, 300, f, f, false, a, 1),
            case(130, 33, 260, b, f, true, o, 2),
            case(150, 40, 270, f, f, true, a, 3),
        ]);
    }
    if limits.long_tokens >= 4500 {
        out.extend([
            case(4500, 24, 40, f, f, true, a, 5),
            case(4500, 17, 9, b, f, false, o, 5),
            case(4500, 24, 40, f, f, true, o, 6),
            case(4500, 17, 9, b, f, false, a, 6),
            case(9000, 8, 16, f, f, false, o, 7),
            case(4500, 12, 20, f, f, false, a, 8),
        ]);
    }
    out
}

struct Data {
    x: Vec<f64>,
    w: Vec<f64>,
    b: Vec<f64>,
    dy: Vec<f64>,
    dw0: Vec<f64>,
    db0: Vec<f64>,
}

/// `y[T,OUT] = x·wᵀ + b`.
fn reference(x: &[f64], w: &[f64], b: Option<&[f64]>, t: usize, d_in: usize, d_out: usize) -> Vec<f64> {
    let mut y = vec![0.0; t * d_out];
    for r in 0..t {
        for o in 0..d_out {
            y[r * d_out + o] =
                b.map_or(0.0, |b| b[o]) + (0..d_in).map(|i| x[r * d_in + i] * w[o * d_in + i]).sum::<f64>();
        }
    }
    y
}

/// `(dx, dw, db)` of `L = Σ dy ∘ y`: `dx = dy·w`, `dw = dyᵀ·x`, `db = Σ_t dy`.
fn reference_backward(dy: &[f64], x: &[f64], w: &[f64], t: usize, d_in: usize, d_out: usize) -> [Vec<f64>; 3] {
    let (mut dx, mut dw, mut db) = (vec![0.0; t * d_in], vec![0.0; d_out * d_in], vec![0.0; d_out]);
    for r in 0..t {
        for o in 0..d_out {
            let g = dy[r * d_out + o];
            db[o] += g;
            for i in 0..d_in {
                dx[r * d_in + i] += g * w[o * d_in + i];
                dw[o * d_in + i] += g * x[r * d_in + i];
            }
        }
    }
    [dx, dw, db]
}

fn forward_backward(ctx: &Ctx<'_>, c: &LinearCase) -> Result<(), Failure> {
    let (t, di, dout, dt, gt) = (c.t, c.d_in, c.d_out, c.dtype, c.grad_dtype);
    let mut r = DataRng::new(c.seed);
    let x = Data {
        x: r.values(t * di, 1.0, dt),
        w: r.values(dout * di, 1.0, dt),
        b: r.values(dout, 1.0, dt),
        dy: r.values(t * dout, 1.0, dt),
        dw0: r.values(dout * di, 1.0, gt),
        db0: r.values(dout, 1.0, gt),
    };
    let p = c.offset;
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let (xb, wb) = (m.input_at(dt, &[t, di], &x.x, p)?, m.input_at(dt, &[dout, di], &x.w, p)?);
        let bias = if c.bias { Some(m.input_at(dt, &[dout], &x.b, p)?) } else { None };
        let mut y = m.poisoned_at(dt, &[t, dout], p)?;
        b.linear_forward(y.view_mut(), xb.view(), wb.view(), bias.as_ref().map(|b| b.view())).at("linear_forward")?;
        let dy = m.input_at(dt, &[t, dout], &x.dy, p)?;
        let mut dx = m.poisoned_at(dt, &[t, di], p)?;
        let (mut dw, mut db) = match c.mode {
            GradMode::Overwrite => (m.poisoned_at(gt, &[dout, di], p)?, m.poisoned_at(gt, &[dout], p)?),
            GradMode::Accumulate => (m.input_at(gt, &[dout, di], &x.dw0, p)?, m.input_at(gt, &[dout], &x.db0, p)?),
        };
        let grads =
            LinearGrads { dx: c.dx.then(|| dx.view_mut()), dw: dw.view_mut(), dbias: c.bias.then(|| db.view_mut()) };
        b.linear_backward(grads, dy.view(), LinearSaved { x: xb.view() }, wb.view(), c.mode).at("linear_backward")?;
        let mut out = Vec::new();
        out.extend(m.output_at("y", "around y", &y)?);
        out.extend(m.output_at("dw", "around dw", &dw)?);
        if c.dx {
            out.extend(m.output_at("dx", "around dx", &dx)?);
        }
        if c.bias {
            out.extend(m.output_at("dbias", "around dbias", &db)?);
        }
        Ok(out)
    };
    let y = reference(&x.x, &x.w, c.bias.then_some(&x.b[..]), t, di, dout);
    let [dx, mut dw, mut db] = reference_backward(&x.dy, &x.x, &x.w, t, di, dout);
    if c.mode == GradMode::Accumulate {
        dw.iter_mut().zip(&x.dw0).for_each(|(a, b)| *a += b);
        db.iter_mut().zip(&x.db0).for_each(|(a, b)| *a += b);
    }
    let tol = REDUCTION.of(dt).max(REDUCTION.of(gt));
    let mut want = vec![
        Expect::new("y", y, tol),
        Expect::guard("around y", p, dout),
        Expect::new("dw", dw, tol),
        Expect::guard("around dw", p, di),
    ];
    if c.dx {
        want.extend([Expect::new("dx", dx, tol), Expect::guard("around dx", p, di)]);
    }
    if c.bias {
        want.extend([Expect::new("dbias", db, tol), Expect::guard("around dbias", p, 1)]);
    }
    ctx.compare("linear_forward+backward", c, run, &want).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::conformance::data::DataRng;

    /// The analytic backward against central differences of the forward (both f64 loops): a test of the suite's
    /// own reference.
    #[test]
    fn reference_backward_matches_finite_differences() {
        let (t, di, dout) = (4, 5, 3);
        let mut r = DataRng::new(1);
        let (x, w, b, dy) = (r.vec(t * di, 1.0), r.vec(dout * di, 1.0), r.vec(dout, 1.0), r.vec(t * dout, 1.0));
        let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
            reference(x, w, Some(b), t, di, dout).iter().zip(&dy).map(|(a, b)| a * b).sum()
        };
        let [dx, dw, db] = reference_backward(&dy, &x, &w, t, di, dout);
        let fd = |f: &dyn Fn(&[f64]) -> f64, at: &[f64]| -> Vec<f64> {
            (0..at.len())
                .map(|i| {
                    let (mut p, mut m) = (at.to_vec(), at.to_vec());
                    p[i] += 1e-4;
                    m[i] -= 1e-4;
                    (f(&p) - f(&m)) / 2e-4
                })
                .collect()
        };
        let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(a, b)| (a - b).abs() < 1e-8);
        assert!(close(&fd(&|v| loss(v, &w, &b), &x), &dx));
        assert!(close(&fd(&|v| loss(&x, v, &b), &w), &dw));
        assert!(close(&fd(&|v| loss(&x, &w, v), &b), &db));
    }
}
