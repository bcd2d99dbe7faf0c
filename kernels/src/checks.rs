//! The checks of every op's arguments, in one place every backend uses: memory, dims, element types and the
//! domains of scalars and host data (ids below the vocabulary, targets, `eps`, AdamW's hyper-parameters), all
//! before any element is written, so an `Err` leaves outputs untouched and both backends refuse the same input
//! with the same error. Each function takes the backend ([`On`]) and the op's arguments and returns the sizes
//! the kernels need.
//!
//! Element types (`T` the op's storage type, `G` a weight gradient's, either `f32` or `bf16`):
//! - attention: `q`, `k`, `v` one type; `o`, `dout`, `dq`, `dk`, `dv` any; `lse` and the merge's buffers `f32`;
//! - linear, norms, activations, gather/combine, embedding, cross-entropy: inputs, outputs and activation
//!   gradients `T`; weight gradients (`dw`, `dbias`, `dweight`, `dtable`) `G`; norms' `rstd`/`mean`, the router's
//!   `probs`/`weights`/`aux` and the combine's weights `f32`;
//! - AdamW: master weights and moments `f32`, gradients and the rounded copy any.

use crate::attention::groups::expect_dims;
use crate::attention::{AttnGrads, AttnOptions, AttnOut, AttnParams, AttnPartial, AttnSaved, Qkv};
use crate::backend::{AdamwState, LinearGrads, NormGrads, NormParams, ProjectionGrads};
use crate::dtype::DType;
use crate::error::{check_len, KernelError, Result};
use crate::ops::{check_targets, AdamW, CrossEntropyOptions, RopeTable, Routing};
use crate::saved::{
    LayerNormSaved, LinearSaved, MoeCombineSaved, MoeRouterSaved, RmsNormSaved, SquaredReluSaved, SwigluSaved,
};
use crate::view::{wrong_memory, Memory, View, ViewMut};

/// The product of `dims`, or a [`KernelError::Shape`] when it overflows `usize`.
pub(crate) fn numel(what: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| KernelError::Shape(format!("{what}: element count {dims:?} overflows usize")))
}

/// Errors with [`KernelError::ZeroDim`] when `d` is zero.
pub(crate) fn nonzero(name: &'static str, d: usize) -> Result<()> {
    if d == 0 {
        Err(KernelError::ZeroDim(name))
    } else {
        Ok(())
    }
}

/// Errors with [`KernelError::InvalidArgument`] unless `x` is finite (and, with `positive`, above zero).
pub(crate) fn finite(name: &'static str, x: f64, positive: bool) -> Result<()> {
    if !x.is_finite() || (positive && x <= 0.0) {
        let want = if positive { "finite and > 0" } else { "finite" };
        Err(KernelError::InvalidArgument { name, why: format!("{x} is not {want}") })
    } else {
        Ok(())
    }
}

/// `got` must equal `want`.
pub(crate) fn same_dims(name: &'static str, got: &[usize], want: &[usize]) -> Result<()> {
    expect_dims(name, got, want)
}

/// `got` must be `want`.
pub(crate) fn same_dtype(name: &'static str, got: DType, want: DType) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(KernelError::DType { name, expected: want.name(), got: got.name() })
    }
}

/// `N` rows of the last dim `C` of a view (`C` must be positive).
pub(crate) fn rows(name: &'static str, dims: &[usize]) -> Result<(usize, usize)> {
    let c = *dims.last().unwrap_or(&0);
    if c == 0 {
        return Err(KernelError::ZeroDim(name));
    }
    Ok((dims.iter().product::<usize>() / c, c))
}

/// The `[rows, cols]` of a 2-dim view.
pub(crate) fn table_dims(d: &[usize]) -> Result<(usize, usize)> {
    match *d {
        [r, c] => Ok((r, c)),
        _ => Err(KernelError::Shape(format!("expected a 2-dim [rows, cols] view, got {d:?}"))),
    }
}

/// The backend a check runs for: the memory every view must live in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct On {
    pub memory: Memory,
}

impl On {
    /// Every view lives in this backend's memory.
    fn mem(&self, views: &[(&'static str, Memory)]) -> Result<()> {
        for &(name, got) in views {
            if got != self.memory {
                return Err(wrong_memory(name, self.memory, got));
            }
        }
        Ok(())
    }
}

/// Sizes of a linear layer: `T` rows, `IN`, `OUT` features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LinearDims {
    pub t: usize,
    pub d_in: usize,
    pub d_out: usize,
}

/// Sizes of a row-wise op: `N` rows of `C`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rows {
    pub n: usize,
    pub c: usize,
}

/// Sizes of a rotary embedding: `B·H` rows of `S` positions of `D`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RopeDims {
    pub b: usize,
    pub h: usize,
    pub s: usize,
}

/// Sizes and scale of the fused cross-entropy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct CrossEntropyDims {
    pub t: usize,
    pub c: usize,
    pub v: usize,
    pub n_valid: usize,
    /// What the loss sum is divided by.
    pub denom: f64,
}

pub(crate) fn copy(on: On, dst: &ViewMut<'_>, src: &View<'_>) -> Result<usize> {
    on.mem(&[("dst", dst.memory()), ("src", src.memory())])?;
    same_dims("dst", dst.dims(), src.dims())?;
    Ok(dst.len())
}

pub(crate) fn fill(on: On, dst: &ViewMut<'_>) -> Result<usize> {
    on.mem(&[("dst", dst.memory())])?;
    Ok(dst.len())
}

pub(crate) fn scale(on: On, x: &ViewMut<'_>, a: f32) -> Result<usize> {
    on.mem(&[("x", x.memory())])?;
    let _ = a;
    Ok(x.len())
}

pub(crate) fn sum_squares(on: On, xs: &[View<'_>]) -> Result<()> {
    for x in xs {
        on.mem(&[("xs", x.memory())])?;
    }
    Ok(())
}

/// `upload` and `download` move bytes: one dims and one dtype on both sides, `host` in host memory and `dev` in
/// the backend's.
pub(crate) fn transfer(on: On, host: (&'static str, Memory), dev: (&'static str, Memory)) -> Result<()> {
    On { memory: Memory::Host }.mem(&[host])?;
    on.mem(&[dev])
}

pub(crate) fn upload(on: On, dst: &ViewMut<'_>, src: &View<'_>) -> Result<usize> {
    transfer(on, ("src", src.memory()), ("dst", dst.memory()))?;
    same_dims("dst", dst.dims(), src.dims())?;
    same_dtype("dst", dst.dtype(), src.dtype())?;
    Ok(dst.len())
}

pub(crate) fn download(on: On, dst: &ViewMut<'_>, src: &View<'_>) -> Result<usize> {
    transfer(on, ("dst", dst.memory()), ("src", src.memory()))?;
    same_dims("dst", dst.dims(), src.dims())?;
    same_dtype("dst", dst.dtype(), src.dtype())?;
    Ok(dst.len())
}

/// `dst[a, c, b, d] = src[a, b, c, d]`: returns `[a, b, c, d]`.
pub(crate) fn transpose12(on: On, dst: &ViewMut<'_>, src: &View<'_>) -> Result<[usize; 4]> {
    on.mem(&[("dst", dst.memory()), ("src", src.memory())])?;
    let [a, b, c, d] = <[usize; 4]>::try_from(src.dims())
        .map_err(|_| KernelError::Shape(format!("`src` must have 4 dims, has {:?}", src.dims())))?;
    same_dims("dst", dst.dims(), &[a, c, b, d])?;
    Ok([a, b, c, d])
}

pub(crate) fn attention_forward<'m>(
    on: On,
    opts: &AttnOptions<'m>,
    out: &AttnOut<'_>,
    qkv: &Qkv<'_>,
) -> Result<AttnParams<'m>> {
    on.mem(&[("q", qkv.q.memory()), ("k", qkv.k.memory()), ("v", qkv.v.memory())])?;
    on.mem(&[("o", out.o.memory()), ("lse", out.lse.memory())])?;
    let shape = qkv.shape()?;
    out.check(&shape)?;
    opts.params(shape)
}

pub(crate) fn attention_backward<'m>(
    on: On,
    opts: &AttnOptions<'m>,
    grads: &AttnGrads<'_>,
    dout: &View<'_>,
    saved: &AttnSaved<'_>,
) -> Result<AttnParams<'m>> {
    let q = &saved.qkv;
    on.mem(&[("q", q.q.memory()), ("k", q.k.memory()), ("v", q.v.memory())])?;
    on.mem(&[("o", saved.o.memory()), ("lse", saved.lse.memory()), ("dout", dout.memory())])?;
    on.mem(&[("dq", grads.dq.memory()), ("dk", grads.dk.memory()), ("dv", grads.dv.memory())])?;
    let shape = saved.shape()?;
    grads.check(&shape)?;
    same_dims("dout", dout.dims(), saved.o.dims())?;
    opts.params(shape)
}

/// Returns the rows (`B·Hq·Sq`) and the row length `D`.
pub(crate) fn attention_merge(on: On, acc: &AttnOut<'_>, part: &AttnPartial<'_>) -> Result<(usize, usize)> {
    on.mem(&[("acc.o", acc.o.memory()), ("acc.lse", acc.lse.memory())])?;
    on.mem(&[("part.o", part.o.memory()), ("part.lse", part.lse.memory())])?;
    same_dims("part.o", part.o.dims(), acc.o.dims())?;
    same_dims("part.lse", part.lse.dims(), acc.lse.dims())?;
    for (name, dt) in [
        ("acc.o", acc.o.dtype()),
        ("acc.lse", acc.lse.dtype()),
        ("part.o", part.o.dtype()),
        ("part.lse", part.lse.dtype()),
    ] {
        same_dtype(name, dt, DType::F32)?;
    }
    let rows = acc.lse.len();
    if rows == 0 {
        check_len("o1", acc.o.len(), 0)?;
        return Ok((0, 0));
    }
    if !acc.o.len().is_multiple_of(rows) {
        return Err(KernelError::Shape(format!("o1 has {} elements, not a multiple of {rows} rows", acc.o.len())));
    }
    Ok((rows, acc.o.len() / rows))
}

fn linear_dims(y: &[usize], x: &[usize], w: &[usize]) -> Result<LinearDims> {
    let (t, d_in) = rows("x", x)?;
    let &[d_out, w_in] = w else {
        return Err(KernelError::Shape(format!("`w` must be [OUT, IN], has {w:?}")));
    };
    if w_in != d_in {
        return Err(KernelError::Shape(format!("`w` is {w:?} but `x`'s last dim is {d_in}")));
    }
    let (ty, y_out) = rows("y", y)?;
    if (ty, y_out) != (t, d_out) {
        return Err(KernelError::Shape(format!("`y` has dims {y:?}, expected {t} rows of {d_out}")));
    }
    nonzero("t", t)?;
    nonzero("d_out", d_out)?;
    Ok(LinearDims { t, d_in, d_out })
}

pub(crate) fn linear_forward(
    on: On,
    y: &ViewMut<'_>,
    x: &View<'_>,
    w: &View<'_>,
    bias: Option<&View<'_>>,
) -> Result<LinearDims> {
    on.mem(&[("y", y.memory()), ("x", x.memory()), ("w", w.memory())])?;
    let l = linear_dims(y.dims(), x.dims(), w.dims())?;
    let t = x.dtype();
    same_dtype("w", w.dtype(), t)?;
    same_dtype("y", y.dtype(), t)?;
    if let Some(b) = bias {
        on.mem(&[("bias", b.memory())])?;
        check_len("bias", b.len(), l.d_out)?;
        same_dtype("bias", b.dtype(), t)?;
    }
    Ok(l)
}

pub(crate) fn linear_backward(
    on: On,
    grads: &LinearGrads<'_>,
    dy: &View<'_>,
    saved: &LinearSaved<'_>,
    w: &View<'_>,
) -> Result<LinearDims> {
    on.mem(&[("dy", dy.memory()), ("x", saved.x.memory()), ("w", w.memory()), ("dw", grads.dw.memory())])?;
    let l = linear_dims(dy.dims(), saved.x.dims(), w.dims())?;
    same_dims("dw", grads.dw.dims(), w.dims())?;
    let t = saved.x.dtype();
    same_dtype("w", w.dtype(), t)?;
    same_dtype("dy", dy.dtype(), t)?;
    if let Some(dx) = &grads.dx {
        on.mem(&[("dx", dx.memory())])?;
        same_dims("dx", dx.dims(), saved.x.dims())?;
        same_dtype("dx", dx.dtype(), t)?;
    }
    if let Some(db) = &grads.dbias {
        on.mem(&[("dbias", db.memory())])?;
        check_len("dbias", db.len(), l.d_out)?;
        same_dtype("dbias", db.dtype(), grads.dw.dtype())?;
    }
    Ok(l)
}

fn eps(eps: f32) -> Result<()> {
    finite("eps", eps as f64, false)?;
    if eps < 0.0 {
        return Err(KernelError::InvalidArgument { name: "eps", why: format!("{eps} < 0") });
    }
    Ok(())
}

/// The norms' common checks: `x[N, C]` and `y` like it of one type, `weight[C]` (and `bias[C]`) of that type,
/// `f32` statistics of `N`.
fn norm_forward(
    on: On,
    y: &ViewMut<'_>,
    stats: &[(&'static str, &ViewMut<'_>)],
    x: &View<'_>,
    p: &NormParams<'_>,
) -> Result<Rows> {
    on.mem(&[("y", y.memory()), ("x", x.memory()), ("weight", p.weight.memory())])?;
    let (n, c) = rows("x", x.dims())?;
    nonzero("n", n)?;
    same_dims("y", y.dims(), x.dims())?;
    let t = x.dtype();
    same_dtype("y", y.dtype(), t)?;
    check_len("weight", p.weight.len(), c)?;
    same_dtype("weight", p.weight.dtype(), t)?;
    if let Some(b) = &p.bias {
        on.mem(&[("bias", b.memory())])?;
        check_len("bias", b.len(), c)?;
        same_dtype("bias", b.dtype(), t)?;
    }
    for (name, s) in stats {
        on.mem(&[(name, s.memory())])?;
        check_len(name, s.len(), n)?;
        same_dtype(name, s.dtype(), DType::F32)?;
    }
    eps(p.eps)?;
    Ok(Rows { n, c })
}

/// The norms' backward checks: `dx`, `dy` like `x`, `weight[C]` of `x`'s type, `dweight` (and `dbias`) `[C]` of
/// one type, `f32` statistics of `N`.
fn norm_backward(
    on: On,
    grads: &NormGrads<'_>,
    dy: &View<'_>,
    x: &View<'_>,
    stats: &[(&'static str, &View<'_>)],
    weight: &View<'_>,
) -> Result<Rows> {
    on.mem(&[("dx", grads.dx.memory()), ("dy", dy.memory()), ("x", x.memory()), ("weight", weight.memory())])?;
    on.mem(&[("dweight", grads.dweight.memory())])?;
    let (n, c) = rows("x", x.dims())?;
    nonzero("n", n)?;
    same_dims("dy", dy.dims(), x.dims())?;
    same_dims("dx", grads.dx.dims(), x.dims())?;
    let t = x.dtype();
    same_dtype("dy", dy.dtype(), t)?;
    same_dtype("dx", grads.dx.dtype(), t)?;
    check_len("weight", weight.len(), c)?;
    same_dtype("weight", weight.dtype(), t)?;
    check_len("dweight", grads.dweight.len(), c)?;
    if let Some(db) = &grads.dbias {
        on.mem(&[("dbias", db.memory())])?;
        check_len("dbias", db.len(), c)?;
        same_dtype("dbias", db.dtype(), grads.dweight.dtype())?;
    }
    for (name, s) in stats {
        on.mem(&[(name, s.memory())])?;
        check_len(name, s.len(), n)?;
        same_dtype(name, s.dtype(), DType::F32)?;
    }
    Ok(Rows { n, c })
}

pub(crate) fn rmsnorm_forward(
    on: On,
    y: &ViewMut<'_>,
    rstd: &ViewMut<'_>,
    x: &View<'_>,
    p: &NormParams<'_>,
) -> Result<Rows> {
    if p.bias.is_some() {
        return Err(KernelError::InvalidArgument { name: "bias", why: "RMSNorm has no bias".into() });
    }
    norm_forward(on, y, &[("rstd", rstd)], x, p)
}

pub(crate) fn rmsnorm_backward(
    on: On,
    grads: &NormGrads<'_>,
    dy: &View<'_>,
    saved: &RmsNormSaved<'_>,
    weight: &View<'_>,
) -> Result<Rows> {
    if grads.dbias.is_some() {
        return Err(KernelError::InvalidArgument { name: "dbias", why: "RMSNorm has no bias".into() });
    }
    norm_backward(on, grads, dy, &saved.x, &[("rstd", &saved.rstd)], weight)
}

pub(crate) fn layernorm_forward(
    on: On,
    y: &ViewMut<'_>,
    mean: &ViewMut<'_>,
    rstd: &ViewMut<'_>,
    x: &View<'_>,
    p: &NormParams<'_>,
) -> Result<Rows> {
    if p.bias.is_none() {
        return Err(KernelError::InvalidArgument { name: "bias", why: "LayerNorm needs a bias".into() });
    }
    norm_forward(on, y, &[("mean", mean), ("rstd", rstd)], x, p)
}

pub(crate) fn layernorm_backward(
    on: On,
    grads: &NormGrads<'_>,
    dy: &View<'_>,
    saved: &LayerNormSaved<'_>,
    weight: &View<'_>,
) -> Result<Rows> {
    if grads.dbias.is_none() {
        return Err(KernelError::InvalidArgument { name: "dbias", why: "LayerNorm's backward needs dbias".into() });
    }
    norm_backward(on, grads, dy, &saved.x, &[("mean", &saved.mean), ("rstd", &saved.rstd)], weight)
}

/// `x[B,H,S,D]` with `S` = the positions and `D` the table's head dim.
pub(crate) fn rope(on: On, rope: &RopeTable, x: &ViewMut<'_>, positions: &[i64]) -> Result<RopeDims> {
    on.mem(&[("x", x.memory())])?;
    match *x.dims() {
        [b, h, s, hd] if s == positions.len() && hd == rope.head_dim() => {
            nonzero("b", b)?;
            nonzero("h", h)?;
            nonzero("s", s)?;
            Ok(RopeDims { b, h, s })
        }
        _ => Err(KernelError::Shape(format!(
            "rotary embedding needs [B, H, S, D] with S = {} positions and D = {}, got {:?}",
            positions.len(),
            rope.head_dim(),
            x.dims()
        ))),
    }
}

/// Views of one dims and one type (element-wise ops).
fn alike(
    on: On,
    first: (&'static str, &[usize], DType, Memory),
    rest: &[(&'static str, &[usize], DType, Memory)],
) -> Result<usize> {
    on.mem(&[(first.0, first.3)])?;
    for &(name, dims, dtype, memory) in rest {
        on.mem(&[(name, memory)])?;
        same_dims(name, dims, first.1)?;
        same_dtype(name, dtype, first.2)?;
    }
    Ok(first.1.iter().product())
}

pub(crate) fn swiglu_forward(on: On, out: &ViewMut<'_>, gate: &View<'_>, up: &View<'_>) -> Result<usize> {
    alike(
        on,
        ("gate", gate.dims(), gate.dtype(), gate.memory()),
        &[("up", up.dims(), up.dtype(), up.memory()), ("out", out.dims(), out.dtype(), out.memory())],
    )
}

pub(crate) fn swiglu_backward(
    on: On,
    dgate: &ViewMut<'_>,
    dup: &ViewMut<'_>,
    dout: &View<'_>,
    saved: &SwigluSaved<'_>,
) -> Result<usize> {
    let g = &saved.gate;
    alike(
        on,
        ("gate", g.dims(), g.dtype(), g.memory()),
        &[
            ("up", saved.up.dims(), saved.up.dtype(), saved.up.memory()),
            ("dout", dout.dims(), dout.dtype(), dout.memory()),
            ("dgate", dgate.dims(), dgate.dtype(), dgate.memory()),
            ("dup", dup.dims(), dup.dtype(), dup.memory()),
        ],
    )
}

pub(crate) fn squared_relu_forward(on: On, out: &ViewMut<'_>, x: &View<'_>) -> Result<usize> {
    alike(on, ("x", x.dims(), x.dtype(), x.memory()), &[("out", out.dims(), out.dtype(), out.memory())])
}

pub(crate) fn squared_relu_backward(
    on: On,
    dx: &ViewMut<'_>,
    dout: &View<'_>,
    saved: &SquaredReluSaved<'_>,
) -> Result<usize> {
    let x = &saved.x;
    alike(
        on,
        ("x", x.dims(), x.dtype(), x.memory()),
        &[("dout", dout.dims(), dout.dtype(), dout.memory()), ("dx", dx.dims(), dx.dtype(), dx.memory())],
    )
}

fn f32_view(on: On, name: &'static str, dims: &[usize], want: &[usize], dtype: DType, memory: Memory) -> Result<()> {
    on.mem(&[(name, memory)])?;
    same_dims(name, dims, want)?;
    same_dtype(name, dtype, DType::F32)
}

/// Returns `(L, E)`.
pub(crate) fn moe_router_forward(
    on: On,
    probs: &ViewMut<'_>,
    weights: &ViewMut<'_>,
    logits: &View<'_>,
    top_k: usize,
) -> Result<(usize, usize)> {
    on.mem(&[("logits", logits.memory())])?;
    let (l, e) = table_dims(logits.dims())?;
    nonzero("l", l)?;
    nonzero("e", e)?;
    nonzero("k", top_k)?;
    if top_k > e {
        return Err(KernelError::InvalidArgument {
            name: "top_k",
            why: format!("{top_k} is more than the {e} experts"),
        });
    }
    f32_view(on, "probs", probs.dims(), &[l, e], probs.dtype(), probs.memory())?;
    f32_view(on, "weights", weights.dims(), &[l, top_k], weights.dtype(), weights.memory())?;
    Ok((l, e))
}

pub(crate) fn moe_router_backward(
    on: On,
    dlogits: &ViewMut<'_>,
    dweights: &View<'_>,
    aux: Option<&View<'_>>,
    saved: &MoeRouterSaved<'_>,
) -> Result<()> {
    let r = saved.routing;
    let (l, e, k) = (r.tokens(), r.experts(), r.top_k());
    on.mem(&[("dlogits", dlogits.memory())])?;
    same_dims("dlogits", dlogits.dims(), &[l, e])?;
    f32_view(on, "probs", saved.probs.dims(), &[l, e], saved.probs.dtype(), saved.probs.memory())?;
    f32_view(on, "weights", saved.weights.dims(), &[l, k], saved.weights.dtype(), saved.weights.memory())?;
    f32_view(on, "dweights", dweights.dims(), &[l, k], dweights.dtype(), dweights.memory())?;
    if let Some(a) = aux {
        f32_view(on, "aux", a.dims(), &[e], a.dtype(), a.memory())?;
    }
    Ok(())
}

/// Returns `C`.
pub(crate) fn moe_gather_forward(on: On, xe: &ViewMut<'_>, x: &View<'_>, routing: &Routing) -> Result<usize> {
    on.mem(&[("x", x.memory()), ("xe", xe.memory())])?;
    let (_, c) = table_dims(x.dims())?;
    nonzero("c", c)?;
    same_dims("x", x.dims(), &[routing.tokens(), c])?;
    same_dims("xe", xe.dims(), &[routing.rows(), c])?;
    same_dtype("xe", xe.dtype(), x.dtype())?;
    Ok(c)
}

/// Returns `C`.
pub(crate) fn moe_gather_backward(on: On, dx: &ViewMut<'_>, dxe: &View<'_>, routing: &Routing) -> Result<usize> {
    on.mem(&[("dxe", dxe.memory()), ("dx", dx.memory())])?;
    let (_, c) = table_dims(dxe.dims())?;
    nonzero("c", c)?;
    same_dims("dxe", dxe.dims(), &[routing.rows(), c])?;
    same_dims("dx", dx.dims(), &[routing.tokens(), c])?;
    same_dtype("dx", dx.dtype(), dxe.dtype())?;
    Ok(c)
}

/// Returns `C`.
pub(crate) fn moe_combine_forward(
    on: On,
    out: &ViewMut<'_>,
    ye: &View<'_>,
    weights: &View<'_>,
    routing: &Routing,
) -> Result<usize> {
    on.mem(&[("ye", ye.memory()), ("out", out.memory())])?;
    let (_, c) = table_dims(ye.dims())?;
    nonzero("c", c)?;
    same_dims("ye", ye.dims(), &[routing.rows(), c])?;
    same_dims("out", out.dims(), &[routing.tokens(), c])?;
    same_dtype("out", out.dtype(), ye.dtype())?;
    let wd = [routing.tokens(), routing.top_k()];
    f32_view(on, "weights", weights.dims(), &wd, weights.dtype(), weights.memory())?;
    Ok(c)
}

/// Returns `C`.
pub(crate) fn moe_combine_backward(
    on: On,
    dye: &ViewMut<'_>,
    dweights: &ViewMut<'_>,
    dout: &View<'_>,
    saved: &MoeCombineSaved<'_>,
) -> Result<usize> {
    let r = saved.routing;
    on.mem(&[("ye", saved.ye.memory()), ("dye", dye.memory()), ("dout", dout.memory())])?;
    let (_, c) = table_dims(saved.ye.dims())?;
    nonzero("c", c)?;
    same_dims("ye", saved.ye.dims(), &[r.rows(), c])?;
    same_dims("dye", dye.dims(), &[r.rows(), c])?;
    same_dims("dout", dout.dims(), &[r.tokens(), c])?;
    let t = saved.ye.dtype();
    same_dtype("dye", dye.dtype(), t)?;
    same_dtype("dout", dout.dtype(), t)?;
    let wd = [r.tokens(), r.top_k()];
    f32_view(on, "weights", saved.weights.dims(), &wd, saved.weights.dtype(), saved.weights.memory())?;
    f32_view(on, "dweights", dweights.dims(), &wd, dweights.dtype(), dweights.memory())?;
    Ok(c)
}

fn ids_in_range(ids: &[u32], v: usize) -> Result<()> {
    match ids.iter().position(|&i| i as usize >= v) {
        Some(t) => Err(KernelError::InvalidArgument {
            name: "ids",
            why: format!("ids[{t}] = {} is out of range for a vocabulary of {v}", ids[t]),
        }),
        None => Ok(()),
    }
}

/// Returns `(V, C)`.
pub(crate) fn embedding_forward(on: On, out: &ViewMut<'_>, ids: &[u32], table: &View<'_>) -> Result<(usize, usize)> {
    on.mem(&[("table", table.memory()), ("out", out.memory())])?;
    let (v, c) = table_dims(table.dims())?;
    nonzero("v", v)?;
    nonzero("c", c)?;
    same_dims("out", out.dims(), &[ids.len(), c])?;
    same_dtype("out", out.dtype(), table.dtype())?;
    ids_in_range(ids, v)?;
    Ok((v, c))
}

/// Returns `(V, C)`.
pub(crate) fn embedding_backward(on: On, dtable: &ViewMut<'_>, dout: &View<'_>, ids: &[u32]) -> Result<(usize, usize)> {
    on.mem(&[("dtable", dtable.memory()), ("dout", dout.memory())])?;
    let (v, c) = table_dims(dtable.dims())?;
    nonzero("v", v)?;
    nonzero("c", c)?;
    same_dims("dout", dout.dims(), &[ids.len(), c])?;
    ids_in_range(ids, v)?;
    Ok((v, c))
}

pub(crate) fn cross_entropy_fused(
    on: On,
    grads: &ProjectionGrads<'_>,
    hidden: &View<'_>,
    weight: &View<'_>,
    targets: &[i64],
    opts: &CrossEntropyOptions,
) -> Result<CrossEntropyDims> {
    on.mem(&[("hidden", hidden.memory()), ("weight", weight.memory())])?;
    on.mem(&[("dhidden", grads.dhidden.memory()), ("dweight", grads.dweight.memory())])?;
    let (t, c) = table_dims(hidden.dims())?;
    let (v, cw) = table_dims(weight.dims())?;
    same_dims("weight", &[v, cw], &[v, c])?;
    same_dims("dhidden", grads.dhidden.dims(), hidden.dims())?;
    same_dims("dweight", grads.dweight.dims(), weight.dims())?;
    let dt = hidden.dtype();
    same_dtype("weight", weight.dtype(), dt)?;
    same_dtype("dhidden", grads.dhidden.dtype(), dt)?;
    nonzero("t", t)?;
    nonzero("c", c)?;
    nonzero("v", v)?;
    nonzero("chunk_tokens", opts.chunk_tokens)?;
    check_len("targets", targets.len(), t)?;
    numel("logits chunk", &[opts.chunk_tokens.min(t), v])?;
    let (n_valid, denom) = check_targets(targets, v, opts)?;
    Ok(CrossEntropyDims { t, c, v, n_valid, denom })
}

/// Returns `P`.
pub(crate) fn adamw_step(
    on: On,
    master: &ViewMut<'_>,
    copy_to: Option<&ViewMut<'_>>,
    grads: &View<'_>,
    state: &AdamwState<'_>,
    hp: &AdamW,
    step: u64,
) -> Result<usize> {
    on.mem(&[("master", master.memory()), ("grads", grads.memory())])?;
    on.mem(&[("m", state.m.memory()), ("v", state.v.memory())])?;
    let d = master.dims();
    for (name, got) in [("grads", grads.dims()), ("m", state.m.dims()), ("v", state.v.dims())] {
        same_dims(name, got, d)?;
    }
    for (name, dt) in [("master", master.dtype()), ("m", state.m.dtype()), ("v", state.v.dtype())] {
        same_dtype(name, dt, DType::F32)?;
    }
    if let Some(c) = copy_to {
        on.mem(&[("copy_to", c.memory())])?;
        same_dims("copy_to", c.dims(), d)?;
    }
    hp.validate(step)?;
    Ok(master.len())
}
