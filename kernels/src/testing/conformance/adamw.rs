//! AdamW: a few steps on `f32` master weights from gradients of `f32` or `bf16`, with and without the rounded
//! `copy_to` (which must be the updated master weights rounded to its type, bit for bit), against PyTorch's
//! update in f64.

use std::fmt;

use proptest::prelude::*;

use super::data::{round, DataRng};
use super::harness::{At, Ctx, Expect, Fault, Mem, Output};
use super::tolerance::POINTWISE;
use super::{strategies, Failure, Limits};
use crate::backend::{AdamwState, Backend};
use crate::dtype::DType;
use crate::ops::AdamW;

/// A few AdamW steps: the parameter count, the steps, the hyper-parameters, the gradients' and the copy's types.
#[derive(Clone)]
pub struct AdamwCase {
    /// Parameters.
    pub n: usize,
    /// Steps taken (from step 1).
    pub steps: u64,
    /// The hyper-parameters.
    pub hp: AdamW,
    /// The gradients' type.
    pub grad_dtype: DType,
    /// The rounded copy's type, when there is one.
    pub copy_to: Option<DType>,
    /// The seed of the data.
    pub seed: u64,
}

impl fmt::Debug for AdamwCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "AdamwCase {{ P {}, {} steps, {:?}, grads {}, copy_to {:?}, seed {:#x} }}",
            self.n,
            self.steps,
            self.hp,
            self.grad_dtype.name(),
            self.copy_to.map(DType::name),
            self.seed
        )
    }
}

/// Cases of 1 to `limits.elems` parameters, 1 to 4 steps, a learning rate in `1e-4..1e-1`, weight decay 0, 0.01
/// or 0.1, β₂ 0.95 or 0.999.
pub fn cases(limits: &Limits) -> impl Strategy<Value = AdamwCase> {
    (
        (
            1..=limits.elems.max(1),
            1u64..5,
            1e-4f32..1e-1,
            prop::sample::select(vec![0.0f32, 0.01, 0.1]),
            prop::sample::select(vec![0.95f32, 0.999]),
        ),
        (strategies::dtype(), prop::option::of(strategies::dtype()), any::<u64>()),
    )
        .prop_map(|((n, steps, lr, weight_decay, beta2), (grad_dtype, copy_to, seed))| AdamwCase {
            n,
            steps,
            hp: AdamW { lr, beta1: 0.9, beta2, eps: 1e-8, weight_decay },
            grad_dtype,
            copy_to,
            seed,
        })
}

/// The checks of this family.
pub(crate) fn check(ctx: &Ctx<'_>) -> Result<(), Failure> {
    ctx.property("steps against PyTorch's update in f64", cases(&ctx.cfg.limits), |c| steps(ctx, c))?;
    let long = ctx.cfg.limits.long_elems;
    if long > 0 {
        ctx.fixed("past the largest grid", || {
            let hp = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
            steps(
                ctx,
                &AdamwCase { n: long, steps: 2, hp, grad_dtype: DType::Bf16, copy_to: Some(DType::Bf16), seed: 12 },
            )
        })?;
    }
    Ok(())
}

/// One step in f64 (PyTorch `AdamW`): decay, the moments, the bias-corrected update.
fn reference(p: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f64], h: &AdamW, step: u64) {
    let (b1, b2) = (h.beta1 as f64, h.beta2 as f64);
    let (bc1, bc2) = (1.0 - b1.powi(step as i32), 1.0 - b2.powi(step as i32));
    for i in 0..p.len() {
        p[i] *= 1.0 - h.lr as f64 * h.weight_decay as f64;
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
        p[i] -= h.lr as f64 * (m[i] / bc1) / ((v[i] / bc2).sqrt() + h.eps as f64);
    }
}

fn steps(ctx: &Ctx<'_>, c: &AdamwCase) -> Result<(), Failure> {
    let n = c.n;
    let mut r = DataRng::new(c.seed);
    let p0 = r.values(n, 1.0, DType::F32);
    let grads: Vec<Vec<f64>> = (0..c.steps).map(|_| r.values(n, 0.5, c.grad_dtype)).collect();
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let mem = Mem(b);
        let mut p = mem.input(DType::F32, &[n], &p0)?;
        let (mut m, mut v) = (mem.filled(DType::F32, &[n], 0.0)?, mem.filled(DType::F32, &[n], 0.0)?);
        let mut copy = match c.copy_to {
            Some(dt) => Some(mem.poisoned(dt, &[n])?),
            None => None,
        };
        for (step, g) in (1..).zip(&grads) {
            let gb = mem.input(c.grad_dtype, &[n], g)?;
            let state = AdamwState { m: m.view_mut(), v: v.view_mut() };
            b.adamw_step(p.view_mut(), copy.as_mut().map(|c| c.view_mut()), gb.view(), state, &c.hp, step)
                .at("adamw_step")?;
        }
        let mut out = vec![mem.output("master", &p)?, mem.output("m", &m)?, mem.output("v", &v)?];
        if let Some(copy) = &copy {
            out.push(mem.output("copy_to", copy)?);
        }
        Ok(out)
    };
    let (mut p, mut m, mut v) = (p0.clone(), vec![0.0; n], vec![0.0; n]);
    for (step, g) in (1..).zip(&grads) {
        reference(&mut p, &mut m, &mut v, g, &c.hp, step);
    }
    let tol = POINTWISE.f32;
    let mut want = vec![Expect::new("master", p.clone(), tol), Expect::new("m", m, tol), Expect::new("v", v, tol)];
    if let Some(dt) = c.copy_to {
        want.push(Expect::new("copy_to", p, POINTWISE.of(dt)));
    }
    let got = ctx.compare("adamw_step", c, run, &want)?;
    // The copy is the backend's own master weights rounded, bit for bit.
    if let Some(dt) = c.copy_to {
        let rounded: Vec<f64> = got[0].vals.iter().map(|&x| round(dt, x)).collect();
        ctx.within("adamw_step", c, &got[3], &rounded, 0.0, super::Against::Rerun)?;
    }
    Ok(())
}
