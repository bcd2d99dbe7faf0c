//! `longctx-dtype`: the one element-type tag that longctx's crates share.
//!
//! The kernels compute on tensors of these types and the offload engine moves them; both name a tensor's type
//! with this [`DType`], so a trainer hands a kernel buffer's type to the engine as it is. It is a crate of its
//! own, with no dependencies, so that the offload engine builds without the kernels crate (a framework author
//! links either alone) and neither depends on the other.
#![warn(missing_docs)]

use std::fmt;

/// An element type: how many bytes an element takes and how they are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// bfloat16: 8 exponent bits, 7 mantissa bits.
    Bf16,
    /// IEEE half precision: 5 exponent bits, 10 mantissa bits.
    F16,
}

impl DType {
    /// Every type, in declaration order.
    pub const ALL: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

    /// The type's name as used in error messages and file headers (`f32`, `bf16`, `f16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_sizes() {
        let got: Vec<_> = DType::ALL.iter().map(|d| (d.to_string(), d.size())).collect();
        assert_eq!(got, [("f32".to_string(), 4), ("bf16".to_string(), 2), ("f16".to_string(), 2)]);
    }
}
