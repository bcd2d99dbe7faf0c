//! Token embedding (`embedding.cu`): the ids are uploaded per call; the backward's grouping of tokens by id is
//! computed on the host (it is what makes the sums deterministic) and uploaded.

use super::{bytes_of, grid, kernel, ptr, ptr_mut, suffix, MAX_BLOCKS, THREADS};
use crate::backend::GradMode;
use crate::cuda::device::{KernelArgs, KernelSource, LaunchConfig};
use crate::cuda::stream::Stream;
use crate::error::Result;
use crate::view::{View, ViewMut};

pub(crate) static SOURCE: KernelSource = KernelSource {
    file: "embedding.cu",
    code: include_str!("../kernels/embedding.cu"),
    kernels: &[
        "embedding_fwd_f32",
        "embedding_fwd_bf16",
        "embedding_fwd_f16",
        "embedding_bwd_f32_f32",
        "embedding_bwd_bf16_f32",
        "embedding_bwd_f16_f32",
        "embedding_bwd_f32_bf16",
        "embedding_bwd_bf16_bf16",
        "embedding_bwd_f16_bf16",
        "embedding_bwd_f32_f16",
        "embedding_bwd_bf16_f16",
        "embedding_bwd_f16_f16",
    ],
    includes: &[],
};

pub(crate) fn forward(b: &Stream, out: ViewMut<'_>, ids: &[u32], table: View<'_>, c: usize) -> Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    let t = table.dtype();
    let idp = b.upload_bytes(bytes_of(ids))?;
    let tp = ptr(b, "table", &table)?;
    let op = ptr_mut(b, "out", out)?;
    let k = kernel(&SOURCE, &format!("embedding_fwd_{}", suffix(t)))?;
    let mut args = KernelArgs::new();
    args.push(op).push(idp.ptr()).push(tp).push(ids.len() as u64).push(c as u32);
    // SAFETY: `out` holds `ids.len()·C` elements, `table` `V·C`, every id below `V` (checked).
    unsafe { b.launch(&k, grid((ids.len() * c) as u64), &args) }
}

pub(crate) fn backward(
    b: &Stream,
    mut dtable: ViewMut<'_>,
    dout: View<'_>,
    ids: &[u32],
    v: usize,
    c: usize,
    mode: GradMode,
) -> Result<()> {
    let (t, g) = (dout.dtype(), dtable.dtype());
    if mode == GradMode::Overwrite {
        super::elementwise::fill(b, dtable.reborrow(), 0.0)?;
    }
    if ids.is_empty() {
        return Ok(());
    }
    // Counting sort of the tokens by id, stable in token order: id `uniq[u]`'s tokens are
    // `order[starts[u]..starts[u+1]]`.
    let mut count = vec![0u32; v];
    for &id in ids {
        count[id as usize] += 1;
    }
    let uniq: Vec<u32> = (0..v as u32).filter(|&i| count[i as usize] > 0).collect();
    let mut first = vec![0u32; v];
    let mut starts = Vec::with_capacity(uniq.len() + 1);
    let mut at = 0u32;
    for &u in &uniq {
        starts.push(at);
        first[u as usize] = at;
        at += count[u as usize];
    }
    starts.push(at);
    let mut order = vec![0u32; ids.len()];
    for (tok, &id) in ids.iter().enumerate() {
        order[first[id as usize] as usize] = tok as u32;
        first[id as usize] += 1;
    }
    let (op, sp, up) =
        (b.upload_bytes(bytes_of(&order))?, b.upload_bytes(bytes_of(&starts))?, b.upload_bytes(bytes_of(&uniq))?);
    let dp = ptr(b, "dout", &dout)?;
    let tp = ptr_mut(b, "dtable", dtable)?;
    let k = kernel(&SOURCE, &format!("embedding_bwd_{}_{}", suffix(t), suffix(g)))?;
    let mut args = KernelArgs::new();
    args.push(tp).push(dp).push(op.ptr()).push(sp.ptr()).push(up.ptr());
    args.push(uniq.len() as u32).push(c as u32).push(1i32);
    let blocks = (uniq.len() as u64).min(MAX_BLOCKS) as u32;
    // SAFETY: `dtable` holds `V·C` elements and every uploaded id is below `V`; `dout` `ids.len()·C`.
    unsafe { b.launch(&k, LaunchConfig::linear(blocks, THREADS), &args) }
}
