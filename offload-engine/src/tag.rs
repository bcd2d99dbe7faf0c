//! What a tensor is, to the caller: its [`TensorTag`] (layer, name, [`TensorKind`]), and the kind as a type
//! ([`Kind`]: [`Activation`] or [`Weights`]) that a [`Ticket`](crate::Ticket) carries.

use std::borrow::Cow;
use std::fmt;

/// What a ticket stands for: a saved activation or a layer's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorKind {
    /// A tensor a layer's forward saved for its backward.
    Activation,
    /// A layer's parameters, moved out between its forward and its backward.
    Weights,
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Activation {}
    impl Sealed for super::Weights {}
}

/// The type-level [`TensorKind`] of a [`Ticket`](crate::Ticket) (sealed: [`Activation`] or [`Weights`]).
pub trait Kind: sealed::Sealed + 'static {
    /// The kind, as a value.
    const KIND: TensorKind;
}

/// Marker of activation tickets ([`ActivationTicket`](crate::ActivationTicket)).
#[derive(Debug)]
pub enum Activation {}

/// Marker of weight tickets ([`WeightsTicket`](crate::WeightsTicket)).
#[derive(Debug)]
pub enum Weights {}

impl Kind for Activation {
    const KIND: TensorKind = TensorKind::Activation;
}

impl Kind for Weights {
    const KIND: TensorKind = TensorKind::Weights;
}

/// The caller's name for a tensor: the layer it belongs to, a name, and its kind. Errors and prefetch hints
/// refer to tensors by their tag.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorTag {
    /// Layer index (forward order: layer 0 runs first, its backward last).
    pub layer: usize,
    /// The caller's name (for a trainer: the saved field, e.g. `"q"`).
    pub name: Cow<'static, str>,
    /// Activation or weights.
    pub kind: TensorKind,
}

impl fmt::Display for TensorTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            TensorKind::Activation => "activation",
            TensorKind::Weights => "weights",
        };
        write!(f, "{kind} '{}' of layer {}", self.name, self.layer)
    }
}
