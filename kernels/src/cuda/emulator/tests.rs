//! The emulator's tests: the kernels under `kernels/tests/cuda/` run by the emulator and checked against the host,
//! the errors it must report, and an NVRTC compile of the same translation units for sm_80 and sm_90 (so the
//! headers' two sides are checked together). Unit tests rather than an integration test because the emulator and the
//! seam's types are crate-private, and making them public for a test would make them API.
//!
//! `cargo test -p longctx-kernels --features cuda --lib emulator -- --ignored --nocapture emulator_figures` prints
//! what the emulator costs.

use std::sync::OnceLock;
use std::time::Instant;

use bytemuck::Pod;
use half::{bf16, f16};

use super::Emulator;
use crate::cuda::device::{DevicePtr, Kernel, KernelArgs, KernelSource, LaunchConfig};
use crate::cuda::sources::translation_unit;
use crate::error::KernelError;

macro_rules! source {
    ($file:literal, [$($k:literal),* $(,)?]) => {
        KernelSource { file: $file, code: include_str!(concat!("../../../tests/cuda/", $file)), kernels: &[$($k),*], includes: &[] }
    };
}

static REDUCE: KernelSource =
    source!("reduce.cu", ["reduce_rows", "shuffles", "barrier_visibility", "early_exit", "built_ins"]);
static MMA: KernelSource = source!(
    "mma.cu",
    ["mma_ldmatrix_bf16", "mma_ldmatrix_f16", "mma_by_hand_bf16", "mma_by_hand_f16", "ldmatrix_layout"]
);
static CP_ASYNC: KernelSource = source!("cp_async.cu", ["cp_async_copy"]);
static ATOMICS: KernelSource = source!("atomics.cu", ["atomics", "flags_in_order"]);
static CONVERT: KernelSource = source!("convert.cu", ["narrow", "widen"]);
static ERRORS: KernelSource = source!(
    "errors.cu",
    [
        "divergent_barrier",
        "collective_never_reached",
        "lane_exits_early",
        "partial_mask",
        "write_past_end",
        "takes_double",
        "traps",
        "asserts",
        "stale_shared",
        "dynamic_smem_overflow",
        "ldmatrix_from_global",
        "named_barrier_never_completes",
        "named_barrier_count_mismatch",
        "named_barrier_left_open",
        "named_barrier_zero",
    ]
);
static MATH: KernelSource = source!("math.cu", ["math_builtins"]);
static FIGURES: KernelSource = source!("figures.cu", ["many_barriers", "many_mma"]);
static NAMED_BARRIERS: KernelSource = source!("named_barriers.cu", ["ping_pong", "hand_over"]);
static ALL: [&KernelSource; 9] =
    [&REDUCE, &MMA, &CP_ASYNC, &ATOMICS, &CONVERT, &MATH, &ERRORS, &FIGURES, &NAMED_BARRIERS];

/// One emulator with every test source, shared by the tests (built once per process; cached on disk after). A build
/// that fails is reported by every test, built once.
fn emu() -> &'static Emulator {
    static EMU: OnceLock<Result<Emulator, String>> = OnceLock::new();
    EMU.get_or_init(|| Emulator::new(&ALL).map_err(|e| e.to_string())).as_ref().unwrap_or_else(|e| panic!("{e}"))
}

/// Device memory freed on drop.
struct Buf<'a> {
    emu: &'a Emulator,
    ptr: DevicePtr,
    bytes: usize,
}

impl<'a> Buf<'a> {
    fn new(emu: &'a Emulator, bytes: usize) -> Self {
        Self { emu, ptr: emu.alloc(bytes).unwrap(), bytes }
    }
    fn from<T: Pod>(emu: &'a Emulator, data: &[T]) -> Self {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let b = Self::new(emu, bytes.len());
        emu.check_range(b.ptr, bytes.len(), "upload").unwrap();
        // SAFETY: the allocation holds `bytes.len()` bytes (checked above).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), b.ptr as *mut u8, bytes.len()) };
        b
    }
    fn zeroed(emu: &'a Emulator, bytes: usize) -> Self {
        Self::from(emu, &vec![0u8; bytes])
    }
    fn read<T: Pod>(&self) -> Vec<T> {
        let mut v = vec![T::zeroed(); self.bytes / std::mem::size_of::<T>()];
        let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut v);
        // SAFETY: the allocation holds `self.bytes` bytes, at least `dst.len()`.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr as *const u8, dst.as_mut_ptr(), dst.len()) };
        v
    }
}

impl Drop for Buf<'_> {
    fn drop(&mut self) {
        // SAFETY: no launch uses the buffer any more (launches are synchronous). A guard error was reported (and the
        // guard repaired) by the launch that caused it.
        let _ = unsafe { self.emu.free(self.ptr) };
    }
}

fn args(ptrs: &[&Buf<'_>]) -> KernelArgs {
    let mut a = KernelArgs::new();
    for b in ptrs {
        a.push(b.ptr);
    }
    a
}

fn run(
    emu: &Emulator,
    src: &'static KernelSource,
    name: &'static str,
    cfg: LaunchConfig,
    args: &KernelArgs,
) -> Result<(), KernelError> {
    // SAFETY: every test passes buffers of this emulator sized for what its kernel touches (or, in the error
    // tests, within their guard zones).
    unsafe { emu.launch(&Kernel { source: src, name }, &cfg, args) }
}

fn cfg(grid: [u32; 3], block: [u32; 3], shared_bytes: u32) -> LaunchConfig {
    LaunchConfig { grid, block, shared_bytes }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The error's text, which must name `kernel`.
fn device_error(r: Result<(), KernelError>, kernel: &str) -> String {
    match r {
        Err(e @ KernelError::Device { .. }) => {
            let s = e.to_string();
            assert!(s.contains(&format!("`{kernel}`")), "the error does not name the kernel: {s}");
            s
        }
        other => panic!("expected a device error from `{kernel}`, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Reductions, shuffles, barriers.

/// A warp's butterfly sum as warp_sum computes it (every lane ends with the same bits).
fn butterfly(mut v: [f32; 32]) -> f32 {
    let mut o = 16;
    while o > 0 {
        let prev = v;
        for (l, x) in v.iter_mut().enumerate() {
            *x = prev[l] + prev[l ^ o];
        }
        o /= 2;
    }
    v[0]
}

#[test]
fn block_and_warp_reductions_match_the_host() {
    let e = emu();
    let (blocks, n, block) = (6usize, 1000usize, [32u32, 4, 2]);
    let threads = 256;
    let x = values(blocks * n, 1);
    let (xb, sums, maxs, dsums) =
        (Buf::from(e, &x), Buf::new(e, blocks * 4), Buf::new(e, blocks * 4), Buf::new(e, blocks * 8));
    let (wsums, same) = (Buf::new(e, blocks * threads / 32 * 4), Buf::new(e, blocks * 4));
    let mut a = KernelArgs::new();
    a.push(xb.ptr).push(n as i32).push(sums.ptr).push(maxs.ptr).push(dsums.ptr).push(wsums.ptr).push(same.ptr);
    run(e, &REDUCE, "reduce_rows", cfg([blocks as u32, 1, 1], block, 0), &a).unwrap();
    let (sums, maxs, dsums) = (sums.read::<f32>(), maxs.read::<f32>(), dsums.read::<f64>());
    let (wsums, same) = (wsums.read::<f32>(), same.read::<i32>());
    for b in 0..blocks {
        let row = &x[b * n..(b + 1) * n];
        // Each thread's partial as the kernel strides; warp and block sums by the same butterflies.
        let partial: Vec<f32> = (0..threads).map(|t| row.iter().skip(t).step_by(threads).sum()).collect();
        let warps: Vec<f32> = partial.chunks(32).map(|w| butterfly(w.try_into().unwrap())).collect();
        assert_eq!(&wsums[b * 8..(b + 1) * 8], &warps[..], "block {b}: warp sums");
        let mut padded = [0f32; 32];
        padded[..warps.len()].copy_from_slice(&warps);
        assert_eq!(sums[b].to_bits(), butterfly(padded).to_bits(), "block {b}: block_sum");
        let exact: f64 = row.iter().map(|&v| f64::from(v)).sum();
        assert!((f64::from(sums[b]) - exact).abs() < 1e-4, "block {b}: {} vs {exact}", sums[b]);
        assert!((dsums[b] - exact).abs() < 1e-9, "block {b}: {} vs {exact}", dsums[b]);
        assert_eq!(maxs[b], row.iter().copied().fold(f32::NEG_INFINITY, f32::max), "block {b}: block_max");
        assert_eq!(same[b], 1, "block {b}: every thread got the same total");
    }
}

#[test]
fn shuffles_and_votes_follow_cuda_semantics() {
    let e = emu();
    let (out, dout) = (Buf::new(e, 64 * 16 * 4), Buf::new(e, 64 * 8));
    run(e, &REDUCE, "shuffles", LaunchConfig::linear(1, 64), &args(&[&out, &dout])).unwrap();
    let (out, dout) = (out.read::<i32>(), dout.read::<f64>());
    for t in 0..64usize {
        let (l, w) = (t % 32, t / 32);
        let v = |lane: usize| (lane * 10 + w * 1000) as i32;
        let xor_w4 = if (l ^ 6) < (l & !3) + 4 { v(l ^ 6) } else { v(l) };
        let expected = [
            v(l * 7 % 32),
            if l >= 3 { v(l - 3) } else { v(l) },
            if l + 5 < 32 { v(l + 5) } else { v(l) },
            v(l ^ 9),
            v((l & !7) + 3),
            if l % 8 >= 2 { v(l - 2) } else { v(l) },
            if l % 16 + 3 < 16 { v(l + 3) } else { v(l) },
            xor_w4,
            0xaaaa_aaaau32 as i32,
            1,
            0,
            496,
            15,
            -16,
            22,
            1,
        ];
        assert_eq!(&out[t * 16..(t + 1) * 16], &expected, "thread {t}");
        assert_eq!(dout[t], f64::from(v(l ^ 1)) + 0.25, "thread {t}: f64 shuffle");
    }
}

#[test]
fn shared_memory_is_seen_across_barriers_and_exited_threads_do_not_hold_them() {
    let e = emu();
    let out = Buf::new(e, 64 * 4);
    run(e, &REDUCE, "barrier_visibility", LaunchConfig::linear(1, 64), &args(&[&out])).unwrap();
    assert_eq!(out.read::<i32>(), vec![123; 64]);

    let out = Buf::new(e, 128 * 4);
    let mut a = KernelArgs::new();
    a.push(100i32).push(out.ptr);
    run(e, &REDUCE, "early_exit", LaunchConfig::linear(1, 128), &a).unwrap();
    let got = out.read::<i32>();
    assert_eq!(&got[..100], &[100; 100][..]);
    assert_eq!(&got[100..], &[-1; 28][..], "unwritten device memory is poison (0xFF bytes)");
}

#[test]
fn built_in_variables_of_a_3d_grid() {
    let e = emu();
    let (grid, block) = ([3u32, 2, 2], [4u32, 2, 3]);
    let out = Buf::new(e, 12 * 24 * 12 * 4);
    run(e, &REDUCE, "built_ins", cfg(grid, block, 0), &args(&[&out])).unwrap();
    let out = out.read::<u32>();
    let mut i = 0;
    for (bz, by, bx) in (0..2).flat_map(|z| (0..2).flat_map(move |y| (0..3).map(move |x| (z, y, x)))) {
        for (tz, ty, tx) in (0..3).flat_map(|z| (0..2).flat_map(move |y| (0..4).map(move |x| (z, y, x)))) {
            let want = [tx, ty, tz, bx, by, bz, 4, 2, 3, 3, 2, 2];
            assert_eq!(&out[i * 12..(i + 1) * 12], &want, "block ({bx},{by},{bz}) thread ({tx},{ty},{tz})");
            i += 1;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// mma.sync and ldmatrix.

/// A 16-bit float type of an mma.
trait Half: Pod + std::fmt::Debug {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}
impl Half for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}
impl Half for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// D = A·B + C for A [16][16], B [16 k][16 n], C [16][16], exact then rounded, with each entry's tolerance: f32
/// rounding of the sum of the terms' magnitudes (the tensor core's order and rounding are its own).
fn host_mma(a: &[f32], b_kn: &[f32], c: &[f32]) -> Vec<(f32, f32)> {
    (0..256)
        .map(|ij| {
            let (i, j) = (ij / 16, ij % 16);
            let (mut s, mut mag) = (f64::from(c[ij]), f64::from(c[ij].abs()));
            for k in 0..16 {
                let p = f64::from(a[i * 16 + k]) * f64::from(b_kn[k * 16 + j]);
                s += p;
                mag += p.abs();
            }
            (s as f32, (mag * 4.0 * f64::from(f32::EPSILON)) as f32)
        })
        .collect()
}

fn assert_close(got: &[f32], want: &[(f32, f32)], what: &str) {
    for (i, (&g, &(w, tol))) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "{what}: D[{}][{}] = {g}, expected {w} (± {tol})", i / 16, i % 16);
    }
}

fn mma_with_ldmatrix<T: Half>(kernel: &'static str) {
    let e = emu();
    let round = |v: Vec<f32>| -> Vec<T> { v.into_iter().map(|x| T::from_f32(x * 4.0)).collect() };
    let (a, b_kn) = (round(values(256, 2)), round(values(256, 3)));
    let b_nk: Vec<T> = (0..256).map(|nk| b_kn[(nk % 16) * 16 + nk / 16]).collect();
    let c = values(256, 4);
    let f = |v: &[T]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let want = host_mma(&f(&a), &f(&b_kn), &c);
    let (ab, knb, nkb, cb) = (Buf::from(e, &a), Buf::from(e, &b_kn), Buf::from(e, &b_nk), Buf::from(e, &c));
    let outs = [Buf::new(e, 1024), Buf::new(e, 1024), Buf::new(e, 1024)];
    let a_ = args(&[&ab, &knb, &nkb, &cb, &outs[0], &outs[1], &outs[2]]);
    run(e, &MMA, kernel, LaunchConfig::linear(1, 32), &a_).unwrap();
    for (out, how) in outs.iter().zip(["B by ldmatrix.x4.trans", "B by ldmatrix.x2.trans", "B by ldmatrix.x2"]) {
        assert_close(&out.read::<f32>(), &want, &format!("{kernel}, {how}"));
    }
}

#[test]
fn mma_bf16_with_ldmatrix_fragments_matches_the_host() {
    mma_with_ldmatrix::<bf16>("mma_ldmatrix_bf16");
}

#[test]
fn mma_f16_with_ldmatrix_fragments_matches_the_host() {
    mma_with_ldmatrix::<f16>("mma_ldmatrix_f16");
}

fn mma_by_hand<T: Half>(kernel: &'static str) {
    let e = emu();
    let (a, b_kn, c) = (values(256, 5), values(256, 6), values(256, 7));
    let rounded = |v: &[f32]| v.iter().map(|&x| T::from_f32(x).to_f32()).collect::<Vec<f32>>();
    let want = host_mma(&rounded(&a), &rounded(&b_kn), &c);
    let (ab, bb, cb, d) = (Buf::from(e, &a), Buf::from(e, &b_kn), Buf::from(e, &c), Buf::new(e, 1024));
    run(e, &MMA, kernel, LaunchConfig::linear(1, 32), &args(&[&ab, &bb, &cb, &d])).unwrap();
    assert_close(&d.read::<f32>(), &want, kernel);
}

#[test]
fn mma_with_fragments_assembled_by_hand_matches_the_host() {
    mma_by_hand::<bf16>("mma_by_hand_bf16");
    mma_by_hand::<f16>("mma_by_hand_f16");
}

#[test]
fn ldmatrix_gives_each_lane_the_documented_elements() {
    let e = emu();
    let out = Buf::new(e, 32 * 13 * 4);
    run(e, &MMA, "ldmatrix_layout", LaunchConfig::linear(1, 32), &args(&[&out])).unwrap();
    let out = out.read::<u32>();
    // Matrix j's row i is the stored row 7 - i (the lanes address rows in reverse); element (r, c) stored = j·64 + r·8 + c.
    let m = |j: u32, i: u32, c: u32| j * 64 + (7 - i) * 8 + c;
    let pair = |lo: u32, hi: u32| lo | (hi << 16);
    for l in 0..32u32 {
        let direct = |j: u32| pair(m(j, l / 4, 2 * (l % 4)), m(j, l / 4, 2 * (l % 4) + 1));
        let trans = |j: u32| pair(m(j, 2 * (l % 4), l / 4), m(j, 2 * (l % 4) + 1, l / 4));
        let expected = [
            direct(0),
            direct(0),
            direct(1),
            direct(0),
            direct(1),
            direct(2),
            direct(3),
            trans(0),
            trans(1),
            trans(0),
            trans(1),
            trans(2),
            trans(3),
        ];
        assert_eq!(&out[l as usize * 13..(l as usize + 1) * 13], &expected, "lane {l}: x1, x2, x4, x2.trans, x4.trans");
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// cp.async, atomics, conversions.

#[test]
fn cp_async_lands_by_group_and_zero_fills() {
    let e = emu();
    let n = 64usize;
    let src = values(2 * n * 4, 8);
    let (sb, dst, early) = (Buf::from(e, &src), Buf::new(e, 3 * n * 16), Buf::new(e, 2 * n * 4));
    let valid = n + n / 2;
    let mut a = KernelArgs::new();
    a.push(sb.ptr).push(valid as i32).push(dst.ptr).push(early.ptr);
    run(e, &CP_ASYNC, "cp_async_copy", cfg([1, 1, 1], [n as u32, 1, 1], (2 * n * 16) as u32), &a).unwrap();
    let (dst, early) = (dst.read::<[f32; 4]>(), early.read::<i32>());
    let chunk = |i: usize| -> [f32; 4] { src[i * 4..i * 4 + 4].try_into().unwrap() };
    for t in 0..n {
        assert_eq!(dst[t], chunk((t + 1) % n), "thread {t}: another thread's chunk after wait_all + barrier");
        let c = n + t;
        assert_eq!(
            dst[n + t],
            if c < valid { chunk(c) } else { [0.0; 4] },
            "thread {t}: group 1, zero-filled past {valid}"
        );
        assert_eq!(dst[2 * n + t], chunk(t), "thread {t}: group 0 after wait_group 1");
    }
    assert_eq!(early, vec![1; 2 * n], "copies land at the wait that covers them, not before");
}

#[test]
fn atomics_from_blocks_running_in_parallel() {
    // Four OS threads (more than this machine's cores, so they are preempted mid-block too).
    let mut e = Emulator::new(&[&ATOMICS]).unwrap();
    e.threads = 4;
    let (blocks, threads) = (64usize, 128usize);
    let total = blocks * threads;
    let zero = |bytes| Buf::zeroed(&e, bytes);
    let (i_sum, u_sum, ull_sum, f_sum, d_sum) = (zero(4), zero(4), zero(8), zero(4), zero(8));
    let (i_max, i_min) = (Buf::from(&e, &[i32::MIN]), Buf::from(&e, &[i32::MAX]));
    let (cas, exch, bits) = (zero(4), Buf::from(&e, &[-1i32]), zero(total / 8));
    let a = args(&[&i_sum, &u_sum, &ull_sum, &f_sum, &d_sum, &i_max, &i_min, &cas, &exch, &bits]);
    run(&e, &ATOMICS, "atomics", LaunchConfig::linear(blocks as u32, threads as u32), &a).unwrap();
    let vals: Vec<i32> = (0..total as i32).map(|g| (g * 7919) % 10007 - 5000).collect();
    assert_eq!(i_sum.read::<i32>()[0], total as i32);
    assert_eq!(u_sum.read::<u32>()[0], 2 * total as u32);
    assert_eq!(ull_sum.read::<u64>()[0], (total as u64 - 1) * total as u64 / 2);
    assert_eq!(f_sum.read::<f32>()[0], total as f32);
    assert_eq!(d_sum.read::<f64>()[0], total as f64 / 2.0);
    assert_eq!(i_max.read::<i32>()[0], *vals.iter().max().unwrap());
    assert_eq!(i_min.read::<i32>()[0], *vals.iter().min().unwrap());
    assert_eq!(cas.read::<i32>()[0], 3 * total as i32);
    assert!((0..total as i32).contains(&exch.read::<i32>()[0]));
    assert!(bits.read::<u32>().iter().all(|&w| w == u32::MAX));
}

#[test]
fn blocks_take_turns_through_flags_and_a_failure_ends_the_waits() {
    // Four OS threads: blocks wait for blocks running on other workers (or done before them).
    let mut e = Emulator::new(&[&ATOMICS]).unwrap();
    e.threads = 4;
    let blocks = 64usize;
    let launch = |fail_block: i32| {
        let (flag, order, counter) = (Buf::zeroed(&e, 4), Buf::zeroed(&e, 4 * blocks), Buf::zeroed(&e, 4));
        let mut a = args(&[&flag, &order, &counter]);
        a.push(fail_block);
        let r = run(&e, &ATOMICS, "flags_in_order", LaunchConfig::linear(blocks as u32, 32), &a);
        (r, order.read::<u32>())
    };
    let (r, order) = launch(-1);
    r.unwrap();
    assert_eq!(order, (0..blocks as u32).collect::<Vec<_>>());
    let t0 = Instant::now();
    let (r, _) = launch(3);
    let err = device_error(r, "flags_in_order");
    assert!(err.contains("__trap()") || err.contains("another block failed"), "{err}");
    assert!(t0.elapsed().as_secs() < 30, "the waits ended by the timeout, not by the failure: {err}");
}

#[test]
fn conversions_match_the_half_crate() {
    let e = emu();
    // Every 4099th f32 bit pattern, and the edges: zeros, infinities, NaNs, the largest values, ties to even.
    let mut x: Vec<f32> = (0..=u32::MAX / 4099).map(|i| f32::from_bits(i * 4099)).collect();
    x.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::MAX, f32::MIN_POSITIVE]);
    x.extend([65504.0, 65519.99, 65520.0, 2f32.powi(-24), 2f32.powi(-25), 2f32.powi(-25) * 1.0001, 2f32.powi(-14)]);
    x.extend([1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), 1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11)]);
    let n = x.len();
    let (xb, bf, hf, bfb, hfb) =
        (Buf::from(e, &x), Buf::new(e, 2 * n), Buf::new(e, 2 * n), Buf::new(e, 4 * n), Buf::new(e, 4 * n));
    let mut a = KernelArgs::new();
    a.push(xb.ptr).push(n as i32).push(bf.ptr).push(hf.ptr).push(bfb.ptr).push(hfb.ptr);
    run(e, &CONVERT, "narrow", LaunchConfig::linear(64, 256), &a).unwrap();
    let (bf, hf, bfb, hfb) = (bf.read::<u16>(), hf.read::<u16>(), bfb.read::<f32>(), hfb.read::<f32>());
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    for i in 0..n {
        let (b, h) = (bf16::from_f32(x[i]), f16::from_f32(x[i]));
        assert!(
            same(bf16::from_bits(bf[i]).to_f32(), b.to_f32()),
            "bf16({:e} = {:#x}): {:#x} vs {:#x}",
            x[i],
            x[i].to_bits(),
            bf[i],
            b.to_bits()
        );
        assert!(
            same(f16::from_bits(hf[i]).to_f32(), h.to_f32()),
            "f16({:e} = {:#x}): {:#x} vs {:#x}",
            x[i],
            x[i].to_bits(),
            hf[i],
            h.to_bits()
        );
        assert!(same(bfb[i], b.to_f32()) && same(hfb[i], h.to_f32()), "round trip of {:e}", x[i]);
    }
    let (wb, wh) = (Buf::new(e, 4 << 16), Buf::new(e, 4 << 16));
    run(e, &CONVERT, "widen", LaunchConfig::linear(256, 256), &args(&[&wb, &wh])).unwrap();
    for (i, (b, h)) in wb.read::<f32>().into_iter().zip(wh.read::<f32>()).enumerate() {
        assert!(same(b, bf16::from_bits(i as u16).to_f32()), "bf16 {i:#x} widened to {b:e}");
        assert!(same(h, f16::from_bits(i as u16).to_f32()), "f16 {i:#x} widened to {h:e}");
    }
}

#[test]
fn math_builtins_compute_what_the_host_does() {
    let e = emu();
    let mut x: Vec<f32> = values(200, 9).into_iter().map(|v| v * 3.0).collect();
    x.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 0.0, -0.0, 1e-40]);
    let n = x.len();
    let (xb, out) = (Buf::from(e, &x), Buf::new(e, n * 32 * 4));
    let mut a = KernelArgs::new();
    a.push(xb.ptr).push(out.ptr).push(n as i32).push(1.0f32);
    run(e, &MATH, "math_builtins", LaunchConfig::linear(n.div_ceil(64) as u32, 64), &a).unwrap();
    let out = out.read::<f32>();
    for (i, &v) in x.iter().enumerate() {
        let o = &out[i * 32..(i + 1) * 32];
        let (d, a) = (f64::from(v), v.abs() + 1.0);
        let flags = [v.is_infinite(), v.is_nan(), v.is_finite()].map(|b| if b { 1.0 } else { 0.0 });
        assert_eq!(&o[20..23], &flags, "x = {v}: isinf, isnan, isfinite");
        if !v.is_finite() {
            continue;
        }
        let want = [
            v.exp(),
            v.exp2(),
            a.ln(),
            a.log2(),
            v.exp(),
            a.ln(),
            1.0 / a.sqrt(),
            v.abs().sqrt(),
            v.max(0.25),
            v.min(0.25),
            v.mul_add(v, 1.0),
            v / 3.0,
            v.tanh(),
            v.sin(),
            v.cos(),
            d.sin() as f32,
            d.cos() as f32,
            (d.sin() + d.cos()) as f32,
            d.exp() as f32,
            (d.abs() + 1.0).ln() as f32,
            o[20],
            o[21],
            o[22],
            -v,
            v,
            (i.min(7) + i.max(7)) as f32,
            v.min(0.5),
            v.max(0.5),
            2.0 * v,
            if v.abs() < f32::MIN_POSITIVE { 1.0 } else { v.exp2() },
            v.clamp(0.0, 1.0),
            v.to_bits().count_ones() as f32,
        ];
        for (k, (&g, &w)) in o.iter().zip(&want).enumerate() {
            // libm and glibc may differ in the last bit; the GPU's fast intrinsics by a few more.
            assert!((g - w).abs() <= 4.0 * f32::EPSILON * w.abs().max(1.0), "x = {v}: result {k} is {g}, expected {w}");
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// What the emulator must report.

#[test]
fn a_divergent_syncthreads_is_an_error_not_a_hang() {
    let out = Buf::new(emu(), 64 * 4);
    let e = device_error(
        run(emu(), &ERRORS, "divergent_barrier", LaunchConfig::linear(1, 64), &args(&[&out])),
        "divergent_barrier",
    );
    assert!(e.contains("divergent __syncthreads") && e.contains("errors.cu:"), "{e}");
}

#[test]
fn collectives_that_cannot_complete_are_errors() {
    let out = Buf::new(emu(), 64 * 4);
    let e = device_error(
        run(emu(), &ERRORS, "collective_never_reached", LaunchConfig::linear(1, 64), &args(&[&out])),
        "collective_never_reached",
    );
    assert!(e.contains("deadlock") && e.contains("__shfl_xor_sync") && e.contains("__syncthreads"), "{e}");
    let e = device_error(
        run(emu(), &ERRORS, "lane_exits_early", LaunchConfig::linear(1, 32), &args(&[&out])),
        "lane_exits_early",
    );
    assert!(e.contains("exited"), "{e}");
    let e =
        device_error(run(emu(), &ERRORS, "partial_mask", LaunchConfig::linear(1, 32), &args(&[&out])), "partial_mask");
    assert!(e.contains("0x0000ffff") && e.contains("full mask"), "{e}");
    // 48 threads: the second warp has 16 lanes, and a full-mask shuffle names lanes that do not exist.
    let (o, d) = (Buf::new(emu(), 48 * 16 * 4), Buf::new(emu(), 48 * 8));
    let e = device_error(run(emu(), &REDUCE, "shuffles", LaunchConfig::linear(1, 48), &args(&[&o, &d])), "shuffles");
    assert!(e.contains("not whole warps"), "{e}");
}

#[test]
fn named_barriers_order_two_groups_turn_by_turn() {
    let e = emu();
    let rounds = 5;
    let log = Buf::from(e, &vec![-1i32; 2 * rounds]);
    let mut a = KernelArgs::new();
    a.push(log.ptr).push(rounds as i32).push(1i32);
    run(e, &NAMED_BARRIERS, "ping_pong", LaunchConfig::linear(2, 160), &a).unwrap();
    // Both blocks wrote the same log (in turn order within each): group 0, group 1, group 0, ...
    let want: Vec<i32> = (0..rounds as i32).flat_map(|r| [r, 1000 + r]).collect();
    assert_eq!(log.read::<i32>(), want);

    let out = Buf::from(e, &[0i32; 64]);
    run(e, &NAMED_BARRIERS, "hand_over", LaunchConfig::linear(1, 64), &args(&[&out])).unwrap();
    let want: Vec<i32> = (0..2).flat_map(|r| (0..32).map(move |l| ((l + 1) % 32) * 3 + 100 * r)).collect();
    assert_eq!(out.read::<i32>(), want);
}

#[test]
fn named_barriers_that_cannot_complete_or_do_not_balance_are_errors() {
    let e = emu();
    // The ping-pong without group 0's first turn: each group waits for the other.
    let log = Buf::new(e, 2 * 4 * 4);
    let mut a = KernelArgs::new();
    a.push(log.ptr).push(4i32).push(0i32);
    let err = device_error(run(e, &NAMED_BARRIERS, "ping_pong", LaunchConfig::linear(1, 160), &a), "ping_pong");
    assert!(
        err.contains("deadlock")
            && err.contains("64 threads (the first: 64) at bar.sync 1 at named_barriers.cu:")
            && err.contains("64 threads (the first: 0) at bar.sync 2 at named_barriers.cu:")
            && err.contains("named barrier 1 has 64 of its 128 threads")
            && err.contains("32 threads exited"),
        "{err}"
    );
    let out = Buf::new(e, 128 * 4);
    let err = device_error(
        run(e, &ERRORS, "named_barrier_never_completes", LaunchConfig::linear(1, 128), &args(&[&out])),
        "named_barrier_never_completes",
    );
    assert!(
        err.contains("deadlock")
            && err.contains("64 threads (the first: 0) at bar.sync 1 at errors.cu:")
            && err.contains("64 threads exited")
            && err.contains("named barrier 1 has 64 of its 96 threads"),
        "{err}"
    );
    let run1 =
        |name: &'static str| device_error(run(e, &ERRORS, name, LaunchConfig::linear(1, 128), &args(&[&out])), name);
    let err = run1("named_barrier_count_mismatch");
    assert!(
        err.contains("thread (32,0,0): bar.sync 2, 96 at errors.cu:") && err.contains("counts 64 threads"),
        "{err}"
    );
    let err = run1("named_barrier_left_open");
    assert!(err.contains("named barrier 3's phase open: 32 of its 64 threads arrived"), "{err}");
    let err = run1("named_barrier_zero");
    assert!(err.contains("bar.sync 0 at errors.cu:") && err.contains("0 is __syncthreads'"), "{err}");
}

#[test]
fn a_write_outside_a_buffer_is_reported_with_the_kernel() {
    // Its own emulator: the guard check after a launch looks at every allocation of the emulator.
    let e = Emulator::new(&[&ERRORS]).unwrap();
    let out = Buf::new(&e, 100 * 4);
    let mut a = KernelArgs::new();
    a.push(out.ptr).push(100i32);
    let msg = device_error(run(&e, &ERRORS, "write_past_end", LaunchConfig::linear(1, 128), &a), "write_past_end");
    assert!(
        msg.contains("wrote outside a buffer") && msg.contains("past its end of 400 bytes (the first at byte 400)"),
        "{msg}"
    );
    // Reported once: the guard is repaired.
    let mut a = KernelArgs::new();
    a.push(out.ptr).push(99i32);
    run(&e, &ERRORS, "write_past_end", LaunchConfig::linear(1, 128), &a).unwrap();
    drop(out);
    assert_eq!(e.memory_used(), 0);
}

#[test]
fn arguments_of_the_wrong_size_are_refused_naming_the_parameter() {
    let out = Buf::new(emu(), 8);
    let mut a = KernelArgs::new();
    a.push(out.ptr).push(1.5f32);
    let e = device_error(run(emu(), &ERRORS, "takes_double", LaunchConfig::linear(1, 32), &a), "takes_double");
    assert!(e.contains("argument 1 is 4 bytes, but parameter 1 is `double` of 8 bytes"), "{e}");
    let e =
        device_error(run(emu(), &ERRORS, "takes_double", LaunchConfig::linear(1, 32), &args(&[&out])), "takes_double");
    assert!(e.contains("1 arguments given, the kernel has 2 parameters (double*, double)"), "{e}");
    let mut a = KernelArgs::new();
    a.push(out.ptr).push(1.5f64);
    run(emu(), &ERRORS, "takes_double", LaunchConfig::linear(1, 32), &a).unwrap();
    assert_eq!(out.read::<f64>(), vec![1.5]);
    let e =
        run(emu(), &ERRORS, Box::leak("no_such_kernel".to_string().into_boxed_str()), LaunchConfig::linear(1, 1), &a);
    assert!(device_error(e, "no_such_kernel").contains("defines no kernel of that name"));
}

#[test]
fn launch_configurations_the_gpu_refuses_are_refused() {
    let out = Buf::new(emu(), 8);
    let mut a = KernelArgs::new();
    a.push(out.ptr).push(1.0f64);
    let refused = |c: LaunchConfig, what: &str| {
        let e = device_error(run(emu(), &ERRORS, "takes_double", c, &a), "takes_double");
        assert!(e.contains(what), "{c:?}: {e}");
    };
    refused(LaunchConfig::linear(1, 2048), "block.x = 2048 is more than the limit 1024");
    refused(cfg([1, 1, 1], [32, 32, 2], 0), "a block of 2048 threads");
    refused(cfg([1, 1, 1], [1, 1, 65], 0), "block.z = 65");
    refused(cfg([0, 1, 1], [32, 1, 1], 0), "at least 1");
    refused(cfg([1, 65536, 1], [32, 1, 1], 0), "grid.y = 65536");
    refused(cfg([1, 1, 1], [32, 1, 1], 228 * 1024), "more than the limit of 232448");
}

#[test]
fn traps_and_failed_asserts_are_errors_naming_the_thread() {
    let out = Buf::new(emu(), 64 * 4);
    let e = device_error(run(emu(), &ERRORS, "traps", LaunchConfig::linear(2, 32), &args(&[&out])), "traps");
    assert!(e.contains("block (1,0,0) thread (5,0,0): __trap() at errors.cu:"), "{e}");
    let x: Vec<i32> = (0..32).collect();
    let xb = Buf::from(emu(), &x);
    let mut a = KernelArgs::new();
    a.push(xb.ptr).push(20i32);
    let e = device_error(run(emu(), &ERRORS, "asserts", LaunchConfig::linear(1, 32), &a), "asserts");
    assert!(e.contains("thread (20,0,0): assertion `x[threadIdx.x] < limit` failed at errors.cu:"), "{e}");
    let mut a = KernelArgs::new();
    a.push(xb.ptr).push(32i32);
    run(emu(), &ERRORS, "asserts", LaunchConfig::linear(1, 32), &a).unwrap();
}

#[test]
fn shared_memory_starts_every_block_poisoned() {
    let out = Buf::new(emu(), 4 * 32 * 4);
    run(emu(), &ERRORS, "stale_shared", LaunchConfig::linear(4, 32), &args(&[&out])).unwrap();
    let got = out.read::<f32>();
    for (i, v) in got.iter().enumerate() {
        let (block, t) = (i / 32, i % 32);
        if block == 0 && t < 16 {
            assert_eq!(*v, 1.0, "block {block} thread {t}");
        } else {
            assert!(v.is_nan(), "block {block} thread {t} read {v} from shared memory no one of its block wrote");
        }
    }
}

#[test]
fn shared_memory_misuse_is_reported() {
    let mut a = KernelArgs::new();
    a.push(0i32);
    let e = device_error(
        run(emu(), &ERRORS, "dynamic_smem_overflow", cfg([1, 1, 1], [64, 1, 1], 256), &a),
        "dynamic_smem_overflow",
    );
    assert!(e.contains("wrote past the end of its 256 bytes of dynamic shared memory (at byte 256)"), "{e}");
    let (g, out) = (Buf::zeroed(emu(), 256), Buf::new(emu(), 128));
    let e = device_error(
        run(emu(), &ERRORS, "ldmatrix_from_global", LaunchConfig::linear(1, 32), &args(&[&g, &out])),
        "ldmatrix_from_global",
    );
    assert!(e.contains("ldmatrix.x1") && e.contains("not in the block's shared memory"), "{e}");
}

#[test]
fn a_compile_error_names_the_file() {
    static BROKEN: KernelSource = KernelSource {
        file: "broken.cu",
        code: "extern \"C\" __global__ void broken(int* x) {\n    x[0] = undefined_name;\n}\n",
        kernels: &["broken"],
        includes: &[],
    };
    match Emulator::new(&[&BROKEN]) {
        Err(KernelError::Compile { file, target, log }) => {
            assert_eq!((file, target.as_str()), ("broken.cu", "host emulator"));
            assert!(log.contains("broken.cu:2") && log.contains("undefined_name"), "{log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// The GPU side of the same text.

/// NVRTC compiles every test source (common.cuh, ptx.cuh and the kernel) for sm_80 and sm_90 without a warning.
/// Skipped, saying why, where libnvrtc cannot be loaded (put its directory on LD_LIBRARY_PATH) or
/// LONGCTX_CUDA_INCLUDE (the directory of cuda_bf16.h) is not set.
#[test]
fn the_same_sources_compile_with_nvrtc_without_warnings() {
    use cudarc::nvrtc::result;
    // SAFETY: is_culib_present only tries to load the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!(
            "skipped: libnvrtc could not be loaded (add its directory, e.g. nvidia/cu13/lib, to LD_LIBRARY_PATH)"
        );
        return;
    }
    let Some(include) = std::env::var_os("LONGCTX_CUDA_INCLUDE") else {
        eprintln!("skipped: LONGCTX_CUDA_INCLUDE (the directory of cuda_bf16.h) is not set");
        return;
    };
    let include = format!("--include-path={}", include.to_string_lossy());
    for src in ALL {
        let text = std::ffi::CString::new(translation_unit(src)).unwrap();
        let name = std::ffi::CString::new(src.file).unwrap();
        for arch in ["sm_80", "sm_90"] {
            let prog = result::create_program(&text, Some(&name)).unwrap();
            let opts = [format!("--gpu-architecture={arch}"), "--std=c++17".into(), include.clone()];
            // SAFETY: `prog` was just created and is destroyed once, last.
            let (compiled, log) = unsafe {
                let compiled = result::compile_program(prog, &opts);
                let log = result::get_program_log(prog).unwrap();
                result::destroy_program(prog).unwrap();
                (compiled, log)
            };
            let log: String = log.iter().take_while(|&&c| c != 0).map(|&c| c as u8 as char).collect();
            assert!(compiled.is_ok() && !log.contains("warning"), "{} for {arch}: {compiled:?}\n{log}", src.file);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Figures.

/// What the emulator costs: a cold build of the test sources (a fresh cache directory), a 128-thread block doing
/// 1000 `__syncthreads`, launches that do nothing, 1000 emulated `mma.sync` per warp. Run alone (`--ignored --nocapture`) for figures.
#[test]
#[ignore]
fn emulator_figures() {
    let dir = std::env::temp_dir().join(format!("longctx-emu-figures-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let t = Instant::now();
    super::compile::build_in(&ALL, &dir).unwrap();
    let cold = t.elapsed();
    let t = Instant::now();
    super::compile::build_in(&ALL, &dir).unwrap();
    let warm = t.elapsed();
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("build of the {} test sources: cold {cold:.2?}, cached {warm:.2?}", ALL.len());

    // The best of five runs of each (the first also makes the workers' fiber regions).
    let best = |f: &dyn Fn()| {
        (0..5)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed()
            })
            .min()
            .unwrap()
    };
    let e = emu();
    let out = Buf::new(e, 1024 * 4 * 4);
    for threads in [128u32, 1024] {
        let mut a = KernelArgs::new();
        a.push(500i32).push(out.ptr);
        let dt = best(&|| run(e, &FIGURES, "many_barriers", LaunchConfig::linear(1, threads), &a).unwrap());
        eprintln!(
            "{threads}-thread block, 1000 __syncthreads: {dt:.2?} ({:.1} ns per thread per barrier)",
            dt.as_nanos() as f64 / (1000.0 * f64::from(threads))
        );
    }
    for blocks in [1u32, 64] {
        let mut a = KernelArgs::new();
        a.push(0i32).push(out.ptr);
        let dt = best(&|| run(e, &FIGURES, "many_barriers", LaunchConfig::linear(blocks, 32), &a).unwrap());
        eprintln!("a launch of {blocks} block(s) of 32 threads doing nothing: {dt:.2?}");
    }
    for warps in [1u32, 4] {
        let mut a = KernelArgs::new();
        a.push(1000i32).push(out.ptr);
        let dt = best(&|| run(e, &FIGURES, "many_mma", LaunchConfig::linear(1, 32 * warps), &a).unwrap());
        eprintln!(
            "{warps} warp(s), 1000 mma.m16n8k16 each: {dt:.2?} ({:.2} us per warp-wide mma)",
            dt.as_secs_f64() * 1e6 / (1000.0 * f64::from(warps))
        );
    }
}
