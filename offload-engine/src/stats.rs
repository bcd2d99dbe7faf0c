//! What the engine did: bytes moved and peak use per tier, and the time the caller spent waiting.

use std::fmt;
use std::time::Duration;

use crate::scheduler::{Counters, Scheduler, TierCounters};

/// One tier's use since the engine started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierStats {
    /// The tier's budget.
    pub budget_bytes: u64,
    /// Bytes the tier holds now. Host: every pool buffer, lent out or idle (size classes round tensors up);
    /// disk: the spill files' sizes (header and page padding included).
    pub used_bytes: u64,
    /// The most `used_bytes` ever was, counting room reserved for copies in flight; never above the budget.
    pub peak_bytes: u64,
    /// Tensor bytes copied into the tier.
    pub bytes_out: u64,
    /// Tensor bytes copied back from the tier.
    pub bytes_in: u64,
    /// Tensors copied into the tier.
    pub tensors_out: u64,
    /// Tensors copied back from the tier.
    pub tensors_in: u64,
    /// Worker time spent copying into the tier (checksums and file system calls included).
    pub time_out: Duration,
    /// Worker time spent copying back.
    pub time_in: Duration,
}

impl TierStats {
    /// Bytes per second of the copies into the tier, per worker (0 before any).
    pub fn out_bytes_per_s(&self) -> f64 {
        rate(self.bytes_out, self.time_out)
    }

    /// Bytes per second of the copies back, per worker (0 before any).
    pub fn in_bytes_per_s(&self) -> f64 {
        rate(self.bytes_in, self.time_in)
    }

    fn new(budget_bytes: u64, used_bytes: u64, peak_bytes: u64, c: &TierCounters) -> Self {
        Self {
            budget_bytes,
            used_bytes,
            peak_bytes,
            bytes_out: c.bytes_out,
            bytes_in: c.bytes_in,
            tensors_out: c.tensors_out,
            tensors_in: c.tensors_in,
            time_out: c.time_out,
            time_in: c.time_in,
        }
    }
}

fn rate(bytes: u64, t: Duration) -> f64 {
    if t.is_zero() {
        0.0
    } else {
        bytes as f64 / t.as_secs_f64()
    }
}

/// A snapshot of the engine's statistics ([`OffloadEngine::stats`](crate::OffloadEngine::stats)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OffloadStats {
    /// The host tier, if there is one.
    pub host: Option<TierStats>,
    /// The disk tier, if there is one.
    pub disk: Option<TierStats>,
    /// Fetches made.
    pub fetches: u64,
    /// Fetches that had to wait for a copy back (the rest found their data in memory).
    pub fetches_waited: u64,
    /// Time spent waiting inside `fetch`: the cost of offload that the caller sees.
    pub fetch_wait: Duration,
    /// Time `offload` spent blocked by [`OffloadEngineBuilder::max_pending_bytes`](crate::OffloadEngineBuilder::max_pending_bytes).
    pub offload_wait: Duration,
    /// Tensors kept resident (last layers, and empty tensors).
    pub resident_tensors: u64,
    /// Offloads cancelled by a prefetch or fetch before their copy started.
    pub cancelled_offloads: u64,
    /// Copies that failed (their fetch returns the error).
    pub failures: u64,
    /// Host buffers mapped since the start: constant once a training step has run.
    pub host_buffers_mapped: u64,
    /// Fetched tensors for which no spare allocation matched, so one was made.
    pub fetch_allocations: u64,
    /// The most bytes ever handed over and not yet in a tier (waiting or being written).
    pub peak_pending_bytes: u64,
    /// Bytes of spare allocations held now.
    pub spare_bytes: u64,
    /// The most bytes of spare allocations ever held.
    pub peak_spare_bytes: u64,
    /// Spill files of crashed runs removed at start.
    pub stale_files_removed: u64,
}

impl OffloadStats {
    pub(crate) fn snapshot(s: &Scheduler) -> Self {
        let c: &Counters = &s.counters;
        Self {
            host: s.host.as_ref().map(|h| TierStats::new(h.budget(), h.held(), h.peak(), &c.host)),
            disk: s.disk.as_ref().map(|d| TierStats::new(d.budget, d.used, d.peak, &c.disk)),
            fetches: c.fetches,
            fetches_waited: c.fetches_waited,
            fetch_wait: c.fetch_wait,
            offload_wait: c.offload_wait,
            resident_tensors: c.resident,
            cancelled_offloads: c.cancelled,
            failures: c.failures,
            host_buffers_mapped: s.host.as_ref().map_or(0, |h| h.allocations()),
            fetch_allocations: c.output_allocations,
            peak_pending_bytes: c.peak_unmoved,
            spare_bytes: s.spare.bytes(),
            peak_spare_bytes: s.spare.peak(),
            stale_files_removed: s.disk.as_ref().map_or(0, |d| d.dir.stale_removed()),
        }
    }
}

const MIB: f64 = (1 << 20) as f64;

impl fmt::Display for OffloadStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, tier) in [("host", &self.host), ("disk", &self.disk)] {
            let Some(t) = tier else { continue };
            writeln!(
                f,
                "{name}: out {:.1} MiB ({} tensors, {:.2} GiB/s), in {:.1} MiB ({} tensors, {:.2} GiB/s), \
                 peak {:.1} of {:.1} MiB",
                t.bytes_out as f64 / MIB,
                t.tensors_out,
                t.out_bytes_per_s() / (MIB * 1024.0),
                t.bytes_in as f64 / MIB,
                t.tensors_in,
                t.in_bytes_per_s() / (MIB * 1024.0),
                t.peak_bytes as f64 / MIB,
                t.budget_bytes as f64 / MIB,
            )?;
        }
        write!(
            f,
            "fetch: {} ({} waited, {:.3} s waiting); resident {}, cancelled {}, failed {}",
            self.fetches,
            self.fetches_waited,
            self.fetch_wait.as_secs_f64(),
            self.resident_tensors,
            self.cancelled_offloads,
            self.failures,
        )
    }
}
