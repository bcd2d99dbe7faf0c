//! Element types: `f32`, `bf16` and `f16` (`half::bf16`, `half::f16` storage). Every kernel computes and
//! accumulates in `f32`; a 16-bit type is converted when a tile is loaded and rounded (to nearest even) when a
//! result is stored.

use half::{bf16, f16};

/// The element types the kernels take: the tag shared with the offload engine (`longctx-dtype`).
pub use longctx_dtype::DType;

/// A storage element: `f32`, `bf16` or `f16`. Sealed; conversions are exact for `f32` and round-to-nearest-even
/// for the 16-bit types on store.
pub trait Element: Copy + Send + Sync + Default + bytemuck::Pod + private::Sealed + 'static {
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Widen to `f32`.
    fn to_f32(self) -> f32;
    /// Narrow from `f32`.
    fn from_f32(x: f32) -> Self;
    /// The slice as a typed host view.
    fn host(s: &[Self]) -> crate::HostSlice<'_>;
    /// The slice as a writable typed host view.
    fn host_mut(s: &mut [Self]) -> crate::HostSliceMut<'_>;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    fn host(s: &[Self]) -> crate::HostSlice<'_> {
        crate::HostSlice::F32(s)
    }
    fn host_mut(s: &mut [Self]) -> crate::HostSliceMut<'_> {
        crate::HostSliceMut::F32(s)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn host(s: &[Self]) -> crate::HostSlice<'_> {
        crate::HostSlice::Bf16(s)
    }
    fn host_mut(s: &mut [Self]) -> crate::HostSliceMut<'_> {
        crate::HostSliceMut::Bf16(s)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn host(s: &[Self]) -> crate::HostSlice<'_> {
        crate::HostSlice::F16(s)
    }
    fn host_mut(s: &mut [Self]) -> crate::HostSliceMut<'_> {
        crate::HostSliceMut::F16(s)
    }
}

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// Widens `src` into `dst` (same length).
#[inline]
pub fn load_f32<T: Element>(src: &[T], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len());
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// Narrows `src` into `dst` (same length).
#[inline]
pub fn store_f32<T: Element>(src: &[f32], dst: &mut [T]) {
    debug_assert_eq!(src.len(), dst.len());
    for (d, s) in dst.iter_mut().zip(src) {
        *d = T::from_f32(*s);
    }
}
