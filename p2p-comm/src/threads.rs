//! The threads transport: every rank is a thread of one process.
//!
//! Matching is rendezvous with a single copy. Each rank `d` owns a mailbox holding the sends addressed to it
//! that no receive has matched yet and the receives it posted that no send has matched yet. Whoever arrives
//! second (the sender finding a posted receive, or the receiver finding a posted send) removes the other's slot
//! under the mailbox lock, releases the lock and copies straight from the send buffer into the receive buffer,
//! then completes both slots. The posting side's [`Request`](crate::Request) borrows its buffer until its slot
//! completes, so the copy reads and writes live memory. Slots are matched first-in first-out per (source, tag).
//!
//! Completions are pooled per rank and the mailbox queues keep their capacity, so a steady-state exchange of
//! a given shape allocates nothing.
//!
//! When a rank's communicator is dropped (normally or while its thread unwinds from a panic) the rank is marked
//! gone and every slot waiting on it completes with [`CommError::PeerGone`].

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

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

#[derive(Debug)]
enum State {
    Posted,
    Done(Outcome),
}

#[derive(Debug)]
struct Completion {
    state: Mutex<State>,
    cv: Condvar,
    /// Set with `state` when done: lets a waiter spin briefly without the lock before sleeping on `cv`.
    flag: AtomicBool,
}

impl Completion {
    fn complete(&self, o: Outcome) {
        *lock(&self.state) = State::Done(o);
        self.flag.store(true, Ordering::Release);
        self.cv.notify_all();
    }

    /// Spins (then yields) for a few microseconds hoping the peer completes us, which avoids a futex sleep and
    /// wake-up (tens of µs) on latency-bound exchanges.
    fn spin(&self) {
        for i in 0..200 {
            if self.flag.load(Ordering::Acquire) {
                return;
            }
            if i < 50 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// A posted, unmatched operation. `ptr` points into the owner's buffer, which the owner's request borrows.
struct Slot {
    /// For a send: the sending rank. For a receive: the rank it receives from.
    peer: usize,
    key: u64,
    meta: u64,
    ptr: *mut u8,
    len: usize,
    done: Arc<Completion>,
}

// SAFETY: `ptr` is only dereferenced by the rank that removes the slot from its queue, while the owner's request
// keeps the buffer borrowed (it cannot complete, and so cannot release the borrow, before `done` is completed).
unsafe impl Send for Slot {}

#[derive(Default)]
struct Queues {
    sends: VecDeque<Slot>,
    recvs: VecDeque<Slot>,
}

struct SplitEntry {
    world: Arc<World>,
    remaining: usize,
}

/// State shared by the ranks of one threads communicator (one per communicator: sub-communicators get their
/// own, so their traffic never meets the parent's).
pub(crate) struct World {
    size: usize,
    mailboxes: Box<[Mutex<Queues>]>,
    alive: Box<[AtomicBool]>,
    pools: Box<[Mutex<Vec<Arc<Completion>>>]>,
    splits: Mutex<HashMap<(u64, u32), SplitEntry>>,
}

impl World {
    pub(crate) fn new(size: usize) -> Arc<World> {
        Arc::new(World {
            size,
            mailboxes: (0..size).map(|_| Mutex::new(Queues::default())).collect(),
            alive: (0..size).map(|_| AtomicBool::new(true)).collect(),
            pools: (0..size).map(|_| Mutex::new(Vec::new())).collect(),
            splits: Mutex::new(HashMap::new()),
        })
    }

    fn completion(&self, rank: usize) -> Arc<Completion> {
        let c = lock(&self.pools[rank]).pop().unwrap_or_else(|| {
            Arc::new(Completion { state: Mutex::new(State::Posted), cv: Condvar::new(), flag: AtomicBool::new(false) })
        });
        *lock(&c.state) = State::Posted;
        c.flag.store(false, Ordering::Relaxed);
        c
    }

    fn recycle(&self, rank: usize, c: Arc<Completion>) {
        lock(&self.pools[rank]).push(c);
    }
}

/// Copies a matched message (or reports why not) and completes both sides.
fn transfer(send: (*const u8, usize, u64, &Completion), recv: (*mut u8, usize, u64, &Completion)) {
    let (sp, sl, sm, sc) = send;
    let (rp, rl, rm, rc) = recv;
    let (so, ro) = if sm != rm {
        (Outcome::MetaMismatch { ours: sm, theirs: rm }, Outcome::MetaMismatch { ours: rm, theirs: sm })
    } else if sl != rl {
        let o = Outcome::LengthMismatch { message_bytes: sl, buffer_bytes: rl };
        (o, o)
    } else {
        // SAFETY: both buffers are borrowed by requests that cannot finish before their completions below are
        // set; they belong to different requests, so they do not overlap (a `&[T]` and a `&mut [T]` never alias).
        unsafe { crate::copy::copy(sp, rp, sl) };
        (Outcome::Ok, Outcome::Ok)
    };
    sc.complete(so);
    rc.complete(ro);
}

/// One rank's handle on a [`World`]. Dropping it marks the rank gone.
pub(crate) struct Endpoint {
    pub(crate) world: Arc<World>,
    pub(crate) rank: usize,
}

impl Endpoint {
    pub(crate) fn size(&self) -> usize {
        self.world.size
    }

    /// Posts a send (`is_send`) or a receive of `len` bytes at `ptr`.
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
        timeout: Duration,
        stats: &Arc<StatsCounters>,
    ) -> Result<ThreadOp, CommError> {
        let w = &self.world;
        let me = self.rank;
        let c = w.completion(me);
        let mbox = if is_send { peer } else { me };
        let mut q = lock(&w.mailboxes[mbox]);
        let matched = if is_send {
            let pos = q.recvs.iter().position(|s| s.peer == me && s.key == key);
            pos.and_then(|i| q.recvs.remove(i))
        } else {
            let pos = q.sends.iter().position(|s| s.peer == peer && s.key == key);
            pos.and_then(|i| q.sends.remove(i))
        };
        match matched {
            Some(other) => {
                drop(q);
                if is_send {
                    transfer((ptr, len, meta, &c), (other.ptr, other.len, other.meta, &other.done));
                } else {
                    transfer((other.ptr, other.len, other.meta, &other.done), (ptr, len, meta, &c));
                }
            }
            None => {
                if !w.alive[peer].load(Ordering::SeqCst) {
                    drop(q);
                    w.recycle(me, c);
                    return Err(CommError::PeerGone { rank: peer });
                }
                let slot = Slot { peer: if is_send { me } else { peer }, key, meta, ptr, len, done: c.clone() };
                if is_send {
                    q.sends.push_back(slot);
                } else {
                    q.recvs.push_back(slot);
                }
            }
        }
        Ok(ThreadOp { world: w.clone(), me, peer, is_send, key, len, timeout, stats: stats.clone(), done: Some(c) })
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
            let mut q = lock(mbox);
            if d == r {
                for s in q.sends.drain(..) {
                    s.done.complete(Outcome::PeerGone);
                }
            } else {
                q.recvs.retain(|s| {
                    if s.peer == r {
                        s.done.complete(Outcome::PeerGone);
                        false
                    } else {
                        true
                    }
                });
            }
        }
    }
}

/// An operation posted on the threads transport.
pub(crate) struct ThreadOp {
    world: Arc<World>,
    me: usize,
    peer: usize,
    is_send: bool,
    key: u64,
    len: usize,
    timeout: Duration,
    stats: Arc<StatsCounters>,
    /// `None` once the op has finished and its completion went back to the pool.
    done: Option<Arc<Completion>>,
}

impl ThreadOp {
    fn finish(&mut self, c: Arc<Completion>, o: Outcome) -> Result<(), CommError> {
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
    fn try_cancel(&self, c: &Arc<Completion>) -> bool {
        let mbox = if self.is_send { self.peer } else { self.me };
        let mut q = lock(&self.world.mailboxes[mbox]);
        let queue = if self.is_send { &mut q.sends } else { &mut q.recvs };
        match queue.iter().position(|s| Arc::ptr_eq(&s.done, c)) {
            Some(i) => {
                queue.remove(i);
                true
            }
            None => false,
        }
    }

    /// Waits without a deadline: only used once a peer has claimed the slot and is copying.
    fn wait_done(c: &Completion) -> Outcome {
        let mut st = lock(&c.state);
        loop {
            if let State::Done(o) = *st {
                return o;
            }
            st = c.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Withdraws the op if unmatched, else waits for the running copy.
    pub(crate) fn cancel(mut self) {
        if let Some(c) = self.done.take() {
            if self.try_cancel(&c) {
                self.world.recycle(self.me, c);
            } else {
                let o = Self::wait_done(&c);
                let _ = self.finish(c, o);
            }
        }
    }

    /// Non-blocking completion check.
    pub(crate) fn test(&mut self) -> Result<bool, CommError> {
        let Some(c) = self.done.take() else {
            return Ok(true);
        };
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
        c.spin();
        let deadline = Instant::now().checked_add(self.timeout);
        let mut st = lock(&c.state);
        loop {
            if let State::Done(o) = *st {
                drop(st);
                return self.finish(c, o);
            }
            let now = Instant::now();
            st = match deadline {
                Some(d) if now >= d => break,
                Some(d) => c.cv.wait_timeout(st, d - now).unwrap_or_else(PoisonError::into_inner).0,
                None => c.cv.wait(st).unwrap_or_else(PoisonError::into_inner),
            };
        }
        drop(st);
        if !self.try_cancel(&c) {
            let o = Self::wait_done(&c);
            return self.finish(c, o);
        }
        self.world.recycle(self.me, c);
        if !self.is_send {
            let q = lock(&self.world.mailboxes[self.me]);
            let other = q.sends.iter().find(|s| s.peer == self.peer && s.key >> 32 == self.key >> 32);
            if let Some(s) = other {
                return Err(CommError::TagMismatch { src: self.peer, dst: self.me, expected: self.key, found: s.key });
            }
        }
        Err(CommError::Timeout { op: if self.is_send { "send" } else { "recv" }, peer: self.peer, after: self.timeout })
    }
}

impl Drop for ThreadOp {
    fn drop(&mut self) {
        if self.done.is_none() {
            return;
        }
        if std::thread::panicking() {
            // Unwinding: withdraw the op so the peer learns quickly that this rank is gone.
            if let Some(c) = self.done.take() {
                if self.try_cancel(&c) {
                    self.world.recycle(self.me, c);
                } else {
                    Self::wait_done(&c);
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
        let world = World::new(n);
        Ok((0..n)
            .map(|rank| Communicator::from_endpoint(Endpoint { world: world.clone(), rank }, self.timeout))
            .collect())
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
