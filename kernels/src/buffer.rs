//! An owned buffer in some backend's memory, with its dims: what a plan allocates once for its workspace, and
//! what [`Backend::zeros`](crate::Backend::zeros) returns. It hands out [`View`]s and [`ViewMut`]s of itself.
//!
//! A large host buffer (1 MiB or more) that is dropped goes to the process's cache of host buffers for the
//! next one of its type and length (see [`Backend::empty`](crate::Backend::empty)).

use half::bf16;

use crate::dtype::DType;
use crate::error::Result;
use crate::host::cache as host_cache;
pub use crate::host::HostVec;
use crate::host::{HostSlice, HostSliceMut};
use crate::view::{Dims, IntoDims, Memory, View, ViewMut};

#[derive(Debug)]
enum Owned {
    HostF32(Vec<f32>),
    HostBf16(Vec<bf16>),
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
        let n = dims.numel();
        let data = match dtype {
            DType::F32 => HostVec::F32(vec![0.0; n]),
            DType::Bf16 => HostVec::Bf16(vec![bf16::ZERO; n]),
        };
        Self::from_host_vec(data, dims)
    }
    /// A host buffer owning `data` with `dims` (no copy). Errors: a length that is not the dims' product.
    pub fn from_host_vec(data: HostVec, dims: impl IntoDims) -> Result<Self> {
        let dims = dims.into_dims()?;
        let len = match &data {
            HostVec::F32(v) => v.len(),
            HostVec::Bf16(v) => v.len(),
        };
        crate::error::check_len("data", len, dims.numel())?;
        host_cache::made(host_cache::bytes_of(&data));
        Ok(Self::owning(data, dims))
    }
    /// A buffer taken from the host cache (already counted there).
    pub(crate) fn owning(data: HostVec, dims: Dims) -> Self {
        let data = match data {
            HostVec::F32(v) => Owned::HostF32(v),
            HostVec::Bf16(v) => Owned::HostBf16(v),
        };
        Self { data, dims }
    }
    /// The elements, moved out (no copy), with the dims. Host buffers only: a device buffer (with the CUDA
    /// backend) is copied out by its backend.
    pub fn into_host_vec(mut self) -> (HostVec, Dims) {
        let data = self.take_data();
        host_cache::left(host_cache::bytes_of(&data));
        (data, self.dims)
    }
    /// The elements, leaving the buffer empty (for its `Drop` not to see them again).
    fn take_data(&mut self) -> HostVec {
        match std::mem::replace(&mut self.data, Owned::HostF32(Vec::new())) {
            Owned::HostF32(v) => HostVec::F32(v),
            Owned::HostBf16(v) => HostVec::Bf16(v),
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
            Owned::HostF32(_) => DType::F32,
            Owned::HostBf16(_) => DType::Bf16,
        }
    }
    /// Where the elements live.
    pub fn memory(&self) -> Memory {
        Memory::Host
    }
    /// Bytes the elements take.
    pub fn bytes(&self) -> usize {
        self.len() * self.dtype().size()
    }
    /// A read-only view of the whole buffer.
    pub fn view(&self) -> View<'_> {
        let h = match &self.data {
            Owned::HostF32(v) => HostSlice::F32(v),
            Owned::HostBf16(v) => HostSlice::Bf16(v),
        };
        View::host(h, self.dims).expect("a buffer's dims match its length")
    }
    /// A writable view of the whole buffer.
    pub fn view_mut(&mut self) -> ViewMut<'_> {
        let h = match &mut self.data {
            Owned::HostF32(v) => HostSliceMut::F32(v),
            Owned::HostBf16(v) => HostSliceMut::Bf16(v),
        };
        ViewMut::host(h, self.dims).expect("a buffer's dims match its length")
    }
}

impl Clone for Buffer {
    fn clone(&self) -> Self {
        let data = match &self.data {
            Owned::HostF32(v) => HostVec::F32(v.clone()),
            Owned::HostBf16(v) => HostVec::Bf16(v.clone()),
        };
        host_cache::made(host_cache::bytes_of(&data));
        Self::owning(data, self.dims)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        host_cache::give(self.take_data());
    }
}
