//! The engine's options, checked once by [`OffloadEngineBuilder::build`].

use std::path::PathBuf;
use std::sync::Arc;

use crate::device::DeviceCopier;
use crate::engine::OffloadEngine;
use crate::error::{OffloadError, Result};
use crate::page_lock::PageLocker;
use crate::pool::HostPool;
use crate::scheduler::DiskTier;
use crate::shared::Policy;
use crate::spare::SparePool;
use crate::spill::dir::SpillDir;

enum TierSpec {
    Host { budget: u64 },
    Disk { dir: PathBuf, budget: u64 },
}

/// Options of an [`OffloadEngine`]; from [`OffloadEngine::builder`].
///
/// Tiers are tried in the order they are added; there is at most one of each, host before disk.
#[must_use]
pub struct OffloadEngineBuilder {
    tiers: Vec<TierSpec>,
    workers: usize,
    prefetch_depth: usize,
    resident: Option<(usize, usize)>,
    spare_bytes: u64,
    max_pending_bytes: Option<u64>,
    direct_io: bool,
    page_lock: Option<Arc<dyn PageLocker>>,
    copier: Option<Arc<dyn DeviceCopier>>,
}

impl OffloadEngine {
    /// The options, to [`OffloadEngineBuilder::build`] the engine from.
    pub fn builder() -> OffloadEngineBuilder {
        OffloadEngineBuilder::default()
    }
}

impl Default for OffloadEngineBuilder {
    fn default() -> Self {
        Self {
            tiers: Vec::new(),
            workers: 2,
            prefetch_depth: 1,
            resident: None,
            spare_bytes: 0,
            max_pending_bytes: None,
            direct_io: true,
            page_lock: None,
            copier: None,
        }
    }
}

impl OffloadEngineBuilder {
    /// Adds the host tier: a pool of page-aligned buffers holding at most `budget_bytes` (idle pool buffers
    /// included).
    pub fn host_tier(mut self, budget_bytes: u64) -> Self {
        self.tiers.push(TierSpec::Host { budget: budget_bytes });
        self
    }

    /// Adds the disk tier: spill files in a private subdirectory of `dir` (created if missing; put it on local
    /// SSD or NVMe), at most `budget_bytes` of them (headers and padding included). `build` checks that the
    /// filesystem has that much free.
    pub fn disk_tier(mut self, dir: impl Into<PathBuf>, budget_bytes: u64) -> Self {
        self.tiers.push(TierSpec::Disk { dir: dir.into(), budget: budget_bytes });
        self
    }

    /// Background threads doing the copies (default 2). Each copies one tensor at a time.
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n;
        self
    }

    /// Layers to prefetch ahead in the backward (default 1): when layer `k`'s backward starts
    /// ([`OffloadEngine::backward_started`], or a fetch of one of its tensors), layers `k-1 ..= k-depth` are
    /// brought back. 0: nothing is brought back before it is fetched.
    pub fn prefetch_depth(mut self, layers: usize) -> Self {
        self.prefetch_depth = layers;
        self
    }

    /// Keeps the tensors of the last `last` of `num_layers` layers (layers `num_layers - last ..`) where they
    /// are: the backward needs them first, so a round trip would only be waited for (default: none).
    pub fn resident_layers(mut self, last: usize, num_layers: usize) -> Self {
        self.resident = Some((last, num_layers));
        self
    }

    /// Budget of the pool of spare tensor allocations that fetches draw from (default 0: every allocation
    /// handed over is freed once its copy has landed, and every fetch allocates). See [`OffloadEngine::recycle`].
    pub fn spare_bytes(mut self, bytes: u64) -> Self {
        self.spare_bytes = bytes;
        self
    }

    /// Bounds the bytes handed over whose copy has not finished (waiting or being written): `offload` blocks
    /// while taking one more tensor would go over, for as long as the copies are making progress. Without it
    /// (the default) `offload` never blocks, and a forward faster than the disk keeps the difference in memory.
    /// It does not block when no tier has room: only a fetch or a dropped ticket frees room, so it would never
    /// end; those tensors wait in memory instead. One tensor larger than the bound alone is taken when nothing
    /// else is pending.
    pub fn max_pending_bytes(mut self, bytes: u64) -> Self {
        self.max_pending_bytes = Some(bytes);
        self
    }

    /// Whether the disk tier tries `O_DIRECT` (default true). When the filesystem refuses it, or with `false`,
    /// it writes through the page cache, then `fdatasync`s and drops the cached pages.
    pub fn direct_io(mut self, on: bool) -> Self {
        self.direct_io = on;
        self
    }

    /// Page-locks every host tier buffer with `locker` when it is mapped, and unlocks it when it is unmapped
    /// (default: not locked). [`Mlock`](crate::Mlock) keeps the tier resident; a device backend's locker
    /// registers it for DMA. `build` asks the locker whether the whole host budget can be locked
    /// ([`OffloadError::PageLockBudget`]); a buffer that fails to lock later is [`OffloadError::PageLock`] at
    /// its tensor's fetch.
    pub fn page_lock(mut self, locker: impl PageLocker + 'static) -> Self {
        self.page_lock = Some(Arc::new(locker));
        self
    }

    /// Lets the engine take [`DeviceTensor`](crate::DeviceTensor)s: `copier` moves them between the device's
    /// memory and the tiers, one copy each way through the host tier (see [`DeviceCopier`]). Pair it with a
    /// [`page_lock`](OffloadEngineBuilder::page_lock) that registers the host tier with the same device, so those
    /// copies run by DMA. Default: none, and a device tensor is [`OffloadError::NoDeviceCopier`].
    pub fn device(mut self, copier: impl DeviceCopier + 'static) -> Self {
        self.copier = Some(Arc::new(copier));
        self
    }

    /// Checks the options, prepares the tiers (the disk tier's directory: see [`OffloadError::SpillDir`] and
    /// [`OffloadError::DiskTooSmall`]) and starts the workers.
    pub fn build(self) -> Result<OffloadEngine> {
        let bad = |reason| Err(OffloadError::InvalidConfig { reason });
        if self.tiers.is_empty() {
            return bad("no tier: add a host tier, a disk tier or both");
        }
        if self.workers == 0 {
            return bad("at least one worker is needed");
        }
        let (mut host, mut disk) = (None, None);
        for tier in self.tiers {
            match tier {
                TierSpec::Host { .. } if host.is_some() || disk.is_some() => {
                    return bad("the host tier must come first, and only once");
                }
                TierSpec::Disk { .. } if disk.is_some() => return bad("only one disk tier"),
                TierSpec::Host { budget: 0 } | TierSpec::Disk { budget: 0, .. } => {
                    return bad("a tier's budget must be above zero");
                }
                TierSpec::Host { budget } => {
                    if let Some(locker) = &self.page_lock {
                        locker
                            .check_budget(budget)
                            .map_err(|source| OffloadError::PageLockBudget { budget, source })?;
                    }
                    host = Some(HostPool::new(budget, self.page_lock.clone()));
                }
                TierSpec::Disk { dir, budget } => disk = Some((dir, budget)),
            }
        }
        if self.page_lock.is_some() && host.is_none() {
            return bad("page locking needs a host tier");
        }
        let resident_from = match self.resident {
            Some((last, num_layers)) if last > num_layers => {
                return bad("more resident layers than layers");
            }
            Some((last, num_layers)) if last > 0 => Some(num_layers - last),
            _ => None,
        };
        let disk = match disk {
            Some((dir, budget)) => {
                Some(DiskTier { dir: SpillDir::open(&dir, budget, self.direct_io)?, budget, used: 0, peak: 0 })
            }
            None => None,
        };
        let policy = Policy { prefetch_depth: self.prefetch_depth, resident_from, max_pending: self.max_pending_bytes };
        OffloadEngine::start(host, disk, SparePool::new(self.spare_bytes), policy, self.copier, self.workers)
    }
}
