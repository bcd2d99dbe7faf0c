//! Rotary position embedding (RoPE) with explicit positions and context-extension scalings.
//!
//! Legend: `B` batch, `H` heads, `S` sequence (tokens this rank holds), `D` head dim (even), `i ∈ [0, D/2)`.
//! Layout `[B, H, S, D]`, row-major, head dim innermost (the attention layout of this crate).
//!
//! Half-split pairing (`rotate_half`, the Llama / Hugging Face convention): element `i` pairs with `i + D/2`.
//!
//! ```text
//! θ[s,i]   = pos[s] · inv_freq[i]                  (in f64; positions are explicit, e.g. a context-parallel
//!                                                    rank's non-contiguous token positions)
//! c, s     = m · cos θ, m · sin θ                   (m = attention factor: 1, or YaRN's mscale)
//! forward:  y[i] = x[i]·c − x[i+D/2]·s,   y[i+D/2] = x[i+D/2]·c + x[i]·s
//! backward: the transposed rotation (the inverse when m = 1):
//!           dx[i] = dy[i]·c + dy[i+D/2]·s,  dx[i+D/2] = dy[i+D/2]·c − dy[i]·s
//! ```
//!
//! Partial rotary (Nemotron's `partial_rotary_factor`, HF `NemotronAttention`): only the first `R` dims of each
//! head rotate, with frequencies computed for a head of width `R` (`base^(−2i/R)`) and the pairing `(i, i + R/2)`
//! within that part; dims `R..D` pass through unchanged, in the forward and the backward
//! ([`RopeTable::with_rotary_dim`]).
//!
//! Inverse frequencies start from `inv_freq[i] = base^(−2i/D)` and are rescaled by [`RopeScaling`], following
//! Hugging Face `modeling_rope_utils`.

use rayon::prelude::*;

use crate::checks::{finite, nonzero};
use crate::error::{KernelError, Result};

/// Context-extension scaling of the rotary frequencies.
///
/// Not `Copy`: LongRoPE carries its per-frequency factors.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Position interpolation: positions divided by `factor` (`inv_freq / factor`).
    Linear {
        /// Interpolation factor (> 0).
        factor: f64,
    },
    /// NTK-aware scaling: `base · factor^(D/(D−2))` (the "dynamic" variant evaluated at a fixed factor).
    NtkAware {
        /// Context extension factor (> 0).
        factor: f64,
    },
    /// Dynamic NTK (HF `_compute_dynamic_ntk_parameters`): past the original context the base grows with the
    /// sequence, `base · (factor·S/S₀ − (factor − 1))^(D/(D−2))` with `S = max(seq_len, S₀)`; at or below `S₀` it
    /// is plain RoPE. Transformers recomputes this per forward from `max(position) + 1`; a run of fixed
    /// sequence length gives the same `seq_len` every step, so the table is built once for it.
    DynamicNtk {
        /// Context extension factor (> 0).
        factor: f64,
        /// Pre-training context `S₀` (Hugging Face's `max_position_embeddings`).
        original_max_position: usize,
        /// The sequence length the table is for (the whole sequence, not one rank's share).
        seq_len: usize,
    },
    /// LongRoPE (HF `_compute_longrope_parameters`): each frequency divided by its own factor, the long set when
    /// the sequence is longer than the original context, the short set otherwise; cos and sin are multiplied by
    /// the attention factor, by default `√(1 + ln(factor) / ln(S₀))` (1 when `factor <= 1`).
    LongRope {
        /// Per-frequency factors (`D/2` of them) for sequences of at most `original_max_position`.
        short_factor: Vec<f64>,
        /// Per-frequency factors (`D/2`) for longer sequences.
        long_factor: Vec<f64>,
        /// The extension factor behind the default attention factor (Hugging Face falls back to
        /// `max_position_embeddings / original_max_position_embeddings` when the config has none).
        factor: f64,
        /// Pre-training context `S₀`.
        original_max_position: usize,
        /// The sequence length the table is for (picks the short or the long factors).
        seq_len: usize,
        /// Override of the attention factor.
        attention_factor: Option<f64>,
    },
    /// Llama 3.1 (HF `_compute_llama3_parameters`): wavelengths longer than `original_max_position /
    /// low_freq_factor` are divided by `factor`, shorter than `original_max_position / high_freq_factor` kept,
    /// and the band between interpolated smoothly.
    Llama3 {
        /// Context extension factor (8 for Llama 3.1).
        factor: f64,
        /// Low-frequency factor (1 for Llama 3.1).
        low_freq_factor: f64,
        /// High-frequency factor (4 for Llama 3.1); must exceed `low_freq_factor`.
        high_freq_factor: f64,
        /// Pre-training context length (8192 for Llama 3.1).
        original_max_position: usize,
    },
    /// YaRN (HF `_compute_yarn_parameters`): per-frequency linear ramp between interpolation (`inv_freq /
    /// factor`) and extrapolation, over the dimensions where the number of rotations in the original context lies
    /// between `beta_slow` and `beta_fast`; cos and sin are multiplied by the attention factor.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// Pre-training context length.
        original_max_position: usize,
        /// Rotations above which a dimension extrapolates (HF default 32).
        beta_fast: f64,
        /// Rotations below which a dimension interpolates (HF default 1).
        beta_slow: f64,
        /// Override of the attention factor; `None` gives `0.1·ln(factor) + 1` (1 when `factor <= 1`).
        attention_factor: Option<f64>,
        /// Round the ramp bounds outward to whole dimensions (HF default `true`).
        truncate: bool,
    },
}

impl RopeScaling {
    /// YaRN's attention factor from DeepSeek's `mscale` and `mscale_all_dim` (HF `_compute_yarn_parameters`):
    /// `m(factor, mscale) / m(factor, mscale_all_dim)` with `m(s, k) = 0.1·k·ln(s) + 1` (1 when `s <= 1`). Pass
    /// the result as [`RopeScaling::Yarn`]'s `attention_factor`.
    pub fn yarn_mscale(factor: f64, mscale: f64, mscale_all_dim: f64) -> f64 {
        let m = |s: f64, k: f64| if s <= 1.0 { 1.0 } else { 0.1 * k * s.ln() + 1.0 };
        m(factor, mscale) / m(factor, mscale_all_dim)
    }
}

/// RoPE parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// Head dim `D` (even, ≥ 2).
    pub head_dim: usize,
    /// Base `θ` (10000 for Llama 2, 500000 for Llama 3).
    pub base: f64,
    /// Context-extension scaling.
    pub scaling: RopeScaling,
}

/// Precomputed inverse frequencies and attention factor of a [`RopeConfig`].
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    head_dim: usize,
    /// The rotating dims at the start of each head (`head_dim` unless partial).
    rotary_dim: usize,
    inv_freq: Vec<f64>,
    attention_factor: f64,
    /// The angles of the positions rotated last.
    angles: AngleCache,
}

/// `cos` and `sin` (each `[S, R/2]`) of one set of positions.
#[derive(Debug)]
pub(crate) struct Angles {
    positions: Vec<i64>,
    pub(crate) cos: Vec<f32>,
    pub(crate) sin: Vec<f32>,
}

/// The angles of the last positions a table rotated. A model rotates Q and K in every layer's forward, and
/// dQ and dK in every backward, all at the same positions: computing `S·R/2` sines and cosines in `f64` per
/// call, on one thread, cost more than the rotations themselves. One entry, compared by value (`O(S)`), so a
/// caller never has to say when positions change; a clone starts empty, and tables compare equal whatever
/// their caches hold.
#[derive(Debug, Default)]
struct AngleCache(std::sync::Mutex<Option<std::sync::Arc<Angles>>>);

impl Clone for AngleCache {
    fn clone(&self) -> Self {
        AngleCache::default()
    }
}

impl PartialEq for AngleCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

fn positive(name: &'static str, x: f64) -> Result<()> {
    finite(name, x, true)
}

impl RopeTable {
    /// Computes the inverse frequencies of `cfg`.
    ///
    /// Errors: an odd or zero head dim, a non-finite or non-positive base or factor, a zero original context,
    /// or Llama 3 `high_freq_factor <= low_freq_factor`.
    pub fn new(cfg: &RopeConfig) -> Result<Self> {
        let d = cfg.head_dim;
        nonzero("head_dim", d)?;
        if d % 2 == 1 {
            return Err(KernelError::InvalidArgument { name: "head_dim", why: format!("{d} is odd") });
        }
        positive("base", cfg.base)?;
        let half = d / 2;
        let base_inv =
            |base: f64| -> Vec<f64> { (0..half).map(|i| 1.0 / base.powf((2 * i) as f64 / d as f64)).collect() };
        let mut attention_factor = 1.0;
        let inv_freq = match cfg.scaling.clone() {
            RopeScaling::None => base_inv(cfg.base),
            RopeScaling::Linear { factor } => {
                positive("factor", factor)?;
                base_inv(cfg.base).into_iter().map(|f| f / factor).collect()
            }
            RopeScaling::NtkAware { factor } => {
                positive("factor", factor)?;
                if d == 2 {
                    return Err(KernelError::InvalidArgument {
                        name: "head_dim",
                        why: "NTK-aware scaling needs D > 2 (exponent D/(D-2))".into(),
                    });
                }
                base_inv(cfg.base * factor.powf(d as f64 / (d as f64 - 2.0)))
            }
            RopeScaling::DynamicNtk { factor, original_max_position, seq_len } => {
                positive("factor", factor)?;
                nonzero("original_max_position", original_max_position)?;
                if d == 2 {
                    return Err(KernelError::InvalidArgument {
                        name: "head_dim",
                        why: "dynamic NTK scaling needs D > 2 (exponent D/(D-2))".into(),
                    });
                }
                let (s, s0) = (seq_len.max(original_max_position) as f64, original_max_position as f64);
                let grown = (factor * s / s0 - (factor - 1.0)).powf(d as f64 / (d as f64 - 2.0));
                positive("factor", grown)?;
                base_inv(cfg.base * grown)
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                factor,
                original_max_position,
                seq_len,
                attention_factor: af,
            } => {
                positive("factor", factor)?;
                nonzero("original_max_position", original_max_position)?;
                for (name, f) in [("short_factor", &short_factor), ("long_factor", &long_factor)] {
                    if f.len() != half {
                        return Err(KernelError::InvalidArgument {
                            name,
                            why: format!("{} factors for a head dim of {d} (needs D/2 = {half})", f.len()),
                        });
                    }
                    for &x in f.iter() {
                        positive(name, x)?;
                    }
                }
                attention_factor = match af {
                    Some(a) => {
                        positive("attention_factor", a)?;
                        a
                    }
                    None if factor <= 1.0 => 1.0,
                    None => (1.0 + factor.ln() / (original_max_position as f64).ln()).sqrt(),
                };
                let ext = if seq_len > original_max_position { long_factor } else { short_factor };
                base_inv(cfg.base).into_iter().zip(ext).map(|(f, e)| f / e).collect()
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                nonzero("original_max_position", original_max_position)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(KernelError::InvalidArgument {
                        name: "high_freq_factor",
                        why: format!("{high_freq_factor} must exceed low_freq_factor {low_freq_factor}"),
                    });
                }
                let old = original_max_position as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base_inv(cfg.base)
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen > low_wavelen {
                            f / factor
                        } else if wavelen < high_wavelen {
                            f
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max_position,
                beta_fast,
                beta_slow,
                attention_factor: af,
                truncate,
            } => {
                positive("factor", factor)?;
                positive("beta_fast", beta_fast)?;
                positive("beta_slow", beta_slow)?;
                nonzero("original_max_position", original_max_position)?;
                attention_factor = match af {
                    Some(a) => {
                        positive("attention_factor", a)?;
                        a
                    }
                    None if factor <= 1.0 => 1.0,
                    None => 0.1 * factor.ln() + 1.0,
                };
                let (dim, base, maxp) = (d as f64, cfg.base, original_max_position as f64);
                let corr = |rot: f64| dim * (maxp / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
                let (mut low, mut high) = (corr(beta_fast), corr(beta_slow));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(dim - 1.0);
                if low == high {
                    high += 0.001;
                }
                base_inv(cfg.base)
                    .into_iter()
                    .enumerate()
                    .map(|(i, f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        (f / factor) * (1.0 - extrapolation) + f * extrapolation
                    })
                    .collect()
            }
        };
        Ok(RopeTable { head_dim: d, rotary_dim: d, inv_freq, attention_factor, angles: AngleCache::default() })
    }

    /// A table for heads of `cfg.head_dim` of which only the first `rotary_dim` rotate (partial rotary): the
    /// frequencies (and any scaling) are those of a head of width `rotary_dim`, as Hugging Face computes them
    /// for `partial_rotary_factor`; the remaining dims pass through.
    ///
    /// Errors: `rotary_dim` zero, odd, or above `cfg.head_dim`, and whatever [`RopeTable::new`] refuses.
    pub fn with_rotary_dim(cfg: &RopeConfig, rotary_dim: usize) -> Result<Self> {
        nonzero("rotary_dim", rotary_dim)?;
        if rotary_dim % 2 == 1 || rotary_dim > cfg.head_dim {
            return Err(KernelError::InvalidArgument {
                name: "rotary_dim",
                why: format!("{rotary_dim} must be even and at most head_dim = {}", cfg.head_dim),
            });
        }
        let mut t = RopeTable::new(&RopeConfig { head_dim: rotary_dim, ..cfg.clone() })?;
        t.head_dim = cfg.head_dim;
        Ok(t)
    }

    /// Head dim `D`.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// The rotating dims `R` at the start of each head (`D` unless partial).
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }
    /// The `R/2` inverse frequencies.
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }
    /// The factor cos and sin are multiplied by (YaRN's mscale; 1 otherwise).
    pub fn attention_factor(&self) -> f64 {
        self.attention_factor
    }

    /// `(cos, sin)`, each `[S, R/2]`, already multiplied by the attention factor.
    pub fn cos_sin(&self, positions: &[i64]) -> (Vec<f32>, Vec<f32>) {
        let a = self.angles(positions);
        (a.cos.clone(), a.sin.clone())
    }

    /// The angles of `positions`: the cached ones when they are the positions of the last call.
    pub(crate) fn angles(&self, positions: &[i64]) -> std::sync::Arc<Angles> {
        // A poisoned lock only means a panic elsewhere while it was held; the entry is replaced whole.
        let mut slot = self.angles.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = slot.as_ref().filter(|a| a.positions == positions) {
            return a.clone();
        }
        let half = self.rotary_dim / 2;
        let mut cos = vec![0.0f32; positions.len() * half];
        let mut sin = vec![0.0f32; positions.len() * half];
        // Each element depends on its position and frequency only: the same bits on any number of threads.
        cos.par_chunks_mut(half).zip(sin.par_chunks_mut(half)).zip(positions.par_iter()).for_each(|((c, s), &p)| {
            for (i, f) in self.inv_freq.iter().enumerate() {
                let (sn, cs) = (p as f64 * f).sin_cos();
                c[i] = (cs * self.attention_factor) as f32;
                s[i] = (sn * self.attention_factor) as f32;
            }
        });
        let a = std::sync::Arc::new(Angles { positions: positions.to_vec(), cos, sin });
        *slot = Some(a.clone());
        a
    }
}
