//! Rotary embedding (`rope.cu`): the positions and the table's frequencies are uploaded per call, the angles
//! computed on the device, then `x` rotated in place.

use super::{bytes_of, grid, kernel, ptr_mut, suffix};
use crate::checks::RopeDims;
use crate::cuda::device::{KernelArgs, KernelSource};
use crate::cuda::stream::Stream;
use crate::error::Result;
use crate::ops::RopeTable;
use crate::view::ViewMut;

pub(crate) static SOURCE: KernelSource = KernelSource {
    file: "rope.cu",
    code: include_str!("../kernels/rope.cu"),
    kernels: &["rope_angles", "rope_apply_f32", "rope_apply_bf16", "rope_apply_f16"],
    includes: &[],
};

/// Rotates `x[B,H,S,D]` by `sign`·θ (1 forward, −1 backward).
pub(crate) fn apply(
    b: &Stream,
    rope: &RopeTable,
    d: RopeDims,
    x: ViewMut<'_>,
    positions: &[i64],
    sign: f32,
) -> Result<()> {
    let half = rope.rotary_dim() / 2;
    let t = x.dtype();
    let pos = b.upload_bytes(bytes_of(positions))?;
    let inv = b.upload_bytes(bytes_of(rope.inv_freq()))?;
    let (cos, sin) = (b.scratch(4 * d.s * half)?, b.scratch(4 * d.s * half)?);
    let n = (d.s * half) as u64;
    let k = kernel(&SOURCE, "rope_angles")?;
    let mut args = KernelArgs::new();
    args.push(cos.ptr()).push(sin.ptr()).push(pos.ptr()).push(inv.ptr());
    args.push(d.s as u32).push(half as u32).push(rope.attention_factor());
    // SAFETY: the tables hold `S·R/2` floats; `pos` `S` i64s, `inv` `R/2` f64s.
    unsafe { b.launch(&k, grid(n), &args)? };
    let rows = (d.b * d.h * d.s) as u64;
    let xp = ptr_mut(b, "x", x)?;
    let k = kernel(&SOURCE, &format!("rope_apply_{}", suffix(t)))?;
    let mut args = KernelArgs::new();
    args.push(xp).push(cos.ptr()).push(sin.ptr()).push(rows).push(d.s as u32);
    args.push(rope.head_dim() as u32).push(half as u32).push(sign);
    // SAFETY: `x` holds `B·H·S·D` elements on this device (checked); the tables as above.
    unsafe { b.launch(&k, grid(rows * half as u64), &args) }
}
