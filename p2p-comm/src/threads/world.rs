//! The state the ranks of one threads communicator share.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use crossbeam::utils::CachePadded;

use super::channel::{Cell, CellRef, Channel, ChannelRef};
use super::completion::{Completion, CompletionRef, Outcome, State, POSTED};
use super::mailbox::{Mailbox, Slot};
use super::refs::{PerRank, Recycler, Ref};
use crate::error::CommError;
use crate::sync::lock;

/// How long a peer that saw a supervised rank go waits for [`ThreadWorld`](crate::ThreadWorld) to say why.
const VERDICT_WAIT: Duration = Duration::from_secs(5);

/// Whether and how a rank left its world.
#[derive(Default)]
pub(super) struct Departure {
    /// Run by [`ThreadWorld`](crate::ThreadWorld), which says why the rank left when its closure returns (its
    /// error or panic), so the rank's endpoint does not leave on its own when dropped.
    supervised: bool,
    /// The endpoint of a supervised rank was dropped: the rank leaves when its supervisor settles it.
    dropped: bool,
    /// Set once the rank left: the reason it failed, if it gave one.
    left: Option<Option<String>>,
}

pub(super) struct SplitEntry {
    pub(super) world: Arc<World>,
    pub(super) remaining: usize,
}

/// State shared by the ranks of one threads communicator (one per communicator: sub-communicators get their
/// own, so their traffic never meets the parent's).
///
/// Each rank's entries are padded to their own cache lines: the two ranks of a ping-pong touch their own pool on
/// every message, and when the pools shared a line each of those touches moved it between the cores.
pub(crate) struct World {
    pub(super) size: usize,
    pub(super) mailboxes: Box<[CachePadded<Mutex<Mailbox>>]>,
    pub(crate) alive: Box<[CachePadded<AtomicBool>]>,
    pub(super) pools: PerRank<Recycler<Completion, ()>>,
    /// Per rank and kind (receives, sends): the outcome cells of its exchange operations, with the last ticket
    /// each was used with. Kept apart because a receive's cell is written by its own rank (which copies) and a
    /// send's by the peer: a cell that went from one kind to the other was a line to fetch back from the peer.
    pub(super) cells: PerRank<Recycler<Cell, u64>>,
    /// The exchange channel of each ordered pair (sender, receiver) that has exchanged, created on first use.
    pub(super) channels: Mutex<HashMap<(usize, usize), ChannelRef>>,
    pub(super) splits: Mutex<HashMap<(u64, u32), SplitEntry>>,
    /// Per rank: whether and why it left; `departed` is notified whenever one does.
    departures: Box<[Mutex<Departure>]>,
    departed: Condvar,
    /// A split world's parent and each member's rank there: where a member that left this world without a
    /// reason (its endpoint dropped, as a failing rank's are while its closure returns) may have given one.
    /// Weak: the parent holds this world in `splits` until every member joined, and a split that never
    /// completes must not keep both alive.
    parent: Option<(Weak<World>, Box<[usize]>)>,
}

impl World {
    pub(crate) fn new(size: usize) -> Arc<World> {
        Self::with_parent(size, None)
    }

    /// The world of a communicator split from `parent`'s, whose members are `members` there (in their order
    /// here).
    pub(crate) fn split_from(parent: &Arc<World>, members: &[usize]) -> Arc<World> {
        Self::with_parent(members.len(), Some((Arc::downgrade(parent), members.into())))
    }

    fn with_parent(size: usize, parent: Option<(Weak<World>, Box<[usize]>)>) -> Arc<World> {
        Arc::new(World {
            size,
            mailboxes: (0..size).map(|_| CachePadded::new(Mutex::new(Mailbox::new()))).collect(),
            alive: (0..size).map(|_| CachePadded::new(AtomicBool::new(true))).collect(),
            pools: (0..size).map(|_| CachePadded::new(Mutex::new(Recycler::default()))).collect(),
            cells: (0..2 * size).map(|_| CachePadded::new(Mutex::new(Recycler::default()))).collect(),
            channels: Mutex::new(HashMap::new()),
            splits: Mutex::new(HashMap::new()),
            departures: (0..size).map(|_| Mutex::default()).collect(),
            departed: Condvar::new(),
            parent,
        })
    }

    pub(super) fn completion(&self, rank: usize) -> CompletionRef {
        let (c, ()) = lock(&self.pools[rank]).take(Completion::new);
        *lock(&c.state) = State::Posted;
        c.stage.store(POSTED, Ordering::Relaxed);
        c
    }

    pub(super) fn recycle(&self, rank: usize, c: CompletionRef) {
        lock(&self.pools[rank]).put(c, ());
    }

    /// An outcome cell for one of `rank`'s exchange operations, and the fresh ticket it is used with.
    pub(crate) fn exchange_cell(&self, rank: usize, is_send: bool) -> (CellRef, u64) {
        let (c, last_ticket) = lock(&self.cells[2 * rank + is_send as usize]).take(Cell::default);
        (c, last_ticket + 1)
    }

    pub(crate) fn recycle_exchange_cell(&self, rank: usize, is_send: bool, c: CellRef, ticket: u64) {
        lock(&self.cells[2 * rank + is_send as usize]).put(c, ticket);
    }

    /// Rank `r` leaves (once; later calls change nothing), having failed for `reason` if given: it is marked
    /// gone, and every operation waiting on it completes with [`gone_error`](Self::gone_error).
    pub(crate) fn depart(&self, r: usize, reason: Option<String>) {
        {
            let mut d = lock(&self.departures[r]);
            if d.left.is_some() {
                return;
            }
            // Published before `alive` changes, so whoever sees the rank gone finds the reason.
            d.left = Some(reason);
        }
        self.alive[r].store(false, Ordering::SeqCst);
        for (d, mbox) in self.mailboxes.iter().enumerate() {
            // Our own mailbox: the sends addressed to us. Another rank's: its receives from us.
            let waiting_on_us = |s: &Slot| if d == r { s.is_send() } else { !s.is_send() && s.peer() == r };
            for s in lock(mbox).drain_where(waiting_on_us) {
                s.done.complete(Outcome::PeerGone);
            }
        }
        // Exchanges with us: their waiters look at `alive` when they wake.
        for (&(src, dst), ch) in lock(&self.channels).iter() {
            if src == r || dst == r {
                ch.wake_all();
            }
        }
        let _g = lock(&self.departures[r]);
        self.departed.notify_all();
    }

    /// Rank `r`'s departure is settled by its supervisor ([`settle`](Self::settle)), not by its endpoint's drop.
    pub(crate) fn supervise(&self, r: usize) {
        lock(&self.departures[r]).supervised = true;
    }

    /// Rank `r`'s endpoint was dropped: it leaves now, or when its supervisor settles it.
    pub(super) fn endpoint_dropped(&self, r: usize) {
        {
            let mut d = lock(&self.departures[r]);
            if d.supervised {
                d.dropped = true;
                return;
            }
        }
        self.depart(r, None);
    }

    /// The supervisor of rank `r` is done with it (its closure returned, with `reason` if it failed): the rank
    /// leaves if its endpoint is gone, else (it outlived the closure) when the endpoint is dropped.
    pub(crate) fn settle(&self, r: usize, reason: Option<String>) {
        let dropped = {
            let mut d = lock(&self.departures[r]);
            d.supervised = false;
            d.dropped
        };
        if dropped {
            self.depart(r, reason);
        }
    }

    /// The error for an operation with rank `r`, which has left (or is leaving: a supervised rank that is
    /// unwinding is given a moment to say why): [`CommError::PeerFailed`] if it gave a reason, else
    /// [`CommError::PeerGone`].
    pub(crate) fn gone_error(&self, r: usize) -> CommError {
        match self.verdict(r, Instant::now() + VERDICT_WAIT) {
            Some(reason) => CommError::PeerFailed { rank: r, reason },
            None => CommError::PeerGone { rank: r },
        }
    }

    /// Why rank `r` failed, if it said, waiting until `deadline` for a supervised rank that has not left yet.
    ///
    /// A member of a split world that left it without a reason is looked up in the parent world: a failing
    /// rank's closure returns, dropping its split communicators (which leave at once, saying nothing), and only
    /// then does its supervisor settle it with the reason in the world it was given, the root; a rank that
    /// [aborted](crate::Communicator::abort) its parent communicator leaves the reason there too. So peers
    /// waiting on it in a split world (the groups of ring attention's all-to-all schedules, say) learn why, as
    /// they would in the root. (UCX looks the reason up by the process's world rank, so it needs no such chain.)
    /// A member still in a split world (it withdrew its messages with the going-away mark, as a rank whose
    /// operation failed does before it returns) is looked up in the parent at once. A supervised rank that dropped
    /// a split communicator and runs on leaves that world's peers waiting here until the deadline, then `None`, as
    /// an unwinding root rank that never says why does.
    fn verdict(&self, r: usize, deadline: Instant) -> Option<String> {
        let mut d = lock(&self.departures[r]);
        loop {
            match &d.left {
                Some(Some(reason)) => return Some(reason.clone()),
                Some(None) => break,
                // A member of a split world that withdrew its messages on its way out (cancelling the rest of an
                // operation that failed) before its endpoint left: its reason comes from the parent, as below.
                None if !d.supervised && self.parent.is_some() => break,
                None if !d.supervised => return None,
                None => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            d = self.departed.wait_timeout(d, deadline - now).unwrap_or_else(PoisonError::into_inner).0;
        }
        drop(d);
        let (parent, members) = self.parent.as_ref()?;
        parent.upgrade()?.verdict(members[r], deadline)
    }

    /// The channel from `src` to `dst`, created on first use.
    pub(super) fn channel(&self, src: usize, dst: usize) -> ChannelRef {
        *lock(&self.channels).entry((src, dst)).or_insert_with(|| Ref::leak(Box::<Channel>::default()))
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // Completions and cells are freed by their recyclers.
        for (_, ch) in lock(&self.channels).drain() {
            // SAFETY: leaked by `channel`, freed once here; its holders (endpoints, operations) hold this world.
            unsafe { ch.free() };
        }
    }
}

/// One rank's own handle on the shared world (see `Endpoint::ops_world`).
///
/// Aligned to two cache lines so that its `Arc`'s counts get lines of their own: the ranks' handles are
/// allocated one after the other, and at 24 bytes two of them shared a line whose counts both ranks changed on
/// every operation.
#[repr(align(128))]
pub(crate) struct RankWorld(pub(super) Arc<World>);

impl std::ops::Deref for RankWorld {
    type Target = World;
    fn deref(&self) -> &World {
        &self.0
    }
}
