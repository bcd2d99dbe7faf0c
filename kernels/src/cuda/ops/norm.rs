//! RMSNorm and LayerNorm (`norm.cu`).

use super::{kernel, ptr, ptr_mut, suffix, MAX_BLOCKS, THREADS};
use crate::backend::{GradMode, NormGrads, NormParams};
use crate::checks::Rows;
use crate::cuda::device::{KernelArgs, KernelSource, LaunchConfig};
use crate::cuda::stream::Stream;
use crate::error::Result;
use crate::view::{View, ViewMut};

pub(crate) static SOURCE: KernelSource = KernelSource {
    file: "norm.cu",
    code: include_str!("../kernels/norm.cu"),
    kernels: &[
        "rmsnorm_fwd_f32",
        "layernorm_fwd_f32",
        "rmsnorm_bwd_f32",
        "layernorm_bwd_f32",
        "norm_reduce_f32",
        "rmsnorm_fwd_bf16",
        "layernorm_fwd_bf16",
        "rmsnorm_bwd_bf16",
        "layernorm_bwd_bf16",
        "norm_reduce_bf16",
        "rmsnorm_fwd_f16",
        "layernorm_fwd_f16",
        "rmsnorm_bwd_f16",
        "layernorm_bwd_f16",
        "norm_reduce_f16",
    ],
    includes: &[],
};

/// Rows each backward block owns: enough blocks to fill a large GPU when there are many rows, few enough that
/// the partial rows (`blocks × C` floats) stay small. A function of the row count alone.
fn rows_per_block(n: usize) -> usize {
    n.div_ceil(1024).max(8)
}

/// Forward: LayerNorm when `mean` is given, RMSNorm otherwise.
pub(crate) fn forward(
    b: &Stream,
    r: Rows,
    y: ViewMut<'_>,
    mean: Option<ViewMut<'_>>,
    rstd: ViewMut<'_>,
    x: View<'_>,
    p: &NormParams<'_>,
) -> Result<()> {
    let t = x.dtype();
    let (xp, wp) = (ptr(b, "x", &x)?, ptr(b, "weight", &p.weight)?);
    let yp = ptr_mut(b, "y", y)?;
    let rp = ptr_mut(b, "rstd", rstd)?;
    let cfg = LaunchConfig::linear((r.n as u64).min(MAX_BLOCKS * 4) as u32, THREADS);
    let mut args = KernelArgs::new();
    let name = match (mean, &p.bias) {
        (Some(mean), Some(bias)) => {
            let (mp, bp) = (ptr_mut(b, "mean", mean)?, ptr(b, "bias", bias)?);
            args.push(yp).push(mp).push(rp).push(xp).push(wp).push(bp);
            format!("layernorm_fwd_{}", suffix(t))
        }
        _ => {
            args.push(yp).push(rp).push(xp).push(wp);
            format!("rmsnorm_fwd_{}", suffix(t))
        }
    };
    args.push(r.n as u64).push(r.c as u32).push(p.eps);
    let k = kernel(&SOURCE, &name)?;
    // SAFETY: the views were checked to be `[N, C]` (`y`, `x`), `[C]` (`weight`, `bias`) and `[N]` f32 (`mean`,
    // `rstd`) on this device, as the kernel reads and writes them.
    unsafe { b.launch(&k, cfg, &args) }
}

/// Backward: LayerNorm when `mean` is given, RMSNorm otherwise.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    b: &Stream,
    r: Rows,
    grads: NormGrads<'_>,
    dy: View<'_>,
    x: View<'_>,
    mean: Option<View<'_>>,
    rstd: View<'_>,
    weight: View<'_>,
    mode: GradMode,
) -> Result<()> {
    let (t, g) = (x.dtype(), grads.dweight.dtype());
    let rpb = rows_per_block(r.n);
    let blocks = r.n.div_ceil(rpb);
    let layernorm = mean.is_some();
    let part_w = b.scratch(blocks * r.c * 4)?;
    let part_b = if layernorm { Some(b.scratch(blocks * r.c * 4)?) } else { None };
    let (dyp, xp, wp, rp) = (ptr(b, "dy", &dy)?, ptr(b, "x", &x)?, ptr(b, "weight", &weight)?, ptr(b, "rstd", &rstd)?);
    let dxp = ptr_mut(b, "dx", grads.dx)?;
    let mut args = KernelArgs::new();
    let name = match (&mean, &part_b) {
        (Some(mean), Some(pb)) => {
            args.push(dxp).push(part_w.ptr()).push(pb.ptr()).push(dyp).push(xp).push(wp);
            args.push(ptr(b, "mean", mean)?).push(rp);
            format!("layernorm_bwd_{}", suffix(t))
        }
        _ => {
            args.push(dxp).push(part_w.ptr()).push(dyp).push(xp).push(wp).push(rp);
            format!("rmsnorm_bwd_{}", suffix(t))
        }
    };
    args.push(r.n as u64).push(r.c as u32).push(rpb as u32);
    let k = kernel(&SOURCE, &name)?;
    // SAFETY: as the forward, and each partial buffer holds `blocks × C` floats, one row per block.
    unsafe { b.launch(&k, LaunchConfig::linear(blocks as u32, THREADS), &args)? };
    let reduce = kernel(&SOURCE, &format!("norm_reduce_{}", suffix(g)))?;
    let acc = i32::from(mode == GradMode::Accumulate);
    let cfg = LaunchConfig::linear((r.c as u32).div_ceil(THREADS), THREADS);
    let dw = ptr_mut(b, "dweight", grads.dweight)?;
    let mut args = KernelArgs::new();
    args.push(dw).push(part_w.ptr()).push(blocks as u32).push(r.c as u32).push(acc);
    // SAFETY: `dweight` holds `C` elements of its type; the partials `blocks × C` floats.
    unsafe { b.launch(&reduce, cfg, &args)? };
    if let (Some(db), Some(pb)) = (grads.dbias, &part_b) {
        let dbp = ptr_mut(b, "dbias", db)?;
        let mut args = KernelArgs::new();
        args.push(dbp).push(pb.ptr()).push(blocks as u32).push(r.c as u32).push(acc);
        // SAFETY: as for `dweight`.
        unsafe { b.launch(&reduce, cfg, &args)? };
    }
    Ok(())
}
