//! Shared by the attention test binaries: the kernels on one explicit SIMD path, and the f64 reference check.
#![allow(dead_code)] // each test binary uses its own part

use longctx_kernels::attention::{
    attention_backward_on, attention_forward_on, AttnMask, AttnParams, AttnShape, Positions, SimdPath,
};
use longctx_kernels::testing::{max_rel_err, reference_f64, uniform_nonzero};

/// Forward then backward on `simd` with `f32` buffers: `[O, LSE, dQ, dK, dV]`, every output poisoned with NaN
/// before its call (as `testing::attention_f32`, which takes the detected path).
pub fn attention_f32_on(
    simd: SimdPath,
    p: &AttnParams<'_>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d_o: &[f32],
) -> [Vec<f32>; 5] {
    let s = p.shape;
    let mut o = vec![f32::NAN; s.q_elems()];
    let mut lse = vec![f32::NAN; s.lse_elems()];
    attention_forward_on(simd, p, q.into(), k.into(), v.into(), (&mut o).into(), &mut lse).unwrap();
    let (mut dq, mut dk, mut dv) =
        (vec![f32::NAN; s.q_elems()], vec![f32::NAN; s.kv_elems()], vec![f32::NAN; s.kv_elems()]);
    attention_backward_on(
        simd,
        p,
        q.into(),
        k.into(),
        v.into(),
        (&o).into(),
        d_o.into(),
        &lse,
        (&mut dq).into(),
        (&mut dk).into(),
        (&mut dv).into(),
        false,
    )
    .unwrap();
    [o, lse, dq, dk, dv]
}

/// Forward and backward on `simd` against the f64 reference, causal and not, with packed documents of
/// `doc_len` positions, a query offset and an optional window: every output within 1e-5 (relative).
pub fn matches_reference(
    simd: SimdPath,
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
        let got = attention_f32_on(simd, &p, &q, &k, &v, &d_o);
        for (name, (got, want)) in ["O", "LSE", "dQ", "dK", "dV"].iter().zip(got.iter().zip(&want)) {
            let e = max_rel_err(got, want);
            assert!(e < 1e-5, "{simd:?} {name} (causal {causal}): relative error {e:e}");
        }
    }
}
