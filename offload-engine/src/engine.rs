//! [`OffloadEngine`]: the caller's side. Every call takes the lock, asks the [`Scheduler`], wakes workers.

use std::borrow::Cow;
use std::marker::PhantomData;
use std::mem;
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Instant;

use crate::device::DeviceCopier;
use crate::error::{OffloadError, Result};
use crate::memory::{Memory, Offloadable, Payload, Tensor};
use crate::pool::HostPool;
use crate::scheduler::{DiskTier, Scheduler};
use crate::shared::{Policy, Shared};
use crate::slot::SlotState;
use crate::spare::SparePool;
use crate::spill::DiskIo;
use crate::stats::OffloadStats;
use crate::tag::{Activation, Kind, TensorTag, Weights};
use crate::tensor::HostTensor;
use crate::ticket::Ticket;
use crate::worker;

/// Moves tensors out of the caller's memory into tiers, on background workers, and back (see the crate docs).
///
/// `OffloadEngine` is `Send + Sync`: tensors can be offloaded and fetched from several threads at once.
/// Dropping it finishes the copies in progress, stops the workers and frees both tiers: the host pool's
/// buffers are unmapped and the spill directory is removed. Tickets still alive can then only be dropped.
pub struct OffloadEngine {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    reaper: Option<JoinHandle<()>>,
}

impl OffloadEngine {
    pub(crate) fn start(
        host: Option<HostPool>,
        disk: Option<DiskTier>,
        spare: SparePool,
        policy: Policy,
        copier: Option<Arc<dyn DeviceCopier>>,
        workers: usize,
    ) -> Result<Self> {
        let spill_dir = disk.as_ref().map(|d| d.dir.path().to_owned());
        let disk_io = disk.as_ref().map(|d| d.dir.mode());
        let shared = Arc::new(Shared {
            sched: Mutex::new(Scheduler::new(host, disk, spare)),
            work: Condvar::new(),
            done: Condvar::new(),
            policy,
            spill_dir,
            disk_io,
            copier,
            reaper: Mutex::new(None),
        });
        let mut engine = Self { shared, workers: Vec::with_capacity(workers), reaper: None };
        let (tx, rx) = mpsc::channel();
        let shared = Arc::clone(&engine.shared);
        let reaper =
            thread::Builder::new().name("longctx-offload-reaper".into()).spawn(move || worker::reap(shared, rx));
        engine.reaper = Some(reaper.map_err(OffloadError::Spawn)?);
        *engine.shared.reaper.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
        for i in 0..workers {
            let shared = Arc::clone(&engine.shared);
            let spawned =
                thread::Builder::new().name(format!("longctx-offload-{i}")).spawn(move || worker::run(shared));
            // On failure, dropping `engine` stops the workers already started.
            engine.workers.push(spawned.map_err(OffloadError::Spawn)?);
        }
        Ok(engine)
    }

    /// Hands `tensor`, saved by layer `layer`'s forward, to the engine and returns at once: a worker copies it
    /// into the first tier with room and then frees the caller's allocation (a host tensor's may be kept as a
    /// spare, see [`OffloadEngineBuilder::spare_bytes`](crate::OffloadEngineBuilder::spare_bytes)). Tensors of
    /// the resident layers, and empty ones, stay where they are. Blocks only under
    /// [`OffloadEngineBuilder::max_pending_bytes`](crate::OffloadEngineBuilder::max_pending_bytes).
    ///
    /// `tensor` is a [`HostTensor`] or a [`DeviceTensor`](crate::DeviceTensor) (copied by the engine's
    /// [`DeviceCopier`](crate::DeviceCopier)); the ticket's type says which, and its fetch gives back the same.
    ///
    /// Errors, handing the tensor back: [`OffloadError::TooLarge`] when no tier's whole budget could hold it,
    /// [`OffloadError::NoDeviceCopier`] for a device tensor when the engine has no copier.
    pub fn offload<T: Offloadable>(
        &self,
        layer: usize,
        name: impl Into<Cow<'static, str>>,
        tensor: T,
    ) -> Result<Ticket<Activation, T::Memory>> {
        self.offload_as(layer, name.into(), tensor.into())
    }

    /// [`OffloadEngine::offload`] for a layer's parameters, moved out after its forward and fetched back before
    /// its backward: the same tiers, budgets and prefetch, another kind of ticket.
    pub fn offload_weights<T: Offloadable>(
        &self,
        layer: usize,
        name: impl Into<Cow<'static, str>>,
        tensor: T,
    ) -> Result<Ticket<Weights, T::Memory>> {
        self.offload_as(layer, name.into(), tensor.into())
    }

    fn offload_as<K: Kind, M: Memory>(
        &self,
        layer: usize,
        name: Cow<'static, str>,
        tensor: Tensor,
    ) -> Result<Ticket<K, M>> {
        let tag = TensorTag { layer, name, kind: K::KIND };
        if matches!(tensor, Tensor::Device(_)) && self.shared.copier.is_none() {
            return Err(OffloadError::NoDeviceCopier { tensor: tag, returned: Box::new(tensor) });
        }
        let (data, dtype, dims) = tensor.into_payload();
        let bytes = data.bytes();
        let device_dims = matches!(data, Payload::Device(_)).then(|| dims.clone());
        let resident = self.shared.policy.resident_from.is_some_and(|from| layer >= from) || bytes == 0;
        let mut sched = self.shared.lock();
        if !resident && !sched.could_hold(bytes) {
            let returned = Box::new(Tensor::from_payload(data, dtype, dims));
            return Err(OffloadError::TooLarge { tensor: tag, bytes: bytes as u64, returned });
        }
        if let (Some(limit), false) = (self.shared.policy.max_pending, resident) {
            let start = Instant::now();
            let mut waited = false;
            while sched.unmoved > 0 && sched.unmoved + bytes as u64 > limit && sched.offloads_progressing() {
                waited = true;
                sched = self.shared.wait_done(sched);
            }
            if waited {
                sched.counters.offload_wait += start.elapsed();
            }
        }
        let slot = sched.insert(tag.clone(), data, dtype, device_dims, resident);
        drop(sched);
        if !resident {
            self.shared.work.notify_one();
        }
        Ok(Ticket { slot, tag, dtype, dims, bytes, engine: Arc::clone(&self.shared), kind: PhantomData })
    }

    /// Starts bringing `ticket`'s tensor back, so that its `fetch` does not wait. A tensor whose copy out has
    /// not started is not copied at all. Errors: [`OffloadError::ForeignTicket`].
    pub fn prefetch<K: Kind, M: Memory>(&self, ticket: &Ticket<K, M>) -> Result<()> {
        self.check_owner(ticket)?;
        self.shared.lock().want(ticket.slot, false);
        self.shared.work.notify_all();
        // A cancelled offload lowers the pending bytes that `offload` may be waiting on.
        self.shared.done.notify_all();
        Ok(())
    }

    /// The LIFO prefetch hint: layer `layer`'s backward has started, so the tensors of the
    /// [`prefetch_depth`](crate::OffloadEngineBuilder::prefetch_depth) layers below it are needed next and are brought
    /// back (the highest layer first). Fetching a tensor of `layer` gives the same hint.
    pub fn backward_started(&self, layer: usize) {
        self.shared.lock().hint_backward(layer, self.shared.policy.prefetch_depth);
        self.shared.work.notify_all();
        self.shared.done.notify_all();
    }

    /// Waits until `ticket`'s tensor is back in memory and returns it, bit-exact, with its dims; the slot is
    /// freed. The time spent waiting is [`OffloadStats::fetch_wait`]. Also the hint
    /// [`backward_started`](OffloadEngine::backward_started)`(ticket.layer())`.
    ///
    /// A device tensor comes back in a new buffer from the engine's [`DeviceCopier`](crate::DeviceCopier), its
    /// bytes in place for any work the caller orders after this call.
    ///
    /// Errors: the copy's, if it failed ([`OffloadError::Corrupt`] when a spill file does not hold what was
    /// written, [`OffloadError::DiskFull`], [`OffloadError::Io`], [`OffloadError::DeviceCopy`]);
    /// [`OffloadError::ForeignTicket`].
    pub fn fetch<K: Kind, M: Memory>(&self, mut ticket: Ticket<K, M>) -> Result<M::Tensor> {
        self.check_owner(&ticket)?;
        let start = Instant::now();
        let mut sched = self.shared.lock();
        sched.counters.fetches += 1;
        sched.hint_backward(ticket.tag.layer, self.shared.policy.prefetch_depth);
        let mut waited = false;
        let result = loop {
            // First: it may turn a tensor whose copy has not started into one that is ready.
            sched.want(ticket.slot, true);
            if let Some(result) = sched.take_fetched(ticket.slot) {
                break result;
            }
            assert!(sched.slots.contains_key(&ticket.slot), "the slot of a live ticket is gone");
            self.shared.work.notify_all();
            waited = true;
            sched = self.shared.wait_done(sched);
        };
        if waited {
            sched.counters.fetches_waited += 1;
            sched.counters.fetch_wait += start.elapsed();
        }
        drop(sched);
        self.shared.work.notify_all();
        self.shared.done.notify_all();
        // The slot is gone, so dropping the ticket now frees nothing twice.
        let dims = mem::take(&mut ticket.dims);
        let tensor = Tensor::from_payload(result?, ticket.dtype, dims);
        // A ticket of `M` is made only from a tensor in `M` (`offload_as`), and its data comes back to `M`.
        Ok(M::from_tensor(tensor).unwrap_or_else(|_| unreachable!("a ticket's tensor came back in another memory")))
    }

    /// Gives a tensor the caller is done with (for instance one it fetched, after the layer's backward) to the
    /// pool of spare allocations that fetches draw from; dropped if the pool is full
    /// ([`OffloadEngineBuilder::spare_bytes`](crate::OffloadEngineBuilder::spare_bytes)).
    pub fn recycle(&self, tensor: HostTensor) {
        let (data, _) = tensor.into_parts();
        let rejected = self.shared.lock().spare.put(data);
        drop(rejected);
    }

    /// Waits until no copy is running and none can start: every offload has landed or waits for room, and
    /// every prefetch is back.
    pub fn sync(&self) {
        let mut sched = self.shared.lock();
        while !sched.is_idle() {
            sched = self.shared.wait_done(sched);
        }
    }

    /// A snapshot of the statistics.
    pub fn stats(&self) -> OffloadStats {
        OffloadStats::snapshot(&self.shared.lock())
    }

    /// This engine's spill directory (a private subdirectory of the disk tier's), if it has a disk tier.
    pub fn spill_dir(&self) -> Option<&std::path::Path> {
        self.shared.spill_dir.as_deref()
    }

    /// How the disk tier does its I/O, if there is one.
    pub fn disk_io(&self) -> Option<DiskIo> {
        self.shared.disk_io
    }

    fn check_owner<K: Kind, M: Memory>(&self, ticket: &Ticket<K, M>) -> Result<()> {
        if Arc::ptr_eq(&ticket.engine, &self.shared) {
            Ok(())
        } else {
            Err(OffloadError::ForeignTicket { tensor: ticket.tag.clone() })
        }
    }
}

impl std::fmt::Debug for OffloadEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadEngine")
            .field("workers", &self.workers.len())
            .field("spill_dir", &self.shared.spill_dir)
            .field("disk_io", &self.shared.disk_io)
            .finish_non_exhaustive()
    }
}

impl Drop for OffloadEngine {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        self.shared.done.notify_all();
        for w in self.workers.drain(..) {
            // A worker that panicked outside a job has nothing left to clean up.
            let _ = w.join();
        }
        // The reaper removes what it was sent, then stops.
        drop(self.shared.reaper.lock().unwrap_or_else(|e| e.into_inner()).take());
        if let Some(r) = self.reaper.take() {
            let _ = r.join();
        }
        let mut sched = self.shared.lock();
        for slot in sched.slots.values_mut() {
            if matches!(slot.state, SlotState::InHost(_) | SlotState::OnDisk(_)) {
                slot.state = SlotState::Taken;
            }
        }
        let (host, disk) = (sched.host.take(), sched.disk.take());
        drop(sched);
        // Unmaps the pool and removes the spill directory, files included.
        drop((host, disk));
    }
}
