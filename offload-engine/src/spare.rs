//! Spare tensor allocations: the bounded pool that `fetch` draws its outputs from.
//!
//! A tensor handed to `offload` is the caller's allocation. Once its copy into a tier has landed it goes here
//! if the pool's budget has room, and is dropped (its memory returned to the system) otherwise. The caller can
//! also give tensors it is done with back ([`OffloadEngine::recycle`](crate::OffloadEngine::recycle)). A fetch
//! whose dtype and length match a spare takes it instead of allocating. The budget defaults to zero: every
//! spilled tensor's memory is freed, which is what lowers peak memory on a machine whose host tier is the
//! same memory as the caller's. A trainer whose layers all have the same shapes that recycles each layer's
//! fetched tensors after its backward needs about one layer plus the prefetched ones of spare budget to fetch
//! without allocating.

use std::collections::HashMap;

use crate::tensor::{DType, HostData};

pub(crate) struct SparePool {
    budget: u64,
    bytes: u64,
    peak: u64,
    by_shape: HashMap<(DType, usize), Vec<HostData>>,
}

impl SparePool {
    pub(crate) fn new(budget: u64) -> Self {
        Self { budget, bytes: 0, peak: 0, by_shape: HashMap::new() }
    }

    /// Keeps `data` if there is room; hands it back otherwise, for the caller to drop outside any lock.
    pub(crate) fn put(&mut self, data: HostData) -> Option<HostData> {
        let size = data.capacity_bytes() as u64;
        if size == 0 || self.bytes + size > self.budget {
            return Some(data);
        }
        self.bytes += size;
        self.peak = self.peak.max(self.bytes);
        self.by_shape.entry((data.dtype(), data.len())).or_default().push(data);
        None
    }

    /// A spare of exactly this dtype and length (its contents are stale).
    pub(crate) fn take(&mut self, dtype: DType, len: usize) -> Option<HostData> {
        let data = self.by_shape.get_mut(&(dtype, len))?.pop()?;
        self.bytes -= data.capacity_bytes() as u64;
        Some(data)
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn peak(&self) -> u64 {
        self.peak
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_what_fits_and_matches_exact_shapes() {
        let mut spare = SparePool::new(100);
        assert!(spare.put(HostData::zeroed(DType::F32, 20)).is_none());
        assert!(spare.put(HostData::zeroed(DType::F32, 20)).is_some(), "over budget: handed back");
        assert!(spare.take(DType::F32, 19).is_none());
        assert!(spare.take(DType::Bf16, 40).is_none());
        assert_eq!(spare.take(DType::F32, 20).map(|d| d.len()), Some(20));
        assert_eq!((spare.bytes(), spare.peak()), (0, 80));
        assert!(SparePool::new(0).put(HostData::zeroed(DType::F16, 1)).is_some());
    }
}
