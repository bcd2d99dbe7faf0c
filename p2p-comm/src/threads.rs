//! The threads transport: every rank is a thread of one process.
//!
//! Ring exchanges (`sendrecv`, `isendrecv` and the collectives' steps) pair their messages by number in a
//! channel per ordered pair of ranks, with no matching (see [`crate::exchange`]). Every other message is matched
//! through mailboxes, as follows.
//!
//! Matching is rendezvous with a single copy. Each rank `d` owns a mailbox holding the sends addressed to it
//! that no receive has matched yet and the receives it posted that no send has matched yet. Whoever arrives
//! second (the sender finding a posted receive, or the receiver finding a posted send) removes the other's slot
//! under the mailbox lock. Slots are matched first-in first-out per (source, tag). Each side's
//! [`Request`](crate::Request) borrows its buffer until its completion is done, so the copy reads and writes
//! live memory.
//!
//! Who copies depends on the size:
//! - messages under [`DEFER_MIN`] bytes are copied at once by whoever arrives second, inside `post`: cheapest
//!   for latency-bound traffic;
//! - larger ones are only *matched* in `post`: the pair (both buffers) is parked in the receive's completion
//!   and copied in chunks ([`chunk_len`]): the receiver claims them from the front as soon as it waits on (or
//!   tests) its receive, the sender from the back of the back half as soon as it waits on its send (a message
//!   of one chunk would be the receiver's alone; [`chunk_len`] gives every deferred message two or more). Each
//!   side so copies the same part of a message from one exchange to the next, and a destination line stays in
//!   the cache of the core that wrote it last time (when the sender took single-chunk messages too, a 64 KiB
//!   stream fell from 19 to 6 GiB/s). In a one-way stream the two cores
//!   split every message: on the bench machine a 1 MiB stream ran at 56 GiB/s against 25 for one `memcpy`, and
//!   at 20 when the sender first spun for a while to leave the copy to the receiver. A sender whose receiver
//!   has not claimed its half after a spin copies it too: the receiver may be busy elsewhere, and a send must
//!   complete without it.
//!
//! A waiter whose chunks are all claimed spins while the peer copies the last ones instead of sleeping: the
//! futex sleep and wake-up cost tens of µs and lie on the path of the next message.
//!
//! Completions are pooled per rank and the mailbox queues keep their capacity, so a steady-state exchange of
//! a given shape allocates nothing.
//!
//! When a rank's communicator is dropped (normally or while its thread unwinds from a panic) the rank is marked
//! gone and every slot waiting on it completes with [`CommError::PeerGone`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crossbeam::utils::CachePadded;

use crate::communicator::INTERNAL;
use crate::exchange::{Cell, CellRef, Channel, ChannelRef, ExchangeOp};
use crate::stats::StatsCounters;
use crate::{CommError, Communicator};

/// Locks a mutex, ignoring poisoning: the data it guards stays consistent across our panics.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How a slot ended, seen from the slot's owner.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    Ok,
    LengthMismatch { message_bytes: usize, buffer_bytes: usize },
    MetaMismatch { ours: u64, theirs: u64 },
    PeerGone,
}

/// Messages of at least this many bytes are copied by the first side to wait/test after matching (normally the
/// receiver) instead of by the second to arrive, inside `post`. Below it the copy costs less than waking the
/// peer thread, so eager copying keeps latency low.
pub(crate) const DEFER_MIN: usize = 64 << 10;

/// In a ring exchange, a receive posted after its message arrived copies it inside `post` below this many
/// bytes (so a small exchange posted with `isendrecv` is done before the rank computes); larger ones, and any
/// whose message is not there yet, are copied in `wait`.
pub(crate) const EXCHANGE_EAGER_BELOW: usize = 16 << 10;

/// A matched large message waiting to be copied, parked in the receive's completion: the send's buffer and
/// completion, and the receive's buffer. Which chunks are claimed and how many bytes are copied live in that
/// completion's atomics ([`Completion::claims`], [`Completion::copied`]), so claiming a chunk takes no lock.
#[derive(Debug)]
struct Pair {
    sp: *const u8,
    sc: CompletionRef,
    rp: *mut u8,
    len: usize,
    /// The receive completion's claim generation for this pair (see [`Completion::claims`]).
    generation: u64,
}

/// What a send matched with a large receive holds: where the pair is parked, and what the sender needs to copy
/// its chunks without reading the pair.
#[derive(Debug)]
struct Attachment {
    rc: CompletionRef,
    sp: *const u8,
    rp: *mut u8,
    generation: u64,
}

/// How long a waiter whose message is being copied by the peer spins for it before sleeping: a chunk
/// ([`chunk_len`], at most 4 MiB) takes under a millisecond to copy on any machine this runs on.
const COPY_SPIN: Duration = Duration::from_millis(2);

/// Size of the chunks a matched large message is copied in: small enough that the two threads share every
/// deferred message ([`DEFER_MIN`] and up: a 256 KiB stream ran at 26-27 GiB/s with 256 KiB chunks, one per
/// message, and at 39-43 with 64 KiB ones, against 36-38 for `memcpy`; a 64 KiB stream at 18-20 with one 64 KiB
/// chunk and at 24-30 with two of 32 KiB), large enough that claiming and finishing a chunk costs little (a 32 KiB
/// chunk is about 1 µs of copying; 16 KiB ones were no faster and slowed the 64 KiB ring). A multiple of 4 KiB,
/// so chunks keep the buffers' alignment.
fn chunk_len(len: usize) -> usize {
    (len / 8).clamp(32 << 10, 4 << 20) & !4095
}

/// Number of chunks of a `len`-byte message.
fn chunks(len: usize) -> usize {
    len.div_ceil(chunk_len(len))
}

// SAFETY: the pointers are dereferenced only by whoever claims a chunk of the pair (see `copy_chunks`), while
// both requests keep their buffers borrowed (neither can finish before the last chunk's copy completes it).
unsafe impl Send for Pair {}
// SAFETY: as for `Pair`.
unsafe impl Send for Attachment {}

/// [`Completion::claims`] packs a generation (the top 24 bits), the next unclaimed chunk from the front (20 bits)
/// and the end of the unclaimed ones (the low 20 bits). 2^20 chunks of at most 4 MiB cover any message.
const CLAIM_BITS: u32 = 20;
const CLAIM_MASK: u64 = (1 << CLAIM_BITS) - 1;

fn pack_claims(generation: u64, next: usize, end: usize) -> u64 {
    (generation << (2 * CLAIM_BITS)) | ((next as u64) << CLAIM_BITS) | end as u64
}

#[derive(Debug)]
enum State {
    Posted,
    /// A receive matched with a large send, being copied (or about to be) chunk by chunk; completed by whoever
    /// copies the last chunk.
    Matched(Pair),
    /// A send matched with a large receive, whose completion holds the pair; completed by whoever copies the
    /// last chunk.
    Attached(Attachment),
    Done(Outcome),
}

/// The hand-off of one operation between the two sides of a message.
///
/// Laid out by hand on two cache lines of its own: the state's lock and value with the stage and sleeper
/// count on the first (what a setter writes and the waiter spins on, moved between the cores together), the
/// condition variable and the chunk claims on the second. Left to the allocator and the compiler, the fields
/// straddled lines that differed from one completion to the next; this layout took a blocking stream from 2.9 to
/// 5.6 GiB/s at 4 KiB, 5.3 to 18 at 16 KiB and 29 to 32 at 64 KiB (alternating single runs of the bench).
#[derive(Debug)]
#[repr(C, align(64))]
struct Completion {
    state: Mutex<State>,
    /// How far `state` got ([`POSTED`], [`MATCHED`] or [`DONE`]), updated with it: lets a waiter spin briefly
    /// without the lock before sleeping on `cv`.
    stage: AtomicU8,
    /// Threads sleeping on `cv`; changed only under the `state` lock. `Condvar::notify_all` is a futex syscall
    /// even with nobody waiting, and most completions have no sleeper (the waiter is spinning, copying or not
    /// there yet), so setters skip it then: two syscalls less per small message.
    sleepers: AtomicU32,
    cv: Condvar,
    /// For a receive matched with a large send: the generation, next and end of its unclaimed chunks
    /// ([`pack_claims`]). Both sides claim chunks with one compare-and-swap, no lock: the lock taken per claim
    /// moved between the cores several times per message. The generation changes with every pair parked here,
    /// so a sender that read its attachment before this completion was reused for another pair claims nothing.
    claims: AtomicU64,
    /// Bytes of the parked pair whose copy finished; whoever brings it to the length completes both sides.
    copied: AtomicUsize,
}

const POSTED: u8 = 0;
const MATCHED: u8 = 1;
const DONE: u8 = 2;

impl Completion {
    fn new() -> Completion {
        Completion {
            state: Mutex::new(State::Posted),
            cv: Condvar::new(),
            stage: AtomicU8::new(POSTED),
            sleepers: AtomicU32::new(0),
            claims: AtomicU64::new(0),
            copied: AtomicUsize::new(0),
        }
    }

    fn set(&self, s: State) {
        let stage = match s {
            State::Posted => POSTED,
            State::Done(_) => DONE,
            _ => MATCHED,
        };
        let mut st = lock(&self.state);
        *st = s;
        self.stage.store(stage, Ordering::Release);
        self.wake(st);
    }

    /// Releases the `state` lock `st` and wakes the threads sleeping on `cv`, if any. A sleeper registers under
    /// the lock before it sleeps (and `Condvar::wait` releases the lock atomically), so one that we do not see
    /// here has not checked the state yet and will find it changed.
    fn wake(&self, st: MutexGuard<'_, State>) {
        let sleeping = self.sleepers.load(Ordering::Relaxed) > 0;
        drop(st);
        if sleeping {
            self.cv.notify_all();
        }
    }

    fn complete(&self, o: Outcome) {
        self.set(State::Done(o));
    }

    /// Completes with `o` under the lock `st` already held on `self.state`; returns what the state held.
    fn complete_locked(&self, mut st: MutexGuard<'_, State>, o: Outcome) -> State {
        let old = std::mem::replace(&mut *st, State::Done(o));
        self.stage.store(DONE, Ordering::Release);
        self.wake(st);
        old
    }

    /// Spins (then yields) for a few microseconds hoping the peer gets us to `stage`, which avoids a futex sleep
    /// and wake-up (tens of µs) on latency-bound exchanges.
    ///
    /// `large`: the message is a deferred one (at least [`DEFER_MIN`] bytes), whose peer takes several writes to
    /// this completion's first line (lock, state, stage, unlock) while we wait on it. Reading it between 8
    /// `pause`s instead of 1 leaves the line with the writer for those: the 64 KiB blocking stream went from
    /// 29-31 to 32-33.5 GiB/s. Small messages keep the tight spin, where the later wake-up cost more than the
    /// line was worth (the 4 KiB stream fell from 4.6-5.7 to 2.8-5.3 with the slow spin for every size).
    fn spin(&self, stage: u8, large: bool) {
        let pauses = if large { 8 } else { 1 };
        let spins = 50 / pauses;
        for i in 0..150 + spins {
            if self.stage.load(Ordering::Acquire) >= stage {
                return;
            }
            if i < spins {
                for _ in 0..pauses {
                    std::hint::spin_loop();
                }
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// A posted, unmatched operation. `ptr` points into the owner's buffer, which the owner's request borrows.
///
/// 40 bytes, so that a mailbox's lock, its first slot and the header of the others share one cache line (see
/// [`Mailbox`]): `word` packs the key (its low [`KEY_BITS`] bits), whether the slot is a send, and the peer (for a
/// send: the sending rank; for a receive: the rank it receives from).
#[derive(Clone, Copy)]
struct Slot {
    word: u64,
    meta: u64,
    ptr: *mut u8,
    len: usize,
    done: CompletionRef,
}

/// Bits of a key: the user tag (32) and the internal flag above it (`communicator::INTERNAL`).
const KEY_BITS: u32 = 33;
/// Most ranks a threads world may have (what a slot's word has room for).
pub(crate) const MAX_THREAD_RANKS: usize = 1 << (63 - KEY_BITS);

impl Slot {
    fn word(is_send: bool, peer: usize, key: u64) -> u64 {
        debug_assert!(key >> KEY_BITS == 0 && peer < MAX_THREAD_RANKS);
        key | (is_send as u64) << KEY_BITS | (peer as u64) << (KEY_BITS + 1)
    }

    fn key(&self) -> u64 {
        self.word & ((1 << KEY_BITS) - 1)
    }

    fn is_send(&self) -> bool {
        self.word >> KEY_BITS & 1 == 1
    }

    fn peer(&self) -> usize {
        (self.word >> (KEY_BITS + 1)) as usize
    }
}

// SAFETY: `ptr` is only dereferenced after the slot left its queue (matched), by the rank that removed it or, for
// a large message, by whichever side claims the pair; meanwhile the owner's request keeps the buffer borrowed (it
// cannot complete, and so cannot release the borrow, before `done` is completed).
unsafe impl Send for Slot {}

/// An object of a [`World`] by address: a completion, an exchange channel or an outcome cell. They are
/// allocated by the world (its [`Recycler`]s and channel map) and freed only when it is dropped, so every `Ref`
/// held by something the world outlives (an operation, which holds the world; a slot in its mailboxes; a pair or
/// attachment in its completions; an endpoint's channel cache) points to a live object.
///
/// Not an `Arc`: the slot, pair and attachment of a message were clones of a completion, each made or dropped by
/// the peer rank, and every such count change moved the completion's first cache line between the cores (a fifth
/// of `post` in a 64 KiB ring exchange).
pub(crate) struct Ref<T>(std::ptr::NonNull<T>);

impl<T> PartialEq for Ref<T> {
    /// The same object.
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl<T> std::fmt::Debug for Ref<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Ref({:p})", self.0)
    }
}

impl<T> Clone for Ref<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Ref<T> {}

impl<T> Ref<T> {
    pub(crate) fn leak(b: Box<T>) -> Self {
        Ref(std::ptr::NonNull::from(Box::leak(b)))
    }

    pub(crate) fn as_ptr(self) -> *mut T {
        self.0.as_ptr()
    }

    /// # Safety
    /// Once, when nothing refers to the object any more (its world is dropped).
    unsafe fn free(self) {
        // SAFETY: allocated by `leak`, freed once per the contract.
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }
}

// SAFETY: the objects are `Sync` (locks and atomics); a `Ref` is valid on any thread while its world lives.
unsafe impl<T: Sync> Send for Ref<T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for Ref<T> {}

impl<T> std::ops::Deref for Ref<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: see the type's docs: the object lives as long as its world, which outlives every holder.
        unsafe { self.0.as_ref() }
    }
}

type CompletionRef = Ref<Completion>;

/// One rank's objects of one kind: the finished ones kept for reuse, each with what its last user left (`E`: an
/// outcome cell's last ticket), and every one ever allocated, freed with the world.
struct Recycler<T, E> {
    free: Vec<(Ref<T>, E)>,
    all: Vec<Ref<T>>,
}

impl<T, E> Default for Recycler<T, E> {
    fn default() -> Self {
        Recycler { free: Vec::new(), all: Vec::new() }
    }
}

impl<T, E: Default> Recycler<T, E> {
    /// A free object and what its last user left, or a new one from `make` (and `E::default()`).
    fn take(&mut self, make: impl FnOnce() -> T) -> (Ref<T>, E) {
        self.free.pop().unwrap_or_else(|| {
            let r = Ref::leak(Box::new(make()));
            self.all.push(r);
            (r, E::default())
        })
    }

    fn put(&mut self, r: Ref<T>, left: E) {
        self.free.push((r, left));
    }
}

/// One `T` per rank (or per rank and kind), each locked on cache lines of its own.
type PerRank<T> = Box<[CachePadded<Mutex<T>>]>;

impl<T, E> Drop for Recycler<T, E> {
    fn drop(&mut self) {
        for r in self.all.drain(..) {
            // SAFETY: allocated by `take`, freed once here. The recycler lives in its world, which is dropped only
            // when nothing refers to its objects any more: their holders are operations (each holds the world) and
            // slots, pairs and attachments inside the world.
            unsafe { r.free() };
        }
    }
}

/// A mailbox's unmatched operations (sends addressed to its rank and receives its rank posted), oldest first.
///
/// Sends and receives share one queue. Its oldest slot is stored inline and the others in a ring buffer whose
/// header is 16 bytes, so the lock word, that slot and the ring's header fill exactly one cache line (checked
/// below). A message between two ranks with nothing else in flight so moves one mailbox line between the cores,
/// where two `Vec`s kept their slots on a second line (five-round medians of the bench: 4 KiB blocking stream
/// 5.0-5.8 → 7.1-7.4 GiB/s, latency 0.8 → 0.6 µs), and windowed streams touch the ring's slots but no header line
/// of their own (with a boxed `VecDeque` the 4 KiB stream with 16 sends in flight and one receive at a time fell
/// from 8.6-9.0 to 6.4-6.9 GiB/s). Both kinds may wait here at once (for
/// different peers or tags); an operation only matches the other kind with the same peer and tag, oldest first,
/// so each (peer, tag) stays first-in first-out. The ring keeps its capacity, so a steady state allocates
/// nothing.
#[derive(Default)]
struct Mailbox {
    /// Set only while `rest` is empty, so it is always the oldest slot. It is not refilled from `rest` when
    /// taken: with many in flight, moving each next slot into the lock's line cost the windowed 4 KiB stream a
    /// fifth of its rate.
    first: Option<Slot>,
    rest: SlotRing,
}

const _: () = assert!(std::mem::size_of::<Mutex<Mailbox>>() <= 64);

impl Mailbox {
    /// A mailbox whose ring already has room for a few slots: a second slot waits only now and then (two
    /// messages in flight at once), and that must not allocate in the middle of a steady state.
    fn new() -> Mailbox {
        let mut m = Mailbox::default();
        m.rest.grow();
        m
    }

    fn push(&mut self, slot: Slot) {
        if self.first.is_none() && self.rest.len == 0 {
            self.first = Some(slot);
        } else {
            self.rest.push_back(slot);
        }
    }

    /// Removes and returns the oldest slot that `matches`.
    fn take(&mut self, matches: impl Fn(&Slot) -> bool) -> Option<Slot> {
        if self.first.as_ref().is_some_and(&matches) {
            return self.first.take();
        }
        let i = self.rest.iter().position(|s| matches(&s))?;
        Some(self.rest.remove(i))
    }

    fn iter(&self) -> impl Iterator<Item = Slot> + '_ {
        self.first.into_iter().chain(self.rest.iter())
    }

    /// Removes every slot that `gone` selects and returns them.
    fn drain_where(&mut self, gone: impl Fn(&Slot) -> bool) -> Vec<Slot> {
        let all: Vec<Slot> = self.iter().collect();
        self.first = None;
        self.rest.len = 0;
        let (removed, kept): (Vec<Slot>, Vec<Slot>) = all.into_iter().partition(|s| gone(s));
        kept.into_iter().for_each(|s| self.push(s));
        removed
    }
}

/// A first-in first-out ring of slots whose header is a pointer and two counters: the capacity (a power of two)
/// is stored at the start of the allocation, on a line of its own that only growing writes.
#[derive(Default)]
struct SlotRing {
    /// The allocation: the capacity (`usize`) in its first cache line, then the slots.
    block: Option<std::ptr::NonNull<u8>>,
    head: u32,
    len: u32,
}

// SAFETY: the ring owns its allocation; slots are plain data (see `Slot`'s `Send`).
unsafe impl Send for SlotRing {}

impl SlotRing {
    const SLOTS_AT: usize = 64;

    fn layout(cap: usize) -> std::alloc::Layout {
        let bytes = Self::SLOTS_AT + cap * std::mem::size_of::<Slot>();
        // Capacities stay far below this bound: a threads world holds at most the operations its ranks posted.
        std::alloc::Layout::from_size_align(bytes, 64).unwrap_or_else(|_| panic!("slot ring of {cap} slots"))
    }

    fn cap(&self) -> usize {
        // SAFETY: a block starts with its capacity, written when it was allocated.
        self.block.map_or(0, |b| unsafe { *(b.as_ptr() as *const usize) })
    }

    fn slot(&self, i: usize) -> *mut Slot {
        let b = self.block.expect("a ring with slots has a block");
        let at = (self.head as usize + i) & (self.cap() - 1);
        // SAFETY: `at` < capacity, so the slot lies inside the allocation.
        unsafe { (b.as_ptr().add(Self::SLOTS_AT) as *mut Slot).add(at) }
    }

    fn push_back(&mut self, s: Slot) {
        if self.len as usize == self.cap() {
            self.grow();
        }
        let p = self.slot(self.len as usize);
        // SAFETY: inside the allocation; `Slot` is `Copy`, so overwriting a stale slot drops nothing.
        unsafe { p.write(s) };
        self.len += 1;
    }

    fn grow(&mut self) {
        let cap = (self.cap() * 2).max(8);
        assert!(cap <= u32::MAX as usize, "more than 2^31 operations waiting in one mailbox");
        let layout = Self::layout(cap);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(block) = std::ptr::NonNull::new(raw) else { std::alloc::handle_alloc_error(layout) };
        // SAFETY: the new block holds the capacity and `cap` slots; the old slots are copied in order.
        unsafe {
            *(raw as *mut usize) = cap;
            let slots = raw.add(Self::SLOTS_AT) as *mut Slot;
            for i in 0..self.len as usize {
                slots.add(i).write(self.slot(i).read());
            }
        }
        self.free();
        self.block = Some(block);
        self.head = 0;
    }

    fn free(&mut self) {
        let cap = self.cap();
        if let Some(b) = self.block.take() {
            // SAFETY: allocated by `grow` with this capacity's layout.
            unsafe { std::alloc::dealloc(b.as_ptr(), Self::layout(cap)) };
        }
    }

    fn iter(&self) -> impl Iterator<Item = Slot> + '_ {
        // SAFETY: slots `0..len` are initialized.
        (0..self.len as usize).map(|i| unsafe { self.slot(i).read() })
    }

    /// Removes slot `i` (counted from the oldest), moving the newer ones up.
    fn remove(&mut self, i: usize) -> Slot {
        debug_assert!(i < self.len as usize);
        // SAFETY: slots `0..len` are initialized; each move stays inside the ring.
        unsafe {
            let s = self.slot(i).read();
            if i == 0 {
                self.head = ((self.head as usize + 1) & (self.cap() - 1)) as u32;
            } else {
                for j in i..self.len as usize - 1 {
                    self.slot(j).write(self.slot(j + 1).read());
                }
            }
            self.len -= 1;
            s
        }
    }
}

impl Drop for SlotRing {
    fn drop(&mut self) {
        self.free();
    }
}

struct SplitEntry {
    world: Arc<World>,
    remaining: usize,
}

/// State shared by the ranks of one threads communicator (one per communicator: sub-communicators get their
/// own, so their traffic never meets the parent's).
///
/// Each rank's entries are padded to their own cache lines: the two ranks of a ping-pong touch their own pool on
/// every message, and when the pools shared a line each of those touches moved it between the cores.
pub(crate) struct World {
    size: usize,
    mailboxes: Box<[CachePadded<Mutex<Mailbox>>]>,
    pub(crate) alive: Box<[CachePadded<AtomicBool>]>,
    pools: PerRank<Recycler<Completion, ()>>,
    /// Per rank and kind (receives, sends): the outcome cells of its exchange operations, with the last ticket
    /// each was used with. Kept apart because a receive's cell is written by its own rank (which copies) and a
    /// send's by the peer: a cell that went from one kind to the other was a line to fetch back from the peer.
    cells: PerRank<Recycler<Cell, u64>>,
    /// The exchange channel of each ordered pair (sender, receiver) that has exchanged, created on first use.
    channels: Mutex<HashMap<(usize, usize), ChannelRef>>,
    splits: Mutex<HashMap<(u64, u32), SplitEntry>>,
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

    fn completion(&self, rank: usize) -> CompletionRef {
        let (c, ()) = lock(&self.pools[rank]).take(Completion::new);
        *lock(&c.state) = State::Posted;
        c.stage.store(POSTED, Ordering::Relaxed);
        c
    }

    fn recycle(&self, rank: usize, c: CompletionRef) {
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
    fn channel(&self, src: usize, dst: usize) -> ChannelRef {
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

/// The outcomes (send's, receive's) of a matched pair that cannot be copied, or `None` if it can.
fn mismatch(sl: usize, sm: u64, rl: usize, rm: u64) -> Option<(Outcome, Outcome)> {
    if sm != rm {
        Some((Outcome::MetaMismatch { ours: sm, theirs: rm }, Outcome::MetaMismatch { ours: rm, theirs: sm }))
    } else if sl != rl {
        let o = Outcome::LengthMismatch { message_bytes: sl, buffer_bytes: rl };
        Some((o, o))
    } else {
        None
    }
}

/// Copies a matched message (or reports why not) and completes both sides.
fn transfer(send: (*const u8, usize, u64, &Completion), recv: (*mut u8, usize, u64, &Completion)) {
    let (sp, sl, sm, sc) = send;
    let (rp, rl, rm, rc) = recv;
    let (so, ro) = if let Some(o) = mismatch(sl, sm, rl, rm) {
        o
    } else {
        // SAFETY: both buffers are borrowed by requests that cannot finish before their completions below are
        // set; they belong to different requests, so they do not overlap (a `&[T]` and a `&mut [T]` never alias).
        unsafe { crate::copy::copy(sp, rp, sl) };
        (Outcome::Ok, Outcome::Ok)
    };
    sc.complete(so);
    rc.complete(ro);
}

impl Completion {
    /// Parks a pair of `len` bytes here (a receive's completion, not yet shared with the sender): resets the
    /// chunk claims under a new generation, which it returns.
    fn park(&self, len: usize) -> u64 {
        let generation = ((self.claims.load(Ordering::Relaxed) >> (2 * CLAIM_BITS)) + 1) & ((1 << 24) - 1);
        self.copied.store(0, Ordering::Relaxed);
        self.claims.store(pack_claims(generation, 0, chunks(len)), Ordering::Release);
        generation
    }

    /// Claims a chunk of the pair of `generation` parked here: the first unclaimed one (`front`), or the last one
    /// if its index is at least `min_back`. `None` if there is none (or the pair is another one).
    fn claim(&self, generation: u64, front: bool, min_back: usize) -> Option<usize> {
        let mut cur = self.claims.load(Ordering::Acquire);
        loop {
            let (g, next, end) = (cur >> (2 * CLAIM_BITS), (cur >> CLAIM_BITS) & CLAIM_MASK, cur & CLAIM_MASK);
            let (next, end) = (next as usize, end as usize);
            if g != generation || next >= end || (!front && end - 1 < min_back) {
                return None;
            }
            let (i, new) =
                if front { (next, pack_claims(g, next + 1, end)) } else { (end - 1, pack_claims(g, next, end - 1)) };
            match self.claims.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(i),
                Err(x) => cur = x,
            }
        }
    }
}

/// Copies chunks of the pair of `generation` parked in the receive completion `rc` (`len` bytes from `sp` to
/// `rp`) until none is left to claim (the peer may be copying others meanwhile), and completes both sides if it
/// copies the last byte. A receiver claims from the front; a sender (`!front`) from the back, and only chunks of
/// the back half unless `all`.
fn copy_chunks(rc: &Completion, generation: u64, sp: *const u8, rp: *mut u8, len: usize, front: bool, all: bool) {
    let min_back = if front || all { 0 } else { chunks(len).div_ceil(2) };
    while let Some(i) = rc.claim(generation, front, min_back) {
        let off = i * chunk_len(len);
        let n = chunk_len(len).min(len - off);
        // SAFETY: both buffers are borrowed by requests that cannot finish before the last chunk's copy completes
        // them; chunk `off..off+n` is claimed by us alone; a send and a receive buffer never overlap.
        unsafe {
            if len >= crate::copy::STREAM_MIN {
                crate::copy::copy_stream(sp.add(off), rp.add(off), n);
            } else {
                crate::copy::copy(sp.add(off), rp.add(off), n);
            }
        }
        // Release our bytes to whoever completes; acquire the others' if that is us.
        if rc.copied.fetch_add(n, Ordering::AcqRel) + n == len {
            let State::Matched(p) = rc.complete_locked(lock(&rc.state), Outcome::Ok) else {
                unreachable!("a pair with a chunk in flight is not completed")
            };
            p.sc.complete(Outcome::Ok);
            return;
        }
    }
}

/// One rank's handle on a [`World`]. Dropping it marks the rank gone.
pub(crate) struct Endpoint {
    pub(crate) world: Arc<World>,
    pub(crate) rank: usize,
    /// What this rank's operations hold: a per-rank `Arc` around the shared one, so starting and finishing an
    /// operation changes a reference count in this rank's cache only. With the shared count, which every rank
    /// changed on every message, that count's cache line (also holding the world's fields) moved between the
    /// cores twice per message: about a fifth of `post` in a 4 KiB ping-pong.
    ops_world: Arc<RankWorld>,
    /// The exchange channels this rank used, so that finding one takes no shared lock.
    channels: Mutex<Vec<((usize, usize), ChannelRef)>>,
}

/// One rank's own handle on the shared world (see `Endpoint::ops_world`).
///
/// Aligned to two cache lines so that its `Arc`'s counts get lines of their own: the ranks' handles are
/// allocated one after the other, and at 24 bytes two of them shared a line whose counts both ranks changed on
/// every operation.
#[repr(align(128))]
pub(crate) struct RankWorld(Arc<World>);

impl std::ops::Deref for RankWorld {
    type Target = World;
    fn deref(&self) -> &World {
        &self.0
    }
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

    /// Posts a send (`is_send`) or a receive of `len` bytes at `ptr`; `exchange`: one direction of a ring
    /// exchange, which goes through the pair's exchange channel.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid (and, for a receive, unaliased) until the returned op completes, is
    /// cancelled or dropped.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn post(
        &self,
        is_send: bool,
        peer: usize,
        key: u64,
        meta: u64,
        ptr: *mut u8,
        len: usize,
        exchange: bool,
        timeout: Duration,
        stats: &Arc<StatsCounters>,
    ) -> Result<ThreadOp, CommError> {
        let w = &self.world;
        let me = self.rank;
        if exchange {
            if !w.alive[peer].load(Ordering::SeqCst) {
                return Err(CommError::PeerGone { rank: peer });
            }
            let ch = if is_send { self.channel(me, peer) } else { self.channel(peer, me) };
            // SAFETY: per our contract.
            let op = unsafe {
                ExchangeOp::post(
                    self.ops_world.clone(),
                    ch,
                    is_send,
                    me,
                    peer,
                    key,
                    meta,
                    ptr,
                    len,
                    EXCHANGE_EAGER_BELOW,
                    timeout,
                    stats,
                )
            }?;
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
                if sl < DEFER_MIN {
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
                    return Err(CommError::PeerGone { rank: peer });
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
            len,
            timeout,
            stats: stats.clone(),
            done: Some(c),
        }))
    }

    /// Collective part of `split` that is specific to threads: finds or creates the sub-world of `color`.
    pub(crate) fn join_split(&self, seq: u64, color: u32, members: usize) -> Arc<World> {
        let mut splits = lock(&self.world.splits);
        let e =
            splits.entry((seq, color)).or_insert_with(|| SplitEntry { world: World::new(members), remaining: members });
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
        let w = &self.world;
        let r = self.rank;
        w.alive[r].store(false, Ordering::SeqCst);
        for (d, mbox) in w.mailboxes.iter().enumerate() {
            // Our own mailbox: the sends addressed to us. Another rank's: its receives from us.
            let waiting_on_us = |s: &Slot| if d == r { s.is_send() } else { !s.is_send() && s.peer() == r };
            for s in lock(mbox).drain_where(waiting_on_us) {
                s.done.complete(Outcome::PeerGone);
            }
        }
        // Exchanges with us: their waiters look at `alive` when they wake.
        for (&(src, dst), ch) in lock(&w.channels).iter() {
            if src == r || dst == r {
                ch.wake_all();
            }
        }
    }
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

/// An operation matched through the mailboxes.
pub(crate) struct MailboxOp {
    /// The world through the posting rank's own `Arc` (see `Endpoint::ops_world`).
    world: Arc<RankWorld>,
    me: usize,
    peer: usize,
    is_send: bool,
    key: u64,
    /// The collective's descriptor (0 for point-to-point).
    meta: u64,
    len: usize,
    timeout: Duration,
    stats: Arc<StatsCounters>,
    /// `None` once the op has finished and its completion went back to the pool.
    done: Option<CompletionRef>,
}

impl MailboxOp {
    fn finish(&mut self, c: CompletionRef, o: Outcome) -> Result<(), CommError> {
        self.world.recycle(self.me, c);
        let (src, dst) = if self.is_send { (self.me, self.peer) } else { (self.peer, self.me) };
        match o {
            Outcome::Ok => {
                self.stats.record(self.is_send, self.len);
                Ok(())
            }
            Outcome::LengthMismatch { message_bytes, buffer_bytes } => {
                Err(CommError::LengthMismatch { src, dst, tag: self.key, message_bytes, buffer_bytes })
            }
            Outcome::MetaMismatch { ours, theirs } => Err(crate::collectives::mismatch(self.peer, ours, theirs)),
            Outcome::PeerGone => Err(CommError::PeerGone { rank: self.peer }),
        }
    }

    /// Removes the slot if nobody matched it yet. Returns `false` if a peer claimed it (its copy is running).
    fn try_cancel(&self, c: CompletionRef) -> bool {
        let mbox = if self.is_send { self.peer } else { self.me };
        lock(&self.world.mailboxes[mbox]).take(|s| s.done == c).is_some()
    }

    /// If this op is matched with a large message that has chunks nobody claimed yet, copies them (completing
    /// both sides if it copies the last). A send copies only the back half unless `all`.
    fn progress(&self, c: CompletionRef, all: bool) {
        let st = lock(&c.state);
        match &*st {
            State::Matched(p) => {
                let (sp, rp, len, generation) = (p.sp, p.rp, p.len, p.generation);
                drop(st);
                copy_chunks(&c, generation, sp, rp, len, true, true);
            }
            State::Attached(a) => {
                let (rc, sp, rp, generation) = (a.rc, a.sp, a.rp, a.generation);
                drop(st);
                copy_chunks(&rc, generation, sp, rp, self.len, false, all);
            }
            _ => {}
        }
    }

    /// Waits until `c` is done or `deadline` passes (`None`), copying the chunks of a matched large message that
    /// the peer has not claimed.
    fn wait_until(&self, c: CompletionRef, deadline: Option<Instant>) -> Option<Outcome> {
        // A matched op needs one copy attempt: after it every chunk is claimed (by us or the peer), and the
        // completion is notified when the last is copied.
        let mut tried = false;
        // Whether a sender has taken over the receiver's half (after a spin) if the receiver left it.
        let mut took_over = false;
        // Until when a matched op whose chunks are all claimed spins for the peer to finish them.
        let mut copy_spin_end = None;
        let mut st = lock(&c.state);
        loop {
            match &*st {
                State::Done(o) => return Some(*o),
                State::Matched(_) | State::Attached(_) if !tried => {
                    tried = true;
                    drop(st);
                    self.progress(c, false);
                    st = lock(&c.state);
                    continue;
                }
                State::Attached(_) if !took_over => {
                    // The front half is the receiver's. If it is still unclaimed after a spin, the receiver is busy
                    // elsewhere (it posted the receive and computes, or is itself blocked in a send to us): a send
                    // must complete without it, so copy the rest ourselves.
                    took_over = true;
                    drop(st);
                    c.spin(DONE, true);
                    self.progress(c, true);
                    st = lock(&c.state);
                    continue;
                }
                State::Matched(_) | State::Attached(_) => {
                    // Every chunk is claimed: the peer is copying its last ones, which takes at most a chunk's copy
                    // time. Spin rather than sleep: a futex sleep and wake-up costs tens of µs, and that lies on the
                    // path of the next message (a 1 MiB stream ran at half of `memcpy` when the helping sender
                    // slept here). Bounded, in case the peer was descheduled mid-copy.
                    let end = *copy_spin_end.get_or_insert_with(|| Instant::now() + COPY_SPIN);
                    if Instant::now() < end {
                        drop(st);
                        c.spin(DONE, true);
                        st = lock(&c.state);
                        continue;
                    }
                }
                State::Posted => {}
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return None;
            }
            // Registered under the lock, which `wait` releases atomically: see `Completion::wake`.
            c.sleepers.fetch_add(1, Ordering::Relaxed);
            st = match deadline {
                Some(d) => c.cv.wait_timeout(st, d - now).unwrap_or_else(PoisonError::into_inner).0,
                None => c.cv.wait(st).unwrap_or_else(PoisonError::into_inner),
            };
            c.sleepers.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Waits without a deadline: only used once the slot left its queue (matched), so a copy will complete it.
    fn wait_done(&self, c: CompletionRef) -> Outcome {
        loop {
            if let Some(o) = self.wait_until(c, None) {
                return o;
            }
        }
    }

    /// Withdraws the op if unmatched, else waits for the running copy.
    pub(crate) fn cancel(mut self) {
        if let Some(c) = self.done.take() {
            if self.try_cancel(c) {
                self.world.recycle(self.me, c);
            } else {
                let o = self.wait_done(c);
                let _ = self.finish(c, o);
            }
        }
    }

    /// Non-blocking completion check.
    pub(crate) fn test(&mut self) -> Result<bool, CommError> {
        let Some(c) = self.done.take() else {
            return Ok(true);
        };
        self.progress(c, false);
        let st = lock(&c.state);
        if let State::Done(o) = *st {
            drop(st);
            return self.finish(c, o).map(|()| true);
        }
        drop(st);
        self.done = Some(c);
        Ok(false)
    }

    /// Waits up to the timeout; on timeout the op is cancelled (unless a copy is already running).
    pub(crate) fn wait(&mut self) -> Result<(), CommError> {
        let Some(c) = self.done.take() else {
            return Ok(());
        };
        // A matched large message is copied at once (in `wait_until`): a receive claims its chunks from the
        // front, a send from the back.
        c.spin(MATCHED, self.len >= DEFER_MIN);
        let deadline = Instant::now().checked_add(self.timeout);
        if let Some(o) = self.wait_until(c, deadline) {
            return self.finish(c, o);
        }
        if !self.try_cancel(c) {
            let o = self.wait_done(c);
            return self.finish(c, o);
        }
        self.world.recycle(self.me, c);
        if !self.is_send {
            let q = lock(&self.world.mailboxes[self.me]);
            let other = q.iter().find(|s| s.is_send() && s.peer() == self.peer && s.key() >> 32 == self.key >> 32);
            if let Some(s) = other {
                // Another collective (internal keys) or another user tag from the same peer is waiting.
                if self.key & INTERNAL != 0 {
                    return Err(crate::collectives::mismatch(self.peer, self.meta, s.meta));
                }
                return Err(CommError::TagMismatch {
                    src: self.peer,
                    dst: self.me,
                    expected: self.key,
                    found: s.key(),
                });
            }
        }
        Err(CommError::Timeout { op: if self.is_send { "send" } else { "recv" }, peer: self.peer, after: self.timeout })
    }
}

impl Drop for MailboxOp {
    fn drop(&mut self) {
        if self.done.is_none() {
            return;
        }
        if std::thread::panicking() {
            // Unwinding: withdraw the op so the peer learns quickly that this rank is gone.
            if let Some(c) = self.done.take() {
                if self.try_cancel(c) {
                    self.world.recycle(self.me, c);
                } else {
                    // Matched: finish the copy ourselves if the peer has not started it, so it is not left
                    // waiting on a rank that is going away.
                    self.wait_done(c);
                    self.world.recycle(self.me, c);
                }
            }
        } else {
            // Keep the buffer borrowed until the op finishes, times out or its peer leaves.
            let _ = self.wait();
        }
    }
}

/// Runs a closure on `n` ranks, one thread each, connected by the threads transport.
///
/// ```
/// use longctx_p2p::ThreadWorld;
/// let ranks = ThreadWorld::run(3, |c| c.rank() * 10)?;
/// assert_eq!(ranks, vec![0, 10, 20]);
/// # Ok::<(), longctx_p2p::CommError>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct ThreadWorld;

impl ThreadWorld {
    /// Runs `f` on `n` ranks with the default timeout and returns each rank's result, in rank order.
    ///
    /// If a rank panics the others see [`CommError::PeerGone`] from operations that involve it, and `run`
    /// returns [`CommError::RankPanicked`] naming the rank that panicked first.
    pub fn run<R: Send, F: Fn(Communicator) -> R + Sync>(n: usize, f: F) -> Result<Vec<R>, CommError> {
        ThreadWorld::builder().run(n, f)
    }

    /// A builder to set options (the timeout) before running.
    pub fn builder() -> ThreadWorldBuilder {
        ThreadWorldBuilder { timeout: crate::communicator::DEFAULT_TIMEOUT }
    }
}

/// Options of a [`ThreadWorld`].
#[derive(Debug, Clone)]
pub struct ThreadWorldBuilder {
    timeout: Duration,
}

impl ThreadWorldBuilder {
    /// The timeout of every rank's communicator (default 5 minutes).
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }

    /// Creates the communicators without running anything: one per rank, in rank order, to be moved to threads.
    pub fn build(&self, n: usize) -> Result<Vec<Communicator>, CommError> {
        if n == 0 {
            return Err(CommError::InvalidArgument("a world needs at least one rank".into()));
        }
        if n > MAX_THREAD_RANKS {
            return Err(CommError::InvalidArgument(format!("a threads world has at most {MAX_THREAD_RANKS} ranks")));
        }
        let world = World::new(n);
        Ok((0..n).map(|rank| Communicator::from_endpoint(Endpoint::new(world.clone(), rank), self.timeout)).collect())
    }

    /// Like [`ThreadWorld::run`], with this builder's options.
    pub fn run<R: Send, F: Fn(Communicator) -> R + Sync>(&self, n: usize, f: F) -> Result<Vec<R>, CommError> {
        let comms = self.build(n)?;
        let order = AtomicUsize::new(0);
        let outcomes: Vec<Result<R, (usize, String)>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let (f, order) = (&f, &order);
                    std::thread::Builder::new().name(format!("rank-{rank}")).spawn_scoped(s, move || {
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm))).map_err(|p| {
                            let msg = p
                                .downcast_ref::<&str>()
                                .map(|s| s.to_string())
                                .or_else(|| p.downcast_ref::<String>().cloned())
                                .unwrap_or_else(|| "non-string panic payload".into());
                            (order.fetch_add(1, Ordering::SeqCst), msg)
                        })
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h.join().unwrap_or_else(|_| Err((usize::MAX, "thread failed".into()))),
                    Err(e) => Err((usize::MAX, format!("spawning the thread failed: {e}"))),
                })
                .collect()
        });
        let first = outcomes
            .iter()
            .enumerate()
            .filter_map(|(rank, o)| o.as_ref().err().map(|(ord, msg)| (*ord, rank, msg.clone())))
            .min();
        if let Some((_, rank, message)) = first {
            return Err(CommError::RankPanicked { rank, message });
        }
        Ok(outcomes.into_iter().filter_map(Result::ok).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mailbox against a `Vec` model: pushes, takes by predicate (oldest first), cancels from the middle and a
    /// drain, across the ring's growth and wrap-around.
    #[test]
    fn mailbox_matches_oldest_first_like_a_vec() {
        let completions: Vec<Box<Completion>> = (0..4).map(|_| Box::new(Completion::new())).collect();
        let slot = |n: u64, is_send: bool, peer: usize| Slot {
            word: Slot::word(is_send, peer, n % 3),
            meta: n,
            ptr: std::ptr::null_mut(),
            len: n as usize,
            done: Ref(std::ptr::NonNull::from(&*completions[(n % 4) as usize])),
        };
        let mut mb = Mailbox::default();
        let mut model: Vec<Slot> = Vec::new();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut n = 0;
        let (mut max_cap, mut wrapped) = (0, false);
        for step in 0..20_000 {
            let r = next();
            // Bursts of pushes, so the ring grows, then drains and wraps.
            let push_bias = if (step / 500) % 2 == 0 { 60 } else { 35 };
            if r % 100 < push_bias {
                let s = slot(n, next() % 2 == 0, (next() % 3) as usize);
                n += 1;
                mb.push(s);
                model.push(s);
            } else if r % 100 < 95 {
                let (is_send, peer, key) = (next() % 2 == 0, (next() % 3) as usize, next() % 3);
                let want = Slot::word(is_send, peer, key);
                let got = mb.take(|s| s.word == want).map(|s| s.meta);
                let i = model.iter().position(|s| s.word == want);
                assert_eq!(got, i.map(|i| model.remove(i).meta), "step {step}");
            } else {
                let meta = next() % (n + 1);
                let got = mb.take(|s| s.meta == meta).map(|s| s.meta);
                let i = model.iter().position(|s| s.meta == meta);
                assert_eq!(got, i.map(|i| model.remove(i).meta), "step {step}");
            }
            let metas: Vec<u64> = mb.iter().map(|s| s.meta).collect();
            assert_eq!(metas, model.iter().map(|s| s.meta).collect::<Vec<_>>(), "step {step}");
            max_cap = max_cap.max(mb.rest.cap());
            wrapped |= mb.rest.head as usize + mb.rest.len as usize > mb.rest.cap();
        }
        assert!(max_cap >= 32 && wrapped, "the test should grow the ring and wrap it (capacity {max_cap})");
        let gone: Vec<u64> = mb.drain_where(|s| s.is_send() && s.peer() == 1).iter().map(|s| s.meta).collect();
        let (model_gone, model_kept): (Vec<Slot>, Vec<Slot>) =
            model.into_iter().partition(|s| s.is_send() && s.peer() == 1);
        assert_eq!(gone, model_gone.iter().map(|s| s.meta).collect::<Vec<_>>());
        assert_eq!(
            mb.iter().map(|s| s.meta).collect::<Vec<_>>(),
            model_kept.iter().map(|s| s.meta).collect::<Vec<_>>()
        );
        let w = Slot::word(true, MAX_THREAD_RANKS - 1, INTERNAL | 0xFF);
        let s = Slot { word: w, ..slot(0, false, 0) };
        assert!(s.is_send() && s.peer() == MAX_THREAD_RANKS - 1 && s.key() == INTERNAL | 0xFF);
    }

    #[test]
    fn claims_split_front_and_back_and_stale_generations_claim_nothing() {
        let c = Completion::new();
        let len = 1 << 20;
        let n = chunks(len);
        assert_eq!(n, 8);
        let g1 = c.park(len);
        // The sender takes only the back half unless told to take all.
        let back: Vec<_> = std::iter::from_fn(|| c.claim(g1, false, n.div_ceil(2))).collect();
        assert_eq!(back, (n.div_ceil(2)..n).rev().collect::<Vec<_>>());
        assert_eq!(c.claim(g1, true, 0), Some(0));
        assert_eq!(c.claim(g1, false, 0), Some(n.div_ceil(2) - 1));
        let front: Vec<_> = std::iter::from_fn(|| c.claim(g1, true, 0)).collect();
        assert_eq!(front, (1..n.div_ceil(2) - 1).collect::<Vec<_>>());
        assert_eq!(c.claim(g1, false, 0), None);
        // The completion is reused for the next pair: a claim under the old generation finds nothing.
        let g2 = c.park(len);
        assert_ne!(g1, g2);
        assert_eq!(c.claim(g1, false, 0), None);
        assert_eq!(c.claim(g1, true, 0), None);
        assert_eq!(c.claim(g2, false, 0), Some(n - 1));
        // The generation wraps within its bits and never collides with the one before.
        c.claims.store(pack_claims((1 << 24) - 1, 0, 0), Ordering::Relaxed);
        let g = c.park(len);
        assert_eq!(g, 0);
        assert_eq!(c.claim(g, true, 0), Some(0));
    }
}
