//! The CUDA backend's ops, one file per kernel source (`cuda/kernels/<name>.cu`), each turning checked views
//! into launches: it picks the kernel by the views' element types, sizes the grid and passes the device
//! addresses. The shared checks have run before any of these is called, so every view is on this device and
//! has the dims and types the op needs.

pub(crate) mod attention;
pub(crate) mod cross_entropy;
pub(crate) mod elementwise;
pub(crate) mod embedding;
pub(crate) mod linear;
pub(crate) mod moe;
pub(crate) mod norm;
pub(crate) mod rope;

use super::device::{Kernel, KernelSource, LaunchConfig};
use super::stream::Stream;
use crate::dtype::DType;
use crate::error::{KernelError, Result};
use crate::view::{View, ViewMut};

/// Threads per block of the grid-stride kernels.
pub(crate) const THREADS: u32 = 256;
/// The most blocks a grid-stride launch uses: past this, threads loop. A constant, not the device's size, so
/// that reductions over a grid split the same way on every GPU.
pub(crate) const MAX_BLOCKS: u64 = 4096;

/// The device address of `v` (a view the checks placed on `b`'s device).
pub(crate) fn ptr(b: &Stream, name: &'static str, v: &View<'_>) -> Result<u64> {
    Ok(v.as_device(name, b.on().memory)?.ptr())
}

/// The device address of the writable `v`.
pub(crate) fn ptr_mut(b: &Stream, name: &'static str, v: ViewMut<'_>) -> Result<u64> {
    Ok(v.into_device(name, b.on().memory)?.ptr())
}

/// The suffix a kernel name carries for an element type.
pub(crate) fn suffix(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::Bf16 => "bf16",
        DType::F16 => "f16",
    }
}

/// The kernel `name` of `src`.
pub(crate) fn kernel(src: &'static KernelSource, name: &str) -> Result<Kernel> {
    match src.kernels.iter().find(|k| **k == name) {
        Some(k) => Ok(Kernel { source: src, name: k }),
        None => Err(KernelError::Device {
            backend: "cuda",
            op: name.to_string(),
            why: format!("no kernel of that name in {}", src.file),
        }),
    }
}

/// A 1-D grid-stride launch over `n` elements.
pub(crate) fn grid(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as u64).clamp(1, MAX_BLOCKS);
    LaunchConfig::linear(blocks as u32, THREADS)
}

/// The bytes of a host slice of plain values.
pub(crate) fn bytes_of<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}
