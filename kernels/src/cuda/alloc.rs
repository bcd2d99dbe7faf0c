//! Device memory owned by a [`Buffer`](crate::Buffer): an allocation from the device's pool, given back
//! (stream-ordered) when dropped.

use std::fmt;
use std::sync::Arc;

use super::device::{Device, DevicePtr};
use crate::buffer::DeviceAllocation;
use crate::view::Memory;

/// `bytes` at `ptr`, from `device`'s pool.
pub(crate) struct CudaAllocation {
    device: Arc<dyn Device>,
    ptr: DevicePtr,
    bytes: usize,
}

impl CudaAllocation {
    /// `bytes` from `device`'s pool (at least 1 byte is asked, so that every allocation has an address of its
    /// own).
    pub fn new(device: &Arc<dyn Device>, bytes: usize) -> crate::Result<Self> {
        let ptr = device.alloc(bytes.max(1))?;
        Ok(Self { device: device.clone(), ptr, bytes })
    }
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Hands the allocation to `to`, another stream of its device ([`Backend::adopt`](crate::Backend::adopt)):
    /// `to` waits for the work enqueued so far on the stream that holds it, and frees it when dropped.
    pub fn move_to(&mut self, to: &Arc<dyn Device>) -> crate::Result<()> {
        if Arc::ptr_eq(&self.device, to) {
            return Ok(());
        }
        let event = self.device.record_event()?;
        to.wait_event(event.as_ref())?;
        self.device = to.clone();
        Ok(())
    }
}

impl fmt::Debug for CudaAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaAllocation({} bytes at {:#x} on {})", self.bytes, self.ptr, self.device.memory())
    }
}

// SAFETY: the range is a live allocation of the device's memory (`Device::alloc`), 256-byte aligned, owned by
// this value alone and freed only by its `Drop`.
unsafe impl DeviceAllocation for CudaAllocation {
    fn ptr(&self) -> u64 {
        self.ptr
    }
    fn bytes(&self) -> usize {
        self.bytes
    }
    fn memory(&self) -> Memory {
        self.device.memory()
    }
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

impl Drop for CudaAllocation {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from this device's `alloc` and nothing uses it after this (views borrow the buffer
        // that owns this allocation); the free is ordered after the work already enqueued on the stream.
        unsafe { self.device.free(self.ptr) }
    }
}
