//! `longctx-offload`: moving saved activations and inactive weights out of the caller's memory between a layer's
//! forward and its backward, and back in time for it.
//!
//! It owns two tiers, each with a byte budget that is never exceeded: **host**, a pool of reusable page-aligned
//! buffers keyed by size class, and **disk**, spill files in a private directory on local storage, written with
//! large aligned (`O_DIRECT`) writes where the filesystem allows it. Background workers do the copies; the
//! backward's reverse order drives prefetch. It depends on no other longctx crate.
//!
//! Main types:
//! - [`OffloadEngine`], from [`OffloadEngine::builder`]: [`offload`](OffloadEngine::offload) returns a
//!   [`Ticket`] at once, [`prefetch`](OffloadEngine::prefetch) starts the copy back,
//!   [`fetch`](OffloadEngine::fetch) waits for it and returns the tensor bit-exact,
//!   [`backward_started`](OffloadEngine::backward_started) is the LIFO prefetch hint.
//! - [`HostTensor`]: what is handed over and given back, an owned `Vec` of `f32`, `bf16` or `f16` with dims;
//!   or a [`DeviceTensor`], a buffer in a device's memory that the engine's [`DeviceCopier`] moves straight
//!   into a host tier buffer and back (one copy each way).
//! - [`Ticket`]: tagged with a layer and a name ([`TensorTag`]), carrying dtype and dims, typed by what it holds
//!   ([`Activation`] or [`Weights`]) and where it came from ([`Host`] or [`Device`], so a fetch gives back the
//!   same kind of tensor); consumed by `fetch`, freed when dropped.
//! - [`DType`]: the element type, the same one the kernels crate uses (`longctx-dtype`).
//! - [`OffloadStats`]: bytes moved and peak use per tier, time waited in `fetch`.
//! - [`OffloadError`]: typed errors; those about a tensor name it.
//!
//! ```
//! use longctx_offload::{HostTensor, Location, OffloadEngine, Tier};
//!
//! let dir = tempfile::tempdir()?;
//! let engine = OffloadEngine::builder()
//!     .host_tier(1 << 20) // 1 MiB of host buffers ...
//!     .disk_tier(dir.path(), 64 << 20) // ... then up to 64 MiB of spill files
//!     .workers(2)
//!     .prefetch_depth(1)
//!     .build()?;
//!
//! // Forward: each layer offloads what it saved (here 256 KiB per layer: four fit in the host tier).
//! let mut saved = Vec::new();
//! for layer in 0..6 {
//!     let x: Vec<f32> = (0..65536).map(|i| (layer * 65536 + i) as f32).collect();
//!     saved.push(engine.offload(layer, "x", HostTensor::f32(x, [256, 256])?)?);
//! }
//! engine.sync();
//! assert_eq!(saved[0].location(), Location::In(Tier::Host));
//! assert_eq!(saved[5].location(), Location::In(Tier::Disk)); // the host tier was full: spilled
//!
//! // Backward, in reverse: fetching layer k's tensor prefetches layer k-1's.
//! while let Some(ticket) = saved.pop() {
//!     let layer = ticket.layer();
//!     let x = engine.fetch(ticket)?.into_f32().expect("an f32 tensor");
//!     assert_eq!(x[0], (layer * 65536) as f32);
//! }
//! let stats = engine.stats();
//! assert!(stats.host.as_ref().is_some_and(|h| h.peak_bytes <= h.budget_bytes));
//! println!("{stats}");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # How it behaves
//!
//! - **Offload** takes the tensor by value and returns at once. Offloads are placed in the order they were
//!   made: the first tier (host, then disk) with room for the tensor gets it, its room reserved before the
//!   copy starts. When no tier has room the tensor waits in the queue, still in the caller's memory, and so
//!   does every later one, until a fetch or a dropped ticket frees room; `offload` does not block for it (only
//!   a fetch could end that wait). To bound the memory held by copies the disk has not caught up with, set
//!   [`OffloadEngineBuilder::max_pending_bytes`]: `offload` then blocks while that much is pending and the
//!   copies progress. A tensor larger than every tier's whole budget is refused ([`OffloadError::TooLarge`],
//!   which hands it back). Nothing moves between tiers once placed.
//! - **Resident layers**: [`OffloadEngineBuilder::resident_layers`] keeps the last layers' tensors where they
//!   are; the backward needs them first, so there is no round trip to wait for.
//! - **Prefetch** is driven by the backward order: fetching a tensor of layer `k` (or
//!   [`backward_started`](OffloadEngine::backward_started)`(k)`) brings back every tensor of layers
//!   `k-1 ..= k-depth`. Workers serve a waiting fetch first, then pending offloads, then prefetches from the
//!   highest layer down (the latest offload first within a layer). Prefetching or fetching a tensor whose copy
//!   has not started cancels the copy.
//! - **Memory handed over**: once a tensor's copy has landed in a tier its allocation is dropped (on a CPU-only
//!   machine, where the host tier is the same memory, that is what the disk tier is for: the process's peak
//!   memory falls by the bytes on disk, which `tests/memory.rs` measures). Whether freed memory goes back to the
//!   system is the process allocator's choice: glibc keeps allocations below its `mmap` threshold in its heap,
//!   so a process that wants its peak RSS to follow live memory maps its large buffers one by one (the
//!   `longctx` trainer's global allocator does, `longctx_trainer::alloc`); the engine leaves the process's
//!   allocator alone. With [`OffloadEngineBuilder::spare_bytes`] allocations are kept
//!   instead, up to that bound, for fetches to reuse ([`OffloadEngine::recycle`] gives back fetched tensors the
//!   same way); the default bound is zero.
//! - **No allocation per step**: host-tier buffers and direct-I/O staging buffers come from pools that keep
//!   them ([`OffloadStats::host_buffers_mapped`] stops growing after the first step); fetched tensors are
//!   allocated unless a spare matches ([`OffloadStats::fetch_allocations`]).
//! - **Disk tier**: each file carries a header and a CRC-32 of the data, checked on read: a corrupt, truncated
//!   or swapped file is [`OffloadError::Corrupt`] naming the tensor, never wrong data. Files are removed after
//!   they are read back or their ticket is dropped, by a thread of their own that waits while the disk is
//!   reading (unless an offload needs the room; [`OffloadEngine::sync`] waits for it), the directory when the
//!   engine is dropped, and leftovers of a crashed run by the next engine started on the same directory (a
//!   live engine holds a `flock`). A budget
//!   above the filesystem's free space is [`OffloadError::DiskTooSmall`] at build, a directory that cannot be
//!   created or written [`OffloadError::SpillDir`], a full disk during a write [`OffloadError::DiskFull`] at
//!   that tensor's fetch.
//! - **Direct I/O**: every spill file is written and read in 8 MiB page-aligned pieces through two staging
//!   buffers per worker with `O_DIRECT`, past the page cache; a file of several pieces is pipelined (one
//!   buffer on the device while the worker copies and checksums the other). A filesystem that refuses
//!   `O_DIRECT` (tmpfs before Linux 6.6, some network filesystems) gets buffered I/O followed by `fdatasync` and
//!   `POSIX_FADV_DONTNEED`, so the page cache does not keep the memory; [`OffloadEngine::disk_io`] says which.
//!   On tmpfs the disk tier is memory itself.
//! - **Host tier and devices**: the pool's buffers are page-aligned anonymous mappings, each page-locked once
//!   when it is mapped by the [`PageLocker`] given to [`OffloadEngineBuilder::page_lock`] ([`Mlock`]: resident,
//!   never swapped; a device backend registers them with its driver for DMA) and unlocked when it is unmapped.
//!   A host tensor is copied into them with `memcpy` on the workers; a [`DeviceTensor`] by the
//!   [`DeviceCopier`] given to [`OffloadEngineBuilder::device`], straight from device memory, and back into a
//!   buffer the copier allocates (see [`DeviceCopier`] for the ordering and the disk tier's staging). Large pool
//!   buffers and freshly allocated fetch outputs get `MADV_HUGEPAGE`, since filling fresh memory through 4 KiB
//!   page faults is several times slower than the copy itself (`bench/log/` has the figures).
//! - **Speed**: `examples/longctx-offload-bench.rs` sets each tier beside `memcpy` and plain sequential file
//!   I/O on the same sizes and directory (see its docs for what each peer is).
//!
//! # Layout
//!
//! Modules depend downwards only: `tensor` ← `device` ← `memory`, and `tag`, `location`, `aligned`,
//! `page_lock`, all ← `error` ← `pool`, `spare`, `spill/` (sys ← format ← file, dir) ← `slot` ← `scheduler`
//! (placement and job order, under the lock) ← `shared` (the scheduler's lock and the condition variables) ←
//! `worker` (the copies, outside the lock, and the reaper that removes spill files), `ticket` ← `engine` ←
//! `builder`; `stats` reads the scheduler.
#![warn(missing_docs, unsafe_op_in_unsafe_fn)]

mod aligned;
mod builder;
mod device;
mod engine;
mod error;
mod location;
mod memory;
mod page_lock;
mod pool;
mod scheduler;
mod shared;
mod slot;
mod spare;
mod spill;
mod stats;
mod tag;
mod tensor;
mod ticket;
mod worker;

pub use builder::OffloadEngineBuilder;
pub use device::{DeviceBuffer, DeviceCopier, DeviceTensor};
pub use engine::OffloadEngine;
pub use error::{OffloadError, Result};
pub use location::{Location, Tier};
pub use memory::{Device, Host, Memory, Offloadable, Tensor};
pub use page_lock::{Mlock, PageLocker};
pub use spill::DiskIo;
pub use stats::{OffloadStats, TierStats};
pub use tag::{Activation, Kind, TensorKind, TensorTag, Weights};
pub use tensor::{DType, HostTensor, ShapeMismatch};
pub use ticket::{ActivationTicket, Ticket, WeightsTicket};
