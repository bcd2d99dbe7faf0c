//! AdamW and gradient clipping against f64 references.

mod ops_util;

use longctx_kernels::{adamw_step, adamw_step_with_copy, clip_grad_norm, AdamW, Element, KernelError};
use ops_util::*;
use proptest::prelude::*;

/// `steps` AdamW steps in f64 (PyTorch semantics), gradients given per step.
fn ref_adamw(p: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f64], h: &AdamW, step: u64) {
    let (b1, b2) = (h.beta1 as f64, h.beta2 as f64);
    let (bc1, bc2) = (1.0 - b1.powi(step as i32), 1.0 - b2.powi(step as i32));
    for i in 0..p.len() {
        p[i] *= 1.0 - h.lr as f64 * h.weight_decay as f64;
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
        p[i] -= h.lr as f64 * (m[i] / bc1) / ((v[i] / bc2).sqrt() + h.eps as f64);
    }
}

fn adamw_case<G: Element>(n: usize, steps: u64, hp: AdamW, copy: bool, seed: u64) {
    let mut r = DataRng::new(seed);
    let p0 = r.vec(n, 1.0);
    let mut p: Vec<f32> = p0.iter().map(|&x| x as f32).collect();
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let mut pr: Vec<f64> = p.iter().map(|&x| x as f64).collect();
    let (mut mr, mut vr) = (vec![0.0; n], vec![0.0; n]);
    let mut bf = vec![half::bf16::ZERO; n];
    for step in 1..=steps {
        let g = rounded::<G>(&r.vec(n, 0.5));
        let gt = to_t::<G>(&g);
        if copy {
            adamw_step_with_copy(&mut bf, &mut p, &gt, &mut m, &mut v, &hp, step).unwrap();
        } else {
            adamw_step(&mut p, &gt, &mut m, &mut v, &hp, step).unwrap();
        }
        ref_adamw(&mut pr, &mut mr, &mut vr, &g, &hp, step);
    }
    assert_close("adamw params", &p, &pr);
    assert_close("adamw m", &m, &mr);
    assert_close("adamw v", &v, &vr);
    if copy {
        assert_close("adamw bf16 copy", &bf, &pr);
        assert!(bf.iter().zip(&p).all(|(b, p)| *b == half::bf16::from_f32(*p)));
    }
}

fn clip_case<G: Element>(lens: Vec<usize>, max_norm: f32, seed: u64) {
    let mut r = DataRng::new(seed);
    let data: Vec<Vec<f64>> = lens.iter().map(|&n| rounded::<G>(&r.vec(n, 1.0))).collect();
    let mut bufs: Vec<Vec<G>> = data.iter().map(|d| to_t(d)).collect();
    let norm_ref = data.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
    let mut views: Vec<&mut [G]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let norm = clip_grad_norm(&mut views, max_norm).unwrap();
    assert!((norm - norm_ref).abs() <= 1e-6 * norm_ref.max(1e-30), "{norm} vs {norm_ref}");
    let k = if norm_ref > max_norm as f64 { max_norm as f64 / (norm_ref + 1e-6) } else { 1.0 };
    for (b, d) in bufs.iter().zip(&data) {
        let want: Vec<f64> = d.iter().map(|x| x * k).collect();
        if !want.is_empty() {
            assert_close("clipped grads", b, &want);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(32)))]

    #[test]
    fn adamw_matches_reference(n in prop_oneof![1usize..100, 16_000usize..20_000], steps in 1u64..5,
        lr in 1e-4f32..1e-1, wd in prop::sample::select(vec![0.0f32, 0.01, 0.1]),
        beta2 in prop::sample::select(vec![0.95f32, 0.999]), copy: bool, bf: bool, seed: u64) {
        let hp = AdamW { lr, beta1: 0.9, beta2, eps: 1e-8, weight_decay: wd };
        both!(bf, adamw_case(n, steps, hp, copy, seed));
    }

    #[test]
    fn clip_matches_reference(lens in prop::collection::vec(0usize..40_000, 1..5), max_norm in 0.0f32..400.0, bf: bool, seed: u64) {
        both!(bf, clip_case(lens.clone(), max_norm, seed));
    }
}

#[test]
fn non_finite_norm_is_reported_and_grads_untouched() {
    let mut a = vec![1.0f32, 2.0];
    let mut b = [f32::NAN, 1.0];
    let before = (a.clone(), b[1]);
    let e = clip_grad_norm(&mut [&mut a[..], &mut b[..]], 1.0).unwrap_err();
    assert!(matches!(e, KernelError::InvalidArgument { name: "grads", .. }), "{e}");
    assert_eq!((a.clone(), b[1]), before);
    let mut c = [f32::INFINITY];
    assert!(clip_grad_norm(&mut [&mut c[..]], 1.0).is_err());
    let mut big = [f32::MAX; 4]; // f64 norm is finite: reported as a number, then clipped
    let n = clip_grad_norm(&mut [&mut big[..]], 1.0).unwrap();
    assert!(n.is_finite() && n > 1e38);
    assert!(big.iter().all(|x| x.is_finite() && *x <= 1.0));
}

#[test]
fn bad_inputs_are_typed_errors() {
    let hp = AdamW::default();
    let (mut p, g, mut m, mut v) = (vec![1.0f32; 4], vec![1.0f32; 4], vec![0.0f32; 4], vec![0.0f32; 4]);
    assert!(matches!(
        adamw_step(&mut p, &g[..3], &mut m, &mut v, &hp, 1),
        Err(KernelError::BufferLength { name: "grads", .. })
    ));
    assert!(matches!(
        adamw_step(&mut p, &g, &mut m[..1], &mut v, &hp, 1),
        Err(KernelError::BufferLength { name: "m", .. })
    ));
    assert!(matches!(
        adamw_step(&mut p, &g, &mut m, &mut v, &hp, 0),
        Err(KernelError::InvalidArgument { name: "step", .. })
    ));
    let bad = AdamW { beta1: 1.0, ..hp };
    assert!(matches!(
        adamw_step(&mut p, &g, &mut m, &mut v, &bad, 1),
        Err(KernelError::InvalidArgument { name: "beta1", .. })
    ));
    let bad = AdamW { eps: 0.0, ..hp };
    assert!(adamw_step(&mut p, &g, &mut m, &mut v, &bad, 1).is_err());
    let mut q = vec![half::bf16::ZERO; 3];
    assert!(matches!(
        adamw_step_with_copy(&mut q, &mut p, &g, &mut m, &mut v, &hp, 1),
        Err(KernelError::BufferLength { name: "params", .. })
    ));
    assert_eq!(p, vec![1.0; 4], "untouched on error");
    assert!(clip_grad_norm(&mut [&mut p[..]], -1.0).is_err());
    assert!(clip_grad_norm(&mut [&mut p[..]], f32::NAN).is_err());
}
