//! Where a tensor is: its [`Tier`], and the [`Location`] a ticket reports (waiting, moving, in a tier, back).

use std::fmt;

/// Which tier a tensor is in or moving to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// The pool of host buffers.
    Host,
    /// The spill directory.
    Disk,
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Host => "host",
            Tier::Disk => "disk",
        })
    }
}

/// Where a ticket's data is now (see [`Ticket::location`](crate::Ticket::location)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Location {
    /// Kept in memory as handed over: one of the last resident layers, or an empty tensor.
    Resident,
    /// In the caller's memory, waiting for a worker or for room in a tier (back-pressure).
    Waiting,
    /// Being copied into a tier.
    MovingOut(Tier),
    /// In a tier.
    In(Tier),
    /// Being copied back from a tier.
    MovingBack(Tier),
    /// Back in memory (prefetched, or its offload was cancelled before it started): `fetch` does not wait.
    Ready,
    /// A copy failed; `fetch` returns the error.
    Failed,
}
