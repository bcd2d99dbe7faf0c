//! The portable (non-SIMD) attention path against the f64 reference. A separate test binary, because forcing
//! the portable path is process-wide.

use longctx_kernels::attention::{force_portable, reference, AttnMask, AttnParams, AttnShape, Positions};
use longctx_kernels::testing::{max_rel_err as rel_err, uniform_nonzero};
use longctx_kernels::{attention_backward, attention_forward};

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
        let f64v = |x: &[f32]| x.iter().map(|&a| a as f64).collect::<Vec<f64>>();
        let (ro, rlse) = reference::forward(&p, &f64v(&q), &f64v(&k), &f64v(&v));
        let (rdq, rdk, rdv) = reference::backward(&p, &f64v(&q), &f64v(&k), &f64v(&v), &f64v(&d_o));
        let mut o = vec![f32::NAN; q.len()];
        let mut lse = vec![f32::NAN; shape.lse_elems()];
        attention_forward(&p, (&q).into(), (&k).into(), (&v).into(), (&mut o).into(), &mut lse).unwrap();
        let (mut dq, mut dk, mut dv) = (vec![f32::NAN; q.len()], vec![f32::NAN; k.len()], vec![f32::NAN; v.len()]);
        attention_backward(
            &p,
            (&q).into(),
            (&k).into(),
            (&v).into(),
            (&o).into(),
            (&d_o).into(),
            &lse,
            (&mut dq).into(),
            (&mut dk).into(),
            (&mut dv).into(),
            false,
        )
        .unwrap();
        for (name, got, want) in
            [("O", &o, &ro), ("LSE", &lse, &rlse), ("dQ", &dq, &rdq), ("dK", &dk, &rdk), ("dV", &dv, &rdv)]
        {
            let e = rel_err(got, want);
            assert!(e < 1e-5, "portable {name} (causal {causal}): relative error {e:e}");
        }
    }
}
