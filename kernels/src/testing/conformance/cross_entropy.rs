//! The fused output projection and cross-entropy, chunked over tokens: the loss (and its sum and the valid count),
//! `dhidden` and `dweight` (per [`GradMode`], `f32` or the inputs' type) against f64 loops, for every chunk size,
//! ignored targets (`-100` or an id inside the vocabulary) and given denominators; the logits themselves through an
//! identity projection, up to scales where the softmax saturates; and what an ignored token may not change.
//!
//! Legend: `T` tokens, `C` channels, `V` vocabulary, `K` tokens per chunk.

use std::fmt;

use proptest::prelude::*;

use super::data::DataRng;
use super::harness::{At, Ctx, Expect, Fault, Mem, Output};
use super::tolerance::{HOST_SCALAR, REDUCTION};
use super::{strategies, Failure, Limits};
use crate::backend::{Backend, GradMode, ProjectionGrads};
use crate::dtype::DType;
use crate::ops::{CrossEntropyOptions, CrossEntropyOutput};

/// One fused cross-entropy: sizes, chunking, targets, denominator, types, mode and the seed.
#[derive(Clone)]
pub struct CrossEntropyCase {
    /// Tokens `T`.
    pub t: usize,
    /// Channels `C` (with `identity`, `V`).
    pub c: usize,
    /// Vocabulary `V`.
    pub v: usize,
    /// The options: chunk size, ignored id, denominator.
    pub opts: CrossEntropyOptions,
    /// The share of targets set to the ignored id.
    pub p_ignore: f64,
    /// The projection is the identity `[V, V]` and `hidden` holds the logits themselves, drawn at `scale`.
    pub identity: bool,
    /// The magnitude of the logits (with `identity`) or of `hidden` and the weight.
    pub scale: f64,
    /// `hidden`, `weight`, `dhidden`.
    pub dtype: DType,
    /// `dweight`.
    pub grad_dtype: DType,
    /// Overwrite or accumulate `dweight`.
    pub mode: GradMode,
    /// The seed of the data and targets.
    pub seed: u64,
}

impl fmt::Debug for CrossEntropyCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CrossEntropyCase {{ T {} C {} V {}, {:?}, ignored share {:.2}, {} scale {}, {} (dweight {}), {:?}, seed {:#x} }}",
            self.t,
            self.c,
            self.v,
            self.opts,
            self.p_ignore,
            if self.identity { "identity projection (logits)" } else { "projection" },
            self.scale,
            self.dtype.name(),
            self.grad_dtype.name(),
            self.mode,
            self.seed
        )
    }
}

impl CrossEntropyCase {
    /// `hidden[T,C]`, `weight[V,C]`, the targets and `dweight`'s starting values, rounded to their types.
    fn data(&self) -> (Vec<f64>, Vec<f64>, Vec<i64>, Vec<f64>) {
        let (t, c, v) = (self.t, self.c, self.v);
        let mut r = DataRng::new(self.seed);
        let (h, w) = if self.identity {
            let eye = (0..v * v).map(|i| if i / v == i % v { 1.0 } else { 0.0 }).collect();
            (r.values(t * v, self.scale, self.dtype), eye)
        } else {
            (r.values(t * c, self.scale, self.dtype), r.values(v * c, self.scale, self.dtype))
        };
        let ignore = self.opts.ignore_index;
        let targets = (0..t).map(|_| if r.unit() < self.p_ignore { ignore } else { r.below(v) as i64 }).collect();
        (h, w, targets, r.values(v * c, 1.0, self.grad_dtype))
    }
}

/// Cases within `limits`: `T` up to `tokens`, `C` up to 16, `V` up to 80, chunks of 1 to 30 tokens, up to half the
/// targets ignored (by `-100`, or by an id the vocabulary has), a denominator or not; a third of them through an
/// identity projection with logits up to 300 (a saturated softmax).
pub fn cases(limits: &Limits) -> impl Strategy<Value = CrossEntropyCase> {
    (
        (
            1..=limits.tokens.max(1),
            1usize..16,
            1usize..80,
            1usize..30,
            0.0f64..0.5,
            any::<bool>(),
            prop::option::of(1.0f64..50.0),
        ),
        (
            0u8..3,
            prop::sample::select(vec![1.0, 10.0, 300.0]),
            strategies::dtype(),
            any::<bool>(),
            strategies::grad_mode(),
            any::<u64>(),
        ),
    )
        .prop_map(
            |((t, c, v, chunk, p_ignore, in_vocab, denominator), (kind, scale, dtype, f32_grads, mode, seed))| {
                let identity = kind == 0;
                let ignore_index = if in_vocab { (v / 2) as i64 } else { -100 };
                CrossEntropyCase {
                    t,
                    c: if identity { v } else { c },
                    v,
                    opts: CrossEntropyOptions { ignore_index, chunk_tokens: chunk, denominator },
                    p_ignore,
                    identity,
                    scale: if identity { scale } else { 1.0 },
                    dtype,
                    grad_dtype: if f32_grads { DType::F32 } else { dtype },
                    mode,
                    seed,
                }
            },
        )
}

/// The checks of this family.
pub(crate) fn check(ctx: &Ctx<'_>) -> Result<(), Failure> {
    ctx.property("loss and gradients against f64, any chunk size", cases(&ctx.cfg.limits), |c| fused(ctx, c))?;
    ctx.fixed("a regression: one token, two classes, logits of 300", || {
        let opts = CrossEntropyOptions { chunk_tokens: 1, ..CrossEntropyOptions::default() };
        let (f, o) = (DType::F32, GradMode::Overwrite);
        let c = CrossEntropyCase {
            t: 1,
            c: 2,
            v: 2,
            opts,
            p_ignore: 0.0,
            identity: true,
            scale: 300.0,
            dtype: f,
            grad_dtype: f,
            mode: o,
            seed: 12507486941789957354,
        };
        fused(ctx, &c)
    })?;
    ctx.fixed("a vocabulary wider than a GPU block", || {
        [DType::F32, DType::Bf16, DType::F16].into_iter().try_for_each(|dtype| {
            let opts = CrossEntropyOptions { chunk_tokens: 4, ..CrossEntropyOptions::default() };
            let v = ctx.cfg.limits.wide;
            let c = CrossEntropyCase {
                t: 9,
                c: 16,
                v,
                opts,
                p_ignore: 0.2,
                identity: false,
                scale: 1.0,
                dtype,
                grad_dtype: DType::F32,
                mode: GradMode::Accumulate,
                seed: 5,
            };
            fused(ctx, &c)
        })
    })?;
    ctx.fixed("an ignored token changes nothing", || ignored(ctx))
}

/// `(loss_sum, n_valid, dhidden, dweight)` with `dz = (softmax(z) − onehot)/N` (0 for ignored tokens).
fn reference(
    h: &[f64],
    w: &[f64],
    targets: &[i64],
    c: usize,
    v: usize,
    opts: &CrossEntropyOptions,
) -> (f64, usize, Vec<f64>, Vec<f64>) {
    let t = targets.len();
    let n_valid = targets.iter().filter(|&&y| y != opts.ignore_index).count();
    let den = opts.denominator.unwrap_or(n_valid.max(1) as f64);
    let (mut sum, mut dh, mut dw) = (0.0, vec![0.0; t * c], vec![0.0; v * c]);
    for (i, &y) in targets.iter().enumerate() {
        if y == opts.ignore_index {
            continue;
        }
        let z: Vec<f64> = (0..v).map(|j| (0..c).map(|k| h[i * c + k] * w[j * c + k]).sum()).collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = z.iter().map(|x| (x - m).exp()).sum();
        sum += m + s.ln() - z[y as usize];
        for j in 0..v {
            let dz = ((z[j] - m).exp() / s - if j == y as usize { 1.0 } else { 0.0 }) / den;
            for k in 0..c {
                dh[i * c + k] += dz * w[j * c + k];
                dw[j * c + k] += dz * h[i * c + k];
            }
        }
    }
    (sum, n_valid, dh, dw)
}

/// Runs the fused op on `b` with `opts`: `[loss, loss_sum, n_valid, dhidden, dweight]`, named with `tag`.
#[allow(clippy::too_many_arguments)]
fn call(
    b: &dyn Backend,
    c: &CrossEntropyCase,
    h: &[f64],
    w: &[f64],
    targets: &[i64],
    base: &[f64],
    opts: &CrossEntropyOptions,
) -> Result<(CrossEntropyOutput, Output, Output), Fault> {
    let m = Mem(b);
    let (t, ch, v) = (targets.len(), c.c, c.v);
    let (hb, wb) = (m.input(c.dtype, &[t, ch], h)?, m.input(c.dtype, &[v, ch], w)?);
    let mut dh = m.poisoned(c.dtype, &[t, ch])?;
    let mut dw = match c.mode {
        GradMode::Overwrite => m.poisoned(c.grad_dtype, &[v, ch])?,
        GradMode::Accumulate => m.input(c.grad_dtype, &[v, ch], base)?,
    };
    let grads = ProjectionGrads { dhidden: dh.view_mut(), dweight: dw.view_mut() };
    let out = b.cross_entropy_fused(grads, hb.view(), wb.view(), targets, opts, c.mode).at("cross_entropy_fused")?;
    Ok((out, m.output("dhidden", &dh)?, m.output("dweight", &dw)?))
}

fn fused(ctx: &Ctx<'_>, c: &CrossEntropyCase) -> Result<(), Failure> {
    let (h, w, targets, base) = c.data();
    let one_chunk = CrossEntropyOptions { chunk_tokens: c.t, ..c.opts };
    let run = |b: &dyn Backend| -> Result<Vec<Output>, Fault> {
        let mut outs = Vec::new();
        for (opts, names) in [
            (&c.opts, ["loss", "loss_sum", "n_valid", "dhidden", "dweight"]),
            (
                &one_chunk,
                [
                    "loss (one chunk)",
                    "loss_sum (one chunk)",
                    "n_valid (one chunk)",
                    "dhidden (one chunk)",
                    "dweight (one chunk)",
                ],
            ),
        ] {
            let (out, dh, dw) = call(b, c, &h, &w, &targets, &base, opts)?;
            outs.extend([
                Output::host(names[0], vec![out.loss as f64]),
                Output::host(names[1], vec![out.loss_sum]),
                Output::host(names[2], vec![out.n_valid as f64]),
                Output { name: names[3], ..dh },
                Output { name: names[4], ..dw },
            ]);
        }
        Ok(outs)
    };
    let (sum, n_valid, dh, mut dw) = reference(&h, &w, &targets, c.c, c.v, &c.opts);
    if c.mode == GradMode::Accumulate {
        dw.iter_mut().zip(&base).for_each(|(a, b)| *a += b);
    }
    let den = c.opts.denominator.unwrap_or(n_valid.max(1) as f64);
    let (tol, ts) = (REDUCTION.of(c.dtype).max(REDUCTION.of(c.grad_dtype)), HOST_SCALAR.of(c.dtype));
    let mut want = Vec::new();
    for names in [
        ["loss", "loss_sum", "n_valid", "dhidden", "dweight"],
        [
            "loss (one chunk)",
            "loss_sum (one chunk)",
            "n_valid (one chunk)",
            "dhidden (one chunk)",
            "dweight (one chunk)",
        ],
    ] {
        want.extend([
            Expect::new(names[0], vec![sum / den], ts).floor(1.0),
            Expect::new(names[1], vec![sum], ts).floor(1.0),
            Expect::new(names[2], vec![n_valid as f64], 0.0),
            // A gradient whose every entry is below f32's range (a softmax saturated at 300) cannot be represented:
            // it is measured on a floor of 1e-30.
            Expect::new(names[3], dh.clone(), tol).floor(1e-30),
            Expect::new(names[4], dw.clone(), tol).floor(1e-30),
        ]);
    }
    let got = ctx.compare("cross_entropy_fused", c, run, &want)?;
    // Chunking changes no more than rounding: the loss within 1e-6, the gradients within a quarter of the tolerance
    // of one call over all the tokens at once (measured on the reference's scale, at least 1 for the loss).
    let find = |name: &str| got.iter().find(|o| o.name == name).expect("an output of the run");
    let scale = |x: &[f64]| x.iter().filter(|v| v.is_finite()).fold(1e-30f64, |m, v| m.max(v.abs()));
    let pairs = [
        ("loss", "loss (one chunk)", 1e-6, (sum / den).abs().max(1.0)),
        ("dhidden", "dhidden (one chunk)", tol / 4.0, scale(&dh)),
        ("dweight", "dweight (one chunk)", tol / 4.0, scale(&dw)),
    ];
    for (chunked, whole, t, on) in pairs {
        ctx.within_on("cross_entropy_fused", c, find(chunked), &find(whole).vals, on, t, super::Against::Rerun)?;
    }
    Ok(())
}

/// With `ignore_index` 3 (inside the vocabulary) and chunks of 4: an ignored token's `dhidden` row is exactly 0,
/// changing its hidden state changes neither the loss (bit for bit) nor `dweight`; the mean is over the valid
/// tokens only (the call on those alone gives it); all tokens ignored give a zero loss and zero gradients; a given
/// denominator divides the sum instead.
fn ignored(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let (t, ch, v) = (6, 5, 11);
    let opts = CrossEntropyOptions { ignore_index: 3, chunk_tokens: 4, denominator: None };
    let c = CrossEntropyCase {
        t,
        c: ch,
        v,
        opts,
        p_ignore: 0.0,
        identity: false,
        scale: 1.0,
        dtype: DType::F32,
        grad_dtype: DType::F32,
        mode: GradMode::Overwrite,
        seed: 9,
    };
    let (h, w, _, base) = c.data();
    let tg = vec![1i64, 3, 0, 3, 10, 2];
    let (op, b) = ("cross_entropy_fused", ctx.backend);
    let fault = |f: Fault| ctx.fault(op, &c, f, false);
    let (out, dh, dw) = call(b, &c, &h, &w, &tg, &base, &opts).map_err(fault)?;
    ctx.ensure(out.n_valid == 4, op, &c, || format!("{} valid tokens, not 4", out.n_valid))?;
    let zero_rows = dh.vals[ch..2 * ch].iter().chain(&dh.vals[3 * ch..4 * ch]).all(|&x| x == 0.0);
    ctx.ensure(zero_rows, op, &c, || "an ignored token's dhidden row is not 0".into())?;
    let mut h2 = h.clone();
    h2[ch..2 * ch].iter_mut().for_each(|x| *x *= -3.0);
    let (out2, _, dw2) = call(b, &c, &h2, &w, &tg, &base, &opts).map_err(fault)?;
    ctx.ensure(out.loss.to_bits() == out2.loss.to_bits(), op, &c, || {
        format!("an ignored token's hidden state moved the loss from {} to {}", out.loss, out2.loss)
    })?;
    ctx.within(op, &c, &dw2, &dw.vals, 1e-6, super::Against::Rerun)?;
    let keep = [0usize, 2, 4, 5];
    let hv: Vec<f64> = keep.iter().flat_map(|&i| h[i * ch..(i + 1) * ch].to_vec()).collect();
    let tv: Vec<i64> = keep.iter().map(|&i| tg[i]).collect();
    let (out3, _, _) = call(b, &c, &hv, &w, &tv, &base, &CrossEntropyOptions::default()).map_err(fault)?;
    ctx.ensure((out3.loss - out.loss).abs() < 1e-6, op, &c, || {
        format!("the mean over the valid tokens alone is {}, with the ignored ones {}", out3.loss, out.loss)
    })?;
    let (out4, dh4, dw4) = call(b, &c, &h, &w, &[3; 6], &base, &opts).map_err(fault)?;
    let zero = out4.loss == 0.0 && out4.n_valid == 0 && dh4.vals.iter().chain(&dw4.vals).all(|&x| x == 0.0);
    ctx.ensure(zero, op, &c, || {
        format!("all targets ignored: loss {}, {} valid, gradients not all zero", out4.loss, out4.n_valid)
    })?;
    let (out5, _, _) =
        call(b, &c, &h, &w, &tg, &base, &CrossEntropyOptions { denominator: Some(10.0), ..opts }).map_err(fault)?;
    ctx.ensure((out5.loss as f64 - out.loss_sum / 10.0).abs() < 1e-6, op, &c, || {
        format!("denominator 10: loss {} for a sum of {}", out5.loss, out.loss_sum)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference's gradients against central differences of its loss: a test of the suite's own reference.
    #[test]
    fn reference_gradients_match_finite_differences() {
        let (t, c, v) = (5, 4, 7);
        let mut r = DataRng::new(3);
        let (h, w) = (r.vec(t * c, 1.0), r.vec(v * c, 1.0));
        let targets = vec![1, -100, 6, 0, 3];
        let opts = CrossEntropyOptions::default();
        let (_, n, dh, dw) = reference(&h, &w, &targets, c, v, &opts);
        let loss = |h: &[f64], w: &[f64]| reference(h, w, &targets, c, v, &opts).0 / n as f64;
        let fd = |f: &dyn Fn(&[f64]) -> f64, at: &[f64]| -> Vec<f64> {
            (0..at.len())
                .map(|i| {
                    let (mut p, mut m) = (at.to_vec(), at.to_vec());
                    p[i] += 1e-5;
                    m[i] -= 1e-5;
                    (f(&p) - f(&m)) / 2e-5
                })
                .collect()
        };
        let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(a, b)| (a - b).abs() < 1e-8);
        assert!(close(&fd(&|x| loss(x, &w), &h), &dh));
        assert!(close(&fd(&|x| loss(&h, x), &w), &dw));
    }
}
