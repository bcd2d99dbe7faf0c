//! Host memory: typed slices ([`HostSlice`], [`HostSliceMut`]) and owned elements ([`HostVec`]) of each element
//! type, and the reuse cache of large host buffers ([`cache`]). [`crate::View`] wraps the slices with dims and a
//! memory kind; the CPU kernels read and write through them, and a device backend's `upload`/`download` move their
//! bytes.

use half::{bf16, f16};

pub(crate) mod cache;

use crate::dtype::{DType, Element};

/// A read-only host buffer of `f32`, `bf16` or `f16`.
#[derive(Debug, Clone, Copy)]
pub enum HostSlice<'a> {
    /// `f32` elements.
    F32(&'a [f32]),
    /// `bf16` elements.
    Bf16(&'a [bf16]),
    /// `f16` elements.
    F16(&'a [f16]),
}

/// A writable host buffer of `f32`, `bf16` or `f16`.
#[derive(Debug)]
pub enum HostSliceMut<'a> {
    /// `f32` elements.
    F32(&'a mut [f32]),
    /// `bf16` elements.
    Bf16(&'a mut [bf16]),
    /// `f16` elements.
    F16(&'a mut [f16]),
}

/// A host buffer's elements, moved out of it without a copy (to hand to an offload engine, and back).
#[derive(Debug, Clone, PartialEq)]
pub enum HostVec {
    /// `f32` elements.
    F32(Vec<f32>),
    /// `bf16` elements.
    Bf16(Vec<bf16>),
    /// `f16` elements.
    F16(Vec<f16>),
}

/// `$body` with `$s` bound to the elements of `$x` (a [`HostSlice`], [`HostSliceMut`] or [`HostVec`] expression,
/// by the variant path `$ty`), whatever their type.
macro_rules! each {
    ($ty:ident, $x:expr, $s:ident => $body:expr) => {
        match $x {
            $ty::F32($s) => $body,
            $ty::Bf16($s) => $body,
            $ty::F16($s) => $body,
        }
    };
}

/// The same variant of `$ty` around `$body`, with `$s` bound to the elements of `$x`.
macro_rules! map {
    ($from:ident => $to:ident, $x:expr, $s:ident => $body:expr) => {
        match $x {
            $from::F32($s) => $to::F32($body),
            $from::Bf16($s) => $to::Bf16($body),
            $from::F16($s) => $to::F16($body),
        }
    };
}

impl HostVec {
    /// Elements.
    pub fn len(&self) -> usize {
        each!(HostVec, self, v => v.len())
    }
    /// True when it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostVec::F32(_) => DType::F32,
            HostVec::Bf16(_) => DType::Bf16,
            HostVec::F16(_) => DType::F16,
        }
    }
    /// `n` zeros of `dtype`.
    pub fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => HostVec::F32(vec![0.0; n]),
            DType::Bf16 => HostVec::Bf16(vec![bf16::ZERO; n]),
            DType::F16 => HostVec::F16(vec![f16::ZERO; n]),
        }
    }
}

impl<'a> HostSlice<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        each!(HostSlice, self, s => s.len())
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
            HostSlice::F16(_) => DType::F16,
        }
    }
    /// The elements' bytes, as they lie in memory.
    pub fn as_bytes(&self) -> &'a [u8] {
        each!(HostSlice, *self, s => bytemuck::cast_slice(s))
    }
    /// The elements `start..start + len`.
    pub fn sub(&self, start: usize, len: usize) -> HostSlice<'a> {
        map!(HostSlice => HostSlice, *self, s => &s[start..start + len])
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
            HostSlice::Bf16(s) => widen(&s[start..start + dst.len()], dst),
            HostSlice::F16(s) => widen(&s[start..start + dst.len()], dst),
        }
    }
}

fn widen<T: Element>(src: &[T], dst: &mut [f32]) {
    for (d, x) in dst.iter_mut().zip(src) {
        *d = x.to_f32();
    }
}

fn narrow<T: Element>(dst: &mut [T], src: &[f32], accumulate: bool) {
    if accumulate {
        for (d, x) in dst.iter_mut().zip(src) {
            *d = T::from_f32(d.to_f32() + *x);
        }
    } else {
        for (d, x) in dst.iter_mut().zip(src) {
            *d = T::from_f32(*x);
        }
    }
}

impl<'a> HostSliceMut<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        each!(HostSliceMut, self, s => s.len())
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
            HostSliceMut::F16(_) => DType::F16,
        }
    }
    /// The elements' bytes, writable (every bit pattern is a valid element of each type).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        each!(HostSliceMut, self, s => bytemuck::cast_slice_mut(s))
    }
    /// Reborrows as a shorter-lived writable view.
    pub fn reborrow(&mut self) -> HostSliceMut<'_> {
        map!(HostSliceMut => HostSliceMut, self, s => s)
    }
    /// The same memory, read-only, for the whole borrow.
    pub fn into_slice(self) -> HostSlice<'a> {
        map!(HostSliceMut => HostSlice, self, s => s)
    }
    /// A read-only view of the same memory.
    pub fn as_slice(&self) -> HostSlice<'_> {
        map!(HostSliceMut => HostSlice, self, s => s)
    }
    /// The elements `start..start + len` (panics out of range, like slicing).
    pub fn into_sub(self, start: usize, len: usize) -> HostSliceMut<'a> {
        map!(HostSliceMut => HostSliceMut, self, s => &mut s[start..start + len])
    }
    /// Elements `..at` and `at..` (panics past the end, like `split_at_mut`).
    pub fn into_split(self, at: usize) -> (HostSliceMut<'a>, HostSliceMut<'a>) {
        match self {
            HostSliceMut::F32(s) => {
                let (a, b) = s.split_at_mut(at);
                (HostSliceMut::F32(a), HostSliceMut::F32(b))
            }
            HostSliceMut::Bf16(s) => {
                let (a, b) = s.split_at_mut(at);
                (HostSliceMut::Bf16(a), HostSliceMut::Bf16(b))
            }
            HostSliceMut::F16(s) => {
                let (a, b) = s.split_at_mut(at);
                (HostSliceMut::F16(a), HostSliceMut::F16(b))
            }
        }
    }
    /// Splits into consecutive chunks of `chunk` elements (the last may be shorter).
    pub(crate) fn into_chunks(self, chunk: usize) -> Vec<HostSliceMut<'a>> {
        match self {
            HostSliceMut::F32(s) => s.chunks_mut(chunk).map(HostSliceMut::F32).collect(),
            HostSliceMut::Bf16(s) => s.chunks_mut(chunk).map(HostSliceMut::Bf16).collect(),
            HostSliceMut::F16(s) => s.chunks_mut(chunk).map(HostSliceMut::F16).collect(),
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
            HostSliceMut::Bf16(s) => narrow(&mut s[start..start + src.len()], src, accumulate),
            HostSliceMut::F16(s) => narrow(&mut s[start..start + src.len()], src, accumulate),
        }
    }
}

/// `From` a slice (or `Vec`) of each element type, into a read-only and a writable typed slice.
macro_rules! from_slices {
    ($($t:ty => $variant:ident),*) => {$(
        impl<'a> From<&'a [$t]> for HostSlice<'a> {
            fn from(s: &'a [$t]) -> Self {
                HostSlice::$variant(s)
            }
        }
        impl<'a> From<&'a Vec<$t>> for HostSlice<'a> {
            fn from(s: &'a Vec<$t>) -> Self {
                HostSlice::$variant(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for HostSliceMut<'a> {
            fn from(s: &'a mut [$t]) -> Self {
                HostSliceMut::$variant(s)
            }
        }
        impl<'a> From<&'a mut Vec<$t>> for HostSliceMut<'a> {
            fn from(s: &'a mut Vec<$t>) -> Self {
                HostSliceMut::$variant(s)
            }
        }
    )*};
}
from_slices!(f32 => F32, bf16 => Bf16, f16 => F16);

/// The element types a [`HostVec`] holds, moved in and out of it by type.
pub(crate) trait HostElement: crate::dtype::Element {
    fn into_host_vec(v: Vec<Self>) -> HostVec;
    /// The elements when `v` holds this type.
    fn from_host_vec(v: HostVec) -> Option<Vec<Self>>;
}

macro_rules! host_element {
    ($($t:ty => $variant:ident),*) => {$(
        impl HostElement for $t {
            fn into_host_vec(v: Vec<Self>) -> HostVec {
                HostVec::$variant(v)
            }
            fn from_host_vec(v: HostVec) -> Option<Vec<Self>> {
                match v {
                    HostVec::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    )*};
}
host_element!(f32 => F32, bf16 => Bf16, f16 => F16);
