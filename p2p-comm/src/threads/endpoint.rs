//! One rank's handle on a threads world: posting operations, and leaving.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::channel::ChannelRef;
use super::completion::{mismatch, transfer};
use super::completion::{Attachment, Completion, Outcome, Pair, State, DEFER_MIN, MATCHED};
use super::device::{self, is_device, Region, DEVICE};
use super::exchange::ExchangeOp;
use super::mailbox::Slot;
use super::mailbox_op::MailboxOp;
use super::world::{RankWorld, SplitEntry, World};
use crate::error::CommError;
use crate::op::Op;
use crate::stats::StatsCounters;
use crate::sync::lock;

/// One rank's handle on a [`World`]. Dropping it marks the rank gone.
pub(crate) struct Endpoint {
    pub(crate) world: Arc<World>,
    pub(crate) rank: usize,
    /// What this rank's operations hold: a per-rank `Arc` around the shared one, so starting and finishing an
    /// operation changes a reference count in this rank's cache only. The shared count, which every rank would
    /// change on every message, sits on a cache line (with the world's fields) that would then move between the
    /// cores twice per message.
    ops_world: Arc<RankWorld>,
    /// The exchange channels this rank used, so that finding one takes no shared lock.
    channels: Mutex<Vec<((usize, usize), ChannelRef)>>,
}

impl Endpoint {
    pub(crate) fn new(world: Arc<World>, rank: usize) -> Self {
        Self { ops_world: Arc::new(RankWorld(world.clone())), world, rank, channels: Mutex::new(Vec::new()) }
    }

    pub(crate) fn size(&self) -> usize {
        self.world.size
    }

    fn channel(&self, src: usize, dst: usize) -> ChannelRef {
        let mut cache = lock(&self.channels);
        if let Some(&(_, ch)) = cache.iter().find(|(k, _)| *k == (src, dst)) {
            return ch;
        }
        let ch = self.world.channel(src, dst);
        cache.push(((src, dst), ch));
        ch
    }

    /// Posts `op`; one direction of a ring exchange (`op.exchange`) goes through the pair's exchange channel.
    ///
    /// # Safety
    /// `op`'s buffer must stay valid (and, for a receive, unaliased) until the returned op completes, is
    /// cancelled or dropped.
    pub(crate) unsafe fn post(&self, op: &Op, stats: &Arc<StatsCounters>) -> Result<ThreadOp, CommError> {
        let Op { is_send, peer, key, meta, timeout, .. } = *op;
        let w = &self.world;
        let me = self.rank;
        // An op in device memory: its slot points at its region, its length carries the flag (see `device.rs`).
        let region = op.device.map(|end| Arc::new(Region { addr: op.ptr as u64, end }));
        let (ptr, len) = match &region {
            Some(r) => (Arc::as_ptr(r) as *mut u8, op.len | DEVICE),
            None => (op.ptr, op.len),
        };
        if op.exchange {
            if region.is_some() {
                return Err(CommError::InvalidArgument("a ring exchange of device memory (not supported)".into()));
            }
            if !w.alive[peer].load(Ordering::SeqCst) {
                return Err(w.gone_error(peer));
            }
            let ch = if is_send { self.channel(me, peer) } else { self.channel(peer, me) };
            // SAFETY: per our contract.
            let op = unsafe { ExchangeOp::post(self.ops_world.clone(), ch, me, op, stats) }?;
            return Ok(ThreadOp::Exchange(op));
        }
        let c = w.completion(me);
        let mbox = if is_send { peer } else { me };
        let mut q = lock(&w.mailboxes[mbox]);
        // The sending rank: a send matches a receive from us, a receive a send from `peer`.
        let from = if is_send { me } else { peer };
        let want = Slot::word(!is_send, from, key);
        let matched = q.take(|s| s.word == want);
        match matched {
            Some(other) => {
                drop(q);
                let (mine, theirs) = ((ptr, len, meta, &c), (other.ptr, other.len, other.meta, &other.done));
                let ((sp, sl, sm, sc), (rp, rl, rm, rc)) = if is_send { (mine, theirs) } else { (theirs, mine) };
                if is_device(sl) || is_device(rl) {
                    // SAFETY: both ops are in flight until `device_transfer` completes them (see `device::copy`).
                    unsafe { device_transfer((sp, sl, sm, sc), (rp, rl, rm, rc)) };
                } else if sl < DEFER_MIN {
                    transfer((sp, sl, sm, sc), (rp, rl, rm, rc));
                } else if let Some((so, ro)) = mismatch(sl, sm, rl, rm) {
                    sc.complete(so);
                    rc.complete(ro);
                } else {
                    let generation = rc.park(rl);
                    let attachment = Attachment { rc: *rc, sp, rp, generation };
                    let pair = Pair { sp, sc: *sc, rp, len: rl, generation };
                    if is_send {
                        // Mark our send attached before publishing the pair: once published the receiver may
                        // copy and complete us at any time, and that `Done` must not be overwritten. (No
                        // `set`: nobody waits on our completion yet, so skip the wake-up.)
                        *lock(&c.state) = State::Attached(attachment);
                        c.stage.store(MATCHED, Ordering::Release);
                        other.done.set(State::Matched(pair));
                    } else {
                        // Park the pair in our receive before telling the sender where it is (same reason).
                        c.set(State::Matched(pair));
                        // Wakes a sender blocked on this send: it may copy if we get busy elsewhere first.
                        other.done.set(State::Attached(attachment));
                    }
                }
            }
            None => {
                if !w.alive[peer].load(Ordering::SeqCst) {
                    drop(q);
                    w.recycle(me, c);
                    return Err(w.gone_error(peer));
                }
                q.push(Slot { word: Slot::word(is_send, from, key), meta, ptr, len, done: c });
            }
        }
        Ok(ThreadOp::Mailbox(MailboxOp {
            world: self.ops_world.clone(),
            me,
            peer,
            is_send,
            key,
            meta,
            len: op.len,
            timeout,
            stats: stats.clone(),
            done: Some(c),
            _region: region,
        }))
    }

    /// Collective part of `split` that is specific to threads: finds or creates the sub-world of `color`, whose
    /// members are `members` here (in their order there; every member passes the same list).
    pub(crate) fn join_split(&self, seq: u64, color: u32, members: &[usize]) -> Arc<World> {
        let mut splits = lock(&self.world.splits);
        let e = splits
            .entry((seq, color))
            .or_insert_with(|| SplitEntry { world: World::split_from(&self.world, members), remaining: members.len() });
        let world = e.world.clone();
        e.remaining -= 1;
        if e.remaining == 0 {
            splits.remove(&(seq, color));
        }
        world
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.world.endpoint_dropped(self.rank);
    }
}

/// Copies a matched message of which a side lies in device memory (or reports why not), and completes both sides.
///
/// # Safety
/// As [`device::copy`].
unsafe fn device_transfer(send: (*mut u8, usize, u64, &Completion), recv: (*mut u8, usize, u64, &Completion)) {
    let (sp, sl, sm, sc) = send;
    let (rp, rl, rm, rc) = recv;
    let (so, ro) = if let Some(o) = mismatch(device::bytes(sl), sm, device::bytes(rl), rm) {
        o
    } else {
        // SAFETY: per our contract.
        match unsafe { device::copy(sp, sl, rp, rl) } {
            Ok(()) => (Outcome::Ok, Outcome::Ok),
            Err((ordinal, reason)) => {
                let o = Outcome::DeviceCopy { ordinal, reason: reason.into() };
                (o.clone(), o)
            }
        }
    };
    sc.complete(so);
    rc.complete(ro);
}

/// An operation posted on the threads transport: a ring exchange's message, or any other.
pub(crate) enum ThreadOp {
    Mailbox(MailboxOp),
    Exchange(ExchangeOp),
}

impl ThreadOp {
    pub(crate) fn wait(&mut self) -> Result<(), CommError> {
        match self {
            ThreadOp::Mailbox(op) => op.wait(),
            ThreadOp::Exchange(op) => op.wait(),
        }
    }

    pub(crate) fn test(&mut self) -> Result<bool, CommError> {
        match self {
            ThreadOp::Mailbox(op) => op.test(),
            ThreadOp::Exchange(op) => op.test(),
        }
    }

    pub(crate) fn cancel(self) {
        match self {
            ThreadOp::Mailbox(op) => op.cancel(),
            ThreadOp::Exchange(op) => op.cancel(),
        }
    }
}
