//! SwiGLU (`silu(gate) ∘ up`) and squared ReLU (`max(x, 0)²`), forward and backward, against f64 formulas; and
//! SwiGLU at gates where `exp` overflows or underflows, infinite and NaN.

use proptest::prelude::*;

use super::data::DataRng;
use super::harness::{At, Ctx, Expect, Fault, Mem, Output};
use super::tolerance::POINTWISE;
use super::{strategies, Failure, Limits};
use crate::backend::Backend;
use crate::dtype::DType;
use crate::saved::{SquaredReluSaved, SwigluSaved};

/// An activation case: SwiGLU or squared ReLU, `[N, F]`, the element type and the seed.
#[derive(Debug, Clone)]
pub struct ActivationCase {
    /// SwiGLU; squared ReLU otherwise.
    pub swiglu: bool,
    /// The dims (`[N]` or `[N, F]`).
    pub dims: Vec<usize>,
    /// The element type.
    pub dtype: DType,
    /// The seed of the data.
    pub seed: u64,
}

/// Cases of 1 to `limits.elems` elements, flat or two-dimensional.
pub fn cases(limits: &Limits) -> impl Strategy<Value = ActivationCase> {
    (any::<bool>(), 1..=limits.elems.max(1), 1usize..64, any::<bool>(), strategies::dtype(), any::<u64>()).prop_map(
        |(swiglu, n, f, flat, dtype, seed)| {
            let dims = if flat || n < f { vec![n] } else { vec![n / f, f] };
            ActivationCase { swiglu, dims, dtype, seed }
        },
    )
}

/// The checks of this family.
pub(crate) fn check(ctx: &Ctx<'_>) -> Result<(), Failure> {
    ctx.property("forward and backward against f64 formulas", cases(&ctx.cfg.limits), |c| activation(ctx, c))?;
    let long = ctx.cfg.limits.long_elems;
    if long > 0 {
        ctx.fixed("past the largest grid", || {
            [true, false].into_iter().try_for_each(|swiglu| {
                activation(ctx, &ActivationCase { swiglu, dims: vec![long], dtype: DType::Bf16, seed: 11 })
            })
        })?;
    }
    ctx.fixed("SwiGLU saturates as the formula does", || saturation(ctx))
}

fn sigmoid(g: f64) -> f64 {
    1.0 / (1.0 + (-g).exp())
}

fn activation(ctx: &Ctx<'_>, c: &ActivationCase) -> Result<(), Failure> {
    let (dt, dims) = (c.dtype, &c.dims[..]);
    let n = dims.iter().product();
    let mut r = DataRng::new(c.seed);
    // Gates up to ±4 reach both tails of the sigmoid; |x| ≥ 0.2 keeps squared ReLU's kink out of rounding's reach.
    let (a, u, d) = (r.values(n, if c.swiglu { 4.0 } else { 2.0 }, dt), r.values(n, 1.0, dt), r.values(n, 1.0, dt));
    let tol = POINTWISE.of(dt);
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let (x, up, dout) = (m.input(dt, dims, &a)?, m.input(dt, dims, &u)?, m.input(dt, dims, &d)?);
        let (mut out, mut da, mut du) = (m.poisoned(dt, dims)?, m.poisoned(dt, dims)?, m.poisoned(dt, dims)?);
        if c.swiglu {
            b.swiglu_forward(out.view_mut(), x.view(), up.view()).at("swiglu_forward")?;
            let saved = SwigluSaved { gate: x.view(), up: up.view() };
            b.swiglu_backward(da.view_mut(), du.view_mut(), dout.view(), saved).at("swiglu_backward")?;
            Ok(vec![m.output("out", &out)?, m.output("dgate", &da)?, m.output("dup", &du)?])
        } else {
            b.squared_relu_forward(out.view_mut(), x.view()).at("squared_relu_forward")?;
            b.squared_relu_backward(da.view_mut(), dout.view(), SquaredReluSaved { x: x.view() })
                .at("squared_relu_backward")?;
            Ok(vec![m.output("out", &out)?, m.output("dx", &da)?])
        }
    };
    let want = if c.swiglu {
        let out = a.iter().zip(&u).map(|(g, u)| g * sigmoid(*g) * u).collect();
        // d/dg [g·σ(g)·u] = u·σ·(1 + g·(1 − σ)); d/du = g·σ(g).
        let dg = (0..n).map(|i| d[i] * u[i] * sigmoid(a[i]) * (1.0 + a[i] * (1.0 - sigmoid(a[i])))).collect();
        let du = (0..n).map(|i| d[i] * a[i] * sigmoid(a[i])).collect();
        vec![Expect::new("out", out, tol), Expect::new("dgate", dg, tol), Expect::new("dup", du, tol)]
    } else {
        let out = a.iter().map(|x| x.max(0.0) * x.max(0.0)).collect();
        let dx = (0..n).map(|i| d[i] * 2.0 * a[i].max(0.0)).collect();
        vec![Expect::new("out", out, tol), Expect::new("dx", dx, tol)]
    };
    let op = if c.swiglu { "swiglu_forward+backward" } else { "squared_relu_forward+backward" };
    ctx.compare(op, c, run, &want).map(drop)
}

/// Gates where `e^-g` leaves the normal range, and non-finite ones: `σ` saturates to 0 or 1, `silu(-inf)` is NaN
/// (`-inf · 0`), NaN stays NaN, as `g·σ(g)` gives them in f64.
fn saturation(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let g = [f64::INFINITY, f64::NEG_INFINITY, f64::NAN, 100.0, -100.0, 88.5, -88.5, 87.0, -87.0, 0.0];
    let n = g.len();
    let u = vec![1.5; n];
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let (gate, up) = (m.input(DType::F32, &[n], &g)?, m.input(DType::F32, &[n], &u)?);
        let mut out = m.poisoned(DType::F32, &[n])?;
        b.swiglu_forward(out.view_mut(), gate.view(), up.view()).at("swiglu_forward")?;
        Ok(vec![m.output("out", &out)?])
    };
    let want: Vec<f64> = g.iter().map(|&g| g / (1.0 + (-g).exp()) * 1.5).collect();
    ctx.compare("swiglu_forward", &g, run, &[Expect::new("out", want, POINTWISE.f32)]).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The analytic gradients the suite compares with against central differences of the forward formulas.
    #[test]
    fn reference_gradients_match_finite_differences() {
        let silu = |g: f64| g * sigmoid(g);
        for g in [-4.0, -1.3, -0.2, 0.3, 2.5, 4.0] {
            let fd = (silu(g + 1e-6) - silu(g - 1e-6)) / 2e-6;
            let an = sigmoid(g) * (1.0 + g * (1.0 - sigmoid(g)));
            assert!((fd - an).abs() < 1e-8, "silu'({g}): {fd} against {an}");
        }
        for x in [-1.5f64, -0.2, 0.2, 1.7] {
            let sq = |x: f64| x.max(0.0) * x.max(0.0);
            let fd = (sq(x + 1e-6) - sq(x - 1e-6)) / 2e-6;
            assert!((fd - 2.0 * x.max(0.0)).abs() < 1e-8, "squared ReLU'({x})");
        }
    }
}
