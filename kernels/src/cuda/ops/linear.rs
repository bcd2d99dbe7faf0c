//! Linear layers on cuBLASLt (`y = x·wᵀ + b` and its backward), with the bias gradient in `linear.cu`.
//!
//! The row-major products in cuBLAS's column-major terms (a row-major `[R, C]` is a column-major `[C, R]`):
//! - forward `y[T,OUT] = x[T,IN]·w[OUT,IN]ᵀ`: `yᵀ[OUT,T] = w·xᵀ`, i.e. `m = OUT, n = T, k = IN`, `A = w` transposed
//!   (stored `[IN, OUT]` column-major, `lda = IN`), `B = x` (`ldb = IN`), the bias as cuBLASLt's epilogue;
//! - `dx[T,IN] = dy[T,OUT]·w[OUT,IN]`: `dxᵀ[IN,T] = wᵀ·dyᵀ`, `m = IN, n = T, k = OUT`, `A = w` (`lda = IN`), `B = dy`
//!   (`ldb = OUT`);
//! - `dw[OUT,IN] (+)= dy[T,OUT]ᵀ·x[T,IN]`: `dwᵀ[IN,OUT] = xᵀ·dy`, `m = IN, n = OUT, k = T`, `A = x` (`lda = IN`),
//!   `B = dy` transposed (`ldb = OUT`), `beta = 1` to accumulate.

use super::{kernel, ptr, ptr_mut, suffix, THREADS};
use crate::backend::{GradMode, LinearGrads};
use crate::checks::LinearDims;
use crate::cuda::device::{Gemm, KernelArgs, KernelSource, LaunchConfig};
use crate::cuda::stream::Stream;
use crate::dtype::DType;
use crate::error::Result;
use crate::saved::LinearSaved;
use crate::view::{View, ViewMut};

pub(crate) static SOURCE: KernelSource = KernelSource {
    file: "linear.cu",
    code: include_str!("../kernels/linear.cu"),
    kernels: &[
        "bias_grad_f32_f32",
        "bias_grad_bf16_f32",
        "bias_grad_f16_f32",
        "bias_grad_f32_bf16",
        "bias_grad_bf16_bf16",
        "bias_grad_f16_bf16",
        "bias_grad_f32_f16",
        "bias_grad_bf16_f16",
        "bias_grad_f16_f16",
    ],
    includes: &[],
};

/// A plain product (no batch, no bias, no TF32): `D = alpha·op(A)·op(B) + beta·C`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    (m, n, k): (usize, usize, usize),
    (a, lda, trans_a): (u64, usize, bool),
    (b, ldb, trans_b): (u64, usize, bool),
    (c, ldc): (u64, usize),
    ab_type: DType,
    c_type: DType,
    beta: f32,
) -> Gemm {
    Gemm {
        m,
        n,
        k,
        a,
        lda,
        trans_a,
        stride_a: 0,
        b,
        ldb,
        trans_b,
        stride_b: 0,
        c,
        ldc,
        stride_c: 0,
        ab_type,
        c_type,
        batch: 1,
        alpha: 1.0,
        beta,
        bias: None,
        tf32: false,
    }
}

pub(crate) fn forward(
    b: &Stream,
    l: LinearDims,
    y: ViewMut<'_>,
    x: View<'_>,
    w: View<'_>,
    bias: Option<View<'_>>,
) -> Result<()> {
    let t = x.dtype();
    let (xp, wp) = (ptr(b, "x", &x)?, ptr(b, "w", &w)?);
    let bp = bias.as_ref().map(|v| ptr(b, "bias", v)).transpose()?;
    let yp = ptr_mut(b, "y", y)?;
    let mut g = gemm((l.d_out, l.t, l.d_in), (wp, l.d_in, true), (xp, l.d_in, false), (yp, l.d_out), t, t, 0.0);
    g.bias = bp;
    // SAFETY: `w` holds `OUT·IN`, `x` `T·IN`, `y` `T·OUT` elements of `t`, `bias` `OUT` (checked).
    unsafe { b.gemm(&g) }
}

pub(crate) fn backward(
    b: &Stream,
    l: LinearDims,
    grads: LinearGrads<'_>,
    dy: View<'_>,
    saved: LinearSaved<'_>,
    w: View<'_>,
    mode: GradMode,
) -> Result<()> {
    let t = saved.x.dtype();
    let gt = grads.dw.dtype();
    let (dyp, xp, wp) = (ptr(b, "dy", &dy)?, ptr(b, "x", &saved.x)?, ptr(b, "w", &w)?);
    let beta = if mode == GradMode::Accumulate { 1.0 } else { 0.0 };
    if let Some(dx) = grads.dx {
        let dxp = ptr_mut(b, "dx", dx)?;
        let g = gemm((l.d_in, l.t, l.d_out), (wp, l.d_in, false), (dyp, l.d_out, false), (dxp, l.d_in), t, t, 0.0);
        // SAFETY: `dx` holds `T·IN` elements, `w` `OUT·IN`, `dy` `T·OUT` (checked).
        unsafe { b.gemm(&g)? };
    }
    let dwp = ptr_mut(b, "dw", grads.dw)?;
    let g = gemm((l.d_in, l.d_out, l.t), (xp, l.d_in, false), (dyp, l.d_out, true), (dwp, l.d_in), t, gt, beta);
    // SAFETY: `dw` holds `OUT·IN` elements of its type, `x` `T·IN`, `dy` `T·OUT`.
    unsafe { b.gemm(&g)? };
    if let Some(db) = grads.dbias {
        let dbp = ptr_mut(b, "dbias", db)?;
        let k = kernel(&SOURCE, &format!("bias_grad_{}_{}", suffix(t), suffix(gt)))?;
        let mut args = KernelArgs::new();
        args.push(dbp).push(dyp).push(l.t as u64).push(l.d_out as u32).push(i32::from(beta == 1.0));
        let cfg = LaunchConfig::linear((l.d_out as u32).div_ceil(THREADS).max(1), THREADS);
        // SAFETY: `dbias` holds `OUT` elements of `dw`'s type, `dy` `T·OUT`.
        unsafe { b.launch(&k, cfg, &args)? };
    }
    Ok(())
}
