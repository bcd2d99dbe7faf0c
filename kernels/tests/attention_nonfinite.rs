//! Masked pairs contribute nothing, even non-finite ones: a NaN or infinity placed in `Q`, `K`, `V` or `dO`
//! leaves every output row, LSE entry and gradient row that cannot see it bit-identical to a clean run, on
//! every SIMD path this CPU has (a CPU backend per path); the rows that see a NaN get a NaN.

mod common;

use half::bf16;
use longctx_kernels::attention::{AttnMask, AttnParams, AttnShape, Positions};
use longctx_kernels::cpu::SimdPath;
use longctx_kernels::testing::{attention_backward, attention_forward, uniform_nonzero};
use longctx_kernels::{GradMode, HostSlice, HostSliceMut};
use proptest::prelude::*;

/// Which input holds the non-finite value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Input {
    Q,
    K,
    V,
    DO,
}

/// Forward then backward on `simd`, in `f32` or `bf16` (inputs rounded to it, outputs in it), from `f32` inputs
/// `[q, k, v, d_o]`: the bit patterns of `[O, LSE, dQ, dK, dV]`.
fn view(x: &[bf16]) -> HostSlice<'_> {
    HostSlice::from(x)
}

fn run_bits(simd: SimdPath, p: &AttnParams<'_>, bf: bool, inputs: &[Vec<f32>; 4]) -> [Vec<u32>; 5] {
    let s = p.shape;
    let mut lse = vec![f32::NAN; s.lse_elems()];
    if !bf {
        let [q, k, v, d_o] = inputs;
        let [o, lse, dq, dk, dv] = common::attention_f32_on(simd, p, q, k, v, d_o);
        let bits = |x: Vec<f32>| x.into_iter().map(f32::to_bits).collect();
        return [bits(o), bits(lse), bits(dq), bits(dk), bits(dv)];
    }
    let [q, k, v, d_o] = inputs.clone().map(|x| x.into_iter().map(bf16::from_f32).collect::<Vec<bf16>>());
    let nan = bf16::from_f32(f32::NAN);
    let cpu = common::cpu_on(simd);
    let mut o = vec![nan; s.q_elems()];
    attention_forward(&cpu, p, HostSliceMut::from(&mut o[..]), &mut lse, view(&q), view(&k), view(&v)).unwrap();
    let (mut dq, mut dk, mut dv) = (vec![nan; s.q_elems()], vec![nan; s.kv_elems()], vec![nan; s.kv_elems()]);
    attention_backward(
        &cpu,
        p,
        HostSliceMut::from(&mut dq[..]),
        HostSliceMut::from(&mut dk[..]),
        HostSliceMut::from(&mut dv[..]),
        view(&d_o),
        view(&q),
        view(&k),
        view(&v),
        view(&o),
        &lse,
        GradMode::Overwrite,
    )
    .unwrap();
    let bits = |x: Vec<bf16>| x.into_iter().map(|v| v.to_bits() as u32).collect();
    [bits(o), lse.into_iter().map(f32::to_bits).collect(), bits(dq), bits(dk), bits(dv)]
}

/// Rows of `[B, H, S]` a poisoned input can reach: query rows (`O`, `LSE`, `dQ`) and key rows (`dK`, `dV`),
/// each `[B·H·S]`.
struct Reach {
    q: Vec<bool>,
    k: Vec<bool>,
}

/// What a non-finite value at row `row` of head `bh` of `which` can reach. A query row (`Q`, `dO`) reaches
/// itself and, through `dK`/`dV`, the keys it sees. A key row (`K`, `V`) reaches the query rows that see it and,
/// through their probabilities, every key those rows see (and itself).
fn reach(p: &AttnParams<'_>, which: Input, bh: usize, row: usize) -> Reach {
    let s = p.shape;
    let g = s.group();
    let mut r = Reach { q: vec![false; s.lse_elems()], k: vec![false; s.batch * s.kv_heads * s.kv_len] };
    let vis = |i: usize, j: usize| p.mask.visible(i, j);
    match which {
        Input::Q | Input::DO => {
            let (b, hq) = (bh / s.q_heads, bh % s.q_heads);
            r.q[bh * s.q_len + row] = true;
            let bhk = b * s.kv_heads + hq / g;
            for j in (0..s.kv_len).filter(|&j| vis(row, j)) {
                r.k[bhk * s.kv_len + j] = true;
            }
        }
        Input::K | Input::V => {
            let (b, hk) = (bh / s.kv_heads, bh % s.kv_heads);
            r.k[bh * s.kv_len + row] = true;
            for i in (0..s.q_len).filter(|&i| vis(i, row)) {
                for hq in hk * g..(hk + 1) * g {
                    r.q[(b * s.q_heads + hq) * s.q_len + i] = true;
                }
                for j in (0..s.kv_len).filter(|&j| vis(i, j)) {
                    r.k[bh * s.kv_len + j] = true;
                }
            }
        }
    }
    r
}

#[derive(Debug, Clone)]
struct Case {
    shape: AttnShape,
    causal: bool,
    window: Option<u64>,
    /// Document boundaries in positions (a document starts at each); `None`: no document ids.
    cuts: Option<Vec<i64>>,
    /// First query position (keys start at 0); with `explicit`, the queries are two runs of positions.
    q_start: i64,
    explicit: bool,
    bf: bool,
    which: Input,
    /// Where the value goes, as a fraction of the buffer.
    at: f64,
    value: f32,
    seed: u64,
}

impl Case {
    fn q_pos(&self) -> Vec<i64> {
        let sq = self.shape.q_len;
        if self.explicit && sq >= 2 {
            let half = sq / 2;
            (0..half as i64)
                .map(|i| i + self.q_start / 3)
                .chain((0..(sq - half) as i64).map(|i| self.q_start + i))
                .collect()
        } else {
            (0..sq as i64).map(|i| self.q_start + i).collect()
        }
    }
}

fn doc_of(cuts: &[i64], pos: i64) -> u32 {
    cuts.iter().filter(|&&c| c <= pos).count() as u32
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        (1usize..=2, 1usize..=2, 1usize..=2, 1usize..=300, 1usize..=300, 0usize..=12),
        (any::<bool>(), prop::option::of(1u64..200), prop::option::of(prop::collection::vec(1i64..400, 0..5))),
        (0i64..150, any::<bool>(), any::<bool>()),
        (prop_oneof![Just(Input::Q), Just(Input::K), Just(Input::V), Just(Input::DO)], 0.0f64..1.0),
        (prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)], any::<u64>()),
    )
        .prop_map(
            |((b, hkv, g, sq, sk, d8), (causal, window, cuts), (q_start, explicit, bf), (which, at), (value, seed))| {
                Case {
                    shape: AttnShape {
                        batch: b,
                        q_heads: hkv * g,
                        kv_heads: hkv,
                        q_len: sq,
                        kv_len: sk,
                        head_dim: 32 + 8 * d8,
                    },
                    causal,
                    window,
                    cuts,
                    q_start,
                    explicit,
                    bf,
                    which,
                    at,
                    value,
                    seed,
                }
            },
        )
}

/// Runs `case` clean and poisoned on every supported path; checks that every row out of the poison's reach is
/// bit-identical, and that a NaN reaches what sees it.
fn check(case: &Case) -> Result<(), TestCaseError> {
    let s = case.shape;
    let d = s.head_dim;
    let q_pos = case.q_pos();
    let q_doc: Vec<u32> = case.cuts.as_ref().map_or(Vec::new(), |c| q_pos.iter().map(|&p| doc_of(c, p)).collect());
    let k_doc: Vec<u32> =
        case.cuts.as_ref().map_or(Vec::new(), |c| (0..s.kv_len as i64).map(|p| doc_of(c, p)).collect());
    let mut mask = AttnMask::full();
    mask.causal = case.causal;
    mask.window = case.window;
    mask = if case.explicit {
        mask.with_positions(Positions::Explicit(&q_pos), Positions::Offset(0))
    } else {
        mask.with_positions(Positions::Offset(case.q_start), Positions::Offset(0))
    };
    if case.cuts.is_some() {
        mask = mask.with_docs(&q_doc, &k_doc);
    }
    let p = AttnParams::new(s).with_mask(mask);
    let clean = [
        uniform_nonzero(s.q_elems(), case.seed),
        uniform_nonzero(s.kv_elems(), case.seed ^ 1),
        uniform_nonzero(s.kv_elems(), case.seed ^ 2),
        uniform_nonzero(s.q_elems(), case.seed ^ 3),
    ];
    let slot = match case.which {
        Input::Q => 0,
        Input::K => 1,
        Input::V => 2,
        Input::DO => 3,
    };
    let mut dirty = clean.clone();
    let idx = ((case.at * dirty[slot].len() as f64) as usize).min(dirty[slot].len() - 1);
    dirty[slot][idx] = case.value;
    let len = if slot == 1 || slot == 2 { s.kv_len } else { s.q_len };
    let (bh, row) = (idx / d / len, idx / d % len);
    let r = reach(&p, case.which, bh, row);
    for simd in SimdPath::supported() {
        let want = run_bits(simd, &p, case.bf, &clean);
        let got = run_bits(simd, &p, case.bf, &dirty);
        for (t, name) in ["O", "LSE", "dQ", "dK", "dV"].iter().enumerate() {
            let (reached, width) = match t {
                0 | 2 => (&r.q, d),
                1 => (&r.q, 1),
                _ => (&r.k, d),
            };
            for (x, &hit) in reached.iter().enumerate().filter(|(_, &hit)| !hit) {
                let _ = hit;
                prop_assert_eq!(
                    &got[t][x * width..(x + 1) * width],
                    &want[t][x * width..(x + 1) * width],
                    "{:?}: {} row {} (head·len + row) changed by {} at {:?} row {} of head {}",
                    simd,
                    name,
                    x,
                    case.value,
                    case.which,
                    row,
                    bh
                );
            }
        }
        // A NaN reaches what sees it: the O rows that see a poisoned Q, K or V row, the dQ row of a poisoned dO.
        if case.value.is_nan() {
            let is_nan = |bits: &[u32]| {
                bits.iter()
                    .any(|&b| if case.bf { bf16::from_bits(b as u16).is_nan() } else { f32::from_bits(b).is_nan() })
            };
            let (t, rows): (usize, Vec<usize>) = match case.which {
                Input::Q | Input::DO => {
                    let sees = (0..s.kv_len).any(|j| p.mask.visible(row, j));
                    (if case.which == Input::Q { 0 } else { 2 }, if sees { vec![bh * s.q_len + row] } else { vec![] })
                }
                Input::K | Input::V => (0, (0..s.lse_elems()).filter(|&x| r.q[x]).collect()),
            };
            for x in rows {
                prop_assert!(is_nan(&got[t][x * d..(x + 1) * d]), "{:?}: row {} does not show the NaN", simd, x);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn nonfinite_inputs_stay_where_the_mask_lets_them(case in case_strategy()) {
        check(&case)?;
    }
}

/// The reported forward case: documents [0, 100) and [100, 128), a NaN in V at position 50. Rows of the second
/// document are bit-identical to a clean run; every row of the first sees the NaN.
#[test]
fn nan_in_one_document_stays_there() {
    let shape = AttnShape { batch: 1, q_heads: 1, kv_heads: 1, q_len: 128, kv_len: 128, head_dim: 64 };
    let docs: Vec<u32> = (0..128).map(|i| u32::from(i >= 100)).collect();
    let p = AttnParams::new(shape).with_mask(AttnMask::full().with_docs(&docs, &docs));
    let d = shape.head_dim;
    let clean = [1, 2, 3, 4].map(|seed| uniform_nonzero(shape.q_elems(), seed));
    for value in [f32::NAN, f32::INFINITY] {
        let mut dirty = clean.clone();
        dirty[2][50 * d + 7] = value;
        for simd in SimdPath::supported() {
            let [want, dirty_out] = [&clean, &dirty].map(|x| run_bits(simd, &p, false, x));
            for t in [0, 2, 3, 4] {
                assert_eq!(dirty_out[t][100 * d..], want[t][100 * d..], "{simd:?} {value}: output {t}, rows 100..128");
            }
            assert_eq!(dirty_out[1][100..], want[1][100..], "{simd:?} {value}: LSE rows 100..128");
            for i in 0..100 {
                let row = &dirty_out[0][i * d..(i + 1) * d];
                assert!(row.iter().any(|&b| !f32::from_bits(b).is_finite()), "{simd:?} {value}: O row {i} is finite");
            }
        }
    }
}

/// The reported backward case: causal, a NaN in Q row 77. dK (and dV) of keys 78..128, which row 77 never sees,
/// are bit-identical to a clean run; dK of the keys it sees is NaN.
#[test]
fn nan_query_row_leaves_later_keys_alone() {
    let shape = AttnShape { batch: 1, q_heads: 1, kv_heads: 1, q_len: 128, kv_len: 128, head_dim: 64 };
    let p = AttnParams::new(shape).with_mask(AttnMask::causal());
    let d = shape.head_dim;
    let clean = [1, 2, 3, 4].map(|seed| uniform_nonzero(shape.q_elems(), seed));
    for value in [f32::NAN, f32::INFINITY] {
        let mut dirty = clean.clone();
        dirty[0][77 * d + 3] = value;
        for simd in SimdPath::supported() {
            let [want, got] = [&clean, &dirty].map(|x| run_bits(simd, &p, false, x));
            assert_eq!(got[3][78 * d..], want[3][78 * d..], "{simd:?} {value}: dK rows 78..128");
            assert_eq!(got[4][78 * d..], want[4][78 * d..], "{simd:?} {value}: dV rows 78..128");
            for (t, name) in [(0, "O"), (2, "dQ")] {
                for i in (0..128).filter(|&i| i != 77) {
                    assert_eq!(
                        got[t][i * d..(i + 1) * d],
                        want[t][i * d..(i + 1) * d],
                        "{simd:?} {value}: {name} row {i}"
                    );
                }
            }
            if value.is_nan() {
                for j in 0..=77 {
                    let row = &got[3][j * d..(j + 1) * d];
                    assert!(row.iter().any(|&b| f32::from_bits(b).is_nan()), "{simd:?}: dK row {j} misses the NaN");
                }
            }
        }
    }
}

/// A partial that saw no key (`LSE = -inf`) adds nothing to the merge, even when its `O` is not finite.
#[test]
fn merge_ignores_a_partial_without_keys() {
    let o2 = vec![0.25f32, -3.0, 1.5, 0.0];
    let l2 = vec![0.7f32, -1.0];
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut o1 = vec![bad, 1.0, 2.0, bad];
        let mut l1 = vec![f32::NEG_INFINITY; 2];
        common::merge_f32(&mut o1, &mut l1, &o2, &l2).unwrap();
        assert_eq!((o1.clone(), l1.clone()), (o2.clone(), l2.clone()), "partial 1 holds {bad}");
        let mut o1 = o2.clone();
        let mut l1 = l2.clone();
        common::merge_f32(&mut o1, &mut l1, &[bad; 4], &[f32::NEG_INFINITY; 2]).unwrap();
        assert_eq!((o1, l1), (o2.clone(), l2.clone()), "partial 2 holds {bad}");
    }
}
