//! The entry point: [`ContextParallel`] (a communicator, a backend and a configuration, owned, so a model can
//! hold it), planned once per problem ([`CpShape`](crate::CpShape), [`CpMask`](crate::CpMask)) into a
//! [`CpPlan`](crate::CpPlan) by [`ContextParallel::plan`] (in `plan.rs`, beside the plan).

use std::sync::Arc;

use longctx_kernels::Backend;
use longctx_p2p::Communicator;

use crate::agree::agree_on_schedule;
use crate::config::{CpConfig, Schedule};
use crate::error::{Result, RingError};
use crate::partition::SeqLayout;

/// Context-parallel attention over a communicator, on a backend. It owns both (the communicator as an `Arc`,
/// so a model struct can hold it beside everything else) and is planned once per problem with
/// [`ContextParallel::plan`]; the plan runs the forward and backward.
///
/// Construction is collective (the ranks check that they chose the same schedule, and the hybrid and Ulysses
/// schedules split the communicator): every rank calls [`ContextParallel::new`] with the same config, and then
/// [`ContextParallel::plan`] with the same shape and mask, which checks that they agree on the rest. Cloning is cheap (shared handles); a plan holds a clone, so a model can
/// own its `ContextParallel` and its plans side by side.
#[derive(Clone)]
pub struct ContextParallel {
    pub(crate) comm: Arc<Communicator>,
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) cfg: CpConfig,
    /// For Ulysses and hybrid: (all-to-all group, ring across groups).
    pub(crate) groups: Option<Arc<(Communicator, Communicator)>>,
}

impl std::fmt::Debug for ContextParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextParallel")
            .field("rank", &self.comm.rank())
            .field("world", &self.comm.world_size())
            .field("backend", &self.backend.name())
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl ContextParallel {
    /// Checks the configuration against the communicator and sets up sub-communicators (collective: ranks that
    /// chose different schedules all fail with [`RingError::RanksDisagree`] naming `schedule`).
    pub fn new(comm: impl Into<Arc<Communicator>>, backend: Arc<dyn Backend>, cfg: CpConfig) -> Result<Self> {
        let comm = comm.into();
        let n = comm.world_size();
        let group = match cfg.schedule {
            Schedule::Ulysses => Some(n),
            Schedule::Hybrid { group } => {
                if group == 0 || !n.is_multiple_of(group) {
                    return Err(RingError::GroupSize { group, world: n });
                }
                Some(group)
            }
            Schedule::AllGather { kv_heads_per_step: 0 } => return Err(RingError::ZeroKvHeadsPerStep),
            _ => None,
        };
        if let Some(s) = cfg.scale {
            if !(s.is_finite() && s > 0.0) {
                return Err(RingError::Scale(s));
            }
        }
        // Before the split, which only the all-to-all schedules make: a rank that split while a peer went on to
        // plan would meet a collective of another size and fail as a bare mismatch, not naming the schedule.
        agree_on_schedule(&comm, cfg.schedule)?;
        let groups = match group {
            Some(u) => {
                let r = comm.rank();
                // Groups of `u` consecutive ranks share an all-to-all; ranks with the same index in their group
                // form a ring, ordered by group.
                let inner = comm.split((r / u) as u32, r as u32)?;
                let outer = comm.split((r % u) as u32, r as u32)?;
                Some(Arc::new((inner, outer)))
            }
            None => None,
        };
        Ok(Self { comm, backend, cfg, groups })
    }

    /// The communicator.
    pub fn comm(&self) -> &Arc<Communicator> {
        &self.comm
    }
    /// The backend the kernels run on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }
    /// The configuration.
    pub fn config(&self) -> &CpConfig {
        &self.cfg
    }

    /// The layout of a sequence of `seq_len` tokens over this communicator.
    pub fn layout(&self, seq_len: usize) -> Result<SeqLayout> {
        SeqLayout::new(self.cfg.partition, self.comm.world_size(), seq_len)
    }

    pub(crate) fn measured_bytes(&self) -> u64 {
        let mut b = self.comm.stats().bytes_sent;
        if let Some(g) = &self.groups {
            b += g.0.stats().bytes_sent + g.1.stats().bytes_sent;
        }
        b
    }
}
