//! Rotary embeddings on every backend present (`test_device!`): the conformance suite's family (forward and
//! backward in place against the f64 rotation by the table's frequencies and attention factor, for every scaling,
//! full and partial rotary, positions up to 200 000 and past a million; the backward inverting the forward; one
//! table rotating each call by its own positions). Then the tables themselves, which are host code every backend
//! shares: their inverse frequencies and attention factors against Hugging Face's formulas rederived line by line,
//! the scalings' properties, and the configurations they refuse (`ops_rope_hf.rs` checks them against numbers
//! transformers computed).

#[macro_use]
mod common;

use std::f64::consts::PI;

use common::Device;
use longctx_kernels::testing::conformance::{rope, Family};
use longctx_kernels::{KernelError, RopeConfig, RopeScaling, RopeTable};
use proptest::prelude::*;

fn rotary(dev: &Device) {
    dev.conformance(&[Family::Rope]);
}

test_device!(rotary);

/// Inverse frequencies and attention factor, following HF `modeling_rope_utils` line by line.
fn ref_inv_freq(d: usize, base: f64, sc: RopeScaling) -> (Vec<f64>, f64) {
    let plain = |base: f64| (0..d / 2).map(|i| 1.0 / base.powf((2 * i) as f64 / d as f64)).collect::<Vec<f64>>();
    match sc {
        RopeScaling::None => (plain(base), 1.0),
        RopeScaling::Linear { factor } => (plain(base).iter().map(|f| f / factor).collect(), 1.0),
        RopeScaling::NtkAware { factor } => (plain(base * factor.powf(d as f64 / (d as f64 - 2.0))), 1.0),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
            let old = original_max_position as f64;
            let (lw, hw) = (old / low_freq_factor, old / high_freq_factor);
            let mut out = vec![];
            for f in plain(base) {
                let wl = 2.0 * PI / f;
                let mut v = if wl > lw { f / factor } else { f };
                let smooth = (old / wl - low_freq_factor) / (high_freq_factor - low_freq_factor);
                let smoothed = (1.0 - smooth) * v / factor + smooth * v;
                if wl >= hw && wl <= lw {
                    v = smoothed;
                }
                out.push(v);
            }
            (out, 1.0)
        }
        RopeScaling::Yarn { factor, original_max_position, beta_fast, beta_slow, attention_factor, truncate } => {
            let af = attention_factor.unwrap_or(if factor <= 1.0 { 1.0 } else { 0.1 * factor.ln() + 1.0 });
            let dim = d as f64;
            let cd = |rot: f64| dim * (original_max_position as f64 / (rot * 2.0 * PI)).ln() / (2.0 * base.ln());
            let (mut lo, mut hi) = (cd(beta_fast), cd(beta_slow));
            if truncate {
                lo = lo.floor();
                hi = hi.ceil();
            }
            let (lo, mut hi) = (lo.max(0.0), hi.min(dim - 1.0));
            if lo == hi {
                hi += 0.001;
            }
            let mut out = vec![];
            for (i, pf) in (0..d / 2).map(|i| base.powf((2 * i) as f64 / dim)).enumerate() {
                let (ext, int) = (1.0 / pf, 1.0 / (factor * pf));
                let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                let ef = 1.0 - ramp;
                out.push(int * (1.0 - ef) + ext * ef);
            }
            (out, af)
        }
        RopeScaling::DynamicNtk { factor, original_max_position, seq_len } => {
            let (s, s0) = (seq_len.max(original_max_position) as f64, original_max_position as f64);
            (plain(base * (factor * s / s0 - (factor - 1.0)).powf(d as f64 / (d as f64 - 2.0))), 1.0)
        }
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            factor,
            original_max_position,
            seq_len,
            attention_factor,
        } => {
            let ext = if seq_len > original_max_position { long_factor } else { short_factor };
            let af = attention_factor.unwrap_or(if factor <= 1.0 {
                1.0
            } else {
                (1.0 + factor.ln() / (original_max_position as f64).ln()).sqrt()
            });
            (plain(base).iter().zip(ext).map(|(f, e)| f / e).collect(), af)
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(common::cases_from_env(64)))]

    /// Every scaling (as the conformance suite draws them), full and partial rotary.
    #[test]
    fn tables_match_the_hf_formulas(half in 1usize..17, partial: bool, base in prop::sample::select(vec![10_000.0, 500_000.0]), kind in 0u8..8, factor in 1.5f64..16.0) {
        let d = 2 * half;
        let r = if partial && half > 1 { 2 * (half / 2) } else { d };
        let sc = rope::scaling(kind, factor, r);
        let table = RopeTable::with_rotary_dim(&RopeConfig { head_dim: d, base, scaling: sc.clone() }, r).unwrap();
        let (inv, af) = ref_inv_freq(r, base, sc);
        prop_assert_eq!((table.head_dim(), table.rotary_dim()), (d, r));
        for (g, w) in table.inv_freq().iter().zip(&inv) {
            prop_assert!((g - w).abs() <= 1e-12 * w.abs(), "{} against {}", g, w);
        }
        prop_assert!((table.attention_factor() - af).abs() < 1e-12);
    }
}

#[test]
fn linear_scaling_is_position_interpolation() {
    let plain = RopeTable::new(&RopeConfig { head_dim: 16, base: 10_000.0, scaling: RopeScaling::None }).unwrap();
    let lin =
        RopeTable::new(&RopeConfig { head_dim: 16, base: 10_000.0, scaling: RopeScaling::Linear { factor: 4.0 } })
            .unwrap();
    let (c1, s1) = lin.cos_sin(&[40, 8, 400]);
    let (c2, s2) = plain.cos_sin(&[10, 2, 100]);
    for (a, b) in c1.iter().chain(&s1).zip(c2.iter().chain(&s2)) {
        assert!((a - b).abs() < 1e-6);
    }
}

#[test]
fn llama3_keeps_high_and_divides_low_frequencies() {
    // Llama 3.1: base 500000, D 128, factor 8, low 1, high 4, original 8192.
    let sc =
        RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 };
    let t = RopeTable::new(&RopeConfig { head_dim: 128, base: 500_000.0, scaling: sc }).unwrap();
    let plain = RopeTable::new(&RopeConfig { head_dim: 128, base: 500_000.0, scaling: RopeScaling::None }).unwrap();
    let (a, p) = (t.inv_freq(), plain.inv_freq());
    assert_eq!(a[0], p[0]);
    assert!((a[63] - p[63] / 8.0).abs() <= 1e-18);
    // Wavelength 2π/f between 8192/4 and 8192 is smoothed: strictly between f/8 and f.
    let mid = (0..64).find(|&i| {
        let wl = 2.0 * PI / p[i];
        (2048.0..=8192.0).contains(&wl)
    });
    let i = mid.expect("Llama 3.1 has a medium band");
    assert!(a[i] < p[i] && a[i] > p[i] / 8.0);
}

#[test]
fn yarn_attention_factor() {
    let sc = RopeScaling::Yarn {
        factor: 4.0,
        original_max_position: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: None,
        truncate: true,
    };
    let t = RopeTable::new(&RopeConfig { head_dim: 64, base: 10_000.0, scaling: sc }).unwrap();
    assert!((t.attention_factor() - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
    let (c, s) = t.cos_sin(&[0]);
    assert!((c[0] as f64 - t.attention_factor()).abs() < 1e-6 && s[0] == 0.0);
}

#[test]
fn bad_configurations_are_typed_errors() {
    let cfg = |head_dim, scaling| RopeConfig { head_dim, base: 10_000.0, scaling };
    assert!(matches!(
        RopeTable::new(&cfg(7, RopeScaling::None)),
        Err(KernelError::InvalidArgument { name: "head_dim", .. })
    ));
    assert_eq!(RopeTable::new(&cfg(0, RopeScaling::None)), Err(KernelError::ZeroDim("head_dim")));
    assert!(RopeTable::new(&cfg(8, RopeScaling::Linear { factor: 0.0 })).is_err());
    assert!(RopeTable::new(&cfg(8, RopeScaling::Linear { factor: f64::NAN })).is_err());
    assert!(RopeTable::new(&cfg(
        8,
        RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 4.0, high_freq_factor: 1.0, original_max_position: 10 }
    ))
    .is_err());
    assert!(RopeTable::new(&RopeConfig { head_dim: 8, base: -1.0, scaling: RopeScaling::None }).is_err());
    assert!(RopeTable::new(&cfg(2, RopeScaling::NtkAware { factor: 2.0 })).is_err());
    for bad in [0, 7, 18] {
        assert!(matches!(
            RopeTable::with_rotary_dim(&cfg(16, RopeScaling::None), bad),
            Err(KernelError::ZeroDim(_)) | Err(KernelError::InvalidArgument { name: "rotary_dim", .. })
        ));
    }
}
