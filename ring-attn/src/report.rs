//! [`StepReport`]: what one call of a plan did (bytes, time, blocks), for benchmarks and for checking the
//! communication volume against the schedule's formula.

use std::time::Duration;

/// What one call did, for benchmarks and for checking communication volume.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepReport {
    /// Bytes this rank sent (measured by the communicators).
    pub bytes_sent: u64,
    /// Bytes the schedule's formula says this rank sends.
    pub expected_bytes: u64,
    /// Time in attention kernels and merges.
    pub compute: Duration,
    /// Time waiting for (or posting) communication that compute did not hide.
    pub comm_wait: Duration,
    /// KV blocks computed.
    pub blocks_computed: usize,
    /// KV blocks skipped because the mask hides them entirely.
    pub blocks_skipped: usize,
    /// On a GPU: how long this rank's compute queue stood idle inside ring attention waiting for the host
    /// (posting or waiting for transfers), on the device's clock: the communication the overlap did not hide.
    /// Only in [`CpPlan::take_totals`](crate::CpPlan::take_totals)'s report (resolving it waits for the device);
    /// `None` on the CPU and the emulator, where `comm_wait` is the measure, and for schedules other than the ring.
    pub device_idle: Option<Duration>,
}

impl StepReport {
    /// Adds `other`'s counts and times to these (totals over calls: [`CpPlan::take_totals`](crate::CpPlan::take_totals)).
    pub fn add(&mut self, other: &StepReport) {
        self.bytes_sent += other.bytes_sent;
        self.expected_bytes += other.expected_bytes;
        self.compute += other.compute;
        self.comm_wait += other.comm_wait;
        self.blocks_computed += other.blocks_computed;
        self.blocks_skipped += other.blocks_skipped;
        self.device_idle = match (self.device_idle, other.device_idle) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
    }
}
