//! A slot: the engine's record of one ticket's tensor, and the states its data goes through.
//!
//! ```text
//!  offload ─┬─> Resident ─────────────────────────────────────────────┐
//!           └─> Waiting ──> MovingOut ──> InHost / OnDisk ──> MovingBack ──> Ready ──> fetch
//!                  │ (prefetch or fetch before the copy starts)                ^
//!                  └───────────────────────────────────────────────────────────┘
//! ```
//! A failed copy leaves `Failed`. While a worker holds the data (`MovingOut`, `MovingBack`) the slot holds
//! none; a ticket dropped then marks the slot `abandoned` and the worker frees what it holds when it is done.

use std::path::PathBuf;

use crate::aligned::AlignedBuf;
use crate::error::OffloadError;
use crate::location::{Location, Tier};
use crate::memory::Payload;
use crate::tag::TensorTag;
use crate::tensor::DType;

/// Identifies a slot within its engine; increasing in offload order.
pub(crate) type SlotId = u64;

pub(crate) enum SlotState {
    /// Kept as handed over.
    Resident(Payload),
    /// In the offload queue, in the caller's memory.
    Waiting(Payload),
    /// A worker is copying it into `Tier`.
    MovingOut(Tier),
    InHost(AlignedBuf),
    OnDisk(PathBuf),
    /// A worker is copying it back from `Tier`.
    MovingBack(Tier),
    Ready(Payload),
    Failed(OffloadError),
    /// Momentarily, while `fetch` moves the contents out.
    Taken,
}

pub(crate) struct Slot {
    pub(crate) tag: TensorTag,
    pub(crate) dtype: DType,
    /// Elements.
    pub(crate) len: usize,
    /// Bytes of the elements.
    pub(crate) bytes: usize,
    pub(crate) state: SlotState,
    /// The dims of a device tensor, to allocate its buffer when it comes back; `None` for a host tensor.
    pub(crate) device_dims: Option<Vec<usize>>,
    /// Wanted back: a prefetch or a fetch asked for it.
    pub(crate) wanted: bool,
    /// A fetch is waiting for it.
    pub(crate) urgent: bool,
    /// The ticket was dropped while a worker held the data.
    pub(crate) abandoned: bool,
}

impl Slot {
    pub(crate) fn location(&self) -> Location {
        match &self.state {
            SlotState::Resident(_) => Location::Resident,
            SlotState::Waiting(_) => Location::Waiting,
            SlotState::MovingOut(t) => Location::MovingOut(*t),
            SlotState::InHost(_) => Location::In(Tier::Host),
            SlotState::OnDisk(_) => Location::In(Tier::Disk),
            SlotState::MovingBack(t) => Location::MovingBack(*t),
            SlotState::Ready(_) | SlotState::Taken => Location::Ready,
            SlotState::Failed(_) => Location::Failed,
        }
    }
}
