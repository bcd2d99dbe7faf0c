//! Shared by the attention test binaries: the CPU backend on one explicit SIMD path, and the f64 reference check.
#![allow(dead_code)] // each test binary uses its own part

use longctx_kernels::attention::{AttnMask, AttnParams, AttnShape, Positions};
use longctx_kernels::cpu::SimdPath;
use longctx_kernels::testing::{attention_f32_with, max_rel_err, reference_f64, uniform_nonzero};
use longctx_kernels::CpuBackend;

/// The CPU backend on `simd` (which must be supported: the tests take their paths from `SimdPath::supported`).
pub fn cpu_on(simd: SimdPath) -> CpuBackend {
    let cpu = CpuBackend::new().with_simd(simd);
    assert_eq!(cpu.simd(), simd, "{simd:?} is not supported here");
    cpu
}

/// Forward then backward through the CPU backend on `simd` with `f32` buffers: `[O, LSE, dQ, dK, dV]`, every
/// output poisoned with NaN before its call (`testing::attention_f32` on the detected path).
pub fn attention_f32_on(
    simd: SimdPath,
    p: &AttnParams<'_>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d_o: &[f32],
) -> [Vec<f32>; 5] {
    attention_f32_with(&cpu_on(simd), p, q, k, v, d_o).unwrap()
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

/// Merges the partial `(o2, lse2)` into `(o1, lse1)` through the CPU backend: `lse1.len()` rows of
/// `o1.len() / lse1.len()` elements, viewed as one batch and one head.
pub fn merge_f32(o1: &mut [f32], lse1: &mut [f32], o2: &[f32], lse2: &[f32]) -> longctx_kernels::Result<()> {
    use longctx_kernels::{AttnOut, AttnPartial, Backend, View, ViewMut};
    let (rows, d) = (lse1.len(), o1.len() / lse1.len());
    let acc = AttnOut { o: ViewMut::new(o1, [1, 1, rows, d])?, lse: ViewMut::new(lse1, [1, 1, rows])? };
    let part = AttnPartial { o: View::new(o2, [1, 1, rows, d])?, lse: View::new(lse2, [1, 1, rows])? };
    CpuBackend::new().attention_merge(acc, part)
}
