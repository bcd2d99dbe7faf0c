//! The CPU backend's rotary embedding: each `[D]` row of `[B, H, S, D]` rotated by the cached angles of its
//! position ([`RopeTable`]'s layout and formulas).

use rayon::prelude::*;

use super::ROWS_PER_TASK;
use crate::dtype::Element;
use crate::ops::RopeTable;

impl RopeTable {
    /// Rotates the first `R` dims of every `D`-row of `x` by `sign`·θ in place; the other dims stay.
    fn apply<T: Element>(&self, x: &mut [T], positions: &[i64], sign: f32) {
        let (d, half, s_len) = (self.head_dim(), self.rotary_dim() / 2, positions.len());
        let angles = self.angles(positions);
        let (cos, sin) = (&angles.cos, &angles.sin);
        x.par_chunks_mut(d * ROWS_PER_TASK).enumerate().for_each(|(blk, o)| {
            for j in 0..o.len() / d {
                let s = (blk * ROWS_PER_TASK + j) % s_len;
                let (c, sn) = (&cos[s * half..(s + 1) * half], &sin[s * half..(s + 1) * half]);
                let o = &mut o[j * d..(j + 1) * d];
                for i in 0..half {
                    let (x1, x2) = (o[i].to_f32(), o[i + half].to_f32());
                    let si = sign * sn[i];
                    o[i] = T::from_f32(x1 * c[i] - x2 * si);
                    o[i + half] = T::from_f32(x2 * c[i] + x1 * si);
                }
            }
        });
    }

    /// Forward in place: `x[B,H,S,D]` is replaced by its rotation by the angles of `positions[S]`.
    pub(crate) fn forward_inplace<T: Element>(&self, x: &mut [T], positions: &[i64]) {
        self.apply(x, positions, 1.0);
    }

    /// Backward in place: `d[B,H,S,D]` (the gradient of the output) is replaced by the gradient of the input,
    /// the transposed rotation.
    pub(crate) fn backward_inplace<T: Element>(&self, d: &mut [T], positions: &[i64]) {
        self.apply(d, positions, -1.0);
    }
}
