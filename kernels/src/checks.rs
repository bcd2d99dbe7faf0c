//! The checks of every op's arguments, in one place both backends use: dims, element types and memory, all
//! before any element is written (an `Err` leaves outputs untouched).

use crate::error::{KernelError, Result};

/// The product of `dims`, or a [`KernelError::Shape`] when it overflows `usize`.
pub(crate) fn numel(what: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| KernelError::Shape(format!("{what}: element count {dims:?} overflows usize")))
}

/// Errors with [`KernelError::ZeroDim`] when `d` is zero.
pub(crate) fn nonzero(name: &'static str, d: usize) -> Result<()> {
    if d == 0 {
        Err(KernelError::ZeroDim(name))
    } else {
        Ok(())
    }
}

/// Errors with [`KernelError::InvalidArgument`] unless `x` is finite (and, with `positive`, above zero).
pub(crate) fn finite(name: &'static str, x: f64, positive: bool) -> Result<()> {
    if !x.is_finite() || (positive && x <= 0.0) {
        let want = if positive { "finite and > 0" } else { "finite" };
        Err(KernelError::InvalidArgument { name, why: format!("{x} is not {want}") })
    } else {
        Ok(())
    }
}
