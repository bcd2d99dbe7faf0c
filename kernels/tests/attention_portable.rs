//! The portable (non-SIMD) attention path against the f64 reference. A separate test binary, because forcing
//! the portable path is process-wide.

use longctx_kernels::attention::{force_portable, AttnMask, AttnParams, AttnShape, Positions};
use longctx_kernels::testing::{attention_f32, max_rel_err as rel_err, reference_f64, uniform_nonzero};

#[test]
fn portable_path_matches_reference() {
    force_portable(true);
    let shape = AttnShape { batch: 2, q_heads: 4, kv_heads: 2, q_len: 150, kv_len: 170, head_dim: 40 };
    let docs_q: Vec<u32> = (0..150).map(|i| (i / 60) as u32).collect();
    let docs_k: Vec<u32> = (0..170).map(|i| ((i + 20) / 60) as u32).collect();
    for causal in [false, true] {
        let mut mask =
            AttnMask::full().with_positions(Positions::Offset(20), Positions::Offset(0)).with_docs(&docs_q, &docs_k);
        mask.causal = causal;
        mask.window = Some(90);
        let p = AttnParams::new(shape).with_mask(mask);
        let q = uniform_nonzero(shape.q_elems(), 1);
        let k = uniform_nonzero(shape.kv_elems(), 2);
        let v = uniform_nonzero(shape.kv_elems(), 3);
        let d_o = uniform_nonzero(shape.q_elems(), 4);
        let want = reference_f64(&p, &q, &k, &v, &d_o);
        let got = attention_f32(&p, &q, &k, &v, &d_o).unwrap();
        for (name, (got, want)) in ["O", "LSE", "dQ", "dK", "dV"].iter().zip(got.iter().zip(&want)) {
            let e = rel_err(got, want);
            assert!(e < 1e-5, "portable {name} (causal {causal}): relative error {e:e}");
        }
    }
}
