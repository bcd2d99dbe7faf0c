//! Mixture-of-experts routing, dispatch and combine (`moe.cu`). The routing is host metadata: the router's
//! forward brings each token's choices to the host (one synchronisation per MoE layer) to build it, and every
//! dispatch op uploads the index arrays it needs per call.

use super::{bytes_of, grid, kernel, ptr, ptr_mut, suffix, THREADS};
use crate::cuda::device::{KernelArgs, KernelSource, LaunchConfig};
use crate::cuda::stream::Stream;
use crate::error::Result;
use crate::ops::{RouterOutput, Routing};
use crate::saved::{MoeCombineSaved, MoeRouterSaved};
use crate::view::{View, ViewMut};

pub(crate) static SOURCE: KernelSource = KernelSource {
    file: "moe.cu",
    code: include_str!("../kernels/moe.cu"),
    kernels: &[
        "router_prob_sum",
        "router_fwd_f32",
        "router_bwd_f32",
        "moe_gather_f32",
        "moe_sum_rows_f32",
        "moe_combine_bwd_f32",
        "router_fwd_bf16",
        "router_bwd_bf16",
        "moe_gather_bf16",
        "moe_sum_rows_bf16",
        "moe_combine_bwd_bf16",
        "router_fwd_f16",
        "router_bwd_f16",
        "moe_gather_f16",
        "moe_sum_rows_f16",
        "moe_combine_bwd_f16",
    ],
    includes: &[],
};

fn threads_for(n: u64) -> LaunchConfig {
    LaunchConfig::linear(n.div_ceil(THREADS as u64).max(1) as u32, THREADS)
}

pub(crate) fn router_forward(
    b: &Stream,
    probs: ViewMut<'_>,
    weights: ViewMut<'_>,
    logits: View<'_>,
    l: usize,
    e: usize,
    k: usize,
) -> Result<RouterOutput> {
    let t = logits.dtype();
    let choice = b.scratch(4 * l * k)?;
    let sums = b.scratch(8 * e)?;
    let xp = ptr(b, "logits", &logits)?;
    let pp = ptr_mut(b, "probs", probs)?;
    let wp = ptr_mut(b, "weights", weights)?;
    let kf = kernel(&SOURCE, &format!("router_fwd_{}", suffix(t)))?;
    let mut args = KernelArgs::new();
    args.push(pp).push(wp).push(choice.ptr()).push(xp).push(l as u32).push(e as u32).push(k as u32);
    // SAFETY: `probs` `[L,E]` f32, `weights` `[L,K]` f32, `logits` `[L,E]` (checked); `choice` holds `L·K` u32.
    unsafe { b.launch(&kf, threads_for(l as u64), &args)? };
    let ks = kernel(&SOURCE, "router_prob_sum")?;
    let mut args = KernelArgs::new();
    args.push(sums.ptr()).push(pp).push(l as u32).push(e as u32);
    // SAFETY: `sums` holds `E` f64, `probs` `L·E` floats.
    unsafe { b.launch(&ks, threads_for(e as u64), &args)? };
    let mut c = vec![0u32; l * k];
    b.download_bytes(bytemuck::cast_slice_mut(&mut c), choice.ptr())?;
    let mut s = vec![0f64; e];
    b.download_bytes(bytemuck::cast_slice_mut(&mut s), sums.ptr())?;
    Ok(RouterOutput { routing: Routing::new(c, l, e, k)?, prob_sum: s })
}

pub(crate) fn router_backward(
    b: &Stream,
    dlogits: ViewMut<'_>,
    dweights: View<'_>,
    aux: Option<View<'_>>,
    saved: MoeRouterSaved<'_>,
) -> Result<()> {
    let r = saved.routing;
    let (l, e, k) = (r.tokens(), r.experts(), r.top_k());
    let t = dlogits.dtype();
    let choice = b.upload_bytes(bytes_of(r.choice()))?;
    let dp = b.scratch(4 * l * e)?;
    let ap = match &aux {
        Some(a) => ptr(b, "aux", a)?,
        None => 0,
    };
    let (dwp, pp, wp) =
        (ptr(b, "dweights", &dweights)?, ptr(b, "probs", &saved.probs)?, ptr(b, "weights", &saved.weights)?);
    let dl = ptr_mut(b, "dlogits", dlogits)?;
    let kf = kernel(&SOURCE, &format!("router_bwd_{}", suffix(t)))?;
    let mut args = KernelArgs::new();
    args.push(dl).push(dwp).push(ap).push(pp).push(wp).push(choice.ptr()).push(dp.ptr());
    args.push(l as u32).push(e as u32).push(k as u32);
    // SAFETY: the views have the routing's dims (checked); `dp` holds `L·E` floats of scratch.
    unsafe { b.launch(&kf, threads_for(l as u64), &args) }
}

pub(crate) fn gather_forward(b: &Stream, xe: ViewMut<'_>, x: View<'_>, routing: &Routing, c: usize) -> Result<()> {
    let n = routing.rows();
    let rows = b.upload_bytes(bytes_of(routing.row_tokens()))?;
    let xp = ptr(b, "x", &x)?;
    let t = x.dtype();
    let op = ptr_mut(b, "xe", xe)?;
    let kf = kernel(&SOURCE, &format!("moe_gather_{}", suffix(t)))?;
    let mut args = KernelArgs::new();
    args.push(op).push(xp).push(rows.ptr()).push(n as u64).push(c as u32);
    // SAFETY: `xe` `[N,C]`, `x` `[L,C]`, every row's token below `L` (the routing's invariant).
    unsafe { b.launch(&kf, grid((n * c) as u64), &args) }
}

/// `out[t, :] = Σ w·ye[n, :]` over token `t`'s dispatched rows: the combine (with `weights`) and the gather's
/// backward (without).
pub(crate) fn sum_rows(
    b: &Stream,
    out: ViewMut<'_>,
    ye: View<'_>,
    weights: Option<View<'_>>,
    routing: &Routing,
    c: usize,
) -> Result<()> {
    let (l, k) = (routing.tokens(), routing.top_k());
    let inv = b.upload_bytes(bytes_of(&routing.inv))?;
    let slots = b.upload_bytes(bytes_of(&routing.slots))?;
    let wp = match &weights {
        Some(w) => ptr(b, "weights", w)?,
        None => 0,
    };
    let t = ye.dtype();
    let yp = ptr(b, "ye", &ye)?;
    let op = ptr_mut(b, "out", out)?;
    let kf = kernel(&SOURCE, &format!("moe_sum_rows_{}", suffix(t)))?;
    let mut args = KernelArgs::new();
    args.push(op).push(yp).push(wp).push(inv.ptr()).push(slots.ptr()).push(l as u32).push(k as u32).push(c as u32);
    // SAFETY: `out` `[L,C]`, `ye` `[N,C]`, `weights` `[L,K]` f32; the routing's indices are in range.
    unsafe { b.launch(&kf, grid((l * c) as u64), &args) }
}

pub(crate) fn combine_backward(
    b: &Stream,
    dye: ViewMut<'_>,
    dweights: ViewMut<'_>,
    dout: View<'_>,
    saved: MoeCombineSaved<'_>,
    c: usize,
) -> Result<()> {
    let r = saved.routing;
    let n = r.rows();
    let rows = b.upload_bytes(bytes_of(r.row_tokens()))?;
    let slots = b.upload_bytes(bytes_of(&r.slots))?;
    let t = saved.ye.dtype();
    let (gp, yp, wp) = (ptr(b, "dout", &dout)?, ptr(b, "ye", &saved.ye)?, ptr(b, "weights", &saved.weights)?);
    let dyp = ptr_mut(b, "dye", dye)?;
    let dwp = ptr_mut(b, "dweights", dweights)?;
    let kf = kernel(&SOURCE, &format!("moe_combine_bwd_{}", suffix(t)))?;
    let mut args = KernelArgs::new();
    args.push(dyp).push(dwp).push(gp).push(yp).push(wp).push(rows.ptr()).push(slots.ptr());
    args.push(n as u64).push(c as u32);
    // One warp per dispatched row.
    let warps_per_block = (THREADS / 32) as u64;
    let blocks = (n as u64).div_ceil(warps_per_block).clamp(1, super::MAX_BLOCKS) as u32;
    // SAFETY: `dye`/`ye` `[N,C]`, `dout` `[L,C]`, `weights`/`dweights` `[L,K]` f32; indices in range.
    unsafe { b.launch(&kf, LaunchConfig::linear(blocks, THREADS), &args) }
}
