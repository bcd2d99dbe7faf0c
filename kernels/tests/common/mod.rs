//! Shared by the test binaries that pin one SIMD path (each its own binary, since the pin is process-wide).

use longctx_kernels::attention::{AttnMask, AttnParams, AttnShape, Positions};
use longctx_kernels::testing::{attention_f32, max_rel_err, reference_f64, uniform_nonzero};

/// Forward and backward of the path in force against the f64 reference, causal and not, with packed documents
/// of `doc_len` positions, a query offset and an optional window: every output within 1e-5 (relative).
pub fn matches_reference(
    path: &str,
    shape: AttnShape,
    q_offset: usize,
    doc_len: usize,
    window: Option<u64>,
    seed: u64,
) {
    let docs_q: Vec<u32> = (0..shape.q_len).map(|i| ((i + q_offset) / doc_len) as u32).collect();
    let docs_k: Vec<u32> = (0..shape.kv_len).map(|i| (i / doc_len) as u32).collect();
    for causal in [false, true] {
        let mut mask = AttnMask::full()
            .with_positions(Positions::Offset(q_offset as i64), Positions::Offset(0))
            .with_docs(&docs_q, &docs_k);
        mask.causal = causal;
        mask.window = window;
        let p = AttnParams::new(shape).with_mask(mask);
        let q = uniform_nonzero(shape.q_elems(), seed);
        let k = uniform_nonzero(shape.kv_elems(), seed + 1);
        let v = uniform_nonzero(shape.kv_elems(), seed + 2);
        let d_o = uniform_nonzero(shape.q_elems(), seed + 3);
        let want = reference_f64(&p, &q, &k, &v, &d_o);
        let got = attention_f32(&p, &q, &k, &v, &d_o).unwrap();
        for (name, (got, want)) in ["O", "LSE", "dQ", "dK", "dV"].iter().zip(got.iter().zip(&want)) {
            let e = max_rel_err(got, want);
            assert!(e < 1e-5, "{path} {name} (causal {causal}): relative error {e:e}");
        }
    }
}
