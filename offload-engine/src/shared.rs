//! What the engine, its workers and its tickets share: the [`Scheduler`] under its lock, the condition variables
//! that wake workers and waiting callers, and the policy the engine's calls apply.

use std::path::PathBuf;
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};

use crate::device::DeviceCopier;

use crate::location::Location;
use crate::scheduler::{Cleanup, Scheduler};
use crate::slot::SlotId;
use crate::spill::DiskIo;

/// The options the engine's calls apply (the rest went into the tiers).
pub(crate) struct Policy {
    pub(crate) prefetch_depth: usize,
    /// Layers from this one on stay resident.
    pub(crate) resident_from: Option<usize>,
    pub(crate) max_pending: Option<u64>,
}

/// What the engine, its workers and its tickets share.
pub(crate) struct Shared {
    pub(crate) sched: Mutex<Scheduler>,
    /// Wakes workers: a job may be ready.
    pub(crate) work: Condvar,
    /// Wakes callers: a job finished.
    pub(crate) done: Condvar,
    pub(crate) policy: Policy,
    pub(crate) spill_dir: Option<PathBuf>,
    pub(crate) disk_io: Option<DiskIo>,
    /// Copies device tensors in and out (see [`crate::DeviceCopier`]).
    pub(crate) copier: Option<Arc<dyn DeviceCopier>>,
    /// Files for the reaper thread; `None` once the engine is dropped.
    pub(crate) reaper: Mutex<Option<mpsc::Sender<(PathBuf, usize)>>>,
}

impl Shared {
    /// The scheduler. A panic while it was held (a bug) does not stop the others: its state is still
    /// consistent, every change to it being made before anything that could panic.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Scheduler> {
        self.sched.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn wait_done<'a>(&self, guard: MutexGuard<'a, Scheduler>) -> MutexGuard<'a, Scheduler> {
        self.done.wait(guard).unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn location(&self, id: SlotId) -> Location {
        self.lock().slots.get(&id).map_or(Location::Ready, |s| s.location())
    }

    /// A ticket was dropped.
    pub(crate) fn release(&self, id: SlotId) {
        let cleanup = self.lock().release(id);
        self.finish(cleanup);
    }

    /// Does a [`Cleanup`] outside the lock: frees the memory, hands the file to the reaper (or removes it here
    /// once the engine is gone), books the job as over, and wakes whoever waits for room or for idleness.
    pub(crate) fn finish(&self, cleanup: Cleanup) {
        let Cleanup { data, file, job } = cleanup;
        drop(data);
        if let Some(file) = file {
            let unsent = match self.reaper.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                Some(tx) => tx.send(file).err().map(|e| e.0),
                None => Some(file),
            };
            // No reaper: the engine is gone (and its directory with it, so this is quick).
            if let Some((path, bytes)) = unsent {
                let _ = std::fs::remove_file(&path);
                self.lock().file_removed(bytes);
            }
        }
        if let Some(writing) = job {
            self.lock().job_done(writing);
        }
        self.work.notify_all();
        self.done.notify_all();
    }
}
