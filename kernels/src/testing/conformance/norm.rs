//! RMSNorm and LayerNorm over the last dim, forward (with the saved `rstd` and `mean`) and backward (`dx`, and
//! `dweight`, `dbias` per [`GradMode`] in `f32` or the inputs' type), against f64 loops.
//!
//! Legend: `N` rows, `C` channels.

use std::fmt;

use proptest::prelude::*;

use super::data::DataRng;
use super::harness::{At, Ctx, Expect, Fault, Mem, Output};
use super::tolerance::REDUCTION;
use super::{strategies, Failure, Limits};
use crate::backend::{Backend, GradMode, NormGrads, NormParams};
use crate::dtype::DType;
use crate::saved::{LayerNormSaved, RmsNormSaved};

/// One norm: which, sizes, `eps`, types, mode and the seed of its data.
#[derive(Clone)]
pub struct NormCase {
    /// LayerNorm (with a bias); RMSNorm otherwise.
    pub layernorm: bool,
    /// Rows `N`.
    pub n: usize,
    /// Channels `C`.
    pub c: usize,
    /// Added to the variance.
    pub eps: f32,
    /// `x`, `y`, `weight`, `bias`, `dy`, `dx`.
    pub dtype: DType,
    /// `dweight`, `dbias`.
    pub grad_dtype: DType,
    /// Overwrite or accumulate the parameter gradients.
    pub mode: GradMode,
    /// The seed of the data.
    pub seed: u64,
}

impl fmt::Debug for NormCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NormCase {{ {} N {} C {}, eps {:e}, {} (weight grads {}), {:?}, seed {:#x} }}",
            if self.layernorm { "LayerNorm" } else { "RMSNorm" },
            self.n,
            self.c,
            self.eps,
            self.dtype.name(),
            self.grad_dtype.name(),
            self.mode,
            self.seed
        )
    }
}

/// Norm cases within `limits` (`N` up to `tokens`, `C` up to `features`), `eps` among 1e-6, 1e-5, 1e-2.
///
/// `C` is at least 2 for RMSNorm and 3 for LayerNorm: below that, `dx` vanishes but for `eps` (a row of one
/// element normalises to ±1 whatever it holds, a centred row of two likewise), and what any backend computes is
/// the rounding noise of that cancellation.
pub fn cases(limits: &Limits) -> impl Strategy<Value = NormCase> {
    (
        (
            any::<bool>(),
            1..=limits.tokens.max(1),
            3..=limits.features.max(3),
            prop::sample::select(vec![1e-6f32, 1e-5, 1e-2]),
        ),
        (strategies::dtype(), any::<bool>(), strategies::grad_mode(), any::<u64>()),
    )
        .prop_map(|((layernorm, n, c, eps), (dtype, f32_grads, mode, seed))| NormCase {
            layernorm,
            n,
            c: if layernorm { c } else { c - 1 },
            eps,
            dtype,
            grad_dtype: if f32_grads { DType::F32 } else { dtype },
            mode,
            seed,
        })
}

/// The checks of this family.
pub(crate) fn check(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let l = ctx.cfg.limits;
    ctx.property("forward and backward against f64 loops", cases(&l), |c| forward_backward(ctx, c))?;
    ctx.fixed("fixed shapes: many row blocks", || {
        let n = l.tokens * 8;
        [false, true].into_iter().try_for_each(|layernorm| {
            let c = NormCase {
                layernorm,
                n,
                c: 64,
                eps: 1e-5,
                dtype: DType::F32,
                grad_dtype: DType::F32,
                mode: GradMode::Accumulate,
                seed: 3,
            };
            forward_backward(ctx, &c)
        })
    })?;
    ctx.fixed("fixed shapes: rows wider than a GPU block", || {
        [(false, DType::F32), (true, DType::F32), (false, DType::Bf16), (true, DType::Bf16)].into_iter().try_for_each(
            |(layernorm, dtype)| {
                let c = NormCase {
                    layernorm,
                    n: 5,
                    c: l.wide,
                    eps: 1e-5,
                    dtype,
                    grad_dtype: DType::F32,
                    mode: GradMode::Overwrite,
                    seed: 4,
                };
                forward_backward(ctx, &c)
            },
        )
    })
}

/// Per row: the mean (0 for RMSNorm), `rstd`, and `x̂ = (x − mean)·rstd`.
fn stats(x: &[f64], c: usize, eps: f64, layernorm: bool) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut mean, mut rstd, mut xh) = (Vec::new(), Vec::new(), Vec::new());
    for row in x.chunks(c) {
        let mu = if layernorm { row.iter().sum::<f64>() / c as f64 } else { 0.0 };
        let r = 1.0 / (row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / c as f64 + eps).sqrt();
        mean.push(mu);
        rstd.push(r);
        xh.extend(row.iter().map(|v| (v - mu) * r));
    }
    (mean, rstd, xh)
}

/// `y = x̂·w (+ b)`.
fn reference(x: &[f64], w: &[f64], b: Option<&[f64]>, c: usize, eps: f64) -> Vec<f64> {
    let (_, _, xh) = stats(x, c, eps, b.is_some());
    xh.iter().enumerate().map(|(i, v)| v * w[i % c] + b.map_or(0.0, |b| b[i % c])).collect()
}

/// `(dx, dw, db)`: with `g = dy·w`, `dx = rstd·(g − mean(g) − x̂·mean(g·x̂))` (RMSNorm: without `mean(g)`),
/// `dw = Σ_rows dy·x̂`, `db = Σ_rows dy`.
fn reference_backward(dy: &[f64], x: &[f64], w: &[f64], c: usize, eps: f64, layernorm: bool) -> [Vec<f64>; 3] {
    let (_, rstd, xh) = stats(x, c, eps, layernorm);
    let (mut dx, mut dw, mut db) = (vec![0.0; x.len()], vec![0.0; c], vec![0.0; c]);
    for (r, &rs) in rstd.iter().enumerate() {
        let row = r * c..(r + 1) * c;
        let (mut sg, mut sgx) = (0.0, 0.0);
        for i in row.clone() {
            let g = dy[i] * w[i % c];
            dw[i % c] += dy[i] * xh[i];
            db[i % c] += dy[i];
            sg += g;
            sgx += g * xh[i];
        }
        let mg = if layernorm { sg / c as f64 } else { 0.0 };
        for i in row {
            dx[i] = rs * (dy[i] * w[i % c] - mg - xh[i] * sgx / c as f64);
        }
    }
    [dx, dw, db]
}

fn forward_backward(ctx: &Ctx<'_>, c: &NormCase) -> Result<(), Failure> {
    let (n, ch, dt, gt, ln) = (c.n, c.c, c.dtype, c.grad_dtype, c.layernorm);
    let mut r = DataRng::new(c.seed);
    // An offset mean exercises LayerNorm's centring.
    let x: Vec<f64> =
        r.vec(n * ch, 2.0).iter().map(|v| super::data::round(dt, v + if ln { 0.5 } else { 0.0 })).collect();
    let (w, b, dy) = (r.values(ch, 1.0, dt), r.values(ch, 1.0, dt), r.values(n * ch, 1.0, dt));
    let (dw0, db0) = (r.values(ch, 1.0, gt), r.values(ch, 1.0, gt));
    let eps = c.eps as f64;
    let run = |be: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(be);
        let (xb, wb, bb) = (m.input(dt, &[n, ch], &x)?, m.input(dt, &[ch], &w)?, m.input(dt, &[ch], &b)?);
        let (mut y, mut mean, mut rstd) =
            (m.poisoned(dt, &[n, ch])?, m.poisoned(DType::F32, &[n])?, m.poisoned(DType::F32, &[n])?);
        let p = NormParams { weight: wb.view(), bias: ln.then(|| bb.view()), eps: c.eps };
        if ln {
            be.layernorm_forward(y.view_mut(), mean.view_mut(), rstd.view_mut(), xb.view(), &p)
                .at("layernorm_forward")?;
        } else {
            be.rmsnorm_forward(y.view_mut(), rstd.view_mut(), xb.view(), &p).at("rmsnorm_forward")?;
        }
        let dyb = m.input(dt, &[n, ch], &dy)?;
        let mut dx = m.poisoned(dt, &[n, ch])?;
        let (mut dw, mut db) = match c.mode {
            GradMode::Overwrite => (m.poisoned(gt, &[ch])?, m.poisoned(gt, &[ch])?),
            GradMode::Accumulate => (m.input(gt, &[ch], &dw0)?, m.input(gt, &[ch], &db0)?),
        };
        let grads = NormGrads { dx: dx.view_mut(), dweight: dw.view_mut(), dbias: ln.then(|| db.view_mut()) };
        if ln {
            let saved = LayerNormSaved { x: xb.view(), mean: mean.view(), rstd: rstd.view() };
            be.layernorm_backward(grads, dyb.view(), saved, wb.view(), c.mode).at("layernorm_backward")?;
        } else {
            let saved = RmsNormSaved { x: xb.view(), rstd: rstd.view() };
            be.rmsnorm_backward(grads, dyb.view(), saved, wb.view(), c.mode).at("rmsnorm_backward")?;
        }
        let mut out =
            vec![m.output("y", &y)?, m.output("rstd", &rstd)?, m.output("dx", &dx)?, m.output("dweight", &dw)?];
        if ln {
            out.extend([m.output("mean", &mean)?, m.output("dbias", &db)?]);
        }
        Ok(out)
    };
    let (mean, rstd, _) = stats(&x, ch, eps, ln);
    let y = reference(&x, &w, ln.then_some(&b[..]), ch, eps);
    let [dx, mut dw, mut db] = reference_backward(&dy, &x, &w, ch, eps, ln);
    if c.mode == GradMode::Accumulate {
        dw.iter_mut().zip(&dw0).for_each(|(a, b)| *a += b);
        db.iter_mut().zip(&db0).for_each(|(a, b)| *a += b);
    }
    let tol = REDUCTION.of(dt).max(REDUCTION.of(gt));
    let mut want = vec![
        Expect::new("y", y, tol),
        Expect::new("rstd", rstd, tol),
        Expect::new("dx", dx, tol),
        Expect::new("dweight", dw, tol),
    ];
    if ln {
        want.extend([Expect::new("mean", mean, tol), Expect::new("dbias", db, tol)]);
    }
    let op = if ln { "layernorm_forward+backward" } else { "rmsnorm_forward+backward" };
    ctx.compare(op, c, run, &want).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fd(f: &dyn Fn(&[f64]) -> f64, at: &[f64]) -> Vec<f64> {
        (0..at.len())
            .map(|i| {
                let (mut p, mut m) = (at.to_vec(), at.to_vec());
                p[i] += 1e-5;
                m[i] -= 1e-5;
                (f(&p) - f(&m)) / 2e-5
            })
            .collect()
    }

    /// The analytic backward against central differences of the forward: a test of the suite's own reference.
    #[test]
    fn reference_backward_matches_finite_differences() {
        let (n, c, eps) = (3, 7, 1e-5);
        let mut r = DataRng::new(2);
        let (x, w, b, dy) = (r.vec(n * c, 2.0), r.vec(c, 1.0), r.vec(c, 1.0), r.vec(n * c, 1.0));
        for ln in [false, true] {
            let bias = ln.then_some(&b[..]);
            let loss = |x: &[f64], w: &[f64], b: Option<&[f64]>| -> f64 {
                reference(x, w, b, c, eps).iter().zip(&dy).map(|(a, b)| a * b).sum()
            };
            let [dx, dw, db] = reference_backward(&dy, &x, &w, c, eps, ln);
            let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(a, b)| (a - b).abs() < 1e-6);
            assert!(close(&fd(&|v| loss(v, &w, bias), &x), &dx), "dx, layernorm {ln}");
            assert!(close(&fd(&|v| loss(&x, v, bias), &w), &dw), "dw, layernorm {ln}");
            if ln {
                assert!(close(&fd(&|v| loss(&x, &w, Some(v)), &b), &db), "db");
            }
        }
    }
}
