//! The AVX2 attention path against the f64 reference, on machines whose default is AVX-512 (where the rest of
//! the suite never reaches it). A separate test binary, because capping the path is process-wide.

use longctx_kernels::attention::{limit_simd, simd_path, AttnMask, AttnParams, AttnShape, Positions, SimdPath};
use longctx_kernels::testing::{attention_f32, max_rel_err as rel_err, reference_f64, uniform_nonzero};

#[test]
fn avx2_path_matches_reference() {
    limit_simd(SimdPath::Avx2);
    if simd_path() != SimdPath::Avx2 {
        eprintln!("skipped: this CPU has no AVX2 + FMA (path {:?})", simd_path());
        return;
    }
    // Sizes that exercise every tile height and the 16- and 8-column tails of the micro-kernel.
    let shape = AttnShape { batch: 1, q_heads: 4, kv_heads: 2, q_len: 141, kv_len: 200, head_dim: 40 };
    let docs_q: Vec<u32> = (0..141).map(|i| (i / 70) as u32).collect();
    let docs_k: Vec<u32> = (0..200).map(|i| ((i + 10) / 70) as u32).collect();
    for causal in [false, true] {
        let mut mask =
            AttnMask::full().with_positions(Positions::Offset(59), Positions::Offset(0)).with_docs(&docs_q, &docs_k);
        mask.causal = causal;
        let p = AttnParams::new(shape).with_mask(mask);
        let q = uniform_nonzero(shape.q_elems(), 11);
        let k = uniform_nonzero(shape.kv_elems(), 12);
        let v = uniform_nonzero(shape.kv_elems(), 13);
        let d_o = uniform_nonzero(shape.q_elems(), 14);
        let want = reference_f64(&p, &q, &k, &v, &d_o);
        let got = attention_f32(&p, &q, &k, &v, &d_o).unwrap();
        for (name, (got, want)) in ["O", "LSE", "dQ", "dK", "dV"].iter().zip(got.iter().zip(&want)) {
            let e = rel_err(got, want);
            assert!(e < 1e-5, "AVX2 {name} (causal {causal}): relative error {e:e}");
        }
    }
}
