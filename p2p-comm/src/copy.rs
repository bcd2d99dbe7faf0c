//! The one copy of the threads transport.
//!
//! glibc's `memcpy` takes its `rep movsb` path for mid-sized copies, and on AMD Zen (this project's CI and bench
//! machines) `rep movsb` is about 15x slower when source and destination share their offset within a 4 KiB
//! page, as two page-aligned buffers do: measured here 2 GiB/s for 4-64 KiB copies, against 30 GiB/s for the
//! same copies with an AVX2 loop (equal from 256 KiB on). So copies of 2 KiB to 1 MiB use the AVX2 loop when
//! the CPU has it; others use `memcpy`.

/// Copies `len` bytes from `src` to `dst`.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: both ranges valid, not overlapping.
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if (2048..(1 << 20)).contains(&len) && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present; the ranges are valid per our contract.
        return unsafe { copy_avx2(src, dst, len) };
    }
    // SAFETY: per our contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_avx2(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};
    let mut i = 0;
    // SAFETY: every access is within `0..len` of both ranges (unaligned loads/stores are allowed).
    unsafe {
        while i + 128 <= len {
            let s = src.add(i) as *const __m256i;
            let d = dst.add(i) as *mut __m256i;
            let (a, b, c, e) = (
                _mm256_loadu_si256(s),
                _mm256_loadu_si256(s.add(1)),
                _mm256_loadu_si256(s.add(2)),
                _mm256_loadu_si256(s.add(3)),
            );
            _mm256_storeu_si256(d, a);
            _mm256_storeu_si256(d.add(1), b);
            _mm256_storeu_si256(d.add(2), c);
            _mm256_storeu_si256(d.add(3), e);
            i += 128;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn copies_every_length_and_offset() {
        let src: Vec<u8> = (0..10_000u32).map(|x| (x * 7 + 3) as u8).collect();
        for len in [0usize, 1, 127, 2047, 2048, 2049, 4096, 5000, 9000] {
            for off in [0usize, 1, 31] {
                let mut dst = vec![0u8; len + off];
                // SAFETY: in-bounds, distinct buffers.
                unsafe { super::copy(src.as_ptr().add(off), dst.as_mut_ptr(), len) };
                assert_eq!(&dst[..len], &src[off..off + len]);
            }
        }
    }
}
