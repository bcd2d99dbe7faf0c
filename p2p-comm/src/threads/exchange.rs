//! One side of one exchange message on a [`Channel`](super::channel::Channel): posting it, waiting for it,
//! withdrawing it (see the channel module for the protocol).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::channel::{
    decided, CellRef, ChannelRef, Claim, Desc, Side, CLAIMED, CLAIM_SHIFT, DEPTH, GONE, LENGTH, OK, RECEIVER_CANCELLED,
    SENDER_CANCELLED,
};
use super::world::RankWorld;
use crate::error::CommError;
use crate::op::{mismatch, Op};
use crate::stats::StatsCounters;

/// A receive posted after its message arrived copies it inside `post` below this many bytes (so a small
/// exchange posted with `isendrecv` is done before the rank computes); larger ones, and any whose message is not
/// there yet, are copied in `wait`.
const EAGER_BELOW: usize = 16 << 10;

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
    /// Posts one side (`op`, by rank `me`) of an exchange message on `ch` (the channel from the sender to the
    /// receiver).
    ///
    /// # Safety
    /// `op`'s buffer must stay valid (and, for a receive, unaliased) until the returned op finishes or is
    /// dropped.
    pub(crate) unsafe fn post(
        world: Arc<RankWorld>,
        ch: ChannelRef,
        me: usize,
        op: &Op,
        stats: &Arc<StatsCounters>,
    ) -> Result<ExchangeOp, CommError> {
        let Op { is_send, peer, key, meta, ptr, len, timeout, .. } = *op;
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
            if len < EAGER_BELOW && ch.offers[slot].stamp.load(Ordering::Acquire) == stamp {
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
            self.world.gone_error(self.peer)
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
                        return Found::Err(self.world.gone_error(self.peer));
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
            Found::Outcome(_, other) => Err(mismatch(self.peer, self.meta, other)),
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
        // Only a rank giving up gets here: unwinding, or cancelling the rest of an operation that failed (one of
        // its other messages met a failed peer). Either way it is on its way out with a reason, so the peer is told
        // it went away and waits for that reason; a withdrawal without the mark reads as the peer's own timeout.
        let found = match self.ch.withdraw(self.slot, self.stamp, ours | GONE) {
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
            return Err(world.gone_error(peer));
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
