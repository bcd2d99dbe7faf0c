//! Device tensors: a buffer in an accelerator's memory, handed over by value and moved straight into a tier.
//!
//! The engine knows no device API. A caller that offloads from device memory gives the builder a
//! [`DeviceCopier`] ([`OffloadEngineBuilder::device`](crate::OffloadEngineBuilder::device)): it copies a
//! [`DeviceBuffer`] into a host tier buffer and back, and allocates the buffers fetches return. A device tensor
//! then costs one copy each way through the host tier: device → pool buffer on offload (the device allocation
//! is dropped once the copy is done, which is what frees device memory), pool buffer → a new device allocation
//! on fetch or prefetch. With a [`PageLocker`](crate::PageLocker) that registers the pool with the device's
//! driver those copies run by DMA at the bus's speed. Spill files are written from host memory, so a device
//! tensor placed in the disk tier is staged through one host buffer of its size each way, unless its buffer is
//! host memory the CPU can read where it is ([`DeviceBuffer::host_bytes`], a CPU backend's buffers), which is
//! then written and read in place.
//!
//! Ordering: the copier's [`download`](DeviceCopier::download) runs on a worker thread while the caller goes
//! on; it must wait for the work that produced the buffer (a device backend orders the copy after the ops
//! already enqueued on its stream, as its own download does). A fetch returns once the copy back has finished:
//! the worker's return from [`upload`](DeviceCopier::upload) is the completion event the caller waits on.

use std::any::Any;
use std::fmt;
use std::io;

use crate::tensor::{DType, ShapeMismatch};

/// An owned allocation in a device's memory (or any memory a [`DeviceCopier`] can reach), holding one tensor.
///
/// The engine only asks its size and, for the disk tier, whether the CPU can read it in place; the copier
/// that made it knows what it is (it downcasts: a `dyn DeviceBuffer` is a `dyn Any`).
pub trait DeviceBuffer: Any + Send + fmt::Debug {
    /// Bytes of the tensor it holds.
    fn size_bytes(&self) -> usize;

    /// The bytes, when the CPU can read them where they are (a host-memory backend's buffer); the default,
    /// `None`, is right for device memory.
    fn host_bytes(&self) -> Option<&[u8]> {
        None
    }

    /// The bytes for writing, when the CPU can write them where they are (see [`DeviceBuffer::host_bytes`]).
    fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        None
    }
}

/// Copies between one device's memory and host memory for the engine's workers (see the module docs).
///
/// Called from the worker threads, several at once: an implementation must be `Sync` and order each copy
/// after the work that produced its source. The host bytes the engine hands it (a pool buffer, or a staging
/// buffer for the disk tier) are aligned to 8 bytes at least, so they can be read as elements of any [`DType`].
pub trait DeviceCopier: Send + Sync + fmt::Debug {
    /// Copies all of `src` into `dst` (`dst.len() == src.size_bytes()`) and returns once `dst` holds the bytes.
    fn download(&self, src: &dyn DeviceBuffer, dst: &mut [u8]) -> io::Result<()>;

    /// A new allocation for a tensor of `dtype` and `dims` (its contents are overwritten at once by
    /// [`DeviceCopier::upload`]).
    fn alloc(&self, dtype: DType, dims: &[usize]) -> io::Result<Box<dyn DeviceBuffer>>;

    /// Copies `src` into all of `dst` (`src.len() == dst.size_bytes()`) and returns once `src` may be reused and
    /// `dst` holds the bytes for any work the caller orders after the fetch.
    fn upload(&self, src: &[u8], dst: &mut dyn DeviceBuffer) -> io::Result<()>;
}

/// A tensor in device memory: a [`DeviceBuffer`], its element type and its dims (row-major, no strides).
/// What [`OffloadEngine::offload`](crate::OffloadEngine::offload) takes by value and a device ticket's fetch
/// gives back.
pub struct DeviceTensor {
    buffer: Box<dyn DeviceBuffer>,
    dtype: DType,
    dims: Vec<usize>,
}

impl DeviceTensor {
    /// A tensor over `buffer`, which must hold exactly the product of `dims` elements of `dtype`.
    pub fn new(
        buffer: Box<dyn DeviceBuffer>,
        dtype: DType,
        dims: impl Into<Vec<usize>>,
    ) -> Result<Self, ShapeMismatch> {
        let dims = dims.into();
        let bytes = dims.iter().try_fold(dtype.size(), |n, &d| n.checked_mul(d));
        if bytes != Some(buffer.size_bytes()) {
            return Err(ShapeMismatch { dims, len: buffer.size_bytes() / dtype.size() });
        }
        Ok(Self { buffer, dtype, dims })
    }

    pub(crate) fn from_parts(buffer: Box<dyn DeviceBuffer>, dtype: DType, dims: Vec<usize>) -> Self {
        debug_assert_eq!(dims.iter().product::<usize>() * dtype.size(), buffer.size_bytes());
        Self { buffer, dtype, dims }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dims.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Bytes the elements take.
    pub fn size_bytes(&self) -> usize {
        self.buffer.size_bytes()
    }

    /// The buffer.
    pub fn buffer(&self) -> &dyn DeviceBuffer {
        &*self.buffer
    }

    /// The buffer, its element type and its dims, taken apart.
    pub fn into_parts(self) -> (Box<dyn DeviceBuffer>, DType, Vec<usize>) {
        (self.buffer, self.dtype, self.dims)
    }

    /// The buffer as the concrete type the caller's copier made, or the tensor back if it is another type.
    pub fn downcast<T: DeviceBuffer>(self) -> Result<Box<T>, Self> {
        let Self { buffer, dtype, dims } = self;
        if (&*buffer as &dyn Any).is::<T>() {
            let any: Box<dyn Any> = buffer;
            Ok(any.downcast::<T>().unwrap_or_else(|_| unreachable!("checked with `is` just above")))
        } else {
            Err(Self { buffer, dtype, dims })
        }
    }
}

impl fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceTensor")
            .field("dtype", &self.dtype)
            .field("dims", &self.dims)
            .field("buffer", &self.buffer)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Bytes(Vec<u8>);

    impl DeviceBuffer for Bytes {
        fn size_bytes(&self) -> usize {
            self.0.len()
        }
    }

    #[derive(Debug)]
    struct Other;

    impl DeviceBuffer for Other {
        fn size_bytes(&self) -> usize {
            0
        }
    }

    #[test]
    fn the_buffer_must_hold_the_dims() {
        assert!(DeviceTensor::new(Box::new(Bytes(vec![0; 24])), DType::F32, [2, 3]).is_ok());
        let err = DeviceTensor::new(Box::new(Bytes(vec![0; 24])), DType::Bf16, [2, 3]).unwrap_err();
        assert_eq!((err.dims, err.len), (vec![2, 3], 12));
        assert!(DeviceTensor::new(Box::new(Bytes(vec![])), DType::F16, [usize::MAX, 2]).is_err());
    }

    #[test]
    fn downcast_to_the_copiers_type_or_get_the_tensor_back() {
        let t = DeviceTensor::new(Box::new(Bytes(vec![7; 8])), DType::F32, [2]).unwrap();
        let t = t.downcast::<Other>().unwrap_err();
        assert_eq!(t.dims(), &[2]);
        assert_eq!(t.downcast::<Bytes>().unwrap().0, vec![7; 8]);
    }
}
