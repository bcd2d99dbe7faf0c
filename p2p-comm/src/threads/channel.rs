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
//! That is the floor of any single-copy hand-off: two lines per step.
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
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crossbeam::utils::CachePadded;

use super::refs::Ref;
use crate::sync::lock;

/// Messages in flight per ordered pair before a post has to finish the oldest first (by copying it itself if
/// the peer has posted its side, else by waiting for the peer).
pub(crate) const DEPTH: usize = 8;

/// Low two bits of a post's `claim` word: who decided the message's fate. [`GONE`] is or-ed into a withdrawal by
/// a rank that is going away (unwinding, or cancelling the rest of an operation that failed). The stamp of the message is above the three bits ([`CLAIM_SHIFT`]).
pub(super) const CLAIMED: u64 = 1;
pub(super) const SENDER_CANCELLED: u64 = 2;
pub(super) const RECEIVER_CANCELLED: u64 = 3;
pub(super) const GONE: u64 = 4;
pub(super) const CLAIM_SHIFT: u32 = 3;

/// Low bits of a cell's word: the outcome. The ticket of the operation is above them.
pub(super) const OK: u64 = 1;
pub(super) const LENGTH: u64 = 2;
pub(super) const META: u64 = 3;

/// One side of a message as that side describes it: its key and descriptor, its buffer, and the cell (with the
/// ticket) where its outcome goes.
#[derive(Clone, Copy)]
pub(super) struct Desc {
    pub(super) key: u64,
    pub(super) meta: u64,
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
    pub(super) cell: *mut Cell,
    pub(super) ticket: u64,
}

/// A [`Desc`] in atomics: written by its side before it publishes the slot's stamp, read by the other side
/// after it has seen that stamp.
#[derive(Default)]
pub(super) struct SharedDesc {
    pub(super) key: AtomicU64,
    pub(super) meta: AtomicU64,
    pub(super) ptr: AtomicPtr<u8>,
    pub(super) len: AtomicUsize,
    pub(super) cell: AtomicPtr<Cell>,
    pub(super) ticket: AtomicU64,
}

impl SharedDesc {
    pub(super) fn store(&self, d: Desc) {
        self.key.store(d.key, Ordering::Relaxed);
        self.meta.store(d.meta, Ordering::Relaxed);
        self.ptr.store(d.ptr, Ordering::Relaxed);
        self.len.store(d.len, Ordering::Relaxed);
        self.cell.store(d.cell, Ordering::Relaxed);
        self.ticket.store(d.ticket, Ordering::Relaxed);
    }

    pub(super) fn load(&self) -> Desc {
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
pub(super) struct Offer {
    pub(super) stamp: AtomicU64,
    pub(super) desc: SharedDesc,
}

/// The receiver's line of a slot: its posted receive (`stamp` published last) and the claim.
#[repr(C, align(64))]
#[derive(Default)]
pub(super) struct Post {
    pub(super) claim: AtomicU64,
    pub(super) stamp: AtomicU64,
    pub(super) desc: SharedDesc,
}

const _: () = assert!(std::mem::size_of::<Offer>() == 64 && std::mem::size_of::<Post>() == 64);

/// Per side of a channel, written by that side only: the next message number, and per slot the last message
/// whose operation on this side finished, as `stamp << 1 | withdrawn` (so a post checks its slot without reading
/// the peer's lines, unless that message was withdrawn).
#[repr(C, align(64))]
#[derive(Default)]
pub(super) struct Side {
    pub(super) next: AtomicU64,
    pub(super) finished: [AtomicU64; DEPTH],
}

/// Where one operation learns its outcome: `word` is the operation's ticket shifted left by 2, or-ed with the
/// outcome; `detail` is the other side's length (length mismatch) or descriptor (descriptor mismatch).
#[repr(C, align(64))]
#[derive(Default)]
pub(crate) struct Cell {
    pub(super) word: AtomicU64,
    pub(super) detail: AtomicU64,
}

/// The channel of one ordered pair of ranks.
#[derive(Default)]
pub(crate) struct Channel {
    pub(super) send_side: Side,
    pub(super) recv_side: Side,
    pub(super) offers: [Offer; DEPTH],
    pub(super) posts: [Post; DEPTH],
    /// Threads sleeping on `cv` for something in this channel; writers check it after publishing.
    pub(super) sleepers: CachePadded<AtomicU32>,
    pub(super) bell: Mutex<()>,
    pub(super) cv: Condvar,
}

pub(crate) type ChannelRef = Ref<Channel>;
pub(crate) type CellRef = Ref<Cell>;

pub(super) fn decided(claim: u64, stamp: u64) -> bool {
    claim >> CLAIM_SHIFT >= stamp
}

/// How a claim went.
pub(super) enum Claim {
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
    /// publication. A release store in its place would let the peer's core see the sleeper count before the
    /// store (and it is no cheaper: the store waits for the peer's line at the next locked instruction anyway).
    pub(super) fn ring(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = lock(&self.bell);
            self.cv.notify_all();
        }
    }

    /// Sleeps until rung or for at most `max`, unless `ready` already holds. `max` bounds the sleep for what a
    /// waiter checks on its own: its deadline and whether its peer is gone.
    pub(super) fn sleep(&self, max: Duration, ready: impl Fn() -> bool) {
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
    pub(super) fn settle(&self, slot: usize, stamp: u64) -> Claim {
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
    pub(super) fn withdraw(&self, slot: usize, stamp: u64, who: u64) -> Result<(), u64> {
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

#[cfg(test)]
mod tests {
    #[test]
    fn a_channel_is_about_one_and_a_half_kib() {
        let size = std::mem::size_of::<super::Channel>();
        assert!((1024..=2048).contains(&size), "{size} bytes");
    }
}
