//! The data of a case: drawn from its seed (so the case's `Debug` is enough to rerun it), already rounded to the
//! element type it is stored in, and kept in `f64` for the references.

use half::bf16;

use crate::dtype::DType;

/// SplitMix64: small, seedable, and the same on every platform.
#[derive(Debug, Clone)]
pub struct DataRng(u64);

impl DataRng {
    /// The generator of `seed`.
    pub fn new(seed: u64) -> Self {
        DataRng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Never zero, so that an output that should be nonzero cannot be matched by a zeroed buffer: magnitude in
    /// `[0.1, 1)·scale`, either sign.
    pub fn nonzero(&mut self, scale: f64) -> f64 {
        let m = 0.1 + 0.9 * self.unit();
        if self.next_u64() & 1 == 0 {
            m * scale
        } else {
            -m * scale
        }
    }
    /// `n` values of [`nonzero`](Self::nonzero).
    pub fn vec(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| self.nonzero(scale)).collect()
    }
    /// `n` values of [`nonzero`](Self::nonzero), rounded to `dtype`: what a backend given them sees.
    pub fn values(&mut self, n: usize, scale: f64, dtype: DType) -> Vec<f64> {
        (0..n).map(|_| round(dtype, self.nonzero(scale))).collect()
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// `x` stored as `dtype` (to nearest, ties to even) and read back.
pub fn round(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F32 => x as f32 as f64,
        DType::Bf16 => bf16::from_f32(x as f32).to_f64(),
        DType::F16 => half::f16::from_f32(x as f32).to_f64(),
    }
}

/// `x` rounded to `f32`, then to `dtype`: how a kernel that computes in `f32` stores a result.
pub fn store(dtype: DType, x: f32) -> f64 {
    round(dtype, x as f64)
}

/// Every element of `x` [`round`]ed to `dtype`.
pub fn rounded(dtype: DType, x: &[f64]) -> Vec<f64> {
    x.iter().map(|&v| round(dtype, v)).collect()
}
