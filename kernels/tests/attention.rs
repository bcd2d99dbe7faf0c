//! Attention forward, backward and merge through the CPU backend against the plain f64 reference, finite
//! differences, and edge cases.

mod common;

use half::bf16;
use longctx_kernels::attention::{reference, AttnMask, AttnParams, AttnShape, Positions};
use longctx_kernels::testing::{
    attention_backward, attention_f32, attention_forward, max_rel_err as rel_err, uniform_nonzero,
};
use longctx_kernels::{AttnOut, AttnPartial, Backend, CpuBackend, DType, GradMode, KernelError, View, ViewMut};
use proptest::prelude::*;

/// Inputs in the chosen dtype, plus the exact f64 values the kernel sees.
struct Buf {
    f32s: Vec<f32>,
    bf16s: Vec<bf16>,
    f64s: Vec<f64>,
}

fn make(n: usize, seed: u64, scale: f32) -> Buf {
    let f: Vec<f32> = uniform_nonzero(n, seed).into_iter().map(|x| x * scale).collect();
    let bf16s: Vec<bf16> = f.iter().map(|&x| bf16::from_f32(x)).collect();
    let f64s = f.iter().map(|&x| x as f64).collect();
    Buf { f32s: f, bf16s, f64s }
}

impl Buf {
    fn view(&self, dt: DType) -> longctx_kernels::HostSlice<'_> {
        match dt {
            DType::F32 => (&self.f32s).into(),
            DType::Bf16 => (&self.bf16s).into(),
            DType::F16 => unreachable!("this suite draws f32 and bf16"),
        }
    }
    fn exact(&self, dt: DType) -> Vec<f64> {
        match dt {
            DType::F32 => self.f64s.clone(),
            DType::Bf16 => self.bf16s.iter().map(|x| x.to_f64()).collect(),
            DType::F16 => unreachable!("this suite draws f32 and bf16"),
        }
    }
}

#[derive(Debug, Clone)]
struct Case {
    shape: AttnShape,
    causal: bool,
    window: Option<u64>,
    docs: Option<(Vec<u32>, Vec<u32>)>,
    q_pos: Vec<i64>,
    k_pos: Vec<i64>,
    explicit: bool,
    dtype: DType,
    seed: u64,
}

impl Case {
    fn params(&self) -> AttnParams<'_> {
        let mut m = AttnMask::full();
        m.causal = self.causal;
        m.window = self.window;
        if self.explicit {
            m = m.with_positions(Positions::Explicit(&self.q_pos), Positions::Explicit(&self.k_pos));
        } else {
            m = m.with_positions(Positions::Offset(self.q_pos[0]), Positions::Offset(self.k_pos[0]));
        }
        if let Some((qd, kd)) = &self.docs {
            m = m.with_docs(qd, kd);
        }
        AttnParams::new(self.shape).with_mask(m)
    }
}

fn case_strategy(max_len: usize, max_d: usize) -> impl Strategy<Value = Case> {
    (
        (1usize..=2, 1usize..=2, 1usize..=3, 1usize..=max_len, 1usize..=max_len, 4usize..=max_d / 8),
        (any::<bool>(), prop::option::of(1u64..80), any::<bool>(), any::<bool>(), 0i64..100, any::<bool>()),
        any::<u64>(),
    )
        .prop_map(|((b, hkv, g, sq, sk, d8), (causal, window, docs, explicit, shift, bf), seed)| {
            let shape =
                AttnShape { batch: b, q_heads: hkv * g, kv_heads: hkv, q_len: sq, kv_len: sk, head_dim: d8 * 8 };
            // Queries at the end of the key range (as in decoding / a later CP block), optionally zigzag-like
            // explicit positions: two separate runs.
            let k_pos: Vec<i64> = (0..sk as i64).collect();
            let q_start = (sk as i64 - sq as i64).max(0) + shift % 7;
            let q_pos: Vec<i64> = if explicit && sq >= 2 {
                let half = sq / 2;
                (0..half as i64).map(|i| i + shift % 5).chain((0..(sq - half) as i64).map(|i| q_start + i)).collect()
            } else {
                (0..sq as i64).map(|i| q_start + i).collect()
            };
            let docs = docs.then(|| {
                let qd = q_pos.iter().map(|p| (p / 37) as u32).collect();
                let kd = k_pos.iter().map(|p| (p / 37) as u32).collect();
                (qd, kd)
            });
            Case {
                shape,
                causal,
                window,
                docs,
                q_pos,
                k_pos,
                explicit,
                dtype: if bf { DType::Bf16 } else { DType::F32 },
                seed,
            }
        })
}

/// Runs forward and backward of the kernel and the reference on `case`; returns the five relative errors.
fn check_case(case: &Case) -> [f64; 5] {
    let cpu = CpuBackend::new();
    let p = case.params();
    let s = case.shape;
    let dt = case.dtype;
    let q = make(s.q_elems(), case.seed, 1.0);
    let k = make(s.kv_elems(), case.seed ^ 1, 1.0);
    let v = make(s.kv_elems(), case.seed ^ 2, 1.0);
    let d_o = make(s.q_elems(), case.seed ^ 3, 1.0);
    let (ro, rlse) = reference::forward(&p, &q.exact(dt), &k.exact(dt), &v.exact(dt));
    let (rdq, rdk, rdv) = reference::backward(&p, &q.exact(dt), &k.exact(dt), &v.exact(dt), &d_o.exact(dt));

    // Outputs poisoned so an unwritten element fails.
    let mut lse = vec![f32::NAN; s.lse_elems()];
    let (o, dq, dk, dv): (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) = match dt {
        DType::F32 => {
            let mut o = vec![f32::NAN; s.q_elems()];
            attention_forward(&cpu, &p, (&mut o).into(), &mut lse, q.view(dt), k.view(dt), v.view(dt)).unwrap();
            let mut dq = vec![f32::NAN; s.q_elems()];
            let mut dk = vec![f32::NAN; s.kv_elems()];
            let mut dv = vec![f32::NAN; s.kv_elems()];
            attention_backward(
                &cpu,
                &p,
                (&mut dq).into(),
                (&mut dk).into(),
                (&mut dv).into(),
                d_o.view(dt),
                q.view(dt),
                k.view(dt),
                v.view(dt),
                (&o).into(),
                &lse,
                GradMode::Overwrite,
            )
            .unwrap();
            (o, dq, dk, dv)
        }
        DType::Bf16 => {
            let nan = bf16::from_f32(f32::NAN);
            let mut o = vec![nan; s.q_elems()];
            attention_forward(&cpu, &p, (&mut o).into(), &mut lse, q.view(dt), k.view(dt), v.view(dt)).unwrap();
            let mut dq = vec![nan; s.q_elems()];
            let mut dk = vec![nan; s.kv_elems()];
            let mut dv = vec![nan; s.kv_elems()];
            attention_backward(
                &cpu,
                &p,
                (&mut dq).into(),
                (&mut dk).into(),
                (&mut dv).into(),
                d_o.view(dt),
                q.view(dt),
                k.view(dt),
                v.view(dt),
                (&o).into(),
                &lse,
                GradMode::Overwrite,
            )
            .unwrap();
            let w = |x: Vec<bf16>| x.into_iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
            (w(o), w(dq), w(dk), w(dv))
        }
        DType::F16 => unreachable!("this suite draws f32 and bf16"),
    };
    [rel_err(&o, &ro), rel_err(&lse, &rlse), rel_err(&dq, &rdq), rel_err(&dk, &rdk), rel_err(&dv, &rdv)]
}

fn tolerance(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-5,
        DType::Bf16 => 2e-2,
        DType::F16 => 3e-3,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Forward O and LSE and all three gradients match the f64 reference.
    #[test]
    fn matches_reference(case in case_strategy(150, 128)) {
        let errs = check_case(&case);
        for (name, e) in ["O", "LSE", "dQ", "dK", "dV"].iter().zip(errs) {
            prop_assert!(e < tolerance(case.dtype), "{name}: relative error {e:e} for {case:?}");
        }
    }

    /// Attention over keys [K1; K2] equals the merge of the two halves, for random split points.
    #[test]
    fn merge_of_halves_is_exact(case in case_strategy(120, 64), split_frac in 0.0f64..1.0) {
        let s = case.shape;
        if s.kv_len < 2 { return Ok(()); }
        let split = ((s.kv_len as f64 * split_frac) as usize).clamp(1, s.kv_len - 1);
        let q = make(s.q_elems(), case.seed, 1.0).f32s;
        let k = make(s.kv_elems(), case.seed ^ 1, 1.0).f32s;
        let v = make(s.kv_elems(), case.seed ^ 2, 1.0).f32s;
        let p = case.params();
        let cpu = CpuBackend::new();
        let (o, lse) = fwd_f32(&p, &q, &k, &v);

        // Each half: the key rows of [.., split) and [split, ..) with their own positions and docs.
        let half = |lo: usize, hi: usize| {
            let sh = AttnShape { kv_len: hi - lo, ..s };
            let d = s.head_dim;
            let mut kh = Vec::new();
            let mut vh = Vec::new();
            for bh in 0..s.batch * s.kv_heads {
                kh.extend_from_slice(&k[(bh * s.kv_len + lo) * d..(bh * s.kv_len + hi) * d]);
                vh.extend_from_slice(&v[(bh * s.kv_len + lo) * d..(bh * s.kv_len + hi) * d]);
            }
            let k_pos: Vec<i64> = case.k_pos[lo..hi].to_vec();
            let k_doc: Option<Vec<u32>> = case.docs.as_ref().map(|(_, kd)| kd[lo..hi].to_vec());
            let mut m = p.mask;
            m.k_pos = Positions::Explicit(&k_pos);
            m.k_doc = k_doc.as_deref();
            let ph = AttnParams { shape: sh, mask: m, scale: p.scale };
            fwd_f32(&ph, &q, &kh, &vh)
        };
        let (mut o1, mut l1) = half(0, split);
        let (o2, l2) = half(split, s.kv_len);
        let acc = AttnOut {
            o: ViewMut::new(&mut o1, s.q_dims()).unwrap(),
            lse: ViewMut::new(&mut l1, s.lse_dims()).unwrap(),
        };
        let part = AttnPartial { o: View::new(&o2, s.q_dims()).unwrap(), lse: View::new(&l2, s.lse_dims()).unwrap() };
        cpu.attention_merge(acc, part).unwrap();
        let o64: Vec<f64> = o.iter().map(|&x| x as f64).collect();
        let l64: Vec<f64> = lse.iter().map(|&x| x as f64).collect();
        prop_assert!(rel_err(&o1, &o64) < 1e-5);
        prop_assert!(rel_err(&l1, &l64) < 1e-5);
    }
}

/// The forward through the CPU backend on `f32` slices, outputs poisoned with NaN first.
fn fwd_f32(p: &AttnParams<'_>, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let s = p.shape;
    let mut o = vec![f32::NAN; s.q_elems()];
    let mut lse = vec![f32::NAN; s.lse_elems()];
    attention_forward(&CpuBackend::new(), p, (&mut o).into(), &mut lse, q.into(), k.into(), v.into()).unwrap();
    (o, lse)
}

/// Gradients of the kernel match central finite differences of the loss `Σ O ∘ dO`, computed in f64 on the
/// reference forward (an independent check of the analytic reference too) and in f32 on the kernel itself.
#[test]
fn gradients_match_finite_differences() {
    let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: 9, kv_len: 11, head_dim: 32 };
    let qd: Vec<u32> = (0..9).map(|i| (i / 5) as u32).collect();
    let kd: Vec<u32> = (0..11).map(|i| (i / 6) as u32).collect();
    let mask = AttnMask::causal()
        .with_positions(Positions::Offset(2), Positions::Offset(0))
        .with_window(7)
        .with_docs(&qd, &kd);
    let p = AttnParams::new(shape).with_mask(mask);
    let q = uniform_nonzero(shape.q_elems(), 11);
    let k = uniform_nonzero(shape.kv_elems(), 12);
    let v = uniform_nonzero(shape.kv_elems(), 13);
    let d_o = uniform_nonzero(shape.q_elems(), 14);
    let [_, _, dq, dk, dv] = attention_f32(&p, &q, &k, &v, &d_o).unwrap();
    let to64 = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
    let loss64 = |q: &[f64], k: &[f64], v: &[f64]| {
        let (o, _) = reference::forward(&p, q, k, v);
        o.iter().zip(&d_o).map(|(a, b)| a * *b as f64).sum::<f64>()
    };
    let loss32 = |q: &[f32], k: &[f32], v: &[f32]| {
        let (o, _) = fwd_f32(&p, q, k, v);
        o.iter().zip(&d_o).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
    };
    let (q64, k64, v64) = (to64(&q), to64(&k), to64(&v));
    for (which, grad) in [(0usize, &dq), (1, &dk), (2, &dv)] {
        let mut fd64 = Vec::new();
        let mut fd32 = Vec::new();
        for idx in (0..grad.len()).step_by(7) {
            let (h64, h32) = (1e-5, 1e-2f32);
            let mut a = [q64.clone(), k64.clone(), v64.clone()];
            a[which][idx] += h64;
            let up = loss64(&a[0], &a[1], &a[2]);
            a[which][idx] -= 2.0 * h64;
            let dn = loss64(&a[0], &a[1], &a[2]);
            fd64.push((up - dn) / (2.0 * h64));
            let mut b = [q.clone(), k.clone(), v.clone()];
            b[which][idx] += h32;
            let up = loss32(&b[0], &b[1], &b[2]);
            b[which][idx] -= 2.0 * h32;
            let dn = loss32(&b[0], &b[1], &b[2]);
            fd32.push((up - dn) / (2.0 * h32 as f64));
        }
        let got: Vec<f32> = grad.iter().step_by(7).copied().collect();
        let e64 = rel_err(&got, &fd64);
        let e32 = rel_err(&got, &fd32);
        assert!(e64 < 1e-4, "gradient {which}: f64 finite differences differ by {e64:e}");
        assert!(e32 < 2e-3, "gradient {which}: f32 finite differences differ by {e32:e}");
    }
}

/// Sq = 1, Sk = 1, rows that see no key, and a window smaller than a tile.
#[test]
fn edge_cases() {
    let d = 64;
    // Sq = 1 (decoding) and Sk = 1.
    for (sq, sk) in [(1, 200), (200, 1), (1, 1)] {
        let shape = AttnShape { batch: 1, q_heads: 4, kv_heads: 2, q_len: sq, kv_len: sk, head_dim: d };
        for causal in [false, true] {
            let case = Case {
                shape,
                causal,
                window: None,
                docs: None,
                q_pos: (0..sq as i64).map(|i| sk as i64 - 1 + i).collect(),
                k_pos: (0..sk as i64).collect(),
                explicit: false,
                dtype: DType::F32,
                seed: 5,
            };
            let errs = check_case(&case);
            assert!(errs.iter().all(|e| *e < 1e-5), "Sq={sq} Sk={sk} causal={causal}: {errs:?}");
        }
    }
    // Fully masked rows: queries before every key (causal) and queries of a document with no keys.
    let shape = AttnShape { batch: 1, q_heads: 1, kv_heads: 1, q_len: 70, kv_len: 70, head_dim: 32 };
    let q = uniform_nonzero(shape.q_elems(), 1);
    let k = uniform_nonzero(shape.kv_elems(), 2);
    let v = uniform_nonzero(shape.kv_elems(), 3);
    let d_o = uniform_nonzero(shape.q_elems(), 4);
    let mask = AttnMask::causal().with_positions(Positions::Offset(0), Positions::Offset(35));
    let p = AttnParams::new(shape).with_mask(mask);
    let (o, lse) = fwd_f32(&p, &q, &k, &v);
    for i in 0..35 {
        assert_eq!(lse[i], f32::NEG_INFINITY);
        assert!(o[i * 32..(i + 1) * 32].iter().all(|&x| x == 0.0));
    }
    assert!(lse[35..].iter().all(|x| x.is_finite()));
    let [_, _, dq, dk, dv] = attention_f32(&p, &q, &k, &v, &d_o).unwrap();
    assert!(dq[..35 * 32].iter().all(|&x| x == 0.0));
    assert!(dq.iter().chain(&dk).chain(&dv).all(|x| x.is_finite()));
    let qd = vec![7u32; 70];
    let kd: Vec<u32> = (0..70).map(|i| i as u32 % 3).collect();
    let p = AttnParams::new(shape).with_mask(AttnMask::full().with_docs(&qd, &kd));
    let (o, lse) = fwd_f32(&p, &q, &k, &v);
    assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY));
    assert!(o.iter().all(|&x| x == 0.0));
    // A window smaller than a tile, crossing tile borders, causal and not, long enough for many tiles.
    for (w, causal) in [(5u64, true), (3, false), (64, true), (65, false)] {
        let case = Case {
            shape: AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: 300, kv_len: 300, head_dim: 40 },
            causal,
            window: Some(w),
            docs: None,
            q_pos: (0..300).collect(),
            k_pos: (0..300).collect(),
            explicit: false,
            dtype: DType::F32,
            seed: w,
        };
        let errs = check_case(&case);
        assert!(errs.iter().all(|e| *e < 1e-5), "window {w} causal {causal}: {errs:?}");
    }
}

/// Head dims at the ends of the range, and a long causal case spanning many tiles in bf16.
#[test]
fn head_dims_and_long_sequences() {
    for d in [32, 136, 256] {
        let case = Case {
            shape: AttnShape { batch: 1, q_heads: 2, kv_heads: 2, q_len: 70, kv_len: 130, head_dim: d },
            causal: true,
            window: None,
            docs: None,
            q_pos: (60..130).collect(),
            k_pos: (0..130).collect(),
            explicit: true,
            dtype: DType::F32,
            seed: d as u64,
        };
        let errs = check_case(&case);
        assert!(errs.iter().all(|e| *e < 1e-5), "D={d}: {errs:?}");
    }
    let case = Case {
        shape: AttnShape { batch: 1, q_heads: 4, kv_heads: 1, q_len: 400, kv_len: 400, head_dim: 64 },
        causal: true,
        window: None,
        docs: None,
        q_pos: (0..400).collect(),
        k_pos: (0..400).collect(),
        explicit: false,
        dtype: DType::Bf16,
        seed: 99,
    };
    let errs = check_case(&case);
    assert!(errs.iter().all(|e| *e < 2e-2), "bf16 long: {errs:?}");
}

/// Same inputs, bit-identical outputs with 1 and 3 threads.
#[test]
fn deterministic_across_thread_counts() {
    let shape = AttnShape { batch: 2, q_heads: 4, kv_heads: 2, q_len: 333, kv_len: 333, head_dim: 64 };
    let p = AttnParams::new(shape).with_mask(AttnMask::causal());
    let q = uniform_nonzero(shape.q_elems(), 1);
    let k = uniform_nonzero(shape.kv_elems(), 2);
    let v = uniform_nonzero(shape.kv_elems(), 3);
    let d_o = uniform_nonzero(shape.q_elems(), 4);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            attention_f32(&p, &q, &k, &v, &d_o).unwrap().map(|x| x.iter().map(|f| f.to_bits()).collect::<Vec<u32>>())
        })
    };
    assert_eq!(run(1), run(3));
}

/// With `GradMode::Accumulate`, gradients are added to the buffers' contents.
#[test]
fn backward_accumulates() {
    let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: 50, kv_len: 80, head_dim: 32 };
    let p = AttnParams::new(shape)
        .with_mask(AttnMask::causal().with_positions(Positions::Offset(30), Positions::Offset(0)));
    let q = uniform_nonzero(shape.q_elems(), 1);
    let k = uniform_nonzero(shape.kv_elems(), 2);
    let v = uniform_nonzero(shape.kv_elems(), 3);
    let d_o = uniform_nonzero(shape.q_elems(), 4);
    let [o, lse, dq, dk, dv] = attention_f32(&p, &q, &k, &v, &d_o).unwrap();
    let base = [
        uniform_nonzero(shape.q_elems(), 5),
        uniform_nonzero(shape.kv_elems(), 6),
        uniform_nonzero(shape.kv_elems(), 7),
    ];
    let [mut aq, mut ak, mut av] = base.clone();
    attention_backward(
        &CpuBackend::new(),
        &p,
        (&mut aq).into(),
        (&mut ak).into(),
        (&mut av).into(),
        (&d_o).into(),
        (&q).into(),
        (&k).into(),
        (&v).into(),
        (&o).into(),
        &lse,
        GradMode::Accumulate,
    )
    .unwrap();
    for (acc, (b, g)) in [aq, ak, av].iter().zip(base.iter().zip([dq, dk, dv])) {
        for i in 0..acc.len() {
            assert!((acc[i] - (b[i] + g[i])).abs() <= 1e-6 * (1.0 + b[i].abs() + g[i].abs()));
        }
    }
}

/// Bad input is a typed error, never a panic.
#[test]
fn bad_input_is_a_typed_error() {
    let cpu = CpuBackend::new();
    let good = AttnShape { batch: 1, q_heads: 4, kv_heads: 2, q_len: 8, kv_len: 8, head_dim: 32 };
    // Buffers sized for `p.shape`, so that the views carry the shape and the backend checks its rules.
    let run = |p: &AttnParams<'_>| {
        let s = p.shape;
        let (q, kv) = (vec![0.5f32; s.q_elems()], vec![0.5f32; s.kv_elems()]);
        let (mut o, mut lse) = (vec![0f32; s.q_elems()], vec![0f32; s.lse_elems()]);
        attention_forward(&cpu, p, (&mut o).into(), &mut lse, (&q).into(), (&kv).into(), (&kv).into())
    };
    let e = run(&AttnParams::new(AttnShape { q_heads: 3, ..good }));
    assert!(matches!(e, Err(KernelError::HeadsNotDivisible { q_heads: 3, kv_heads: 2 })), "{e:?}");
    let e = run(&AttnParams::new(AttnShape { head_dim: 36, ..good }));
    assert!(matches!(e, Err(KernelError::HeadDim(36))), "{e:?}");
    let e = run(&AttnParams::new(AttnShape { head_dim: 264, ..good }));
    assert!(matches!(e, Err(KernelError::HeadDim(264))), "{e:?}");
    // K one element short. A view cannot have dims its length does not fill, so the constructor refuses it (a
    // Shape error); the slice wrapper of `testing` checks each length against the shape first and names it.
    let (q, kv) = (vec![0.5f32; good.q_elems()], vec![0.5f32; good.kv_elems()]);
    assert!(matches!(View::new(&kv[1..], good.kv_dims()), Err(KernelError::Shape(_))));
    let (mut o, mut lse) = (vec![0f32; good.q_elems()], vec![0f32; good.lse_elems()]);
    let p = AttnParams::new(good);
    let e = attention_forward(&cpu, &p, (&mut o).into(), &mut lse, (&q).into(), (&kv[1..]).into(), (&kv).into());
    assert!(matches!(e, Err(KernelError::BufferLength { name: "k", .. })), "{e:?}");
    let e = run(&AttnParams::new(AttnShape { kv_len: 0, ..good }));
    assert!(matches!(e, Err(KernelError::ZeroDim("kv_len"))), "{e:?}");
    let e = run(&AttnParams::new(good).with_scale(f32::NAN));
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "scale", .. })), "{e:?}");
    let pos = [0i64; 3];
    let e = run(&AttnParams::new(good)
        .with_mask(AttnMask::causal().with_positions(Positions::Explicit(&pos), Positions::Offset(0))));
    assert!(matches!(e, Err(KernelError::BufferLength { name: "q_pos", .. })), "{e:?}");
    let e = run(&AttnParams::new(good).with_mask(AttnMask::full().with_window(0)));
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "window", .. })), "{e:?}");
    let mut m = AttnMask::full();
    let docs = [0u32; 8];
    m.q_doc = Some(&docs);
    let e = run(&AttnParams::new(good).with_mask(m));
    assert!(matches!(e, Err(KernelError::InvalidArgument { .. })), "{e:?}");
    // Merge with mismatched sizes. The slice kernel's `BufferLength { name: "o2" }` cannot be reached through
    // views: the backend compares the partial's dims with the accumulator's first and names the argument.
    let (mut o1, mut l1) = (vec![0f32; 8], vec![0f32; 2]);
    let (o2, l2) = ([0f32; 6], [0f32; 2]);
    let acc =
        AttnOut { o: ViewMut::new(&mut o1, [1, 1, 2, 4]).unwrap(), lse: ViewMut::new(&mut l1, [1, 1, 2]).unwrap() };
    let part = AttnPartial { o: View::new(&o2, [1, 1, 2, 3]).unwrap(), lse: View::new(&l2, [1, 1, 2]).unwrap() };
    let e = cpu.attention_merge(acc, part);
    assert!(matches!(&e, Err(KernelError::Shape(m)) if m.contains("`part.o`")), "{e:?}");
}

/// The merge is stable for huge and -inf LSEs.
#[test]
fn merge_extreme_lse() {
    let mut o1 = vec![1.0f32, 2.0, 0.0, 0.0, 5.0, 5.0];
    let mut l1 = vec![1e30f32, f32::NEG_INFINITY, 80.0];
    let o2 = vec![3.0f32, 4.0, 7.0, 8.0, 1.0, 1.0];
    let l2 = vec![1e30f32, 3.0, f32::NEG_INFINITY];
    common::merge_f32(&mut o1, &mut l1, &o2, &l2).unwrap();
    assert_eq!(&o1[..2], &[2.0, 3.0]);
    assert_eq!(l1[0], 1e30 + std::f32::consts::LN_2);
    assert_eq!(&o1[2..4], &[7.0, 8.0]);
    assert_eq!(l1[1], 3.0);
    assert_eq!(&o1[4..], &[5.0, 5.0]);
    assert_eq!(l1[2], 80.0);
    let mut o = vec![0f32; 2];
    let mut l = vec![f32::NEG_INFINITY];
    common::merge_f32(&mut o, &mut l, &[0.0, 0.0], &[f32::NEG_INFINITY]).unwrap();
    assert_eq!(l[0], f32::NEG_INFINITY);
    assert_eq!(o, vec![0.0, 0.0]);
}
