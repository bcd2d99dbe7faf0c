//! Typed host memory: the CPU backend's element access. [`crate::View`] wraps these with dims and a memory kind;
//! the kernels below the backend read and write through them.

use half::bf16;

pub(crate) mod cache;

use crate::dtype::DType;

/// A read-only host buffer of `f32` or `bf16`.
#[derive(Debug, Clone, Copy)]
pub enum HostSlice<'a> {
    /// `f32` elements.
    F32(&'a [f32]),
    /// `bf16` elements.
    Bf16(&'a [bf16]),
}

/// A writable host buffer of `f32` or `bf16`.
#[derive(Debug)]
pub enum HostSliceMut<'a> {
    /// `f32` elements.
    F32(&'a mut [f32]),
    /// `bf16` elements.
    Bf16(&'a mut [bf16]),
}

impl HostVec {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            HostVec::F32(v) => v.len(),
            HostVec::Bf16(v) => v.len(),
        }
    }
    /// True when it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a> HostSlice<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostSlice::F32(s) => s.len(),
            HostSlice::Bf16(s) => s.len(),
        }
    }
    /// True when the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostSlice::F32(_) => DType::F32,
            HostSlice::Bf16(_) => DType::Bf16,
        }
    }
    /// The elements' bytes, as they lie in memory.
    pub fn as_bytes(&self) -> &'a [u8] {
        match *self {
            HostSlice::F32(s) => bytemuck::cast_slice(s),
            HostSlice::Bf16(s) => bytemuck::cast_slice(s),
        }
    }
    /// The elements `start..start + len`.
    pub fn sub(&self, start: usize, len: usize) -> HostSlice<'a> {
        match *self {
            HostSlice::F32(s) => HostSlice::F32(&s[start..start + len]),
            HostSlice::Bf16(s) => HostSlice::Bf16(&s[start..start + len]),
        }
    }
    /// The whole buffer widened to `f32`.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut v = vec![0f32; self.len()];
        self.load_f32(0, &mut v);
        v
    }
    /// Widens `dst.len()` elements starting at `start` into `dst`.
    #[inline]
    pub fn load_f32(&self, start: usize, dst: &mut [f32]) {
        match self {
            HostSlice::F32(s) => dst.copy_from_slice(&s[start..start + dst.len()]),
            HostSlice::Bf16(s) => {
                let n = dst.len();
                for (d, x) in dst.iter_mut().zip(&s[start..start + n]) {
                    *d = x.to_f32();
                }
            }
        }
    }
}

impl<'a> HostSliceMut<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostSliceMut::F32(s) => s.len(),
            HostSliceMut::Bf16(s) => s.len(),
        }
    }
    /// True when the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostSliceMut::F32(_) => DType::F32,
            HostSliceMut::Bf16(_) => DType::Bf16,
        }
    }
    /// The elements' bytes, writable (every bit pattern is a valid `f32` or `bf16`).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            HostSliceMut::F32(s) => bytemuck::cast_slice_mut(s),
            HostSliceMut::Bf16(s) => bytemuck::cast_slice_mut(s),
        }
    }
    /// Reborrows as a shorter-lived writable view.
    pub fn reborrow(&mut self) -> HostSliceMut<'_> {
        match self {
            HostSliceMut::F32(s) => HostSliceMut::F32(s),
            HostSliceMut::Bf16(s) => HostSliceMut::Bf16(s),
        }
    }
    /// The same memory, read-only, for the whole borrow.
    pub fn into_slice(self) -> HostSlice<'a> {
        match self {
            HostSliceMut::F32(s) => HostSlice::F32(s),
            HostSliceMut::Bf16(s) => HostSlice::Bf16(s),
        }
    }
    /// A read-only view of the same memory.
    pub fn as_slice(&self) -> HostSlice<'_> {
        match self {
            HostSliceMut::F32(s) => HostSlice::F32(s),
            HostSliceMut::Bf16(s) => HostSlice::Bf16(s),
        }
    }
    /// The elements `start..start + len` (panics out of range, like slicing).
    pub fn into_sub(self, start: usize, len: usize) -> HostSliceMut<'a> {
        match self {
            HostSliceMut::F32(s) => HostSliceMut::F32(&mut s[start..start + len]),
            HostSliceMut::Bf16(s) => HostSliceMut::Bf16(&mut s[start..start + len]),
        }
    }
    /// Splits into consecutive chunks of `chunk` elements (the last may be shorter).
    pub(crate) fn into_chunks(self, chunk: usize) -> Vec<HostSliceMut<'a>> {
        match self {
            HostSliceMut::F32(s) => s.chunks_mut(chunk).map(HostSliceMut::F32).collect(),
            HostSliceMut::Bf16(s) => s.chunks_mut(chunk).map(HostSliceMut::Bf16).collect(),
        }
    }
    /// Stores (or, with `accumulate`, adds) `src` at `start`, rounding to the buffer's type.
    #[inline]
    pub fn store_f32(&mut self, start: usize, src: &[f32], accumulate: bool) {
        match self {
            HostSliceMut::F32(s) => {
                let d = &mut s[start..start + src.len()];
                if accumulate {
                    for (d, x) in d.iter_mut().zip(src) {
                        *d += *x;
                    }
                } else {
                    d.copy_from_slice(src);
                }
            }
            HostSliceMut::Bf16(s) => {
                let d = &mut s[start..start + src.len()];
                if accumulate {
                    for (d, x) in d.iter_mut().zip(src) {
                        *d = bf16::from_f32(d.to_f32() + *x);
                    }
                } else {
                    for (d, x) in d.iter_mut().zip(src) {
                        *d = bf16::from_f32(*x);
                    }
                }
            }
        }
    }
}

impl<'a> From<&'a [f32]> for HostSlice<'a> {
    fn from(s: &'a [f32]) -> Self {
        HostSlice::F32(s)
    }
}
impl<'a> From<&'a [bf16]> for HostSlice<'a> {
    fn from(s: &'a [bf16]) -> Self {
        HostSlice::Bf16(s)
    }
}
impl<'a> From<&'a Vec<f32>> for HostSlice<'a> {
    fn from(s: &'a Vec<f32>) -> Self {
        HostSlice::F32(s)
    }
}
impl<'a> From<&'a Vec<bf16>> for HostSlice<'a> {
    fn from(s: &'a Vec<bf16>) -> Self {
        HostSlice::Bf16(s)
    }
}
impl<'a> From<&'a mut [f32]> for HostSliceMut<'a> {
    fn from(s: &'a mut [f32]) -> Self {
        HostSliceMut::F32(s)
    }
}
impl<'a> From<&'a mut [bf16]> for HostSliceMut<'a> {
    fn from(s: &'a mut [bf16]) -> Self {
        HostSliceMut::Bf16(s)
    }
}
impl<'a> From<&'a mut Vec<f32>> for HostSliceMut<'a> {
    fn from(s: &'a mut Vec<f32>) -> Self {
        HostSliceMut::F32(s)
    }
}
impl<'a> From<&'a mut Vec<bf16>> for HostSliceMut<'a> {
    fn from(s: &'a mut Vec<bf16>) -> Self {
        HostSliceMut::Bf16(s)
    }
}

/// A host buffer's elements, moved out of it without a copy (to hand to an offload engine, and back).
#[derive(Debug, Clone, PartialEq)]
pub enum HostVec {
    /// `f32` elements.
    F32(Vec<f32>),
    /// `bf16` elements.
    Bf16(Vec<bf16>),
}

/// The element types a [`HostVec`] holds, moved in and out of it by type.
pub(crate) trait HostElement: crate::dtype::Element {
    fn into_host_vec(v: Vec<Self>) -> HostVec;
    /// The elements when `v` holds this type.
    fn from_host_vec(v: HostVec) -> Option<Vec<Self>>;
}

impl HostElement for f32 {
    fn into_host_vec(v: Vec<Self>) -> HostVec {
        HostVec::F32(v)
    }
    fn from_host_vec(v: HostVec) -> Option<Vec<Self>> {
        match v {
            HostVec::F32(v) => Some(v),
            HostVec::Bf16(_) => None,
        }
    }
}

impl HostElement for bf16 {
    fn into_host_vec(v: Vec<Self>) -> HostVec {
        HostVec::Bf16(v)
    }
    fn from_host_vec(v: HostVec) -> Option<Vec<Self>> {
        match v {
            HostVec::Bf16(v) => Some(v),
            HostVec::F32(_) => None,
        }
    }
}
