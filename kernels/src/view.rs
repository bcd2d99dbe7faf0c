//! Views that carry their shape: data, dims, dtype and the kind of memory they live in.
//!
//! A [`View`] (read-only) or [`ViewMut`] (writable) is what every [`Backend`](crate::Backend) method takes.
//! It is not a tensor library: no broadcasting, no strides, no autograd, no lazy ops; a view is a contiguous
//! row-major buffer with up to four dims, checked once when it is made. The memory is an enum (host memory, or a
//! device's: [`DeviceSlice`], an address range a device backend made), so code written against views runs on
//! every backend without changing its signatures, as candle's `Storage { Cpu, Cuda }` does. A backend checks
//! that every view it is given lives in its memory ([`KernelError::Memory`]); host code reaches a device view's
//! elements only through [`Backend::download`](crate::Backend::download).
//!
//! ```
//! use longctx_kernels::{View, ViewMut, DType};
//! let q = vec![0.5f32; 2 * 4 * 64 * 32];
//! let v = View::new(&q, [2, 4, 64, 32])?; // checked: 2·4·64·32 elements
//! assert_eq!((v.dims(), v.dtype()), (&[2, 4, 64, 32][..], DType::F32));
//! assert!(View::new(&q, [2, 4, 64, 31]).is_err());
//! let mut o = vec![0f32; q.len()];
//! let o = ViewMut::new(&mut o, [2, 4, 64, 32])?;
//! assert_eq!(o.len(), q.len());
//! # Ok::<(), longctx_kernels::KernelError>(())
//! ```

use std::fmt;
use std::marker::PhantomData;

use half::{bf16, f16};

use crate::dtype::{DType, Element};
use crate::error::{KernelError, Result};
use crate::host::{HostSlice, HostSliceMut};

/// The most dims a view has (`[B, H, S, D]`).
pub const MAX_DIMS: usize = 4;

/// The dims of a view, outermost first (row-major: the last dim is contiguous).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dims {
    rank: u8,
    d: [usize; MAX_DIMS],
}

impl Dims {
    /// Up to [`MAX_DIMS`] dims; the element count must fit in `usize`.
    pub fn new(dims: &[usize]) -> Result<Self> {
        if dims.is_empty() || dims.len() > MAX_DIMS {
            return Err(KernelError::Shape(format!("a view has 1 to {MAX_DIMS} dims, not {}", dims.len())));
        }
        dims.iter()
            .try_fold(1usize, |a, &x| a.checked_mul(x))
            .ok_or_else(|| KernelError::Shape(format!("element count of {dims:?} overflows usize")))?;
        let mut d = [1; MAX_DIMS];
        d[..dims.len()].copy_from_slice(dims);
        Ok(Self { rank: dims.len() as u8, d })
    }
    /// The dims as a slice.
    pub fn as_slice(&self) -> &[usize] {
        &self.d[..self.rank as usize]
    }
    /// Elements they hold.
    pub fn numel(&self) -> usize {
        self.as_slice().iter().product()
    }
}

impl fmt::Debug for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.as_slice())
    }
}

/// What can name a view's dims: `[usize; N]`, `&[usize]`, `Vec<usize>` or [`Dims`].
pub trait IntoDims {
    /// The dims, checked.
    fn into_dims(self) -> Result<Dims>;
}
impl<const N: usize> IntoDims for [usize; N] {
    fn into_dims(self) -> Result<Dims> {
        Dims::new(&self)
    }
}
impl IntoDims for &[usize] {
    fn into_dims(self) -> Result<Dims> {
        Dims::new(self)
    }
}
impl IntoDims for Vec<usize> {
    fn into_dims(self) -> Result<Dims> {
        Dims::new(&self)
    }
}
impl IntoDims for Dims {
    fn into_dims(self) -> Result<Dims> {
        Ok(self)
    }
}

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Memory {
    /// Ordinary (pageable or pinned) host memory.
    Host,
    /// Memory of the CUDA device with this ordinal.
    Cuda {
        /// The device ordinal.
        ordinal: usize,
    },
}

impl fmt::Display for Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Memory::Host => write!(f, "host"),
            Memory::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// A read-only view of device memory: an address, an element count and type, and the device. Made by a device
/// backend's [`Buffer`](crate::Buffer)s, or by [`DeviceSlice::new`] for memory a framework owns.
#[derive(Debug, Clone, Copy)]
pub struct DeviceSlice<'a> {
    ptr: u64,
    len: usize,
    dtype: DType,
    memory: Memory,
    _life: PhantomData<&'a ()>,
}

/// A writable view of device memory (see [`DeviceSlice`]).
#[derive(Debug)]
pub struct DeviceSliceMut<'a> {
    ptr: u64,
    len: usize,
    dtype: DType,
    memory: Memory,
    _life: PhantomData<&'a mut ()>,
}

impl<'a> DeviceSlice<'a> {
    /// `len` elements of `dtype` at device address `ptr` of `memory`.
    ///
    /// # Safety
    /// The `len · dtype.size()` bytes at `ptr` are memory of `memory`, allocated for `'a`, and not written
    /// through anything else for `'a` (outside work ordered before or after the reads, as the backend's
    /// ordering rules say).
    pub unsafe fn new(ptr: u64, len: usize, dtype: DType, memory: Memory) -> Self {
        Self { ptr, len, dtype, memory, _life: PhantomData }
    }
    /// The device address of the first element.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when the slice holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Which device's memory.
    pub fn memory(&self) -> Memory {
        self.memory
    }
    fn sub(self, start: usize, len: usize) -> Self {
        Self { ptr: self.ptr + (start * self.dtype.size()) as u64, len, ..self }
    }
}

impl<'a> DeviceSliceMut<'a> {
    /// `len` writable elements of `dtype` at device address `ptr` of `memory`.
    ///
    /// # Safety
    /// As [`DeviceSlice::new`], and nothing else reads or writes the bytes for `'a`.
    pub unsafe fn new(ptr: u64, len: usize, dtype: DType, memory: Memory) -> Self {
        Self { ptr, len, dtype, memory, _life: PhantomData }
    }
    /// The device address of the first element.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when the slice holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Which device's memory.
    pub fn memory(&self) -> Memory {
        self.memory
    }
    fn into_sub(self, start: usize, len: usize) -> Self {
        Self { ptr: self.ptr + (start * self.dtype.size()) as u64, len, ..self }
    }
    fn into_split(self, at: usize) -> (Self, Self) {
        let tail = Self { ptr: self.ptr + (at * self.dtype.size()) as u64, len: self.len - at, ..self };
        (Self { len: at, ..self }, tail)
    }
    fn reborrow(&mut self) -> DeviceSliceMut<'_> {
        DeviceSliceMut { ptr: self.ptr, len: self.len, dtype: self.dtype, memory: self.memory, _life: PhantomData }
    }
    fn as_slice(&self) -> DeviceSlice<'_> {
        DeviceSlice { ptr: self.ptr, len: self.len, dtype: self.dtype, memory: self.memory, _life: PhantomData }
    }
}

#[derive(Debug, Clone, Copy)]
enum Data<'a> {
    Host(HostSlice<'a>),
    Device(DeviceSlice<'a>),
}

#[derive(Debug)]
enum DataMut<'a> {
    Host(HostSliceMut<'a>),
    Device(DeviceSliceMut<'a>),
}

/// A read-only buffer with its dims (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    data: Data<'a>,
    dims: Dims,
}

/// A writable buffer with its dims (see the module docs).
#[derive(Debug)]
pub struct ViewMut<'a> {
    data: DataMut<'a>,
    dims: Dims,
}

/// Where a view's bytes lie, for code that moves them without reading them as numbers (a transport): host
/// bytes, or a device address with the memory it is in.
#[derive(Debug, Clone, Copy)]
pub enum RawBytes<'a> {
    /// Host memory.
    Host(&'a [u8]),
    /// Device memory: `len` bytes at `ptr`.
    Device {
        /// Address of the first byte.
        ptr: u64,
        /// Length in bytes.
        len: usize,
        /// The device.
        memory: Memory,
    },
}

/// Where a writable view's bytes lie (see [`RawBytes`]).
#[derive(Debug)]
pub enum RawBytesMut<'a> {
    /// Host memory.
    Host(&'a mut [u8]),
    /// Device memory: `len` bytes at `ptr`.
    Device {
        /// Address of the first byte.
        ptr: u64,
        /// Length in bytes.
        len: usize,
        /// The device.
        memory: Memory,
    },
}

fn check_numel(len: usize, dims: &Dims) -> Result<()> {
    if len == dims.numel() {
        Ok(())
    } else {
        Err(KernelError::Shape(format!("a buffer of {len} elements cannot have dims {dims:?}")))
    }
}

fn bytes_error(e: bytemuck::PodCastError) -> KernelError {
    KernelError::InvalidArgument { name: "bytes", why: format!("not whole elements aligned for their type ({e:?})") }
}

fn cast_bytes<T: bytemuck::Pod>(bytes: &[u8]) -> Result<&[T]> {
    bytemuck::try_cast_slice(bytes).map_err(bytes_error)
}

fn cast_bytes_mut<T: bytemuck::Pod>(bytes: &mut [u8]) -> Result<&mut [T]> {
    bytemuck::try_cast_slice_mut(bytes).map_err(bytes_error)
}

impl<'a> View<'a> {
    /// Host elements of `f32`, `bf16` or `f16` with dims whose product is their length.
    pub fn new<T: Element>(data: &'a [T], dims: impl IntoDims) -> Result<Self> {
        Self::host(T::host(data), dims)
    }
    /// A typed host slice with dims.
    pub fn host(data: HostSlice<'a>, dims: impl IntoDims) -> Result<Self> {
        let dims = dims.into_dims()?;
        check_numel(data.len(), &dims)?;
        Ok(Self { data: Data::Host(data), dims })
    }
    /// Host bytes read as elements of `dtype` with dims (a message, a staging buffer): [`KernelError::InvalidArgument`]
    /// naming `bytes` when they are not whole elements aligned for `dtype`.
    pub fn from_host_bytes(bytes: &'a [u8], dtype: DType, dims: impl IntoDims) -> Result<Self> {
        let data = match dtype {
            DType::F32 => HostSlice::F32(cast_bytes(bytes)?),
            DType::Bf16 => HostSlice::Bf16(cast_bytes(bytes)?),
            DType::F16 => HostSlice::F16(cast_bytes(bytes)?),
        };
        Self::host(data, dims)
    }
    /// A device slice with dims.
    pub fn device(data: DeviceSlice<'a>, dims: impl IntoDims) -> Result<Self> {
        let dims = dims.into_dims()?;
        check_numel(data.len(), &dims)?;
        Ok(Self { data: Data::Device(data), dims })
    }
    /// Host elements viewed as one dimension of their length.
    pub fn flat<T: Element>(data: &'a [T]) -> Self {
        let dims = Dims { rank: 1, d: [data.len(), 1, 1, 1] };
        Self { data: Data::Host(T::host(data)), dims }
    }
    /// The dims.
    pub fn dims(&self) -> &[usize] {
        self.dims.as_slice()
    }
    /// The dims as a value.
    pub fn shape(&self) -> Dims {
        self.dims
    }
    /// Elements.
    pub fn len(&self) -> usize {
        self.dims.numel()
    }
    /// True when the view holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        match &self.data {
            Data::Host(h) => h.dtype(),
            Data::Device(d) => d.dtype(),
        }
    }
    /// Where the elements live.
    pub fn memory(&self) -> Memory {
        match &self.data {
            Data::Host(_) => Memory::Host,
            Data::Device(d) => d.memory(),
        }
    }
    /// Bytes the elements take.
    pub fn bytes(&self) -> usize {
        self.len() * self.dtype().size()
    }
    /// The same elements with other dims of the same element count.
    pub fn reshape(self, dims: impl IntoDims) -> Result<Self> {
        let dims = dims.into_dims()?;
        check_numel(self.len(), &dims)?;
        Ok(Self { data: self.data, dims })
    }
    /// Rows `start..start + n` of the first dim (the other dims kept): e.g. one expert's tokens of a mixture of
    /// experts' dispatched `[N, C]` rows. Errors when the rows run past the view.
    pub fn rows(self, start: usize, n: usize) -> Result<Self> {
        let (dims, at, len) = row_range(&self.dims, start, n)?;
        let data = match self.data {
            Data::Host(h) => Data::Host(h.sub(at, len)),
            Data::Device(d) => Data::Device(d.sub(at, len)),
        };
        Ok(Self { data, dims })
    }
    /// Where the bytes lie (see [`RawBytes`]).
    pub fn raw_bytes(&self) -> RawBytes<'a> {
        match self.data {
            Data::Host(HostSlice::F32(s)) => RawBytes::Host(bytemuck::cast_slice(s)),
            Data::Host(HostSlice::Bf16(s)) => RawBytes::Host(bytemuck::cast_slice(s)),
            Data::Host(HostSlice::F16(s)) => RawBytes::Host(bytemuck::cast_slice(s)),
            Data::Device(d) => RawBytes::Device { ptr: d.ptr(), len: d.len() * d.dtype().size(), memory: d.memory() },
        }
    }
    /// The host slice, or [`KernelError::Memory`] naming `name` when the view lives elsewhere.
    pub fn as_host(&self, name: &'static str) -> Result<HostSlice<'a>> {
        match self.data {
            Data::Host(h) => Ok(h),
            Data::Device(d) => Err(not_host(name, d.memory())),
        }
    }
    /// The device slice, or [`KernelError::Memory`] naming `name` when the view is not in `memory` (a device
    /// backend's own).
    pub fn as_device(&self, name: &'static str, memory: Memory) -> Result<DeviceSlice<'a>> {
        match self.data {
            Data::Device(d) if d.memory() == memory => Ok(d),
            _ => Err(wrong_memory(name, memory, self.memory())),
        }
    }
    /// The host elements as `T`, or an error naming `name` (wrong memory or dtype).
    pub fn as_typed<T: Element>(&self, name: &'static str) -> Result<&'a [T]> {
        match self.as_host(name)? {
            HostSlice::F32(s) if T::DTYPE == DType::F32 => Ok(bytemuck::cast_slice(s)),
            HostSlice::Bf16(s) if T::DTYPE == DType::Bf16 => Ok(bytemuck::cast_slice(s)),
            HostSlice::F16(s) if T::DTYPE == DType::F16 => Ok(bytemuck::cast_slice(s)),
            h => Err(dtype_error(name, T::DTYPE, h.dtype())),
        }
    }
}

impl<'a> ViewMut<'a> {
    /// Writable host elements of `f32`, `bf16` or `f16` with dims whose product is their length.
    pub fn new<T: Element>(data: &'a mut [T], dims: impl IntoDims) -> Result<Self> {
        Self::host(T::host_mut(data), dims)
    }
    /// A writable typed host slice with dims.
    pub fn host(data: HostSliceMut<'a>, dims: impl IntoDims) -> Result<Self> {
        let dims = dims.into_dims()?;
        check_numel(data.len(), &dims)?;
        Ok(Self { data: DataMut::Host(data), dims })
    }
    /// Writable host bytes as elements of `dtype` with dims (see [`View::from_host_bytes`]).
    pub fn from_host_bytes(bytes: &'a mut [u8], dtype: DType, dims: impl IntoDims) -> Result<Self> {
        let data = match dtype {
            DType::F32 => HostSliceMut::F32(cast_bytes_mut(bytes)?),
            DType::Bf16 => HostSliceMut::Bf16(cast_bytes_mut(bytes)?),
            DType::F16 => HostSliceMut::F16(cast_bytes_mut(bytes)?),
        };
        Self::host(data, dims)
    }
    /// A writable device slice with dims.
    pub fn device(data: DeviceSliceMut<'a>, dims: impl IntoDims) -> Result<Self> {
        let dims = dims.into_dims()?;
        check_numel(data.len(), &dims)?;
        Ok(Self { data: DataMut::Device(data), dims })
    }
    /// Writable host elements viewed as one dimension of their length.
    pub fn flat<T: Element>(data: &'a mut [T]) -> Self {
        let dims = Dims { rank: 1, d: [data.len(), 1, 1, 1] };
        Self { data: DataMut::Host(T::host_mut(data)), dims }
    }
    /// The dims.
    pub fn dims(&self) -> &[usize] {
        self.dims.as_slice()
    }
    /// The dims as a value.
    pub fn shape(&self) -> Dims {
        self.dims
    }
    /// Elements.
    pub fn len(&self) -> usize {
        self.dims.numel()
    }
    /// True when the view holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        match &self.data {
            DataMut::Host(h) => h.dtype(),
            DataMut::Device(d) => d.dtype(),
        }
    }
    /// Where the elements live.
    pub fn memory(&self) -> Memory {
        match &self.data {
            DataMut::Host(_) => Memory::Host,
            DataMut::Device(d) => d.memory(),
        }
    }
    /// Bytes the elements take.
    pub fn bytes(&self) -> usize {
        self.len() * self.dtype().size()
    }
    /// The same elements with other dims of the same element count.
    pub fn reshape(self, dims: impl IntoDims) -> Result<Self> {
        let dims = dims.into_dims()?;
        check_numel(self.len(), &dims)?;
        Ok(Self { data: self.data, dims })
    }
    /// Rows `start..start + n` of the first dim (see [`View::rows`]).
    pub fn rows(self, start: usize, n: usize) -> Result<Self> {
        let (dims, at, len) = row_range(&self.dims, start, n)?;
        let data = match self.data {
            DataMut::Host(h) => DataMut::Host(h.into_sub(at, len)),
            DataMut::Device(d) => DataMut::Device(d.into_sub(at, len)),
        };
        Ok(Self { data, dims })
    }
    /// Rows `..at` and `at..` of the first dim, as two views that can be written at once (e.g. the two halves of
    /// one buffer, each receiving a message). Errors when `at` is past the rows.
    pub fn split_rows(self, at: usize) -> Result<(Self, Self)> {
        let first = self.dims.as_slice().first().copied().unwrap_or(0);
        let (head_dims, _, head_len) = row_range(&self.dims, 0, at)?;
        let (tail_dims, _, _) = row_range(&self.dims, at, first - at)?;
        let (head, tail) = match self.data {
            DataMut::Host(h) => {
                let (a, b) = h.into_split(head_len);
                (DataMut::Host(a), DataMut::Host(b))
            }
            DataMut::Device(d) => {
                let (a, b) = d.into_split(head_len);
                (DataMut::Device(a), DataMut::Device(b))
            }
        };
        Ok((Self { data: head, dims: head_dims }, Self { data: tail, dims: tail_dims }))
    }
    /// A shorter-lived writable view of the same elements.
    pub fn reborrow(&mut self) -> ViewMut<'_> {
        let data = match &mut self.data {
            DataMut::Host(h) => DataMut::Host(h.reborrow()),
            DataMut::Device(d) => DataMut::Device(d.reborrow()),
        };
        ViewMut { data, dims: self.dims }
    }
    /// The same elements, read-only, for as long as this view could have written them.
    pub fn into_view(self) -> View<'a> {
        let data = match self.data {
            DataMut::Host(h) => Data::Host(h.into_slice()),
            DataMut::Device(d) => Data::Device(DeviceSlice {
                ptr: d.ptr,
                len: d.len,
                dtype: d.dtype,
                memory: d.memory,
                _life: PhantomData,
            }),
        };
        View { data, dims: self.dims }
    }
    /// A read-only view of the same elements.
    pub fn as_view(&self) -> View<'_> {
        let data = match &self.data {
            DataMut::Host(h) => Data::Host(h.as_slice()),
            DataMut::Device(d) => Data::Device(d.as_slice()),
        };
        View { data, dims: self.dims }
    }
    /// Where the bytes lie (see [`RawBytes`]).
    pub fn into_raw_bytes(self) -> RawBytesMut<'a> {
        match self.data {
            DataMut::Host(HostSliceMut::F32(s)) => RawBytesMut::Host(bytemuck::cast_slice_mut(s)),
            DataMut::Host(HostSliceMut::Bf16(s)) => RawBytesMut::Host(bytemuck::cast_slice_mut(s)),
            DataMut::Host(HostSliceMut::F16(s)) => RawBytesMut::Host(bytemuck::cast_slice_mut(s)),
            DataMut::Device(d) => {
                RawBytesMut::Device { ptr: d.ptr(), len: d.len() * d.dtype().size(), memory: d.memory() }
            }
        }
    }
    /// The writable host slice, or [`KernelError::Memory`] naming `name` when the view lives elsewhere.
    pub fn into_host(self, name: &'static str) -> Result<HostSliceMut<'a>> {
        match self.data {
            DataMut::Host(h) => Ok(h),
            DataMut::Device(d) => Err(not_host(name, d.memory())),
        }
    }
    /// The writable device slice, or [`KernelError::Memory`] naming `name` when the view is not in `memory`.
    pub fn into_device(self, name: &'static str, memory: Memory) -> Result<DeviceSliceMut<'a>> {
        let got = self.memory();
        match self.data {
            DataMut::Device(d) if d.memory() == memory => Ok(d),
            _ => Err(wrong_memory(name, memory, got)),
        }
    }
    /// The writable host elements as `T`, or an error naming `name` (wrong memory or dtype).
    pub fn into_typed<T: Element>(self, name: &'static str) -> Result<&'a mut [T]> {
        match self.into_host(name)? {
            HostSliceMut::F32(s) if T::DTYPE == DType::F32 => Ok(bytemuck::cast_slice_mut(s)),
            HostSliceMut::Bf16(s) if T::DTYPE == DType::Bf16 => Ok(bytemuck::cast_slice_mut(s)),
            HostSliceMut::F16(s) if T::DTYPE == DType::F16 => Ok(bytemuck::cast_slice_mut(s)),
            h => Err(dtype_error(name, T::DTYPE, h.dtype())),
        }
    }
}

/// The dims, first element and element count of rows `start..start + n` of a view of `dims`.
fn row_range(dims: &Dims, start: usize, n: usize) -> Result<(Dims, usize, usize)> {
    let d = dims.as_slice();
    let first = d.first().copied().unwrap_or(0);
    if start.checked_add(n).is_none_or(|end| end > first) {
        return Err(KernelError::Shape(format!("rows {start}..{} of a view of dims {d:?}", start.saturating_add(n))));
    }
    let row = d[1..].iter().product::<usize>();
    let mut out = *dims;
    out.d[0] = n;
    Ok((out, start * row, n * row))
}

/// A device view asked for as host memory.
fn not_host(name: &'static str, got: Memory) -> KernelError {
    wrong_memory(name, Memory::Host, got)
}

/// A view asked for in `expected` memory (that of the backend of the same name) that lives in `got`.
pub(crate) fn wrong_memory(name: &'static str, expected: Memory, got: Memory) -> KernelError {
    let backend = match expected {
        Memory::Host => "cpu",
        Memory::Cuda { .. } => "cuda",
    };
    KernelError::Memory { name, backend, expected, got }
}

fn dtype_error(name: &'static str, expected: DType, got: DType) -> KernelError {
    KernelError::DType { name, expected: expected.name(), got: got.name() }
}

/// `From` a slice (or `Vec`) of each element type, into a one-dim view of its length.
macro_rules! from_slices {
    ($($t:ty),*) => {$(
        impl<'a> From<&'a [$t]> for View<'a> {
            fn from(s: &'a [$t]) -> Self {
                View::flat(s)
            }
        }
        impl<'a> From<&'a Vec<$t>> for View<'a> {
            fn from(s: &'a Vec<$t>) -> Self {
                View::flat(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for ViewMut<'a> {
            fn from(s: &'a mut [$t]) -> Self {
                ViewMut::flat(s)
            }
        }
        impl<'a> From<&'a mut Vec<$t>> for ViewMut<'a> {
            fn from(s: &'a mut Vec<$t>) -> Self {
                ViewMut::flat(s)
            }
        }
    )*};
}
from_slices!(f32, bf16, f16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_bytes_are_read_as_aligned_whole_elements() {
        let words = [1.5f32, -2.0, 0.25, 8.0];
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        let v = View::from_host_bytes(bytes, DType::F32, [2, 2]).unwrap();
        assert!(matches!(v.raw_bytes(), RawBytes::Host(b) if b == bytes));
        assert_eq!(View::from_host_bytes(bytes, DType::Bf16, [8]).unwrap().dims(), &[8]);
        for (bad, dtype) in [(&bytes[1..5], DType::F32), (&bytes[..7], DType::F16)] {
            let e = View::from_host_bytes(bad, dtype, [1]).unwrap_err();
            assert!(matches!(e, KernelError::InvalidArgument { name: "bytes", .. }), "{e}");
        }
        assert!(matches!(View::from_host_bytes(bytes, DType::F32, [3]), Err(KernelError::Shape(_))));
        let mut out = [0u16; 4];
        let w = ViewMut::from_host_bytes(bytemuck::cast_slice_mut(&mut out), DType::F16, [4]).unwrap();
        assert_eq!(w.dims(), &[4]);
    }
}
