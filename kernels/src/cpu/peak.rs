//! The machine's arithmetic ceiling: `f32` multiply-adds per second in registers, on every thread of the
//! rayon pool, at a [`SimdPath`]'s vector width. No kernel can pass it, so it is the denominator of an honest
//! utilisation figure (a benchmark's "% of peak", a trainer's MFU); a large GEMM's rate is an attainable
//! figure below it, and how far below depends on the GEMM library as much as on the machine.

use std::time::Instant;

use crate::cpu::SimdPath;

/// FLOP/s of independent FMA chains in registers on all threads of the current rayon pool, at `path`
/// (clamped to what the CPU supports); `None` on the portable path, which has no vector kernel to time.
///
/// Each thread times its own loops (about 15 ms each) and keeps the best of eight, and the rates add up: a
/// thread that starts late or loses a time slice does not pull the figure down. Takes about a quarter of a
/// second.
pub fn fma_peak_flops(path: SimdPath) -> Option<f64> {
    let path = path.clamp_supported();
    let iters = 4_000_000u64;
    let rates: Vec<f64> = rayon::broadcast(|_| {
        let mut best = f64::MAX;
        let mut lanes = 0.0;
        for _ in 0..8 {
            let t = Instant::now();
            lanes = fma_chains(path, iters);
            best = best.min(t.elapsed().as_secs_f64());
        }
        // Lanes × 2 FLOPs × 24 chains × iterations; 0 lanes when the path has no kernel.
        lanes as f64 * 2.0 * 24.0 * iters as f64 / best
    });
    let total: f64 = rates.iter().sum();
    (total > 0.0).then_some(total)
}

/// Runs 24 independent FMA chains (of 16 lanes; 12 of 8 lanes twice as long on AVX2) `iters` times; returns
/// the vector width in `f32` lanes (0 if not run). The chains outnumber an FMA unit's latency × throughput, so
/// the loop is bound by issue, not by dependencies.
fn fma_chains(path: SimdPath, iters: u64) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        #[target_feature(enable = "avx512f")]
        unsafe fn run512(iters: u64) -> f32 {
            let m = _mm512_set1_ps(0.999_999);
            let a = _mm512_set1_ps(1e-7);
            let mut acc = [_mm512_set1_ps(1.0); 24];
            for _ in 0..iters {
                for x in acc.iter_mut() {
                    *x = _mm512_fmadd_ps(*x, m, a);
                }
            }
            // Keep the chains live so the loop is not removed.
            std::hint::black_box(acc);
            16.0
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run256(iters: u64) -> f32 {
            let m = _mm256_set1_ps(0.999_999);
            let a = _mm256_set1_ps(1e-7);
            let mut acc = [_mm256_set1_ps(1.0); 12];
            for _ in 0..2 * iters {
                for x in acc.iter_mut() {
                    *x = _mm256_fmadd_ps(*x, m, a);
                }
            }
            std::hint::black_box(acc);
            8.0
        }
        // SAFETY: `path` was clamped to what the CPU supports, so the CPU has its features.
        match path {
            SimdPath::Avx512 => return unsafe { run512(iters) },
            SimdPath::Avx2 => return unsafe { run256(iters) },
            _ => {}
        }
    }
    let _ = (path, iters);
    0.0
}
