//! Mixture-of-experts routing (Hugging Face Mixtral): the router's softmax, top-k (ties to the lower expert) and
//! renormalised weights with its backward, the dispatch (gather) and the weighted combine with their backwards,
//! against f64 loops; ties; and a token's results not depending on which other tokens share the call.
//!
//! Legend: `L` tokens, `E` experts, `K` experts per token, `C` channels, `N = L·K` dispatched rows.

use std::fmt;

use proptest::prelude::*;

use super::data::DataRng;
use super::failure::Against;
use super::harness::{At, Ctx, Expect, Fault, Mem, Output};
use super::tolerance::{EXACT, POINTWISE, REDUCTION};
use super::{strategies, Failure, Limits};
use crate::backend::Backend;
use crate::dtype::DType;
use crate::ops::Routing;
use crate::saved::{MoeCombineSaved, MoeRouterSaved};

/// A router or dispatch case: sizes, element type and the seed of the logits, choices and data.
#[derive(Clone)]
pub struct MoeCase {
    /// Tokens `L`.
    pub l: usize,
    /// Experts `E`.
    pub e: usize,
    /// Experts per token `K` (at most `E`).
    pub k: usize,
    /// Channels `C` of the dispatched rows.
    pub c: usize,
    /// The logits', the tokens' and the expert rows' type.
    pub dtype: DType,
    /// With the load-balancing loss' gradient `aux`.
    pub aux: bool,
    /// The seed of the data.
    pub seed: u64,
}

impl fmt::Debug for MoeCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "MoeCase {{ L {} E {} K {} C {}, {}, aux {}, seed {:#x} }}",
            self.l,
            self.e,
            self.k,
            self.c,
            self.dtype.name(),
            self.aux,
            self.seed
        )
    }
}

/// Cases within `limits` (`L` up to `tokens`, `C` up to `features`), 1 to 8 experts, top 1 to `E`.
pub fn cases(limits: &Limits) -> impl Strategy<Value = MoeCase> {
    (1..=limits.tokens.max(1), 1usize..=8, 1..=limits.features.max(1), strategies::dtype(), any::<bool>(), any::<u64>())
        .prop_flat_map(|(l, e, c, dtype, aux, seed)| {
            (1..=e).prop_map(move |k| MoeCase { l, e, k, c, dtype, aux, seed })
        })
}

impl MoeCase {
    /// Each token's `K` distinct experts, drawn from the seed.
    fn choices(&self) -> Vec<u32> {
        let mut r = DataRng::new(self.seed ^ 0x5eed);
        (0..self.l)
            .flat_map(|_| {
                let mut all: Vec<u32> = (0..self.e as u32).collect();
                for i in 0..self.k {
                    let j = i + r.below(self.e - i);
                    all.swap(i, j);
                }
                all.truncate(self.k);
                all
            })
            .collect()
    }
}

/// The checks of this family.
pub(crate) fn check(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let l = ctx.cfg.limits;
    ctx.property("router forward and backward against f64 loops", cases(&l), |c| router(ctx, c))?;
    ctx.property("dispatch and combine with their backwards against f64 loops", cases(&l), |c| dispatch(ctx, c))?;
    ctx.fixed("64 experts, top 8, rows wider than a GPU block", || {
        let c = MoeCase { l: 9, e: 64, k: 8, c: l.wide, dtype: DType::Bf16, aux: true, seed: 7 };
        router(ctx, &c)?;
        dispatch(ctx, &c)
    })?;
    ctx.fixed("router ties go to the lower expert", || ties(ctx))?;
    ctx.fixed("a token's routing and combine do not depend on the other tokens of the call", || shared_call(ctx))
}

/// Per token: the softmax `p[E]`, the top-`k` choices (ties to the lower index) and their renormalised weights.
fn reference_router(logits: &[f64], e: usize, k: usize) -> (Vec<f64>, Vec<u32>, Vec<f64>) {
    let (mut p, mut c, mut w) = (vec![], vec![], vec![]);
    for row in logits.chunks(e) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = row.iter().map(|x| (x - m).exp()).sum();
        let pr: Vec<f64> = row.iter().map(|x| (x - m).exp() / z).collect();
        let mut idx: Vec<usize> = (0..e).collect();
        idx.sort_by(|&a, &b| pr[b].total_cmp(&pr[a]).then(a.cmp(&b)));
        let s: f64 = idx[..k].iter().map(|&i| pr[i]).sum();
        for &i in &idx[..k] {
            c.push(i as u32);
            w.push(pr[i] / s);
        }
        p.extend(pr);
    }
    (p, c, w)
}

/// `dlogits` of `J = Σ dw·w + Σ_t Σ_e aux[e]·p[t,e]` with the choices held fixed:
/// `dp[e] = aux[e]`, `dp[c_j] += (dw_j − Σ_m dw_m·w_m) / Σ_m p[c_m]`, `dlogits = p∘(dp − Σ p·dp)`.
fn reference_router_backward(
    p: &[f64],
    w: &[f64],
    choice: &[u32],
    dw: &[f64],
    aux: Option<&[f64]>,
    e: usize,
    k: usize,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(p.len());
    for t in 0..p.len() / e {
        let (p, w, dw, c) =
            (&p[t * e..(t + 1) * e], &w[t * k..(t + 1) * k], &dw[t * k..(t + 1) * k], &choice[t * k..(t + 1) * k]);
        let mut dp: Vec<f64> = (0..e).map(|i| aux.map_or(0.0, |a| a[i])).collect();
        let total: f64 = c.iter().map(|&i| p[i as usize]).sum();
        let g: f64 = dw.iter().zip(w).map(|(a, b)| a * b).sum();
        for j in 0..k {
            dp[c[j] as usize] += (dw[j] - g) / total;
        }
        let dot: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
        out.extend(p.iter().zip(&dp).map(|(p, d)| p * (d - dot)));
    }
    out
}

fn router(ctx: &Ctx<'_>, c: &MoeCase) -> Result<(), Failure> {
    let (l, e, k, dt) = (c.l, c.e, c.k, c.dtype);
    let mut r = DataRng::new(c.seed);
    let (logits, dw, aux) = (r.values(l * e, 2.0, dt), r.values(l * k, 1.0, DType::F32), r.values(e, 1.0, DType::F32));
    let (p, choice, w) = reference_router(&logits, e, k);
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let x = m.input(dt, &[l, e], &logits)?;
        let (mut probs, mut weights) = (m.poisoned(DType::F32, &[l, e])?, m.poisoned(DType::F32, &[l, k])?);
        let out = b.moe_router_forward(probs.view_mut(), weights.view_mut(), x.view(), k).at("moe_router_forward")?;
        let (dwb, auxb) = (m.input(DType::F32, &[l, k], &dw)?, m.input(DType::F32, &[e], &aux)?);
        let mut dl = m.poisoned(dt, &[l, e])?;
        // The backward from the reference's choices, so that it is compared on the routing the reference uses.
        let routing = Routing::new(choice.clone(), l, e, k).at("Routing::new")?;
        let saved = MoeRouterSaved { probs: probs.view(), weights: weights.view(), routing: &routing };
        b.moe_router_backward(dl.view_mut(), dwb.view(), c.aux.then(|| auxb.view()), saved)
            .at("moe_router_backward")?;
        let f = |v: &[u32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        Ok(vec![
            m.output("probs", &probs)?,
            m.output("weights", &weights)?,
            Output::host("choice", f(out.routing.choice())),
            Output::host("counts", out.routing.counts().iter().map(|&x| x as f64).collect()),
            Output::host("prob_sum", out.prob_sum.clone()),
            m.output("dlogits", &dl)?,
        ])
    };
    let tol = REDUCTION.of(dt);
    let counts = (0..e as u32).map(|i| choice.iter().filter(|&&x| x == i).count() as f64).collect();
    let sums = (0..e).map(|i| p.iter().skip(i).step_by(e).sum()).collect();
    let dl = reference_router_backward(&p, &w, &choice, &dw, c.aux.then_some(&aux[..]), e, k);
    let want = [
        Expect::new("probs", p.clone(), tol),
        Expect::new("weights", w.clone(), tol),
        Expect::new("choice", choice.iter().map(|&x| x as f64).collect(), EXACT.f32),
        Expect::new("counts", counts, EXACT.f32),
        Expect::new("prob_sum", sums, tol),
        Expect::new("dlogits", dl, tol),
    ];
    ctx.compare("moe_router_forward+backward", c, run, &want).map(drop)
}

fn dispatch(ctx: &Ctx<'_>, c: &MoeCase) -> Result<(), Failure> {
    let (l, e, k, ch, dt) = (c.l, c.e, c.k, c.c, c.dtype);
    let n = l * k;
    let choice = c.choices();
    let mut r = DataRng::new(c.seed);
    let (x, w, ye, dout, dxe) = (
        r.values(l * ch, 1.0, dt),
        r.values(l * k, 1.0, DType::F32),
        r.values(n * ch, 1.0, dt),
        r.values(l * ch, 1.0, dt),
        r.values(n * ch, 1.0, dt),
    );
    // The dispatch order: expert-major, tokens in order within an expert; `row_of[t·K + j]` is (t, j)'s row.
    let mut order = Vec::new();
    let mut row_of = vec![0usize; n];
    for ex in 0..e as u32 {
        for t in 0..l {
            for j in 0..k {
                if choice[t * k + j] == ex {
                    row_of[t * k + j] = order.len();
                    order.push(t);
                }
            }
        }
    }
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let routing = Routing::new(choice.clone(), l, e, k).at("Routing::new")?;
        let (xb, wb, yb, gb, dxeb) = (
            m.input(dt, &[l, ch], &x)?,
            m.input(DType::F32, &[l, k], &w)?,
            m.input(dt, &[n, ch], &ye)?,
            m.input(dt, &[l, ch], &dout)?,
            m.input(dt, &[n, ch], &dxe)?,
        );
        let mut xe = m.poisoned(dt, &[n, ch])?;
        b.moe_gather_forward(xe.view_mut(), xb.view(), &routing).at("moe_gather_forward")?;
        let mut dx = m.poisoned(dt, &[l, ch])?;
        b.moe_gather_backward(dx.view_mut(), dxeb.view(), &routing).at("moe_gather_backward")?;
        let mut out = m.poisoned(dt, &[l, ch])?;
        b.moe_combine_forward(out.view_mut(), yb.view(), wb.view(), &routing).at("moe_combine_forward")?;
        let (mut dye, mut dw) = (m.poisoned(dt, &[n, ch])?, m.poisoned(DType::F32, &[l, k])?);
        let saved = MoeCombineSaved { ye: yb.view(), weights: wb.view(), routing: &routing };
        b.moe_combine_backward(dye.view_mut(), dw.view_mut(), gb.view(), saved).at("moe_combine_backward")?;
        let rows = routing.row_tokens().iter().map(|&t| t as f64).collect();
        Ok(vec![
            Output::host("row_tokens", rows),
            m.output("xe", &xe)?,
            m.output("dx", &dx)?,
            m.output("out", &out)?,
            m.output("dye", &dye)?,
            m.output("dweights", &dw)?,
        ])
    };
    let xe: Vec<f64> = order.iter().flat_map(|&t| x[t * ch..(t + 1) * ch].to_vec()).collect();
    let (mut dx, mut out, mut dye, mut dw) =
        (vec![0.0; l * ch], vec![0.0; l * ch], vec![0.0; n * ch], vec![0.0; l * k]);
    for t in 0..l {
        for j in 0..k {
            let row = row_of[t * k + j];
            for i in 0..ch {
                dx[t * ch + i] += dxe[row * ch + i];
                out[t * ch + i] += w[t * k + j] * ye[row * ch + i];
                dye[row * ch + i] = w[t * k + j] * dout[t * ch + i];
                dw[t * k + j] += dout[t * ch + i] * ye[row * ch + i];
            }
        }
    }
    let tol = REDUCTION.of(dt);
    let want = [
        Expect::new("row_tokens", order.iter().map(|&t| t as f64).collect(), EXACT.f32),
        Expect::new("xe", xe, EXACT.of(dt)),
        Expect::new("dx", dx, tol),
        Expect::new("out", out, tol),
        Expect::new("dye", dye, POINTWISE.of(dt)),
        // Each weight's gradient is one dot product over `C` that may cancel to far below its terms: measured on at
        // least the size of a term, so that a well-computed dot that cancels is not held to its own tiny scale.
        Expect::new("dweights", dw, tol).floor(super::harness::scale(&dout) * super::harness::scale(&ye)),
    ];
    ctx.compare("moe_gather/combine+backward", c, run, &want).map(drop)
}

fn ties(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let x = [0.5, 1.0, 1.0, 1.0, 0.0, 0.0];
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let m = Mem(b);
        let xb = m.input(DType::F32, &[2, 3], &x)?;
        let (mut p, mut w) = (m.poisoned(DType::F32, &[2, 3])?, m.poisoned(DType::F32, &[2, 2])?);
        let out = b.moe_router_forward(p.view_mut(), w.view_mut(), xb.view(), 2).at("moe_router_forward")?;
        let f = |v: &[u32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let offsets = out.routing.offsets().iter().map(|&x| x as f64).collect();
        Ok(vec![
            Output::host("choice", f(out.routing.choice())),
            Output::host("offsets", offsets),
            Output::host("row_tokens", f(out.routing.row_tokens())),
            Output::host("token 0's weights", m.read(w.view())?[..2].to_vec()),
        ])
    };
    let want = [
        Expect::new("choice", vec![1.0, 2.0, 0.0, 1.0], 0.0),
        Expect::new("offsets", vec![0.0, 1.0, 3.0, 4.0], 0.0),
        Expect::new("row_tokens", vec![1.0, 0.0, 1.0, 0.0], 0.0),
        Expect::new("token 0's weights", vec![0.5, 0.5], 0.0),
    ];
    ctx.compare("moe_router_forward", &x, run, &want).map(drop)
}

/// A context-parallel rank routes its tokens as the whole sequence would: the second half of 40 tokens routed and
/// combined alone gives the bits the whole call gives for them.
fn shared_call(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let (l, e, k, c) = (40, 4, 2, 8);
    let mut r = DataRng::new(3);
    let (logits, ye) = (r.values(l * e, 2.0, DType::F32), r.values(l * k * c, 1.0, DType::F32));
    let (b, m, op) = (ctx.backend, ctx.mem(), "moe_router_forward/moe_combine_forward");
    let fault = |f: Fault| ctx.fault(op, &(l, e, k, c), f, false);
    let route = |x: &[f64], l: usize| -> Result<_, Fault> {
        let xb = m.input(DType::F32, &[l, e], x)?;
        let (mut p, mut w) = (m.poisoned(DType::F32, &[l, e])?, m.poisoned(DType::F32, &[l, k])?);
        let out = b.moe_router_forward(p.view_mut(), w.view_mut(), xb.view(), k).at("moe_router_forward")?;
        Ok((m.output("probs", &p)?, w, out.routing))
    };
    let (p, w, whole) = route(&logits, l).map_err(fault)?;
    let (p2, w2, half) = route(&logits[l / 2 * e..], l / 2).map_err(fault)?;
    let tail = |o: &Output, from: usize| Output { vals: o.vals[from..].to_vec(), ..o.clone() };
    let (wv, w2v) = (m.output("weights", &w).map_err(fault)?, m.output("weights", &w2).map_err(fault)?);
    ctx.same_bits(
        op,
        &"the second half alone",
        &[tail(&p, l / 2 * e), tail(&wv, l / 2 * k)],
        &[p2, w2v],
        Against::Rerun,
    )?;
    let choice = |r: &Routing| r.choice().iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let (cw, ch) = (choice(&whole), choice(&half));
    ctx.same_bits(
        op,
        &"the second half alone",
        &[Output::host("choice", cw[l / 2 * k..].to_vec())],
        &[Output::host("choice", ch)],
        Against::Rerun,
    )?;
    // The second half's dispatched rows, picked out of the whole call's in its dispatch order.
    let mut ye_half = vec![0.0; l / 2 * k * c];
    for (n, &t) in whole.row_tokens().iter().enumerate() {
        if t as usize >= l / 2 {
            let ex = whole.offsets().iter().rposition(|&o| o <= n).unwrap_or(0);
            let within = n - whole.offsets()[ex];
            let before = whole.row_tokens()[whole.offsets()[ex]..n].iter().filter(|&&u| (u as usize) < l / 2).count();
            let row = half.offsets()[ex] + within - before;
            ye_half[row * c..(row + 1) * c].copy_from_slice(&ye[n * c..(n + 1) * c]);
        }
    }
    let combine = |ye: &[f64], w: &crate::buffer::Buffer, routing: &Routing, l: usize| -> Result<Output, Fault> {
        let yb = m.input(DType::F32, &[l * k, c], ye)?;
        let mut out = m.poisoned(DType::F32, &[l, c])?;
        b.moe_combine_forward(out.view_mut(), yb.view(), w.view(), routing).at("moe_combine_forward")?;
        m.output("out", &out)
    };
    let a = combine(&ye, &w, &whole, l).map_err(fault)?;
    let h = combine(&ye_half, &w2, &half, l / 2).map_err(fault)?;
    ctx.same_bits(op, &"the second half alone", &[tail(&a, l / 2 * c)], &[h], Against::Rerun)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The router's analytic backward against central differences of its objective (choices held fixed): a test of
    /// the suite's own reference.
    #[test]
    fn reference_router_backward_matches_finite_differences() {
        let (l, e, k) = (7, 5, 2);
        let mut r = DataRng::new(7);
        let (logits, dw, aux) = (r.vec(l * e, 2.0), r.vec(l * k, 1.0), r.vec(e, 1.0));
        let (p, choice, w) = reference_router(&logits, e, k);
        let objective = |x: &[f64]| -> f64 {
            let (p, _, _) = reference_router(x, e, k);
            let mut j = 0.0;
            for t in 0..l {
                let pt = &p[t * e..(t + 1) * e];
                let c = &choice[t * k..(t + 1) * k];
                let s: f64 = c.iter().map(|&i| pt[i as usize]).sum();
                j += c.iter().enumerate().map(|(jj, &i)| dw[t * k + jj] * pt[i as usize] / s).sum::<f64>();
                j += pt.iter().zip(&aux).map(|(a, b)| a * b).sum::<f64>();
            }
            j
        };
        let an = reference_router_backward(&p, &w, &choice, &dw, Some(&aux), e, k);
        for i in 0..logits.len() {
            let (mut a, mut b) = (logits.clone(), logits.clone());
            a[i] += 1e-6;
            b[i] -= 1e-6;
            let fd = (objective(&a) - objective(&b)) / 2e-6;
            assert!((fd - an[i]).abs() < 1e-6, "dlogits[{i}]: {fd} vs {}", an[i]);
        }
    }
}
