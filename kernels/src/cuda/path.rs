//! [`AttentionPath`]: which attention kernels the CUDA backend runs, chosen per backend
//! ([`CudaBackend::with_attention_path`](crate::CudaBackend::with_attention_path)) or for the process
//! (`LONGCTX_CUDA_ATTN_PATH`). In every build, so that code naming it compiles without the `cuda` feature. Also
//! how the wgmma backward computes dQ ([`WgmmaBackward`], `LONGCTX_CUDA_ATTN_DETERMINISTIC`).

use crate::error::{KernelError, Result};

/// Which attention kernels the CUDA backend runs. A path applies where it supports the problem; elsewhere the
/// backend takes the next one down (wgmma → mma → general), so forcing a path never refuses a problem another path
/// runs:
/// - `wgmma`: `attention_forward_wgmma.cu` and `attention_backward_wgmma.cu`, Hopper's warpgroup MMA (sm_90a), for
///   the problems `mma` runs.
/// - `mma`: the `mma.sync` tensor-core kernels (`attention_forward_tc.cu`, `attention_backward_tc.cu`), on any GPU
///   from sm_80 (bf16 or f16 inputs, head dim 64 or 128, 16-byte aligned inputs, outputs and gradients in the input
///   type or f32); the reference of the wgmma path on the GPU.
/// - `general`: the f32 kernels that run every problem (`attention_forward.cu`, `attention_backward.cu`).
///
/// [`Auto`](AttentionPath::Auto), the default, takes `wgmma` on a compute capability 9.0 GPU and `mma` elsewhere
/// (the emulator reports 8.0; forcing `wgmma` there runs the wgmma kernels on the emulator's warpgroup MMA, which
/// is how the tests cover them). Forcing `wgmma` on a GPU other than sm_90 fails at the launch (the kernels are
/// sm_90a code).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionPath {
    /// `wgmma` on compute capability 9.0, else `mma`.
    #[default]
    Auto,
    /// The wgmma kernels where they apply.
    Wgmma,
    /// The mma.sync kernels where they apply.
    Mma,
    /// The general kernels always.
    General,
}

impl AttentionPath {
    /// The path `LONGCTX_CUDA_ATTN_PATH` names (`auto`, `wgmma`, `mma`, `general`; unset or empty: `Auto`).
    ///
    /// Errors: [`KernelError::InvalidArgument`] for any other value.
    pub fn from_env() -> Result<Self> {
        match std::env::var("LONGCTX_CUDA_ATTN_PATH") {
            Ok(s) => s.parse(),
            Err(_) => Ok(Self::Auto),
        }
    }
}

impl std::str::FromStr for AttentionPath {
    type Err = KernelError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "" | "auto" => Ok(Self::Auto),
            "wgmma" => Ok(Self::Wgmma),
            "mma" => Ok(Self::Mma),
            "general" => Ok(Self::General),
            other => Err(KernelError::InvalidArgument {
                name: "LONGCTX_CUDA_ATTN_PATH",
                why: format!("`{other}` is none of auto, wgmma, mma, general"),
            }),
        }
    }
}

/// How the wgmma attention backward computes dQ
/// ([`CudaBackend::with_wgmma_backward`](crate::CudaBackend::with_wgmma_backward) states the trade; the other paths
/// have one way). Counted in tile products: S and dP, then dV, dK and dQ, for each (query tile, key tile) pair the
/// mask does not hide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WgmmaBackward {
    /// Two kernels, dK/dV per key block and dQ per query block, each computing S and dP (7 products a pair); every
    /// gradient element summed by one thread in a fixed order. Deterministic; the default.
    #[default]
    Split,
    /// One kernel per key block (5 products a pair) that adds each pair's dQ contribution to an f32 workspace, the
    /// key blocks taking turns for each query tile in a fixed order. Deterministic.
    Ordered,
    /// The same kernel with the additions in whatever order they land. Not deterministic in dQ.
    Atomic,
}

impl WgmmaBackward {
    /// Whether two runs give the same bits.
    pub fn deterministic(self) -> bool {
        self != Self::Atomic
    }
}

/// The wgmma backward `LONGCTX_CUDA_ATTN_DETERMINISTIC` names: unset, empty, `1` or `split`: [`WgmmaBackward::Split`]
/// (the default, and what the trainer runs); `ordered`: [`WgmmaBackward::Ordered`]; `0` or `atomic`:
/// [`WgmmaBackward::Atomic`].
///
/// Errors: [`KernelError::InvalidArgument`] for any other value.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the backend, which the build without CUDA stubs
pub(crate) fn wgmma_backward_from_env() -> Result<WgmmaBackward> {
    match std::env::var("LONGCTX_CUDA_ATTN_DETERMINISTIC") {
        Ok(s) => parse_wgmma_backward(&s),
        Err(_) => Ok(WgmmaBackward::Split),
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn parse_wgmma_backward(s: &str) -> Result<WgmmaBackward> {
    match s.trim() {
        "" | "1" | "split" => Ok(WgmmaBackward::Split),
        "ordered" => Ok(WgmmaBackward::Ordered),
        "0" | "atomic" => Ok(WgmmaBackward::Atomic),
        other => Err(KernelError::InvalidArgument {
            name: "LONGCTX_CUDA_ATTN_DETERMINISTIC",
            why: format!("`{other}` is none of 1, split, ordered, 0, atomic"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_wgmma_backward, AttentionPath, WgmmaBackward};

    #[test]
    fn split_is_the_default_and_the_others_are_named() {
        for (s, want) in [
            ("", WgmmaBackward::Split),
            (" 1", WgmmaBackward::Split),
            ("split", WgmmaBackward::Split),
            ("ordered ", WgmmaBackward::Ordered),
            ("0", WgmmaBackward::Atomic),
            ("atomic", WgmmaBackward::Atomic),
        ] {
            assert_eq!(parse_wgmma_backward(s).ok(), Some(want), "{s:?}");
        }
        assert!(WgmmaBackward::Ordered.deterministic() && !WgmmaBackward::Atomic.deterministic());
        let err = parse_wgmma_backward("no").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("LONGCTX_CUDA_ATTN_DETERMINISTIC") && err.contains("`no`"), "{err}");
    }

    #[test]
    fn parses_the_four_names_and_refuses_others() {
        for (s, p) in [
            ("auto", AttentionPath::Auto),
            ("", AttentionPath::Auto),
            ("wgmma", AttentionPath::Wgmma),
            (" mma ", AttentionPath::Mma),
            ("general", AttentionPath::General),
        ] {
            assert_eq!(s.parse::<AttentionPath>().ok(), Some(p), "{s:?}");
        }
        let err = "tc".parse::<AttentionPath>().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("LONGCTX_CUDA_ATTN_PATH") && err.contains("`tc`"), "{err}");
    }
}
