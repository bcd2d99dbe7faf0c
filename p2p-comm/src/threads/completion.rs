//! Completions: the hand-off of one mailbox operation between the two sides of a message, and the chunked copy
//! of a matched large message parked in a receive's completion.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::refs::Ref;
use crate::sync::lock;

/// How a slot ended, seen from the slot's owner.
#[derive(Debug, Clone)]
pub(super) enum Outcome {
    Ok,
    LengthMismatch {
        message_bytes: usize,
        buffer_bytes: usize,
    },
    MetaMismatch {
        ours: u64,
        theirs: u64,
    },
    PeerGone,
    /// A message in device memory that its copier failed to move (see `device.rs`).
    DeviceCopy {
        ordinal: u32,
        reason: std::sync::Arc<str>,
    },
}

/// Messages of at least this many bytes are copied by the first side to wait/test after matching (normally the
/// receiver) instead of by the second to arrive, inside `post`. Below it the copy costs less than waking the
/// peer thread, so eager copying keeps latency low.
pub(crate) const DEFER_MIN: usize = 64 << 10;

/// A matched large message waiting to be copied, parked in the receive's completion: the send's buffer and
/// completion, and the receive's buffer. Which chunks are claimed and how many bytes are copied live in that
/// completion's atomics ([`Completion::claims`], [`Completion::copied`]), so claiming a chunk takes no lock.
#[derive(Debug)]
pub(super) struct Pair {
    pub(super) sp: *const u8,
    pub(super) sc: CompletionRef,
    pub(super) rp: *mut u8,
    pub(super) len: usize,
    /// The receive completion's claim generation for this pair (see [`Completion::claims`]).
    pub(super) generation: u64,
}

/// What a send matched with a large receive holds: where the pair is parked, and what the sender needs to copy
/// its chunks without reading the pair.
#[derive(Debug)]
pub(super) struct Attachment {
    pub(super) rc: CompletionRef,
    pub(super) sp: *const u8,
    pub(super) rp: *mut u8,
    pub(super) generation: u64,
}

/// How long a waiter whose message is being copied by the peer spins for it before sleeping: a chunk
/// ([`chunk_len`], at most 4 MiB) takes under a millisecond to copy on any machine this runs on.
pub(super) const COPY_SPIN: Duration = Duration::from_millis(2);

/// Size of the chunks a matched large message is copied in: small enough that the two threads share every
/// deferred message ([`DEFER_MIN`] and up: at least two chunks each, eight for larger ones), large enough that
/// claiming and finishing a chunk costs little next to copying it (at least 32 KiB). A multiple of 4 KiB, so
/// chunks keep the buffers' alignment.
pub(super) fn chunk_len(len: usize) -> usize {
    (len / 8).clamp(32 << 10, 4 << 20) & !4095
}

/// Number of chunks of a `len`-byte message.
pub(super) fn chunks(len: usize) -> usize {
    len.div_ceil(chunk_len(len))
}

// SAFETY: the pointers are dereferenced only by whoever claims a chunk of the pair (see `copy_chunks`), while
// both requests keep their buffers borrowed (neither can finish before the last chunk's copy completes it).
unsafe impl Send for Pair {}
// SAFETY: as for `Pair`.
unsafe impl Send for Attachment {}

/// [`Completion::claims`] packs a generation (the top 24 bits), the next unclaimed chunk from the front (20 bits)
/// and the end of the unclaimed ones (the low 20 bits). 2^20 chunks of at most 4 MiB cover any message.
pub(super) const CLAIM_BITS: u32 = 20;
pub(super) const CLAIM_MASK: u64 = (1 << CLAIM_BITS) - 1;

pub(super) fn pack_claims(generation: u64, next: usize, end: usize) -> u64 {
    (generation << (2 * CLAIM_BITS)) | ((next as u64) << CLAIM_BITS) | end as u64
}

#[derive(Debug)]
pub(super) enum State {
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
/// would straddle lines that differ from one completion to the next, and each hand-off would move more lines.
#[derive(Debug)]
#[repr(C, align(64))]
pub(super) struct Completion {
    pub(super) state: Mutex<State>,
    /// How far `state` got ([`POSTED`], [`MATCHED`] or [`DONE`]), updated with it: lets a waiter spin briefly
    /// without the lock before sleeping on `cv`.
    pub(super) stage: AtomicU8,
    /// Threads sleeping on `cv`; changed only under the `state` lock. `Condvar::notify_all` is a futex syscall
    /// even with nobody waiting, and most completions have no sleeper (the waiter is spinning, copying or not
    /// there yet), so setters skip it then: two syscalls less per small message.
    pub(super) sleepers: AtomicU32,
    pub(super) cv: Condvar,
    /// For a receive matched with a large send: the generation, next and end of its unclaimed chunks
    /// ([`pack_claims`]). Both sides claim chunks with one compare-and-swap, no lock: the lock taken per claim
    /// moved between the cores several times per message. The generation changes with every pair parked here,
    /// so a sender that read its attachment before this completion was reused for another pair claims nothing.
    pub(super) claims: AtomicU64,
    /// Bytes of the parked pair whose copy finished; whoever brings it to the length completes both sides.
    pub(super) copied: AtomicUsize,
}

pub(super) const POSTED: u8 = 0;
pub(super) const MATCHED: u8 = 1;
pub(super) const DONE: u8 = 2;

impl Completion {
    pub(super) fn new() -> Completion {
        Completion {
            state: Mutex::new(State::Posted),
            cv: Condvar::new(),
            stage: AtomicU8::new(POSTED),
            sleepers: AtomicU32::new(0),
            claims: AtomicU64::new(0),
            copied: AtomicUsize::new(0),
        }
    }

    pub(super) fn set(&self, s: State) {
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
    pub(super) fn wake(&self, st: MutexGuard<'_, State>) {
        let sleeping = self.sleepers.load(Ordering::Relaxed) > 0;
        drop(st);
        if sleeping {
            self.cv.notify_all();
        }
    }

    pub(super) fn complete(&self, o: Outcome) {
        self.set(State::Done(o));
    }

    /// Completes with `o` under the lock `st` already held on `self.state`; returns what the state held.
    pub(super) fn complete_locked(&self, mut st: MutexGuard<'_, State>, o: Outcome) -> State {
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
    /// `pause`s instead of 1 leaves the line with the writer for those. Small messages keep the tight spin:
    /// their peer writes the line once, and noticing it late costs more than the line is worth.
    pub(super) fn spin(&self, stage: u8, large: bool) {
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

/// The outcomes (send's, receive's) of a matched pair that cannot be copied, or `None` if it can.
pub(super) fn mismatch(sl: usize, sm: u64, rl: usize, rm: u64) -> Option<(Outcome, Outcome)> {
    if sm != rm {
        Some((Outcome::MetaMismatch { ours: sm, theirs: rm }, Outcome::MetaMismatch { ours: rm, theirs: sm }))
    } else if sl != rl {
        let o = Outcome::LengthMismatch { message_bytes: sl, buffer_bytes: rl };
        Some((o.clone(), o))
    } else {
        None
    }
}

/// Copies a matched message (or reports why not) and completes both sides.
pub(super) fn transfer(send: (*const u8, usize, u64, &Completion), recv: (*mut u8, usize, u64, &Completion)) {
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
    pub(super) fn park(&self, len: usize) -> u64 {
        let generation = ((self.claims.load(Ordering::Relaxed) >> (2 * CLAIM_BITS)) + 1) & ((1 << 24) - 1);
        self.copied.store(0, Ordering::Relaxed);
        self.claims.store(pack_claims(generation, 0, chunks(len)), Ordering::Release);
        generation
    }

    /// Claims a chunk of the pair of `generation` parked here: the first unclaimed one (`front`), or the last one
    /// if its index is at least `min_back`. `None` if there is none (or the pair is another one).
    pub(super) fn claim(&self, generation: u64, front: bool, min_back: usize) -> Option<usize> {
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
pub(super) fn copy_chunks(
    rc: &Completion,
    generation: u64,
    sp: *const u8,
    rp: *mut u8,
    len: usize,
    front: bool,
    all: bool,
) {
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

pub(super) type CompletionRef = Ref<Completion>;

#[cfg(test)]
mod tests {
    use super::*;

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
