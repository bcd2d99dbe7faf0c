//! The AVX2 + FMA kernels: 6 × 16 register tiles, a packed-panel path for A read transposed, and an `exp2`
//! built in the exponent bits.

#![allow(clippy::needless_range_loop)] // register arrays indexed by row: the index is the point

use std::arch::x86_64::*;

/// Rows of `C` per micro-tile: 6 rows × 16 columns keep 12 accumulators in the 16 ymm registers.
const MR: usize = 6;
/// Reduction lengths up to this take a transposed-A panel on the stack (`PW·PACK_K` floats, 8 KiB).
const PACK_K: usize = 256;
/// Floats per step of a packed A panel: `MR` rounded up to a whole vector, so a step is one load and store.
const PW: usize = 8;

/// # Safety
/// AVX2 and FMA must be present, and the slices behind the pointers must cover the extents
/// `(m-1)*ld + cols` that the caller asserted.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn matmul(
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    ldb: usize,
    b_js: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        // A read transposed (`a_cs != 1`, the backward's `Pᵀ·dO` and `dSᵀ·Q`): each row block's slice of A is
        // copied first into a contiguous `[k][PW]` panel. Read in place, a block walks `k` cache lines one
        // leading dimension apart (512 bytes at BC = 128), which map to only 8 of the 64 L1 sets, the very
        // sets the equally strided B rows use, so A and B keep evicting each other; packed, the panel takes
        // `k·PW·4` contiguous bytes. The copy costs one vector move per step of `k`, against `MR·n`
        // multiply-adds, and changes no arithmetic (results bit-identical), so it pays wherever the conflicts do.
        if a_cs != 1 {
            return matmul_packed_a(m, n, k, a, a_rs, a_cs, b, ldb, b_js, c, ldc, accumulate);
        }
        let mut i = 0;
        while i < m {
            let rows = (m - i).min(MR);
            let ap = a.add(i * a_rs);
            block::<0>(rows, n, k, ap, a_rs, a_cs, b, ldb, b_js, c.add(i * ldc), ldc, accumulate);
            i += rows;
        }
    }
}

/// [`matmul`] for A read transposed, through packed panels (see there). Kept out of line so that its
/// 8 KiB stack panel does not enlarge (and stack-probe) the frame of every other product.
///
/// # Safety
/// As [`matmul`].
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
#[inline(never)]
unsafe fn matmul_packed_a(
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    ldb: usize,
    b_js: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        let mut stack = [0f32; PW * PACK_K];
        let mut heap = Vec::new();
        let panel: &mut [f32] = if k <= PACK_K {
            &mut stack
        } else {
            heap.resize(PW * k, 0.0);
            &mut heap
        };
        let dst = panel.as_mut_ptr();
        let mut i = 0;
        while i < m {
            let rows = (m - i).min(MR);
            let ap = a.add(i * a_rs);
            if a_rs == 1 && i + PW <= m {
                // One 8-wide load and store per step; lanes past `rows` belong to the next block, unused.
                for p in 0..k {
                    _mm256_storeu_ps(dst.add(p * PW), _mm256_loadu_ps(ap.add(p * a_cs)));
                }
            } else {
                for p in 0..k {
                    for r in 0..rows {
                        *dst.add(p * PW + r) = *ap.add(p * a_cs + r * a_rs);
                    }
                }
            }
            block::<1>(rows, n, k, dst, 1, PW, b, ldb, b_js, c.add(i * ldc), ldc, accumulate);
            i += rows;
        }
    }
}

/// Rows `0..rows` (at most `MR`) of `C`: the micro-tile of that height (`S` as for [`tile`]).
///
/// # Safety
/// As [`matmul`].
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn block<const S: u8>(
    rows: usize,
    n: usize,
    k: usize,
    ap: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    ldb: usize,
    b_js: usize,
    cp: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        match rows {
            6 => tile::<6, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate),
            5 => tile::<5, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate),
            4 => tile::<4, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate),
            3 => tile::<3, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate),
            2 => tile::<2, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate),
            _ => tile::<1, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate),
        }
    }
}

/// `M` rows of `C`, all `n` columns, 16 (then 8) at a time. `S = 1`: A is a packed panel (`a_rs = 1`,
/// `a_cs = PW`, the arguments are ignored); `S = 0`: strides as given. With the panel's strides constant
/// the broadcasts of a step are one base register plus fixed displacements; with run-time strides the
/// compiler spends an integer add per row on every step of `k` to form their addresses, in the innermost loop
/// of the backward's two transposed products (results bit-identical either way).
///
/// # Safety
/// As [`matmul`].
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn tile<const M: usize, const S: u8>(
    n: usize,
    k: usize,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    ldb: usize,
    b_js: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        let (a_rs, a_cs) = if S == 1 { (1, PW) } else { (a_rs, a_cs) };
        let mut j = 0;
        while j + 16 <= n {
            let mut c0 = [_mm256_setzero_ps(); M];
            let mut c1 = [_mm256_setzero_ps(); M];
            let mut bp = b.add(j * b_js);
            for p in 0..k {
                let b0 = _mm256_loadu_ps(bp);
                let b1 = _mm256_loadu_ps(bp.add(8));
                for r in 0..M {
                    let av = _mm256_broadcast_ss(&*a.add(r * a_rs + p * a_cs));
                    c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
                    c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
                }
                bp = bp.add(ldb);
            }
            for r in 0..M {
                let cr = c.add(r * ldc + j);
                if accumulate {
                    c0[r] = _mm256_add_ps(c0[r], _mm256_loadu_ps(cr));
                    c1[r] = _mm256_add_ps(c1[r], _mm256_loadu_ps(cr.add(8)));
                }
                _mm256_storeu_ps(cr, c0[r]);
                _mm256_storeu_ps(cr.add(8), c1[r]);
            }
            j += 16;
        }
        if j < n {
            // n is a multiple of 8: one 8-wide column block remains.
            let mut c0 = [_mm256_setzero_ps(); M];
            let mut bp = b.add(j * b_js);
            for p in 0..k {
                let b0 = _mm256_loadu_ps(bp);
                for r in 0..M {
                    let av = _mm256_broadcast_ss(&*a.add(r * a_rs + p * a_cs));
                    c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
                }
                bp = bp.add(ldb);
            }
            for r in 0..M {
                let cr = c.add(r * ldc + j);
                if accumulate {
                    c0[r] = _mm256_add_ps(c0[r], _mm256_loadu_ps(cr));
                }
                _mm256_storeu_ps(cr, c0[r]);
            }
        }
    }
}

/// `2^x` for `x <= 126`: `x = n + f` with `n = round(x)`, `|f| <= 1/2`, `2^f = 1 + f·P(f)` (the degree-5
/// minimax polynomial of Cephes `exp2f`, relative error about 2e-7), and `2^n` built in the exponent bits.
/// Inputs at or below -128 (including `-inf`) give exactly 0.
///
/// One addition does both the rounding and the integer conversion: `t = x + (1.5·2^23 + 128)` rounds `x` to
/// the nearest integer (ties to even, as `vroundps` does: the offset is even) because the sum's last
/// mantissa bit is worth 1, and leaves `n + 128` in the low mantissa bits, so shifting `t`'s bits left by 23
/// puts `n + 128` in the exponent field (the bits above it fall off): that is `2^(n+1)`, so the polynomial
/// runs with every coefficient halved and gives `2^f / 2`. Halving is exact at every step, so the product
/// equals `2^f · 2^n` bit for bit: the same results as the AVX-512 `exp2` wherever both are normal.
/// 11 vector operations instead of 13 with `vroundps` and `vcvtps2dq`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp2(x: __m256) -> __m256 {
    const SHIFT: f32 = 12_583_040.0; // 1.5 * 2^23 + 128
    let x = _mm256_max_ps(x, _mm256_set1_ps(-128.0));
    let t = _mm256_add_ps(x, _mm256_set1_ps(SHIFT));
    let n = _mm256_sub_ps(t, _mm256_set1_ps(SHIFT));
    let f = _mm256_sub_ps(x, n);
    let mut p = _mm256_set1_ps(1.535_336_2e-4 * 0.5);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339_887_4e-3 * 0.5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618_437e-3 * 0.5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550_332_5e-2 * 0.5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402_264_8e-1 * 0.5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931_472e-1 * 0.5));
    let half_frac = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5));
    // n + 128 in the exponent field; n = -128 gives the bit pattern of +0.0.
    let bits = _mm256_slli_epi32(_mm256_castps_si256(t), 23);
    _mm256_mul_ps(half_frac, _mm256_castsi256_ps(bits))
}

/// # Safety
/// AVX2 and FMA must be present.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn max(x: &[f32]) -> f32 {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        let n8 = x.len() / 8 * 8;
        let p = x.as_ptr();
        // Four accumulators hide the latency of `max` (four cycles: with two, a 128-wide row waited on the
        // chain); `vmaxps` returns its second operand when the first is NaN, so NaN elements are skipped
        // exactly as `f32::max` does.
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let (mut m0, mut m1, mut m2, mut m3) = (ninf, ninf, ninf, ninf);
        let mut j = 0;
        while j + 32 <= n8 {
            m0 = _mm256_max_ps(_mm256_loadu_ps(p.add(j)), m0);
            m1 = _mm256_max_ps(_mm256_loadu_ps(p.add(j + 8)), m1);
            m2 = _mm256_max_ps(_mm256_loadu_ps(p.add(j + 16)), m2);
            m3 = _mm256_max_ps(_mm256_loadu_ps(p.add(j + 24)), m3);
            j += 32;
        }
        while j < n8 {
            m0 = _mm256_max_ps(_mm256_loadu_ps(p.add(j)), m0);
            j += 8;
        }
        // No lane holds NaN, so the order cannot matter: a tree of three steps rather than eight dependent
        // scalar ones, which cost as much as the whole vector loop of a 128-wide row.
        let m = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
        let mut m = reduce_max(m);
        for v in &x[j..] {
            m = m.max(*v);
        }
        m
    }
}

/// The largest of the eight lanes (none of them NaN), in a tree.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn reduce_max(v: __m256) -> f32 {
    let h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)))
}

/// The sum of the eight lanes, in a fixed tree: `(l0 + l4) + (l2 + l6)` and so on.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn reduce_add(v: __m256) -> f32 {
    let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)))
}

/// # Safety
/// AVX2 and FMA must be present.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn scale(y: &mut [f32], a: f32) {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        let n8 = y.len() / 8 * 8;
        let p = y.as_mut_ptr();
        let av = _mm256_set1_ps(a);
        let mut j = 0;
        while j < n8 {
            _mm256_storeu_ps(p.add(j), _mm256_mul_ps(_mm256_loadu_ps(p.add(j)), av));
            j += 8;
        }
        for v in &mut y[j..] {
            *v *= a;
        }
    }
}

/// # Safety
/// AVX2 and FMA must be present, and `ds` at least as long as `p`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn probs_and_ds(p: &mut [f32], ds: &mut [f32], c: f32, m: f32, di: f32) {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        let (cv, mv, dv) = (_mm256_set1_ps(c), _mm256_set1_ps(m), _mm256_set1_ps(di));
        let n8 = p.len() / 8 * 8;
        let (pp, gp) = (p.as_mut_ptr(), ds.as_mut_ptr());
        let mut j = 0;
        while j < n8 {
            let pr = exp2(_mm256_fmsub_ps(_mm256_loadu_ps(pp.add(j)), cv, mv));
            _mm256_storeu_ps(pp.add(j), pr);
            _mm256_storeu_ps(gp.add(j), _mm256_mul_ps(pr, _mm256_sub_ps(_mm256_loadu_ps(gp.add(j)), dv)));
            j += 8;
        }
        if j < p.len() {
            // The tail through the same polynomial, padded with -inf (which gives 0), as in `exp2_scaled_sum`.
            let rest = p.len() - j;
            let (mut pt, mut gt) = ([f32::NEG_INFINITY; 8], [0f32; 8]);
            pt[..rest].copy_from_slice(&p[j..]);
            gt[..rest].copy_from_slice(&ds[j..j + rest]);
            let pr = exp2(_mm256_fmsub_ps(_mm256_loadu_ps(pt.as_ptr()), cv, mv));
            _mm256_storeu_ps(pt.as_mut_ptr(), pr);
            _mm256_storeu_ps(gt.as_mut_ptr(), _mm256_mul_ps(pr, _mm256_sub_ps(_mm256_loadu_ps(gt.as_ptr()), dv)));
            p[j..].copy_from_slice(&pt[..rest]);
            ds[j..j + rest].copy_from_slice(&gt[..rest]);
        }
    }
}

/// # Safety
/// AVX2 and FMA must be present.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp2_scaled_sum(x: &mut [f32], c: f32, m: f32) -> f32 {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        let cv = _mm256_set1_ps(c);
        let mv = _mm256_set1_ps(m);
        let mut acc = _mm256_setzero_ps();
        let n8 = x.len() / 8 * 8;
        let p = x.as_mut_ptr();
        let mut j = 0;
        while j < n8 {
            let v = exp2(_mm256_fmsub_ps(_mm256_loadu_ps(p.add(j)), cv, mv));
            _mm256_storeu_ps(p.add(j), v);
            acc = _mm256_add_ps(acc, v);
            j += 8;
        }
        let mut s = 0f32;
        if j < x.len() {
            // The tail goes through the same polynomial, padded with -inf (which gives 0).
            let mut tail = [f32::NEG_INFINITY; 8];
            let rest = x.len() - j;
            tail[..rest].copy_from_slice(&x[j..]);
            let v = exp2(_mm256_fmsub_ps(_mm256_loadu_ps(tail.as_ptr()), cv, mv));
            _mm256_storeu_ps(tail.as_mut_ptr(), v);
            x[j..].copy_from_slice(&tail[..rest]);
            for t in &tail[..rest] {
                s += t;
            }
        }
        // A fixed tree of lane sums (see `max`).
        reduce_add(acc) + s
    }
}
