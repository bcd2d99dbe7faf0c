//! The inner loops of the attention kernels: a small register-blocked matrix product and a vectorised
//! `exp2`, in three versions: [`SimdPath::Avx512`] (`avx512.rs`), [`SimdPath::Avx2`] (`avx2.rs`) and
//! [`SimdPath::Portable`] (`portable.rs`, plain loops for every other machine). All paths compute each product
//! element with the same multiply-adds in the same order of the reduction dimension; the row sums of `exp2`
//! use different lane counts, so results may differ in the last bits between paths, never between runs of
//! one path.
//!
//! The level is a parameter, not a process setting: [`Simd`] holds a level the CPU is known to support
//! (clamped on construction), and the kernels call its methods, so one process (one test binary) can run the
//! same problem on every path side by side.
//!
//! The products are tiny (at most 256 × 256 × 256, all operands in L1/L2), so a hand-written micro-kernel
//! beats calling a general GEMM per tile: there is no packing or dispatch overhead per call. The right
//! operands (K and V tiles) are strip-packed once per attention call instead (`pack.rs`,
//! [`Simd::matmul_packed_b`]), so the kernel reads each strip as one contiguous block.

/// The inner loops an attention call runs, slowest first. [`SimdPath::detect`] gives the best one this CPU
/// has, [`SimdPath::supported`] all of them; [`CpuBackend::with_simd`](crate::CpuBackend::with_simd) makes a
/// backend that takes one explicitly (to compare paths, or to test every one of them, in one process).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdPath {
    /// Plain loops that the compiler vectorises for the baseline instruction set.
    Portable,
    /// 256-bit AVX2 + FMA micro-kernels (6 × 16 register tiles).
    Avx2,
    /// 512-bit AVX-512F micro-kernels (12 × 32 register tiles).
    Avx512,
}

impl SimdPath {
    /// Every path, slowest first.
    pub const ALL: [SimdPath; 3] = [SimdPath::Portable, SimdPath::Avx2, SimdPath::Avx512];

    /// Whether this CPU can run the path (`is_x86_feature_detected!` caches its answer, so this is cheap).
    pub fn is_supported(self) -> bool {
        match self {
            SimdPath::Portable => true,
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx2 => std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The paths this CPU supports, slowest first (always starts with `Portable`).
    pub fn supported() -> Vec<SimdPath> {
        Self::ALL.into_iter().filter(|p| p.is_supported()).collect()
    }

    /// The fastest path this CPU supports.
    pub fn detect() -> SimdPath {
        SimdPath::Avx512.clamp_supported()
    }

    /// The fastest supported path no faster than `self`: `self` itself when the CPU has it, so `Avx512` on an
    /// AVX2 machine gives `Avx2`.
    pub fn clamp_supported(self) -> SimdPath {
        Self::ALL.into_iter().rev().find(|p| *p <= self && p.is_supported()).unwrap_or(SimdPath::Portable)
    }
}

/// A [`SimdPath`] this CPU supports: the only way to build one clamps the level, so the methods below may
/// call the `unsafe` kernels of its path. Cheap to copy; the kernels pass it down to every inner loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Simd(SimdPath);

/// Columns per strip of a strip-packed `B` (see [`Simd::matmul_packed_b`]): the width of the micro-kernel.
pub(crate) const STRIP: usize = 16;

impl Simd {
    /// `path`, clamped to what the CPU supports.
    pub fn new(path: SimdPath) -> Self {
        Simd(path.clamp_supported())
    }

    /// `C[m×n] (+)= A[m×k] · B[k×n]`, all row-major with leading dimensions `lda`, `ldb`, `ldc`; `n` must be a
    /// multiple of 8. With `accumulate` false, `C` is overwritten.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        self,
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
        self.matmul_strided(m, n, k, a, lda, 1, b, ldb, 1, c, ldc, accumulate)
    }

    /// `C[m×n] (+)= Aᵀ[m×k] · B[k×n]` where `A` is stored `[k×m]` row-major with leading dimension `lda`: the
    /// backward's `Pᵀ·dO` and `dSᵀ·Q` without materialising a transpose.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_at(
        self,
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
        self.matmul_strided(m, n, k, a, 1, lda, b, ldb, 1, c, ldc, accumulate)
    }

    /// `C[m×n] (+)= A[m×k] · B[k×n]` with `B` strip-packed: columns in strips of [`STRIP`], each strip
    /// `strip_rows` rows (at least `k`) of `STRIP` contiguous floats, so `B[p][j]` is at
    /// `b[(j / STRIP)·STRIP·strip_rows + p·STRIP + j % STRIP]`. The micro-kernel then reads one contiguous block
    /// per strip instead of `k` cache lines a row apart: at 128 columns those lines are 512 bytes apart and fall
    /// into 8 of the 64 L1 sets, evicting the rows of `A` that share those sets. `n` must be a multiple of 8; a
    /// sub-block of columns must start at a strip boundary (rows may start anywhere: offset `b` by `p0·STRIP`).
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_packed_b(
        self,
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
        self.matmul_strided(m, n, k, a, lda, 1, b, STRIP, strip_rows, c, ldc, accumulate)
    }

    /// `C[m×n] (+)= Aᵀ[m×k] · B[k×n]`: `A` as for [`Simd::matmul_at`], `B` strip-packed as for
    /// [`Simd::matmul_packed_b`]. The backward's `Pᵀ·dO` and `dSᵀ·Q`, with the tile of dO (or Q) packed once per
    /// block of key tiles.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_at_packed_b(
        self,
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
        self.matmul_strided(m, n, k, a, 1, lda, b, STRIP, strip_rows, c, ldc, accumulate)
    }

    /// `C (+)= A·B` with `A[i][p]` at `a[i·a_rs + p·a_cs]` and `B[p][j]` at `b[s·b_js + p·ldb + j % STRIP]` for
    /// the strip start `s = j - j % STRIP` (row-major: `b_js = 1`; strip-packed: `ldb = STRIP`, `b_js = k`).
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn matmul_strided(
        self,
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
        match self.0 {
            // SAFETY (both): a `Simd` only holds a path the CPU supports, and the bounds asserted on entry cover
            // every access.
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 => unsafe {
                avx512::matmul(m, n, k, a.as_ptr(), a_rs, a_cs, b.as_ptr(), ldb, b_js, c.as_mut_ptr(), ldc, accumulate)
            },
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx2 => unsafe {
                avx2::matmul(m, n, k, a.as_ptr(), a_rs, a_cs, b.as_ptr(), ldb, b_js, c.as_mut_ptr(), ldc, accumulate)
            },
            _ => portable::matmul(m, n, k, a, a_rs, a_cs, b, ldb, b_js, c, ldc, accumulate),
        }
    }

    /// Computes `x[j] = exp2(x[j] * c - m)` for all `j` and returns the sum (accumulated in 8 lanes, 16 with
    /// AVX-512, then reduced in a fixed order).
    #[inline]
    pub fn exp2_scaled_sum(self, x: &mut [f32], c: f32, m: f32) -> f32 {
        match self.0 {
            // SAFETY (both): a `Simd` only holds a path the CPU supports; the function only touches `x`.
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 => unsafe { avx512::exp2_scaled_sum(x, c, m) },
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx2 => unsafe { avx2::exp2_scaled_sum(x, c, m) },
            _ => portable::exp2_scaled_sum(x, c, m),
        }
    }

    /// The backward's row step: `p[j] = exp2(p[j]·c - m)` (the probabilities, from the scores), then
    /// `ds[j] = p[j]·(ds[j] - di)` (from `dP`, giving `dS`). On the x86 paths in one vector pass over both rows,
    /// with the same operations as the two passes it replaces (results bit-identical), and without the row sum
    /// the backward does not need.
    #[inline]
    pub fn probs_and_ds(self, p: &mut [f32], ds: &mut [f32], c: f32, m: f32, di: f32) {
        assert_eq!(p.len(), ds.len(), "probs_and_ds: rows of different lengths");
        match self.0 {
            // SAFETY (both): a `Simd` only holds a path the CPU supports; the rows have equal lengths.
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 => return unsafe { avx512::probs_and_ds(p, ds, c, m, di) },
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx2 => return unsafe { avx2::probs_and_ds(p, ds, c, m, di) },
            _ => {}
        }
        self.exp2_scaled_sum(p, c, m);
        for (g, &pr) in ds.iter_mut().zip(p.iter()) {
            *g = pr * (*g - di);
        }
    }

    /// Largest element (`-inf` for an empty slice). NaN handling: NaN elements are skipped by `max`.
    #[inline]
    pub fn max(self, x: &[f32]) -> f32 {
        match self.0 {
            // SAFETY (both): a `Simd` only holds a path the CPU supports; the function only reads `x`.
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 => unsafe { avx512::max(x) },
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx2 => unsafe { avx2::max(x) },
            _ => portable::max(x),
        }
    }

    /// `y *= a`.
    #[inline]
    pub fn scale(self, y: &mut [f32], a: f32) {
        match self.0 {
            // SAFETY (both): a `Simd` only holds a path the CPU supports; the function only touches `y`.
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 => unsafe { avx512::scale(y, a) },
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx2 => unsafe { avx2::scale(y, a) },
            _ => portable::scale(y, a),
        }
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

/// Dot product accumulated in 8 lanes (fixed order), the same on every path.
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

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod portable;

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
                kernels.push(("avx2", avx2::matmul));
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                kernels.push(("avx512", avx512::matmul));
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
                    let (mx, sum) = unsafe { (avx2::max(&x), avx2::exp2_scaled_sum(&mut e, 1.3, 0.2)) };
                    unsafe { avx2::scale(&mut s, 0.75) };
                    check("avx2", mx, sum, &e, &s);
                    // The fused backward row step equals its two passes bit for bit.
                    let (mut p1, mut g1) = (x.clone(), data(len, 9));
                    let (mut p2, mut g2) = (p1.clone(), g1.clone());
                    // SAFETY: features detected; equal lengths.
                    unsafe { avx2::probs_and_ds(&mut p1, &mut g1, 1.3, 0.2, 0.1) };
                    unsafe { avx2::exp2_scaled_sum(&mut p2, 1.3, 0.2) };
                    for (g, &pr) in g2.iter_mut().zip(&p2) {
                        *g = pr * (*g - 0.1);
                    }
                    assert_eq!((p1, g1), (p2, g2), "avx2 probs_and_ds, len {len}");
                }
                let (mut e, mut s) = (x.clone(), x.clone());
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: feature detected.
                    let (mx, sum) = unsafe { (avx512::max(&x), avx512::exp2_scaled_sum(&mut e, 1.3, 0.2)) };
                    unsafe { avx512::scale(&mut s, 0.75) };
                    check("avx512", mx, sum, &e, &s);
                    // Scores far below the maximum give exactly 0, never a denormal.
                    let mut far: Vec<f32> = (0..len).map(|i| -96.0 - i as f32 * 0.05).collect();
                    // SAFETY: feature detected.
                    unsafe { avx512::exp2_scaled_sum(&mut far, 1.3, 0.2) };
                    assert!(far.iter().all(|v| *v == 0.0 || v.is_normal()), "avx512 exp2 gave a denormal: {far:?}");
                    // The fused backward row step equals its two passes bit for bit.
                    let (mut p1, mut g1) = (x.clone(), data(len, 9));
                    let (mut p2, mut g2) = (p1.clone(), g1.clone());
                    // SAFETY: feature detected; equal lengths.
                    unsafe { avx512::probs_and_ds(&mut p1, &mut g1, 1.3, 0.2, 0.1) };
                    unsafe { avx512::exp2_scaled_sum(&mut p2, 1.3, 0.2) };
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
                unsafe { avx2::exp2_scaled_sum(&mut e, 1.0, 0.0) };
                check("avx2", &e);
                avx2 = Some(e);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                let mut e = x.clone();
                // SAFETY: feature detected.
                unsafe { avx512::exp2_scaled_sum(&mut e, 1.0, 0.0) };
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
