//! The one copy of the threads transport.
//!
//! glibc's `memcpy` takes its `rep movsb` path for mid-sized copies, and on AMD Zen `rep movsb` is many times
//! slower when the destination lies 1 to 31 bytes past the source modulo 4 KiB, as it does between two
//! same-sized heap blocks of under 128 KiB (`malloc` puts the second 16 bytes past the first); an AVX2 loop is
//! not. A transport cannot choose its users' buffers, so copies of 2 KiB to 1 MiB at those offsets use an AVX2
//! loop when the CPU has it. Every other copy uses `memcpy`, which is as fast or faster there (on Intel too).
//!
//! Messages larger than the last-level cache are copied with non-temporal (streaming) stores instead
//! ([`copy_stream`]): glibc only streams from 3/4 of the L3 *per thread* times the thread count (192 MiB
//! here), so a 16-64 MiB `memcpy` reads every destination line before overwriting it and evicts the cache for
//! nothing (the data does not fit anyway).

/// Copies `len` bytes from `src` to `dst`.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: both ranges valid, not overlapping.
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if (2048..(1 << 20)).contains(&len)
        && (1..32).contains(&((dst as usize).wrapping_sub(src as usize) & 4095))
        && std::arch::is_x86_feature_detected!("avx2")
    {
        // SAFETY: AVX2 is present; the ranges are valid per our contract.
        return unsafe { copy_avx2(src, dst, len) };
    }
    // SAFETY: per our contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Messages of at least this many bytes are copied with [`copy_stream`]: from here two messages in flight (a
/// ring shift, source and destination each) no longer fit the 32 MiB L3 of the bench machines.
pub(crate) const STREAM_MIN: usize = 16 << 20;

/// Copies `len` bytes from `src` to `dst` with non-temporal stores where the CPU allows (else as [`copy`]), and
/// fences them: once this returns, another thread that synchronises with this one (a lock, an atomic) sees the
/// bytes.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: both ranges valid, not overlapping.
pub(crate) unsafe fn copy_stream(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= 4096 && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present; the ranges are valid per our contract.
        return unsafe { copy_stream_avx2(src, dst, len) };
    }
    // SAFETY: per our contract.
    unsafe { copy(src, dst, len) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_stream_avx2(src: *const u8, dst: *mut u8, len: usize) {
    // Streaming stores need 32-byte aligned destinations: copy the head normally up to the first boundary.
    let head = (32 - (dst as usize & 31)) & 31;
    // SAFETY: `len >= 4096 > head`; `dst.add(head)` is 32-aligned for the streaming stores; every access is within
    // `0..len` of both ranges.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let i = copy_blocks_avx2::<true>(src, dst, head, len);
        // Streaming stores are weakly ordered: make them globally visible before anyone is told the copy is done.
        std::arch::x86_64::_mm_sfence();
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_avx2(src: *const u8, dst: *mut u8, len: usize) {
    // Stores aligned to the destination's cache lines, loads unaligned: a 32-byte store that straddles two
    // lines costs about two, and `malloc` puts two same-sized blocks of under 128 KiB 16 bytes apart, so
    // unaligned stores would straddle on most copies.
    let head = ((64 - (dst as usize & 63)) & 63).min(len);
    // SAFETY: every access is within `0..len` of both ranges (unaligned loads/stores are allowed).
    unsafe {
        if head > 0 {
            std::ptr::copy_nonoverlapping(src, dst, head);
        }
        let i = copy_blocks_avx2::<false>(src, dst, head, len);
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
    }
}

/// Copies whole 128-byte blocks from offset `i` while they fit in `len`; returns the offset after the last one.
/// `STREAM`: non-temporal stores (then `dst + i` must be 32-byte aligned), else ordinary unaligned stores.
///
/// # Safety
/// Both ranges valid for `len` bytes, not overlapping; AVX2 present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_blocks_avx2<const STREAM: bool>(src: *const u8, dst: *mut u8, mut i: usize, len: usize) -> usize {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256, _mm256_stream_si256};
    // SAFETY: per the contract; each block `i..i + 128` is within `0..len`.
    unsafe {
        while i + 128 <= len {
            let s = src.add(i) as *const __m256i;
            let d = dst.add(i) as *mut __m256i;
            let v = [
                _mm256_loadu_si256(s),
                _mm256_loadu_si256(s.add(1)),
                _mm256_loadu_si256(s.add(2)),
                _mm256_loadu_si256(s.add(3)),
            ];
            for (k, x) in v.into_iter().enumerate() {
                if STREAM {
                    _mm256_stream_si256(d.add(k), x);
                } else {
                    _mm256_storeu_si256(d.add(k), x);
                }
            }
            i += 128;
        }
    }
    i
}

#[cfg(test)]
mod tests {
    #[test]
    fn copies_every_length_and_offset() {
        let src: Vec<u8> = (0..10_000u32).map(|x| (x * 7 + 3) as u8).collect();
        for len in [0usize, 1, 63, 127, 2047, 2048, 2049, 4096, 5000, 9000] {
            for off in [0usize, 1, 31] {
                for doff in [0usize, 1, 16, 31, 63] {
                    let mut dst = vec![0u8; len + doff];
                    // SAFETY: in-bounds, distinct buffers.
                    unsafe { super::copy(src.as_ptr().add(off), dst.as_mut_ptr().add(doff), len) };
                    assert_eq!(&dst[doff..], &src[off..off + len]);
                    // The AVX2 loop itself, whatever the dispatcher picked for these addresses.
                    #[cfg(target_arch = "x86_64")]
                    if std::arch::is_x86_feature_detected!("avx2") {
                        let mut dst = vec![0u8; len + doff];
                        // SAFETY: AVX2 present; in-bounds, distinct buffers.
                        unsafe { super::copy_avx2(src.as_ptr().add(off), dst.as_mut_ptr().add(doff), len) };
                        assert_eq!(&dst[doff..], &src[off..off + len]);
                    }
                }
            }
        }
    }

    #[test]
    fn streams_every_length_and_offset() {
        let src: Vec<u8> = (0..20_000u32).map(|x| (x * 13 + 5) as u8).collect();
        for len in [0usize, 1, 4095, 4096, 4097, 4096 + 127, 9000, 19_000] {
            for (soff, doff) in [(0usize, 0usize), (1, 0), (0, 1), (31, 17), (32, 32)] {
                if soff + len > src.len() {
                    continue;
                }
                let mut dst = vec![0u8; len + doff];
                // SAFETY: in-bounds, distinct buffers.
                unsafe { super::copy_stream(src.as_ptr().add(soff), dst.as_mut_ptr().add(doff), len) };
                assert_eq!(&dst[doff..], &src[soff..soff + len]);
            }
        }
    }
}
