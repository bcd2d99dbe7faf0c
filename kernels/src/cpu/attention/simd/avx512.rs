//! The AVX-512F kernels: [`super::avx2`]'s loops at twice the width, with register tiles of `MR = 12` rows × 32
//! columns (24 of the 32 zmm registers accumulate, two hold the B row, broadcasts of A come from memory).
//! Each `C` element takes the same multiply-adds in the same order as on the AVX2 path, so products are
//! bit-identical to it. `exp2` differs only below 2⁻¹²⁶ (exactly 0 here), and its row sums in lane count.

#![allow(clippy::needless_range_loop)] // register arrays indexed by row: the index is the point

use std::arch::x86_64::*;

/// Rows of `C` per micro-tile; the forward's products run 12 rows at a time, so they take exactly one.
const MR: usize = 12;
/// The low eight lanes: the last 8 columns when `n` is not a multiple of 16.
const LOW8: __mmask16 = 0x00ff;

/// # Safety
/// AVX-512F must be present, and the slices behind the pointers must cover the extents `(m-1)*ld + cols`
/// that the caller asserted.
#[target_feature(enable = "avx512f")]
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
        // A read transposed (`a_rs == 1`: the backward's `Pᵀ·dO` and `dSᵀ·Q`) is read in place, with the row
        // stride known to the compiler (`S = 2`): a step's 12 broadcasts are one base register plus fixed
        // displacements. The AVX2 path copies such A blocks into packed panels first, which on its 8-way 32 KiB
        // L1 kept A and B from evicting each other; a 12-way 48 KiB L1, as AVX-512 machines have, holds both
        // strided operands of a 128-wide tile without the conflicts, so the copy there is pure overhead.
        let mut i = 0;
        while i < m {
            let rows = (m - i).min(MR);
            let (ap, cp) = (a.add(i * a_rs), c.add(i * ldc));
            if a_rs == 1 {
                block::<2>(rows, n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate);
            } else {
                block::<0>(rows, n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate);
            }
            i += rows;
        }
    }
}

/// Rows `0..rows` (at most `MR`) of `C`: the micro-tile of that height.
///
/// # Safety
/// As [`matmul`].
#[target_feature(enable = "avx512f")]
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
    acc: bool,
) {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        match rows {
            12 => tile::<12, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, acc),
            11 => tile::<11, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, acc),
            10 => tile::<10, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, acc),
            9 => tile::<9, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, acc),
            8 => tile::<8, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, acc),
            7 => tile::<7, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, acc),
            6 => tile::<6, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, acc),
            5 => tile::<5, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, acc),
            4 => tile::<4, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, acc),
            3 => tile::<3, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, acc),
            2 => tile::<2, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, acc),
            _ => tile::<1, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, acc),
        }
    }
}

/// Stores (or adds into) one 16-column row segment of `C` under `mask`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn put(cr: *mut f32, mask: __mmask16, v: __m512, accumulate: bool) {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        let v = if accumulate { _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, cr)) } else { v };
        _mm512_mask_storeu_ps(cr, mask, v);
    }
}

/// `M` rows of `C`, all `n` columns: 32 at a time, then 16, then a last 8 under a lane mask (masked loads
/// and stores touch no memory in the lanes they leave out). Columns `j` and `j + 16` lie in two strips of
/// the packed layout, or 16 floats apart in a row-major `B` (`b_js = 1`). `S = 2`: A's row stride is 1 (A
/// read transposed; `a_rs` is ignored), so a step's broadcasts are one base register plus fixed
/// displacements; `S = 0`: strides as given.
///
/// # Safety
/// As [`matmul`].
#[target_feature(enable = "avx512f")]
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
        let a_rs = if S == 2 { 1 } else { a_rs };
        let mut j = 0;
        while j + 32 <= n {
            let mut c0 = [_mm512_setzero_ps(); M];
            let mut c1 = [_mm512_setzero_ps(); M];
            let (mut b0p, mut b1p) = (b.add(j * b_js), b.add((j + 16) * b_js));
            for p in 0..k {
                let b0 = _mm512_loadu_ps(b0p);
                let b1 = _mm512_loadu_ps(b1p);
                for r in 0..M {
                    let av = _mm512_set1_ps(*a.add(r * a_rs + p * a_cs));
                    c0[r] = _mm512_fmadd_ps(av, b0, c0[r]);
                    c1[r] = _mm512_fmadd_ps(av, b1, c1[r]);
                }
                b0p = b0p.add(ldb);
                b1p = b1p.add(ldb);
            }
            for r in 0..M {
                let cr = c.add(r * ldc + j);
                put(cr, !0, c0[r], accumulate);
                put(cr.add(16), !0, c1[r], accumulate);
            }
            j += 32;
        }
        while j < n {
            // 16 columns, or the last 8 (n is a multiple of 8).
            let mask = if j + 16 <= n { !0 } else { LOW8 };
            let mut c0 = [_mm512_setzero_ps(); M];
            let mut bp = b.add(j * b_js);
            for p in 0..k {
                let b0 = _mm512_maskz_loadu_ps(mask, bp);
                for r in 0..M {
                    let av = _mm512_set1_ps(*a.add(r * a_rs + p * a_cs));
                    c0[r] = _mm512_fmadd_ps(av, b0, c0[r]);
                }
                bp = bp.add(ldb);
            }
            for r in 0..M {
                put(c.add(r * ldc + j), mask, c0[r], accumulate);
            }
            j += 16;
        }
    }
}

/// `2^x` for `x <= 127`, in as few vector operations as possible: with 512-bit vectors only two ports
/// compute, and `exp2` is most of a forward's work outside the products. `n = round(x)` comes from adding
/// and subtracting `1.5·2^23` (exact for `|x| < 2^22`), `2^f` from the same polynomial as `avx2::exp2`, and
/// `2^n·2^f` from one `vscalefps`, so results equal `avx2::exp2`'s wherever both are normal. Lanes with
/// `x <= -126` (also `-inf` and NaN) are set to exactly 0 by the same instruction's zero mask, so no
/// denormal ever reaches the products that follow (each one can cost a microcode assist there).
/// 13 vector operations against 16 for the AVX2 recipe at this width.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn exp2(x: __m512) -> __m512 {
    const SHIFT: f32 = 12_582_912.0; // 1.5 * 2^23
    let keep = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(-126.0));
    let n = _mm512_sub_ps(_mm512_add_ps(x, _mm512_set1_ps(SHIFT)), _mm512_set1_ps(SHIFT));
    let f = _mm512_sub_ps(x, n);
    let mut p = _mm512_set1_ps(1.535_336_2e-4);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339_887_4e-3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618_437e-3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550_332_5e-2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402_264_8e-1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931_472e-1));
    let frac = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0));
    _mm512_maskz_scalef_ps(keep, frac, n)
}

/// The lane mask of the first `rest` (< 16) lanes.
fn first(rest: usize) -> __mmask16 {
    ((1u32 << rest) - 1) as __mmask16
}

/// # Safety
/// AVX-512F must be present.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn max(x: &[f32]) -> f32 {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        let p = x.as_ptr();
        // `vmaxps` returns its second operand when the first is NaN, so NaN elements are skipped as `f32::max`
        // does; the tail's masked-off lanes load as -inf.
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let (mut m0, mut m1) = (ninf, ninf);
        let mut j = 0;
        while j + 32 <= x.len() {
            m0 = _mm512_max_ps(_mm512_loadu_ps(p.add(j)), m0);
            m1 = _mm512_max_ps(_mm512_loadu_ps(p.add(j + 16)), m1);
            j += 32;
        }
        while j < x.len() {
            let mask = if j + 16 <= x.len() { !0 } else { first(x.len() - j) };
            m0 = _mm512_max_ps(_mm512_mask_loadu_ps(ninf, mask, p.add(j)), m0);
            j += 16;
        }
        // No lane holds NaN, so the order of the tree reduction cannot matter. A tree (4 shuffle steps) rather
        // than 16 dependent scalar steps: rows are only 128 long, so a row's fixed costs weigh as much as its
        // vector work.
        _mm512_reduce_max_ps(_mm512_max_ps(m0, m1))
    }
}

/// # Safety
/// AVX-512F must be present.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn scale(y: &mut [f32], a: f32) {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        let p = y.as_mut_ptr();
        let av = _mm512_set1_ps(a);
        let mut j = 0;
        while j < y.len() {
            let mask = if j + 16 <= y.len() { !0 } else { first(y.len() - j) };
            let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, p.add(j)), av);
            _mm512_mask_storeu_ps(p.add(j), mask, v);
            j += 16;
        }
    }
}

/// # Safety
/// AVX-512F must be present, and `ds` at least as long as `p`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn probs_and_ds(p: &mut [f32], ds: &mut [f32], c: f32, m: f32, di: f32) {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        let (cv, mv, dv) = (_mm512_set1_ps(c), _mm512_set1_ps(m), _mm512_set1_ps(di));
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let (pp, gp) = (p.as_mut_ptr(), ds.as_mut_ptr());
        let mut j = 0;
        while j < p.len() {
            let mask = if j + 16 <= p.len() { !0 } else { first(p.len() - j) };
            let pr = exp2(_mm512_fmsub_ps(_mm512_mask_loadu_ps(ninf, mask, pp.add(j)), cv, mv));
            _mm512_mask_storeu_ps(pp.add(j), mask, pr);
            let g = _mm512_mul_ps(pr, _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, gp.add(j)), dv));
            _mm512_mask_storeu_ps(gp.add(j), mask, g);
            j += 16;
        }
    }
}

/// # Safety
/// AVX-512F must be present.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn exp2_scaled_sum(x: &mut [f32], c: f32, m: f32) -> f32 {
    // SAFETY: the caller upholds this function's contract (see its docs).
    unsafe {
        let cv = _mm512_set1_ps(c);
        let mv = _mm512_set1_ps(m);
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut acc = _mm512_setzero_ps();
        let p = x.as_mut_ptr();
        let mut j = 0;
        while j < x.len() {
            // The tail goes through the same polynomial, its missing lanes read as -inf (which gives 0).
            let mask = if j + 16 <= x.len() { !0 } else { first(x.len() - j) };
            let v = exp2(_mm512_fmsub_ps(_mm512_mask_loadu_ps(ninf, mask, p.add(j)), cv, mv));
            _mm512_mask_storeu_ps(p.add(j), mask, v);
            acc = _mm512_add_ps(acc, v);
            j += 16;
        }
        // A fixed tree of lane sums (see `max`).
        _mm512_reduce_add_ps(acc)
    }
}
