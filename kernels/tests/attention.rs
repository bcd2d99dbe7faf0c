//! Attention forward, backward and merge against the plain f64 reference, finite differences, and edge cases.

use half::bf16;
use longctx_kernels::attention::{reference, AttnMask, AttnParams, AttnShape, Positions};
use longctx_kernels::{attention_backward, attention_forward, merge_partial_attention, DType, KernelError};
use proptest::prelude::*;

/// Deterministic pseudo-random data in (-1, 1), never exactly zero.
fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            let v = 2.0 * u - 1.0;
            if v == 0.0 {
                0.5
            } else {
                v
            }
        })
        .collect()
}

/// max |got - want| / max |want|; infinities must match exactly.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let mut num = 0f64;
    let mut den = 0f64;
    for (g, w) in got.iter().zip(want) {
        if w.is_infinite() {
            assert_eq!(*g as f64, *w, "infinite entry mismatch");
            continue;
        }
        assert!(g.is_finite(), "non-finite output {g} where reference is {w}");
        num = num.max((*g as f64 - w).abs());
        den = den.max(w.abs());
    }
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

/// Inputs in the chosen dtype, plus the exact f64 values the kernel sees.
struct Buf {
    f32s: Vec<f32>,
    bf16s: Vec<bf16>,
    f64s: Vec<f64>,
}

fn make(n: usize, seed: u64, scale: f32) -> Buf {
    let f: Vec<f32> = rand_vec(n, seed).into_iter().map(|x| x * scale).collect();
    let bf16s: Vec<bf16> = f.iter().map(|&x| bf16::from_f32(x)).collect();
    let f64s = f.iter().map(|&x| x as f64).collect();
    Buf { f32s: f, bf16s, f64s }
}

impl Buf {
    fn view(&self, dt: DType) -> longctx_kernels::HostSlice<'_> {
        match dt {
            DType::F32 => (&self.f32s).into(),
            DType::Bf16 => (&self.bf16s).into(),
        }
    }
    fn exact(&self, dt: DType) -> Vec<f64> {
        match dt {
            DType::F32 => self.f64s.clone(),
            DType::Bf16 => self.bf16s.iter().map(|x| x.to_f64()).collect(),
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
            attention_forward(&p, q.view(dt), k.view(dt), v.view(dt), (&mut o).into(), &mut lse).unwrap();
            let mut dq = vec![f32::NAN; s.q_elems()];
            let mut dk = vec![f32::NAN; s.kv_elems()];
            let mut dv = vec![f32::NAN; s.kv_elems()];
            attention_backward(
                &p,
                q.view(dt),
                k.view(dt),
                v.view(dt),
                (&o).into(),
                d_o.view(dt),
                &lse,
                (&mut dq).into(),
                (&mut dk).into(),
                (&mut dv).into(),
                false,
            )
            .unwrap();
            (o, dq, dk, dv)
        }
        DType::Bf16 => {
            let nan = bf16::from_f32(f32::NAN);
            let mut o = vec![nan; s.q_elems()];
            attention_forward(&p, q.view(dt), k.view(dt), v.view(dt), (&mut o).into(), &mut lse).unwrap();
            let mut dq = vec![nan; s.q_elems()];
            let mut dk = vec![nan; s.kv_elems()];
            let mut dv = vec![nan; s.kv_elems()];
            attention_backward(
                &p,
                q.view(dt),
                k.view(dt),
                v.view(dt),
                (&o).into(),
                d_o.view(dt),
                &lse,
                (&mut dq).into(),
                (&mut dk).into(),
                (&mut dv).into(),
                false,
            )
            .unwrap();
            let w = |x: Vec<bf16>| x.into_iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
            (w(o), w(dq), w(dk), w(dv))
        }
    };
    [rel_err(&o, &ro), rel_err(&lse, &rlse), rel_err(&dq, &rdq), rel_err(&dk, &rdk), rel_err(&dv, &rdv)]
}

fn tolerance(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-5,
        DType::Bf16 => 2e-2,
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
        let mut o = vec![f32::NAN; s.q_elems()];
        let mut lse = vec![f32::NAN; s.lse_elems()];
        attention_forward(&p, (&q).into(), (&k).into(), (&v).into(), (&mut o).into(), &mut lse).unwrap();

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
            let mut oh = vec![f32::NAN; s.q_elems()];
            let mut lh = vec![f32::NAN; s.lse_elems()];
            attention_forward(&ph, (&q).into(), (&kh[..]).into(), (&vh[..]).into(), (&mut oh).into(), &mut lh).unwrap();
            (oh, lh)
        };
        let (mut o1, mut l1) = half(0, split);
        let (o2, l2) = half(split, s.kv_len);
        merge_partial_attention(&mut o1, &mut l1, &o2, &l2).unwrap();
        let o64: Vec<f64> = o.iter().map(|&x| x as f64).collect();
        let l64: Vec<f64> = lse.iter().map(|&x| x as f64).collect();
        prop_assert!(rel_err(&o1, &o64) < 1e-5);
        prop_assert!(rel_err(&l1, &l64) < 1e-5);
    }
}
