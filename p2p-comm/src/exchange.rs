//! Exchange channels of the threads transport: how the ring shift and the collectives' steps move.
//!
//! In an exchange every rank posts a receive and a send at once and its peers do the same, in the same order
//! (every rank calls the same collectives and ring shifts in the same order, which the collectives'
//! descriptors check). So the `k`-th exchange send from rank `s` to rank `d` and the `k`-th exchange receive of
//! `d` from `s` belong together, and need no matching: each ordered pair `(s, d)` has a [`Channel`] in which the
//! sender numbers its sends and the receiver its receives, and message `k` lives in slot `k % DEPTH` on both
//! sides.
//!
//! The point is what moves between the cores. The mailbox path of the rest of the transport matches under a
//! lock that both ranks take, and hands completions over through lines that both write: about ten cache-line
//! hand-offs per ring step, which at 4-64 KiB took more time than the copy. Here, in the usual order:
//! - the receiver writes its receive into its own line of the slot (the [`Post`]), which the sender reads only
//!   if it ever has to copy itself;
//! - the sender writes its send into its own line (the [`Offer`]);
//! - the receiver reads the offer (one hand-off), claims the message in its own post line, copies, and writes
//!   the outcome into the sender's [`Cell`] (one hand-off), which the sender is polling.
//!
//! That is the floor of any single-copy hand-off: the bench's ring floor moves two lines per step the same way.
//!
//! Whoever copies first claims the message with one compare-and-swap on the post line's `claim` word: the
//! receiver normally, the sender if its receiver has posted but not come to copy for a while (it is busy
//! elsewhere, and a send must complete without it), or either side on behalf of an earlier message whose slot
//! it needs. A side that gives up (timeout, peer gone, unwinding) withdraws with the same compare-and-swap, so
//! a message is copied or withdrawn, never both: once claimed, neither side touches the other's buffer except
//! for that one copy, and the copier writes both outcomes. The outcome of an operation goes to a [`Cell`] of
//! its own, taken from its rank's pool and stamped with a fresh ticket, so it is never overwritten by a later
//! message in the same slot.
//!
//! Failures:
//! - a message whose two sides disagree (ranks calling different collectives, or sizes) fails both at once
//!   with the collectives' mismatch error or a length mismatch, and the channel stays in step;
//! - a message withdrawn by one side fails the other side's operation when it looks (at once, or when it is
//!   posted later). Its slot is reused only after both sides' operations on it finished (see [`free_slot`]), so
//!   a run of timeouts never leaves an operation waiting for an outcome that cannot come. A post whose slot
//!   does not free up in time fails without taking a message number, and two ranks that timed out on different
//!   numbers of exchanges get back in step after the difference has failed on the other side;
//! - a waiter spins, then yields, then sleeps on the channel's condition variable, and every publication rings
//!   it (see [`Channel::ring`]); a sleeper also wakes every millisecond to look at its deadline and its peer.
//!
//! A channel takes about 1.5 KiB and is created the first time its pair exchanges: a ring needs two per rank,
//! an `all_to_all` of `n` threads `n - 1` per rank (6 MiB in all for 64 ranks).

use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam::utils::CachePadded;

use crate::stats::StatsCounters;
use crate::threads::{lock, RankWorld, Ref};
use crate::CommError;

/// Messages in flight per ordered pair before a post has to finish the oldest first (by copying it itself if
/// the peer has posted its side, else by waiting for the peer).
pub(crate) const DEPTH: usize = 8;

/// Low two bits of a post's `claim` word: who decided the message's fate. [`GONE`] is or-ed into a withdrawal by
/// a rank that is going away (unwinding). The stamp of the message is above the three bits ([`CLAIM_SHIFT`]).
const CLAIMED: u64 = 1;
const SENDER_CANCELLED: u64 = 2;
const RECEIVER_CANCELLED: u64 = 3;
const GONE: u64 = 4;
const CLAIM_SHIFT: u32 = 3;

/// Low bits of a cell's word: the outcome. The ticket of the operation is above them.
const OK: u64 = 1;
const LENGTH: u64 = 2;
const META: u64 = 3;

/// One side of a message as that side describes it: its key and descriptor, its buffer, and the cell (with the
/// ticket) where its outcome goes.
#[derive(Clone, Copy)]
struct Desc {
    key: u64,
    meta: u64,
    ptr: *mut u8,
    len: usize,
    cell: *mut Cell,
    ticket: u64,
}

/// A [`Desc`] in atomics: written by its side before it publishes the slot's stamp, read by the other side
/// after it has seen that stamp.
#[derive(Default)]
struct SharedDesc {
    key: AtomicU64,
    meta: AtomicU64,
    ptr: AtomicPtr<u8>,
    len: AtomicUsize,
    cell: AtomicPtr<Cell>,
    ticket: AtomicU64,
}

impl SharedDesc {
    fn store(&self, d: Desc) {
        self.key.store(d.key, Ordering::Relaxed);
        self.meta.store(d.meta, Ordering::Relaxed);
        self.ptr.store(d.ptr, Ordering::Relaxed);
        self.len.store(d.len, Ordering::Relaxed);
        self.cell.store(d.cell, Ordering::Relaxed);
        self.ticket.store(d.ticket, Ordering::Relaxed);
    }

    fn load(&self) -> Desc {
        Desc {
            key: self.key.load(Ordering::Relaxed),
            meta: self.meta.load(Ordering::Relaxed),
            ptr: self.ptr.load(Ordering::Relaxed),
            len: self.len.load(Ordering::Relaxed),
            cell: self.cell.load(Ordering::Relaxed),
            ticket: self.ticket.load(Ordering::Relaxed),
        }
    }
}

/// The sender's line of a slot. `stamp` is the message number plus one (0: none yet), published last.
#[repr(C, align(64))]
#[derive(Default)]
struct Offer {
    stamp: AtomicU64,
    desc: SharedDesc,
}

/// The receiver's line of a slot: its posted receive (`stamp` published last) and the claim.
#[repr(C, align(64))]
#[derive(Default)]
struct Post {
    claim: AtomicU64,
    stamp: AtomicU64,
    desc: SharedDesc,
}

const _: () = assert!(std::mem::size_of::<Offer>() == 64 && std::mem::size_of::<Post>() == 64);

/// Per side of a channel, written by that side only: the next message number, and per slot the last message
/// whose operation on this side finished, as `stamp << 1 | withdrawn` (so a post checks its slot without reading
/// the peer's lines, unless that message was withdrawn).
#[repr(C, align(64))]
#[derive(Default)]
struct Side {
    next: AtomicU64,
    finished: [AtomicU64; DEPTH],
}

/// Where one operation learns its outcome: `word` is the operation's ticket shifted left by 2, or-ed with the
/// outcome; `detail` is the other side's length (length mismatch) or descriptor (descriptor mismatch).
#[repr(C, align(64))]
#[derive(Default)]
pub(crate) struct Cell {
    word: AtomicU64,
    detail: AtomicU64,
}

/// The channel of one ordered pair of ranks.
#[derive(Default)]
pub(crate) struct Channel {
    send_side: Side,
    recv_side: Side,
    offers: [Offer; DEPTH],
    posts: [Post; DEPTH],
    /// Threads sleeping on `cv` for something in this channel; writers check it after publishing.
    sleepers: CachePadded<AtomicU32>,
    bell: Mutex<()>,
    cv: Condvar,
}

pub(crate) type ChannelRef = Ref<Channel>;
pub(crate) type CellRef = Ref<Cell>;

fn decided(claim: u64, stamp: u64) -> bool {
    claim >> CLAIM_SHIFT >= stamp
}

/// How a claim went.
enum Claim {
    /// We copied (or found the message unacceptable) and wrote both outcomes.
    Settled,
    /// The message's fate was decided by someone else: the low bits of its claim word.
    Lost(u64),
}

impl Channel {
    /// Wakes the sleepers, if any, after a publication.
    ///
    /// Every publication that a sleeper may wait for (an offer, a post, an outcome, a withdrawal) is a
    /// sequentially consistent read-modify-write, and a sleeper registers in `sleepers` (also sequentially
    /// consistent) before its last look: so either the publisher sees the sleeper, or the sleeper sees the
    /// publication. The release store that the publication replaces left the peer's core to see the sleeper count
    /// before the store (a 4 KiB ring step also ran 5-8% slower with it: the store waited for the peer's line at
    /// the next locked instruction anyway, and later).
    fn ring(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = lock(&self.bell);
            self.cv.notify_all();
        }
    }

    /// Sleeps until rung or for at most `max`, unless `ready` already holds. `max` bounds the sleep for what a
    /// waiter checks on its own: its deadline and whether its peer is gone.
    fn sleep(&self, max: Duration, ready: impl Fn() -> bool) {
        let g = lock(&self.bell);
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        if !ready() {
            let _ = self.cv.wait_timeout(g, max);
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Wakes every sleeper (a rank went away: they have to look at it).
    pub(crate) fn wake_all(&self) {
        let _g = lock(&self.bell);
        self.cv.notify_all();
    }

    /// Claims message `stamp` (in `slot`, whose offer and post are both published for it) and copies it, or
    /// reports who decided it.
    fn settle(&self, slot: usize, stamp: u64) -> Claim {
        let p = &self.posts[slot];
        // Read both sides before claiming: once claimed, the slot may be reused by the next message.
        let (s, r) = (self.offers[slot].desc.load(), p.desc.load());
        let mut cur = p.claim.load(Ordering::Acquire);
        loop {
            if decided(cur, stamp) {
                return Claim::Lost(cur & 7);
            }
            match p.claim.compare_exchange_weak(
                cur,
                stamp << CLAIM_SHIFT | CLAIMED,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(x) => cur = x,
            }
        }
        // Both stamps were read as `stamp` before the claim and neither side reuses its line before the claim is
        // decided, so the fields read above are this message's.
        let (code, to_sender, to_receiver) = if s.key != r.key || s.meta != r.meta {
            (META, r.meta, s.meta)
        } else if s.len != r.len {
            (LENGTH, r.len as u64, s.len as u64)
        } else {
            // SAFETY: both operations keep their buffers borrowed until their cells are written below; the claim
            // makes us the only copier; a send and a receive buffer never overlap.
            unsafe {
                if s.len >= crate::copy::STREAM_MIN {
                    crate::copy::copy_stream(s.ptr, r.ptr, s.len);
                } else {
                    crate::copy::copy(s.ptr, r.ptr, s.len);
                }
            }
            (OK, 0, 0)
        };
        // SAFETY: cells live as long as the world; each is owned by an operation waiting for exactly this ticket.
        unsafe {
            (*s.cell).detail.store(to_sender, Ordering::Relaxed);
            (*s.cell).word.swap(s.ticket << 2 | code, Ordering::SeqCst);
            (*r.cell).detail.store(to_receiver, Ordering::Relaxed);
            (*r.cell).word.swap(r.ticket << 2 | code, Ordering::SeqCst);
        }
        self.ring();
        Claim::Settled
    }

    /// Withdraws message `stamp` in `slot` for one side (`who`: [`SENDER_CANCELLED`] or [`RECEIVER_CANCELLED`],
    /// with [`GONE`] if the rank is going away): `Ok` if withdrawn, else the low bits of the claim that decided it
    /// first.
    fn withdraw(&self, slot: usize, stamp: u64, who: u64) -> Result<(), u64> {
        let p = &self.posts[slot];
        let mut cur = p.claim.load(Ordering::Acquire);
        loop {
            if decided(cur, stamp) {
                return Err(cur & 7);
            }
            match p.claim.compare_exchange_weak(cur, stamp << CLAIM_SHIFT | who, Ordering::SeqCst, Ordering::Acquire) {
                Ok(_) => {
                    self.ring();
                    return Ok(());
                }
                Err(x) => cur = x,
            }
        }
    }
}

/// Polls of a waiting operation before it first reads the clock.
const FAST_POLLS: u32 = 2000;

/// How long a waiting side spins before it copies a send into its posted receive itself, yields, and then
/// sleeps (a ring step's copy takes a few µs).
const PATIENCE: Duration = Duration::from_micros(20);

/// How long a side that knows the peer is copying spins for the result before sleeping: a sleep and wake-up
/// cost tens of µs on the path of the next message, and a copy of any message this carries in one piece ends in
/// a few ms.
const COPY_SPIN: Duration = Duration::from_millis(2);

/// The longest a sleeper sleeps before looking again at its deadline and at its peer.
const NAP: Duration = Duration::from_millis(1);

/// One side of one exchange message.
pub(crate) struct ExchangeOp {
    world: Arc<RankWorld>,
    ch: ChannelRef,
    is_send: bool,
    me: usize,
    peer: usize,
    slot: usize,
    stamp: u64,
    key: u64,
    meta: u64,
    len: usize,
    cell: CellRef,
    ticket: u64,
    timeout: Duration,
    stats: Arc<StatsCounters>,
    /// When `test` first found the op unfinished.
    first_test: Option<Instant>,
    finished: bool,
}

/// What an operation's wait found.
enum Found {
    Outcome(u64, u64),
    Err(CommError),
}

impl ExchangeOp {
    /// Posts one side of an exchange message on `ch` (the channel from the sender to the receiver).
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid (and, for a receive, unaliased) until the returned op finishes or is
    /// dropped.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn post(
        world: Arc<RankWorld>,
        ch: ChannelRef,
        is_send: bool,
        me: usize,
        peer: usize,
        key: u64,
        meta: u64,
        ptr: *mut u8,
        len: usize,
        eager_below: usize,
        timeout: Duration,
        stats: &Arc<StatsCounters>,
    ) -> Result<ExchangeOp, CommError> {
        let side = if is_send { &ch.send_side } else { &ch.recv_side };
        // The number is taken only once its slot is free, so a post that fails leaves no message behind.
        let n = loop {
            let n = side.next.load(Ordering::Acquire);
            let (slot, stamp) = ((n % DEPTH as u64) as usize, n + 1);
            // The slot's previous message: if our operation on it finished with an outcome, the slot is free.
            if stamp > DEPTH as u64 && side.finished[slot].load(Ordering::Relaxed) != (stamp - DEPTH as u64) << 1 {
                free_slot(&world, ch, peer, slot, stamp - DEPTH as u64, is_send, timeout)?;
            }
            if side.next.compare_exchange(n, n + 1, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                break n;
            }
        };
        let slot = (n % DEPTH as u64) as usize;
        let stamp = n + 1;
        let (cell, ticket) = world.exchange_cell(me, is_send);
        let op = ExchangeOp {
            world,
            ch,
            is_send,
            me,
            peer,
            slot,
            stamp,
            key,
            meta,
            len,
            cell,
            ticket,
            timeout,
            stats: stats.clone(),
            first_test: None,
            finished: false,
        };
        let desc = Desc { key, meta, ptr, len, cell: cell.as_ptr(), ticket };
        if is_send {
            let o = &ch.offers[slot];
            o.desc.store(desc);
            o.stamp.swap(stamp, Ordering::SeqCst);
            ch.ring();
        } else {
            let p = &ch.posts[slot];
            p.desc.store(desc);
            p.stamp.swap(stamp, Ordering::SeqCst);
            ch.ring();
            // A small message whose send is already here is copied now, while it is cheap and the line is warm.
            if len < eager_below && ch.offers[slot].stamp.load(Ordering::Acquire) == stamp {
                let _ = ch.settle(slot, stamp);
            }
        }
        Ok(op)
    }

    fn outcome(&self) -> Option<(u64, u64)> {
        let w = self.cell.word.load(Ordering::Acquire);
        (w >> 2 == self.ticket).then(|| (w & 3, self.cell.detail.load(Ordering::Relaxed)))
    }

    /// Tries to move the message along from our side: a receive copies a send that has arrived, a send (only if
    /// `take_over`) copies into a posted receive. Returns what decided the message if someone else did.
    fn push(&self, take_over: bool) -> Option<u64> {
        let ch = &self.ch;
        let ready = if self.is_send {
            take_over && ch.posts[self.slot].stamp.load(Ordering::Acquire) == self.stamp
        } else {
            ch.offers[self.slot].stamp.load(Ordering::Acquire) == self.stamp
        };
        if ready {
            if let Claim::Lost(who) = ch.settle(self.slot, self.stamp) {
                return Some(who);
            }
            return None;
        }
        // A claim word already past our message means the peer's side moved on, which it does only after our
        // message was claimed (our outcome is on its way) or after we finished (see `free_slot`).
        let c = ch.posts[self.slot].claim.load(Ordering::Acquire);
        match (c >> CLAIM_SHIFT).cmp(&self.stamp) {
            std::cmp::Ordering::Less => None,
            std::cmp::Ordering::Equal => Some(c & 7),
            std::cmp::Ordering::Greater => Some(CLAIMED),
        }
    }

    /// The error for a message the peer withdrew (`how`: the claim's low bits): it timed out or went away.
    fn withdrawn_by_peer(&self, how: u64) -> CommError {
        if how & GONE == 0 && self.world.alive[self.peer].load(Ordering::SeqCst) {
            CommError::Timeout { op: self.op_name(), peer: self.peer, after: self.timeout }
        } else {
            CommError::PeerGone { rank: self.peer }
        }
    }

    fn op_name(&self) -> &'static str {
        if self.is_send {
            "send"
        } else {
            "recv"
        }
    }

    /// Waits for the outcome, for at most `timeout` (then withdraws if nobody claimed the message yet).
    fn wait_found(&self, timeout: Option<Duration>) -> Found {
        // First a tight spin without reading the clock (each read costs as much as a few polls): a receive on its
        // offer line, copying as soon as the send is there; a send on its own cell only, so that the receiver's
        // lines stay in the receiver's cache.
        for _ in 0..FAST_POLLS {
            if let Some((code, detail)) = self.outcome() {
                return Found::Outcome(code, detail);
            }
            if !self.is_send && self.ch.offers[self.slot].stamp.load(Ordering::Acquire) == self.stamp {
                break;
            }
            std::hint::spin_loop();
        }
        let ours = if self.is_send { SENDER_CANCELLED } else { RECEIVER_CANCELLED };
        let start = Instant::now();
        let deadline = timeout.and_then(|t| start.checked_add(t));
        let mut copy_spin_end: Option<Instant> = None;
        loop {
            if let Some((code, detail)) = self.outcome() {
                return Found::Outcome(code, detail);
            }
            // A send copies into its posted receive itself once the receiver has had time to come.
            let now = Instant::now();
            let take_over = now - start >= PATIENCE;
            match self.push(take_over) {
                Some(CLAIMED) => {
                    // The peer is copying: its outcome comes within a copy's time.
                    let end = *copy_spin_end.get_or_insert_with(|| now + COPY_SPIN);
                    if now < end {
                        for _ in 0..64 {
                            std::hint::spin_loop();
                        }
                    } else {
                        self.ch.sleep(NAP, || self.outcome().is_some());
                    }
                    continue;
                }
                // Withdrawn by the peer (after withdrawing ours we return at once).
                Some(w) if w & 3 != ours => return Found::Err(self.withdrawn_by_peer(w)),
                Some(_) | None => {}
            }
            if self.outcome().is_some() {
                continue;
            }
            if !self.world.alive[self.peer].load(Ordering::SeqCst) {
                // Whatever the peer published is still borrowed by its operations; look once more, then withdraw.
                if self.push(true).is_none() && self.outcome().is_none() {
                    if let Ok(()) = self.ch.withdraw(self.slot, self.stamp, ours) {
                        return Found::Err(CommError::PeerGone { rank: self.peer });
                    }
                }
                continue;
            }
            if deadline.is_some_and(|d| now >= d) {
                if let Ok(()) = self.ch.withdraw(self.slot, self.stamp, ours) {
                    return Found::Err(CommError::Timeout { op: self.op_name(), peer: self.peer, after: self.timeout });
                }
                continue;
            }
            if now - start < PATIENCE {
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            } else if now - start < PATIENCE * 4 {
                std::thread::yield_now();
            } else {
                let (slot, stamp, ch, is_send) = (self.slot, self.stamp, self.ch, self.is_send);
                self.ch.sleep(NAP, move || {
                    self.outcome().is_some()
                        || if is_send {
                            ch.posts[slot].stamp.load(Ordering::Acquire) == stamp
                        } else {
                            ch.offers[slot].stamp.load(Ordering::Acquire) == stamp
                        }
                });
            }
        }
    }

    fn finish(&mut self, found: Found) -> Result<(), CommError> {
        self.finished = true;
        if self.is_send {
            // The next send's offer line: fetch it for writing now, while nobody needs it, so that its stores do
            // not wait on the peer's cache when they are on the path of the next message.
            prefetch_for_write(&self.ch.offers[(self.slot + 1) % DEPTH]);
        }
        let side = if self.is_send { &self.ch.send_side } else { &self.ch.recv_side };
        let withdrawn = matches!(found, Found::Err(_));
        side.finished[self.slot].fetch_max(self.stamp << 1 | withdrawn as u64, Ordering::Relaxed);
        self.world.recycle_exchange_cell(self.me, self.is_send, self.cell, self.ticket);
        let (src, dst) = if self.is_send { (self.me, self.peer) } else { (self.peer, self.me) };
        match found {
            Found::Outcome(OK, _) => {
                self.stats.record(self.is_send, self.len);
                Ok(())
            }
            Found::Outcome(LENGTH, other) => {
                let (message_bytes, buffer_bytes) =
                    if self.is_send { (self.len, other as usize) } else { (other as usize, self.len) };
                Err(CommError::LengthMismatch { src, dst, tag: self.key, message_bytes, buffer_bytes })
            }
            Found::Outcome(_, other) => Err(crate::collectives::mismatch(self.peer, self.meta, other)),
            Found::Err(e) => Err(e),
        }
    }

    /// Waits up to the timeout; on timeout the message is withdrawn (unless a copy is already running).
    pub(crate) fn wait(&mut self) -> Result<(), CommError> {
        if self.finished {
            return Ok(());
        }
        let found = self.wait_found(Some(self.timeout));
        self.finish(found)
    }

    /// Non-blocking completion check (a receive whose send has arrived copies it).
    pub(crate) fn test(&mut self) -> Result<bool, CommError> {
        if self.finished {
            return Ok(true);
        }
        if self.outcome().is_none() {
            // A send polled for a while copies into its posted receive itself, as a waiting one does: its
            // receiver may be blocked on something that needs this rank.
            let first = *self.first_test.get_or_insert_with(Instant::now);
            if let Some(w) = self.push(self.is_send && first.elapsed() >= PATIENCE) {
                if w != CLAIMED {
                    let e = self.withdrawn_by_peer(w);
                    return self.finish(Found::Err(e)).map(|()| true);
                }
            }
        }
        match self.outcome() {
            Some((code, detail)) => self.finish(Found::Outcome(code, detail)).map(|()| true),
            None if !self.world.alive[self.peer].load(Ordering::SeqCst) => self.wait().map(|()| true),
            None => Ok(false),
        }
    }

    /// Withdraws the message if nobody claimed it yet, else waits for the running copy.
    pub(crate) fn cancel(mut self) {
        self.withdraw_or_finish();
    }

    fn withdraw_or_finish(&mut self) {
        if self.finished {
            return;
        }
        let ours = if self.is_send { SENDER_CANCELLED } else { RECEIVER_CANCELLED };
        let gone = if std::thread::panicking() { GONE } else { 0 };
        let found = match self.ch.withdraw(self.slot, self.stamp, ours | gone) {
            Ok(()) => Found::Err(CommError::Timeout { op: self.op_name(), peer: self.peer, after: Duration::ZERO }),
            Err(CLAIMED) => self.wait_found(None),
            Err(w) => Found::Err(self.withdrawn_by_peer(w)),
        };
        let _ = self.finish(found);
    }
}

impl Drop for ExchangeOp {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if std::thread::panicking() {
            // Unwinding: withdraw so the peer learns quickly that this rank is gone.
            self.withdraw_or_finish();
        } else {
            // Keep the buffer borrowed until the op finishes, times out or its peer leaves.
            let _ = self.wait();
        }
    }
}

/// Makes `slot` of `ch` free for this side's next message: message `old` (the slot's previous one) must be
/// decided. Copies it ourselves when both sides are posted, else waits for the peer to post its side.
///
/// A withdrawn message leaves no outcome in the cells: each side's operation learns of it from the claim word,
/// and an operation that finds the claim word past its own message takes that for a copy whose outcome is on its
/// way. So the slot of a withdrawn message is reused only once both sides' operations on it have finished.
fn free_slot(
    world: &RankWorld,
    ch: ChannelRef,
    peer: usize,
    slot: usize,
    old: u64,
    is_send: bool,
    timeout: Duration,
) -> Result<(), CommError> {
    let start = Instant::now();
    let deadline = start.checked_add(timeout);
    let finished = |side: &Side| side.finished[slot].load(Ordering::Relaxed) >> 1 >= old;
    let is_free = || {
        let c = ch.posts[slot].claim.load(Ordering::Acquire);
        let claimed = c >> CLAIM_SHIFT > old || c & 3 == CLAIMED;
        decided(c, old) && (claimed || (finished(&ch.send_side) && finished(&ch.recv_side)))
    };
    loop {
        if is_free() {
            return Ok(());
        }
        let both =
            ch.offers[slot].stamp.load(Ordering::Acquire) == old && ch.posts[slot].stamp.load(Ordering::Acquire) == old;
        if both {
            let _ = ch.settle(slot, old);
            continue;
        }
        if !world.alive[peer].load(Ordering::SeqCst) {
            return Err(CommError::PeerGone { rank: peer });
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            let op = if is_send { "send" } else { "recv" };
            return Err(CommError::Timeout { op, peer, after: timeout });
        }
        if now - start < PATIENCE {
            std::hint::spin_loop();
        } else {
            ch.sleep(NAP, is_free);
        }
    }
}

/// Asks the core to fetch `x`'s cache line in the exclusive state (a hint: nothing happens where unsupported).
fn prefetch_for_write<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetchw` only hints the cache (it never faults and changes no memory); CPUs without PRFCHW
    // execute it as a no-op.
    unsafe {
        std::arch::asm!("prefetchw [{0}]", in(reg) x as *const T, options(nostack, preserves_flags, readonly));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_channel_is_about_one_and_a_half_kib() {
        let size = std::mem::size_of::<super::Channel>();
        assert!((1024..=2048).contains(&size), "{size} bytes");
    }
}
