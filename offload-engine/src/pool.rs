//! The host tier: a pool of reusable page-aligned buffers keyed by size class, bounded by a byte budget.
//!
//! A tensor of `n` bytes takes a buffer of `size_class(n)` bytes: `n` rounded up to a quarter of its power of
//! two (and to a page), so a buffer wastes at most a quarter of its size and tensors of nearby sizes share
//! buffers. A released buffer stays in the pool, idle, for the next tensor of its class: once a training step
//! has run, the next steps allocate nothing. The budget bounds every byte the pool holds, idle buffers
//! included; when a tensor of a class with no idle buffer needs room that idle buffers of other classes hold,
//! those are freed first.

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;

use crate::aligned::{AlignedBuf, ALIGN};
use crate::page_lock::PageLocker;

/// Why [`HostPool::take`] could not give a buffer that the budget has room for.
#[derive(Debug)]
pub(crate) enum TakeError {
    /// No memory could be mapped.
    Map(io::Error),
    /// The new buffer could not be page-locked (it was unmapped again).
    Lock(io::Error),
}

/// The size of the buffer a tensor of `bytes` bytes takes (see the module docs); `None` on overflow.
pub(crate) fn size_class(bytes: usize) -> Option<usize> {
    let b = bytes.max(ALIGN);
    let top = 1usize << (usize::BITS - 1 - b.leading_zeros());
    let step = (top / 4).max(ALIGN);
    b.checked_add(step - 1).map(|m| m / step * step)
}

/// The pool (see the module docs). All sizes are in bytes.
pub(crate) struct HostPool {
    budget: u64,
    /// Bytes of buffers lent out.
    in_use: u64,
    idle: BTreeMap<usize, Vec<AlignedBuf>>,
    idle_bytes: u64,
    peak: u64,
    /// Buffers mapped since the start.
    allocations: u64,
    /// Locks every buffer when it is mapped.
    locker: Option<Arc<dyn PageLocker>>,
}

impl HostPool {
    pub(crate) fn new(budget: u64, locker: Option<Arc<dyn PageLocker>>) -> Self {
        Self { budget, in_use: 0, idle: BTreeMap::new(), idle_bytes: 0, peak: 0, allocations: 0, locker }
    }

    /// True when a tensor of `bytes` could ever be placed here (its class fits the whole budget).
    pub(crate) fn could_hold(&self, bytes: usize) -> bool {
        size_class(bytes).is_some_and(|c| c as u64 <= self.budget)
    }

    /// True when [`HostPool::take`] would succeed now (barring a failed mapping).
    pub(crate) fn has_room(&self, bytes: usize) -> bool {
        match size_class(bytes) {
            Some(c) => self.idle.get(&c).is_some_and(|v| !v.is_empty()) || self.in_use + c as u64 <= self.budget,
            None => false,
        }
    }

    /// A buffer for a tensor of `bytes`: an idle one of its class, or a new one when the budget allows (freeing
    /// idle buffers of other classes to make room), page-locked when the pool has a locker. `Ok(None)`: no room
    /// now.
    pub(crate) fn take(&mut self, bytes: usize) -> Result<Option<AlignedBuf>, TakeError> {
        let Some(class) = size_class(bytes) else { return Ok(None) };
        if let Some(buf) = self.idle.get_mut(&class).and_then(Vec::pop) {
            self.idle_bytes -= class as u64;
            self.in_use += class as u64;
            return Ok(Some(buf));
        }
        if self.in_use + class as u64 > self.budget {
            return Ok(None);
        }
        // Free idle buffers, largest classes first, until the new one fits beside what remains.
        while self.in_use + self.idle_bytes + class as u64 > self.budget {
            let Some(mut entry) = self.idle.last_entry() else { break };
            if let Some(buf) = entry.get_mut().pop() {
                self.idle_bytes -= buf.len() as u64;
            }
            if entry.get().is_empty() {
                entry.remove();
            }
        }
        let mut buf = AlignedBuf::zeroed(class).map_err(TakeError::Map)?;
        if let Some(locker) = &self.locker {
            buf.lock(locker).map_err(TakeError::Lock)?;
        }
        self.allocations += 1;
        self.in_use += class as u64;
        self.peak = self.peak.max(self.in_use + self.idle_bytes);
        Ok(Some(buf))
    }

    /// Returns a buffer from [`HostPool::take`] to the pool.
    pub(crate) fn put(&mut self, buf: AlignedBuf) {
        let class = buf.len();
        self.in_use -= class as u64;
        self.idle_bytes += class as u64;
        self.idle.entry(class).or_default().push(buf);
    }

    /// Books a buffer from [`HostPool::take`] that was lost (a worker panicked holding it).
    pub(crate) fn forget(&mut self, bytes: usize) {
        self.in_use -= size_class(bytes).unwrap_or(0) as u64;
    }

    pub(crate) fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes the pool holds: lent out and idle.
    pub(crate) fn held(&self) -> u64 {
        self.in_use + self.idle_bytes
    }

    pub(crate) fn peak(&self) -> u64 {
        self.peak
    }

    pub(crate) fn allocations(&self) -> u64 {
        self.allocations
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_waste_at_most_a_quarter() {
        assert_eq!(size_class(0), Some(4096));
        assert_eq!(size_class(4096), Some(4096));
        assert_eq!(size_class(4097), Some(8192));
        assert_eq!(size_class(1 << 20), Some(1 << 20));
        assert_eq!(size_class((1 << 20) + 1), Some((1 << 20) + (1 << 18)));
        assert_eq!(size_class(usize::MAX), None);
        for n in (1..200_000usize).step_by(997) {
            let c = size_class(n).unwrap();
            assert!(c >= n && c.is_multiple_of(ALIGN));
            assert!(n < ALIGN || c as f64 <= n as f64 * 1.25 + ALIGN as f64, "{n} -> {c}");
        }
    }

    #[test]
    fn buffers_are_reused_and_the_budget_bounds_idle_ones_too() {
        let mut pool = HostPool::new(3 << 20, None);
        let a = pool.take(1 << 20).unwrap().unwrap();
        let b = pool.take(1 << 20).unwrap().unwrap();
        pool.put(a);
        pool.put(b);
        assert_eq!((pool.held(), pool.allocations()), (2 << 20, 2));
        // Same class: reused, nothing mapped.
        let a = pool.take(1 << 20).unwrap().unwrap();
        assert_eq!(pool.allocations(), 2);
        // Another class that needs the idle buffer's room: it is freed first.
        let c = pool.take(2 << 20).unwrap().unwrap();
        assert_eq!(pool.held(), 3 << 20);
        assert!(!pool.has_room(1));
        assert!(pool.take(1).unwrap().is_none());
        assert!(pool.peak() <= pool.budget());
        pool.put(a);
        pool.put(c);
        assert!(!pool.could_hold(4 << 20));
    }
}
