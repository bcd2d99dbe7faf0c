//! What travels together in an attention call: `Q`/`K`/`V` ([`Qkv`]), the output with its log-sum-exp
//! ([`AttnOut`]), what the forward saves for the backward ([`AttnSaved`]) and the gradients ([`AttnGrads`]).
//!
//! The fields are named, so `O` and `dO` (same type, same length) cannot be swapped without writing the
//! swap out. The dims come from the views: `Q`, `O`, `dQ`, `dO` are `[B, Hq, Sq, D]`, `K`, `V`, `dK`, `dV`
//! `[B, Hkv, Sk, D]`, `LSE` `[B, Hq, Sq]` `f32`.

use super::{AttnMask, AttnParams, AttnShape};
use crate::dtype::DType;
use crate::error::{KernelError, Result};
use crate::view::{Memory, View, ViewMut};

/// The inputs of attention.
#[derive(Debug, Clone, Copy)]
pub struct Qkv<'a> {
    /// `[B, Hq, Sq, D]`.
    pub q: View<'a>,
    /// `[B, Hkv, Sk, D]`.
    pub k: View<'a>,
    /// `[B, Hkv, Sk, D]`.
    pub v: View<'a>,
}

/// The output of the forward: `O` and the log-sum-exp of every query row.
#[derive(Debug)]
pub struct AttnOut<'a> {
    /// `[B, Hq, Sq, D]`.
    pub o: ViewMut<'a>,
    /// `[B, Hq, Sq]`, `f32`, natural log; `-inf` for a row that sees no key.
    pub lse: ViewMut<'a>,
}

/// A read-only output with its log-sum-exp: a partial result to merge, or what a forward produced.
#[derive(Debug, Clone, Copy)]
pub struct AttnPartial<'a> {
    /// `[B, Hq, Sq, D]`.
    pub o: View<'a>,
    /// `[B, Hq, Sq]`, `f32`.
    pub lse: View<'a>,
}

/// What the backward reads from the forward: its inputs, its output and the log-sum-exp.
#[derive(Debug, Clone, Copy)]
pub struct AttnSaved<'a> {
    /// The forward's inputs.
    pub qkv: Qkv<'a>,
    /// The forward's output `O`.
    pub o: View<'a>,
    /// The forward's `LSE`.
    pub lse: View<'a>,
}

/// The gradients of `Q`, `K`, `V`, written (or added to, see [`GradMode`](crate::GradMode)) by the backward.
#[derive(Debug)]
pub struct AttnGrads<'a> {
    /// `[B, Hq, Sq, D]`.
    pub dq: ViewMut<'a>,
    /// `[B, Hkv, Sk, D]`.
    pub dk: ViewMut<'a>,
    /// `[B, Hkv, Sk, D]`.
    pub dv: ViewMut<'a>,
}

/// The mask and softmax scale of an attention call; the sizes come from the views.
#[derive(Debug, Clone, Copy, Default)]
pub struct AttnOptions<'a> {
    /// Which keys each query sees.
    pub mask: AttnMask<'a>,
    /// Multiplies `q·k` before the softmax; `1/sqrt(D)` when `None`.
    pub scale: Option<f32>,
}

impl<'a> AttnOptions<'a> {
    /// The mask, with the default scale.
    pub fn new(mask: AttnMask<'a>) -> Self {
        Self { mask, scale: None }
    }
    /// The kernel parameters for `shape`, checked.
    pub fn params(&self, shape: AttnShape) -> Result<AttnParams<'a>> {
        let mut p = AttnParams::new(shape).with_mask(self.mask);
        if let Some(s) = self.scale {
            p = p.with_scale(s);
        }
        p.validate()?;
        Ok(p)
    }
}

fn dims4(name: &'static str, d: &[usize]) -> Result<[usize; 4]> {
    <[usize; 4]>::try_from(d)
        .map_err(|_| KernelError::Shape(format!("`{name}` must have dims [B, H, S, D], has {d:?}")))
}

pub(crate) fn expect_dims(name: &'static str, got: &[usize], want: &[usize]) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(KernelError::Shape(format!("`{name}` has dims {got:?}, expected {want:?}")))
    }
}

fn expect_same(name: &'static str, dtype: DType, want: DType, memory: Memory, want_memory: Memory) -> Result<()> {
    if dtype != want {
        return Err(KernelError::DType { name, expected: want.name(), got: dtype.name() });
    }
    if memory != want_memory {
        return Err(KernelError::Shape(format!("`{name}` is in {memory} memory, `q` in {want_memory}")));
    }
    Ok(())
}

impl<'a> Qkv<'a> {
    /// Groups three views.
    pub fn new(q: View<'a>, k: View<'a>, v: View<'a>) -> Self {
        Self { q, k, v }
    }
    /// The sizes the views imply, checked: four dims each, one batch and head dim, `K` and `V` alike, one dtype
    /// and one memory. The head rules ([`AttnShape::validate`]) are checked too.
    pub fn shape(&self) -> Result<AttnShape> {
        let [b, hq, sq, d] = dims4("q", self.q.dims())?;
        let [bk, hkv, sk, dk] = dims4("k", self.k.dims())?;
        expect_dims("k", self.k.dims(), &[b, hkv, sk, d]).map_err(|_| {
            KernelError::Shape(format!(
                "`k` dims [{bk}, {hkv}, {sk}, {dk}] disagree with `q` [{b}, {hq}, {sq}, {d}] in B or D"
            ))
        })?;
        expect_dims("v", self.v.dims(), self.k.dims())?;
        let (dt, mem) = (self.q.dtype(), self.q.memory());
        expect_same("k", self.k.dtype(), dt, self.k.memory(), mem)?;
        expect_same("v", self.v.dtype(), dt, self.v.memory(), mem)?;
        let shape = AttnShape { batch: b, q_heads: hq, kv_heads: hkv, q_len: sq, kv_len: sk, head_dim: d };
        shape.validate()?;
        Ok(shape)
    }
}

impl AttnOut<'_> {
    /// Checks `O` and `LSE` against the sizes of the call.
    pub fn check(&self, s: &AttnShape) -> Result<()> {
        expect_dims("o", self.o.dims(), &[s.batch, s.q_heads, s.q_len, s.head_dim])?;
        expect_lse("lse", self.lse.dims(), self.lse.dtype(), s)
    }
    /// A read-only view of both.
    pub fn as_partial(&self) -> AttnPartial<'_> {
        AttnPartial { o: self.o.as_view(), lse: self.lse.as_view() }
    }
}

impl AttnPartial<'_> {
    /// Checks `O` and `LSE` against the sizes of the call.
    pub fn check(&self, s: &AttnShape) -> Result<()> {
        expect_dims("o", self.o.dims(), &[s.batch, s.q_heads, s.q_len, s.head_dim])?;
        expect_lse("lse", self.lse.dims(), self.lse.dtype(), s)
    }
}

fn expect_lse(name: &'static str, dims: &[usize], dtype: DType, s: &AttnShape) -> Result<()> {
    expect_dims(name, dims, &[s.batch, s.q_heads, s.q_len])?;
    if dtype != DType::F32 {
        return Err(KernelError::DType { name, expected: "f32", got: dtype.name() });
    }
    Ok(())
}

impl AttnSaved<'_> {
    /// Bytes the saved tensors take.
    pub fn bytes(&self) -> usize {
        self.qkv.q.bytes() + self.qkv.k.bytes() + self.qkv.v.bytes() + self.o.bytes() + self.lse.bytes()
    }
    /// Bytes the forward of `shape` with buffers of `dtype` saves: `Q`, `K`, `V`, `O` and the `f32` `LSE`.
    pub fn bytes_for(shape: &AttnShape, dtype: DType) -> usize {
        (2 * shape.q_elems() + 2 * shape.kv_elems()) * dtype.size() + shape.lse_elems() * 4
    }
    /// The sizes, checked: `O` and `LSE` must match `Q`.
    pub fn shape(&self) -> Result<AttnShape> {
        let s = self.qkv.shape()?;
        AttnPartial { o: self.o, lse: self.lse }.check(&s)?;
        Ok(s)
    }
}

impl AttnGrads<'_> {
    /// Checks the gradients against the sizes of the call: `dQ` like `Q`, `dK` and `dV` like `K`.
    pub fn check(&self, s: &AttnShape) -> Result<()> {
        expect_dims("dq", self.dq.dims(), &[s.batch, s.q_heads, s.q_len, s.head_dim])?;
        expect_dims("dk", self.dk.dims(), &[s.batch, s.kv_heads, s.kv_len, s.head_dim])?;
        expect_dims("dv", self.dv.dims(), &[s.batch, s.kv_heads, s.kv_len, s.head_dim])
    }
}
