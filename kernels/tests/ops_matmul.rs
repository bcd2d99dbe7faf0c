//! Matmul and linear layer against f64 loop references and finite differences.

mod ops_util;

use longctx_kernels::{linear_backward, linear_forward, matmul, matmul_backward, DType, Element, KernelError};
use ops_util::*;
use proptest::prelude::*;

// ---- f64 references ----
fn ref_matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                c[i * n + j] += a[i * k + p] * b[p * n + j];
            }
        }
    }
    c
}
fn transpose(a: &[f64], r: usize, c: usize) -> Vec<f64> {
    let mut t = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            t[j * r + i] = a[i * c + j];
        }
    }
    t
}
fn ref_linear(x: &[f64], w: &[f64], b: Option<&[f64]>, t: usize, di: usize, d_o: usize) -> Vec<f64> {
    let mut y = vec![0.0; t * d_o];
    for r in 0..t {
        for o in 0..d_o {
            let mut s = b.map_or(0.0, |b| b[o]);
            for i in 0..di {
                s += x[r * di + i] * w[o * di + i];
            }
            y[r * d_o + o] = s;
        }
    }
    y
}
/// (dx, dw, db) of L = Σ dy ⊙ linear(x, w, b).
fn ref_linear_bwd(dy: &[f64], x: &[f64], w: &[f64], t: usize, di: usize, d_o: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let dx = ref_matmul(dy, w, t, d_o, di);
    let dw = ref_matmul(&transpose(dy, t, d_o), x, d_o, t, di);
    let mut db = vec![0.0; d_o];
    for r in 0..t {
        for o in 0..d_o {
            db[o] += dy[r * d_o + o];
        }
    }
    (dx, dw, db)
}

fn grad_tol<T: Element, G: Element>() -> f64 {
    tol::<T>().max(tol::<G>())
}

fn matmul_case<T: Element, G: Element>(m: usize, k: usize, n: usize, acc: bool, seed: u64) {
    let mut rng = DataRng::new(seed);
    let a = rounded::<T>(&rng.vec(m * k, 1.0));
    let b = rounded::<T>(&rng.vec(k * n, 1.0));
    let dc = rounded::<T>(&rng.vec(m * n, 1.0));
    let db0 = rounded::<G>(&rng.vec(k * n, 1.0));
    let (at, bt, dct) = (to_t::<T>(&a), to_t::<T>(&b), to_t::<T>(&dc));
    let mut c = poisoned::<T>(m * n);
    matmul(&mut c, &at, &bt, m, k, n).unwrap();
    assert_close("matmul c", &c, &ref_matmul(&a, &b, m, k, n));

    let mut da = poisoned::<T>(m * k);
    let mut db: Vec<G> = if acc { to_t(&db0) } else { poisoned(k * n) };
    matmul_backward(Some(&mut da), Some(&mut db), &dct, &at, &bt, m, k, n, acc).unwrap();
    let da_ref = ref_matmul(&dc, &transpose(&b, k, n), m, n, k);
    let mut db_ref = ref_matmul(&transpose(&a, m, k), &dc, k, m, n);
    // Finite differences of L(a, b) = Σ dc ⊙ (a·b) on the reference (small shapes only: O(size²)).
    if m * k * n <= 6000 {
        let fa = fd_grad(|a| dot(&dc, &ref_matmul(a, &b, m, k, n)), &a, 1e-3);
        let fb = fd_grad(|b| dot(&dc, &ref_matmul(&a, b, m, k, n)), &b, 1e-3);
        assert_fd("fd da", &fa, &da_ref, 1e-8);
        assert_fd("fd db", &fb, &db_ref, 1e-8);
    }
    if acc {
        db_ref.iter_mut().zip(&db0).for_each(|(r, g)| *r += g);
    }
    assert_close("matmul da", &da, &da_ref);
    let e = rel_err(&to_f64(&db), &db_ref);
    assert!(e < grad_tol::<T, G>(), "matmul db rel err {e:e}");
}

#[allow(clippy::too_many_arguments)]
fn linear_case<T: Element, G: Element>(t: usize, di: usize, d_o: usize, bias: bool, acc: bool, seed: u64) {
    let mut rng = DataRng::new(seed);
    let x = rounded::<T>(&rng.vec(t * di, 1.0));
    let w = rounded::<T>(&rng.vec(d_o * di, 1.0));
    let b = rounded::<T>(&rng.vec(d_o, 1.0));
    let dy = rounded::<T>(&rng.vec(t * d_o, 1.0));
    let dw0 = rounded::<G>(&rng.vec(d_o * di, 1.0));
    let db0 = rounded::<G>(&rng.vec(d_o, 1.0));
    let (xt, wt, bt, dyt) = (to_t::<T>(&x), to_t::<T>(&w), to_t::<T>(&b), to_t::<T>(&dy));
    let bref = bias.then_some(&b[..]);

    let mut y = poisoned::<T>(t * d_o);
    linear_forward(&mut y, &xt, &wt, bias.then_some(&bt[..]), t, di, d_o).unwrap();
    assert_close("linear y", &y, &ref_linear(&x, &w, bref, t, di, d_o));

    let mut dx = poisoned::<T>(t * di);
    let mut dw: Vec<G> = if acc { to_t(&dw0) } else { poisoned(d_o * di) };
    let mut db: Vec<G> = if acc { to_t(&db0) } else { poisoned(d_o) };
    linear_backward(Some(&mut dx), &mut dw, bias.then_some(&mut db[..]), &dyt, &xt, &wt, t, di, d_o, acc).unwrap();
    let (dx_ref, mut dw_ref, mut db_ref) = ref_linear_bwd(&dy, &x, &w, t, di, d_o);
    if t * di * d_o <= 6000 {
        let loss = |x: &[f64], w: &[f64], b: &[f64]| dot(&dy, &ref_linear(x, w, Some(b), t, di, d_o));
        assert_fd("fd dx", &fd_grad(|v| loss(v, &w, &b), &x, 1e-3), &dx_ref, 1e-8);
        assert_fd("fd dw", &fd_grad(|v| loss(&x, v, &b), &w, 1e-3), &dw_ref, 1e-8);
        assert_fd("fd db", &fd_grad(|v| loss(&x, &w, v), &b, 1e-3), &db_ref, 1e-8);
    }
    if acc {
        dw_ref.iter_mut().zip(&dw0).for_each(|(r, g)| *r += g);
        db_ref.iter_mut().zip(&db0).for_each(|(r, g)| *r += g);
    }
    assert_close("linear dx", &dx, &dx_ref);
    let tl = grad_tol::<T, G>();
    assert!(rel_err(&to_f64(&dw), &dw_ref) < tl, "linear dw");
    if bias {
        assert!(rel_err(&to_f64(&db), &db_ref) < tl, "linear db");
    }
}

/// 0: f32/f32, 1: bf16/bf16, 2: bf16 storage with f32 weight gradients.
fn dispatch(kind: u8, f32f32: impl FnOnce(), bb: impl FnOnce(), bf: impl FnOnce()) {
    match kind {
        0 => f32f32(),
        1 => bb(),
        _ => bf(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(32)))]

    #[test]
    fn matmul_matches_reference(m in 1usize..24, k in 1usize..40, n in 1usize..24, acc: bool, kind in 0u8..3, seed: u64) {
        dispatch(kind,
            || matmul_case::<f32, f32>(m, k, n, acc, seed),
            || matmul_case::<Bf16, Bf16>(m, k, n, acc, seed),
            || matmul_case::<Bf16, f32>(m, k, n, acc, seed));
    }

    #[test]
    fn linear_matches_reference(t in 1usize..24, di in 1usize..32, d_o in 1usize..24, bias: bool, acc: bool, kind in 0u8..3, seed: u64) {
        dispatch(kind,
            || linear_case::<f32, f32>(t, di, d_o, bias, acc, seed),
            || linear_case::<Bf16, Bf16>(t, di, d_o, bias, acc, seed),
            || linear_case::<Bf16, f32>(t, di, d_o, bias, acc, seed));
    }
}

#[test]
fn multi_tile_shapes() {
    // Crosses the 128×256 output tiles in both directions, and runs the parallel path.
    matmul_case::<f32, f32>(200, 19, 300, true, 1);
    matmul_case::<Bf16, f32>(130, 33, 260, false, 2);
    linear_case::<f32, f32>(150, 40, 270, true, true, 3);
}

#[test]
fn bad_shapes_are_typed_errors() {
    let a = vec![1.0f32; 6];
    let b = vec![1.0f32; 6];
    let mut c = vec![0.0f32; 4];
    assert!(matches!(matmul(&mut c, &a, &b, 2, 3, 2), Ok(())));
    assert_eq!(matmul(&mut c, &a[..5], &b, 2, 3, 2), Err(KernelError::BufferLength { name: "a", expected: 6, got: 5 }));
    assert_eq!(matmul(&mut c[..3], &a, &b, 2, 3, 2), Err(KernelError::BufferLength { name: "c", expected: 4, got: 3 }));
    assert_eq!(matmul(&mut c, &a, &b, 0, 3, 2), Err(KernelError::ZeroDim("m")));
    assert!(matches!(matmul(&mut c, &a, &b, usize::MAX, 3, 2), Err(KernelError::Shape(_))));
    let mut y = vec![0.0f32; 4];
    assert!(matches!(
        linear_forward(&mut y, &a, &b, Some(&a[..1]), 2, 3, 2),
        Err(KernelError::BufferLength { name: "bias", .. })
    ));
    let mut dw = vec![0.0f32; 5];
    assert!(matches!(
        linear_backward::<f32, f32>(None, &mut dw, None, &y, &a, &b, 2, 3, 2, false),
        Err(KernelError::BufferLength { name: "dw", .. })
    ));
    // An error leaves outputs untouched.
    let mut c = vec![7.0f32; 4];
    let _ = matmul(&mut c, &a, &b[..5], 2, 3, 2);
    assert_eq!(c, vec![7.0; 4]);
    assert_eq!(<f32 as Element>::DTYPE, DType::F32);
}
