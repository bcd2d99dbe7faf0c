//! Attention forward, backward and merge (`attention_forward.cu`, `attention_backward.cu`, `attention_merge.cu`,
//! their tensor-core versions `attention_forward_tc.cu` and `attention_backward_tc.cu` (mma.sync), and Hopper's
//! `attention_forward_wgmma.cu` and `attention_backward_wgmma.cu` (wgmma, sm_90a, sharing `attention_wgmma.cuh`),
//! all sharing `attention.cuh`; which ones run: [`AttentionPath`]). Per call the host uploads what the mask needs
//! of host memory: explicit positions, document ids, and the position and document range of every tile of rows
//! (`O(Sq + Sk)`), from which the kernels classify each (query tile, key tile) pair.

use super::{kernel, ptr, ptr_mut, THREADS};
use crate::attention::mask::{tile_summaries, RangeSummary};
use crate::attention::{AttnGrads, AttnOut, AttnParams, AttnPartial, AttnSaved, AttnShape, Positions, Qkv};
use crate::backend::GradMode;
use crate::cuda::alloc::CudaAllocation;
use crate::cuda::device::{KernelArgs, KernelSource, LaunchConfig};
use crate::cuda::includes::{PTX_HOPPER, PTX_TMA};
use crate::cuda::path::AttentionPath;
use crate::cuda::stream::Stream;
use crate::cuda::tensor_map::{TensorMap, TensorMapDesc, TmaElem, TmaSwizzle};
use crate::cuda::WgmmaBackward;
use crate::dtype::DType;
use crate::error::Result;
use crate::view::View;

const HEADER: (&str, &str) = ("attention.cuh", include_str!("../kernels/attention.cuh"));
/// The wgmma kernels' tiles and products (after `attention.cuh` and `ptx_hopper.cuh`).
const WGMMA_HEADER: (&str, &str) = ("attention_wgmma.cuh", include_str!("../kernels/attention_wgmma.cuh"));

pub(crate) static FORWARD: KernelSource = KernelSource {
    file: "attention_forward.cu",
    code: include_str!("../kernels/attention_forward.cu"),
    kernels: &["attn_fwd_general"],
    includes: &[HEADER],
};

pub(crate) static FORWARD_TC: KernelSource = KernelSource {
    file: "attention_forward_tc.cu",
    code: include_str!("../kernels/attention_forward_tc.cu"),
    kernels: &[
        "attn_fwd_tc_bf16_d64_m1_bf16",
        "attn_fwd_tc_bf16_d64_m1_f32",
        "attn_fwd_tc_bf16_d128_m1_bf16",
        "attn_fwd_tc_bf16_d128_m1_f32",
        "attn_fwd_tc_bf16_d64_m2_bf16",
        "attn_fwd_tc_bf16_d64_m2_f32",
        "attn_fwd_tc_f16_d64_m1_f16",
        "attn_fwd_tc_f16_d64_m1_f32",
        "attn_fwd_tc_f16_d128_m1_f16",
        "attn_fwd_tc_f16_d128_m1_f32",
        "attn_fwd_tc_f16_d64_m2_f16",
        "attn_fwd_tc_f16_d64_m2_f32",
    ],
    includes: &[HEADER],
};

const FORWARD_WGMMA_CODE: &str = include_str!("../kernels/attention_forward_wgmma.cu");

/// The wgmma forward (sm_90a only: [`crate::cuda::sources::SM90A_SOURCES`]), taken on sm_90 ([`path`]).
pub(crate) static FORWARD_WGMMA: KernelSource = KernelSource {
    file: "attention_forward_wgmma.cu",
    code: FORWARD_WGMMA_CODE,
    kernels: &[
        "attn_fwd_wgmma_bf16_d64_w1_bf16",
        "attn_fwd_wgmma_bf16_d64_w1_f32",
        "attn_fwd_wgmma_bf16_d64_w2_bf16",
        "attn_fwd_wgmma_bf16_d64_w2_f32",
        "attn_fwd_wgmma_bf16_d128_w1_bf16",
        "attn_fwd_wgmma_bf16_d128_w1_f32",
        "attn_fwd_wgmma_bf16_d128_w2_bf16",
        "attn_fwd_wgmma_bf16_d128_w2_f32",
        "attn_fwd_wgmma_f16_d64_w1_f16",
        "attn_fwd_wgmma_f16_d64_w1_f32",
        "attn_fwd_wgmma_f16_d64_w2_f16",
        "attn_fwd_wgmma_f16_d64_w2_f32",
        "attn_fwd_wgmma_f16_d128_w1_f16",
        "attn_fwd_wgmma_f16_d128_w1_f32",
        "attn_fwd_wgmma_f16_d128_w2_f16",
        "attn_fwd_wgmma_f16_d128_w2_f32",
    ],
    includes: &[HEADER, PTX_TMA, PTX_HOPPER, WGMMA_HEADER],
};

const BACKWARD_WGMMA_CODE: &str = include_str!("../kernels/attention_backward_wgmma.cu");

/// The wgmma backward (sm_90a only, as [`FORWARD_WGMMA`]): `BACKWARD_TC`'s two kernels and arguments, the one-kernel
/// variants (`fused`, and `ordered` with its turns' set-up `attn_bwd_dq_turns_w<NWG>`), each of them fed by the TMA
/// (`_tma_`, [`bwd_tma_maps`]) or not.
pub(crate) static BACKWARD_WGMMA: KernelSource = KernelSource {
    file: "attention_backward_wgmma.cu",
    code: BACKWARD_WGMMA_CODE,
    kernels: &[
        "attn_bwd_wgmma_dkdv_bf16_d64_bf16",
        "attn_bwd_wgmma_dq_bf16_d64_bf16",
        "attn_bwd_wgmma_dkdv_bf16_d64_f32",
        "attn_bwd_wgmma_dq_bf16_d64_f32",
        "attn_bwd_wgmma_dkdv_bf16_d128_bf16",
        "attn_bwd_wgmma_dq_bf16_d128_bf16",
        "attn_bwd_wgmma_dkdv_bf16_d128_f32",
        "attn_bwd_wgmma_dq_bf16_d128_f32",
        "attn_bwd_wgmma_dkdv_f16_d64_f16",
        "attn_bwd_wgmma_dq_f16_d64_f16",
        "attn_bwd_wgmma_dkdv_f16_d64_f32",
        "attn_bwd_wgmma_dq_f16_d64_f32",
        "attn_bwd_wgmma_dkdv_f16_d128_f16",
        "attn_bwd_wgmma_dq_f16_d128_f16",
        "attn_bwd_wgmma_dkdv_f16_d128_f32",
        "attn_bwd_wgmma_dq_f16_d128_f32",
        "attn_bwd_wgmma_fused_bf16_d64_bf16",
        "attn_bwd_wgmma_fused_bf16_d64_f32",
        "attn_bwd_wgmma_fused_bf16_d128_bf16",
        "attn_bwd_wgmma_fused_bf16_d128_f32",
        "attn_bwd_wgmma_fused_f16_d64_f16",
        "attn_bwd_wgmma_fused_f16_d64_f32",
        "attn_bwd_wgmma_fused_f16_d128_f16",
        "attn_bwd_wgmma_fused_f16_d128_f32",
        "attn_bwd_wgmma_dkdv_tma_bf16_d64_bf16",
        "attn_bwd_wgmma_dq_tma_bf16_d64_bf16",
        "attn_bwd_wgmma_fused_tma_bf16_d64_bf16",
        "attn_bwd_wgmma_dkdv_tma_bf16_d64_f32",
        "attn_bwd_wgmma_dq_tma_bf16_d64_f32",
        "attn_bwd_wgmma_fused_tma_bf16_d64_f32",
        "attn_bwd_wgmma_dkdv_tma_bf16_d128_bf16",
        "attn_bwd_wgmma_dq_tma_bf16_d128_bf16",
        "attn_bwd_wgmma_fused_tma_bf16_d128_bf16",
        "attn_bwd_wgmma_dkdv_tma_bf16_d128_f32",
        "attn_bwd_wgmma_dq_tma_bf16_d128_f32",
        "attn_bwd_wgmma_fused_tma_bf16_d128_f32",
        "attn_bwd_wgmma_dkdv_tma_f16_d64_f16",
        "attn_bwd_wgmma_dq_tma_f16_d64_f16",
        "attn_bwd_wgmma_fused_tma_f16_d64_f16",
        "attn_bwd_wgmma_dkdv_tma_f16_d64_f32",
        "attn_bwd_wgmma_dq_tma_f16_d64_f32",
        "attn_bwd_wgmma_fused_tma_f16_d64_f32",
        "attn_bwd_wgmma_dkdv_tma_f16_d128_f16",
        "attn_bwd_wgmma_dq_tma_f16_d128_f16",
        "attn_bwd_wgmma_fused_tma_f16_d128_f16",
        "attn_bwd_wgmma_dkdv_tma_f16_d128_f32",
        "attn_bwd_wgmma_dq_tma_f16_d128_f32",
        "attn_bwd_wgmma_fused_tma_f16_d128_f32",
        "attn_bwd_dq_convert_d64_bf16",
        "attn_bwd_dq_convert_d64_f16",
        "attn_bwd_dq_convert_d64_f32",
        "attn_bwd_dq_convert_d128_bf16",
        "attn_bwd_dq_convert_d128_f16",
        "attn_bwd_dq_convert_d128_f32",
        "attn_bwd_wgmma_ordered_bf16_d64_bf16",
        "attn_bwd_wgmma_ordered_bf16_d64_f32",
        "attn_bwd_wgmma_ordered_bf16_d128_bf16",
        "attn_bwd_wgmma_ordered_bf16_d128_f32",
        "attn_bwd_wgmma_ordered_f16_d64_f16",
        "attn_bwd_wgmma_ordered_f16_d64_f32",
        "attn_bwd_wgmma_ordered_f16_d128_f16",
        "attn_bwd_wgmma_ordered_f16_d128_f32",
        "attn_bwd_wgmma_ordered_tma_bf16_d64_bf16",
        "attn_bwd_wgmma_ordered_tma_bf16_d64_f32",
        "attn_bwd_wgmma_ordered_tma_bf16_d128_bf16",
        "attn_bwd_wgmma_ordered_tma_bf16_d128_f32",
        "attn_bwd_wgmma_ordered_tma_f16_d64_f16",
        "attn_bwd_wgmma_ordered_tma_f16_d64_f32",
        "attn_bwd_wgmma_ordered_tma_f16_d128_f16",
        "attn_bwd_wgmma_ordered_tma_f16_d128_f32",
        "attn_bwd_dq_turns_w1",
        "attn_bwd_dq_turns_w2",
    ],
    includes: &[HEADER, PTX_TMA, PTX_HOPPER, WGMMA_HEADER],
};

pub(crate) static FLAGS: KernelSource = KernelSource {
    file: "attention_flags.cu",
    code: include_str!("../kernels/attention_flags.cu"),
    kernels: &["nonfinite_rows_f32", "nonfinite_rows_bf16", "nonfinite_rows_f16"],
    includes: &[],
};

pub(crate) static BACKWARD: KernelSource = KernelSource {
    file: "attention_backward.cu",
    code: include_str!("../kernels/attention_backward.cu"),
    kernels: &["attn_bwd_delta", "attn_bwd_dq", "attn_bwd_dkdv"],
    includes: &[HEADER],
};

pub(crate) static BACKWARD_TC: KernelSource = KernelSource {
    file: "attention_backward_tc.cu",
    code: include_str!("../kernels/attention_backward_tc.cu"),
    kernels: &[
        "attn_bwd_tc_dkdv_bf16_d64_bf16",
        "attn_bwd_tc_dq_bf16_d64_bf16",
        "attn_bwd_tc_dkdv_bf16_d64_f32",
        "attn_bwd_tc_dq_bf16_d64_f32",
        "attn_bwd_tc_dkdv_bf16_d128_bf16",
        "attn_bwd_tc_dq_bf16_d128_bf16",
        "attn_bwd_tc_dkdv_bf16_d128_f32",
        "attn_bwd_tc_dq_bf16_d128_f32",
        "attn_bwd_tc_dkdv_f16_d64_f16",
        "attn_bwd_tc_dq_f16_d64_f16",
        "attn_bwd_tc_dkdv_f16_d64_f32",
        "attn_bwd_tc_dq_f16_d64_f32",
        "attn_bwd_tc_dkdv_f16_d128_f16",
        "attn_bwd_tc_dq_f16_d128_f16",
        "attn_bwd_tc_dkdv_f16_d128_f32",
        "attn_bwd_tc_dq_f16_d128_f32",
    ],
    includes: &[HEADER],
};

pub(crate) static MERGE: KernelSource = KernelSource {
    file: "attention_merge.cu",
    code: include_str!("../kernels/attention_merge.cu"),
    kernels: &["attn_merge"],
    includes: &[],
};

/// Rows per tile of the tensor-core kernels (`TC_BR`, `TC_BC`), and of the non-finite row masks.
const TC_TILE: usize = 64;

/// Whether the tensor-core kernels run this problem: bf16 or f16 inputs, a head dim they are built for, and inputs at
/// 16-byte aligned addresses (their rows are copied 16 bytes at a time by cp.async, which faults otherwise; a view
/// of a buffer's middle rows may start anywhere).
fn tensor_cores(p: &AttnParams<'_>, qkv_dtype: DType, inputs: &[&View<'_>]) -> bool {
    matches!(qkv_dtype, DType::Bf16 | DType::F16)
        && matches!(p.shape.head_dim, 64 | 128)
        && inputs.iter().all(|v| v.as_device("input", v.memory()).is_ok_and(|d| d.ptr() % 16 == 0))
}

/// The forward kernels, fastest first: which one a call takes ([`path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Wgmma,
    Mma,
    General,
}

/// The forward's kernels for this problem on this stream: the backend's [`AttentionPath`] where it applies, else
/// the next one down; `Auto` is `Wgmma` on compute capability 9.0 (the wgmma kernels are sm_90a code). Wgmma and
/// mma need what [`tensor_cores`] checks and an output in the input type or f32.
fn path(b: &Stream, p: &AttnParams<'_>, qkv: &Qkv<'_>, ot: DType) -> Path {
    let qt = qkv.q.dtype();
    let tc = tensor_cores(p, qt, &[&qkv.q, &qkv.k, &qkv.v]) && (ot == qt || ot == DType::F32);
    match b.attn_path {
        AttentionPath::General => Path::General,
        _ if !tc => Path::General,
        _ if wgmma_chosen(b) => Path::Wgmma,
        _ => Path::Mma,
    }
}

/// Whether this stream takes the wgmma kernels where they apply: forced, or `Auto` on compute capability 9.0.
fn wgmma_chosen(b: &Stream) -> bool {
    match b.attn_path {
        AttentionPath::Wgmma => true,
        AttentionPath::Auto => b.device.info().compute_capability == (9, 0),
        AttentionPath::Mma | AttentionPath::General => false,
    }
}

/// The tensor map of one of attention's inputs for the wgmma kernels' TMA loads: the view `x` (`name` in errors) of
/// `heads` heads of `len` rows of D 16-bit elements as a 3-D tensor `(D, len, batch·heads)`, innermost first, a box
/// of 64 elements × `box_rows` rows × 1 head with the 128B swizzle (the kernels' tile layout: attention_wgmma.cuh),
/// so rows past a head's length land as zeros, never the next head's. `None` where a map cannot describe the view
/// (its address not 16-byte aligned, a stride not a multiple of 16 bytes, an empty dimension: the device refuses
/// it), and the caller takes the kernels without the TMA.
fn head_map(
    b: &Stream,
    p: &AttnParams<'_>,
    name: &'static str,
    x: &View<'_>,
    heads: usize,
    len: usize,
    box_rows: usize,
) -> Option<TensorMap> {
    #[cfg(test)]
    if TMA_LOADS.with(|l| l.get().refuse_maps) {
        return None;
    }
    let elem = match x.dtype() {
        DType::Bf16 => TmaElem::Bf16,
        DType::F16 => TmaElem::F16,
        DType::F32 => return None,
    };
    let d = p.shape.head_dim as u64;
    let desc = TensorMapDesc {
        elem,
        address: ptr(b, name, x).ok()?,
        dims: vec![d, len as u64, (p.shape.batch * heads) as u64],
        strides: vec![2 * d, 2 * d * len as u64],
        box_dims: vec![64, box_rows as u32, 1],
        swizzle: TmaSwizzle::B128,
    };
    b.device.tensor_map(&desc).ok()
}

/// The wgmma forward's tensor maps for Q, K and V (`attention_forward_wgmma.cu`'s header; [`head_map`]): boxes of
/// `rows` (Q) or [`FWD_BC`] (K, V) rows. `None` where the device refuses one: the caller takes the mma.sync kernels.
fn fwd_tma_maps(b: &Stream, p: &AttnParams<'_>, qkv: &Qkv<'_>, rows: usize) -> Option<[TensorMap; 3]> {
    let s = p.shape;
    Some([
        head_map(b, p, "q", &qkv.q, s.q_heads, s.q_len, rows)?,
        head_map(b, p, "k", &qkv.k, s.kv_heads, s.kv_len, FWD_BC)?,
        head_map(b, p, "v", &qkv.v, s.kv_heads, s.kv_len, FWD_BC)?,
    ])
}

/// The wgmma forward's ring of K/V stages at head dim `d`: `attention_forward_wgmma.cu`'s `#define FWD_STAGES_D<d>`,
/// read from the kernel's text when the crate builds, so that the shared memory the host gives the kernel is the
/// size the kernel lays out.
const fn fwd_stages(d: usize) -> usize {
    if d == 64 {
        c_define(FORWARD_WGMMA_CODE, "FWD_STAGES_D64")
    } else {
        c_define(FORWARD_WGMMA_CODE, "FWD_STAGES_D128")
    }
}

/// The wgmma forward's key tile (rows of K and V a stage holds, and the key tiles its mask summaries classify):
/// `attention_forward_wgmma.cu`'s `#define FWD_BC`, read from the kernel's text.
const FWD_BC: usize = c_define(FORWARD_WGMMA_CODE, "FWD_BC");

/// Dynamic shared memory of the wgmma forward at head dim `d` with `nwg` consumer warpgroups: Q (64·`nwg` rows), K
/// and V ([`FWD_BC`] rows each) in each of the ring's [`fwd_stages`], P's correction scratch (16 rows × [`FWD_BC`] keys of
/// f32 per consumer warp), the barriers (Q's, full and empty per stage, the consumers'), and 1024 for the kernel's
/// alignment of its tiles (the 128B swizzle is on the address). Above 48 KiB, so the launch raises the kernel's limit
/// (driver.rs).
const fn fwd_wgmma_smem(d: usize, nwg: usize) -> usize {
    let stages = fwd_stages(d);
    (64 * nwg + 2 * stages * FWD_BC) * d * 2 + 4 * nwg * 16 * FWD_BC * 4 + 8 * (2 + 2 * stages) + 1024
}

// Every case fits what an sm_90 block may opt into (227 KiB): the largest 225 KiB at D = 128 with two stages of 128
// keys (177 KiB at D = 64 with three).
const _: () = assert!(
    fwd_wgmma_smem(128, 2) <= 227 * 1024 && fwd_wgmma_smem(64, 2) <= 227 * 1024,
    "the wgmma forward's ring does not fit shared memory"
);

/// The warp-specialised wgmma backward's ring of Q/dO stages (the TMA-fed dK/dV and fused kernels):
/// `attention_backward_wgmma.cu`'s `#define BWD_STAGES`, read from the kernel's text as [`fwd_stages`].
const BWD_STAGES: usize = c_define(BACKWARD_WGMMA_CODE, "BWD_STAGES");

/// Consumer warpgroups of the warp-specialised wgmma backward's dK/dV kernel, or its fused one (`atomic`), at head dim
/// `d` (each with a key tile of its own, all sharing the block's Q/dO ring): `attention_backward_wgmma.cu`'s
/// `BWD_DKDV_WGS_D<d>` and `BWD_FUSED_WGS_D<d>`, read from the kernel's text; the cp.async kernels have one.
const fn bwd_dkdv_wgs(d: usize, atomic: bool, tma: bool) -> usize {
    match (tma, atomic, d) {
        (false, _, _) => 1,
        (true, false, 64) => c_define(BACKWARD_WGMMA_CODE, "BWD_DKDV_WGS_D64"),
        (true, false, _) => c_define(BACKWARD_WGMMA_CODE, "BWD_DKDV_WGS_D128"),
        (true, true, 64) => c_define(BACKWARD_WGMMA_CODE, "BWD_FUSED_WGS_D64"),
        (true, true, _) => c_define(BACKWARD_WGMMA_CODE, "BWD_FUSED_WGS_D128"),
    }
}

/// The ring's depth of the warp-specialised wgmma backward's dK/dV kernel, or its fused one (`atomic`), at head dim
/// `d`: [`BWD_STAGES`], or `attention_backward_wgmma.cu`'s `BWD_FUSED_STAGES_D<d>`, read from the kernel's text.
const fn bwd_dkdv_stages(d: usize, atomic: bool) -> usize {
    match (atomic, d) {
        (false, _) => BWD_STAGES,
        (true, 64) => c_define(BACKWARD_WGMMA_CODE, "BWD_FUSED_STAGES_D64"),
        (true, _) => c_define(BACKWARD_WGMMA_CODE, "BWD_FUSED_STAGES_D128"),
    }
}

/// Dynamic shared memory of the wgmma backward's dK/dV kernel at head dim `d` (`atomic`: the fused kernel, which adds
/// the sanitized copy of K), fed by the TMA (`tma`: the warp-specialised kernel with [`bwd_dkdv_wgs`] consumer
/// warpgroups, its ring of [`bwd_dkdv_stages`] Q/dO stages and 1 + 2·stages mbarriers) or by cp.async (one
/// warpgroup, two buffers, no barriers): K and V per consumer warpgroup, Q and dO per stage, two slots of the pairs'
/// LSE and Δ, Pᵀ and dSᵀ for the correction (16 rows × 64 of f32 each per consumer warp), the barriers, and 1024 for
/// the kernel's alignment of its tiles (the 128B swizzle is on the address).
const fn bwd_dkdv_smem(d: usize, atomic: bool, tma: bool) -> usize {
    let stages = if tma { bwd_dkdv_stages(d, atomic) } else { 2 };
    let wgs = bwd_dkdv_wgs(d, atomic, tma);
    let tiles = 2 * wgs + 2 * stages + if atomic { wgs } else { 0 };
    let bars = if tma { 8 * (1 + 2 * stages) } else { 0 };
    tiles * TC_TILE * d * 2 + 2 * 2 * TC_TILE * 4 + wgs * 4 * 2 * 16 * TC_TILE * 4 + bars + 1024
}

// Every case fits what an sm_90 block may opt into (227 KiB): the largest, the dK/dV kernel at D = 128 with three
// stages and two consumer warpgroups, by 968 bytes (the fused one there, with two stages, by 984).
const _: () = assert!(
    bwd_dkdv_smem(64, false, true) <= 227 * 1024
        && bwd_dkdv_smem(64, true, true) <= 227 * 1024
        && bwd_dkdv_smem(128, false, true) <= 227 * 1024
        && bwd_dkdv_smem(128, true, true) <= 227 * 1024,
    "the wgmma backward's ring does not fit"
);

/// The launch of the wgmma backward's dK/dV or fused kernel (`atomic`) at head dim `d`, fed by the TMA or not: a
/// block per [`bwd_dkdv_wgs`] key tiles of one (batch, key/value head), the producer warpgroup and the consumers
/// with the TMA (the kernel's header, Warps), else one warpgroup.
fn bwd_dkdv_launch(s: AttnShape, atomic: bool, tma: bool) -> LaunchConfig {
    let wgs = bwd_dkdv_wgs(s.head_dim, atomic, tma);
    LaunchConfig {
        grid: [s.kv_len.div_ceil(TC_TILE * wgs) as u32, s.kv_heads as u32, s.batch as u32],
        block: [if tma { 128 * (1 + wgs as u32) } else { 128 }, 1, 1],
        shared_bytes: bwd_dkdv_smem(s.head_dim, atomic, tma) as u32,
    }
}

/// Consumer warpgroups of the warp-specialised wgmma backward's dQ kernel (each with a query tile of its own, all
/// sharing the block's K/V ring): `attention_backward_wgmma.cu`'s `BWD_DQ_WGS`, read from the kernel's text; the
/// cp.async kernel has one.
const fn bwd_dq_wgs(tma: bool) -> usize {
    if tma {
        c_define(BACKWARD_WGMMA_CODE, "BWD_DQ_WGS")
    } else {
        1
    }
}

/// Dynamic shared memory of the wgmma backward's dQ kernel at head dim `d`, fed by the TMA (`tma`: the
/// warp-specialised kernel with [`bwd_dq_wgs`] consumer warpgroups, its ring of [`BWD_STAGES`] K/V stages and 1 +
/// 2·stages mbarriers) or by cp.async (one warpgroup, two buffers): Q and dO per consumer warpgroup, K and V per
/// stage, dS for the correction (16 rows × 64 of f32 per consumer warp), the barriers, and 1024 for the kernel's
/// alignment of its tiles.
const fn bwd_dq_smem(d: usize, tma: bool) -> usize {
    let stages = if tma { BWD_STAGES } else { 2 };
    let wgs = bwd_dq_wgs(tma);
    let bars = if tma { 8 * (1 + 2 * stages) } else { 0 };
    (2 * wgs + 2 * stages) * TC_TILE * d * 2 + wgs * 4 * 16 * TC_TILE * 4 + bars + 1024
}

const _: () = assert!(bwd_dq_smem(128, true) <= 227 * 1024, "the wgmma backward's dQ ring does not fit");

/// The launch of the wgmma backward's dQ kernel at head dim `d`, fed by the TMA or not: a block per [`bwd_dq_wgs`]
/// query tiles of one (batch, query head), the producer warpgroup and the consumers with the TMA (the kernel's
/// header, Warps), else one warpgroup.
fn bwd_dq_launch(s: AttnShape, tma: bool) -> LaunchConfig {
    let wgs = bwd_dq_wgs(tma);
    LaunchConfig {
        grid: [s.q_len.div_ceil(TC_TILE * wgs) as u32, s.q_heads as u32, s.batch as u32],
        block: [if tma { 128 * (1 + wgs as u32) } else { 128 }, 1, 1],
        shared_bytes: bwd_dq_smem(s.head_dim, tma) as u32,
    }
}

/// The value of a kernel source's `#define NAME <decimal>` (a line of its own), at compile time: a define missing or
/// not a plain number fails the build.
const fn c_define(code: &str, name: &str) -> usize {
    const PREFIX: &[u8] = b"#define ";
    let (c, n) = (code.as_bytes(), name.as_bytes());
    let mut i = 0;
    while i < c.len() {
        if (i == 0 || c[i - 1] == b'\n') && bytes_at(c, i, PREFIX) && bytes_at(c, i + PREFIX.len(), n) {
            let mut j = i + PREFIX.len() + n.len();
            if j < c.len() && c[j] == b' ' {
                j += 1;
                let (mut v, start) = (0usize, j);
                while j < c.len() && c[j].is_ascii_digit() {
                    v = v * 10 + (c[j] - b'0') as usize;
                    j += 1;
                }
                assert!(j > start && (j == c.len() || c[j] == b'\n'), "the #define is not a plain decimal number");
                return v;
            }
        }
        i += 1;
    }
    panic!("no #define of that name in the kernel source")
}

/// Whether `c` holds `pat` at `at`.
const fn bytes_at(c: &[u8], at: usize, pat: &[u8]) -> bool {
    if at + pat.len() > c.len() {
        return false;
    }
    let mut k = 0;
    while k < pat.len() {
        if c[at + k] != pat[k] {
            return false;
        }
        k += 1;
    }
    true
}

/// The wgmma backward's tensor maps for Q, K, V and dO (`attention_backward_wgmma.cu`'s header, Loads;
/// [`head_map`]): boxes of 64 rows. `None` where the device refuses one: the caller takes the cp.async kernels.
fn bwd_tma_maps(b: &Stream, p: &AttnParams<'_>, [q, k, v, dout]: [&View<'_>; 4]) -> Option<[TensorMap; 4]> {
    let s = p.shape;
    Some([
        head_map(b, p, "q", q, s.q_heads, s.q_len, TC_TILE)?,
        head_map(b, p, "k", k, s.kv_heads, s.kv_len, TC_TILE)?,
        head_map(b, p, "v", v, s.kv_heads, s.kv_len, TC_TILE)?,
        head_map(b, p, "dout", dout, s.q_heads, s.q_len, TC_TILE)?,
    ])
}

/// The wgmma kernels' loads in the tests, per thread (each test's calls run on its own thread, so what other tests
/// run at the same time does not count): `refuse_maps` makes [`head_map`] answer `None`, as a device refusing a map
/// would (the forward then takes the mma.sync kernels, the backward its cp.async ones); the counts are the calls
/// that took each load (the tests' proof of which ran).
#[cfg(test)]
#[derive(Clone, Copy, Default)]
pub(crate) struct TmaLoads {
    pub refuse_maps: bool,
    pub fwd_tma: usize,
    pub bwd_tma: usize,
    pub bwd_cp_async: usize,
}

#[cfg(test)]
thread_local! {
    pub(crate) static TMA_LOADS: std::cell::Cell<TmaLoads> = const {
        std::cell::Cell::new(TmaLoads { refuse_maps: false, fwd_tma: 0, bwd_tma: 0, bwd_cp_async: 0 })
    };
}

/// Changes this thread's [`TMA_LOADS`] record.
#[cfg(test)]
pub(crate) fn tma_loads(change: impl FnOnce(&mut TmaLoads)) {
    TMA_LOADS.with(|l| {
        let mut n = l.get();
        change(&mut n);
        l.set(n);
    });
}

/// Row tiles of 16 per warp in the tensor-core forward (`MT` in `attention_forward_tc.cu`): 2 loads each K and
/// V fragment once for 32 rows (half the shared-memory traffic per product) but reads Q's fragments from shared
/// memory at each use; 1 keeps Q in registers. At D = 64, `LONGCTX_CUDA_ATTN_ROWS=64|128` picks the block's rows
/// (1 or 2 tiles per warp); the default is 64 until the two are measured on a GPU. At D = 128 only 1 is built (2
/// does not fit in the registers).
fn forward_row_tiles(head_dim: usize) -> usize {
    match (head_dim, std::env::var("LONGCTX_CUDA_ATTN_ROWS").as_deref()) {
        (64, Ok("128")) => 2,
        _ => 1,
    }
}

/// One 64-bit mask per tile of 64 rows of each head of `x` (`[heads, len, D]`): which rows hold a non-finite
/// element (`attention_flags.cu`).
fn nonfinite_masks(b: &Stream, x: &View<'_>, heads: usize, len: usize, d: usize) -> Result<CudaAllocation> {
    let n = heads * len.div_ceil(TC_TILE);
    let masks = b.scratch(8 * n)?;
    // SAFETY: `masks` holds `n` u64 words, `2n` u32 words.
    unsafe { b.memset32(masks.ptr(), 0, 2 * n)? };
    let k = kernel(&FLAGS, &format!("nonfinite_rows_{}", super::suffix(x.dtype())))?;
    let xp = ptr(b, "x", x)?;
    let mut args = KernelArgs::new();
    args.push(masks.ptr()).push(xp).push(heads as u64).push(len as u32).push(d as u32);
    let warps_per_block = (THREADS / 32) as u64;
    let blocks = ((heads * len) as u64).div_ceil(warps_per_block).clamp(1, super::MAX_BLOCKS) as u32;
    // SAFETY: `x` holds `heads·len·d` elements; `masks` one word per tile of each head.
    unsafe { b.launch(&k, LaunchConfig::linear(blocks, THREADS), &args)? };
    Ok(masks)
}

/// Rows per tile of the general kernels (`FWD_ROWS`, `FWD_KEYS`, `BWD_ROWS` in the sources), and so of the
/// summaries they classify by.
const GENERAL_TILE: usize = 16;

/// `TileSummary` of `attention.cuh`.
#[derive(Clone, Copy)]
#[repr(C)]
struct TileSummary {
    pos_min: i64,
    pos_max: i64,
    doc_min: u32,
    doc_max: u32,
}

/// `AttnProblem` of `attention.cuh`, field for field (pointers as device addresses, 0 for null).
#[derive(Clone, Copy)]
#[repr(C)]
struct AttnProblem {
    batch: u32,
    q_heads: u32,
    kv_heads: u32,
    q_len: u32,
    kv_len: u32,
    head_dim: u32,
    scale: f32,
    causal: u32,
    window: u64,
    q_pos: u64,
    k_pos: u64,
    q_off: i64,
    k_off: i64,
    q_doc: u64,
    k_doc: u64,
    q_tiles: u64,
    k_tiles: u64,
    q_tile: u32,
    k_tile: u32,
}

/// The problem on the device: the struct the kernels take, and the uploads it points into (kept alive until the
/// launches that read them are enqueued; their memory is reused only by later work).
struct Problem {
    args: AttnProblem,
    _uploads: Vec<CudaAllocation>,
}

fn summaries(s: &[RangeSummary]) -> Vec<TileSummary> {
    s.iter()
        .map(|r| TileSummary { pos_min: r.pos_min, pos_max: r.pos_max, doc_min: r.doc_min, doc_max: r.doc_max })
        .collect()
}

fn upload<T: bytemuck::Pod>(b: &Stream, v: &[T], keep: &mut Vec<CudaAllocation>) -> Result<u64> {
    let a = b.upload_bytes(bytemuck::cast_slice(v))?;
    let p = a.ptr();
    keep.push(a);
    Ok(p)
}

fn upload_summaries(b: &Stream, s: Vec<TileSummary>, keep: &mut Vec<CudaAllocation>) -> Result<u64> {
    // SAFETY: `TileSummary` is plain data (`#[repr(C)]`, integers, no padding: 8 + 8 + 4 + 4 bytes).
    let bytes = unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s.as_slice())) };
    let a = b.upload_bytes(bytes)?;
    let p = a.ptr();
    keep.push(a);
    Ok(p)
}

fn problem(b: &Stream, p: &AttnParams<'_>, (q_tile, k_tile): (usize, usize)) -> Result<Problem> {
    let s = p.shape;
    let m = &p.mask;
    let mut keep = Vec::new();
    let (q_pos, q_off) = match m.q_pos {
        Positions::Offset(o) => (0, o),
        Positions::Explicit(v) => (upload(b, v, &mut keep)?, 0),
    };
    let (k_pos, k_off) = match m.k_pos {
        Positions::Offset(o) => (0, o),
        Positions::Explicit(v) => (upload(b, v, &mut keep)?, 0),
    };
    let (q_doc, k_doc) = match (m.q_doc, m.k_doc) {
        (Some(q), Some(k)) => (upload(b, q, &mut keep)?, upload(b, k, &mut keep)?),
        _ => (0, 0),
    };
    let q_tiles = upload_summaries(b, summaries(&tile_summaries(m, true, s.q_len, q_tile)), &mut keep)?;
    let k_tiles = upload_summaries(b, summaries(&tile_summaries(m, false, s.kv_len, k_tile)), &mut keep)?;
    let args = AttnProblem {
        batch: s.batch as u32,
        q_heads: s.q_heads as u32,
        kv_heads: s.kv_heads as u32,
        q_len: s.q_len as u32,
        kv_len: s.kv_len as u32,
        head_dim: s.head_dim as u32,
        scale: p.scale,
        causal: u32::from(m.causal),
        window: m.window.unwrap_or(0),
        q_pos,
        k_pos,
        q_off,
        k_off,
        q_doc,
        k_doc,
        q_tiles,
        k_tiles,
        q_tile: q_tile as u32,
        k_tile: k_tile as u32,
    };
    Ok(Problem { args, _uploads: keep })
}

/// The element-type code of `attention.cuh`.
fn code(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F16 => 2,
    }
}

/// Dynamic shared memory of the general kernels: two tiles of `GENERAL_TILE` rows of `D` floats (and, for the
/// key-side backward, the tile's LSE and Δ).
fn general_smem(d: usize) -> u32 {
    (2 * GENERAL_TILE * d * 4 + 2 * GENERAL_TILE * 4) as u32
}

pub(crate) fn forward(b: &Stream, p: &AttnParams<'_>, out: AttnOut<'_>, qkv: Qkv<'_>) -> Result<()> {
    let s = p.shape;
    let (qt, ot) = (qkv.q.dtype(), out.o.dtype());
    let path = path(b, p, &qkv, ot);
    // One warpgroup per 64 query rows; two per block (128 rows, K and V loaded once for both) unless the queries
    // fit one (decoding and short shards).
    let nwg = if s.q_len > 64 { 2 } else { 1 };
    let maps = if path == Path::Wgmma { fwd_tma_maps(b, p, &qkv, 64 * nwg) } else { None };
    if let Some([q_map, k_map, v_map]) = maps {
        let rows = 64 * nwg;
        let pr = problem(b, p, (rows, FWD_BC))?;
        let v_bad = nonfinite_masks(b, &qkv.v, s.batch * s.kv_heads, s.kv_len, s.head_dim)?;
        let v = ptr(b, "v", &qkv.v)?;
        let o = ptr_mut(b, "o", out.o)?;
        let lse = ptr_mut(b, "lse", out.lse)?;
        let mut args = KernelArgs::new();
        args.push(pr.args).push(q_map).push(k_map).push(v_map).push(v).push(o).push(lse).push(v_bad.ptr());
        let cfg = LaunchConfig {
            grid: [s.q_len.div_ceil(rows) as u32, s.q_heads as u32, s.batch as u32],
            // A producer warpgroup and `nwg` consumer warpgroups.
            block: [128 * (nwg as u32 + 1), 1, 1],
            shared_bytes: fwd_wgmma_smem(s.head_dim, nwg) as u32,
        };
        let name = format!("attn_fwd_wgmma_{}_d{}_w{nwg}_{}", super::suffix(qt), s.head_dim, super::suffix(ot));
        let kf = kernel(&FORWARD_WGMMA, &name)?;
        #[cfg(test)]
        tma_loads(|n| n.fwd_tma += 1);
        // SAFETY: as the general path; the maps describe the views q, k, v (their dims, strides and addresses);
        // `v_bad` holds one mask per 64 key rows of each head.
        return unsafe { b.launch(&kf, cfg, &args) };
    }
    // The mma.sync kernels, also where the wgmma ones were chosen but the device refused a tensor map.
    if matches!(path, Path::Mma | Path::Wgmma) {
        let mt = forward_row_tiles(s.head_dim);
        let rows = 64 * mt;
        let pr = problem(b, p, (rows, TC_TILE))?;
        let v_bad = nonfinite_masks(b, &qkv.v, s.batch * s.kv_heads, s.kv_len, s.head_dim)?;
        let (q, k, v) = (ptr(b, "q", &qkv.q)?, ptr(b, "k", &qkv.k)?, ptr(b, "v", &qkv.v)?);
        let o = ptr_mut(b, "o", out.o)?;
        let lse = ptr_mut(b, "lse", out.lse)?;
        let mut args = KernelArgs::new();
        args.push(pr.args).push(q).push(k).push(v).push(o).push(lse).push(v_bad.ptr());
        let cfg = LaunchConfig {
            grid: [s.q_len.div_ceil(rows) as u32, s.q_heads as u32, s.batch as u32],
            block: [128, 1, 1],
            // Q, two K and two V buffers, P's correction scratch.
            shared_bytes: ((rows + 4 * TC_TILE) * s.head_dim * 2 + 4 * 16 * mt * TC_TILE * 4) as u32,
        };
        let name = format!("attn_fwd_tc_{}_d{}_m{mt}_{}", super::suffix(qt), s.head_dim, super::suffix(ot));
        let kf = kernel(&FORWARD_TC, &name)?;
        // SAFETY: as the general path; `v_bad` holds one mask per 64 key rows of each head.
        return unsafe { b.launch(&kf, cfg, &args) };
    }
    let pr = problem(b, p, (GENERAL_TILE, GENERAL_TILE))?;
    let (q, k, v) = (ptr(b, "q", &qkv.q)?, ptr(b, "k", &qkv.k)?, ptr(b, "v", &qkv.v)?);
    let o = ptr_mut(b, "o", out.o)?;
    let lse = ptr_mut(b, "lse", out.lse)?;
    let mut args = KernelArgs::new();
    args.push(pr.args).push(q).push(k).push(v).push(o).push(lse).push(code(qt)).push(code(ot));
    let cfg = LaunchConfig {
        grid: [s.q_len.div_ceil(GENERAL_TILE) as u32, s.q_heads as u32, s.batch as u32],
        block: [128, 1, 1],
        shared_bytes: general_smem(s.head_dim),
    };
    let kf = kernel(&FORWARD, "attn_fwd_general")?;
    // SAFETY: the views have the problem's dims and types (checked); the problem's pointers are the uploads it
    // keeps alive past the launch.
    unsafe { b.launch(&kf, cfg, &args) }
}

pub(crate) fn backward(
    b: &Stream,
    p: &AttnParams<'_>,
    grads: AttnGrads<'_>,
    dout: View<'_>,
    saved: AttnSaved<'_>,
    mode: GradMode,
) -> Result<()> {
    let s = p.shape;
    let qt = saved.qkv.q.dtype();
    let (ot, dot) = (saved.o.dtype(), dout.dtype());
    let (dqt, dkt, dvt) = (grads.dq.dtype(), grads.dk.dtype(), grads.dv.dtype());
    let (q, k, v) = (ptr(b, "q", &saved.qkv.q)?, ptr(b, "k", &saved.qkv.k)?, ptr(b, "v", &saved.qkv.v)?);
    let (o, lse, dop) = (ptr(b, "o", &saved.o)?, ptr(b, "lse", &saved.lse)?, ptr(b, "dout", &dout)?);
    let (dq, dk, dv) = (ptr_mut(b, "dq", grads.dq)?, ptr_mut(b, "dk", grads.dk)?, ptr_mut(b, "dv", grads.dv)?);
    let acc = i32::from(mode == GradMode::Accumulate);
    let rows = s.lse_elems() as u64;
    let delta = b.scratch(4 * rows as usize)?;
    let tc = b.attn_path != AttentionPath::General
        && tensor_cores(p, qt, &[&saved.qkv.q, &saved.qkv.k, &saved.qkv.v, &dout])
        && dot == qt
        && dkt == dvt
        && (dkt == qt || dkt == DType::F32)
        && (dqt == qt || dqt == DType::F32);

    let kd = kernel(&BACKWARD, "attn_bwd_delta")?;
    let mut args = KernelArgs::new();
    args.push(delta.ptr()).push(o).push(dop).push(rows).push(s.head_dim as u32).push(code(ot)).push(code(dot));
    let warps_per_block = (THREADS / 32) as u64;
    let blocks = rows.div_ceil(warps_per_block).clamp(1, super::MAX_BLOCKS) as u32;
    // SAFETY: `o` and `dout` hold `rows·D` elements of their types, `delta` `rows` floats.
    unsafe { b.launch(&kd, LaunchConfig::linear(blocks, THREADS), &args)? };

    // The wgmma kernels where the forward would take them (the same path), else mma.sync's.
    let wgmma = tc && wgmma_chosen(b);
    let (src, prefix) = if wgmma { (&BACKWARD_WGMMA, "attn_bwd_wgmma") } else { (&BACKWARD_TC, "attn_bwd_tc") };
    if tc {
        let pr = problem(b, p, (TC_TILE, TC_TILE))?;
        let (qh, kh) = (s.batch * s.q_heads, s.batch * s.kv_heads);
        let q_bad = nonfinite_masks(b, &saved.qkv.q, qh, s.q_len, s.head_dim)?;
        let do_bad = nonfinite_masks(b, &dout, qh, s.q_len, s.head_dim)?;
        let k_bad = nonfinite_masks(b, &saved.qkv.k, kh, s.kv_len, s.head_dim)?;
        let tile_bytes = TC_TILE * s.head_dim * 2;
        // The wgmma kernels' loads: the TMA where the device takes the maps, else cp.async.
        let maps = if wgmma { bwd_tma_maps(b, p, [&saved.qkv.q, &saved.qkv.k, &saved.qkv.v, &dout]) } else { None };
        #[cfg(test)]
        if wgmma {
            tma_loads(|n| if maps.is_some() { n.bwd_tma += 1 } else { n.bwd_cp_async += 1 });
        }
        // The TMA kernels' names (`_tma_`), the maps first among their arguments (their shared memory:
        // bwd_dkdv_smem, bwd_dq_smem).
        let tma = if maps.is_some() { "_tma" } else { "" };
        if wgmma && b.attn_backward != WgmmaBackward::Split {
            let inputs = [q, k, v, dop, lse, delta.ptr()];
            let masks = [q_bad.ptr(), do_bad.ptr(), k_bad.ptr()];
            let ordered = b.attn_backward == WgmmaBackward::Ordered;
            return backward_fused(b, &pr, s, [dq, dk, dv], inputs, masks, [qt, dqt, dkt], acc, maps, ordered);
        }
        // The mma.sync kernels' tiles, LSE and Δ, and correction scratch (the wgmma kernels': bwd_dkdv_smem,
        // bwd_dq_smem).
        let (tiles, stats, scr_cols) = (4, 2, 32);
        let d = s.head_dim;
        let kk = kernel(src, &format!("{prefix}_dkdv{tma}_{}_d{d}_{}", super::suffix(qt), super::suffix(dkt)))?;
        let mut args = bwd_args(&pr, maps.as_ref());
        args.push(dk).push(dv).push(q).push(k).push(v).push(dop).push(lse).push(delta.ptr());
        args.push(q_bad.ptr()).push(do_bad.ptr()).push(acc);
        let cfg = if wgmma {
            bwd_dkdv_launch(s, false, maps.is_some())
        } else {
            LaunchConfig {
                grid: [s.kv_len.div_ceil(TC_TILE) as u32, s.kv_heads as u32, s.batch as u32],
                block: [128, 1, 1],
                // K, V, Q, dO tiles, the tile's LSE and Δ, Pᵀ and dSᵀ for the correction (per warp 16 rows each).
                shared_bytes: (tiles * tile_bytes + stats * TC_TILE * 4 + 4 * 2 * 16 * scr_cols * 4) as u32,
            }
        };
        // SAFETY: as the forward; `dk`/`dv` have `k`'s dims and one type; the masks one word per 64 rows of each
        // head; the maps describe the views q, k, v, dout (their dims, strides and addresses).
        unsafe { b.launch(&kk, cfg, &args)? };
        let kq = kernel(src, &format!("{prefix}_dq{tma}_{}_d{d}_{}", super::suffix(qt), super::suffix(dqt)))?;
        let mut args = bwd_args(&pr, maps.as_ref());
        args.push(dq).push(q).push(k).push(v).push(dop).push(lse).push(delta.ptr());
        args.push(k_bad.ptr()).push(acc);
        let cfg = if wgmma {
            bwd_dq_launch(s, maps.is_some())
        } else {
            LaunchConfig {
                grid: [s.q_len.div_ceil(TC_TILE) as u32, s.q_heads as u32, s.batch as u32],
                block: [128, 1, 1],
                // Q, dO, K, V tiles, dS for the correction (per warp 16 rows).
                shared_bytes: (tiles * tile_bytes + 4 * 16 * scr_cols * 4) as u32,
            }
        };
        // SAFETY: as above; `dq` has `q`'s dims.
        return unsafe { b.launch(&kq, cfg, &args) };
    }

    let pr = problem(b, p, (GENERAL_TILE, GENERAL_TILE))?;
    let smem = general_smem(s.head_dim);
    let kq = kernel(&BACKWARD, "attn_bwd_dq")?;
    let mut args = KernelArgs::new();
    args.push(pr.args).push(dq).push(q).push(k).push(v).push(dop).push(lse).push(delta.ptr());
    args.push(code(qt)).push(code(dot)).push(code(dqt)).push(acc);
    let cfg = LaunchConfig {
        grid: [s.q_len.div_ceil(GENERAL_TILE) as u32, s.q_heads as u32, s.batch as u32],
        block: [128, 1, 1],
        shared_bytes: smem,
    };
    // SAFETY: as the forward; `dq` has `q`'s dims.
    unsafe { b.launch(&kq, cfg, &args)? };

    let kk = kernel(&BACKWARD, "attn_bwd_dkdv")?;
    let mut args = KernelArgs::new();
    args.push(pr.args).push(dk).push(dv).push(q).push(k).push(v).push(dop).push(lse).push(delta.ptr());
    args.push(code(qt)).push(code(dot)).push(code(dkt)).push(code(dvt)).push(acc);
    let cfg = LaunchConfig {
        grid: [s.kv_len.div_ceil(GENERAL_TILE) as u32, s.kv_heads as u32, s.batch as u32],
        block: [128, 1, 1],
        shared_bytes: smem,
    };
    // SAFETY: as the forward; `dk` and `dv` have `k`'s dims.
    unsafe { b.launch(&kk, cfg, &args) }
}

/// A backward kernel's first arguments: the problem, then a TMA-fed wgmma kernel's tensor maps (Q, K, V, dO).
fn bwd_args(pr: &Problem, maps: Option<&[TensorMap; 4]>) -> KernelArgs {
    let mut args = KernelArgs::new();
    args.push(pr.args);
    for m in maps.into_iter().flatten() {
        args.push(*m);
    }
    args
}

/// The wgmma backward's one-kernel variants ([`CudaBackend::with_wgmma_backward`]): the fused kernel per key block
/// (dK, dV, and dQ's contributions added to an f32 workspace; fed by the TMA with `maps`, else by cp.async), in
/// whatever order the additions land or, `ordered`, with the key blocks taking turns (their flags set up first by
/// `attn_bwd_dq_turns_w<NWG>`), then dQ from the workspace.
///
/// [`CudaBackend::with_wgmma_backward`]: crate::CudaBackend::with_wgmma_backward
#[allow(clippy::too_many_arguments)]
fn backward_fused(
    b: &Stream,
    pr: &Problem,
    s: AttnShape,
    [dq, dk, dv]: [u64; 3],
    [q, k, v, dop, lse, delta]: [u64; 6],
    [q_bad, do_bad, k_bad]: [u64; 3],
    [qt, dqt, dkt]: [DType; 3],
    acc: i32,
    maps: Option<[TensorMap; 4]>,
    ordered: bool,
) -> Result<()> {
    let d = s.head_dim;
    let n = s.q_elems();
    let q_tiles = s.q_len.div_ceil(TC_TILE);
    // The workspace: whole query tiles (the kernel's bwd_dq_ws_offset order, rows past the queries included).
    let ws_elems = s.batch * s.q_heads * q_tiles * TC_TILE * d;
    let ws = b.scratch(4 * ws_elems)?;
    // SAFETY: `ws` holds `ws_elems` f32, just allocated.
    unsafe { b.memset32(ws.ptr(), 0, ws_elems)? };
    let tma = if maps.is_some() { "_tma" } else { "" };
    let variant = if ordered { "ordered" } else { "fused" };
    let name = format!("attn_bwd_wgmma_{variant}{tma}_{}_d{d}_{}", super::suffix(qt), super::suffix(dkt));
    let kf = kernel(&BACKWARD_WGMMA, &name)?;
    let mut args = bwd_args(pr, maps.as_ref());
    args.push(dk).push(dv).push(ws.ptr()).push(q).push(k).push(v).push(dop).push(lse).push(delta);
    args.push(q_bad).push(do_bad).push(k_bad).push(acc);
    let cfg = bwd_dkdv_launch(s, true, maps.is_some());
    // The turns: a flag per (batch, query head, query tile, 64 columns of D), the last block of each query tile.
    let turns = if ordered {
        Some((b.scratch(4 * s.batch * s.q_heads * q_tiles * (d / 64))?, b.scratch(4 * q_tiles)?))
    } else {
        None
    };
    if let Some((turns, last)) = &turns {
        let nwg = bwd_dkdv_wgs(d, true, maps.is_some());
        let kt = kernel(&BACKWARD_WGMMA, &format!("attn_bwd_dq_turns_w{nwg}"))?;
        let mut targs = KernelArgs::new();
        targs.push(pr.args).push(turns.ptr()).push(last.ptr()).push((d / 64) as u32);
        let blocks = (q_tiles as u64).div_ceil(THREADS as u64).clamp(1, super::MAX_BLOCKS) as u32;
        // SAFETY: `turns` holds one u32 per (batch, query head, query tile, chunk), `last` one per query tile.
        unsafe { b.launch(&kt, LaunchConfig::linear(blocks, THREADS), &targs)? };
        args.push(turns.ptr()).push(last.ptr());
    }
    // SAFETY: as the deterministic kernels (the maps too); `ws` holds one f32 per element of dQ's whole query
    // tiles; the ordered kernel's turns were just set up for this problem and this grid (bwd_dkdv_launch's, the
    // same NWG).
    unsafe { b.launch(&kf, cfg, &args)? };
    let kc = kernel(&BACKWARD_WGMMA, &format!("attn_bwd_dq_convert_d{d}_{}", super::suffix(dqt)))?;
    let mut args = KernelArgs::new();
    args.push(dq).push(ws.ptr()).push(n as u64).push(s.q_len as u32).push(pr.args.scale).push(acc);
    let blocks = (n as u64).div_ceil(THREADS as u64).clamp(1, super::MAX_BLOCKS) as u32;
    // SAFETY: `dq` holds `n` elements of its type, `ws` the workspace the kernel reads them from.
    unsafe { b.launch(&kc, LaunchConfig::linear(blocks, THREADS), &args) }
}

pub(crate) fn merge(b: &Stream, acc: AttnOut<'_>, part: AttnPartial<'_>, rows: usize, d: usize) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let (o2, l2) = (ptr(b, "part.o", &part.o)?, ptr(b, "part.lse", &part.lse)?);
    let (o1, l1) = (ptr_mut(b, "acc.o", acc.o)?, ptr_mut(b, "acc.lse", acc.lse)?);
    let k = kernel(&MERGE, "attn_merge")?;
    let mut args = KernelArgs::new();
    args.push(o1).push(l1).push(o2).push(l2).push(rows as u64).push(d as u32);
    let warps_per_block = (THREADS / 32) as u64;
    let blocks = (rows as u64).div_ceil(warps_per_block).clamp(1, super::MAX_BLOCKS) as u32;
    // SAFETY: all four are f32 with `rows` rows of `d` (checked).
    unsafe { b.launch(&k, LaunchConfig::linear(blocks, THREADS), &args) }
}
