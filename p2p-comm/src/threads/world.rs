//! The state the ranks of one threads communicator share.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam::utils::CachePadded;

use super::channel::{Cell, CellRef, Channel, ChannelRef};
use super::completion::{Completion, CompletionRef, State, POSTED};
use super::mailbox::Mailbox;
use super::refs::{PerRank, Recycler, Ref};
use crate::sync::lock;

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
}

impl World {
    pub(crate) fn new(size: usize) -> Arc<World> {
        Arc::new(World {
            size,
            mailboxes: (0..size).map(|_| CachePadded::new(Mutex::new(Mailbox::new()))).collect(),
            alive: (0..size).map(|_| CachePadded::new(AtomicBool::new(true))).collect(),
            pools: (0..size).map(|_| CachePadded::new(Mutex::new(Recycler::default()))).collect(),
            cells: (0..2 * size).map(|_| CachePadded::new(Mutex::new(Recycler::default()))).collect(),
            channels: Mutex::new(HashMap::new()),
            splits: Mutex::new(HashMap::new()),
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
