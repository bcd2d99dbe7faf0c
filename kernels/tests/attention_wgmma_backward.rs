//! The wgmma attention backward (`attention_backward_wgmma.cu`), forced with `AttentionPath::Wgmma` on the backend:
//! on the emulator (`::emulated`) and on an sm_90 GPU
//! (`::cuda`: skipped, saying why, without one or on another architecture) against the f64 reference on the same
//! rounded inputs. bf16 and f16, head dims 64 and 128, GQA, lengths off the tile, causal, window with explicit
//! positions and documents, a causal band over 5 tiles (hidden pairs on both sides), gradients in T or f32, both grad
//! modes, outputs poisoned (or pre-filled, to accumulate) before each call; two runs bit-identical; a NaN in one query
//! or key row confined to the gradients that see it. (The conformance families with the path forced are in
//! `attention_wgmma.rs`.) The non-deterministic variant (`CudaBackend::with_deterministic_backward(false)`) on the
//! same cases: against the reference, dK/dV bit-identical to the deterministic path's and dQ close to it, and the
//! NaN confinement with dQ compared within a tolerance; the ordered one (`WgmmaBackward::Ordered`) the same against
//! the reference and the split backward, two runs bit-identical, and the NaN confinement exact. The shapes are
//! small: the emulator computes each wgmma exactly, in double.
#![cfg(feature = "cuda")]

#[allow(unused_macros)] // test_device!: this binary runs on the emulator and a GPU only
mod common;

use half::{bf16, f16};
use longctx_kernels::attention::{AttnMask, AttnParams, AttnShape, Positions};
use longctx_kernels::cuda::{AttentionPath, WgmmaBackward};
use longctx_kernels::testing::{reference_f64, uniform_nonzero};
use longctx_kernels::{AttnGrads, AttnSaved, Backend, Buffer, CudaBackend, DType, Dims, GradMode, Qkv, View, ViewMut};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mask {
    Full,
    Causal,
    /// A window of 37 over explicit positions (the queries 5 ahead of the keys), two documents.
    WindowDocs,
    /// Causal with a window of 100: a band of tile pairs, hidden ones before and after it on every row of tiles.
    CausalWindow,
}

#[derive(Debug, Clone, Copy)]
struct Case {
    shape: AttnShape,
    dtype: DType,
    grads: DType,
    mask: Mask,
    mode: GradMode,
}

/// What a case puts in one row of an input before the run: a NaN in row `row` of the first head of Q or K.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Poison {
    None,
    QRow(usize),
    KRow(usize),
}

/// The values of `x` rounded to `dt`.
fn rounded(x: &[f32], dt: DType) -> Vec<f32> {
    match dt {
        DType::Bf16 => x.iter().map(|&a| bf16::from_f32(a).to_f32()).collect(),
        DType::F16 => x.iter().map(|&a| f16::from_f32(a).to_f32()).collect(),
        DType::F32 => x.to_vec(),
    }
}

/// A buffer of `dt` on `be` holding `x` (representable in `dt`).
fn put(be: &dyn Backend, dt: DType, dims: &[usize], x: &[f32]) -> Buffer {
    let d = Dims::new(dims).expect("dims");
    let mut buf = be.empty(dt, d).expect("empty");
    match dt {
        DType::Bf16 => {
            let h: Vec<bf16> = x.iter().map(|&a| bf16::from_f32(a)).collect();
            be.upload(buf.view_mut(), View::new(&h, d).expect("view")).expect("upload");
        }
        DType::F16 => {
            let h: Vec<f16> = x.iter().map(|&a| f16::from_f32(a)).collect();
            be.upload(buf.view_mut(), View::new(&h, d).expect("view")).expect("upload");
        }
        DType::F32 => be.upload(buf.view_mut(), View::new(x, d).expect("view")).expect("upload"),
    }
    buf
}

/// The elements of `buf`, converted to f32 on the device and downloaded.
fn get(be: &dyn Backend, buf: &Buffer) -> Vec<f32> {
    let d = Dims::new(buf.dims()).expect("dims");
    let mut wide = be.empty(DType::F32, d).expect("empty");
    be.copy(wide.view_mut(), buf.view()).expect("copy");
    let mut host = vec![0f32; buf.len()];
    be.download(ViewMut::new(&mut host, d).expect("view"), wide.view()).expect("download");
    host
}

/// One backward of `case` on `be`: `(got, want)` for dQ, dK, dV, `want` from the f64 reference (plus the pre-filled
/// value when accumulating).
fn run(be: &dyn Backend, case: &Case, poison: Poison) -> ([Vec<f32>; 3], [Vec<f64>; 3]) {
    let s = case.shape;
    let q_pos: Vec<i64> = (0..s.q_len as i64).map(|i| 3 * i / 2 + 5).collect();
    let k_pos: Vec<i64> = (0..s.kv_len as i64).map(|j| 3 * j / 2).collect();
    let q_doc: Vec<u32> = (0..s.q_len).map(|i| u32::from(i >= s.q_len * 2 / 5)).collect();
    let k_doc: Vec<u32> = (0..s.kv_len).map(|j| u32::from(j >= s.kv_len * 2 / 5)).collect();
    let mask = match case.mask {
        Mask::Full => AttnMask::full(),
        Mask::Causal => AttnMask::causal(),
        Mask::WindowDocs => AttnMask::full()
            .with_positions(Positions::Explicit(&q_pos), Positions::Explicit(&k_pos))
            .with_window(37)
            .with_docs(&q_doc, &k_doc),
        Mask::CausalWindow => AttnMask::causal().with_window(100),
    };
    let p = AttnParams::new(s).with_mask(mask);
    let dt = case.dtype;
    let mut q = rounded(&uniform_nonzero(s.q_elems(), 1), dt);
    let mut k = rounded(&uniform_nonzero(s.kv_elems(), 2), dt);
    let v = rounded(&uniform_nonzero(s.kv_elems(), 3), dt);
    let d_o = rounded(&uniform_nonzero(s.q_elems(), 4), dt);
    match poison {
        Poison::None => {}
        Poison::QRow(i) => q[i * s.head_dim + 7] = f32::NAN,
        Poison::KRow(j) => k[j * s.head_dim + 7] = f32::NAN,
    }
    let [o, lse, dq_ref, dk_ref, dv_ref] = reference_f64(&p, &q, &k, &v, &d_o);
    let o: Vec<f32> = rounded(&o.iter().map(|&x| x as f32).collect::<Vec<f32>>(), dt);
    let lse: Vec<f32> = lse.iter().map(|&x| x as f32).collect();

    let (qd, kd) = ([s.batch, s.q_heads, s.q_len, s.head_dim], [s.batch, s.kv_heads, s.kv_len, s.head_dim]);
    let (qb, kb, vb) = (put(be, dt, &qd, &q), put(be, dt, &kd, &k), put(be, dt, &kd, &v));
    let (ob, dob) = (put(be, dt, &qd, &o), put(be, dt, &qd, &d_o));
    let lseb = put(be, DType::F32, &[s.batch, s.q_heads, s.q_len], &lse);
    // Poisoned outputs (NaN) to overwrite, or 0.25 everywhere to add to.
    let start = if case.mode == GradMode::Accumulate { 0.25 } else { f32::NAN };
    let filled = |dims: &[usize]| {
        let mut b = be.empty(case.grads, Dims::new(dims).expect("dims")).expect("empty");
        be.fill(b.view_mut(), start).expect("fill");
        b
    };
    let (mut dq, mut dk, mut dv) = (filled(&qd), filled(&kd), filled(&kd));
    let grads = AttnGrads { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut() };
    let saved = AttnSaved { qkv: Qkv::new(qb.view(), kb.view(), vb.view()), o: ob.view(), lse: lseb.view() };
    be.attention_backward(&p.options(), grads, dob.view(), saved, case.mode).expect("attention_backward");
    let got = [get(be, &dq), get(be, &dk), get(be, &dv)];
    let add = if case.mode == GradMode::Accumulate { 0.25 } else { 0.0 };
    let want = [dq_ref, dk_ref, dv_ref].map(|w| w.into_iter().map(|x| x + add).collect::<Vec<f64>>());
    (got, want)
}

/// max |got − want| / max |want| (the f64 reference's scale), and whether every element is finite.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0f64, |m, w| m.max(w.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .fold(0f64, |m, (&g, &w)| if g.is_finite() { m.max((g as f64 - w).abs()) } else { f64::INFINITY })
        / scale
}

fn shape(batch: usize, q_heads: usize, kv_heads: usize, q_len: usize, kv_len: usize, head_dim: usize) -> AttnShape {
    AttnShape { batch, q_heads, kv_heads, q_len, kv_len, head_dim }
}

/// The cases: each dtype and head dim, every mask, GQA, ragged lengths, both modes and gradient types.
fn cases() -> Vec<Case> {
    let c = |shape, dtype, grads, mask, mode| Case { shape, dtype, grads, mask, mode };
    vec![
        c(shape(1, 2, 1, 100, 130, 64), DType::Bf16, DType::Bf16, Mask::Full, GradMode::Overwrite),
        c(shape(1, 2, 2, 70, 70, 128), DType::F16, DType::F32, Mask::Causal, GradMode::Accumulate),
        c(shape(2, 4, 2, 90, 90, 64), DType::Bf16, DType::F32, Mask::WindowDocs, GradMode::Overwrite),
        c(shape(1, 3, 1, 65, 40, 128), DType::Bf16, DType::Bf16, Mask::Causal, GradMode::Accumulate),
        c(shape(1, 2, 1, 129, 77, 64), DType::F16, DType::F16, Mask::WindowDocs, GradMode::Overwrite),
        c(shape(1, 2, 1, 300, 300, 64), DType::Bf16, DType::F32, Mask::CausalWindow, GradMode::Overwrite),
    ]
}

fn matches_reference(be: &dyn Backend) {
    for case in cases() {
        let (got, want) = run(be, &case, Poison::None);
        assert_near_reference(&case, "", &got, &want);
    }
}

/// dQ, dK and dV (`got`) against the f64 reference (`want`): relative errors within what the inputs' type keeps.
/// bf16 keeps 8 bits, f16 11: P and dS are rounded to the input type before their products, and T-typed gradients
/// once more at the end (measured on the emulator: at most 3.8e-3 and 4.7e-4).
fn assert_near_reference(case: &Case, label: &str, got: &[Vec<f32>; 3], want: &[Vec<f64>; 3]) {
    let tol = match case.dtype {
        DType::Bf16 => 1e-2,
        _ => 1.5e-3,
    };
    for (name, g, w) in [("dQ", &got[0], &want[0]), ("dK", &got[1], &want[1]), ("dV", &got[2], &want[2])] {
        let e = rel_err(g, w);
        eprintln!("{case:?}: {label}{name} relative error {e:.2e}");
        assert!(e <= tol, "{case:?}: {label}{name} relative error {e:.3e} over {tol:.0e}");
    }
}

fn deterministic(be: &dyn Backend) {
    for case in [cases()[2], cases()[3]] {
        let (a, _) = run(be, &case, Poison::None);
        let (b, _) = run(be, &case, Poison::None);
        for (x, y) in a.iter().zip(&b) {
            let same = x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "{case:?}: two runs differ");
        }
    }
}

/// A NaN in Q's row `i` (document 0, head 0) or K's row `j` (document 1): the gradients that cannot see it are
/// bit-identical to a clean run, on a case whose first tiles hold both documents (partial tiles, sanitized).
fn nan_confined(be: &dyn Backend) {
    nan_confined_dq(be, true)
}

/// As [`nan_confined`], dQ's rows that cannot see the NaN bit-identical to the clean run's (`exact`) or finite and
/// within 1e-5 of its scale (the atomic backward, whose order of additions may vary).
fn nan_confined_dq(be: &dyn Backend, exact: bool) {
    let case = Case {
        shape: shape(1, 2, 1, 100, 100, 64),
        dtype: DType::Bf16,
        grads: DType::F32,
        mask: Mask::WindowDocs,
        mode: GradMode::Overwrite,
    };
    let s = case.shape;
    let (clean, _) = run(be, &case, Poison::None);
    let d = s.head_dim;
    let (doc_q, doc_k) = (s.q_len * 2 / 5, s.kv_len * 2 / 5);
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let dq_scale = clean[0].iter().fold(0f32, |m, x| m.max(x.abs()));
    let same_dq = |a: &[f32], b: &[f32]| {
        if exact {
            same(a, b)
        } else {
            a.iter().zip(b).all(|(x, y)| x.is_finite() && (x - y).abs() <= 1e-5 * dq_scale)
        }
    };

    // Q row 10 (document 0): every other dQ row, and dK/dV of document 1's keys, as in the clean run.
    let i = 10;
    let (got, _) = run(be, &case, Poison::QRow(i));
    for h in 0..s.q_heads {
        for r in (0..s.q_len).filter(|&r| !(h == 0 && r == i)) {
            let at = (h * s.q_len + r) * d..(h * s.q_len + r + 1) * d;
            assert!(
                same_dq(&got[0][at.clone()], &clean[0][at]),
                "dQ row {r} of head {h} changed by a NaN in Q row {i}"
            );
        }
    }
    for j in doc_k..s.kv_len {
        let at = j * d..(j + 1) * d;
        assert!(same(&got[1][at.clone()], &clean[1][at.clone()]), "dK row {j} changed by a NaN in Q row {i}");
        assert!(same(&got[2][at.clone()], &clean[2][at]), "dV row {j} changed by a NaN in Q row {i}");
    }
    assert!(got[0][i * d..(i + 1) * d].iter().any(|x| x.is_nan()), "dQ row {i} should show the NaN");

    // K row 60 (document 1): dQ of document 0's queries, and dK/dV of document 0's keys, as in the clean run.
    let j = 60;
    let (got, _) = run(be, &case, Poison::KRow(j));
    for h in 0..s.q_heads {
        for r in 0..doc_q {
            let at = (h * s.q_len + r) * d..(h * s.q_len + r + 1) * d;
            assert!(
                same_dq(&got[0][at.clone()], &clean[0][at]),
                "dQ row {r} of head {h} changed by a NaN in K row {j}"
            );
        }
    }
    for r in 0..doc_k {
        let at = r * d..(r + 1) * d;
        assert!(same(&got[1][at.clone()], &clean[1][at.clone()]), "dK row {r} changed by a NaN in K row {j}");
        assert!(same(&got[2][at.clone()], &clean[2][at]), "dV row {r} changed by a NaN in K row {j}");
    }
}

/// The backend with a one-kernel backward (`attention_backward_wgmma.cu`'s fused kernel and dQ's f32 workspace, the
/// additions in any order or in turns).
fn one_kernel(be: &CudaBackend, how: WgmmaBackward) -> CudaBackend {
    be.clone().with_wgmma_backward(how)
}

/// The atomic backward against the f64 reference (the same tolerances) and the deterministic one on the same
/// device: dK and dV bit-identical (the same arithmetic in the same order), dQ within one rounding of its type of
/// the deterministic dQ's scale (its f32 sums added in another order).
fn atomic_matches_reference(be: &CudaBackend) {
    one_kernel_matches_reference(be, WgmmaBackward::Atomic)
}

/// [`atomic_matches_reference`] for the ordered backward (deterministic too, dQ's sums in another order than the
/// split backward's).
fn ordered_matches_reference(be: &CudaBackend) {
    one_kernel_matches_reference(be, WgmmaBackward::Ordered)
}

fn one_kernel_matches_reference(be: &CudaBackend, how: WgmmaBackward) {
    let ab = one_kernel(be, how);
    assert!(be.deterministic_backward() && ab.deterministic_backward() == (how == WgmmaBackward::Ordered));
    for case in cases() {
        let (got, want) = run(&ab, &case, Poison::None);
        let (det, _) = run(be, &case, Poison::None);
        assert_near_reference(&case, &format!("{how:?} "), &got, &want);
        for (name, g, d) in [("dK", &got[1], &det[1]), ("dV", &got[2], &det[2])] {
            let same = g.iter().zip(d.iter()).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{case:?}: {how:?} {name} differs from the split one");
        }
        let det_q: Vec<f64> = det[0].iter().map(|&x| x as f64).collect();
        let e = rel_err(&got[0], &det_q);
        let tol_q = match case.grads {
            DType::Bf16 => 1.0 / 128.0,
            DType::F16 => 1.0 / 1024.0,
            DType::F32 => 1e-5,
        };
        eprintln!("{case:?}: {how:?} dQ against the split one {e:.2e}");
        assert!(e <= tol_q, "{case:?}: {how:?} dQ {e:.3e} from the split one, over {tol_q:.0e}");
    }
}

/// The atomic backward's NaN confinement ([`nan_confined`], dQ compared within a tolerance).
fn atomic_nan_confined(be: &CudaBackend) {
    nan_confined_dq(&one_kernel(be, WgmmaBackward::Atomic), false)
}

/// The ordered backward: two runs bit-identical ([`deterministic`]), and the NaN confinement with dQ's rows that
/// cannot see the NaN bit-identical to a clean run's (their sums in the same order).
fn ordered_deterministic_and_confined(be: &CudaBackend) {
    let ob = one_kernel(be, WgmmaBackward::Ordered);
    deterministic(&ob);
    nan_confined_dq(&ob, true)
}

/// The emulated backend (deterministic backward, whatever the environment says), or None (saying why) without a
/// host compiler.
fn emulated(test: &str) -> Option<CudaBackend> {
    common::cuda_emulated_backend(test)
        .map(|b| b.with_attention_path(AttentionPath::Wgmma).with_deterministic_backward(true))
}

/// The GPU backend when it is an sm_90 device (the only one wgmma runs on), else None, saying why.
fn gpu(test: &str) -> Option<CudaBackend> {
    let be = common::cuda_backend(test)?.with_attention_path(AttentionPath::Wgmma).with_deterministic_backward(true);
    if !be.device_name().contains("sm_90") {
        eprintln!("{test}: skipped, wgmma needs an sm_90 device, not {}", be.device_name());
        return None;
    }
    Some(be)
}

macro_rules! on_emulator_and_gpu {
    ($($body:ident),+ $(,)?) => {
        $(
            mod $body {
                #[test]
                fn emulated() {
                    if let Some(be) = super::emulated(concat!(stringify!($body), "::emulated")) {
                        super::$body(&be);
                    }
                }

                #[test]
                fn cuda() {
                    if let Some(be) = super::gpu(concat!(stringify!($body), "::cuda")) {
                        super::$body(&be);
                    }
                }
            }
        )+
    };
}

on_emulator_and_gpu!(
    matches_reference,
    deterministic,
    nan_confined,
    atomic_matches_reference,
    atomic_nan_confined,
    ordered_matches_reference,
    ordered_deterministic_and_confined,
);
