//! RMSNorm and LayerNorm through the CPU backend against f64 loop references and finite differences.

mod ops_util;

use longctx_kernels::{
    Backend, CpuBackend, Element, GradMode, KernelError, LayerNormSaved, NormGrads, NormParams, RmsNormSaved, View,
    ViewMut,
};
use ops_util::*;
use proptest::prelude::*;

fn ref_rms(x: &[f64], w: &[f64], n: usize, c: usize, eps: f64) -> Vec<f64> {
    let mut y = vec![0.0; n * c];
    for r in 0..n {
        let row = &x[r * c..(r + 1) * c];
        let ms: f64 = row.iter().map(|v| v * v).sum::<f64>() / c as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for i in 0..c {
            y[r * c + i] = row[i] * inv * w[i];
        }
    }
    y
}
fn ref_rms_bwd(dy: &[f64], x: &[f64], w: &[f64], n: usize, c: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let (mut dx, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
    for r in 0..n {
        let row = &x[r * c..(r + 1) * c];
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / c as f64 + eps).sqrt();
        let mut dot = 0.0;
        for i in 0..c {
            let xh = row[i] * inv;
            dw[i] += dy[r * c + i] * xh;
            dot += dy[r * c + i] * w[i] * xh;
        }
        for i in 0..c {
            dx[r * c + i] = inv * (dy[r * c + i] * w[i] - row[i] * inv * dot / c as f64);
        }
    }
    (dx, dw)
}
fn ref_ln(x: &[f64], w: &[f64], b: &[f64], n: usize, c: usize, eps: f64) -> Vec<f64> {
    let mut y = vec![0.0; n * c];
    for r in 0..n {
        let row = &x[r * c..(r + 1) * c];
        let mu = row.iter().sum::<f64>() / c as f64;
        let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / c as f64;
        let inv = 1.0 / (var + eps).sqrt();
        for i in 0..c {
            y[r * c + i] = (row[i] - mu) * inv * w[i] + b[i];
        }
    }
    y
}
fn ref_ln_bwd(dy: &[f64], x: &[f64], w: &[f64], n: usize, c: usize, eps: f64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut dx, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
    for r in 0..n {
        let row = &x[r * c..(r + 1) * c];
        let mu = row.iter().sum::<f64>() / c as f64;
        let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / c as f64;
        let inv = 1.0 / (var + eps).sqrt();
        let (mut sg, mut sgx) = (0.0, 0.0);
        for i in 0..c {
            let xh = (row[i] - mu) * inv;
            let g = dy[r * c + i] * w[i];
            dw[i] += dy[r * c + i] * xh;
            db[i] += dy[r * c + i];
            sg += g;
            sgx += g * xh;
        }
        for i in 0..c {
            let xh = (row[i] - mu) * inv;
            dx[r * c + i] = inv * (dy[r * c + i] * w[i] - sg / c as f64 - xh * sgx / c as f64);
        }
    }
    (dx, dw, db)
}

fn rms_case<T: Element>(n: usize, c: usize, eps: f64, acc: bool, seed: u64) {
    let mut r = DataRng::new(seed);
    let x = rounded::<T>(&r.vec(n * c, 2.0));
    let w = rounded::<T>(&r.vec(c, 1.0));
    let dy = rounded::<T>(&r.vec(n * c, 1.0));
    let dw0 = rounded::<T>(&r.vec(c, 1.0));
    let (xt, wt, dyt) = (to_t::<T>(&x), to_t::<T>(&w), to_t::<T>(&dy));
    let cpu = CpuBackend::new();
    let (xv, wv) = (view(&xt, [n, c]), view(&wt, [c]));
    let mut y = poisoned::<T>(n * c);
    let mut rstd = vec![f32::NAN; n];
    let p = NormParams { weight: wv, bias: None, eps: eps as f32 };
    cpu.rmsnorm_forward(view_mut(&mut y, [n, c]), view_mut(&mut rstd, [n]), xv, &p).unwrap();
    assert_close("rms y", &y, &ref_rms(&x, &w, n, c, eps));
    let mut dx = poisoned::<T>(n * c);
    let mut dw: Vec<T> = if acc { to_t(&dw0) } else { poisoned(c) };
    let grads = NormGrads { dx: view_mut(&mut dx, [n, c]), dweight: view_mut(&mut dw, [c]), dbias: None };
    let saved = RmsNormSaved { x: xv, rstd: view(&rstd, [n]) };
    cpu.rmsnorm_backward(grads, view(&dyt, [n, c]), saved, wv, mode(acc)).unwrap();
    let (dx_ref, mut dw_ref) = ref_rms_bwd(&dy, &x, &w, n, c, eps);
    if n * c <= 400 {
        let fx = fd_grad(|v| dot(&dy, &ref_rms(v, &w, n, c, eps)), &x, 1e-5);
        let fw = fd_grad(|v| dot(&dy, &ref_rms(&x, v, n, c, eps)), &w, 1e-5);
        assert_fd("fd rms dx", &fx, &dx_ref, 1e-6);
        assert_fd("fd rms dw", &fw, &dw_ref, 1e-6);
    }
    if acc {
        dw_ref.iter_mut().zip(&dw0).for_each(|(a, b)| *a += b);
    }
    assert_close("rms dx", &dx, &dx_ref);
    assert_close("rms dw", &dw, &dw_ref);
}

fn ln_case<T: Element>(n: usize, c: usize, eps: f64, acc: bool, seed: u64) {
    let mut r = DataRng::new(seed);
    // An offset mean exercises the centring.
    let x = rounded::<T>(&r.vec(n * c, 2.0).iter().map(|v| v + 0.5).collect::<Vec<_>>());
    let w = rounded::<T>(&r.vec(c, 1.0));
    let b = rounded::<T>(&r.vec(c, 1.0));
    let dy = rounded::<T>(&r.vec(n * c, 1.0));
    let (dw0, db0) = (rounded::<T>(&r.vec(c, 1.0)), rounded::<T>(&r.vec(c, 1.0)));
    let (xt, wt, bt, dyt) = (to_t::<T>(&x), to_t::<T>(&w), to_t::<T>(&b), to_t::<T>(&dy));
    let cpu = CpuBackend::new();
    let (xv, wv) = (view(&xt, [n, c]), view(&wt, [c]));
    let mut y = poisoned::<T>(n * c);
    let (mut mean, mut rstd) = (vec![f32::NAN; n], vec![f32::NAN; n]);
    let p = NormParams { weight: wv, bias: Some(view(&bt, [c])), eps: eps as f32 };
    cpu.layernorm_forward(view_mut(&mut y, [n, c]), view_mut(&mut mean, [n]), view_mut(&mut rstd, [n]), xv, &p)
        .unwrap();
    assert_close("ln y", &y, &ref_ln(&x, &w, &b, n, c, eps));
    let mut dx = poisoned::<T>(n * c);
    let mut dw: Vec<T> = if acc { to_t(&dw0) } else { poisoned(c) };
    let mut db: Vec<T> = if acc { to_t(&db0) } else { poisoned(c) };
    let grads = NormGrads {
        dx: view_mut(&mut dx, [n, c]),
        dweight: view_mut(&mut dw, [c]),
        dbias: Some(view_mut(&mut db, [c])),
    };
    let saved = LayerNormSaved { x: xv, mean: view(&mean, [n]), rstd: view(&rstd, [n]) };
    cpu.layernorm_backward(grads, view(&dyt, [n, c]), saved, wv, mode(acc)).unwrap();
    let (dx_ref, mut dw_ref, mut db_ref) = ref_ln_bwd(&dy, &x, &w, n, c, eps);
    if n * c <= 400 {
        let l = |x: &[f64], w: &[f64], b: &[f64]| dot(&dy, &ref_ln(x, w, b, n, c, eps));
        assert_fd("fd ln dx", &fd_grad(|v| l(v, &w, &b), &x, 1e-5), &dx_ref, 1e-6);
        assert_fd("fd ln dw", &fd_grad(|v| l(&x, v, &b), &w, 1e-5), &dw_ref, 1e-6);
        assert_fd("fd ln db", &fd_grad(|v| l(&x, &w, v), &b, 1e-5), &db_ref, 1e-6);
    }
    if acc {
        dw_ref.iter_mut().zip(&dw0).for_each(|(a, b)| *a += b);
        db_ref.iter_mut().zip(&db0).for_each(|(a, b)| *a += b);
    }
    assert_close("ln dx", &dx, &dx_ref);
    assert_close("ln dw", &dw, &dw_ref);
    assert_close("ln db", &db, &db_ref);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(32)))]

    #[test]
    fn rmsnorm_matches_reference(n in 1usize..40, c in 2usize..48, eps in prop::sample::select(vec![1e-6, 1e-5, 1e-2]), acc: bool, bf: bool, seed: u64) {
        both!(bf, rms_case(n, c, eps, acc, seed));
    }

    #[test]
    fn layernorm_matches_reference(n in 1usize..40, c in 3usize..48, eps in prop::sample::select(vec![1e-6, 1e-5, 1e-2]), acc: bool, bf: bool, seed: u64) {
        both!(bf, ln_case(n, c, eps, acc, seed));
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let cpu = CpuBackend::new();
    let x = vec![1.0f32; 6];
    let w = vec![1.0f32; 3];
    let mut y = vec![0.0f32; 6];
    let mut r = vec![0.0f32; 2];
    let mut m = vec![0.0f32; 2];
    let xv = View::new(&x, [2, 3]).unwrap();
    let rms = |y: &mut [f32], r: &mut [f32], x: View<'_>, w: &[f32], eps: f32| {
        let p = NormParams { weight: View::flat(w), bias: None, eps };
        let y = ViewMut::new(y, x.dims()).unwrap();
        cpu.rmsnorm_forward(y, ViewMut::flat(r), x, &p)
    };
    assert!(matches!(rms(&mut y, &mut r, xv, &w[..2], 1e-5), Err(KernelError::BufferLength { name: "weight", .. })));
    assert!(matches!(rms(&mut y, &mut r, xv, &w, f32::NAN), Err(KernelError::InvalidArgument { .. })));
    assert!(matches!(rms(&mut y, &mut r, xv, &w, -1.0), Err(KernelError::InvalidArgument { .. })));
    // No rows: empty views of dims [0, 3] reach the kernel.
    let e = rms(&mut y[..0], &mut r[..0], View::new(&x[..0], [0, 3]).unwrap(), &w, 1e-5);
    assert_eq!(e, Err(KernelError::ZeroDim("n")));
    let p = NormParams { weight: View::flat(&w), bias: Some(View::flat(&w)), eps: 1e-5 };
    let e = cpu.layernorm_forward(
        ViewMut::new(&mut y, [2, 3]).unwrap(),
        ViewMut::flat(&mut m),
        ViewMut::flat(&mut r[..1]),
        xv,
        &p,
    );
    assert!(matches!(e, Err(KernelError::BufferLength { name: "rstd", .. })), "{e:?}");
    let mut dx = vec![0.0f32; 6];
    let mut dw = vec![0.0f32; 3];
    let mut db = vec![0.0f32; 4];
    let grads = NormGrads {
        dx: ViewMut::new(&mut dx, [2, 3]).unwrap(),
        dweight: ViewMut::flat(&mut dw),
        dbias: Some(ViewMut::flat(&mut db)),
    };
    let saved = LayerNormSaved { x: xv, mean: View::flat(&m), rstd: View::flat(&r) };
    let e = cpu.layernorm_backward(grads, xv, saved, View::flat(&w), GradMode::Accumulate);
    assert!(matches!(e, Err(KernelError::BufferLength { name: "dbias", .. })), "{e:?}");
    // A `dy` one element short cannot be viewed as [2, 3] (the view constructor refuses it); viewed with the dims
    // it has, the backend reports them as a `Shape` error naming `dy` (the slice kernel's `BufferLength`).
    assert!(matches!(View::new(&x[..5], [2, 3]), Err(KernelError::Shape(_))));
    let grads = NormGrads { dx: ViewMut::new(&mut dx, [2, 3]).unwrap(), dweight: ViewMut::flat(&mut dw), dbias: None };
    let saved = RmsNormSaved { x: xv, rstd: View::flat(&r) };
    let e = cpu.rmsnorm_backward(grads, View::flat(&x[..5]), saved, View::flat(&w), GradMode::Accumulate);
    assert!(matches!(&e, Err(KernelError::Shape(m)) if m.contains("`dy`")), "{e:?}");
}
