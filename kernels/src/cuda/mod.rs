//! The CUDA backend's public face. Its kernels are not written yet: without the `cuda` feature
//! [`CudaBackend::new`] returns [`KernelError::NotCompiled`]; with it, [`KernelError::NoDevice`] (naming whether a
//! driver was found), so the type exists in every build and callers that probe for a GPU compile everywhere
//! (candle's `dummy_cuda_backend`). The device memory kind is already [`Memory::Cuda`](crate::Memory::Cuda).

use crate::error::{KernelError, Result};

#[cfg(feature = "cuda")]
#[allow(dead_code)] // the ops that use every part of the seam come with the backend
pub(crate) mod device;
#[cfg(feature = "cuda")]
#[allow(dead_code)]
pub(crate) mod sources;

// The real GPU behind the seam: where CUDA's libraries and headers are, NVRTC, the driver, cuBLASLt. The backend
// that calls them comes later, hence the allowance.
#[cfg(feature = "cuda")]
#[allow(dead_code)]
pub(crate) mod driver;
#[cfg(feature = "cuda")]
#[allow(dead_code)]
pub(crate) mod gemm;
#[cfg(feature = "cuda")]
#[allow(dead_code)]
pub(crate) mod headers;
#[cfg(feature = "cuda")]
#[allow(dead_code)]
pub(crate) mod libraries;
#[cfg(feature = "cuda")]
#[allow(dead_code)]
pub(crate) mod nvrtc;
#[cfg(feature = "cuda")]
#[allow(dead_code)]
pub(crate) mod places;

/// A CUDA device to compute on (see the module docs).
#[derive(Debug)]
pub struct CudaBackend {
    _never: std::convert::Infallible,
}

impl CudaBackend {
    /// The backend on device `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self> {
        #[cfg(not(feature = "cuda"))]
        {
            let _ = ordinal;
            Err(KernelError::NotCompiled { backend: "cuda", feature: "cuda" })
        }
        #[cfg(feature = "cuda")]
        {
            let why = if driver_present() {
                format!("a CUDA driver is present, but this release has no device kernels (device {ordinal})")
            } else {
                "no CUDA driver (libcuda.so.1) could be loaded".to_string()
            };
            Err(KernelError::NoDevice { backend: "cuda", why })
        }
    }
}

#[cfg(feature = "cuda")]
fn driver_present() -> bool {
    let name = c"libcuda.so.1";
    // SAFETY: dlopen with a valid C string; the handle is closed at once and nothing from it is used.
    unsafe {
        let h = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if h.is_null() {
            false
        } else {
            libc::dlclose(h);
            true
        }
    }
}
