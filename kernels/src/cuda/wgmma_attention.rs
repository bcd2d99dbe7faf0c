//! Small cases of the wgmma attention kernels (`attention_forward_wgmma.cu`, `attention_backward_wgmma.cu`) in the
//! library's tests, so that the GPU check's compute-sanitizer step (`scripts/gpu-run --only hopper`, which runs the
//! library's tests matching `wgmma_attention` beside the wgmma and TMA probes) covers them: one forward and backward
//! per head dim (bf16, grouped queries, causal with the queries at the end of the keys, lengths off the tiles) on the
//! emulator (`::emulated`) and on an sm_90 GPU (`::cuda`, skipped with a message elsewhere), against the mma.sync
//! kernels on the same device and the CPU backend, and the backward's non-deterministic variant against the
//! deterministic one; the forward's and the backward's TMA loads (zero fill past a head's rows; the backward's
//! cp.async fallback, forced, bit for bit against them); the backward's warp-specialised rings (`ws_backward`: many
//! tiles per block, and blocks the mask hides whole); the two consumer warpgroups' shared tiles sanitised for one of
//! them (`shared_nonfinite`); the forward's non-finite V rows in either half of a 128-key tile (`forward_nonfinite`);
//! the forward exactly as mma.sync's where every key fits one tile of both (`single_key_tile`). tests/attention_wgmma.rs and tests/attention_wgmma_backward.rs
//! have the wider cases.

use crate::attention::{AttnGrads, AttnMask, AttnOut, AttnParams, AttnSaved, AttnShape, Positions, Qkv};
use crate::backend::{Backend, GradMode};
use crate::cuda::{AttentionPath, CudaBackend, WgmmaBackward};
use crate::testing::uniform_nonzero;
use crate::{Buffer, CpuBackend, DType, Dims, View, ViewMut};

use super::ops::attention::{tma_loads, TmaLoads, TMA_LOADS};

fn dims(d: &[usize]) -> Dims {
    Dims::new(d).unwrap()
}

/// `vals` on `b` as bf16 (uploaded as f32, rounded on the backend).
fn bf16_input(b: &dyn Backend, vals: &[f32], d: &[usize]) -> Buffer {
    let mut f = b.empty(DType::F32, dims(d)).unwrap();
    b.upload(f.view_mut(), View::new(vals, d).unwrap()).unwrap();
    let mut t = b.empty(DType::Bf16, dims(d)).unwrap();
    b.copy(t.view_mut(), f.view()).unwrap();
    t
}

/// A buffer of `t` on `b` filled with NaN, so that an element a kernel does not write fails the comparisons.
fn poisoned(b: &dyn Backend, t: DType, d: &[usize]) -> Buffer {
    let mut buf = b.empty(t, dims(d)).unwrap();
    b.fill(buf.view_mut(), f32::NAN).unwrap();
    buf
}

/// `buf` (of any type) as f32 on the host.
fn download(b: &dyn Backend, buf: &Buffer, d: &[usize]) -> Vec<f32> {
    let mut f = b.empty(DType::F32, dims(d)).unwrap();
    b.copy(f.view_mut(), buf.view()).unwrap();
    let mut host = vec![f32::NAN; d.iter().product()];
    b.download(ViewMut::new(&mut host, d).unwrap(), f.view()).unwrap();
    host
}

/// Q, K, V and dO of `shape` (uniform, nonzero), drawn from `seed` to `seed + 3`.
fn inputs(shape: AttnShape, seed: u64) -> [Vec<f32>; 4] {
    [
        uniform_nonzero(shape.q_elems(), seed),
        uniform_nonzero(shape.kv_elems(), seed + 1),
        uniform_nonzero(shape.kv_elems(), seed + 2),
        uniform_nonzero(shape.q_elems(), seed + 3),
    ]
}

/// `[O, LSE, dQ, dK, dV]` as f32 of a forward and a backward of `p` on `b`, inputs (q, k, v, dO) rounded to bf16 on
/// the backend, outputs and gradients in `ot`, each poisoned with NaN first.
fn run(b: &dyn Backend, p: &AttnParams<'_>, x: &[Vec<f32>; 4], ot: DType) -> Vec<Vec<f32>> {
    run_split(b, b, p, x, ot, || {})
}

/// [`run`] with the forward on `fwd` and the backward on `bwd` (another handle of the same device: a different
/// attention path), `between` run after the forward. So that two backwards compare on the same forward's O and LSE:
/// the wgmma forward's key tiles are 128 keys, the mma.sync one's 64, so their P are rounded to 16 bits against
/// different running maxima and their outputs differ by that rounding, as would every gradient after them.
fn run_split(
    fwd: &dyn Backend,
    bwd: &dyn Backend,
    p: &AttnParams<'_>,
    x: &[Vec<f32>; 4],
    ot: DType,
    between: impl FnOnce(),
) -> Vec<Vec<f32>> {
    let (b, s) = (fwd, p.shape);
    let input = |vals: &[f32], d: &[usize]| bf16_input(b, vals, d);
    let poisoned = |t: DType, d: &[usize]| poisoned(b, t, d);
    let (q, k, v) = (input(&x[0], &s.q_dims()), input(&x[1], &s.kv_dims()), input(&x[2], &s.kv_dims()));
    let d_o = input(&x[3], &s.q_dims());
    let (mut o, mut lse) = (poisoned(ot, &s.q_dims()), poisoned(DType::F32, &s.lse_dims()));
    let out = AttnOut { o: o.view_mut(), lse: lse.view_mut() };
    b.attention_forward(&p.options(), out, Qkv::new(q.view(), k.view(), v.view())).unwrap();
    between();
    let (mut dq, mut dk, mut dv) = (poisoned(ot, &s.q_dims()), poisoned(ot, &s.kv_dims()), poisoned(ot, &s.kv_dims()));
    let saved = AttnSaved { qkv: Qkv::new(q.view(), k.view(), v.view()), o: o.view(), lse: lse.view() };
    let grads = AttnGrads { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut() };
    bwd.attention_backward(&p.options(), grads, d_o.view(), saved, GradMode::Overwrite).unwrap();
    let download = |buf: &Buffer, d: &[usize]| download(b, buf, d);
    vec![
        download(&o, &s.q_dims()),
        download(&lse, &s.lse_dims()),
        download(&dq, &s.q_dims()),
        download(&dk, &s.kv_dims()),
        download(&dv, &s.kv_dims()),
    ]
}

/// How close the wgmma forward's `[O, LSE]` come to the mma.sync one's (absolute and relative, as `near` below): on
/// the emulator, where both sum exactly and round once, they differ only where the key tiles do (128 keys against
/// 64: P rounded to 16 bits against other running maxima, up to 2⁻⁸ of each term of O; LSE sums P in f32); on a GPU,
/// by the products' order too.
fn fwd_against_mma(emulated: bool) -> [f32; 2] {
    if emulated {
        [4e-3, 1e-5]
    } else {
        [1e-2, 1e-2]
    }
}

fn check(b: CudaBackend) {
    let emulated = b.is_emulated();
    let wg = b.with_attention_path(AttentionPath::Wgmma).with_deterministic_backward(true);
    let mma = wg.clone().with_attention_path(AttentionPath::Mma);
    let atomic = wg.clone().with_deterministic_backward(false);
    let ordered = wg.clone().with_wgmma_backward(WgmmaBackward::Ordered);
    let cpu = CpuBackend::new();
    // The backwards on the same forward's O and LSE: the emulator's wgmma and mma.sync both sum exactly and round
    // once; a GPU's differ in their order.
    let against_mma = if emulated { 1e-6 } else { 1e-2 };
    let fwd_tol = fwd_against_mma(emulated);
    for d in [64, 128] {
        let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: 70, kv_len: 130, head_dim: d };
        let p = AttnParams::new(shape)
            .with_mask(AttnMask::causal().with_positions(Positions::Offset(60), Positions::Offset(0)));
        let seed = d as u64;
        let x = inputs(shape, seed);
        let got = run(&wg, &p, &x, DType::F32);
        let mma_fwd = run(&mma, &p, &x, DType::F32);
        let want_mma = run_split(&wg, &mma, &p, &x, DType::F32, || {});
        let want_cpu = run(&cpu, &p, &x, DType::F32);
        // The one-kernel backwards: dK and dV as the split one's, dQ's f32 sums in another order.
        for (variant, be) in [("atomic", &atomic), ("ordered", &ordered)] {
            let got_fused = run(be, &p, &x, DType::F32);
            for (n, name) in [(2, "dQ"), (3, "dK"), (4, "dV")] {
                for (i, (a, g)) in got_fused[n].iter().zip(&got[n]).enumerate() {
                    assert!((a - g).abs() <= 1e-5 * (1.0 + g.abs()), "d {d}, {variant} {name}[{i}]: {a} against {g}");
                }
            }
        }
        for (n, name) in ["O", "LSE", "dQ", "dK", "dV"].into_iter().enumerate() {
            // Against the CPU (which keeps P and dS in f32): the 16-bit rounding of P and dS.
            let abs = [3e-3, 1e-3, 1e-2, 2e-2, 2e-2][n];
            let (mma_out, tol) = if n < 2 { (&mma_fwd[n], fwd_tol[n]) } else { (&want_mma[n], against_mma) };
            for (i, ((g, m), c)) in got[n].iter().zip(mma_out).zip(&want_cpu[n]).enumerate() {
                let near = |w: f32, abs: f32, rel: f32| *g == w || (g - w).abs() <= abs + rel * w.abs();
                assert!(near(*m, tol, tol), "d {d}, {name}[{i}]: {g} against mma.sync's {m}");
                assert!(near(*c, abs, 1e-2), "d {d}, {name}[{i}]: {g} against the CPU's {c}");
            }
        }
    }
}

/// This thread's record of the wgmma kernels' loads (`ops/attention.rs`'s `TMA_LOADS`).
fn loads() -> TmaLoads {
    TMA_LOADS.with(|l| l.get())
}

/// Makes this thread's tensor maps refused (`on`), as by a device that does not take them, or taken again.
fn refuse_maps(on: bool) {
    tma_loads(|n| n.refuse_maps = on);
}

/// The backward on `be` fed by the TMA, then by cp.async (the maps refused after the forward, so that both take the
/// same wgmma forward's O and LSE), the per-thread counters showing that each ran once (`what` names the case):
/// `[O, LSE, dQ, dK, dV]` of each.
fn tma_then_cp_async(
    be: &CudaBackend,
    p: &AttnParams<'_>,
    x: &[Vec<f32>; 4],
    what: &str,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let before = loads();
    let tma = run(be, p, x, DType::F32);
    let mid = loads();
    assert_eq!((mid.bwd_tma, mid.bwd_cp_async), (before.bwd_tma + 1, before.bwd_cp_async), "{what}: TMA");
    let cp = run_split(be, be, p, x, DType::F32, || refuse_maps(true));
    refuse_maps(false);
    let after = loads();
    assert_eq!((after.bwd_tma, after.bwd_cp_async), (mid.bwd_tma, mid.bwd_cp_async + 1), "{what}: cp.async");
    (tma, cp)
}

/// The gradients of [`tma_then_cp_async`]'s two runs agree: NaN where the other has NaN, else bit for bit where the
/// sums' order is the same in both (all but the one-kernel variants' dQ, `fused`: within 1e-5·(1 + |x|) there; the
/// ordered one's order is fixed but differs between the kernels of 128 and 64 keys a block).
fn assert_tma_as_cp_async(tma: &[Vec<f32>], cp: &[Vec<f32>], fused: bool, what: &str) {
    for (n, name) in [(2, "dQ"), (3, "dK"), (4, "dV")] {
        let exact = !(fused && name == "dQ");
        for (i, (t, c)) in tma[n].iter().zip(&cp[n]).enumerate() {
            let same = (t.is_nan() && c.is_nan())
                || if exact { t.to_bits() == c.to_bits() } else { (t - c).abs() <= 1e-5 * (1.0 + c.abs()) };
            assert!(same, "{what}: {name}[{i}] {t} by the TMA, {c} by cp.async");
        }
    }
}

/// The GPU's backend when it is an sm_90 device (the only one wgmma runs on), else `None`, saying why on stderr (a
/// panic without a device under `LONGCTX_REQUIRE_GPU=1`).
fn sm90_backend() -> Option<CudaBackend> {
    let b = super::probe::or_skip("wgmma_attention", CudaBackend::new(0))?;
    if b.device_name().contains("sm_90") {
        return Some(b);
    }
    eprintln!("wgmma_attention: skipped, the device is {} and wgmma needs sm_90", b.device_name());
    None
}

/// `mod $name` with the tests `emulated` and `cuda` (the GPU check's filters select `::cuda`) running `$body` on the
/// emulator and on an sm_90 GPU.
macro_rules! on_emulator_and_sm90 {
    ($name:ident => $body:ident) => {
        mod $name {
            use super::*;

            #[test]
            fn emulated() {
                $body(CudaBackend::emulated().unwrap_or_else(|e| panic!("{e}")));
            }

            #[test]
            fn cuda() {
                if let Some(b) = sm90_backend() {
                    $body(b);
                }
            }
        }
    };
}

on_emulator_and_sm90!(forward_backward => check);

/// The forward's TMA loads (`attention_forward_wgmma.cu`: per-head tensor maps whose rows past the sequence are
/// zeros): two heads of K and V, the second all NaN, lengths off the tiles (70 queries, 70 keys: the last key
/// tile's rows 70..127 of the first head lie where the second head's rows start in memory). The first head's O and
/// LSE must be the CPU's (a map that let the tile run on into the next head would put NaN·0 into them), and this
/// thread's count of TMA forwards shows that path ran; with the maps refused, the mma.sync kernels give the same.
fn tails_do_not_leak(b: CudaBackend) {
    let wg = b.with_attention_path(AttentionPath::Wgmma);
    let cpu = CpuBackend::new();
    for d in [64, 128] {
        let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 2, q_len: 70, kv_len: 70, head_dim: d };
        let p = AttnParams::new(shape);
        let (q, mut k, mut v) = (
            uniform_nonzero(shape.q_elems(), 7),
            uniform_nonzero(shape.kv_elems(), 8),
            uniform_nonzero(shape.kv_elems(), 9),
        );
        let head = shape.kv_len * d;
        k[head..].fill(f32::NAN);
        v[head..].fill(f32::NAN);
        let before = loads().fwd_tma;
        let got = run_forward(&wg, &p, [&q, &k, &v]);
        assert_eq!(loads().fwd_tma, before + 1, "d {d}: no TMA forward ran");
        // Where the device refuses the maps, the mma.sync kernels run instead, to the same result.
        refuse_maps(true);
        let fallback = run_forward(&wg, &p, [&q, &k, &v]);
        refuse_maps(false);
        assert_eq!(loads().fwd_tma, before + 1, "d {d}: a TMA forward ran with its maps refused");
        let want = run_forward(&cpu, &p, [&q, &k, &v]);
        let rows = shape.q_len;
        for (run, got) in [("TMA", &got), ("refused maps", &fallback)] {
            for (n, (name, per_row)) in [("O", d), ("LSE", 1)].into_iter().enumerate() {
                for i in 0..rows * per_row {
                    let (g, w) = (got[n][i], want[n][i]);
                    assert!(
                        g.is_finite() && (g - w).abs() <= 3e-3 + 1e-2 * w.abs(),
                        "d {d}, {run}: {name}[{i}] = {g}, want {w}"
                    );
                }
            }
        }
    }
}

/// `[O, LSE]` as f32 of a forward of `p` on `b`, inputs rounded to bf16 on the backend, O in f32.
fn run_forward(b: &dyn Backend, p: &AttnParams<'_>, x: [&[f32]; 3]) -> [Vec<f32>; 2] {
    let s = p.shape;
    let (q, k, v) =
        (bf16_input(b, x[0], &s.q_dims()), bf16_input(b, x[1], &s.kv_dims()), bf16_input(b, x[2], &s.kv_dims()));
    let (mut o, mut lse) = (poisoned(b, DType::F32, &s.q_dims()), poisoned(b, DType::F32, &s.lse_dims()));
    let out = AttnOut { o: o.view_mut(), lse: lse.view_mut() };
    b.attention_forward(&p.options(), out, Qkv::new(q.view(), k.view(), v.view())).unwrap();
    [download(b, &o, &s.q_dims()), download(b, &lse, &s.lse_dims())]
}

on_emulator_and_sm90!(tma_forward => tails_do_not_leak);

/// The forward's non-finite V rows in a 128-key tile the mask shows in part (`attention_forward_wgmma.cu`'s header):
/// 128 queries and 128 keys at the same positions, causal, so key tile 0 is partial for both consumer warpgroups; a
/// NaN in V row 30 (the tile's first 64 rows, the first word of its row masks) and then in row 100 (the second). The
/// queries before the poisoned key have O and LSE bit for bit those of a run without the NaN (their P for it is a
/// hidden 0, against the zeroed element), every query from it on has NaN in O (the correction adds P·NaN back). Head
/// dims 64 and 128.
fn forward_nonfinite_halves(b: CudaBackend) {
    let wg = b.with_attention_path(AttentionPath::Wgmma);
    for d in [64, 128] {
        let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: 128, kv_len: 128, head_dim: d };
        let p = AttnParams::new(shape).with_mask(AttnMask::causal());
        let (q, k, v) = (
            uniform_nonzero(shape.q_elems(), 11),
            uniform_nonzero(shape.kv_elems(), 12),
            uniform_nonzero(shape.kv_elems(), 13),
        );
        let before = loads().fwd_tma;
        let clean = run_forward(&wg, &p, [&q, &k, &v]);
        assert_eq!(loads().fwd_tma, before + 1, "d {d}: no TMA forward ran");
        for row in [30, 100] {
            let mut poisoned = v.clone();
            poisoned[row * d + 5] = f32::NAN;
            let got = run_forward(&wg, &p, [&q, &k, &poisoned]);
            for h in 0..2 {
                for i in 0..128 {
                    let at = (h * 128 + i) * d;
                    let (o, o_clean) = (&got[0][at..at + d], &clean[0][at..at + d]);
                    if i < row {
                        let same = o.iter().zip(o_clean).all(|(g, c)| g.to_bits() == c.to_bits());
                        assert!(same, "d {d}, V row {row}: head {h}, query {i} changed");
                        assert_eq!(got[1][h * 128 + i].to_bits(), clean[1][h * 128 + i].to_bits(), "d {d}: LSE");
                    } else {
                        assert!(o[5].is_nan(), "d {d}, V row {row}: head {h}, query {i} lost the NaN");
                    }
                }
            }
        }
    }
}

on_emulator_and_sm90!(forward_nonfinite => forward_nonfinite_halves);

/// The forward's K/V ring and its consumer warpgroups' turns (`attention_forward_wgmma.cu`'s header) over many key
/// tiles: 130 queries (two consumer warpgroups a block, and a second block of 2 rows) and 50 (one warpgroup), 586
/// keys at D = 128 (five tiles of 128, so that each of the ring's two stages is refilled and its barriers' parities
/// go both ways) and 850 at D = 64 (seven tiles, for its three stages), grouped
/// queries, bf16, head dims 64 and 128, with no mask; with a window (hidden tiles skipped at both ends of the walk);
/// and causal with the keys placed after the first block's queries (every tile of that block hidden: nothing loaded,
/// no turn taken, while the second block's warpgroups take theirs). Against the mma.sync kernel on the same device
/// ([`fwd_against_mma`]) and the CPU.
fn long_ring(b: CudaBackend) {
    let wg = b.with_attention_path(AttentionPath::Wgmma);
    let mma = wg.clone().with_attention_path(AttentionPath::Mma);
    let cpu = CpuBackend::new();
    let fwd_tol = fwd_against_mma(wg.is_emulated());
    for (d, sq, sk) in [(64, 130, 850), (128, 130, 586), (128, 50, 586)] {
        let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: sq, kv_len: sk, head_dim: d };
        let masks = [
            AttnMask::default(),
            AttnMask::default().with_positions(Positions::Offset(300), Positions::Offset(0)).with_window(100),
            AttnMask::causal().with_positions(Positions::Offset(0), Positions::Offset(128)),
        ];
        let seed = 40 + d as u64;
        let (q, k, v) = (
            uniform_nonzero(shape.q_elems(), seed),
            uniform_nonzero(shape.kv_elems(), seed + 1),
            uniform_nonzero(shape.kv_elems(), seed + 2),
        );
        for (mi, mask) in masks.into_iter().enumerate() {
            let p = AttnParams::new(shape).with_mask(mask);
            let got = run_forward(&wg, &p, [&q, &k, &v]);
            let want_mma = run_forward(&mma, &p, [&q, &k, &v]);
            let want_cpu = run_forward(&cpu, &p, [&q, &k, &v]);
            for (n, name) in ["O", "LSE"].into_iter().enumerate() {
                for (i, ((g, m), c)) in got[n].iter().zip(&want_mma[n]).zip(&want_cpu[n]).enumerate() {
                    let near = |w: f32, abs: f32, rel: f32| *g == w || (g - w).abs() <= abs + rel * w.abs();
                    assert!(
                        near(*m, fwd_tol[n], fwd_tol[n]),
                        "d {d}, {sq} queries, mask {mi}, {name}[{i}]: {g} against mma.sync's {m}"
                    );
                    assert!(
                        near(*c, 3e-3, 1e-2),
                        "d {d}, {sq} queries, mask {mi}, {name}[{i}]: {g} against the CPU's {c}"
                    );
                }
            }
        }
    }
}

on_emulator_and_sm90!(ring_and_turns => long_ring);

/// Where every key fits one tile of both forwards (64 keys or fewer: one 128-key tile of the wgmma kernel, one 64-key
/// tile of the mma.sync one), their P are rounded against the same maxima, so on the emulator, where both sum
/// exactly and round once, the wgmma forward's O and LSE match the mma.sync one's to 1e-6 (1e-2 on a GPU): the
/// 128-wide products, the masked half of the tile past the keys, and the softmax's bits, checked exactly. 130 and 50
/// queries, 64 and 37 keys, head dims 64 and 128, no mask and causal with the queries at the end of the keys.
fn one_key_tile(b: CudaBackend) {
    let wg = b.with_attention_path(AttentionPath::Wgmma);
    let mma = wg.clone().with_attention_path(AttentionPath::Mma);
    let against_mma = if wg.is_emulated() { 1e-6 } else { 1e-2 };
    for (d, sq, sk) in [(64, 130, 64), (128, 130, 37), (128, 50, 64)] {
        let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: sq, kv_len: sk, head_dim: d };
        let end = Positions::Offset(sk as i64 - sq as i64);
        let seed = 90 + d as u64 + sk as u64;
        let (q, k, v) = (
            uniform_nonzero(shape.q_elems(), seed),
            uniform_nonzero(shape.kv_elems(), seed + 1),
            uniform_nonzero(shape.kv_elems(), seed + 2),
        );
        for (mi, mask) in
            [AttnMask::default(), AttnMask::causal().with_positions(end, Positions::Offset(0))].into_iter().enumerate()
        {
            let p = AttnParams::new(shape).with_mask(mask);
            let got = run_forward(&wg, &p, [&q, &k, &v]);
            let want = run_forward(&mma, &p, [&q, &k, &v]);
            for (n, name) in ["O", "LSE"].into_iter().enumerate() {
                for (i, (g, m)) in got[n].iter().zip(&want[n]).enumerate() {
                    let near = *g == *m || (g - m).abs() <= against_mma * (1.0 + m.abs());
                    assert!(near, "d {d}, {sq}×{sk}, mask {mi}, {name}[{i}]: {g} against mma.sync's {m}");
                }
            }
        }
    }
}

on_emulator_and_sm90!(single_key_tile => one_key_tile);

/// The backward's loads (`attention_backward_wgmma.cu`'s header, Loads): the TMA-fed kernels, and the cp.async ones
/// that run where the device refuses a tensor map (forced here by refusing them), on grouped queries under a causal
/// mask (queries at the end of the keys: 4 tile pairs per dK/dV block and up to 3 key tiles per dQ block, so the
/// cp.async kernels fill both their buffers twice and the TMA's 3-stage ring is refilled once in dK/dV; ws_backward
/// drives the rings further), lengths off the tiles, and the second half of the heads of every input
/// NaN: the rows past a head's length must land as zeros, never as the next head's NaN rows. Both loads give the
/// same gradients, bit for bit where the sums' order is fixed (all but the non-deterministic variant's dQ); the first
/// half's are finite and the CPU's; the per-thread counters show which kernels ran.
fn backward_loads(b: CudaBackend) {
    let wg = b.with_attention_path(AttentionPath::Wgmma).with_deterministic_backward(true);
    let atomic = wg.clone().with_deterministic_backward(false);
    let ordered = wg.clone().with_wgmma_backward(WgmmaBackward::Ordered);
    let cpu = CpuBackend::new();
    for d in [64, 128] {
        let shape = AttnShape { batch: 1, q_heads: 4, kv_heads: 2, q_len: 70, kv_len: 130, head_dim: d };
        let p = AttnParams::new(shape)
            .with_mask(AttnMask::causal().with_positions(Positions::Offset(60), Positions::Offset(0)));
        let seed = 10 * d as u64;
        let mut x = inputs(shape, seed);
        for v in &mut x {
            let half = v.len() / 2;
            v[half..].fill(f32::NAN);
        }
        let want = run(&cpu, &p, &x, DType::F32);
        for (variant, be) in [("deterministic", &wg), ("atomic", &atomic), ("ordered", &ordered)] {
            let what = format!("d {d} {variant}");
            let (tma, cp) = tma_then_cp_async(be, &p, &x, &what);
            assert_tma_as_cp_async(&tma, &cp, variant != "deterministic", &what);
            for (n, name) in [(2, "dQ"), (3, "dK"), (4, "dV")] {
                // The first half of the heads (the second's inputs are NaN, and so are its gradients).
                let half = tma[n].len() / 2;
                let abs = [1e-2, 2e-2, 2e-2][n - 2];
                for (i, (g, w)) in tma[n][..half].iter().zip(&want[n][..half]).enumerate() {
                    assert!(
                        g.is_finite() && (g - w).abs() <= abs + 1e-2 * w.abs(),
                        "d {d} {variant}: {name}[{i}] = {g}, the CPU's {w}"
                    );
                }
            }
        }
    }
}

on_emulator_and_sm90!(tma_backward => backward_loads);

/// The warp-specialised backward kernels' rings (`attention_backward_wgmma.cu`'s header, Warps and Loads): a long
/// query length against a short key length (640 queries grouped by 2, 70 keys: 20 visible pairs per dK/dV block, so
/// its producer runs ahead of the consumers and every stage of the ring is refilled six or seven times, its
/// barriers' parities going both ways), and the reverse (70 queries, 640 keys: 10 key tiles per dQ block); causal
/// with more keys than queries (300 queries, 400 keys: the mask hides every pair of the blocks of key tiles 5 and 6)
/// and with the keys placed after the first 128 queries (200 queries, 300 keys: every key tile of dQ blocks 0 and 1
/// hidden, and dK/dV blocks 2 to 4): nothing loaded there, no deadlock, and the gradients of what the mask hides
/// exactly 0. The TMA-fed dK/dV blocks are two consumer warpgroups with a key tile each (the fused ones at head dim
/// 64): causal with more keys than queries (300 queries, 400 keys: the second warpgroup's tile hidden from every pair
/// of block 2 while the first's is not, and block 3 with one key tile, all of it hidden), and a sliding window (100
/// positions) that hides the first warpgroup's tile from pairs that the second's sees, at both head dims. Both
/// variants, bf16. Against the mma.sync kernels on the same device (on the emulator to 1e-4 of the gradient's largest
/// magnitude, 1e-2 on a GPU), the CPU (1e-2), and the cp.async kernels bit for bit where the sums' order is fixed.
fn backward_ring(b: CudaBackend) {
    let wg = b.with_attention_path(AttentionPath::Wgmma).with_deterministic_backward(true);
    let atomic = wg.clone().with_deterministic_backward(false);
    let ordered = wg.clone().with_wgmma_backward(WgmmaBackward::Ordered);
    let mma = wg.clone().with_attention_path(AttentionPath::Mma);
    let cpu = CpuBackend::new();
    let against_mma = if wg.is_emulated() { 1e-4 } else { 1e-2 };
    // (head dim, queries, keys, mask, keys from which on no query sees, queries before which no key is seen).
    let causal = |k0| AttnMask::causal().with_positions(Positions::Offset(0), Positions::Offset(k0));
    let cases = [
        (64, 300, 400, causal(0), 300, 0),
        (64, 256, 320, causal(0).with_window(100), 256, 0),
        (64, 640, 70, AttnMask::default(), 70, 0),
        (128, 640, 70, AttnMask::default(), 70, 0),
        (64, 70, 640, AttnMask::default(), 640, 0),
        (128, 300, 400, causal(0), 300, 0),
        (128, 256, 320, causal(0).with_window(100), 256, 0),
        (128, 200, 300, causal(128), 72, 128),
    ];
    for (d, sq, sk, mask, unseen_keys, unseeing_queries) in cases {
        let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: sq, kv_len: sk, head_dim: d };
        let p = AttnParams::new(shape).with_mask(mask);
        let seed = 70 + d as u64 + sq as u64;
        let x = inputs(shape, seed);
        let want_cpu = run(&cpu, &p, &x, DType::F32);
        let want_mma = run_split(&wg, &mma, &p, &x, DType::F32, || {});
        for (variant, be) in [("deterministic", &wg), ("atomic", &atomic), ("ordered", &ordered)] {
            let (tma, cp) = tma_then_cp_async(be, &p, &x, &format!("d {d}, {sq} queries, {variant}"));
            for (n, name) in [(2, "dQ"), (3, "dK"), (4, "dV")] {
                let exact = !(variant != "deterministic" && name == "dQ");
                let at = |i: usize| format!("d {d}, {sq} queries, {variant}: {name}[{i}]");
                // Errors against the gradient's largest magnitude (the CPU's).
                let scale = want_cpu[n].iter().fold(1e-6f32, |m, w| m.max(w.abs()));
                for (i, (((t, c), m), w)) in tma[n].iter().zip(&cp[n]).zip(&want_mma[n]).zip(&want_cpu[n]).enumerate() {
                    assert!(t.is_finite(), "{} = {t}", at(i));
                    assert!(
                        if exact { t.to_bits() == c.to_bits() } else { (t - c).abs() <= 1e-5 * scale },
                        "{}: {t} by the TMA, {c} by cp.async",
                        at(i)
                    );
                    assert!((t - m).abs() <= against_mma * scale, "{}: {t}, mma.sync's {m}", at(i));
                    assert!((t - w).abs() <= 1e-2 * scale, "{}: {t}, the CPU's {w}", at(i));
                }
            }
            // What no query sees (whole dK/dV blocks among them: nothing loaded) and the queries that see no key
            // (whole dQ blocks): exactly 0.
            for n in [3, 4] {
                assert!(
                    tma[n][unseen_keys * d..].iter().all(|g| *g == 0.0),
                    "d {d}, {sq} queries {variant}: unseen keys"
                );
            }
            assert!(tma[2][..unseeing_queries * d].iter().all(|g| *g == 0.0), "d {d}, {sq} queries {variant}: dQ");
        }
    }
}

on_emulator_and_sm90!(ws_backward => backward_ring);

/// The two consumer warpgroups of the TMA-fed kernels share their blocks' streamed tiles (the kernel's header, Warps):
/// Q and dO in dK/dV (and in the non-deterministic kernel at D = 64), K in dQ. 128 queries at positions 100.., 128
/// keys from 0, causal: key tile 0 is seen whole by both query tiles, key tile 1 in part by query tile 0 and whole by
/// query tile 1. So a pair that one dK/dV warpgroup's key tile sees whole and the other's only in part has its
/// shared Q and dO sanitised for the second, and a key tile that one dQ warpgroup's query tile sees whole and the
/// other's in part has its shared K sanitised: the warpgroup that sees the pair whole computes on tiles whose
/// non-finite elements were zeroed and must add back what they contribute. A NaN in query row 5 of head 0, one in dO
/// row 20 of head 1 (which only the correction carries into dV: its LSE is finite), and one in key row 120 (queries
/// 120.. see it): the TMA-fed kernels (two warpgroups) against the cp.async ones (one warpgroup, which never
/// sanitises a tile its pair shows whole): NaN where they have NaN (what the poisoned row reaches), bit for bit
/// elsewhere (dQ within 1e-5 in the non-deterministic variant). Head dims 64 and 128.
fn shared_tiles_nonfinite(b: CudaBackend) {
    let wg = b.with_attention_path(AttentionPath::Wgmma).with_deterministic_backward(true);
    let atomic = wg.clone().with_deterministic_backward(false);
    let ordered = wg.clone().with_wgmma_backward(WgmmaBackward::Ordered);
    for d in [64, 128] {
        let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: 128, kv_len: 128, head_dim: d };
        let p = AttnParams::new(shape)
            .with_mask(AttnMask::causal().with_positions(Positions::Offset(100), Positions::Offset(0)));
        let clean = inputs(shape, 41);
        // (what is poisoned, its input, its element).
        for (poison, input, at) in
            [("Q row 5", 0, 5 * d + 7), ("dO row 20", 3, (128 + 20) * d + 3), ("K row 120", 1, 120 * d + 9)]
        {
            let mut x = clean.clone();
            x[input][at] = f32::NAN;
            for (variant, be) in [("deterministic", &wg), ("atomic", &atomic), ("ordered", &ordered)] {
                let what = format!("d {d}, {poison}, {variant}");
                let (tma, cp) = tma_then_cp_async(be, &p, &x, &what);
                assert_tma_as_cp_async(&tma, &cp, variant != "deterministic", &what);
                // Not vacuous: NaN reaches what the poisoned row sees, and not what it does not.
                if input == 1 {
                    // The queries before position 120 (rows 0..19 of each head) have finite dQ, query 120 not.
                    for h in 0..2 {
                        let rows = &tma[2][h * 128 * d..];
                        assert!(rows[..20 * d].iter().all(|g| g.is_finite()), "{what}: dQ of queries 100..119");
                        assert!(rows[20 * d..21 * d].iter().any(|g| g.is_nan()), "{what}: dQ of query 120");
                    }
                } else {
                    // The keys of tile 0 (which the poisoned row sees) have NaN in dV, the keys past the poisoned
                    // row's position (121..127) finite gradients.
                    let dv_at = if input == 0 { 0 } else { 3 };
                    assert!((0..64).all(|j| tma[4][j * d + dv_at].is_nan()), "{what}: dV of key tile 0");
                    for n in [3, 4] {
                        assert!(tma[n][121 * d..].iter().all(|g| g.is_finite()), "{what}: keys 121..");
                    }
                }
            }
        }
    }
}

on_emulator_and_sm90!(shared_nonfinite => shared_tiles_nonfinite);

/// The ordered backward (`attention_backward_wgmma.cu`'s header, "ordered") gives dQ the same bits every run, fed by
/// the TMA (blocks of 128 keys) and by cp.async (64), while the emulator's workers run blocks side by side: no mask
/// (every key block reaches every query tile at once and waits for its turn), causal, and documents that make the
/// key blocks visiting a query tile not consecutive (keys in documents 0 and 1 by turns of 128 keys, queries in
/// document 0: a turn passes over the blocks between). Two batches, two query heads on one key/value head (a flag per
/// batch and query head). Within 1e-5 of the split backward's dQ.
fn ordered_is_reproducible(b: CudaBackend) {
    let wg = b.with_attention_path(AttentionPath::Wgmma).with_deterministic_backward(true);
    let ordered = wg.clone().with_wgmma_backward(WgmmaBackward::Ordered);
    let shape = AttnShape { batch: 2, q_heads: 2, kv_heads: 1, q_len: 192, kv_len: 640, head_dim: 64 };
    let q_doc = vec![0u32; shape.q_len];
    let k_doc: Vec<u32> = (0..shape.kv_len).map(|j| ((j / 128) % 2) as u32).collect();
    let masks = [
        ("no mask", AttnMask::default()),
        ("causal", AttnMask::causal().with_positions(Positions::Offset(448), Positions::Offset(0))),
        ("documents", AttnMask::default().with_docs(&q_doc, &k_doc)),
    ];
    for (what, mask) in masks {
        let p = AttnParams::new(shape).with_mask(mask);
        let x = inputs(shape, 90);
        for refuse in [false, true] {
            let loads = if refuse { "cp.async" } else { "TMA" };
            // (With the maps refused the forward is mma.sync's: the split backward runs on the same.)
            refuse_maps(refuse);
            let split = run(&wg, &p, &x, DType::F32);
            let first = run(&ordered, &p, &x, DType::F32);
            for _ in 0..2 {
                let again = run(&ordered, &p, &x, DType::F32);
                for (i, (a, f)) in again[2].iter().zip(&first[2]).enumerate() {
                    assert_eq!(a.to_bits(), f.to_bits(), "{what}, {loads}: dQ[{i}] {a} in one run, {f} in another");
                }
            }
            for (i, (f, w)) in first[2].iter().zip(&split[2]).enumerate() {
                assert!((f - w).abs() <= 1e-5 * (1.0 + w.abs()), "{what}, {loads}: dQ[{i}] {f}, split's {w}");
            }
        }
        refuse_maps(false);
    }
}

on_emulator_and_sm90!(ordered_backward => ordered_is_reproducible);
