//! Element-wise ops and the sum of squares (`elementwise.cu`).

use super::{grid, kernel, ptr, ptr_mut, suffix, MAX_BLOCKS};
use crate::backend::AdamwState;
use crate::cuda::device::{KernelArgs, KernelSource, LaunchConfig};
use crate::cuda::stream::Stream;
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::AdamW;
use crate::saved::{SquaredReluSaved, SwigluSaved};
use crate::view::{View, ViewMut};

pub(crate) static SOURCE: KernelSource = KernelSource {
    file: "elementwise.cu",
    code: include_str!("../kernels/elementwise.cu"),
    kernels: &[
        "copy_f32_f32",
        "copy_f32_bf16",
        "copy_f32_f16",
        "copy_bf16_f32",
        "copy_bf16_bf16",
        "copy_bf16_f16",
        "copy_f16_f32",
        "copy_f16_bf16",
        "copy_f16_f16",
        "add_f32_f32",
        "add_f32_bf16",
        "add_f32_f16",
        "add_bf16_f32",
        "add_bf16_bf16",
        "add_bf16_f16",
        "add_f16_f32",
        "add_f16_bf16",
        "add_f16_f16",
        "transpose12_f32_f32",
        "transpose12_f32_bf16",
        "transpose12_f32_f16",
        "transpose12_bf16_f32",
        "transpose12_bf16_bf16",
        "transpose12_bf16_f16",
        "transpose12_f16_f32",
        "transpose12_f16_bf16",
        "transpose12_f16_f16",
        "fill_f32",
        "fill_bf16",
        "fill_f16",
        "scale_f32",
        "scale_bf16",
        "scale_f16",
        "sum_squares_f32",
        "sum_squares_bf16",
        "sum_squares_f16",
        "sum_partials_f64",
        "swiglu_fwd_f32",
        "swiglu_bwd_f32",
        "squared_relu_fwd_f32",
        "squared_relu_bwd_f32",
        "swiglu_fwd_bf16",
        "swiglu_bwd_bf16",
        "squared_relu_fwd_bf16",
        "squared_relu_bwd_bf16",
        "swiglu_fwd_f16",
        "swiglu_bwd_f16",
        "squared_relu_fwd_f16",
        "squared_relu_bwd_f16",
        "adamw_f32_f32",
        "adamw_f32_bf16",
        "adamw_f32_f16",
        "adamw_bf16_f32",
        "adamw_bf16_bf16",
        "adamw_bf16_f16",
        "adamw_f16_f32",
        "adamw_f16_bf16",
        "adamw_f16_f16",
    ],
    includes: &[],
};

fn launch(b: &Stream, name: &str, n: usize, args: &KernelArgs) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let k = kernel(&SOURCE, name)?;
    // SAFETY: every kernel of this source takes its pointers first, then scalars, as `args` holds them (built
    // by the callers below from views of this device covering `n` elements).
    unsafe { b.launch(&k, grid(n as u64), args) }
}

pub(crate) fn copy(b: &Stream, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
    let (n, dt, st) = (dst.len(), dst.dtype(), src.dtype());
    let s = ptr(b, "src", &src)?;
    let d = ptr_mut(b, "dst", dst)?;
    if dt == st {
        if n == 0 || d == s {
            return Ok(());
        }
        // SAFETY: both views hold `n` elements of one type on this device; distinct views do not overlap.
        return unsafe { b.copy_bytes(d, s, n * dt.size()) };
    }
    launch(b, &format!("copy_{}_{}", suffix(dt), suffix(st)), n, KernelArgs::new().push(d).push(s).push(n as u64))
}

pub(crate) fn fill(b: &Stream, dst: ViewMut<'_>, value: f32) -> Result<()> {
    let (n, dt) = (dst.len(), dst.dtype());
    let d = ptr_mut(b, "dst", dst)?;
    if dt == DType::F32 && n > 0 {
        // SAFETY: `dst` holds `n` f32 words on this device.
        return unsafe { b.memset32(d, value.to_bits(), n) };
    }
    launch(b, &format!("fill_{}", suffix(dt)), n, KernelArgs::new().push(d).push(value).push(n as u64))
}

pub(crate) fn add(b: &Stream, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
    let (n, dt, st) = (dst.len(), dst.dtype(), src.dtype());
    let s = ptr(b, "src", &src)?;
    let d = ptr_mut(b, "dst", dst)?;
    launch(b, &format!("add_{}_{}", suffix(dt), suffix(st)), n, KernelArgs::new().push(d).push(s).push(n as u64))
}

pub(crate) fn scale(b: &Stream, x: ViewMut<'_>, a: f32) -> Result<()> {
    let (n, dt) = (x.len(), x.dtype());
    let p = ptr_mut(b, "x", x)?;
    launch(b, &format!("scale_{}", suffix(dt)), n, KernelArgs::new().push(p).push(a).push(n as u64))
}

/// `Σ x²` over the views in `f64`: per view, a fixed grid of partials and their ordered sum on the device; the
/// views' sums are added in order on the host once the last one is downloaded.
pub(crate) fn sum_squares(b: &Stream, xs: &[View<'_>]) -> Result<f64> {
    let xs: Vec<&View<'_>> = xs.iter().filter(|x| !x.is_empty()).collect();
    if xs.is_empty() {
        return Ok(0.0);
    }
    let out = b.scratch(8 * xs.len())?;
    let mut partials = Vec::new();
    for (i, x) in xs.iter().enumerate() {
        let n = x.len() as u64;
        let cfg = grid(n);
        let blocks = cfg.grid[0];
        let part = b.scratch(8 * blocks as usize)?;
        let k = kernel(&SOURCE, &format!("sum_squares_{}", suffix(x.dtype())))?;
        let p = ptr(b, "xs", x)?;
        // SAFETY: `part` holds one f64 per block; `p` covers `n` elements of the view's type.
        unsafe { b.launch(&k, cfg, KernelArgs::new().push(part.ptr()).push(p).push(n))? };
        let k = kernel(&SOURCE, "sum_partials_f64")?;
        let at = out.ptr() + 8 * i as u64;
        // SAFETY: `at` is the i-th f64 of `out`; `part` holds `blocks` partials.
        unsafe { b.launch(&k, LaunchConfig::linear(1, 32), KernelArgs::new().push(at).push(part.ptr()).push(blocks))? };
        partials.push(part);
    }
    let mut sums = vec![0u8; 8 * xs.len()];
    b.download_bytes(&mut sums, out.ptr())?;
    drop(partials);
    Ok(sums.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).sum())
}

pub(crate) fn transpose12(b: &Stream, dst: ViewMut<'_>, src: View<'_>, dims: [usize; 4]) -> Result<()> {
    let (n, dt, st) = (dst.len(), dst.dtype(), src.dtype());
    let s = ptr(b, "src", &src)?;
    let d = ptr_mut(b, "dst", dst)?;
    let [a, bb, c, dd] = dims.map(|x| x as u64);
    let mut args = KernelArgs::new();
    args.push(d).push(s).push(a).push(bb).push(c).push(dd);
    launch(b, &format!("transpose12_{}_{}", suffix(dt), suffix(st)), n, &args)
}

pub(crate) fn swiglu_forward(b: &Stream, out: ViewMut<'_>, gate: View<'_>, up: View<'_>) -> Result<()> {
    let (n, t) = (out.len(), gate.dtype());
    let (g, u) = (ptr(b, "gate", &gate)?, ptr(b, "up", &up)?);
    let o = ptr_mut(b, "out", out)?;
    launch(b, &format!("swiglu_fwd_{}", suffix(t)), n, KernelArgs::new().push(o).push(g).push(u).push(n as u64))
}

pub(crate) fn swiglu_backward(
    b: &Stream,
    dgate: ViewMut<'_>,
    dup: ViewMut<'_>,
    dout: View<'_>,
    saved: SwigluSaved<'_>,
) -> Result<()> {
    let (n, t) = (dout.len(), dout.dtype());
    let (dy, g, u) = (ptr(b, "dout", &dout)?, ptr(b, "gate", &saved.gate)?, ptr(b, "up", &saved.up)?);
    let (dg, du) = (ptr_mut(b, "dgate", dgate)?, ptr_mut(b, "dup", dup)?);
    let mut args = KernelArgs::new();
    args.push(dg).push(du).push(dy).push(g).push(u).push(n as u64);
    launch(b, &format!("swiglu_bwd_{}", suffix(t)), n, &args)
}

pub(crate) fn squared_relu_forward(b: &Stream, out: ViewMut<'_>, x: View<'_>) -> Result<()> {
    let (n, t) = (out.len(), x.dtype());
    let xp = ptr(b, "x", &x)?;
    let o = ptr_mut(b, "out", out)?;
    launch(b, &format!("squared_relu_fwd_{}", suffix(t)), n, KernelArgs::new().push(o).push(xp).push(n as u64))
}

pub(crate) fn squared_relu_backward(
    b: &Stream,
    dx: ViewMut<'_>,
    dout: View<'_>,
    saved: SquaredReluSaved<'_>,
) -> Result<()> {
    let (n, t) = (dout.len(), dout.dtype());
    let (dy, x) = (ptr(b, "dout", &dout)?, ptr(b, "x", &saved.x)?);
    let d = ptr_mut(b, "dx", dx)?;
    let mut args = KernelArgs::new();
    args.push(d).push(dy).push(x).push(n as u64);
    launch(b, &format!("squared_relu_bwd_{}", suffix(t)), n, &args)
}

/// One AdamW step; the bias corrections `1 − βᵗ` in `f64` on the host, as the CPU computes them.
pub(crate) fn adamw(
    b: &Stream,
    master: ViewMut<'_>,
    copy_to: Option<ViewMut<'_>>,
    grads: View<'_>,
    state: AdamwState<'_>,
    hp: &AdamW,
    step: u64,
) -> Result<()> {
    let n = master.len();
    let t = step.min(i32::MAX as u64) as i32;
    let bc1 = (1.0 - (hp.beta1 as f64).powi(t)) as f32;
    let bc2 = (1.0 - (hp.beta2 as f64).powi(t)) as f32;
    let gt = grads.dtype();
    // Without a copy the kernel's `copy_to` is a null pointer of the f32 instance.
    let pt = copy_to.as_ref().map_or(DType::F32, |c| c.dtype());
    let g = ptr(b, "grads", &grads)?;
    let c = match copy_to {
        Some(c) => ptr_mut(b, "copy_to", c)?,
        None => 0,
    };
    let (m, v) = (ptr_mut(b, "m", state.m)?, ptr_mut(b, "v", state.v)?);
    let p = ptr_mut(b, "master", master)?;
    let mut args = KernelArgs::new();
    args.push(p).push(c).push(g).push(m).push(v);
    args.push(hp.lr).push(hp.beta1).push(hp.beta2).push(hp.eps).push(hp.weight_decay).push(bc1).push(bc2);
    args.push(n as u64);
    launch(b, &format!("adamw_{}_{}", suffix(gt), suffix(pt)), n, &args)
}

/// The number of partials a sum-of-squares launch over `n` elements writes (for tests of the split).
#[allow(dead_code)]
pub(crate) fn partial_count(n: u64) -> u64 {
    n.div_ceil(super::THREADS as u64).clamp(1, MAX_BLOCKS)
}
