//! An owned buffer in some backend's memory, with its dims: what a plan allocates once for its workspace, and
//! what [`Backend::zeros`](crate::Backend::zeros) returns. It hands out [`View`]s and [`ViewMut`]s of itself.
//!
//! Host buffers own a `Vec`; a large one (1 MiB or more) that is dropped goes to the process's cache of host
//! buffers for the next one of its type and length (see [`Backend::empty`](crate::Backend::empty)). Device
//! buffers own a [`DeviceAllocation`], which gives the memory back to its backend's pool when dropped.

use std::fmt;

use crate::dtype::DType;
use crate::error::{KernelError, Result};
use crate::host::cache as host_cache;
pub use crate::host::HostVec;
use crate::host::{HostSlice, HostSliceMut};
use crate::view::{DeviceSlice, DeviceSliceMut, Dims, IntoDims, Memory, View, ViewMut};

/// Device memory that a [`Buffer`] owns: an address range in some device's memory, given back to the backend
/// that made it when dropped (the backend decides when: the CUDA backend's pool reuses it for work enqueued after
/// the drop on the stream that allocated it).
///
/// # Safety
/// `ptr()..ptr() + bytes()` is memory of `memory()` that stays allocated, and is used by nothing but views of
/// the buffer that owns this allocation, until the allocation is dropped. `ptr()` is aligned to 256 bytes.
pub unsafe trait DeviceAllocation: Send + Sync + fmt::Debug {
    /// The device address of the first byte.
    fn ptr(&self) -> u64;
    /// Bytes allocated.
    fn bytes(&self) -> usize;
    /// Which device's memory.
    fn memory(&self) -> Memory;
    /// For the backend that made the allocation to recognise it ([`Backend::adopt`](crate::Backend::adopt)); the
    /// default, `None`, is an allocation that cannot change hands.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
}

enum Owned {
    Host(HostVec),
    Device { alloc: Box<dyn DeviceAllocation>, dtype: DType },
}

impl fmt::Debug for Owned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Owned::Host(v) => write!(f, "Host({} elements of {})", v.len(), v.dtype().name()),
            Owned::Device { alloc, dtype } => write!(f, "Device({alloc:?}, {dtype:?})"),
        }
    }
}

/// An owned, contiguous buffer with dims (see the module docs).
#[derive(Debug)]
pub struct Buffer {
    data: Owned,
    dims: Dims,
}

impl Buffer {
    /// Zeros of `dtype` in host memory.
    pub fn host_zeros(dtype: DType, dims: impl IntoDims) -> Result<Self> {
        let dims = dims.into_dims()?;
        Self::from_host_vec(HostVec::zeros(dtype, dims.numel()), dims)
    }
    /// A host buffer owning `data` with `dims` (no copy). Errors: a length that is not the dims' product.
    pub fn from_host_vec(data: HostVec, dims: impl IntoDims) -> Result<Self> {
        let dims = dims.into_dims()?;
        crate::error::check_len("data", data.len(), dims.numel())?;
        host_cache::made(host_cache::bytes_of(&data));
        Ok(Self::owning(data, dims))
    }
    /// A buffer taken from the host cache (already counted there).
    pub(crate) fn owning(data: HostVec, dims: Dims) -> Self {
        Self { data: Owned::Host(data), dims }
    }
    /// A device buffer of `dtype` with `dims` owning `alloc` (what a device backend's
    /// [`Backend::empty`](crate::Backend::empty) returns). Errors: an allocation smaller than the dims need.
    pub fn from_device(alloc: Box<dyn DeviceAllocation>, dtype: DType, dims: impl IntoDims) -> Result<Self> {
        let dims = dims.into_dims()?;
        let need = dims.numel() * dtype.size();
        if alloc.bytes() < need {
            return Err(KernelError::Shape(format!(
                "a device allocation of {} bytes cannot hold {dims:?} of {}",
                alloc.bytes(),
                dtype.name()
            )));
        }
        Ok(Self { data: Owned::Device { alloc, dtype }, dims })
    }
    /// The elements, moved out (no copy), with the dims; a device buffer is handed back unchanged (its
    /// elements reach the host through [`Backend::download`](crate::Backend::download)).
    pub fn into_host_vec(mut self) -> std::result::Result<(HostVec, Dims), Buffer> {
        if matches!(self.data, Owned::Device { .. }) {
            return Err(self);
        }
        let data = self.take_host();
        host_cache::left(host_cache::bytes_of(&data));
        Ok((data, self.dims))
    }
    /// A host buffer's elements, leaving it empty (for its `Drop` not to see them again).
    fn take_host(&mut self) -> HostVec {
        match std::mem::replace(&mut self.data, Owned::Host(HostVec::F32(Vec::new()))) {
            Owned::Host(v) => v,
            device @ Owned::Device { .. } => {
                self.data = device;
                HostVec::F32(Vec::new())
            }
        }
    }
    /// A device buffer's allocation (`None` for a host buffer).
    pub fn device_allocation_mut(&mut self) -> Option<&mut dyn DeviceAllocation> {
        match &mut self.data {
            Owned::Host(_) => None,
            Owned::Device { alloc, .. } => Some(&mut **alloc),
        }
    }
    /// The dims.
    pub fn dims(&self) -> &[usize] {
        self.dims.as_slice()
    }
    /// Elements.
    pub fn len(&self) -> usize {
        self.dims.numel()
    }
    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        match &self.data {
            Owned::Host(v) => v.dtype(),
            Owned::Device { dtype, .. } => *dtype,
        }
    }
    /// Where the elements live.
    pub fn memory(&self) -> Memory {
        match &self.data {
            Owned::Host(_) => Memory::Host,
            Owned::Device { alloc, .. } => alloc.memory(),
        }
    }
    /// Bytes the elements take.
    pub fn bytes(&self) -> usize {
        self.len() * self.dtype().size()
    }
    /// A read-only view of the whole buffer.
    pub fn view(&self) -> View<'_> {
        let view = match &self.data {
            Owned::Host(HostVec::F32(v)) => View::host(HostSlice::F32(v), self.dims),
            Owned::Host(HostVec::Bf16(v)) => View::host(HostSlice::Bf16(v), self.dims),
            Owned::Host(HostVec::F16(v)) => View::host(HostSlice::F16(v), self.dims),
            Owned::Device { alloc, dtype } => {
                // SAFETY: the allocation holds the dims' elements (checked when the buffer was made) and lives
                // as long as `self`, which the view borrows.
                let d = unsafe { DeviceSlice::new(alloc.ptr(), self.len(), *dtype, alloc.memory()) };
                View::device(d, self.dims)
            }
        };
        view.expect("a buffer's dims match its length")
    }
    /// A writable view of the whole buffer.
    pub fn view_mut(&mut self) -> ViewMut<'_> {
        let len = self.len();
        let view = match &mut self.data {
            Owned::Host(HostVec::F32(v)) => ViewMut::host(HostSliceMut::F32(v), self.dims),
            Owned::Host(HostVec::Bf16(v)) => ViewMut::host(HostSliceMut::Bf16(v), self.dims),
            Owned::Host(HostVec::F16(v)) => ViewMut::host(HostSliceMut::F16(v), self.dims),
            Owned::Device { alloc, dtype } => {
                // SAFETY: as in `view`; the view borrows `self` mutably, so it is the only one.
                let d = unsafe { DeviceSliceMut::new(alloc.ptr(), len, *dtype, alloc.memory()) };
                ViewMut::device(d, self.dims)
            }
        };
        view.expect("a buffer's dims match its length")
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if !matches!(self.data, Owned::Device { .. }) {
            host_cache::give(self.take_host());
        }
    }
}
