//! The fused output projection and cross-entropy, chunked over tokens (`cross_entropy.cu` and cuBLASLt): per
//! chunk of `K` tokens, the logits `[K, V]` (f32) = `hidden · weightᵀ`, their loss and gradient in place, then
//! `dhidden` for those tokens and their share of `dweight`; memory is `K·V` floats whatever `T` is. The per-token
//! losses stay on the device until the end, then come to the host and are summed in token order in f64, as the
//! CPU sums them (so the call waits for its work).
//!
//! With `bf16` storage the gradient of the logits is rounded to `bf16` for the two backward products (cuBLASLt
//! multiplies matrices of one type), and a `bf16` `dweight` accumulates its chunks in an `f32` buffer of its
//! size, rounded once at the end, as the CPU does.

use super::linear::gemm;
use super::{bytes_of, kernel, ptr, ptr_mut, THREADS};
use crate::backend::{GradMode, ProjectionGrads};
use crate::checks::CrossEntropyDims;
use crate::cuda::device::{KernelArgs, KernelSource, LaunchConfig};
use crate::cuda::stream::Stream;
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::{CrossEntropyOptions, CrossEntropyOutput};
use crate::view::{DeviceSliceMut, View, ViewMut};

pub(crate) static SOURCE: KernelSource = KernelSource {
    file: "cross_entropy.cu",
    code: include_str!("../kernels/cross_entropy.cu"),
    kernels: &["softmax_xent_rows"],
    includes: &[],
};

#[allow(clippy::too_many_arguments)]
pub(crate) fn fused(
    b: &Stream,
    d: CrossEntropyDims,
    grads: ProjectionGrads<'_>,
    hidden: View<'_>,
    weight: View<'_>,
    targets: &[i64],
    opts: &CrossEntropyOptions,
    mode: GradMode,
) -> Result<CrossEntropyOutput> {
    let (t, c, v) = (d.t, d.c, d.v);
    let k = opts.chunk_tokens.min(t);
    let dt = hidden.dtype();
    let gt = grads.dweight.dtype();
    let scale = (1.0 / d.denom) as f32;
    let memory = b.on().memory;
    let (hp, wp) = (ptr(b, "hidden", &hidden)?, ptr(b, "weight", &weight)?);
    let dhp = ptr_mut(b, "dhidden", grads.dhidden)?;
    let dwp = ptr_mut(b, "dweight", grads.dweight)?;
    // A bf16 dweight accumulates in f32 (as the CPU does), then is rounded into place.
    let dw_f32 = if gt == DType::F32 { None } else { Some(b.scratch(4 * v * c)?) };
    let (acc_ptr, acc_type) = match &dw_f32 {
        Some(s) => (s.ptr(), DType::F32),
        None => (dwp, gt),
    };
    let accumulate = mode == GradMode::Accumulate;
    if let Some(s) = &dw_f32 {
        // SAFETY: `s` holds `V·C` floats, `dweight` `V·C` elements of `gt` (checked).
        let acc = unsafe { view(s.ptr(), v * c, DType::F32, memory) };
        if accumulate {
            super::elementwise::copy(b, acc, unsafe { view(dwp, v * c, gt, memory) }.into_view())?;
        } else {
            super::elementwise::fill(b, acc, 0.0)?;
        }
    } else if !accumulate {
        // SAFETY: as above.
        super::elementwise::fill(b, unsafe { view(dwp, v * c, gt, memory) }, 0.0)?;
    }
    let z = b.scratch(4 * k * v)?;
    let dz_t = if dt == DType::F32 { None } else { Some(b.scratch(dt.size() * k * v)?) };
    let losses = b.scratch(8 * t)?;
    let tg = b.upload_bytes(bytes_of(targets))?;
    let xent = kernel(&SOURCE, "softmax_xent_rows")?;
    let es = dt.size() as u64;
    for t0 in (0..t).step_by(k) {
        let rows = k.min(t - t0);
        let dh = dhp + (t0 * c) as u64 * es;
        if targets[t0..t0 + rows].iter().all(|&y| y == opts.ignore_index) {
            // SAFETY: rows `t0..t0 + rows` of `dhidden`; the chunk's losses are zero.
            super::elementwise::fill(b, unsafe { view(dh, rows * c, dt, memory) }, 0.0)?;
            // SAFETY: the chunk's `rows` f64 losses, set to +0.0 (all bits clear).
            unsafe { b.memset32(losses.ptr() + 8 * t0 as u64, 0, 2 * rows)? };
            continue;
        }
        let h = hp + (t0 * c) as u64 * es;
        // z[rows, V] = h · wᵀ (f32 out).
        let g = gemm((v, rows, c), (wp, c, true), (h, c, false), (z.ptr(), v), dt, DType::F32, 0.0);
        // SAFETY: `w` holds `V·C`, the chunk of `hidden` `rows·C`, `z` `K·V` floats.
        unsafe { b.gemm(&g)? };
        let mut args = KernelArgs::new();
        args.push(z.ptr()).push(losses.ptr() + 8 * t0 as u64).push(tg.ptr() + 8 * t0 as u64);
        args.push(rows as u32).push(v as u32).push(opts.ignore_index).push(scale);
        let blocks = (rows as u32).min(4096);
        // SAFETY: `z` holds `rows·V` floats, `losses` and the targets `rows` entries from `t0`; every target is in
        // range or ignored (checked).
        unsafe { b.launch(&xent, LaunchConfig::linear(blocks, THREADS), &args)? };
        let dz = match &dz_t {
            Some(s) => {
                // SAFETY: `s` holds `K·V` elements of `dt`, `z` `K·V` floats.
                let (dst, src) =
                    unsafe { (view(s.ptr(), rows * v, dt, memory), view(z.ptr(), rows * v, DType::F32, memory)) };
                super::elementwise::copy(b, dst, src.into_view())?;
                s.ptr()
            }
            None => z.ptr(),
        };
        // dh[rows, C] = dz[rows, V] · w[V, C].
        let g = gemm((c, rows, v), (wp, c, false), (dz, v, false), (dh, c), dt, dt, 0.0);
        // SAFETY: `dz` holds `rows·V`, `w` `V·C`, the chunk of `dhidden` `rows·C` elements.
        unsafe { b.gemm(&g)? };
        // dw[V, C] += dzᵀ · h.
        let g = gemm((c, v, rows), (h, c, false), (dz, v, true), (acc_ptr, c), dt, acc_type, 1.0);
        // SAFETY: the accumulator holds `V·C` elements of its type.
        unsafe { b.gemm(&g)? };
    }
    if let Some(s) = &dw_f32 {
        // SAFETY: as above.
        let (dst, src) = unsafe { (view(dwp, v * c, gt, memory), view(s.ptr(), v * c, DType::F32, memory)) };
        super::elementwise::copy(b, dst, src.into_view())?;
    }
    let mut l = vec![0f64; t];
    b.download_bytes(bytemuck::cast_slice_mut(&mut l), losses.ptr())?;
    let loss_sum: f64 = l.iter().sum();
    Ok(CrossEntropyOutput { loss: (loss_sum / d.denom) as f32, loss_sum, n_valid: d.n_valid })
}

/// `len` elements of `dtype` at `ptr` as a writable view.
///
/// # Safety
/// The range is device memory of `memory`, alive and used by nothing else while the view lives.
unsafe fn view<'a>(ptr: u64, len: usize, dtype: DType, memory: crate::view::Memory) -> ViewMut<'a> {
    // SAFETY: the caller's contract.
    let d = unsafe { DeviceSliceMut::new(ptr, len, dtype, memory) };
    ViewMut::device(d, [len]).expect("one dim of the slice's length")
}
