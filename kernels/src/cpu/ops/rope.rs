//! The CPU backend's rotary embedding: each `[D]` row of `[B, H, S, D]` rotated by the cached angles of its
//! position ([`RopeTable`]'s layout and formulas).

use rayon::prelude::*;

use super::ROWS_PER_TASK;
use crate::checks::{nonzero, numel};
use crate::dtype::Element;
use crate::error::{check_len, Result};
use crate::ops::RopeTable;

impl RopeTable {
    fn check<T: Element>(&self, out: &[T], inp: &[T], positions: &[i64], b: usize, h: usize) -> Result<usize> {
        nonzero("b", b)?;
        nonzero("h", h)?;
        nonzero("s", positions.len())?;
        let n = numel("x", &[b, h, positions.len(), self.head_dim()])?;
        check_len("input", inp.len(), n)?;
        check_len("output", out.len(), n)?;
        Ok(n)
    }

    /// Rotates the first `R` dims of every `D`-row of `out` (reading `inp`, or `out` itself when `None`) by
    /// `sign`·θ; the other dims are copied from `inp` (or left as they are).
    fn apply<T: Element>(&self, out: &mut [T], inp: Option<&[T]>, positions: &[i64], sign: f32) {
        let (d, half, s_len) = (self.head_dim(), self.rotary_dim() / 2, positions.len());
        let angles = self.angles(positions);
        let (cos, sin) = (&angles.cos, &angles.sin);
        let block = |blk: usize, o: &mut [T], x: Option<&[T]>| {
            for j in 0..o.len() / d {
                let s = (blk * ROWS_PER_TASK + j) % s_len;
                let (c, sn) = (&cos[s * half..(s + 1) * half], &sin[s * half..(s + 1) * half]);
                let o = &mut o[j * d..(j + 1) * d];
                let x = x.map(|x| &x[j * d..(j + 1) * d]);
                if let Some(x) = x {
                    o[2 * half..].copy_from_slice(&x[2 * half..]);
                }
                for i in 0..half {
                    let (x1, x2) = match x {
                        Some(x) => (x[i].to_f32(), x[i + half].to_f32()),
                        None => (o[i].to_f32(), o[i + half].to_f32()),
                    };
                    let si = sign * sn[i];
                    o[i] = T::from_f32(x1 * c[i] - x2 * si);
                    o[i + half] = T::from_f32(x2 * c[i] + x1 * si);
                }
            }
        };
        match inp {
            Some(inp) => out
                .par_chunks_mut(d * ROWS_PER_TASK)
                .zip(inp.par_chunks(d * ROWS_PER_TASK))
                .enumerate()
                .for_each(|(blk, (o, x))| block(blk, o, Some(x))),
            None => out.par_chunks_mut(d * ROWS_PER_TASK).enumerate().for_each(|(blk, o)| block(blk, o, None)),
        }
    }

    /// Forward: `y[B,H,S,D]` = `x` rotated by the angles of `positions[S]`.
    ///
    /// Errors: a zero size, or `x`/`y` not holding `B·H·S·D` elements.
    pub(crate) fn forward<T: Element>(
        &self,
        y: &mut [T],
        x: &[T],
        positions: &[i64],
        b: usize,
        h: usize,
    ) -> Result<()> {
        self.check(y, x, positions, b, h)?;
        self.apply(y, Some(x), positions, 1.0);
        Ok(())
    }

    /// Backward: `dx[B,H,S,D]` = `dy` rotated back (the transpose of the forward map).
    ///
    /// Errors: a zero size, or `dx`/`dy` not holding `B·H·S·D` elements.
    pub(crate) fn backward<T: Element>(
        &self,
        dx: &mut [T],
        dy: &[T],
        positions: &[i64],
        b: usize,
        h: usize,
    ) -> Result<()> {
        self.check(dx, dy, positions, b, h)?;
        self.apply(dx, Some(dy), positions, -1.0);
        Ok(())
    }

    /// In-place forward: `x[B,H,S,D]` is replaced by its rotation (e.g. Q and K before attention).
    ///
    /// Errors: a zero size, or `x` not holding `B·H·S·D` elements.
    pub(crate) fn forward_inplace<T: Element>(&self, x: &mut [T], positions: &[i64], b: usize, h: usize) -> Result<()> {
        self.check(x, x, positions, b, h)?;
        self.apply(x, None, positions, 1.0);
        Ok(())
    }

    /// In-place backward: `d[B,H,S,D]` (the gradient of the output) is replaced by the gradient of the input.
    ///
    /// Errors: a zero size, or `d` not holding `B·H·S·D` elements.
    pub(crate) fn backward_inplace<T: Element>(
        &self,
        d: &mut [T],
        positions: &[i64],
        b: usize,
        h: usize,
    ) -> Result<()> {
        self.check(d, d, positions, b, h)?;
        self.apply(d, None, positions, -1.0);
        Ok(())
    }
}
