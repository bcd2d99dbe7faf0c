//! A worker thread: takes the scheduler's next job under the lock, does the copy without it, reports back.
//!
//! Spill files are removed by a thread of their own, the reaper ([`reap`]).
//!
//! Each worker keeps two page-aligned staging buffers for direct I/O ([`file::Staging`]), mapped on its first
//! disk job and kept until the engine is dropped.

use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use crate::aligned::{advise_hugepages, as_unfilled, fill};
use crate::location::Tier;
use crate::scheduler::{Dest, Done, Job, Landed, Source};
use crate::shared::Shared;
use crate::spill::file;
use crate::tensor::HostData;

pub(crate) fn run(shared: Arc<Shared>) {
    let mut staging = file::Staging::default();
    let mut sched = shared.lock();
    loop {
        let failures = sched.counters.failures;
        let job = sched.next_job();
        if sched.counters.failures != failures {
            // Taking the job failed a tensor that never reached a tier (no host buffer could be mapped or
            // locked): a fetch or `sync` may be waiting for it.
            shared.done.notify_all();
        }
        let Some(job) = job else {
            if sched.shutdown {
                return;
            }
            sched = shared.work.wait(sched).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        drop(sched);
        let (id, tier, writing) = describe(&job);
        let done = panic::catch_unwind(AssertUnwindSafe(|| execute(job, &mut staging))).unwrap_or(Done::Panicked {
            id,
            tier,
            writing,
        });
        sched = shared.lock();
        let cleanup = sched.complete(done);
        // A fetch may be waiting for this one.
        shared.done.notify_all();
        drop(sched);
        shared.finish(cleanup);
        sched = shared.lock();
    }
}

/// The reaper thread: removes spill files off the workers' and callers' paths, then gives their room back.
///
/// Removing a file is not free: on ext4 with online discard a 64 MiB file took 64 ms to remove, twice as long
/// as reading it back, and removals running beside reads halved their speed. So a removal waits while the
/// disk tier is reading (a copy back running or queued), unless an offload is waiting for room. `sync` waits
/// for removals too, so after it every file is gone.
pub(crate) fn reap(shared: Arc<Shared>, files: Receiver<(PathBuf, usize)>) {
    for (path, bytes) in files {
        let mut sched = shared.lock();
        while !sched.shutdown && sched.disk_busy_reading() && !sched.room_wanted() {
            sched = shared.done.wait(sched).unwrap_or_else(|e| e.into_inner());
        }
        drop(sched);
        // Already gone when the engine was dropped (its directory went with it).
        let _ = std::fs::remove_file(&path);
        shared.lock().file_removed(bytes);
        shared.work.notify_all();
        shared.done.notify_all();
    }
}

fn describe(job: &Job) -> (u64, Tier, bool) {
    match job {
        Job::Write { id, to: Dest::Host(_), .. } => (*id, Tier::Host, true),
        Job::Write { id, to: Dest::Disk { .. }, .. } => (*id, Tier::Disk, true),
        Job::Read { id, from: Source::Host(_), .. } => (*id, Tier::Host, false),
        Job::Read { id, from: Source::Disk { .. }, .. } => (*id, Tier::Disk, false),
    }
}

fn execute(job: Job, staging: &mut file::Staging) -> Done {
    let start = Instant::now();
    match job {
        Job::Write { id, tag, data, to } => {
            let bytes = data.as_bytes();
            let to = match to {
                Dest::Host(mut buf) => {
                    buf.as_mut_slice()[..bytes.len()].copy_from_slice(bytes);
                    Ok(Landed::Host(buf))
                }
                Dest::Disk { path, mode } => match file::write(&path, mode, &tag, data.dtype(), bytes, staging) {
                    Ok(()) => Ok(Landed::Disk(path)),
                    Err(e) => Err((Tier::Disk, e)),
                },
            };
            Done::Wrote { id, to, data, took: start.elapsed() }
        }
        Job::Read { id, tag, dtype, len, from, out } => {
            // A destination the caller handed over holds data already; a fresh one is filled without being zeroed.
            let fresh = out.is_none();
            let mut out = out.unwrap_or_else(|| HostData::unfilled(dtype, len));
            let dst = if fresh { out.unfilled_bytes(len) } else { as_unfilled(out.as_bytes_mut()) };
            if fresh {
                advise_hugepages(dst);
            }
            let (result, from) = match from {
                Source::Host(buf) => {
                    let n = dst.len();
                    fill(dst, &buf.as_slice()[..n]);
                    (Ok(()), Landed::Host(buf))
                }
                Source::Disk { path, mode } => {
                    let r = file::read(&path, mode, &tag, dtype, dst, staging);
                    (r, Landed::Disk(path))
                }
            };
            if fresh && result.is_ok() {
                // SAFETY: the copy, or a read that returned `Ok`, wrote all of `unfilled_bytes(len)`.
                unsafe { out.assume_filled(len) };
            }
            Done::Read { id, result: result.map(|()| out), from, took: start.elapsed() }
        }
    }
}
