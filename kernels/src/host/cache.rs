//! Large host buffers kept for reuse when a [`Buffer`](crate::Buffer) is dropped, so that the next buffer of the
//! same type and length needs neither a fresh allocation (page faults, the kernel clearing pages) nor, through
//! [`Backend::empty`](crate::Backend::empty), any clearing at all. A training step frees and asks for the same
//! tensors every step, so after the first one nearly every request is served from here.
//!
//! Peak memory is unchanged: the bytes kept here plus those of the large buffers alive never pass the most
//! that large buffers alive have ever taken, so at the peak of a step (when that most is reached) nothing is
//! kept. Kept buffers past that bound are freed, the oldest first.
//!
//! One cache per process, shared by every backend and thread (the ranks of a threads world reuse each other's
//! buffers); a mutex guards it, taken once per large buffer made or freed, a few hundred times a step.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::HostVec;
use crate::dtype::DType;

/// Buffers from this many bytes up are counted and kept; smaller ones are the system allocator's business.
pub(crate) const MIN_BYTES: usize = 1 << 20;

/// At most this many buffers are kept (a rank of the bench model frees about 40 large tensors per layer of a
/// step, a few hundred at most in flight across ranks).
const MAX_KEPT: usize = 512;

struct Cache {
    /// Kept buffers, the oldest first.
    kept: VecDeque<HostVec>,
    kept_bytes: usize,
    /// Bytes of the large buffers alive.
    live: usize,
    /// The most `live` has been.
    high: usize,
}

static CACHE: Mutex<Cache> = Mutex::new(Cache::new());

fn lock() -> MutexGuard<'static, Cache> {
    // The counts stay consistent under a panic elsewhere: nothing here panics while holding the lock.
    CACHE.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn bytes_of(v: &HostVec) -> usize {
    v.len() * v.dtype().size()
}

fn dtype_of(v: &HostVec) -> DType {
    v.dtype()
}

/// Whether a buffer of `bytes` is counted and kept.
pub(crate) fn is_large(bytes: usize) -> bool {
    bytes >= MIN_BYTES
}

impl Cache {
    const fn new() -> Self {
        Cache { kept: VecDeque::new(), kept_bytes: 0, live: 0, high: 0 }
    }

    /// Frees kept buffers, the oldest first, until kept and alive bytes are within the high-water mark; returns
    /// them, to be dropped once the lock is released.
    fn trim(&mut self) -> Vec<HostVec> {
        let mut out = Vec::new();
        while self.live + self.kept_bytes > self.high || self.kept.len() > MAX_KEPT {
            let Some(v) = self.kept.pop_front() else { break };
            self.kept_bytes -= bytes_of(&v);
            out.push(v);
        }
        out
    }

    fn take(&mut self, dtype: DType, bytes: usize) -> Option<HostVec> {
        let i = self.kept.iter().rposition(|v| dtype_of(v) == dtype && bytes_of(v) == bytes)?;
        let v = self.kept.remove(i)?;
        self.kept_bytes -= bytes;
        self.live += bytes;
        Some(v)
    }

    fn made(&mut self, bytes: usize) -> Vec<HostVec> {
        self.live += bytes;
        self.high = self.high.max(self.live);
        self.trim()
    }

    fn give(&mut self, v: HostVec) -> Vec<HostVec> {
        let bytes = bytes_of(&v);
        self.live -= bytes;
        self.kept_bytes += bytes;
        self.kept.push_back(v);
        self.trim()
    }
}

/// A kept buffer of `dtype` with exactly `len` elements (the latest one kept, the likeliest still in cache), now
/// counted as alive; its contents are what its last owner left.
pub(crate) fn take(dtype: DType, len: usize) -> Option<HostVec> {
    let bytes = len * dtype.size();
    if !is_large(bytes) {
        return None;
    }
    lock().take(dtype, bytes)
}

/// Counts a large buffer made outside the cache as alive.
pub(crate) fn made(bytes: usize) {
    if is_large(bytes) {
        let freed = lock().made(bytes);
        drop(freed);
    }
}

/// A large buffer leaving the count without being freed (its elements moved out of their [`Buffer`](crate::Buffer)).
pub(crate) fn left(bytes: usize) {
    if is_large(bytes) {
        lock().live -= bytes;
    }
}

/// A buffer freed by its owner: kept when large (and room remains), else dropped.
pub(crate) fn give(v: HostVec) {
    if is_large(bytes_of(&v)) {
        let freed = lock().give(v);
        drop(freed);
    }
}

/// Frees every kept buffer (the counts of alive ones stay).
pub(crate) fn release() {
    let freed = {
        let mut c = lock();
        c.kept_bytes = 0;
        std::mem::take(&mut c.kept)
    };
    drop(freed);
}

/// Bytes kept for reuse now.
pub(crate) fn kept_bytes() -> usize {
    lock().kept_bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn f32s(mib: usize, x: f32) -> HostVec {
        HostVec::F32(vec![x; mib * MIB / 4])
    }

    #[test]
    fn a_freed_buffer_serves_the_next_of_its_type_and_length_only() {
        let mut c = Cache::new();
        c.made(2 * MIB);
        assert!(c.give(f32s(2, 7.0)).is_empty());
        assert_eq!(c.kept_bytes, 2 * MIB);
        assert!(c.take(DType::F32, MIB).is_none(), "another length");
        assert!(c.take(DType::Bf16, 2 * MIB).is_none(), "another type");
        let v = c.take(DType::F32, 2 * MIB).expect("the kept buffer");
        assert_eq!(v, f32s(2, 7.0), "handed back as its owner left it");
        assert_eq!((c.kept_bytes, c.live), (0, 2 * MIB));
    }

    #[test]
    fn kept_and_alive_bytes_never_pass_the_most_ever_alive() {
        let mut c = Cache::new();
        // A step's pattern: 3 + 2 MiB alive at the peak, then both freed and kept.
        c.made(3 * MIB);
        c.made(2 * MIB);
        assert!(c.give(f32s(3, 0.0)).is_empty());
        assert!(c.give(f32s(2, 0.0)).is_empty());
        assert_eq!((c.live, c.kept_bytes, c.high), (0, 5 * MIB, 5 * MIB));
        // A 1 MiB buffer matches neither: making it frees the oldest kept one (1 + 2 <= 5 after that).
        assert_eq!(c.made(MIB), vec![f32s(3, 0.0)]);
        assert_eq!((c.live, c.kept_bytes), (MIB, 2 * MIB));
        // A 4 MiB one: 4 + 1 alive, so nothing can stay kept.
        assert_eq!(c.made(4 * MIB), vec![f32s(2, 0.0)]);
        assert_eq!((c.live, c.kept_bytes, c.high), (5 * MIB, 0, 5 * MIB));
    }

    #[test]
    fn at_most_max_kept_buffers_are_kept() {
        let mut c = Cache::new();
        let n = MAX_KEPT + 3;
        for _ in 0..n {
            c.made(MIB);
        }
        let freed: usize = (0..n).map(|_| c.give(f32s(1, 0.0)).len()).sum();
        assert_eq!((c.kept.len(), freed), (MAX_KEPT, 3));
        assert_eq!(c.kept_bytes, MAX_KEPT * MIB);
    }
}
