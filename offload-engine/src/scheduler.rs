//! The scheduler: every slot, the two queues, the tiers' budgets, and the rules that decide what a worker does
//! next. It only ever runs under the engine's lock and never copies data; workers copy outside the lock.
//!
//! The rules (also in the crate docs):
//! - Placement: offloads are placed in the order they were made. The head of the queue goes to the first tier
//!   (in builder order) with room for it; when no tier has room it waits, in the caller's memory, and so does
//!   everything behind it, until a fetch or a dropped ticket frees room. Room is reserved before the copy
//!   starts, so a tier's budget is never exceeded, not even by copies in flight. Nothing moves between tiers
//!   once placed.
//! - Restores: a fetch that is waiting goes first; then pending offloads; then prefetches, highest layer first
//!   and, within a layer, the latest offload first: the backward needs tensors in the reverse order of the
//!   forward.
//! - A prefetch or fetch of a tensor whose copy has not started cancels it: the data never left memory.

use std::collections::{HashMap, VecDeque};
use std::mem;
use std::path::PathBuf;
use std::time::Duration;

use crate::aligned::AlignedBuf;
use crate::error::OffloadError;
use crate::location::Tier;
use crate::memory::Payload;
use crate::pool::{HostPool, TakeError};
use crate::slot::{Slot, SlotId, SlotState};
use crate::spare::SparePool;
use crate::spill::dir::SpillDir;
use crate::spill::{file, DiskIo};
use crate::tag::TensorTag;
use crate::tensor::{DType, HostData};

/// The disk tier's directory and budget.
pub(crate) struct DiskTier {
    pub(crate) dir: SpillDir,
    pub(crate) budget: u64,
    pub(crate) used: u64,
    pub(crate) peak: u64,
}

impl DiskTier {
    fn has_room(&self, bytes: usize) -> bool {
        file::file_bytes(bytes).is_some_and(|f| self.used + f <= self.budget)
    }

    pub(crate) fn could_hold(&self, bytes: usize) -> bool {
        file::file_bytes(bytes).is_some_and(|f| f <= self.budget)
    }

    fn reserve(&mut self, bytes: usize) -> u64 {
        let f = file::file_bytes(bytes).unwrap_or(u64::MAX);
        self.used += f;
        self.peak = self.peak.max(self.used);
        f
    }

    fn release(&mut self, bytes: usize) {
        self.used -= file::file_bytes(bytes).unwrap_or(0);
    }
}

/// Bytes moved and time spent per direction of one tier.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TierCounters {
    pub(crate) bytes_out: u64,
    pub(crate) bytes_in: u64,
    pub(crate) tensors_out: u64,
    pub(crate) tensors_in: u64,
    pub(crate) time_out: Duration,
    pub(crate) time_in: Duration,
}

/// Counters behind [`crate::OffloadStats`].
#[derive(Debug, Clone, Default)]
pub(crate) struct Counters {
    pub(crate) host: TierCounters,
    pub(crate) disk: TierCounters,
    pub(crate) fetches: u64,
    pub(crate) fetches_waited: u64,
    pub(crate) fetch_wait: Duration,
    pub(crate) offload_wait: Duration,
    pub(crate) resident: u64,
    pub(crate) cancelled: u64,
    pub(crate) failures: u64,
    pub(crate) output_allocations: u64,
    pub(crate) peak_unmoved: u64,
}

/// Where a write goes.
pub(crate) enum Dest {
    Host(AlignedBuf),
    Disk { path: PathBuf, mode: DiskIo },
}

/// Where a read comes from.
pub(crate) enum Source {
    Host(AlignedBuf),
    Disk { path: PathBuf, mode: DiskIo },
}

/// What a worker is asked to do.
pub(crate) enum Job {
    Write {
        id: SlotId,
        tag: TensorTag,
        dtype: DType,
        data: Payload,
        to: Dest,
    },
    /// `device_dims`: the tensor goes back to device memory, in a buffer of these dims; `out`: a host tensor's
    /// destination, if a spare was at hand.
    Read {
        id: SlotId,
        tag: TensorTag,
        dtype: DType,
        len: usize,
        from: Source,
        out: Option<HostData>,
        device_dims: Option<Vec<usize>>,
    },
}

/// What a worker reports back.
pub(crate) enum Done {
    /// `data` is the caller's allocation, now free.
    /// On failure: the tier it was going to, and the error.
    Wrote {
        id: SlotId,
        to: Result<Landed, (Tier, OffloadError)>,
        data: Payload,
        took: Duration,
    },
    Read {
        id: SlotId,
        result: Result<Payload, OffloadError>,
        from: Landed,
        took: Duration,
    },
    /// The job panicked; everything it held is gone.
    Panicked {
        id: SlotId,
        tier: Tier,
        writing: bool,
    },
}

/// A tensor's place in a tier: a host buffer, or a spill file (on failed writes: the partial file, to remove).
pub(crate) enum Landed {
    Host(AlignedBuf),
    Disk(PathBuf),
}

/// What must happen once the lock is released ([`crate::shared::Shared::finish`]): memory to free, a spill
/// file to remove (by the reaper thread, which then gives its room back: [`Scheduler::file_removed`]), a job to
/// book as over ([`Scheduler::job_done`]). A job counts as running until then, and [`Scheduler::is_idle`] waits
/// for pending removals too, so an idle engine is a tidy one.
#[derive(Default)]
#[must_use]
pub(crate) struct Cleanup {
    pub(crate) data: Option<Payload>,
    /// A spill file to remove, and the tensor bytes it held.
    pub(crate) file: Option<(PathBuf, usize)>,
    /// The job that finished: `Some(true)` a write, `Some(false)` a read.
    pub(crate) job: Option<bool>,
}

pub(crate) struct Scheduler {
    pub(crate) slots: HashMap<SlotId, Slot>,
    next_id: SlotId,
    offload_queue: VecDeque<SlotId>,
    restore_queue: Vec<SlotId>,
    pub(crate) host: Option<HostPool>,
    pub(crate) disk: Option<DiskTier>,
    pub(crate) spare: SparePool,
    pub(crate) counters: Counters,
    /// Bytes handed over and not yet in a tier (waiting or being written).
    pub(crate) unmoved: u64,
    writes: usize,
    reads: usize,
    /// Spill files handed to the reaper and not yet removed.
    unlinks: usize,
    scratch: Vec<SlotId>,
    pub(crate) shutdown: bool,
}

impl Scheduler {
    pub(crate) fn new(host: Option<HostPool>, disk: Option<DiskTier>, spare: SparePool) -> Self {
        Self {
            slots: HashMap::new(),
            next_id: 0,
            offload_queue: VecDeque::new(),
            restore_queue: Vec::new(),
            host,
            disk,
            spare,
            counters: Counters::default(),
            unmoved: 0,
            writes: 0,
            reads: 0,
            unlinks: 0,
            scratch: Vec::new(),
            shutdown: false,
        }
    }

    /// True when some tier's whole budget fits a tensor of `bytes`.
    pub(crate) fn could_hold(&self, bytes: usize) -> bool {
        self.host.as_ref().is_some_and(|h| h.could_hold(bytes))
            || self.disk.as_ref().is_some_and(|d| d.could_hold(bytes))
    }

    /// Adds a slot: kept in place (`resident`) or queued for offload. `device_dims`: see [`Slot::device_dims`].
    pub(crate) fn insert(
        &mut self,
        tag: TensorTag,
        data: Payload,
        dtype: DType,
        device_dims: Option<Vec<usize>>,
        resident: bool,
    ) -> SlotId {
        let id = self.next_id;
        self.next_id += 1;
        let bytes = data.bytes();
        let len = bytes / dtype.size();
        let state = if resident || bytes == 0 {
            self.counters.resident += 1;
            SlotState::Resident(data)
        } else {
            self.offload_queue.push_back(id);
            self.unmoved += bytes as u64;
            self.counters.peak_unmoved = self.counters.peak_unmoved.max(self.unmoved);
            SlotState::Waiting(data)
        };
        let slot = Slot { tag, dtype, len, bytes, state, device_dims, wanted: false, urgent: false, abandoned: false };
        self.slots.insert(id, slot);
        id
    }

    /// The next job for a worker (see the module docs for the order), or `None`.
    pub(crate) fn next_job(&mut self) -> Option<Job> {
        if self.shutdown {
            return None;
        }
        let job = self.take_restore(true).or_else(|| self.take_offload()).or_else(|| self.take_restore(false))?;
        match job {
            Job::Write { .. } => self.writes += 1,
            Job::Read { .. } => self.reads += 1,
        }
        Some(job)
    }

    /// True when no job is running and none could start now.
    pub(crate) fn is_idle(&self) -> bool {
        self.shutdown
            || (self.writes == 0
                && self.reads == 0
                && self.unlinks == 0
                && !self.offload_head_placeable()
                && !self.restore_pending())
    }

    /// True when a write is running, the head of the offload queue has room, or a spill file being removed
    /// will make room: waiting for the offload queue to shrink will end.
    pub(crate) fn offloads_progressing(&self) -> bool {
        !self.shutdown && (self.writes > 0 || self.unlinks > 0 || self.offload_head_placeable())
    }

    /// True while the disk tier has a copy back running or queued.
    pub(crate) fn disk_busy_reading(&self) -> bool {
        let reading = |s: &Slot| matches!(s.state, SlotState::MovingBack(Tier::Disk) | SlotState::OnDisk(_));
        self.slots.values().any(|s| matches!(s.state, SlotState::MovingBack(Tier::Disk)))
            || self.restore_queue.iter().any(|id| self.slots.get(id).is_some_and(reading))
    }

    /// True when the head of the offload queue waits for room.
    pub(crate) fn room_wanted(&self) -> bool {
        let head_waits = self
            .offload_queue
            .iter()
            .any(|id| self.slots.get(id).is_some_and(|s| matches!(s.state, SlotState::Waiting(_))));
        head_waits && !self.offload_head_placeable()
    }

    fn restore_pending(&self) -> bool {
        self.restore_queue.iter().any(|id| self.slots.get(id).is_some_and(|s| is_stored(&s.state)))
    }

    fn offload_head_placeable(&self) -> bool {
        let head = self.offload_queue.iter().find_map(|id| match self.slots.get(id) {
            Some(s) if matches!(s.state, SlotState::Waiting(_)) => Some(s.bytes),
            _ => None,
        });
        head.is_some_and(|bytes| self.host_has_room(bytes) || self.disk.as_ref().is_some_and(|d| d.has_room(bytes)))
    }

    fn host_has_room(&self, bytes: usize) -> bool {
        self.host.as_ref().is_some_and(|h| h.has_room(bytes))
    }

    fn take_offload(&mut self) -> Option<Job> {
        loop {
            let id = *self.offload_queue.front()?;
            let bytes = match self.slots.get(&id) {
                Some(s) if matches!(s.state, SlotState::Waiting(_)) => s.bytes,
                // Fetched, prefetched or dropped before its copy started.
                _ => {
                    self.offload_queue.pop_front();
                    continue;
                }
            };
            let host_buf = match self.host.as_mut() {
                Some(h) if h.has_room(bytes) => match h.take(bytes) {
                    Ok(buf) => buf,
                    Err(e) => {
                        self.offload_queue.pop_front();
                        self.fail_waiting(id, |tensor| match e {
                            TakeError::Map(source) => OffloadError::HostAlloc { tensor, source },
                            TakeError::Lock(source) => OffloadError::PageLock { tensor, bytes: bytes as u64, source },
                        });
                        continue;
                    }
                },
                _ => None,
            };
            let to = match host_buf {
                Some(buf) => Dest::Host(buf),
                None => match self.disk.as_mut() {
                    Some(d) if d.has_room(bytes) => {
                        d.reserve(bytes);
                        Dest::Disk { path: d.dir.file(id), mode: d.dir.mode() }
                    }
                    _ => return None,
                },
            };
            self.offload_queue.pop_front();
            let slot = self.slots.get_mut(&id)?;
            let tier = match to {
                Dest::Host(_) => Tier::Host,
                Dest::Disk { .. } => Tier::Disk,
            };
            let SlotState::Waiting(data) = mem::replace(&mut slot.state, SlotState::MovingOut(tier)) else {
                unreachable!("checked above");
            };
            return Some(Job::Write { id, tag: slot.tag.clone(), dtype: slot.dtype, data, to });
        }
    }

    fn fail_waiting(&mut self, id: SlotId, err: impl FnOnce(TensorTag) -> OffloadError) {
        if let Some(slot) = self.slots.get_mut(&id) {
            self.unmoved -= slot.bytes as u64;
            self.counters.failures += 1;
            slot.state = SlotState::Failed(err(slot.tag.clone()));
        }
    }

    fn take_restore(&mut self, urgent_only: bool) -> Option<Job> {
        let slots = &self.slots;
        self.restore_queue.retain(|id| slots.get(id).is_some_and(|s| is_stored(&s.state)));
        let pos = (0..self.restore_queue.len()).max_by_key(|&i| {
            let id = self.restore_queue[i];
            let s = &slots[&id];
            (s.urgent, s.tag.layer, id)
        })?;
        let id = self.restore_queue[pos];
        if urgent_only && !slots[&id].urgent {
            return None;
        }
        self.restore_queue.swap_remove(pos);
        let slot = self.slots.get_mut(&id)?;
        let from = match mem::replace(&mut slot.state, SlotState::Taken) {
            SlotState::InHost(buf) => {
                slot.state = SlotState::MovingBack(Tier::Host);
                Source::Host(buf)
            }
            SlotState::OnDisk(path) => {
                slot.state = SlotState::MovingBack(Tier::Disk);
                let mode = self.disk.as_ref().map_or(DiskIo::Buffered, |d| d.dir.mode());
                Source::Disk { path, mode }
            }
            _ => unreachable!("the queue was just filtered to stored slots"),
        };
        // A device tensor comes back into a buffer its copier allocates; a host one into a spare if one matches.
        let out = if slot.device_dims.is_none() { self.spare.take(slot.dtype, slot.len) } else { None };
        if out.is_none() {
            self.counters.output_allocations += 1;
        }
        let (tag, dtype, len, device_dims) = (slot.tag.clone(), slot.dtype, slot.len, slot.device_dims.clone());
        Some(Job::Read { id, tag, dtype, len, from, out, device_dims })
    }

    /// Asks for a slot's data back: restores it (ahead of time, or `urgent`ly for a waiting fetch), or cancels
    /// its offload if the copy has not started.
    pub(crate) fn want(&mut self, id: SlotId, urgent: bool) {
        let Some(slot) = self.slots.get_mut(&id) else { return };
        slot.wanted = true;
        slot.urgent |= urgent;
        match &slot.state {
            SlotState::Waiting(_) => {
                let SlotState::Waiting(data) = mem::replace(&mut slot.state, SlotState::Taken) else { unreachable!() };
                slot.state = SlotState::Ready(data);
                self.unmoved -= slot.bytes as u64;
                self.counters.cancelled += 1;
            }
            SlotState::InHost(_) | SlotState::OnDisk(_) if !self.restore_queue.contains(&id) => {
                self.restore_queue.push(id)
            }
            _ => {}
        }
    }

    /// Prefetches every live slot of layers `layer - depth .. layer` (the hint that `layer`'s backward started).
    pub(crate) fn hint_backward(&mut self, layer: usize, depth: usize) {
        let below = layer.saturating_sub(depth)..layer;
        if below.is_empty() {
            return;
        }
        // A kept scratch list: hints run once per layer per step and allocate nothing after the first.
        let mut ids = mem::take(&mut self.scratch);
        ids.extend(
            self.slots
                .iter()
                .filter(|(_, s)| below.contains(&s.tag.layer) && !s.wanted && !s.abandoned)
                .map(|(&id, _)| id),
        );
        // Oldest first, so the restore queue's ties go the same way every run.
        ids.sort_unstable();
        for &id in &ids {
            self.want(id, false);
        }
        ids.clear();
        self.scratch = ids;
    }

    /// Takes a fetched slot's contents if they are in memory: `Some(Ok)` data, `Some(Err)` the copy's error,
    /// `None` still in a tier or moving.
    pub(crate) fn take_fetched(&mut self, id: SlotId) -> Option<Result<Payload, OffloadError>> {
        let slot = self.slots.get_mut(&id)?;
        let result = match mem::replace(&mut slot.state, SlotState::Taken) {
            SlotState::Resident(data) | SlotState::Ready(data) => Ok(data),
            SlotState::Failed(err) => Err(err),
            other => {
                slot.state = other;
                return None;
            }
        };
        self.slots.remove(&id);
        Some(result)
    }

    /// The ticket of `id` is gone: free the slot wherever its data is.
    pub(crate) fn release(&mut self, id: SlotId) -> Cleanup {
        let cleanup = self.release_slot(id);
        self.unlinks += usize::from(cleanup.file.is_some());
        cleanup
    }

    fn release_slot(&mut self, id: SlotId) -> Cleanup {
        let mut cleanup = Cleanup::default();
        let Some(slot) = self.slots.get_mut(&id) else { return cleanup };
        if matches!(slot.state, SlotState::MovingOut(_) | SlotState::MovingBack(_)) {
            // The worker frees what it holds when it reports back.
            slot.abandoned = true;
            return cleanup;
        }
        match mem::replace(&mut slot.state, SlotState::Taken) {
            SlotState::MovingOut(_) | SlotState::MovingBack(_) => unreachable!("handled above"),
            SlotState::Waiting(data) => {
                self.unmoved -= slot.bytes as u64;
                cleanup.data = Some(data);
            }
            SlotState::Resident(data) | SlotState::Ready(data) => cleanup.data = Some(data),
            SlotState::InHost(buf) => {
                if let Some(h) = self.host.as_mut() {
                    h.put(buf);
                }
            }
            SlotState::OnDisk(path) => cleanup.file = Some((path, slot.bytes)),
            SlotState::Failed(_) | SlotState::Taken => {}
        }
        self.slots.remove(&id);
        cleanup
    }

    /// A job's cleanup is done.
    pub(crate) fn job_done(&mut self, writing: bool) {
        if writing {
            self.writes -= 1;
        } else {
            self.reads -= 1;
        }
    }

    /// A spill file of a tensor of `bytes` is gone: its room is free.
    pub(crate) fn file_removed(&mut self, bytes: usize) {
        if let Some(d) = self.disk.as_mut() {
            d.release(bytes);
        }
        self.unlinks -= 1;
    }

    /// Books a worker's report: the slot's new state, the tiers' room, the counters. The job still counts as
    /// running until the returned cleanup is done.
    pub(crate) fn complete(&mut self, done: Done) -> Cleanup {
        let cleanup = self.complete_slot(done);
        self.unlinks += usize::from(cleanup.file.is_some());
        cleanup
    }

    fn complete_slot(&mut self, done: Done) -> Cleanup {
        match done {
            Done::Wrote { id, to, data, took } => {
                let mut cleanup = Cleanup { job: Some(true), ..Cleanup::default() };
                let Some(slot) = self.slots.get_mut(&id) else { return cleanup };
                self.unmoved -= slot.bytes as u64;
                let state = match to {
                    Ok(landed) => {
                        let c = match landed {
                            Landed::Host(_) => &mut self.counters.host,
                            Landed::Disk(_) => &mut self.counters.disk,
                        };
                        c.bytes_out += slot.bytes as u64;
                        c.tensors_out += 1;
                        c.time_out += took;
                        match landed {
                            Landed::Host(buf) => SlotState::InHost(buf),
                            Landed::Disk(path) => SlotState::OnDisk(path),
                        }
                    }
                    Err((tier, err)) => {
                        self.counters.failures += 1;
                        // The tier's room comes back; a partial file is removed first.
                        match (tier, self.disk.as_ref()) {
                            (Tier::Disk, Some(d)) => cleanup.file = Some((d.dir.file(id), slot.bytes)),
                            _ => {
                                if let Some(h) = self.host.as_mut() {
                                    h.forget(slot.bytes);
                                }
                            }
                        }
                        SlotState::Failed(err)
                    }
                };
                slot.state = state;
                let (abandoned, wanted) = (slot.abandoned, slot.wanted);
                if abandoned {
                    let more = self.release_slot(id);
                    cleanup.file = cleanup.file.or(more.file);
                } else if wanted && !self.restore_queue.contains(&id) {
                    self.restore_queue.push(id);
                }
                cleanup.data = self.keep_spare(data);
                cleanup
            }
            Done::Read { id, result, from, took } => {
                let mut cleanup = Cleanup { job: Some(false), ..Cleanup::default() };
                let Some(slot) = self.slots.get_mut(&id) else { return cleanup };
                let c = match from {
                    Landed::Host(buf) => {
                        if let Some(h) = self.host.as_mut() {
                            h.put(buf);
                        }
                        &mut self.counters.host
                    }
                    // Read back (or found corrupt): the file has served its purpose either way.
                    Landed::Disk(path) => {
                        cleanup.file = Some((path, slot.bytes));
                        &mut self.counters.disk
                    }
                };
                match result {
                    Ok(data) => {
                        c.bytes_in += slot.bytes as u64;
                        c.tensors_in += 1;
                        c.time_in += took;
                        if slot.abandoned {
                            cleanup.data = self.keep_spare(data);
                            self.slots.remove(&id);
                        } else {
                            slot.state = SlotState::Ready(data);
                        }
                    }
                    Err(err) => {
                        self.counters.failures += 1;
                        if slot.abandoned {
                            self.slots.remove(&id);
                        } else {
                            slot.state = SlotState::Failed(err);
                        }
                    }
                }
                cleanup
            }
            Done::Panicked { id, tier, writing } => {
                let mut cleanup = Cleanup { job: Some(writing), ..Cleanup::default() };
                let Some(slot) = self.slots.get_mut(&id) else { return cleanup };
                if writing {
                    self.unmoved -= slot.bytes as u64;
                }
                // The tier's room is given back; a host buffer the job held is lost with it.
                match (tier, self.disk.as_ref()) {
                    (Tier::Disk, Some(d)) => cleanup.file = Some((d.dir.file(id), slot.bytes)),
                    _ => {
                        if let Some(h) = self.host.as_mut() {
                            h.forget(slot.bytes);
                        }
                    }
                }
                self.counters.failures += 1;
                let tensor = slot.tag.clone();
                if slot.abandoned {
                    self.slots.remove(&id);
                } else {
                    slot.state = SlotState::Failed(OffloadError::WorkerPanicked { tensor });
                }
                cleanup
            }
        }
    }
}

impl Scheduler {
    /// Keeps a host allocation the caller is done with as a spare if there is room; what is not kept is
    /// returned, to be freed outside the lock (a device buffer always is: its backend caches its own memory).
    fn keep_spare(&mut self, data: Payload) -> Option<Payload> {
        match data {
            Payload::Host(d) => self.spare.put(d).map(Payload::Host),
            device => Some(device),
        }
    }
}

fn is_stored(state: &SlotState) -> bool {
    matches!(state, SlotState::InHost(_) | SlotState::OnDisk(_))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tag::TensorKind;

    fn tag(layer: usize) -> TensorTag {
        TensorTag { layer, name: "x".into(), kind: TensorKind::Activation }
    }

    fn host(len: usize) -> Payload {
        Payload::Host(HostData::zeroed(DType::F32, len))
    }

    /// Runs every job the scheduler hands out, in order, as a worker would; returns (slot, was a write).
    fn drain(s: &mut Scheduler) -> Vec<(SlotId, bool)> {
        let mut order = Vec::new();
        while let Some(job) = s.next_job() {
            let done = match job {
                Job::Write { id, data, to: Dest::Host(buf), .. } => {
                    order.push((id, true));
                    Done::Wrote { id, to: Ok(Landed::Host(buf)), data, took: Duration::ZERO }
                }
                Job::Read { id, dtype, len, from: Source::Host(buf), .. } => {
                    order.push((id, false));
                    let data = Payload::Host(HostData::zeroed(dtype, len));
                    Done::Read { id, result: Ok(data), from: Landed::Host(buf), took: Duration::ZERO }
                }
                _ => unreachable!("host-only scheduler"),
            };
            let cleanup = s.complete(done);
            if let Some((_, bytes)) = cleanup.file {
                s.file_removed(bytes);
            }
            if let Some(writing) = cleanup.job {
                s.job_done(writing);
            }
        }
        order
    }

    #[test]
    fn a_waiting_fetch_goes_first_then_offloads_then_prefetches_from_the_top_layer_down() {
        let mut s = Scheduler::new(Some(HostPool::new(64 << 20, None)), None, SparePool::new(0));
        let ids: Vec<_> = (0..5).map(|l| s.insert(tag(l), host(1000), DType::F32, None, false)).collect();
        assert_eq!(drain(&mut s), ids.iter().map(|&i| (i, true)).collect::<Vec<_>>(), "offloads in order");
        // Prefetches of layers 1, 3 and 2 (in that order), a fetch of layer 0 waiting, and a new offload.
        s.want(ids[1], false);
        s.want(ids[3], false);
        s.want(ids[2], false);
        s.want(ids[0], true);
        let late = s.insert(tag(4), host(1000), DType::F32, None, false);
        let order = drain(&mut s);
        assert_eq!(order, [(ids[0], false), (late, true), (ids[3], false), (ids[2], false), (ids[1], false)]);
        assert!(s.is_idle());
    }

    #[test]
    fn within_a_layer_the_latest_offload_comes_back_first() {
        let mut s = Scheduler::new(Some(HostPool::new(64 << 20, None)), None, SparePool::new(0));
        let ids: Vec<_> = (0..3).map(|_| s.insert(tag(2), host(10), DType::F32, None, false)).collect();
        drain(&mut s);
        s.hint_backward(3, 1);
        let order: Vec<_> = drain(&mut s).into_iter().map(|(id, _)| id).collect();
        assert_eq!(order, [ids[2], ids[1], ids[0]]);
    }
}
