//! [`Local`]: one rank's side of the problem as a schedule runs it, and its attention calls through the backend.

use longctx_kernels::{AttnGrads, AttnPartial, AttnSaved, GradMode, Qkv, View};
use longctx_kernels::{AttnMask, AttnOptions, AttnOut, AttnParams, AttnShape, Backend, Positions};

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

    /// Attention of a block through the backend: `out.o` and `out.lse` are `f32`.
    pub fn attn_forward(&self, p: &AttnParams<'_>, qkv: Qkv<'_>, out: AttnOut<'_>) -> Result<()> {
        self.backend.attention_forward(&AttnOptions { mask: p.mask, scale: Some(p.scale) }, out, qkv)?;
        Ok(())
    }

    /// The backward of a block through the backend, into the `f32` gradients (added to them with
    /// [`GradMode::Accumulate`], written whole with `Overwrite`).
    pub fn attn_backward(
        &self,
        p: &AttnParams<'_>,
        saved: AttnSaved<'_>,
        d_o: View<'_>,
        grads: AttnGrads<'_>,
        mode: GradMode,
    ) -> Result<()> {
        let opts = AttnOptions { mask: p.mask, scale: Some(p.scale) };
        self.backend.attention_backward(&opts, grads, d_o, saved, mode)?;
        Ok(())
    }

    /// Merges a partial result into the accumulator through the backend.
    pub fn merge(&self, acc: AttnOut<'_>, part: AttnPartial<'_>) -> Result<()> {
        self.backend.attention_merge(acc, part)?;
        Ok(())
    }
}

/// Dims of a block's `Q` (and `O`, `dQ`): `[B, Hq, Lq, D]`.
pub(crate) fn q_dims(s: &AttnShape) -> [usize; 4] {
    [s.batch, s.q_heads, s.q_len, s.head_dim]
}
/// Dims of a block's `K`, `V` (and their gradients): `[B, Hkv, Lkv, D]`.
pub(crate) fn kv_dims(s: &AttnShape) -> [usize; 4] {
    [s.batch, s.kv_heads, s.kv_len, s.head_dim]
}
/// Dims of a block's `LSE`: `[B, Hq, Lq]`.
pub(crate) fn lse_dims(s: &AttnShape) -> [usize; 3] {
    [s.batch, s.q_heads, s.q_len]
}
