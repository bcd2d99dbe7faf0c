//! The CUDA kernel sources, embedded in the binary: one `.cu` file per kernel family under `kernels/`, each
//! compiled as one translation unit made of the shared headers (`common.cuh`: element types, conversions,
//! reductions; `ptx.cuh`: the inline-PTX wrappers) followed by the file itself. The same text goes to NVRTC
//! for a GPU and to the host C++ compiler for the emulator, so what the emulator tests is what the GPU runs.

use super::device::KernelSource;
pub(crate) use super::includes::{PTX_HOPPER, PTX_TMA};

/// The shared headers, in the order they are prepended.
pub(crate) const HEADERS: &[(&str, &str)] =
    &[("common.cuh", include_str!("kernels/common.cuh")), ("ptx.cuh", include_str!("kernels/ptx.cuh"))];

/// Every kernel source.
pub(crate) static SOURCES: &[&KernelSource] = &[
    &super::ops::elementwise::SOURCE,
    &super::ops::norm::SOURCE,
    &super::ops::rope::SOURCE,
    &super::ops::embedding::SOURCE,
    &super::ops::moe::SOURCE,
    &super::ops::linear::SOURCE,
    &super::ops::cross_entropy::SOURCE,
    &super::ops::attention::FORWARD,
    &super::ops::attention::FORWARD_TC,
    &super::ops::attention::FLAGS,
    &super::ops::attention::BACKWARD,
    &super::ops::attention::BACKWARD_TC,
    &super::ops::attention::MERGE,
];

/// Whether `src` can only be compiled for sm_90a (it includes [`PTX_HOPPER`]): NVRTC refuses `wgmma` for sm_90.
pub(crate) fn needs_sm90a(src: &KernelSource) -> bool {
    src.includes.iter().any(|(name, _)| *name == PTX_HOPPER.0)
}

/// Whether `src` needs sm_90 or later (it includes [`PTX_TMA`] or [`PTX_HOPPER`]). No source in [`SOURCES`] does:
/// they compile for sm_80 too; one that did would belong in a list of sm_90-and-later sources, which does not exist
/// yet (the only such source, the TMA probe, is sm_90a-only).
pub(crate) fn needs_sm90(src: &KernelSource) -> bool {
    needs_sm90a(src) || src.includes.iter().any(|(name, _)| *name == PTX_TMA.0)
}

/// The probe of `wgmma`'s layouts (kernels/wgmma_probe.cu; its tests are in `cuda::wgmma_probe`).
pub(crate) static WGMMA_PROBE: KernelSource = KernelSource {
    file: "wgmma_probe.cu",
    code: include_str!("kernels/wgmma_probe.cu"),
    kernels: &[
        "longctx_wgmma_probe_bf16_n64",
        "longctx_wgmma_probe_bf16_n128",
        "longctx_wgmma_probe_f16_n64",
        "longctx_wgmma_probe_f16_n128",
        "longctx_wgmma_probe_rs_bf16_n64",
        "longctx_wgmma_probe_rs_bf16_n128",
        "longctx_wgmma_probe_rs_f16_n64",
        "longctx_wgmma_probe_rs_f16_n128",
        "longctx_wgmma_probe_mistakes",
    ],
    includes: &[PTX_HOPPER],
};

/// The probe of the TMA and mbarriers in a warp-specialised pipeline (kernels/tma_probe.cu; its tests are in
/// `cuda::tma_probe`): sm_90a-only, as it also uses `setmaxnreg`.
pub(crate) static TMA_PROBE: KernelSource = KernelSource {
    file: "tma_probe.cu",
    code: include_str!("kernels/tma_probe.cu"),
    kernels: &[
        "longctx_tma_probe",
        "longctx_tma_probe_try_wait",
        "longctx_tma_probe_wgmma",
        "longctx_tma_probe_reduce",
    ],
    includes: &[PTX_TMA, PTX_HOPPER],
};

/// The sources compiled for sm_90a only (each [`needs_sm90a`]); not among [`SOURCES`], which every GPU compiles.
pub(crate) static SM90A_SOURCES: &[&KernelSource] =
    &[&WGMMA_PROBE, &TMA_PROBE, &super::ops::attention::FORWARD_WGMMA, &super::ops::attention::BACKWARD_WGMMA];

/// The translation unit of `src`: the headers, then the source, with `#line` directives so that compiler
/// messages name the file and line they come from.
pub(crate) fn translation_unit(src: &KernelSource) -> String {
    let mut tu = String::new();
    for (name, text) in HEADERS {
        tu.push_str(&format!("#line 1 \"{name}\"\n"));
        tu.push_str(text);
        tu.push('\n');
    }
    for (name, text) in src.includes {
        tu.push_str(&format!("#line 1 \"{name}\"\n"));
        tu.push_str(text);
        tu.push('\n');
    }
    tu.push_str(&format!("#line 1 \"{}\"\n", src.file));
    tu.push_str(src.code);
    tu.push('\n');
    tu
}
