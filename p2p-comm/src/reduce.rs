//! Element types that collectives can reduce, and the reduction operators.

use bytemuck::Pod;
use half::bf16;

/// A reduction operator for [`all_reduce`](crate::Communicator::all_reduce) and
/// [`reduce_scatter`](crate::Communicator::reduce_scatter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum (integers wrap on overflow).
    Sum,
    /// Element-wise maximum (for floats, `f32::max` semantics: a NaN loses against a number).
    Max,
}

mod private {
    pub trait Sealed {}
}

/// An element type that collectives can reduce: `f32`, `f64`, `half::bf16`, `i32`, `i64`, `u64`.
///
/// Reductions run in [`Reduce::Acc`]: `bf16` accumulates (and travels between ranks) as `f32`, so a ring
/// reduction rounds to `bf16` once at the end instead of once per hop. The trait is sealed.
pub trait Reduce: Pod + Send + Sync + private::Sealed {
    /// Type in which partial results are accumulated and exchanged.
    type Acc: Reduce<Acc = Self::Acc>;
    /// Widens an element to the accumulation type.
    fn to_acc(self) -> Self::Acc;
    /// Narrows an accumulated value back (round to nearest for `bf16`).
    fn from_acc(acc: Self::Acc) -> Self;
    /// Combines two values.
    fn combine(self, other: Self, op: ReduceOp) -> Self;
}

macro_rules! reduce_float {
    ($t:ty) => {
        impl private::Sealed for $t {}
        impl Reduce for $t {
            type Acc = $t;
            #[inline]
            fn to_acc(self) -> $t {
                self
            }
            #[inline]
            fn from_acc(acc: $t) -> $t {
                acc
            }
            #[inline]
            fn combine(self, other: $t, op: ReduceOp) -> $t {
                match op {
                    ReduceOp::Sum => self + other,
                    ReduceOp::Max => self.max(other),
                }
            }
        }
    };
}
macro_rules! reduce_int {
    ($t:ty) => {
        impl private::Sealed for $t {}
        impl Reduce for $t {
            type Acc = $t;
            #[inline]
            fn to_acc(self) -> $t {
                self
            }
            #[inline]
            fn from_acc(acc: $t) -> $t {
                acc
            }
            #[inline]
            fn combine(self, other: $t, op: ReduceOp) -> $t {
                match op {
                    ReduceOp::Sum => self.wrapping_add(other),
                    ReduceOp::Max => self.max(other),
                }
            }
        }
    };
}
reduce_float!(f32);
reduce_float!(f64);
reduce_int!(i32);
reduce_int!(i64);
reduce_int!(u64);

impl private::Sealed for bf16 {}
impl Reduce for bf16 {
    type Acc = f32;
    #[inline]
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    #[inline]
    fn from_acc(acc: f32) -> bf16 {
        bf16::from_f32(acc)
    }
    #[inline]
    fn combine(self, other: bf16, op: ReduceOp) -> bf16 {
        bf16::from_f32(self.to_f32().combine(other.to_f32(), op))
    }
}

/// `acc[i] = acc[i] op other[i]`.
pub(crate) fn combine_into<A: Reduce>(acc: &mut [A], other: &[A], op: ReduceOp) {
    for (a, &b) in acc.iter_mut().zip(other) {
        *a = a.combine(b, op);
    }
}
