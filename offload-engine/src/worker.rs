//! A worker thread: takes the scheduler's next job under the lock, does the copy without it, reports back.
//!
//! Spill files are removed by a thread of their own, the reaper ([`reap`]).
//!
//! Each worker keeps two page-aligned staging buffers for direct I/O ([`file::Staging`]), mapped on its first
//! disk job and kept until the engine is dropped.

use std::io;
use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use crate::aligned::{advise_hugepages, as_unfilled, fill};
use crate::device::{DeviceBuffer, DeviceCopier};
use crate::error::OffloadError;
use crate::location::Tier;
use crate::memory::Payload;
use crate::scheduler::{Dest, Done, Job, Landed, Source};
use crate::shared::Shared;
use crate::spill::file;
use crate::tag::TensorTag;
use crate::tensor::{DType, HostData};

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
        let copier = shared.copier.as_deref();
        let done = panic::catch_unwind(AssertUnwindSafe(|| execute(job, &mut staging, copier)))
            .unwrap_or(Done::Panicked { id, tier, writing });
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

fn execute(job: Job, staging: &mut file::Staging, copier: Option<&dyn DeviceCopier>) -> Done {
    let start = Instant::now();
    match job {
        Job::Write { id, tag, dtype, data, to } => {
            let to = match to {
                Dest::Host(mut buf) => {
                    let dst = &mut buf.as_mut_slice()[..data.bytes()];
                    let copied = match &data {
                        Payload::Host(h) => {
                            dst.copy_from_slice(h.as_bytes());
                            Ok(())
                        }
                        Payload::Device(d) => device(copier, &tag).and_then(|c| {
                            c.download(&**d, dst)
                                .map_err(|source| OffloadError::DeviceCopy { tensor: tag.clone(), source })
                        }),
                    };
                    // On failure the buffer is unmapped here and booked as lost (`HostPool::forget`).
                    copied.map(|()| Landed::Host(buf)).map_err(|e| (Tier::Host, e))
                }
                Dest::Disk { path, mode } => {
                    let written = match &data {
                        Payload::Host(h) => file::write(&path, mode, &tag, dtype, h.as_bytes(), staging),
                        Payload::Device(d) => match d.host_bytes() {
                            Some(in_place) => file::write(&path, mode, &tag, dtype, in_place, staging),
                            None => download_staged(copier, &tag, &**d)
                                .and_then(|staged| file::write(&path, mode, &tag, dtype, staged.bytes(), staging)),
                        },
                    };
                    written.map(|()| Landed::Disk(path)).map_err(|e| (Tier::Disk, e))
                }
            };
            Done::Wrote { id, to, data, took: start.elapsed() }
        }
        Job::Read { id, tag, dtype, len, from, out: _, device_dims: Some(dims) } => {
            let result = read_to_device(copier, &tag, dtype, &dims, len * dtype.size(), &from, staging);
            Done::Read { id, result: result.map(Payload::Device), from: landed(from), took: start.elapsed() }
        }
        Job::Read { id, tag, dtype, len, from, out, device_dims: None } => {
            // A destination the caller handed over holds data already; a fresh one is filled without being zeroed.
            let fresh = out.is_none();
            let mut out = out.unwrap_or_else(|| HostData::unfilled(dtype, len));
            let dst = if fresh { out.unfilled_bytes(len) } else { as_unfilled(out.as_bytes_mut()) };
            if fresh {
                advise_hugepages(dst);
            }
            let result = match &from {
                Source::Host(buf) => {
                    let n = dst.len();
                    fill(dst, &buf.as_slice()[..n]);
                    Ok(())
                }
                Source::Disk { path, mode } => file::read(path, *mode, &tag, dtype, dst, staging),
            };
            if fresh && result.is_ok() {
                // SAFETY: the copy, or a read that returned `Ok`, wrote all of `unfilled_bytes(len)`.
                unsafe { out.assume_filled(len) };
            }
            Done::Read { id, result: result.map(|()| Payload::Host(out)), from: landed(from), took: start.elapsed() }
        }
    }
}

fn landed(from: Source) -> Landed {
    match from {
        Source::Host(buf) => Landed::Host(buf),
        Source::Disk { path, .. } => Landed::Disk(path),
    }
}

/// The engine's copier, which every device tensor's engine has (`offload` refuses one without it).
fn device<'c>(copier: Option<&'c dyn DeviceCopier>, tag: &TensorTag) -> Result<&'c dyn DeviceCopier, OffloadError> {
    copier.ok_or_else(|| OffloadError::DeviceCopy { tensor: tag.clone(), source: io::Error::other("no device copier") })
}

/// A device tensor's bytes in a host buffer of their own, for a spill file.
fn download_staged(
    copier: Option<&dyn DeviceCopier>,
    tag: &TensorTag,
    d: &dyn DeviceBuffer,
) -> Result<Staged, OffloadError> {
    let c = device(copier, tag)?;
    let mut staged = Staged::new(d.size_bytes());
    c.download(d, staged.bytes_mut()).map_err(|source| OffloadError::DeviceCopy { tensor: tag.clone(), source })?;
    Ok(staged)
}

/// A stored tensor back into a new device buffer of `dims`: one copy from the host tier; from the disk tier
/// straight into the buffer when the CPU can write it, else through one staging buffer.
fn read_to_device(
    copier: Option<&dyn DeviceCopier>,
    tag: &TensorTag,
    dtype: DType,
    dims: &[usize],
    bytes: usize,
    from: &Source,
    staging: &mut file::Staging,
) -> Result<Box<dyn DeviceBuffer>, OffloadError> {
    let c = device(copier, tag)?;
    let copy_err = |source| OffloadError::DeviceCopy { tensor: tag.clone(), source };
    let mut dst = c.alloc(dtype, dims).map_err(copy_err)?;
    if dst.size_bytes() != bytes {
        let reason = format!("the copier allocated {} bytes for a tensor of {bytes}", dst.size_bytes());
        return Err(copy_err(io::Error::other(reason)));
    }
    match from {
        Source::Host(buf) => c.upload(&buf.as_slice()[..bytes], &mut *dst).map_err(copy_err)?,
        Source::Disk { path, mode } => match dst.host_bytes_mut() {
            Some(in_place) => file::read(path, *mode, tag, dtype, as_unfilled(in_place), staging)?,
            None => {
                let mut staged = Staged::new(bytes);
                file::read(path, *mode, tag, dtype, as_unfilled(staged.bytes_mut()), staging)?;
                c.upload(staged.bytes(), &mut *dst).map_err(copy_err)?;
            }
        },
    }
    Ok(dst)
}

/// A host buffer for a device tensor on its way to or from a spill file, aligned for any element type (the
/// [`DeviceCopier`] contract: every buffer the engine hands a copier is).
struct Staged {
    words: Vec<u64>,
    len: usize,
}

impl Staged {
    fn new(len: usize) -> Self {
        Self { words: vec![0; len.div_ceil(8)], len }
    }

    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}
