//! [`Local`]: one rank's side of the problem as a schedule runs it, and its attention calls through the backend.

use longctx_kernels::{AttnGrads, AttnSaved, Qkv, View, ViewMut};
use longctx_kernels::{AttnMask, AttnOptions, AttnOut, AttnParams, AttnShape, Backend, HostSlice, Positions};

use crate::error::Result;

/// One rank's side of the problem as a schedule runs it on some communicator.
#[derive(Clone, Copy)]
pub(crate) struct Local<'a> {
    pub backend: &'a dyn Backend,
    /// Block sizes on this rank (`q_len == kv_len`).
    pub shape: AttnShape,
    pub causal: bool,
    pub window: Option<u64>,
    pub scale: f32,
    /// Global positions of every rank's block, indexed by rank in the communicator the schedule uses.
    pub positions: &'a [Vec<i64>],
    /// This rank's index there.
    pub me: usize,
    /// Document ids of this rank's block.
    pub docs: Option<&'a [u32]>,
}

impl Local<'_> {
    pub fn my_positions(&self) -> &[i64] {
        &self.positions[self.me]
    }
    /// Kernel parameters for this rank's queries against a key block at `k_pos`.
    pub fn params<'b>(&'b self, k_pos: &'b [i64], k_doc: Option<&'b [u32]>) -> AttnParams<'b> {
        self.params_for(self.shape, self.my_positions(), k_pos, k_doc)
    }
    /// Kernel parameters of another block shape (a gathered KV slice).
    pub fn params_for<'b>(
        &'b self,
        shape: AttnShape,
        q_pos: &'b [i64],
        k_pos: &'b [i64],
        k_doc: Option<&'b [u32]>,
    ) -> AttnParams<'b> {
        let mut mask = AttnMask::full().with_positions(Positions::Explicit(q_pos), Positions::Explicit(k_pos));
        mask.causal = self.causal;
        mask.window = self.window;
        mask.q_doc = self.docs;
        mask.k_doc = k_doc;
        AttnParams { shape, mask, scale: self.scale }
    }

    /// Attention of host blocks through the backend: `o` and `lse` are `f32`.
    pub fn attn_forward(
        &self,
        p: &AttnParams<'_>,
        [q, k, v]: [HostSlice<'_>; 3],
        o: &mut [f32],
        lse: &mut [f32],
    ) -> Result<()> {
        let s = p.shape;
        let (qd, kd) = (q_dims(&s), kv_dims(&s));
        let qkv = Qkv::new(View::host(q, qd)?, View::host(k, kd)?, View::host(v, kd)?);
        let out = AttnOut { o: ViewMut::new(o, qd)?, lse: ViewMut::new(lse, [s.batch, s.q_heads, s.q_len])? };
        self.backend.attention_forward(&AttnOptions { mask: p.mask, scale: Some(p.scale) }, out, qkv)?;
        Ok(())
    }

    /// The backward of host blocks through the backend, into the `f32` gradients (added to them with
    /// [`GradMode::Accumulate`](longctx_kernels::GradMode), written whole with `Overwrite`).
    pub fn attn_backward(
        &self,
        p: &AttnParams<'_>,
        [q, k, v, o, d_o]: [HostSlice<'_>; 5],
        lse: &[f32],
        [dq, dk, dv]: [&mut [f32]; 3],
        mode: longctx_kernels::GradMode,
    ) -> Result<()> {
        let s = p.shape;
        let (qd, kd) = (q_dims(&s), kv_dims(&s));
        let qkv = Qkv::new(View::host(q, qd)?, View::host(k, kd)?, View::host(v, kd)?);
        let saved = AttnSaved { qkv, o: View::host(o, qd)?, lse: View::new(lse, [s.batch, s.q_heads, s.q_len])? };
        let grads = AttnGrads { dq: ViewMut::new(dq, qd)?, dk: ViewMut::new(dk, kd)?, dv: ViewMut::new(dv, kd)? };
        let opts = AttnOptions { mask: p.mask, scale: Some(p.scale) };
        self.backend.attention_backward(&opts, grads, View::host(d_o, qd)?, saved, mode)?;
        Ok(())
    }

    /// Merges a partial result into the accumulator through the backend.
    pub fn merge(&self, o: &mut [f32], lse: &mut [f32], o2: &[f32], lse2: &[f32]) -> Result<()> {
        let s = self.shape;
        let (qd, ld) = (q_dims(&s), [s.batch, s.q_heads, s.q_len]);
        let acc = AttnOut { o: ViewMut::new(o, qd)?, lse: ViewMut::new(lse, ld)? };
        let part = longctx_kernels::AttnPartial { o: View::new(o2, qd)?, lse: View::new(lse2, ld)? };
        self.backend.attention_merge(acc, part)?;
        Ok(())
    }
}

fn q_dims(s: &AttnShape) -> [usize; 4] {
    [s.batch, s.q_heads, s.q_len, s.head_dim]
}
fn kv_dims(s: &AttnShape) -> [usize; 4] {
    [s.batch, s.kv_heads, s.kv_len, s.head_dim]
}
