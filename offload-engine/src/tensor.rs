//! What the caller hands over and gets back: an owned host tensor, its element type and dims.
//!
//! The engine moves bytes; it never looks at values. Data comes back bit-exact (NaN payloads included), so
//! tests compare [`HostTensor::as_bytes`], not floats.

use std::fmt;
use std::mem::MaybeUninit;

use half::{bf16, f16};

/// Element type of a tensor: the tag the kernels use too (`longctx-dtype`), so a trainer hands a kernel buffer's
/// type over as it is.
pub use longctx_dtype::DType;

/// The elements, typed. Private so that `len == dims.product()` always holds for a [`HostTensor`].
#[derive(Clone)]
pub(crate) enum HostData {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl HostData {
    /// Zeros of `dtype`.
    #[cfg(test)]
    pub(crate) fn zeroed(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => HostData::F32(vec![0.0; len]),
            DType::Bf16 => HostData::Bf16(vec![bf16::ZERO; len]),
            DType::F16 => HostData::F16(vec![f16::ZERO; len]),
        }
    }

    /// Room for `len` elements of `dtype`, none of them written yet (length 0): a fetch into fresh memory fills
    /// it through [`HostData::unfilled_bytes`] and then [`HostData::assume_filled`], writing each byte once. Zeros
    /// first would cost a pass over the tensor: with a caching allocator, `calloc` of a reused block clears it.
    pub(crate) fn unfilled(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => HostData::F32(Vec::with_capacity(len)),
            DType::Bf16 => HostData::Bf16(Vec::with_capacity(len)),
            DType::F16 => HostData::F16(Vec::with_capacity(len)),
        }
    }

    /// The bytes of the first `len` elements past the current length, for writing (see [`HostData::unfilled`]).
    /// Panics if the capacity is short of them.
    pub(crate) fn unfilled_bytes(&mut self, len: usize) -> &mut [MaybeUninit<u8>] {
        fn bytes<T>(v: &mut Vec<T>, len: usize) -> &mut [MaybeUninit<u8>] {
            let spare = &mut v.spare_capacity_mut()[..len];
            // SAFETY: the same memory seen as bytes; `MaybeUninit<u8>` has no alignment or validity requirement.
            unsafe { std::slice::from_raw_parts_mut(spare.as_mut_ptr().cast(), std::mem::size_of_val(spare)) }
        }
        match self {
            HostData::F32(v) => bytes(v, len),
            HostData::Bf16(v) => bytes(v, len),
            HostData::F16(v) => bytes(v, len),
        }
    }

    /// Takes the first `len` elements past the current length as written.
    ///
    /// # Safety
    /// Every byte of [`HostData::unfilled_bytes`]`(len)` must have been written (every bit pattern is a valid
    /// `f32`, `bf16` and `f16`, so any bytes will do).
    pub(crate) unsafe fn assume_filled(&mut self, len: usize) {
        // SAFETY: the caller's contract; `unfilled_bytes(len)` checked that the capacity holds them.
        unsafe {
            match self {
                HostData::F32(v) => v.set_len(v.len() + len),
                HostData::Bf16(v) => v.set_len(v.len() + len),
                HostData::F16(v) => v.set_len(v.len() + len),
            }
        }
    }

    pub(crate) fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::Bf16(_) => DType::Bf16,
            HostData::F16(_) => DType::F16,
        }
    }

    /// Elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::Bf16(v) => v.len(),
            HostData::F16(v) => v.len(),
        }
    }

    /// Bytes the allocation holds (its capacity, which is what freeing it gives back).
    pub(crate) fn capacity_bytes(&self) -> usize {
        match self {
            HostData::F32(v) => v.capacity() * 4,
            HostData::Bf16(v) => v.capacity() * 2,
            HostData::F16(v) => v.capacity() * 2,
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            HostData::F32(v) => bytemuck::cast_slice(v),
            HostData::Bf16(v) => bytemuck::cast_slice(v),
            HostData::F16(v) => bytemuck::cast_slice(v),
        }
    }

    pub(crate) fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            HostData::F32(v) => bytemuck::cast_slice_mut(v),
            HostData::Bf16(v) => bytemuck::cast_slice_mut(v),
            HostData::F16(v) => bytemuck::cast_slice_mut(v),
        }
    }
}

/// A tensor's data whose length is not the product of its dims (the error of [`HostTensor`]'s constructors).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("dims {dims:?} hold {} elements but the data has {len}", dims.iter().map(|&d| d as u128).product::<u128>())]
pub struct ShapeMismatch {
    /// The dims given.
    pub dims: Vec<usize>,
    /// Elements in the data.
    pub len: usize,
}

/// An owned, contiguous tensor in host memory: typed elements and their dims (row-major, no strides).
///
/// A trainer builds one from the `Vec` it already has (a move, no copy) and takes the `Vec` back with
/// [`HostTensor::into_f32`] and friends. `Debug` prints the dtype and dims, never the elements.
#[derive(Clone)]
pub struct HostTensor {
    data: HostData,
    dims: Vec<usize>,
}

impl HostTensor {
    /// An `f32` tensor; `data.len()` must equal the product of `dims` (an empty `dims` is a scalar).
    pub fn f32(data: Vec<f32>, dims: impl Into<Vec<usize>>) -> Result<Self, ShapeMismatch> {
        Self::new(HostData::F32(data), dims.into())
    }

    /// A `bf16` tensor; `data.len()` must equal the product of `dims`.
    pub fn bf16(data: Vec<bf16>, dims: impl Into<Vec<usize>>) -> Result<Self, ShapeMismatch> {
        Self::new(HostData::Bf16(data), dims.into())
    }

    /// An `f16` tensor; `data.len()` must equal the product of `dims`.
    pub fn f16(data: Vec<f16>, dims: impl Into<Vec<usize>>) -> Result<Self, ShapeMismatch> {
        Self::new(HostData::F16(data), dims.into())
    }

    fn new(data: HostData, dims: Vec<usize>) -> Result<Self, ShapeMismatch> {
        let numel = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if numel != Some(data.len()) {
            return Err(ShapeMismatch { dims, len: data.len() });
        }
        Ok(Self { data, dims })
    }

    /// Put back together what the engine took apart (the ticket kept the dims, a tier the data).
    pub(crate) fn from_parts(data: HostData, dims: Vec<usize>) -> Self {
        debug_assert_eq!(dims.iter().product::<usize>(), data.len());
        Self { data, dims }
    }

    pub(crate) fn into_parts(self) -> (HostData, Vec<usize>) {
        (self.data, self.dims)
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// The dims.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True when the tensor holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the elements take.
    pub fn size_bytes(&self) -> usize {
        self.data.as_bytes().len()
    }

    /// The elements as bytes (native endianness).
    pub fn as_bytes(&self) -> &[u8] {
        self.data.as_bytes()
    }

    /// The elements, when this is an `f32` tensor.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            HostData::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The elements, when this is a `bf16` tensor.
    pub fn as_bf16(&self) -> Option<&[bf16]> {
        match &self.data {
            HostData::Bf16(v) => Some(v),
            _ => None,
        }
    }

    /// The elements, when this is an `f16` tensor.
    pub fn as_f16(&self) -> Option<&[f16]> {
        match &self.data {
            HostData::F16(v) => Some(v),
            _ => None,
        }
    }

    /// The `f32` elements, moved out; another dtype hands the tensor back.
    pub fn into_f32(self) -> Result<Vec<f32>, Self> {
        match self.data {
            HostData::F32(v) => Ok(v),
            data => Err(Self { data, dims: self.dims }),
        }
    }

    /// The `bf16` elements, moved out; another dtype hands the tensor back.
    pub fn into_bf16(self) -> Result<Vec<bf16>, Self> {
        match self.data {
            HostData::Bf16(v) => Ok(v),
            data => Err(Self { data, dims: self.dims }),
        }
    }

    /// The `f16` elements, moved out; another dtype hands the tensor back.
    pub fn into_f16(self) -> Result<Vec<f16>, Self> {
        match self.data {
            HostData::F16(v) => Ok(v),
            data => Err(Self { data, dims: self.dims }),
        }
    }
}

impl fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostTensor").field("dtype", &self.dtype()).field("dims", &self.dims).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_must_match_length() {
        assert!(HostTensor::f32(vec![0.0; 6], [2, 3]).is_ok());
        assert!(HostTensor::f32(vec![1.0], Vec::new()).is_ok(), "no dims is a scalar");
        assert!(HostTensor::bf16(vec![bf16::ZERO; 0], [4, 0]).is_ok());
        let err = HostTensor::f16(vec![f16::ZERO; 5], [2, 3]).unwrap_err();
        assert_eq!(err.len, 5, "{err}");
        let overflow = HostTensor::f16(vec![], [usize::MAX, 2]).unwrap_err();
        assert_eq!(overflow.dims, [usize::MAX, 2]);
    }

    /// Unfilled storage exposes exactly the bytes of its elements, and once they are written holds them.
    #[test]
    fn unfilled_data_is_filled_through_its_bytes() {
        for (dtype, size) in [(DType::F32, 4), (DType::Bf16, 2), (DType::F16, 2)] {
            let mut d = HostData::unfilled(dtype, 5);
            assert_eq!(d.len(), 0);
            let bytes = d.unfilled_bytes(5);
            assert_eq!(bytes.len(), 5 * size);
            for (i, b) in bytes.iter_mut().enumerate() {
                b.write(i as u8 + 1);
            }
            // SAFETY: every byte was written just above.
            unsafe { d.assume_filled(5) };
            assert_eq!(d.len(), 5);
            assert_eq!(d.as_bytes(), (1..=(5 * size) as u8).collect::<Vec<_>>());
        }
    }

    #[test]
    fn into_the_wrong_dtype_hands_the_tensor_back() {
        let t = HostTensor::f32(vec![1.5; 4], [4]).unwrap();
        let t = t.into_bf16().unwrap_err();
        assert_eq!(t.dims(), &[4]);
        assert_eq!(t.into_f32().unwrap(), vec![1.5; 4]);
    }

    #[test]
    fn debug_shows_the_shape_not_the_data() {
        let t = HostTensor::f32(vec![7.0; 1000], [10, 100]).unwrap();
        let s = format!("{t:?}");
        assert!(s.contains("[10, 100]") && !s.contains("7.0"), "{s}");
    }
}
