//! Tensor maps for the TMA (kernels/ptx_tma.cuh): a typed description of a tiled view of a tensor in device memory
//! ([`TensorMapDesc`]), checked against the rules the CUDA driver API documents for `cuTensorMapEncodeTiled`, and its
//! encoding into the 128 bytes ([`TensorMap`]) a kernel takes by value as a `const __grid_constant__ CUtensorMap`
//! parameter: by the driver on a GPU ([`TensorMapDesc::encode_driver`]), or in the emulator's own format
//! ([`TensorMapDesc::encode_emulated`]), which the emulator's `cp.async.bulk.tensor` decodes (runtime.cpp).
//!
//! Dimensions are listed innermost first, as the driver and the PTX coordinates take them: dim 0 is the contiguous
//! one (element stride 1), `strides[i]` is the byte distance between consecutive indices of dim `i + 1`. Only what
//! our kernels use is offered: element strides 1, no interleave, out-of-bounds elements filled with zeros, no L2
//! promotion hint beyond the default.
//!
//! The emulator's format (little-endian, the rest zero): bytes 0-3 the magic "LCTM" (0x4d54434c), 4 the rank, 5 the
//! element size in bytes, 6 the swizzle (0 none, 1 32B, 2 64B, 3 128B), 8-15 the global address, 16-55 the five
//! dimensions (u64, unused ones 1), 56-95 the byte stride of each dimension (u64; dimension 0's is the element
//! size), 96-115 the box dimensions (u32, unused ones 1).

use crate::error::{KernelError, Result};

/// The element type of a tensor map: what the driver is told (the copy itself only moves bytes; the type decides
/// the size and what an out-of-bounds NaN fill would be, which we do not use).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TmaElem {
    /// bfloat16, 2 bytes.
    Bf16,
    /// IEEE half, 2 bytes.
    F16,
    /// f32, 4 bytes.
    F32,
}

impl TmaElem {
    /// The element's size in bytes.
    pub fn bytes(self) -> u64 {
        match self {
            Self::Bf16 | Self::F16 => 2,
            Self::F32 => 4,
        }
    }
}

/// The swizzle the TMA applies to the shared-memory address of what it writes (ptx_tma.cuh gives the pattern); the
/// box's inner dimension in bytes must not exceed its span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TmaSwizzle {
    /// Dense rows, no permutation.
    None,
    /// 16-byte chunks permuted within 32-byte spans (pattern of 256 bytes).
    B32,
    /// Within 64-byte spans (pattern of 512 bytes).
    B64,
    /// Within 128-byte rows (pattern of 1024 bytes): the layout wgmma's 128B swizzle reads.
    B128,
}

impl TmaSwizzle {
    /// The span in bytes (0 for none).
    pub fn span(self) -> u64 {
        match self {
            Self::None => 0,
            Self::B32 => 32,
            Self::B64 => 64,
            Self::B128 => 128,
        }
    }

    /// The code ptx_tma.cuh's `tma_swizzle` and the emulator's map take: 0 none, 1 32B, 2 64B, 3 128B.
    pub fn code(self) -> u8 {
        match self {
            Self::None => 0,
            Self::B32 => 1,
            Self::B64 => 2,
            Self::B128 => 3,
        }
    }
}

/// A tiled view of a tensor in device memory, innermost dimension first (see the module's documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorMapDesc {
    pub elem: TmaElem,
    /// The tensor's device address (a `device::DevicePtr`, which the `Device` trait's `tensor_map` takes this
    /// description for: a plain `u64` here so that this module stands below that trait): 16-byte aligned.
    pub address: u64,
    /// Each dimension's size, innermost first: 2 to 5 of them, each 1..=2^32.
    pub dims: Vec<u64>,
    /// The byte stride of dimensions 1.. (one fewer than `dims`): multiples of 16, below 2^40, each at least the
    /// extent of the dimensions inside it (so that no two elements overlap).
    pub strides: Vec<u64>,
    /// The box (the tile one copy moves), innermost first, as many as `dims`: each 1..=256, the inner one a multiple
    /// of 16 bytes and at most the swizzle's span.
    pub box_dims: Vec<u32>,
    pub swizzle: TmaSwizzle,
}

/// 128 bytes, 64-byte aligned: a tensor map as a kernel parameter (`CUtensorMap`), pushed by value into the launch's
/// arguments.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(C, align(64))]
pub(crate) struct TensorMap(pub [u8; 128]);

impl std::fmt::Debug for TensorMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TensorMap({:02x?}…)", &self.0[..16])
    }
}

/// The emulator's magic ("LCTM" little-endian).
const EMU_MAGIC: u32 = 0x4d54_434c;

fn invalid(name: &'static str, why: String) -> KernelError {
    KernelError::InvalidArgument { name, why }
}

impl TensorMapDesc {
    /// The box's size in bytes: the transaction bytes one copy completes on its mbarrier.
    pub fn box_bytes(&self) -> u64 {
        self.box_dims.iter().map(|&b| u64::from(b)).product::<u64>() * self.elem.bytes()
    }

    /// The bytes from `address` to the end of the tensor's last element (after [`TensorMapDesc::validate`]).
    pub fn span_bytes(&self) -> u64 {
        let elem = self.elem.bytes();
        let last: u64 = self
            .dims
            .iter()
            .enumerate()
            .map(|(i, &d)| {
                let stride = if i == 0 { elem } else { self.strides.get(i - 1).copied().unwrap_or(0) };
                d.saturating_sub(1).saturating_mul(stride)
            })
            .fold(0u64, |a, b| a.saturating_add(b));
        last.saturating_add(elem)
    }

    /// Checks the rules `cuTensorMapEncodeTiled` documents; each error names the field
    /// (`KernelError::InvalidArgument` with `tensor_map.<field>`).
    pub fn validate(&self) -> Result<()> {
        let rank = self.dims.len();
        if !(2..=5).contains(&rank) {
            return Err(invalid("tensor_map.dims", format!("rank {rank}: a tensor map here has 2 to 5 dimensions")));
        }
        if !self.address.is_multiple_of(16) {
            return Err(invalid("tensor_map.address", format!("0x{:x} is not 16-byte aligned", self.address)));
        }
        for (i, &d) in self.dims.iter().enumerate() {
            if d == 0 || d > 1 << 32 {
                return Err(invalid("tensor_map.dims", format!("dims[{i}] = {d}: each must be in 1..=2^32")));
            }
        }
        if self.strides.len() != rank - 1 {
            return Err(invalid(
                "tensor_map.strides",
                format!("{} strides for {rank} dimensions: one per dimension after the first", self.strides.len()),
            ));
        }
        let mut extent = self.dims[0] * self.elem.bytes();
        for (i, &s) in self.strides.iter().enumerate() {
            if !s.is_multiple_of(16) || s >= 1 << 40 {
                return Err(invalid(
                    "tensor_map.strides",
                    format!("strides[{i}] = {s} bytes: each must be a multiple of 16 below 2^40"),
                ));
            }
            if s < extent {
                return Err(invalid(
                    "tensor_map.strides",
                    format!(
                        "strides[{i}] = {s} bytes is less than the {extent} bytes the dimensions inside it span \
                         (elements would overlap)"
                    ),
                ));
            }
            extent = s * self.dims[i + 1];
        }
        if self.box_dims.len() != rank {
            return Err(invalid(
                "tensor_map.box_dims",
                format!("{} box dimensions for {rank} dimensions", self.box_dims.len()),
            ));
        }
        for (i, &b) in self.box_dims.iter().enumerate() {
            if !(1..=256).contains(&b) {
                return Err(invalid("tensor_map.box_dims", format!("box_dims[{i}] = {b}: each must be in 1..=256")));
            }
        }
        let inner = u64::from(self.box_dims[0]) * self.elem.bytes();
        if !inner.is_multiple_of(16) {
            return Err(invalid(
                "tensor_map.box_dims",
                format!("box_dims[0] = {} elements is {inner} bytes, not a multiple of 16", self.box_dims[0]),
            ));
        }
        let span = self.swizzle.span();
        if span != 0 && inner > span {
            return Err(invalid(
                "tensor_map.swizzle",
                format!(
                    "the box's inner dimension is {inner} bytes, more than the {:?} swizzle's {span}",
                    self.swizzle
                ),
            ));
        }
        Ok(())
    }

    /// The map in the emulator's format (the module's documentation), after [`TensorMapDesc::validate`].
    pub fn encode_emulated(&self) -> Result<TensorMap> {
        self.validate()?;
        let mut m = [0u8; 128];
        m[0..4].copy_from_slice(&EMU_MAGIC.to_le_bytes());
        m[4] = self.dims.len() as u8;
        m[5] = self.elem.bytes() as u8;
        m[6] = self.swizzle.code();
        m[8..16].copy_from_slice(&self.address.to_le_bytes());
        for d in 0..5 {
            let dim = self.dims.get(d).copied().unwrap_or(1);
            let stride = if d == 0 { self.elem.bytes() } else { self.strides.get(d - 1).copied().unwrap_or(0) };
            let bx = self.box_dims.get(d).copied().unwrap_or(1);
            m[16 + 8 * d..24 + 8 * d].copy_from_slice(&dim.to_le_bytes());
            m[56 + 8 * d..64 + 8 * d].copy_from_slice(&stride.to_le_bytes());
            m[96 + 4 * d..100 + 4 * d].copy_from_slice(&bx.to_le_bytes());
        }
        Ok(TensorMap(m))
    }

    /// The map encoded by the CUDA driver's `cuTensorMapEncodeTiled`, after [`TensorMapDesc::validate`]. The
    /// driver must be loaded (a `DriverDevice` exists: `DriverDevice::encode_tensor_map` is the way in).
    pub(crate) fn encode_driver(&self) -> Result<TensorMap> {
        use cudarc::driver::sys;
        self.validate()?;
        let dtype = match self.elem {
            TmaElem::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            TmaElem::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            TmaElem::F32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        };
        let swizzle = match self.swizzle {
            TmaSwizzle::None => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
            TmaSwizzle::B32 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_32B,
            TmaSwizzle::B64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
            TmaSwizzle::B128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        };
        let element_strides = vec![1u32; self.dims.len()];
        // SAFETY: all-zero bytes are a valid CUtensorMap (an opaque array of integers).
        let mut map: sys::CUtensorMap = unsafe { std::mem::zeroed() };
        // SAFETY: the arrays hold `rank` entries (`strides` rank - 1, as the driver reads), checked by `validate`;
        // `map` is writable; the driver only records the address.
        let status = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                dtype,
                self.dims.len() as u32,
                self.address as *mut std::ffi::c_void,
                self.dims.as_ptr(),
                self.strides.as_ptr(),
                self.box_dims.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if status != sys::CUresult::CUDA_SUCCESS {
            return Err(KernelError::Device {
                backend: "cuda",
                op: "cuTensorMapEncodeTiled".to_string(),
                why: format!("{status:?} for {self:?}"),
            });
        }
        let mut out = [0u8; 128];
        for (i, q) in map.opaque.iter().enumerate() {
            out[8 * i..8 * i + 8].copy_from_slice(&q.to_le_bytes());
        }
        Ok(TensorMap(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [B = 2, S = 40, H = 3, D = 64] bf16, innermost first, a 64 × 1 × 16 × 1 box with the 128B swizzle.
    fn attention_like() -> TensorMapDesc {
        TensorMapDesc {
            elem: TmaElem::Bf16,
            address: 0x1000,
            dims: vec![64, 3, 40, 2],
            strides: vec![128, 384, 15360],
            box_dims: vec![64, 1, 16, 1],
            swizzle: TmaSwizzle::B128,
        }
    }

    fn field_of(d: &TensorMapDesc) -> String {
        match d.validate() {
            Err(KernelError::InvalidArgument { name, why }) => format!("{name}: {why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_valid_map_validates_and_encodes() {
        let d = attention_like();
        d.validate().unwrap();
        assert_eq!(d.box_bytes(), 2048);
        let m = d.encode_emulated().unwrap();
        assert_eq!(&m.0[0..4], b"LCTM");
        assert_eq!((m.0[4], m.0[5], m.0[6]), (4, 2, 3));
        assert_eq!(u64::from_le_bytes(m.0[8..16].try_into().unwrap()), 0x1000);
        assert_eq!(u64::from_le_bytes(m.0[40..48].try_into().unwrap()), 2, "dims[3]");
        assert_eq!(u64::from_le_bytes(m.0[56..64].try_into().unwrap()), 2, "dim 0's stride is the element");
        assert_eq!(u64::from_le_bytes(m.0[80..88].try_into().unwrap()), 15360, "dims[3]'s stride");
        assert_eq!(u32::from_le_bytes(m.0[104..108].try_into().unwrap()), 16, "box_dims[2]");
        assert_eq!(u32::from_le_bytes(m.0[112..116].try_into().unwrap()), 1, "an unused box dimension");
        assert_eq!(std::mem::align_of::<TensorMap>(), 64);
        assert_eq!(std::mem::size_of::<TensorMap>(), 128);
    }

    #[test]
    fn the_emulated_device_encodes_in_the_emulators_format() {
        let dev = crate::cuda::emulated::EmulatedDevice::open().unwrap();
        let mut d = attention_like();
        assert_eq!(d.span_bytes(), 2 * 64 * 3 * 40 * 2);
        let buf = dev.alloc(d.span_bytes() as usize).unwrap();
        d.address = buf;
        assert_eq!(dev.tensor_map(&d).unwrap(), d.encode_emulated().unwrap());
        let mut bad = d.clone();
        bad.box_dims[1] = 0;
        let err = dev.tensor_map(&bad).unwrap_err().to_string();
        assert!(err.contains("tensor_map.box_dims"), "{err}");
        // One more batch than the buffer holds: refused.
        let mut past = d.clone();
        past.dims[3] = 3;
        let err = dev.tensor_map(&past).unwrap_err().to_string();
        assert!(err.contains("tensor map"), "{err}");
        // SAFETY: nothing uses the buffer.
        unsafe { dev.free(buf) };
    }

    #[test]
    fn each_rule_names_its_field() {
        let mut d = attention_like();
        d.address = 0x1008;
        assert!(field_of(&d).starts_with("tensor_map.address"), "{}", field_of(&d));

        let mut d = attention_like();
        d.dims = vec![64];
        d.strides = vec![];
        d.box_dims = vec![64];
        assert!(field_of(&d).starts_with("tensor_map.dims: rank 1"), "{}", field_of(&d));

        let mut d = attention_like();
        d.dims[1] = 0;
        assert!(field_of(&d).starts_with("tensor_map.dims: dims[1] = 0"), "{}", field_of(&d));

        let mut d = attention_like();
        d.strides[0] = 136;
        assert!(field_of(&d).contains("strides[0] = 136 bytes: each must be a multiple of 16"), "{}", field_of(&d));

        let mut d = attention_like();
        d.strides[2] = 1 << 40;
        assert!(field_of(&d).contains("below 2^40"), "{}", field_of(&d));

        let mut d = attention_like();
        d.strides[1] = 256;
        assert!(field_of(&d).contains("elements would overlap"), "{}", field_of(&d));

        let mut d = attention_like();
        d.strides.pop();
        assert!(field_of(&d).starts_with("tensor_map.strides: 2 strides for 4"), "{}", field_of(&d));

        let mut d = attention_like();
        d.box_dims[2] = 257;
        assert!(field_of(&d).starts_with("tensor_map.box_dims: box_dims[2] = 257"), "{}", field_of(&d));

        let mut d = attention_like();
        d.box_dims[0] = 12;
        assert!(field_of(&d).contains("24 bytes, not a multiple of 16"), "{}", field_of(&d));

        let mut d = attention_like();
        d.swizzle = TmaSwizzle::B64;
        assert!(field_of(&d).starts_with("tensor_map.swizzle: the box's inner dimension is 128 bytes"));

        let mut d = attention_like();
        d.swizzle = TmaSwizzle::None;
        d.box_dims[0] = 128;
        d.dims[0] = 128;
        d.strides = vec![256, 768, 30720];
        d.validate().unwrap();
    }
}
