//! Cross-entropy (logits-in and fused chunked) through the CPU backend against f64 references and finite
//! differences; chunked equals unchunked; ignore_index.

mod ops_util;

use longctx_kernels::{
    Backend, CpuBackend, CrossEntropyOptions, CrossEntropyOutput, Element, GradMode, KernelError, ProjectionGrads,
    Result, View, ViewMut,
};
use ops_util::*;
use proptest::prelude::*;

const IGN: i64 = -100;

/// Mean loss and dlogits over valid rows (f64, max-subtracted).
fn ref_ce(z: &[f64], tg: &[i64], v: usize, denom: Option<f64>) -> (f64, Vec<f64>) {
    let n_valid = tg.iter().filter(|&&y| y != IGN).count();
    let den = denom.unwrap_or(n_valid.max(1) as f64);
    let mut dz = vec![0.0; z.len()];
    let mut sum = 0.0;
    for (t, &y) in tg.iter().enumerate() {
        if y == IGN {
            continue;
        }
        let row = &z[t * v..(t + 1) * v];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|x| (x - m).exp()).sum();
        sum += m + s.ln() - row[y as usize];
        for j in 0..v {
            dz[t * v + j] = ((row[j] - m).exp() / s - if j == y as usize { 1.0 } else { 0.0 }) / den;
        }
    }
    (sum / den, dz)
}
fn logits(h: &[f64], w: &[f64], t: usize, c: usize, v: usize) -> Vec<f64> {
    let mut z = vec![0.0; t * v];
    for i in 0..t {
        for j in 0..v {
            z[i * v + j] = (0..c).map(|k| h[i * c + k] * w[j * c + k]).sum();
        }
    }
    z
}
/// (loss, dh, dw) of the fused op.
fn ref_fused(h: &[f64], w: &[f64], tg: &[i64], t: usize, c: usize, v: usize) -> (f64, Vec<f64>, Vec<f64>) {
    let (loss, dz) = ref_ce(&logits(h, w, t, c, v), tg, v, None);
    let mut dh = vec![0.0; t * c];
    let mut dw = vec![0.0; v * c];
    for i in 0..t {
        for j in 0..v {
            for k in 0..c {
                dh[i * c + k] += dz[i * v + j] * w[j * c + k];
                dw[j * c + k] += dz[i * v + j] * h[i * c + k];
            }
        }
    }
    (loss, dh, dw)
}

/// The fused op through the CPU backend on slices: `dh[T,C]`, `dw[V,C]` from `h[T,C]`, `w[V,C]`.
#[allow(clippy::too_many_arguments)]
fn fused<T: Element>(
    dh: &mut [T],
    dw: &mut [T],
    h: &[T],
    w: &[T],
    tg: &[i64],
    (t, c, v): (usize, usize, usize),
    opts: &CrossEntropyOptions,
    mode: GradMode,
) -> Result<CrossEntropyOutput> {
    let grads = ProjectionGrads { dhidden: ViewMut::new(dh, [t, c])?, dweight: ViewMut::new(dw, [v, c])? };
    CpuBackend::new().cross_entropy_fused(grads, View::new(h, [t, c])?, View::new(w, [v, c])?, tg, opts, mode)
}

fn targets(r: &mut DataRng, t: usize, v: usize, p_ignore: f64) -> Vec<i64> {
    (0..t).map(|_| if r.unit() < p_ignore { IGN } else { r.below(v) as i64 }).collect()
}

/// The loss and its gradient over logits `z[T,V]` themselves: the fused op with `hidden = z` and the identity
/// `[V, V]` as the projection, whose products are exact, so `dhidden` is `dz`.
fn logits_case<T: Element>(t: usize, v: usize, scale: f64, p_ignore: f64, seed: u64) {
    let mut r = DataRng::new(seed);
    let z = rounded::<T>(&r.vec(t * v, scale));
    let tg = targets(&mut r, t, v, p_ignore);
    let eye: Vec<f64> = (0..v * v).map(|i| if i / v == i % v { 1.0 } else { 0.0 }).collect();
    let (zt, eye) = (to_t::<T>(&z), to_t::<T>(&eye));
    let (mut dz, mut deye) = (to_t::<T>(&vec![f64::NAN; t * v]), to_t::<T>(&vec![0.0; v * v]));
    let opts = CrossEntropyOptions::default();
    let out = fused(&mut dz, &mut deye, &zt, &eye, &tg, (t, v, v), &opts, GradMode::Overwrite).unwrap();
    let zt = dz;
    let (loss, dz) = ref_ce(&z, &tg, v, None);
    assert_eq!(out.n_valid, tg.iter().filter(|&&y| y != IGN).count());
    assert!((out.loss as f64 - loss).abs() <= 1e-5 * loss.abs().max(1.0), "{} vs {loss}", out.loss);
    if t * v <= 300 {
        let g = fd_grad(|x| ref_ce(x, &tg, v, None).0, &z, 1e-5);
        assert_fd("fd dlogits", &g, &dz, 1e-6);
    }
    // Entries below f32's range (e.g. p = e^-500) cannot be represented: measure against a 1e-30 floor.
    let err = rel_err(&to_f64(&zt), &dz) * dz.iter().fold(0.0f64, |m, x| m.max(x.abs()))
        / dz.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
    assert!(err < tol::<T>(), "dlogits ({:?}): rel err {err:e}", T::DTYPE);
}

#[allow(clippy::too_many_arguments)]
fn fused_case<T: Element>(t: usize, c: usize, v: usize, chunk: usize, p_ignore: f64, acc: bool, seed: u64) {
    let mut r = DataRng::new(seed);
    let h = rounded::<T>(&r.vec(t * c, 1.0));
    let w = rounded::<T>(&r.vec(v * c, 1.0));
    let dw0 = rounded::<T>(&r.vec(v * c, 1.0));
    let tg = targets(&mut r, t, v, p_ignore);
    let (ht, wt) = (to_t::<T>(&h), to_t::<T>(&w));
    let opts = CrossEntropyOptions { chunk_tokens: chunk, ..Default::default() };
    let mut dh = poisoned::<T>(t * c);
    let mut dw: Vec<T> = if acc { to_t(&dw0) } else { poisoned(v * c) };
    let out = fused(&mut dh, &mut dw, &ht, &wt, &tg, (t, c, v), &opts, mode(acc)).unwrap();
    let (loss, dh_ref, mut dw_ref) = ref_fused(&h, &w, &tg, t, c, v);
    assert!((out.loss as f64 - loss).abs() <= tol::<f32>() * loss.abs().max(1.0), "{} vs {loss}", out.loss);
    if t * c * v <= 1500 {
        let fh = fd_grad(|x| ref_fused(x, &w, &tg, t, c, v).0, &h, 1e-5);
        let fw = fd_grad(|x| ref_fused(&h, x, &tg, t, c, v).0, &w, 1e-5);
        assert_fd("fd dhidden", &fh, &dh_ref, 1e-6);
        assert_fd("fd dweight", &fw, &dw_ref, 1e-6);
    }
    if acc {
        dw_ref.iter_mut().zip(&dw0).for_each(|(a, b)| *a += b);
    }
    assert_close("dhidden", &dh, &dh_ref);
    assert_close("dweight", &dw, &dw_ref);

    // Chunked equals unchunked (same maths, possibly different rounding in the products).
    let mut dh1 = poisoned::<T>(t * c);
    let mut dw1: Vec<T> = if acc { to_t(&dw0) } else { poisoned(v * c) };
    let o1 = fused(
        &mut dh1,
        &mut dw1,
        &ht,
        &wt,
        &tg,
        (t, c, v),
        &CrossEntropyOptions { chunk_tokens: t, ..opts },
        mode(acc),
    )
    .unwrap();
    assert_eq!(o1.n_valid, out.n_valid);
    assert!((o1.loss - out.loss).abs() <= 1e-6 * out.loss.abs().max(1.0));
    assert_close_f64("chunked dh", &to_f64(&dh), &to_f64(&dh1), tol::<T>() / 4.0);
    assert_close_f64("chunked dw", &to_f64(&dw), &to_f64(&dw1), tol::<T>() / 4.0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(32)))]

    #[test]
    fn logits_variant_matches_reference(t in 1usize..24, v in 1usize..200, scale in prop::sample::select(vec![1.0, 10.0, 300.0]), p_ignore in 0.0f64..0.5, bf: bool, seed: u64) {
        both!(bf, logits_case(t, v, scale, p_ignore, seed));
    }

    #[test]
    fn fused_chunked_matches_reference(t in 1usize..24, c in 1usize..16, v in 1usize..80, chunk in 1usize..30, p_ignore in 0.0f64..0.5, acc: bool, bf: bool, seed: u64) {
        both!(bf, fused_case(t, c, v, chunk, p_ignore, acc, seed));
    }
}

#[test]
fn ignore_index_contributes_nothing() {
    let (t, c, v) = (6, 5, 11);
    let mut r = DataRng::new(9);
    let h: Vec<f32> = r.vec(t * c, 1.0).iter().map(|&x| x as f32).collect();
    let w: Vec<f32> = r.vec(v * c, 1.0).iter().map(|&x| x as f32).collect();
    // A custom ignore_index inside the vocabulary range.
    let opts = CrossEntropyOptions { ignore_index: 3, chunk_tokens: 4, denominator: None };
    let tg = vec![1i64, 3, 0, 3, 10, 2];
    let (mut dh, mut dw) = (vec![f32::NAN; t * c], vec![f32::NAN; v * c]);
    let out = fused(&mut dh, &mut dw, &h, &w, &tg, (t, c, v), &opts, GradMode::Overwrite).unwrap();
    assert_eq!(out.n_valid, 4);
    assert!(dh[c..2 * c].iter().chain(&dh[3 * c..4 * c]).all(|&x| x == 0.0), "ignored rows get zero gradient");
    // Changing the hidden state of ignored tokens changes nothing.
    let mut h2 = h.clone();
    h2[c..2 * c].iter_mut().for_each(|x| *x *= -3.0);
    let (mut dh2, mut dw2) = (vec![f32::NAN; t * c], vec![f32::NAN; v * c]);
    let out2 = fused(&mut dh2, &mut dw2, &h2, &w, &tg, (t, c, v), &opts, GradMode::Overwrite).unwrap();
    assert_eq!(out.loss, out2.loss);
    assert_close_f64("dw", &to_f64(&dw2), &to_f64(&dw), 1e-6);
    // Mean over valid tokens only: equals the same call on just the valid rows.
    let keep = [0usize, 2, 4, 5];
    let hv: Vec<f32> = keep.iter().flat_map(|&i| h[i * c..(i + 1) * c].to_vec()).collect();
    let tv: Vec<i64> = keep.iter().map(|&i| tg[i]).collect();
    let (mut dh3, mut dw3) = (vec![f32::NAN; 4 * c], vec![f32::NAN; v * c]);
    let out3 = fused(&mut dh3, &mut dw3, &hv, &w, &tv, (4, c, v), &CrossEntropyOptions::default(), GradMode::Overwrite)
        .unwrap();
    assert!((out3.loss - out.loss).abs() < 1e-6);
    // All ignored: zero loss, zero gradients.
    let (mut dh4, mut dw4) = (vec![f32::NAN; t * c], vec![f32::NAN; v * c]);
    let out4 = fused(&mut dh4, &mut dw4, &h, &w, &[3; 6], (t, c, v), &opts, GradMode::Overwrite).unwrap();
    assert_eq!((out4.loss, out4.n_valid), (0.0, 0));
    assert!(dh4.iter().chain(&dw4).all(|&x| x == 0.0));
    // An explicit denominator divides the sum instead.
    let o5 = fused(
        &mut dh4,
        &mut dw4,
        &h,
        &w,
        &tg,
        (t, c, v),
        &CrossEntropyOptions { denominator: Some(10.0), ..opts },
        GradMode::Overwrite,
    )
    .unwrap();
    assert!((o5.loss as f64 - out.loss_sum / 10.0).abs() < 1e-6);
}

#[test]
fn bad_inputs_are_typed_errors() {
    let cpu = CpuBackend::new();
    let opts = CrossEntropyOptions::default();
    let (h, w) = (vec![0.5f32; 2 * 4], vec![0.5f32; 3 * 4]);
    let (mut dh, mut dw) = (vec![0.0f32; 8], vec![0.0f32; 12]);
    let mut call = |tg: &[i64], opts: &CrossEntropyOptions| {
        fused(&mut dh, &mut dw, &h, &w, tg, (2, 4, 3), opts, GradMode::Overwrite)
    };
    let e = call(&[0, 3], &opts).unwrap_err();
    assert!(matches!(e, KernelError::InvalidArgument { name: "targets", .. }));
    assert!(matches!(call(&[0, -1], &opts), Err(KernelError::InvalidArgument { .. })));
    assert!(matches!(call(&[0], &opts), Err(KernelError::BufferLength { name: "targets", .. })));
    let bad = CrossEntropyOptions { denominator: Some(0.0), ..opts };
    assert!(call(&[0, 1], &bad).is_err());
    assert_eq!((&dh, &dw), (&vec![0.0; 8], &vec![0.0; 12]), "untouched on error");
    let zero = CrossEntropyOptions { chunk_tokens: 0, ..opts };
    assert_eq!(
        fused(&mut dh, &mut dw, &h, &w, &[0, 1], (2, 4, 3), &zero, GradMode::Overwrite),
        Err(KernelError::ZeroDim("chunk_tokens"))
    );
    // A `dweight` one element short cannot be viewed as [3, 4] (the view constructor refuses it); viewed with
    // the dims it has, the backend reports them as a `Shape` error naming `dweight` (the slice kernel's
    // `BufferLength { name: "dweight" }`).
    assert!(matches!(ViewMut::new(&mut dw[..11], [3, 4]), Err(KernelError::Shape(_))));
    let grads =
        ProjectionGrads { dhidden: ViewMut::new(&mut dh, [2, 4]).unwrap(), dweight: ViewMut::flat(&mut dw[..11]) };
    let e = cpu.cross_entropy_fused(
        grads,
        View::new(&h, [2, 4]).unwrap(),
        View::new(&w, [3, 4]).unwrap(),
        &[0, 1],
        &opts,
        GradMode::Overwrite,
    );
    assert!(matches!(&e, Err(KernelError::Shape(m)) if m.contains("`dweight`")), "{e:?}");
}
