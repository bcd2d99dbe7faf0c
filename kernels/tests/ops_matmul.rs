//! Matmul and linear layer through the CPU backend against f64 loop references and finite differences.

mod ops_util;

use longctx_kernels::{
    Backend, CpuBackend, DType, Element, GradMode, KernelError, LinearGrads, LinearSaved, View, ViewMut,
};
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
    let cpu = CpuBackend::new();
    let (xv, wv) = (view(&xt, [t, di]), view(&wt, [d_o, di]));

    let mut y = poisoned::<T>(t * d_o);
    cpu.linear_forward(view_mut(&mut y, [t, d_o]), xv, wv, bias.then(|| view(&bt, [d_o]))).unwrap();
    assert_close("linear y", &y, &ref_linear(&x, &w, bref, t, di, d_o));

    let mut dx = poisoned::<T>(t * di);
    let mut dw: Vec<G> = if acc { to_t(&dw0) } else { poisoned(d_o * di) };
    let mut db: Vec<G> = if acc { to_t(&db0) } else { poisoned(d_o) };
    let grads = LinearGrads {
        dx: Some(view_mut(&mut dx, [t, di])),
        dw: view_mut(&mut dw, [d_o, di]),
        dbias: bias.then(|| view_mut(&mut db, [d_o])),
    };
    cpu.linear_backward(grads, view(&dyt, [t, d_o]), LinearSaved { x: xv }, wv, mode(acc)).unwrap();
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
    linear_case::<f32, f32>(200, 19, 300, false, true, 1);
    linear_case::<Bf16, f32>(130, 33, 260, true, false, 2);
    linear_case::<f32, f32>(150, 40, 270, true, true, 3);
}

#[test]
fn long_token_reductions_split_into_chunks() {
    // Weight gradients (and a product's right-hand gradient) over 4500 and 9000 tokens: the reduction is cut
    // into 8 chunks (an uneven last one). Run twice on one thread, so that the second run's partials start
    // from the first one's values.
    for seed in [5, 6] {
        linear_case::<f32, f32>(4500, 24, 40, true, seed == 5, seed);
        linear_case::<Bf16, f32>(4500, 17, 9, false, seed == 6, seed);
    }
    linear_case::<f32, f32>(9000, 8, 16, false, false, 7);
    linear_case::<f32, f32>(4500, 12, 20, false, true, 8);
}

#[test]
fn bad_shapes_are_typed_errors() {
    let cpu = CpuBackend::new();
    let a = vec![1.0f32; 6];
    let b = vec![1.0f32; 6];
    let mut c = vec![0.0f32; 4];
    let (av, bv) = (View::new(&a, [2, 3]).unwrap(), View::new(&b, [2, 3]).unwrap());
    assert!(matches!(cpu.linear_forward(ViewMut::new(&mut c, [2, 2]).unwrap(), av, bv, None), Ok(())));
    // A buffer shorter than its dims cannot be viewed with them: the view constructor refuses it. Viewed with
    // the dims it has, the backend refuses the dims instead.
    assert!(matches!(View::new(&a[..5], [2, 3]), Err(KernelError::Shape(_))));
    assert!(matches!(ViewMut::new(&mut c[..3], [2, 2]), Err(KernelError::Shape(_))));
    let e = cpu.linear_forward(ViewMut::new(&mut c, [2, 2]).unwrap(), View::new(&a[..5], [1, 5]).unwrap(), bv, None);
    assert!(matches!(&e, Err(KernelError::Shape(m)) if m.contains("[2, 3]")), "{e:?}");
    let e = cpu.linear_forward(ViewMut::new(&mut c[..3], [1, 3]).unwrap(), av, bv, None);
    assert!(matches!(&e, Err(KernelError::Shape(m)) if m.contains("`y`")), "{e:?}");
    // An element count that overflows is refused by the view constructor (the kernel's `Shape` error).
    assert!(matches!(View::new(&a, [usize::MAX, 3]), Err(KernelError::Shape(_))));
    let mut y = vec![0.0f32; 4];
    let e = cpu.linear_forward(ViewMut::new(&mut y, [2, 2]).unwrap(), av, bv, Some(View::flat(&a[..1])));
    assert!(matches!(e, Err(KernelError::BufferLength { name: "bias", .. })), "{e:?}");
    // A `dw` of 5 elements: through views its dims disagree with `w`'s, which the backend reports as a `Shape`
    // error naming `dw` (the slice kernel's `BufferLength { name: "dw" }` comes after that check).
    let mut dw = vec![0.0f32; 5];
    let grads = LinearGrads { dx: None, dw: ViewMut::flat(&mut dw), dbias: None };
    let e = cpu.linear_backward(grads, View::new(&y, [2, 2]).unwrap(), LinearSaved { x: av }, bv, GradMode::Overwrite);
    assert!(matches!(&e, Err(KernelError::Shape(m)) if m.contains("`dw`")), "{e:?}");
    // An error leaves outputs untouched.
    let mut c = vec![7.0f32; 4];
    let _ = cpu.linear_forward(ViewMut::new(&mut c, [2, 2]).unwrap(), av, View::new(&b[..5], [1, 5]).unwrap(), None);
    assert_eq!(c, vec![7.0; 4]);
    assert_eq!(<f32 as Element>::DTYPE, DType::F32);
}
