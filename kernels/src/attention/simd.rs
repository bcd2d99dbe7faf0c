//! The inner loops of the attention kernels: a small register-blocked matrix product and a vectorised
//! `exp2`. AVX-512F, then AVX2+FMA, is detected at run time; every other machine takes the portable loops.
//! All paths compute each product element with the same multiply-adds in the same order of the reduction
//! dimension; the row sums of `exp2` use different lane counts, so results may differ in the last bits
//! between paths, never between runs on one machine ([`simd_path`] says which one runs).
//!
//! The products are tiny (at most 256 × 256 × 256, all operands in L1/L2), so a hand-written micro-kernel
//! beats calling a general GEMM per tile: there is no packing or dispatch overhead per call. The right
//! operands (K and V tiles) are strip-packed once per attention call instead (`pack.rs`,
//! [`matmul_packed_b`]), so the kernel reads each strip as one contiguous block.

use std::sync::atomic::{AtomicU8, Ordering};

/// `C[m×n] (+)= A[m×k] · B[k×n]`, all row-major with leading dimensions `lda`, `ldb`, `ldc`; `n` must be a
/// multiple of 8. With `accumulate` false, `C` is overwritten.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    matmul_strided(m, n, k, a, lda, 1, b, ldb, 1, c, ldc, accumulate)
}

/// `C[m×n] (+)= Aᵀ[m×k] · B[k×n]` where `A` is stored `[k×m]` row-major with leading dimension `lda`: the
/// backward's `Pᵀ·dO` and `dSᵀ·Q` without materialising a transpose.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_at(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    matmul_strided(m, n, k, a, 1, lda, b, ldb, 1, c, ldc, accumulate)
}

/// Columns per strip of a strip-packed `B` (see [`matmul_packed_b`]): the width of the micro-kernel.
pub(crate) const STRIP: usize = 16;

/// `C[m×n] (+)= A[m×k] · B[k×n]` with `B` strip-packed: columns in strips of [`STRIP`], each strip
/// `strip_rows` rows (at least `k`) of `STRIP` contiguous floats, so `B[p][j]` is at
/// `b[(j / STRIP)·STRIP·strip_rows + p·STRIP + j % STRIP]`. The micro-kernel then reads one contiguous block
/// per strip instead of `k` cache lines a row apart: at 128 columns those lines are 512 bytes apart and fall
/// into 8 of the 64 L1 sets, evicting the rows of `A` that share those sets. `n` must be a multiple of 8; a
/// sub-block of columns must start at a strip boundary (rows may start anywhere: offset `b` by `p0·STRIP`).
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_packed_b(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    strip_rows: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    debug_assert!(k <= strip_rows);
    matmul_strided(m, n, k, a, lda, 1, b, STRIP, strip_rows, c, ldc, accumulate)
}

/// `C (+)= A·B` with `A[i][p]` at `a[i·a_rs + p·a_cs]` and `B[p][j]` at `b[s·b_js + p·ldb + j % STRIP]` for the
/// strip start `s = j - j % STRIP` (row-major: `b_js = 1`; strip-packed: `ldb = STRIP`, `b_js = k`).
#[inline]
#[allow(clippy::too_many_arguments)]
fn matmul_strided(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    b: &[f32],
    ldb: usize,
    b_js: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(n.is_multiple_of(8), "matmul: n = {n} must be a multiple of 8");
    assert!(k == 0 || a.len() > (m - 1) * a_rs + (k - 1) * a_cs, "matmul: A too short");
    let last = n - 1;
    assert!(k == 0 || b.len() > (last - last % STRIP) * b_js + (k - 1) * ldb + last % STRIP, "matmul: B too short");
    assert!(c.len() >= (m - 1) * ldc + n, "matmul: C too short");
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                c[i * ldc..i * ldc + n].fill(0.0);
            }
        }
        return;
    }
    match simd_path() {
        // SAFETY (both): the path is only chosen when the CPU has its features, and the bounds asserted on entry
        // cover every access.
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx512 => unsafe {
            x86_512::matmul(m, n, k, a.as_ptr(), a_rs, a_cs, b.as_ptr(), ldb, b_js, c.as_mut_ptr(), ldc, accumulate)
        },
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 => unsafe {
            x86::matmul(m, n, k, a.as_ptr(), a_rs, a_cs, b.as_ptr(), ldb, b_js, c.as_mut_ptr(), ldc, accumulate)
        },
        _ => portable::matmul(m, n, k, a, a_rs, a_cs, b, ldb, b_js, c, ldc, accumulate),
    }
}

/// Computes `x[j] = exp2(x[j] * c - m)` for all `j` and returns the sum (accumulated in 8 lanes, 16 with
/// AVX-512, then reduced in a fixed order).
#[inline]
pub(crate) fn exp2_scaled_sum(x: &mut [f32], c: f32, m: f32) -> f32 {
    match simd_path() {
        // SAFETY (both): the path is only chosen when the CPU has its features; the function only touches `x`.
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx512 => unsafe { x86_512::exp2_scaled_sum(x, c, m) },
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 => unsafe { x86::exp2_scaled_sum(x, c, m) },
        _ => portable::exp2_scaled_sum(x, c, m),
    }
}

/// The backward's row step: `p[j] = exp2(p[j]·c - m)` (the probabilities, from the scores), then
/// `ds[j] = p[j]·(ds[j] - di)` (from `dP`, giving `dS`). With AVX-512 in one pass over both rows, with the
/// same operations as the two passes it replaces (results bit-identical).
#[inline]
pub(crate) fn probs_and_ds(p: &mut [f32], ds: &mut [f32], c: f32, m: f32, di: f32) {
    assert_eq!(p.len(), ds.len(), "probs_and_ds: rows of different lengths");
    #[cfg(target_arch = "x86_64")]
    if simd_path() == SimdPath::Avx512 {
        // SAFETY: the path is only chosen when the CPU has AVX-512F; the rows have equal lengths.
        return unsafe { x86_512::probs_and_ds(p, ds, c, m, di) };
    }
    exp2_scaled_sum(p, c, m);
    for (g, &pr) in ds.iter_mut().zip(p.iter()) {
        *g = pr * (*g - di);
    }
}

/// Largest element (`-inf` for an empty slice). NaN handling: NaN elements are skipped by `max`.
#[inline]
pub(crate) fn max(x: &[f32]) -> f32 {
    match simd_path() {
        // SAFETY (both): the path is only chosen when the CPU has its features; the function only reads `x`.
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx512 => unsafe { x86_512::max(x) },
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 => unsafe { x86::max(x) },
        _ => portable::max(x),
    }
}

/// `y *= a`.
#[inline]
pub(crate) fn scale(y: &mut [f32], a: f32) {
    match simd_path() {
        // SAFETY (both): the path is only chosen when the CPU has its features; the function only touches `y`.
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx512 => unsafe { x86_512::scale(y, a) },
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 => unsafe { x86::scale(y, a) },
        _ => portable::scale(y, a),
    }
}

/// Hints the cache lines of part `part` of `parts` equal parts of `x` into cache (no effect on results).
#[inline]
pub(crate) fn prefetch_part(x: &[f32], part: usize, parts: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        const LINE: usize = 16; // f32 per 64-byte cache line
        let lines = x.len().div_ceil(LINE);
        let (lo, hi) = (lines * part / parts, lines * (part + 1) / parts);
        for l in lo..hi {
            // SAFETY: `l * LINE < x.len()`, so the address lies inside `x`; prefetching never faults anyway.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
                _mm_prefetch::<_MM_HINT_T1>(x.as_ptr().add(l * LINE) as *const i8);
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, part, parts);
}

/// Dot product accumulated in 8 lanes (fixed order).
#[inline]
pub(crate) fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut cx = x.chunks_exact(8);
    let mut cy = y.chunks_exact(8);
    for (a, b) in (&mut cx).zip(&mut cy) {
        for l in 0..8 {
            lanes[l] += a[l] * b[l];
        }
    }
    let mut s = 0f32;
    for (a, b) in cx.remainder().iter().zip(cy.remainder()) {
        s += a * b;
    }
    lanes.iter().sum::<f32>() + s
}

/// The inner loops an attention call runs, fastest last. [`simd_path`] gives the best one this CPU has,
/// lowered by [`limit_simd`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdPath {
    /// Plain loops that the compiler vectorises for the baseline instruction set.
    Portable,
    /// 256-bit AVX2 + FMA micro-kernels (6 × 16 register tiles).
    Avx2,
    /// 512-bit AVX-512F micro-kernels (12 × 32 register tiles).
    Avx512,
}

/// The highest path allowed by [`limit_simd`], as `SimdPath as u8`.
static LIMIT: AtomicU8 = AtomicU8::new(SimdPath::Avx512 as u8);

/// Caps the path every later attention call in this process uses (process-wide): `Portable` to check the
/// fallback, `Avx2` to check or time the 256-bit kernels on an AVX-512 machine; `Avx512` restores detection.
/// Results of two paths may differ in the last bits.
pub fn limit_simd(max: SimdPath) {
    LIMIT.store(max as u8, Ordering::Relaxed);
}

/// Makes every later attention call in this process use the portable loops (`true`) or go back to detection
/// (`false`): shorthand for [`limit_simd`].
pub fn force_portable(on: bool) {
    limit_simd(if on { SimdPath::Portable } else { SimdPath::Avx512 });
}

/// The path attention calls take now: the best this CPU supports, capped by [`limit_simd`].
#[inline]
pub fn simd_path() -> SimdPath {
    let limit = LIMIT.load(Ordering::Relaxed);
    // `is_x86_feature_detected!` caches its answer in an atomic.
    #[cfg(target_arch = "x86_64")]
    {
        if limit >= SimdPath::Avx512 as u8 && std::arch::is_x86_feature_detected!("avx512f") {
            return SimdPath::Avx512;
        }
        if limit >= SimdPath::Avx2 as u8
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            return SimdPath::Avx2;
        }
    }
    let _ = limit;
    SimdPath::Portable
}

/// Plain loops; LLVM vectorises the 8-wide inner loops with the baseline instruction set.
mod portable {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul(
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        a_rs: usize,
        a_cs: usize,
        b: &[f32],
        ldb: usize,
        b_js: usize,
        c: &mut [f32],
        ldc: usize,
        accumulate: bool,
    ) {
        // n is a multiple of 8: eight accumulators per block of columns, no allocation.
        for i in 0..m {
            for j in (0..n).step_by(8) {
                let mut acc = [0f32; 8];
                let col = (j - j % super::STRIP) * b_js + j % super::STRIP;
                for p in 0..k {
                    let av = a[i * a_rs + p * a_cs];
                    let brow = &b[p * ldb + col..p * ldb + col + 8];
                    for (o, bv) in acc.iter_mut().zip(brow) {
                        *o = av.mul_add(*bv, *o);
                    }
                }
                let crow = &mut c[i * ldc + j..i * ldc + j + 8];
                if accumulate {
                    for (o, v) in crow.iter_mut().zip(&acc) {
                        *o += v;
                    }
                } else {
                    crow.copy_from_slice(&acc);
                }
            }
        }
    }

    pub(super) fn max(x: &[f32]) -> f32 {
        let mut lanes = [f32::NEG_INFINITY; 8];
        let mut chunks = x.chunks_exact(8);
        for ch in &mut chunks {
            for l in 0..8 {
                lanes[l] = lanes[l].max(ch[l]);
            }
        }
        let mut m = f32::NEG_INFINITY;
        for v in lanes.iter().chain(chunks.remainder()) {
            m = m.max(*v);
        }
        m
    }

    pub(super) fn scale(y: &mut [f32], a: f32) {
        for v in y {
            *v *= a;
        }
    }

    pub(super) fn exp2_scaled_sum(x: &mut [f32], c: f32, m: f32) -> f32 {
        let mut lanes = [0f32; 8];
        let mut chunks = x.chunks_exact_mut(8);
        for ch in &mut chunks {
            for l in 0..8 {
                ch[l] = (ch[l] * c - m).exp2();
                lanes[l] += ch[l];
            }
        }
        let mut s = 0f32;
        for v in chunks.into_remainder() {
            *v = (*v * c - m).exp2();
            s += *v;
        }
        lanes.iter().sum::<f32>() + s
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // register arrays indexed by row: the index is the point
mod x86 {
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
        // A read transposed (`a_cs != 1`, the backward's `Pᵀ·dO` and `dSᵀ·Q`): each row block's slice of A is
        // copied first into a contiguous `[k][PW]` panel. Read in place, a block walks `k` cache lines one
        // leading dimension apart (512 bytes at BC = 128), which map to only 8 of the 64 L1 sets, the very
        // sets the equally strided B rows use, so A and B keep evicting each other; packed, the panel takes
        // `k·PW·4` contiguous bytes. The copy costs one vector move per step of `k`, against `MR·n`
        // multiply-adds, and changes no arithmetic (results bit-identical). Measured in call-by-call paired
        // runs: the backward's median time 2-3% lower at S = 2048, D = 128.
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
        match rows {
            6 => tile::<6, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate),
            5 => tile::<5, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate),
            4 => tile::<4, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate),
            3 => tile::<3, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate),
            2 => tile::<2, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate),
            _ => tile::<1, S>(n, k, ap, a_rs, a_cs, b, ldb, b_js, cp, ldc, accumulate),
        }
    }

    /// `M` rows of `C`, all `n` columns, 16 (then 8) at a time. `S = 1`: A is a packed panel (`a_rs = 1`,
    /// `a_cs = PW`, the arguments are ignored); `S = 0`: strides as given. With the panel's strides constant
    /// the broadcasts of a step are one base register plus fixed displacements; with run-time strides the
    /// compiler spends an integer add per row on every step of `k` to form their addresses (about 2% of the
    /// backward in paired A/B runs, results bit-identical).
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

    /// # Safety
    /// AVX2 and FMA must be present.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp2_scaled_sum(x: &mut [f32], c: f32, m: f32) -> f32 {
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

/// The AVX-512F kernels: [`x86`]'s loops at twice the width, with register tiles of `MR = 12` rows × 32
/// columns (24 of the 32 zmm registers accumulate, two hold the B row, broadcasts of A come from memory).
/// Each `C` element takes the same multiply-adds in the same order as on the AVX2 path, so products are
/// bit-identical to it. `exp2` differs only below 2⁻¹²⁶ (exactly 0 here), and its row sums in lane count.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // register arrays indexed by row: the index is the point
mod x86_512 {
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
        // A read transposed (`a_rs == 1`: the backward's `Pᵀ·dO` and `dSᵀ·Q`) is read in place, with the row
        // stride known to the compiler (`S = 2`): a step's 12 broadcasts are one base register plus fixed
        // displacements. The AVX2 path copies such A blocks into packed panels first, which on its 8-way 32 KiB
        // L1 kept A and B from evicting each other; on this path's bench machine (12-way 48 KiB L1) the copy
        // cost more than it saved: 147 GFLOP/s for a 128³ product with panels, 161 without (one core).
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

    /// Stores (or adds into) one 16-column row segment of `C` under `mask`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn put(cr: *mut f32, mask: __mmask16, v: __m512, accumulate: bool) {
        let v = if accumulate { _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, cr)) } else { v };
        _mm512_mask_storeu_ps(cr, mask, v);
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

    /// `2^x` for `x <= 127`, in as few vector operations as possible: with 512-bit vectors only two ports
    /// compute, and `exp2` is most of a forward's work outside the products. `n = round(x)` comes from adding
    /// and subtracting `1.5·2^23` (exact for `|x| < 2^22`), `2^f` from the same polynomial as `x86::exp2`, and
    /// `2^n·2^f` from one `vscalefps`, so results equal `x86::exp2`'s wherever both are normal. Lanes with
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

    /// # Safety
    /// AVX-512F must be present.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scale(y: &mut [f32], a: f32) {
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

    /// # Safety
    /// AVX-512F must be present, and `ds` at least as long as `p`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn probs_and_ds(p: &mut [f32], ds: &mut [f32], c: f32, m: f32, di: f32) {
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

    /// # Safety
    /// AVX-512F must be present.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp2_scaled_sum(x: &mut [f32], c: f32, m: f32) -> f32 {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 2000) as f32 / 1000.0 - 1.0)
            .collect()
    }

    /// Every x86 kernel against a plain f64 product, over shapes that reach each tile height, the 32/16/8-column
    /// tails, transposed A (with and without the one-load panel copy, and past the stack panel) and packed B.
    #[test]
    fn simd_kernels_match_plain_products() {
        type Kernel =
            unsafe fn(usize, usize, usize, *const f32, usize, usize, *const f32, usize, usize, *mut f32, usize, bool);
        let mut kernels: Vec<(&str, Kernel)> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                kernels.push(("avx2", x86::matmul));
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                kernels.push(("avx512", x86_512::matmul));
            }
        }
        if kernels.is_empty() {
            eprintln!("skipped: no SIMD kernel on this CPU");
        }
        for (name, kernel) in kernels {
            for &(m, n, k) in
                &[(1usize, 8usize, 1usize), (5, 24, 7), (12, 32, 40), (13, 40, 64), (25, 56, 300), (30, 128, 128)]
            {
                for (transposed, packed) in [(false, false), (true, false), (false, true)] {
                    let a = data(m * k, 1);
                    let b = data(k * n.next_multiple_of(STRIP), 2);
                    let c0 = data(m * n, 3);
                    // A[i][p] and B[p][j] as the kernel addresses them.
                    let (a_rs, a_cs) = if transposed { (1, m) } else { (k, 1) };
                    let (ldb, b_js) = if packed { (STRIP, k) } else { (n, 1) };
                    let bij = |p: usize, j: usize| b[(j - j % STRIP) * b_js + p * ldb + j % STRIP];
                    for accumulate in [false, true] {
                        let mut c = c0.clone();
                        // SAFETY: the feature was detected; every extent fits the buffers above.
                        unsafe {
                            kernel(
                                m,
                                n,
                                k,
                                a.as_ptr(),
                                a_rs,
                                a_cs,
                                b.as_ptr(),
                                ldb,
                                b_js,
                                c.as_mut_ptr(),
                                n,
                                accumulate,
                            )
                        };
                        for i in 0..m {
                            for j in 0..n {
                                let mut want = if accumulate { c0[i * n + j] as f64 } else { 0.0 };
                                want += (0..k).map(|p| a[i * a_rs + p * a_cs] as f64 * bij(p, j) as f64).sum::<f64>();
                                let got = c[i * n + j] as f64;
                                assert!(
                                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt(),
                                    "{name} m={m} n={n} k={k} transposed={transposed} packed={packed} \
                                     accumulate={accumulate} C[{i}][{j}] = {got}, want {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The vector helpers of every path against plain loops, at lengths that reach each tail.
    #[test]
    fn simd_helpers_match_plain_loops() {
        for len in [0, 1, 7, 8, 15, 16, 17, 31, 33, 128, 130] {
            let mut x = data(len, 7);
            if len > 3 {
                x[3] = f32::NEG_INFINITY;
            }
            let want_max = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
            let mut want_exp = x.clone();
            let want_sum = portable::exp2_scaled_sum(&mut want_exp, 1.3, 0.2);
            let check = |name: &str, max: f32, sum: f32, exp: &[f32], scaled: &[f32]| {
                assert_eq!(max, want_max, "{name} max, len {len}");
                assert!((sum - want_sum).abs() <= 1e-6 * (1.0 + want_sum.abs()), "{name} exp2 sum, len {len}");
                for (g, w) in exp.iter().zip(&want_exp) {
                    assert!((g - w).abs() <= 1e-6 * (1.0 + w.abs()), "{name} exp2, len {len}: {g} vs {w}");
                }
                for (g, w) in scaled.iter().zip(&x) {
                    assert_eq!(*g, w * 0.75, "{name} scale, len {len}");
                }
            };
            #[cfg(target_arch = "x86_64")]
            {
                let (mut e, mut s) = (x.clone(), x.clone());
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: features detected.
                    let (mx, sum) = unsafe { (x86::max(&x), x86::exp2_scaled_sum(&mut e, 1.3, 0.2)) };
                    unsafe { x86::scale(&mut s, 0.75) };
                    check("avx2", mx, sum, &e, &s);
                }
                let (mut e, mut s) = (x.clone(), x.clone());
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: feature detected.
                    let (mx, sum) = unsafe { (x86_512::max(&x), x86_512::exp2_scaled_sum(&mut e, 1.3, 0.2)) };
                    unsafe { x86_512::scale(&mut s, 0.75) };
                    check("avx512", mx, sum, &e, &s);
                    // Scores far below the maximum give exactly 0, never a denormal.
                    let mut far: Vec<f32> = (0..len).map(|i| -96.0 - i as f32 * 0.05).collect();
                    // SAFETY: feature detected.
                    unsafe { x86_512::exp2_scaled_sum(&mut far, 1.3, 0.2) };
                    assert!(far.iter().all(|v| *v == 0.0 || v.is_normal()), "avx512 exp2 gave a denormal: {far:?}");
                    // The fused backward row step equals its two passes bit for bit.
                    let (mut p1, mut g1) = (x.clone(), data(len, 9));
                    let (mut p2, mut g2) = (p1.clone(), g1.clone());
                    // SAFETY: feature detected; equal lengths.
                    unsafe { x86_512::probs_and_ds(&mut p1, &mut g1, 1.3, 0.2, 0.1) };
                    unsafe { x86_512::exp2_scaled_sum(&mut p2, 1.3, 0.2) };
                    for (g, &pr) in g2.iter_mut().zip(&p2) {
                        *g = pr * (*g - 0.1);
                    }
                    assert_eq!((p1, g1), (p2, g2), "avx512 probs_and_ds, len {len}");
                }
            }
            let mut s = x.clone();
            portable::scale(&mut s, 0.75);
            check("portable", portable::max(&x), want_sum, &want_exp, &s);
        }
    }

    /// `exp2` of each x86 path against f64 `2^x` over the whole range a softmax feeds it (every 1/64 from -130 to
    /// 8, the ties k + 1/2 among them, and -inf), and the two paths against each other: equal bit for bit
    /// wherever the result is normal, since both round `x` to nearest-even and use the same polynomial.
    #[test]
    fn x86_exp2_matches_f64_and_each_other() {
        let mut x: Vec<f32> = (-130 * 64..=8 * 64).map(|i| i as f32 / 64.0).collect();
        x.push(f32::NEG_INFINITY);
        let check = |name: &str, got: &[f32]| {
            for (&xi, &g) in x.iter().zip(got) {
                let want = (xi as f64).exp2();
                if xi <= -128.0 {
                    assert_eq!(g, 0.0, "{name} exp2({xi}) = {g}, want exactly 0");
                } else if xi > -126.0 {
                    assert!(((g as f64) - want).abs() <= 3e-7 * want, "{name} exp2({xi}) = {g}, want {want}");
                }
            }
        };
        #[cfg(target_arch = "x86_64")]
        {
            let mut avx2 = None;
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                let mut e = x.clone();
                // SAFETY: features detected.
                unsafe { x86::exp2_scaled_sum(&mut e, 1.0, 0.0) };
                check("avx2", &e);
                avx2 = Some(e);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                let mut e = x.clone();
                // SAFETY: feature detected.
                unsafe { x86_512::exp2_scaled_sum(&mut e, 1.0, 0.0) };
                check("avx512", &e);
                for ((&xi, a), b) in x.iter().zip(avx2.iter().flatten()).zip(&e) {
                    if xi > -126.0 {
                        assert_eq!(a.to_bits(), b.to_bits(), "exp2({xi}): avx2 {a} vs avx512 {b}");
                    }
                }
            }
        }
        let _ = check;
    }
}
