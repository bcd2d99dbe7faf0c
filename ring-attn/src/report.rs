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
    }
}
