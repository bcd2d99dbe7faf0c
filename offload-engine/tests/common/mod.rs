//! Helpers shared by the integration tests: tensors with reproducible bit patterns, and their checks.
#![allow(dead_code)] // each test binary uses its own share

use half::{bf16, f16};
use longctx_offload::{DType, HostTensor};

/// A tensor of `dtype` and `dims` whose bytes are a function of `seed` (every bit pattern, NaNs included).
pub fn tensor(dtype: DType, dims: &[usize], seed: u64) -> HostTensor {
    let n: usize = dims.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    match dtype {
        DType::F32 => HostTensor::f32((0..n).map(|_| f32::from_bits(next() as u32)).collect(), dims),
        DType::Bf16 => HostTensor::bf16((0..n).map(|_| bf16::from_bits(next() as u16)).collect(), dims),
        DType::F16 => HostTensor::f16((0..n).map(|_| f16::from_bits(next() as u16)).collect(), dims),
    }
    .expect("dims match the length")
}

/// The host tensor an error handed back (a test offloads host tensors only).
pub fn host(returned: Box<longctx_offload::Tensor>) -> HostTensor {
    #![allow(clippy::boxed_local)] // the error's field is a box
    returned.into_host().expect("a host tensor was handed over")
}

/// Panics unless `got` is `want` bit for bit, with the same dtype and dims.
pub fn assert_same(got: &HostTensor, want: &HostTensor, what: &str) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.dims(), want.dims(), "{what}: dims");
    assert!(got.as_bytes() == want.as_bytes(), "{what}: data differs");
}

/// The `.spill` files in `dir`.
pub fn spill_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> =
        std::fs::read_dir(dir).map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).collect()).unwrap_or_default();
    files.retain(|p| p.extension().is_some_and(|e| e == "spill"));
    files.sort();
    files
}

pub const MIB: u64 = 1 << 20;
