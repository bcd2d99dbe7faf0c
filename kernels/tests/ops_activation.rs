//! SwiGLU and squared ReLU against f64 references and finite differences.

mod ops_util;

use longctx_kernels::{
    squared_relu_backward, squared_relu_forward, swiglu_backward, swiglu_forward, Element, KernelError,
};
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
    let mut out = poisoned::<T>(n);
    swiglu_forward(&mut out, &to_t::<T>(&g), &to_t::<T>(&u)).unwrap();
    assert_close("swiglu out", &out, &ref_swiglu(&g, &u));
    let (mut dg, mut du) = (poisoned::<T>(n), poisoned::<T>(n));
    swiglu_backward(&mut dg, &mut du, &to_t::<T>(&d), &to_t::<T>(&g), &to_t::<T>(&u)).unwrap();
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

fn sqrelu_case<T: Element>(n: usize, seed: u64) {
    let mut r = DataRng::new(seed);
    let x = rounded::<T>(&r.vec(n, 2.0));
    let d = rounded::<T>(&r.vec(n, 1.0));
    let mut out = poisoned::<T>(n);
    squared_relu_forward(&mut out, &to_t::<T>(&x)).unwrap();
    assert_close("sqrelu out", &out, &ref_sqrelu(&x));
    let mut dx = poisoned::<T>(n);
    squared_relu_backward(&mut dx, &to_t::<T>(&d), &to_t::<T>(&x)).unwrap();
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

#[test]
fn bad_lengths_are_typed_errors() {
    let a = vec![1.0f32; 4];
    let mut o = vec![0.0f32; 4];
    let mut o2 = [0.0f32; 4];
    assert!(matches!(swiglu_forward(&mut o, &a, &a[..3]), Err(KernelError::BufferLength { name: "up", .. })));
    assert!(matches!(swiglu_forward(&mut o[..2], &a, &a), Err(KernelError::BufferLength { name: "out", .. })));
    assert!(matches!(
        swiglu_backward(&mut o, &mut o2[..1], &a, &a, &a),
        Err(KernelError::BufferLength { name: "d_up", .. })
    ));
    assert!(matches!(squared_relu_forward(&mut o[..3], &a), Err(KernelError::BufferLength { name: "out", .. })));
    assert!(matches!(squared_relu_backward(&mut o, &a[..1], &a), Err(KernelError::BufferLength { name: "dout", .. })));
}
