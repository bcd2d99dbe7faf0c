//! SwiGLU and squared ReLU through the CPU backend against f64 references and finite differences.

mod ops_util;

use longctx_kernels::cpu::SimdPath;
use longctx_kernels::{Backend, CpuBackend, Element, KernelError, SquaredReluSaved, SwigluSaved, View, ViewMut};
use ops_util::*;
use proptest::prelude::*;

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}
fn ref_swiglu(g: &[f64], u: &[f64]) -> Vec<f64> {
    g.iter().zip(u).map(|(g, u)| silu(*g) * u).collect()
}
fn ref_sqrelu(x: &[f64]) -> Vec<f64> {
    x.iter().map(|x| x.max(0.0) * x.max(0.0)).collect()
}

fn swiglu_case<T: Element>(n: usize, seed: u64) {
    let mut r = DataRng::new(seed);
    let g = rounded::<T>(&r.vec(n, 4.0));
    let u = rounded::<T>(&r.vec(n, 1.0));
    let d = rounded::<T>(&r.vec(n, 1.0));
    let (gt, ut, dt) = (to_t::<T>(&g), to_t::<T>(&u), to_t::<T>(&d));
    let saved = SwigluSaved { gate: view(&gt, [n]), up: view(&ut, [n]) };
    // Every SIMD path this CPU has gives the same bits (the loops are compiled per path, without fused
    // multiply-adds); the last one's are checked against the reference.
    let (mut out, mut dg, mut du) = (vec![], vec![], vec![]);
    for simd in SimdPath::supported() {
        let cpu = CpuBackend::new().with_simd(simd);
        let mut o = poisoned::<T>(n);
        cpu.swiglu_forward(view_mut(&mut o, [n]), saved.gate, saved.up).unwrap();
        let (mut g_, mut u_) = (poisoned::<T>(n), poisoned::<T>(n));
        cpu.swiglu_backward(view_mut(&mut g_, [n]), view_mut(&mut u_, [n]), view(&dt, [n]), saved).unwrap();
        if !out.is_empty() {
            assert!(bits_eq(&o, &out) && bits_eq(&g_, &dg) && bits_eq(&u_, &du), "{simd:?} differs");
        }
        (out, dg, du) = (o, g_, u_);
    }
    assert_close("swiglu out", &out, &ref_swiglu(&g, &u));
    // Analytic f64 reference.
    let dg_ref: Vec<f64> = (0..n)
        .map(|i| {
            let s = 1.0 / (1.0 + (-g[i]).exp());
            d[i] * u[i] * (s + g[i] * s * (1.0 - s))
        })
        .collect();
    let du_ref: Vec<f64> = (0..n).map(|i| d[i] * silu(g[i])).collect();
    if n <= 300 {
        let fg = fd_grad(|v| dot(&d, &ref_swiglu(v, &u)), &g, 1e-5);
        let fu = fd_grad(|v| dot(&d, &ref_swiglu(&g, v)), &u, 1e-5);
        assert_fd("fd swiglu dg", &fg, &dg_ref, 1e-7);
        assert_fd("fd swiglu du", &fu, &du_ref, 1e-7);
    }
    assert_close("swiglu d_gate", &dg, &dg_ref);
    assert_close("swiglu d_up", &du, &du_ref);
}

fn bits_eq<T: Element>(a: &[T], b: &[T]) -> bool {
    bytemuck::cast_slice::<T, u8>(a) == bytemuck::cast_slice::<T, u8>(b)
}

/// Gates where `e^-g` leaves the normal range, and non-finite ones, give what `g·σ(g)` with the C library's
/// `exp` gives, within 1e-35 (below -88 the kernels' `σ` is 0 where the library's is under 1e-38): `σ`
/// saturates to 0 or 1, `silu(-inf)` is NaN (`-inf · 0`), NaN stays NaN.
#[test]
fn swiglu_saturates_like_the_scalar_formula() {
    let g = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 100.0, -100.0, 88.5, -88.5, 87.0, -87.0, 0.0];
    let n = g.len();
    let u = vec![1.5f32; n];
    for simd in SimdPath::supported() {
        let mut out = vec![0f32; n];
        let cpu = CpuBackend::new().with_simd(simd);
        cpu.swiglu_forward(view_mut(&mut out, [n]), view(&g, [n]), view(&u, [n])).unwrap();
        for (i, (&o, &g)) in out.iter().zip(&g).enumerate() {
            let want = g / (1.0 + (-g).exp()) * 1.5;
            let close = o == want || (o - want).abs() <= 1e-6 * want.abs() + 1e-35;
            assert!(close || (o.is_nan() && want.is_nan()), "{simd:?} gate {g}: {o} against {want} (#{i})");
        }
    }
}

fn sqrelu_case<T: Element>(n: usize, seed: u64) {
    let mut r = DataRng::new(seed);
    let x = rounded::<T>(&r.vec(n, 2.0));
    let d = rounded::<T>(&r.vec(n, 1.0));
    let cpu = CpuBackend::new();
    let (xt, dt) = (to_t::<T>(&x), to_t::<T>(&d));
    let mut out = poisoned::<T>(n);
    cpu.squared_relu_forward(view_mut(&mut out, [n]), view(&xt, [n])).unwrap();
    assert_close("sqrelu out", &out, &ref_sqrelu(&x));
    let mut dx = poisoned::<T>(n);
    cpu.squared_relu_backward(view_mut(&mut dx, [n]), view(&dt, [n]), SquaredReluSaved { x: view(&xt, [n]) }).unwrap();
    let dx_ref: Vec<f64> = (0..n).map(|i| d[i] * 2.0 * x[i].max(0.0)).collect();
    if n <= 300 {
        // |x| ≥ 0.2 keeps the kink at 0 out of the FD stencil.
        let fx = fd_grad(|v| dot(&d, &ref_sqrelu(v)), &x, 1e-5);
        assert_fd("fd sqrelu dx", &fx, &dx_ref, 1e-7);
    }
    assert_close("sqrelu dx", &dx, &dx_ref);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(32)))]

    #[test]
    fn swiglu_matches_reference(n in prop_oneof![1usize..300, 16_000usize..40_000], bf: bool, seed: u64) {
        both!(bf, swiglu_case(n, seed));
    }

    #[test]
    fn squared_relu_matches_reference(n in prop_oneof![1usize..300, 16_000usize..40_000], bf: bool, seed: u64) {
        both!(bf, sqrelu_case(n, seed));
    }
}

/// Through views, a length that does not match is a pair of disagreeing dims: the backend compares every
/// view with the first input's dims before the kernel runs and reports a `Shape` error naming the argument (the
/// slice kernels' `BufferLength` for the same argument is behind that check).
#[test]
fn bad_lengths_are_typed_errors() {
    let cpu = CpuBackend::new();
    let a = vec![1.0f32; 4];
    let mut o = vec![0.0f32; 4];
    let mut o2 = [0.0f32; 4];
    let names = |e: Result<(), KernelError>, name: &str| matches!(&e, Err(KernelError::Shape(m)) if m.contains(name));
    let e = cpu.swiglu_forward(ViewMut::flat(&mut o), View::flat(&a), View::flat(&a[..3]));
    assert!(names(e, "`up`"));
    let e = cpu.swiglu_forward(ViewMut::flat(&mut o[..2]), View::flat(&a), View::flat(&a));
    assert!(names(e, "`out`"));
    let saved = SwigluSaved { gate: View::flat(&a), up: View::flat(&a) };
    let e = cpu.swiglu_backward(ViewMut::flat(&mut o), ViewMut::flat(&mut o2[..1]), View::flat(&a), saved);
    assert!(names(e, "`dup`"));
    let e = cpu.squared_relu_forward(ViewMut::flat(&mut o[..3]), View::flat(&a));
    assert!(names(e, "`out`"));
    let e =
        cpu.squared_relu_backward(ViewMut::flat(&mut o), View::flat(&a[..1]), SquaredReluSaved { x: View::flat(&a) });
    assert!(names(e, "`dout`"));
}
