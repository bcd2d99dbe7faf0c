//! Each SIMD path of the attention kernels against the f64 reference, the level passed explicitly, so every
//! path this CPU has runs in one binary (the rest of the suite takes the detected one).

mod common;

use longctx_kernels::attention::AttnShape;
use longctx_kernels::cpu::SimdPath;

#[test]
fn portable_path_matches_reference() {
    let shape = AttnShape { batch: 2, q_heads: 4, kv_heads: 2, q_len: 150, kv_len: 170, head_dim: 40 };
    common::matches_reference(SimdPath::Portable, shape, 20, 60, Some(90), 1);
}

/// Also on machines whose default is AVX-512, where the rest of the suite never reaches AVX2.
#[test]
fn avx2_path_matches_reference() {
    if !SimdPath::Avx2.is_supported() {
        eprintln!("skipped: this CPU has no AVX2 + FMA");
        return;
    }
    // Sizes that reach every tile height and the 16- and 8-column tails of the micro-kernel.
    let shape = AttnShape { batch: 1, q_heads: 4, kv_heads: 2, q_len: 141, kv_len: 200, head_dim: 40 };
    common::matches_reference(SimdPath::Avx2, shape, 59, 70, None, 11);
}

/// The best path (AVX-512 where there is one), on the AVX2 test's sizes.
#[test]
fn detected_path_matches_reference() {
    let shape = AttnShape { batch: 1, q_heads: 4, kv_heads: 2, q_len: 141, kv_len: 200, head_dim: 40 };
    common::matches_reference(SimdPath::detect(), shape, 59, 70, None, 11);
}

#[test]
fn simd_levels_are_listed_and_clamped() {
    let all = SimdPath::supported();
    assert_eq!(all[0], SimdPath::Portable);
    assert_eq!(*all.last().unwrap(), SimdPath::detect());
    assert!(all.windows(2).all(|w| w[0] < w[1]));
    for p in SimdPath::ALL {
        let c = p.clamp_supported();
        assert!(c <= p && c.is_supported() && all.contains(&c));
        assert_eq!(p.is_supported(), c == p);
    }
    assert_eq!(SimdPath::Avx512.clamp_supported(), SimdPath::detect());
}
