//! AdamW and gradient clipping through the CPU backend against f64 references.

mod ops_util;

use longctx_kernels::{AdamW, AdamwState, Backend, CpuBackend, Element, KernelError, View, ViewMut};
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
    let cpu = CpuBackend::new();
    for step in 1..=steps {
        let g = rounded::<G>(&r.vec(n, 0.5));
        let gt = to_t::<G>(&g);
        let state = AdamwState { m: view_mut(&mut m, [n]), v: view_mut(&mut v, [n]) };
        let copy_to = copy.then(|| view_mut(&mut bf, [n]));
        cpu.adamw_step(view_mut(&mut p, [n]), copy_to, view(&gt, [n]), state, &hp, step).unwrap();
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
    let mut views: Vec<ViewMut<'_>> = bufs.iter_mut().map(|b| ViewMut::flat(&mut b[..])).collect();
    let norm = CpuBackend::new().clip_grad_norm(&mut views, max_norm).unwrap();
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
    let cpu = CpuBackend::new();
    let mut a = vec![1.0f32, 2.0];
    let mut b = [f32::NAN, 1.0];
    let before = (a.clone(), b[1]);
    let e = cpu.clip_grad_norm(&mut [ViewMut::flat(&mut a), ViewMut::flat(&mut b[..])], 1.0).unwrap_err();
    assert!(matches!(e, KernelError::InvalidArgument { name: "grads", .. }), "{e}");
    assert_eq!((a.clone(), b[1]), before);
    let mut c = [f32::INFINITY];
    assert!(cpu.clip_grad_norm(&mut [ViewMut::flat(&mut c[..])], 1.0).is_err());
    let mut big = [f32::MAX; 4]; // f64 norm is finite: reported as a number, then clipped
    let n = cpu.clip_grad_norm(&mut [ViewMut::flat(&mut big[..])], 1.0).unwrap();
    assert!(n.is_finite() && n > 1e38);
    assert!(big.iter().all(|x| x.is_finite() && *x <= 1.0));
}

#[test]
fn bad_inputs_are_typed_errors() {
    let cpu = CpuBackend::new();
    let hp = AdamW::default();
    let (mut p, g, mut m, mut v) = (vec![1.0f32; 4], vec![1.0f32; 4], vec![0.0f32; 4], vec![0.0f32; 4]);
    let mut step = |p: &mut [f32], g: &[f32], m: &mut [f32], hp: &AdamW, step: u64| {
        let state = AdamwState { m: ViewMut::flat(m), v: ViewMut::flat(&mut v) };
        cpu.adamw_step(ViewMut::flat(p), None, View::flat(g), state, hp, step)
    };
    // Short `grads` and `m`: through views their dims disagree with the parameters', which the backend reports
    // as a `Shape` error naming them (the slice kernel's `BufferLength` for the same argument).
    let e = step(&mut p, &g[..3], &mut m, &hp, 1);
    assert!(matches!(&e, Err(KernelError::Shape(s)) if s.contains("`grads`")), "{e:?}");
    let e = step(&mut p, &g, &mut m[..1], &hp, 1);
    assert!(matches!(&e, Err(KernelError::Shape(s)) if s.contains("`m`")), "{e:?}");
    assert!(matches!(step(&mut p, &g, &mut m, &hp, 0), Err(KernelError::InvalidArgument { name: "step", .. })));
    let bad = AdamW { beta1: 1.0, ..hp };
    assert!(matches!(step(&mut p, &g, &mut m, &bad, 1), Err(KernelError::InvalidArgument { name: "beta1", .. })));
    let bad = AdamW { eps: 0.0, ..hp };
    assert!(step(&mut p, &g, &mut m, &bad, 1).is_err());
    // A `bf16` copy of 3 elements for 4 parameters: a `Shape` error naming `copy_to` (the slice kernel's
    // `BufferLength { name: "params" }`).
    let mut q = vec![half::bf16::ZERO; 3];
    let state = AdamwState { m: ViewMut::flat(&mut m), v: ViewMut::flat(&mut v) };
    let e = cpu.adamw_step(ViewMut::flat(&mut p), Some(ViewMut::flat(&mut q)), View::flat(&g), state, &hp, 1);
    assert!(matches!(&e, Err(KernelError::Shape(s)) if s.contains("`copy_to`")), "{e:?}");
    assert_eq!(p, vec![1.0; 4], "untouched on error");
    assert!(cpu.clip_grad_norm(&mut [ViewMut::flat(&mut p)], -1.0).is_err());
    assert!(cpu.clip_grad_norm(&mut [ViewMut::flat(&mut p)], f32::NAN).is_err());
}
