//! Traffic counters of a communicator.

use std::sync::atomic::{AtomicU64, Ordering};

/// Cumulative traffic of one communicator (not of its parent or its sub-communicators), counting the messages
/// that collectives send internally. A message counts when its operation completes successfully.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    /// Payload bytes of completed sends.
    pub bytes_sent: u64,
    /// Payload bytes of completed receives.
    pub bytes_received: u64,
    /// Completed sends.
    pub messages_sent: u64,
    /// Completed receives.
    pub messages_received: u64,
}

/// Aligned to two cache lines, so that its `Arc`'s counts and these counters share no line with another rank's:
/// every message changes them.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct StatsCounters {
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    messages_sent: AtomicU64,
    messages_received: AtomicU64,
}

impl StatsCounters {
    pub(crate) fn record(&self, is_send: bool, bytes: usize) {
        let (b, m) = if is_send {
            (&self.bytes_sent, &self.messages_sent)
        } else {
            (&self.bytes_received, &self.messages_received)
        };
        b.fetch_add(bytes as u64, Ordering::Relaxed);
        m.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> CommStats {
        CommStats {
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            messages_sent: self.messages_sent.load(Ordering::Relaxed),
            messages_received: self.messages_received.load(Ordering::Relaxed),
        }
    }
}
