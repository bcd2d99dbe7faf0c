//! Every UCX status as a `Result`.

use std::ffi::CStr;

use super::sys;

/// A UCX status other than `UCS_OK` / `UCS_INPROGRESS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UcxError(pub sys::ucs_status_t);

impl std::fmt::Display for UcxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // SAFETY: ucs_status_string returns a static NUL-terminated string for any status value.
        let s = unsafe { CStr::from_ptr(sys::ucs_status_string(self.0)) };
        write!(f, "{} ({})", s.to_string_lossy(), self.0 .0)
    }
}

impl std::error::Error for UcxError {}

impl From<UcxError> for crate::CommError {
    fn from(e: UcxError) -> Self {
        crate::CommError::Ucx(e.to_string())
    }
}

/// `Ok` for `UCS_OK`, the error otherwise.
pub fn check(s: sys::ucs_status_t) -> Result<(), UcxError> {
    if s == sys::ucs_status_t::UCS_OK {
        Ok(())
    } else {
        Err(UcxError(s))
    }
}

/// What a `ucs_status_ptr_t` returned by a non-blocking call means.
pub enum Started {
    /// Completed at once.
    Done,
    /// In flight: poll and free this request.
    Request(*mut std::ffi::c_void),
}

/// Decodes a `ucs_status_ptr_t` (`UCS_PTR_IS_ERR` / `UCS_PTR_STATUS`).
pub fn started(p: sys::ucs_status_ptr_t) -> Result<Started, UcxError> {
    if p.is_null() {
        Ok(Started::Done)
    } else if sys::ucs_ptr_is_err(p) {
        Err(UcxError(sys::ucs_status_t(sys::ucs_ptr_status(p) as i8)))
    } else {
        Ok(Started::Request(p))
    }
}
