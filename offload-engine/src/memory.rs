//! Where a tensor is handed over from: host memory ([`HostTensor`]) or a device's ([`DeviceTensor`]). A ticket
//! carries it in its type ([`Host`] or [`Device`]), so a fetch gives back the kind of tensor that was offloaded,
//! checked at compile time.

use crate::device::{DeviceBuffer, DeviceTensor};
use crate::tensor::{DType, HostData, HostTensor};

/// A tensor of either memory, as one value: what [`OffloadError::TooLarge`](crate::OffloadError::TooLarge) hands
/// back.
#[derive(Debug)]
pub enum Tensor {
    /// In host memory.
    Host(HostTensor),
    /// In a device's memory.
    Device(DeviceTensor),
}

impl Tensor {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Tensor::Host(t) => t.dtype(),
            Tensor::Device(t) => t.dtype(),
        }
    }

    /// The dims.
    pub fn dims(&self) -> &[usize] {
        match self {
            Tensor::Host(t) => t.dims(),
            Tensor::Device(t) => t.dims(),
        }
    }

    /// The host tensor, or this one back when it is in device memory.
    pub fn into_host(self) -> Result<HostTensor, Self> {
        match self {
            Tensor::Host(t) => Ok(t),
            other => Err(other),
        }
    }

    /// The device tensor, or this one back when it is in host memory.
    pub fn into_device(self) -> Result<DeviceTensor, Self> {
        match self {
            Tensor::Device(t) => Ok(t),
            other => Err(other),
        }
    }

    pub(crate) fn into_payload(self) -> (Payload, DType, Vec<usize>) {
        match self {
            Tensor::Host(t) => {
                let (data, dims) = t.into_parts();
                let dtype = data.dtype();
                (Payload::Host(data), dtype, dims)
            }
            Tensor::Device(t) => {
                let (buffer, dtype, dims) = t.into_parts();
                (Payload::Device(buffer), dtype, dims)
            }
        }
    }

    pub(crate) fn from_payload(payload: Payload, dtype: DType, dims: Vec<usize>) -> Self {
        match payload {
            Payload::Host(data) => Tensor::Host(HostTensor::from_parts(data, dims)),
            Payload::Device(buffer) => Tensor::Device(DeviceTensor::from_parts(buffer, dtype, dims)),
        }
    }
}

impl From<HostTensor> for Tensor {
    fn from(t: HostTensor) -> Self {
        Tensor::Host(t)
    }
}

impl From<DeviceTensor> for Tensor {
    fn from(t: DeviceTensor) -> Self {
        Tensor::Device(t)
    }
}

/// The memory a ticket's tensor was handed over from and comes back to: [`Host`] or [`Device`] (sealed).
pub trait Memory: sealed::Sealed + 'static {
    /// What a fetch gives back.
    type Tensor: Into<Tensor>;
    /// The tensor, when it is in this memory (a ticket's tensor always is).
    fn from_tensor(t: Tensor) -> Result<Self::Tensor, Tensor>;
}

/// Host memory: the tensor is a [`HostTensor`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Host {}

/// A device's memory: the tensor is a [`DeviceTensor`], copied by the engine's
/// [`DeviceCopier`](crate::DeviceCopier).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {}

impl Memory for Host {
    type Tensor = HostTensor;
    fn from_tensor(t: Tensor) -> Result<HostTensor, Tensor> {
        t.into_host()
    }
}

impl Memory for Device {
    type Tensor = DeviceTensor;
    fn from_tensor(t: Tensor) -> Result<DeviceTensor, Tensor> {
        t.into_device()
    }
}

/// A tensor the engine takes: [`HostTensor`] or [`DeviceTensor`] (sealed).
pub trait Offloadable: Into<Tensor> + sealed::Sealed {
    /// The memory it is in.
    type Memory: Memory;
}

impl Offloadable for HostTensor {
    type Memory = Host;
}

impl Offloadable for DeviceTensor {
    type Memory = Device;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Host {}
    impl Sealed for super::Device {}
    impl Sealed for crate::tensor::HostTensor {}
    impl Sealed for crate::device::DeviceTensor {}
}

/// A tensor's data inside the engine, in whichever memory it is.
pub(crate) enum Payload {
    Host(HostData),
    Device(Box<dyn DeviceBuffer>),
}

impl Payload {
    /// Bytes of the elements.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Payload::Host(d) => d.as_bytes().len(),
            Payload::Device(b) => b.size_bytes(),
        }
    }
}
