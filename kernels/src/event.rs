//! [`Event`]: a point in a backend's queue of work, for ordering work across backends (streams) and for
//! knowing when results may be read. See [`Backend`](crate::Backend)'s "Ordering" for the rules.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;

/// What a device backend records for an [`Event`]: a marker in its stream.
pub trait BackendEvent: Send + Sync + fmt::Debug {
    /// Blocks the calling thread until the marker is reached (every op enqueued before it has run), and
    /// reports a fault of any of those ops.
    fn synchronize(&self) -> Result<()>;
    /// For a backend to recognise its own events (and wait on them on the device, without the host).
    fn as_any(&self) -> &dyn Any;
    /// The device time from `earlier` to this marker, both recorded with timing
    /// ([`Backend::record_timed_event`](crate::Backend::record_timed_event)) on this backend's device; waits for
    /// this one. `None` where the markers carry no time (the default).
    fn elapsed_since(&self, earlier: &dyn BackendEvent) -> Result<Option<Duration>> {
        let _ = earlier;
        Ok(None)
    }
}

/// A point in a backend's queue of work: complete once every op enqueued on that backend before
/// [`Backend::record_event`](crate::Backend::record_event) has run. Cheap to clone.
///
/// A synchronous backend (the CPU) records events that are complete at once.
#[derive(Clone, Debug, Default)]
pub struct Event(Option<Arc<dyn BackendEvent>>);

impl Event {
    /// An event that is already complete: what a backend that runs every op before returning records.
    pub fn complete() -> Self {
        Self(None)
    }
    /// An event a device backend recorded.
    pub fn new(event: Arc<dyn BackendEvent>) -> Self {
        Self(Some(event))
    }
    /// Blocks until the event is complete (a no-op for a complete one).
    pub fn synchronize(&self) -> Result<()> {
        match &self.0 {
            Some(e) => e.synchronize(),
            None => Ok(()),
        }
    }
    /// The device time from `earlier` to this event, both recorded by
    /// [`Backend::record_timed_event`](crate::Backend::record_timed_event) on one device (waits for this one):
    /// how long the device took between them, idle time included. `None` where the events carry no time (a
    /// backend that runs each op before returning, the emulator): the host clock is the measure there.
    pub fn elapsed_since(&self, earlier: &Event) -> Result<Option<Duration>> {
        match (&self.0, &earlier.0) {
            (Some(end), Some(start)) => end.elapsed_since(start.as_ref()),
            _ => Ok(None),
        }
    }
    /// The backend's marker, or `None` for an event that was complete when recorded.
    pub fn marker(&self) -> Option<&Arc<dyn BackendEvent>> {
        self.0.as_ref()
    }
}
