//! Shared helpers of the `ops_*` integration tests: seeded data, dtype round trips, NaN poisoning, error
//! measures, central finite differences, and views for the calls through the backend. References are written in
//! the test files as plain f64 loops.
#![allow(dead_code)]

use half::bf16;
use longctx_kernels::{DType, Element, GradMode, IntoDims, View, ViewMut};

/// A view of test data whose dims are known to fit (panics otherwise, naming the dims).
#[track_caller]
pub fn view<T: Element>(x: &[T], dims: impl IntoDims + std::fmt::Debug + Copy) -> View<'_> {
    View::new(x, dims).unwrap_or_else(|e| panic!("view {dims:?}: {e}"))
}

/// A writable view of test data whose dims are known to fit.
#[track_caller]
pub fn view_mut<T: Element>(x: &mut [T], dims: impl IntoDims + std::fmt::Debug + Copy) -> ViewMut<'_> {
    ViewMut::new(x, dims).unwrap_or_else(|e| panic!("view {dims:?}: {e}"))
}

/// The gradient mode a test's `acc` flag stands for.
pub fn mode(acc: bool) -> GradMode {
    if acc {
        GradMode::Accumulate
    } else {
        GradMode::Overwrite
    }
}

/// SplitMix64: small, seedable, good enough for test data.
pub struct DataRng(u64);

impl DataRng {
    pub fn new(seed: u64) -> Self {
        DataRng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Never zero: magnitude in [0.1, 1)·scale, random sign.
    pub fn nz(&mut self, scale: f64) -> f64 {
        let m = 0.1 + 0.9 * self.unit();
        if self.next_u64() & 1 == 0 {
            m * scale
        } else {
            -m * scale
        }
    }
    pub fn vec(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| self.nz(scale)).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Tolerance on `max|a−b| / max|ref|` for a storage type.
pub fn tol<T: Element>() -> f64 {
    match T::DTYPE {
        DType::F32 => 1e-5,
        DType::Bf16 => 2e-2,
        DType::F16 => 3e-3,
    }
}

pub fn to_t<T: Element>(x: &[f64]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v as f32)).collect()
}
pub fn to_f64<T: Element>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| v.to_f32() as f64).collect()
}
/// `x` as stored in `T` and read back: what the op actually sees.
pub fn rounded<T: Element>(x: &[f64]) -> Vec<f64> {
    to_f64(&to_t::<T>(x))
}
/// `n` NaNs, so an element the op fails to write fails the comparison.
pub fn poisoned<T: Element>(n: usize) -> Vec<T> {
    vec![T::from_f32(f32::NAN); n]
}

/// `max|got − want| / max|want|`; infinite when `got` holds a NaN or infinity.
pub fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    if got.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let num = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    let den = want.iter().map(|x| x.abs()).fold(0.0, f64::max);
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

/// Asserts `got` (storage `T`) matches the f64 reference within `tol::<T>()`.
#[track_caller]
pub fn assert_close<T: Element>(what: &str, got: &[T], want: &[f64]) {
    let e = rel_err(&to_f64(got), want);
    assert!(e < tol::<T>(), "{what} ({:?}): rel err {e:e} >= {:e}", T::DTYPE, tol::<T>());
}

/// Asserts two f64 vectors agree within `tol`.
#[track_caller]
pub fn assert_close_f64(what: &str, got: &[f64], want: &[f64], tol: f64) {
    let e = rel_err(got, want);
    assert!(e < tol, "{what}: rel err {e:e} >= {tol:e}");
}

/// Asserts finite differences match an analytic gradient: `max|fd − an| / max(max|an|, 1e-3) < tol`. The floor
/// keeps a gradient that is tiny by cancellation (FD round-off dominates there) from failing on round-off alone.
#[track_caller]
pub fn assert_fd(what: &str, fd: &[f64], analytic: &[f64], tol: f64) {
    let num = fd.iter().zip(analytic).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    let den = analytic.iter().map(|x| x.abs()).fold(1e-3, f64::max);
    assert!(num / den < tol, "{what}: finite differences off by {:e} (relative)", num / den);
}

/// Central finite differences of a scalar function at `x` (f64, step `h`).
pub fn fd_grad(f: impl Fn(&[f64]) -> f64, x: &[f64], h: f64) -> Vec<f64> {
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            let x0 = xp[i];
            xp[i] = x0 + h;
            let fp = f(&xp);
            xp[i] = x0 - h;
            let fm = f(&xp);
            xp[i] = x0;
            (fp - fm) / (2.0 * h)
        })
        .collect()
}

pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Runs the body once per storage type: `$f::<f32>(..)` and `$f::<bf16>(..)`.
#[macro_export]
macro_rules! both {
    ($bf:expr, $f:ident ( $($a:expr),* )) => {
        if $bf { $f::<half::bf16>($($a),*) } else { $f::<f32>($($a),*) }
    };
}

pub type Bf16 = bf16;

/// Proptest case count: `PROPTEST_CASES` from the environment when set (for soak runs), else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}
