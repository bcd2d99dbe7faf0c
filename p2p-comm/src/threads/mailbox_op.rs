//! Operations matched through the mailboxes.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use super::completion::{copy_chunks, CompletionRef, Outcome, State, COPY_SPIN, DEFER_MIN, DONE, MATCHED};
use super::device::Region;
use super::world::RankWorld;
use crate::error::CommError;
use crate::op::{mismatch as meta_mismatch, INTERNAL};
use crate::stats::StatsCounters;
use crate::sync::lock;

/// An operation matched through the mailboxes.
pub(crate) struct MailboxOp {
    /// The world through the posting rank's own `Arc` (see `Endpoint::ops_world`).
    pub(super) world: Arc<RankWorld>,
    pub(super) me: usize,
    pub(super) peer: usize,
    pub(super) is_send: bool,
    pub(super) key: u64,
    /// The collective's descriptor (0 for point-to-point).
    pub(super) meta: u64,
    pub(super) len: usize,
    pub(super) timeout: Duration,
    pub(super) stats: Arc<StatsCounters>,
    /// `None` once the op has finished and its completion went back to the pool.
    pub(super) done: Option<CompletionRef>,
    /// Where the bytes lie if in device memory: what the op's slot points at until it is matched.
    pub(super) _region: Option<Arc<Region>>,
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
            Outcome::MetaMismatch { ours, theirs } => Err(meta_mismatch(self.peer, ours, theirs)),
            Outcome::PeerGone => Err(self.world.gone_error(self.peer)),
            Outcome::DeviceCopy { ordinal, reason } => {
                Err(CommError::DeviceCopy { ordinal, reason: reason.to_string() })
            }
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
                State::Done(o) => return Some(o.clone()),
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
                    // path of the next message. Bounded, in case the peer was descheduled mid-copy.
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
        if let State::Done(o) = &*st {
            let o = o.clone();
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
                    return Err(meta_mismatch(self.peer, self.meta, s.meta));
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
