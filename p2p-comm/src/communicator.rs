//! The `Communicator`: ranks, point-to-point messages and ring shifts, over a private transport enum.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytemuck::Pod;

use crate::request::{Pending, Request};
use crate::stats::{CommStats, StatsCounters};
use crate::threads::{self, lock};
use crate::CommError;

/// Timeout of a new communicator.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Tags of user messages occupy `0..2^32`; messages of collectives and ring shifts use this channel above them.
pub(crate) const INTERNAL: u64 = 1 << 32;
/// Tag of [`Communicator::sendrecv`] / [`Communicator::isendrecv`] messages.
const RING_TAG: u64 = INTERNAL | 0xFF;

enum Transport {
    Threads(threads::Endpoint),
    #[cfg(feature = "ucx")]
    Ucx(crate::ucx::UcxEndpoint),
}

/// A group of ranks that exchange messages: point-to-point, ring shifts and collectives.
///
/// Every rank holds its own `Communicator` (it is `Send`, so each rank can live on its own thread). All ranks
/// must call collectives (and [`split`](Communicator::split)) in the same order with matching arguments;
/// mismatches are reported as [`CommError::CollectiveMismatch`] or [`CommError::LengthMismatch`].
///
/// Create one with [`ThreadWorld`](crate::ThreadWorld) (ranks as threads of one process) or, with the `ucx`
/// feature, `Communicator::from_env` (ranks as processes, started by `longctx-launch`, Slurm or `mpirun`).
pub struct Communicator {
    transport: Transport,
    timeout: Duration,
    stats: Arc<StatsCounters>,
    /// Reused temporary of the collectives (u64 words so it is aligned for every element type).
    scratch: Mutex<Vec<u64>>,
    /// Reused by scopes: free request slots, and the list a scope keeps of the ones it handed out, so that a
    /// steady loop of scoped exchanges allocates nothing.
    pub(crate) scope_pool: Mutex<crate::request::ScopePool>,
    split_seq: AtomicU64,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.transport {
            Transport::Threads(_) => "threads",
            #[cfg(feature = "ucx")]
            Transport::Ucx(_) => "ucx",
        };
        f.debug_struct("Communicator")
            .field("transport", &kind)
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Communicator {
    fn new(transport: Transport, timeout: Duration) -> Self {
        Communicator {
            transport,
            timeout,
            stats: Arc::new(StatsCounters::default()),
            scratch: Mutex::new(Vec::new()),
            scope_pool: Mutex::new(Default::default()),
            split_seq: AtomicU64::new(0),
        }
    }

    pub(crate) fn from_endpoint(ep: threads::Endpoint, timeout: Duration) -> Self {
        Self::new(Transport::Threads(ep), timeout)
    }

    #[cfg(feature = "ucx")]
    pub(crate) fn from_ucx(ep: crate::ucx::UcxEndpoint, timeout: Duration) -> Self {
        Self::new(Transport::Ucx(ep), timeout)
    }

    /// Joins the multi-process job described by the environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`, `LONGCTX_JOB_TOKEN`, as set by `longctx-launch`; or Slurm / Open MPI variables, see
    /// [`Bootstrap::from_env`](crate::Bootstrap::from_env)) over UCX. Rank 0 hosts the rendezvous store on
    /// `MASTER_ADDR:MASTER_PORT`. Collective: returns once every rank has joined.
    ///
    /// The timeout, for joining (a rank that does not join in time is named in the error) and then for every
    /// blocking wait, is `LONGCTX_TIMEOUT_SECS` when set, else 5 minutes; see also
    /// [`from_env_with_timeout`](Self::from_env_with_timeout).
    ///
    /// Without the `ucx` feature this returns [`CommError::NotCompiled`].
    pub fn from_env() -> Result<Communicator, CommError> {
        let timeout = match std::env::var("LONGCTX_TIMEOUT_SECS") {
            Ok(v) => match v.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && s > 0.0 => Duration::from_secs_f64(s),
                _ => {
                    return Err(CommError::Bootstrap(format!(
                        "LONGCTX_TIMEOUT_SECS={v:?} is not a positive number of seconds"
                    )))
                }
            },
            Err(_) => DEFAULT_TIMEOUT,
        };
        Self::from_env_with_timeout(timeout)
    }

    /// [`from_env`](Self::from_env) with the given timeout for joining and for every blocking wait (what
    /// [`set_timeout`](Self::set_timeout) sets afterwards), whatever `LONGCTX_TIMEOUT_SECS` says.
    pub fn from_env_with_timeout(timeout: Duration) -> Result<Communicator, CommError> {
        #[cfg(feature = "ucx")]
        {
            crate::ucx::from_env(timeout)
        }
        #[cfg(not(feature = "ucx"))]
        {
            let _ = timeout;
            Err(CommError::NotCompiled("ucx"))
        }
    }

    /// Zeroes the traffic counters (after a bootstrap's own messages).
    #[cfg(feature = "ucx")]
    pub(crate) fn with_fresh_stats(mut self) -> Self {
        self.stats = Arc::new(StatsCounters::default());
        self
    }

    /// This rank, in `0..world_size()`.
    pub fn rank(&self) -> usize {
        match &self.transport {
            Transport::Threads(ep) => ep.rank,
            #[cfg(feature = "ucx")]
            Transport::Ucx(ep) => ep.rank(),
        }
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        match &self.transport {
            Transport::Threads(ep) => ep.size(),
            #[cfg(feature = "ucx")]
            Transport::Ucx(ep) => ep.size(),
        }
    }

    /// Cumulative traffic of this communicator.
    pub fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    /// Sets how long any blocking wait may take before it fails with [`CommError::Timeout`].
    ///
    /// With UCX, a send that fails this way closes the link to its peer (which counts as gone from then on),
    /// and a receive of that message that the peer resumes later fails with [`CommError::LinkClosed`] (peers on
    /// one host) or times out (TCP), rather than completing with whatever the buffer holds by then.
    pub fn set_timeout(&mut self, d: Duration) {
        self.timeout = d;
    }

    /// The timeout of blocking waits (default 5 minutes).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn check_peer(&self, peer: usize) -> Result<(), CommError> {
        let n = self.world_size();
        if peer >= n {
            return Err(CommError::InvalidRank { rank: peer, world_size: n });
        }
        Ok(())
    }

    /// Posts one send or receive of raw bytes. `later`: the caller will not wait at once (a non-blocking call),
    /// so the transport should move the message in the background meanwhile (UCX: its progress thread).
    /// `exchange`: one direction of a ring exchange, whose peer is exchanging with its own neighbours at the same
    /// moment, in the same order as every rank (threads: paired by number in the pair's exchange channel).
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid, and for a receive unaliased, until the returned op finishes; callers
    /// ensure it by tying the op to a borrow of the buffer ([`Request`]) or by finishing it before returning.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn post(
        &self,
        is_send: bool,
        peer: usize,
        key: u64,
        meta: u64,
        ptr: *mut u8,
        len: usize,
        later: bool,
        exchange: bool,
    ) -> Result<Pending, CommError> {
        self.check_peer(peer)?;
        match &self.transport {
            // Threads: the copy is the transfer and it runs on a waiting rank's thread, so `later` changes nothing.
            Transport::Threads(ep) => {
                let _ = later;
                ep.post(is_send, peer, key, meta, ptr, len, exchange, self.timeout, &self.stats).map(Pending::Threads)
            }
            #[cfg(feature = "ucx")]
            Transport::Ucx(ep) => {
                let _ = exchange;
                ep.post(is_send, peer, key, meta, ptr, len, later, self.timeout, &self.stats).map(Pending::Ucx)
            }
        }
    }

    pub(crate) fn post_send(
        &self,
        dst: usize,
        key: u64,
        meta: u64,
        buf: &[u8],
        later: bool,
        exchange: bool,
    ) -> Result<Pending, CommError> {
        // SAFETY: callers finish the op while `buf` is borrowed (see `post`); a send never writes through `ptr`.
        unsafe { self.post(true, dst, key, meta, buf.as_ptr() as *mut u8, buf.len(), later, exchange) }
    }

    pub(crate) fn post_recv(
        &self,
        src: usize,
        key: u64,
        meta: u64,
        buf: &mut [u8],
        later: bool,
        exchange: bool,
    ) -> Result<Pending, CommError> {
        // SAFETY: callers finish the op while `buf` is mutably borrowed (see `post`).
        unsafe { self.post(false, src, key, meta, buf.as_mut_ptr(), buf.len(), later, exchange) }
    }

    /// Posts a receive from `src` and a send to `dst`, both in flight at once, as one request (`later`: see
    /// [`post`](Self::post)).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn exchange_start<'a>(
        &self,
        key: u64,
        meta: u64,
        dst: usize,
        send: &'a [u8],
        src: usize,
        recv: &'a mut [u8],
        later: bool,
    ) -> Result<Request<'a>, CommError> {
        if matches!(self.transport, Transport::Threads(_)) {
            // Threads: the send first. Its offer is what the peer waits for, and a receive whose message is
            // already there copies it in `post`, which would hold the offer back by a copy and by the wait for the
            // peer's cache line that the copy's completion writes. The request still finishes the receive first.
            let s = self.post_send(dst, key, meta, send, later, true)?;
            return match self.post_recv(src, key, meta, recv, later, true) {
                Ok(r) => Ok(Request::new(r, Some(s))),
                Err(e) => {
                    s.cancel();
                    Err(e)
                }
            };
        }
        let r = self.post_recv(src, key, meta, recv, later, true)?;
        match self.post_send(dst, key, meta, send, later, true) {
            Ok(s) => Ok(Request::new(r, Some(s))),
            Err(e) => {
                r.cancel();
                Err(e)
            }
        }
    }

    /// Blocking [`exchange_start`](Self::exchange_start). Both directions are finished even if one fails, so a
    /// failure here never withdraws a message a peer is about to receive.
    pub(crate) fn exchange(
        &self,
        key: u64,
        meta: u64,
        dst: usize,
        send: &[u8],
        src: usize,
        recv: &mut [u8],
    ) -> Result<(), CommError> {
        self.exchange_start(key, meta, dst, send, src, recv, false)?.wait()
    }

    /// Runs `f` on a reused scratch buffer of `len` elements (contents unspecified).
    pub(crate) fn with_scratch<A: Pod, R>(&self, len: usize, f: impl FnOnce(&mut [A]) -> R) -> R {
        let bytes = len * std::mem::size_of::<A>();
        let mut s = lock(&self.scratch);
        let words = bytes.div_ceil(8);
        if s.len() < words {
            s.resize(words, 0);
        }
        let b: &mut [u8] = bytemuck::cast_slice_mut(&mut s[..words]);
        f(bytemuck::cast_slice_mut(&mut b[..bytes]))
    }

    /// Sends `buf` to `dst` with `tag` and blocks until the receiver has taken it (synchronous send).
    ///
    /// Two ranks that both call `send` to each other before receiving wait on each other until the timeout; use
    /// [`isend`](Self::isend) or [`sendrecv`](Self::sendrecv) for exchanges.
    pub fn send<T: Pod>(&self, dst: usize, tag: u32, buf: &[T]) -> Result<(), CommError> {
        Request::new(self.post_send(dst, tag as u64, 0, bytemuck::cast_slice(buf), false, false)?, None).wait()
    }

    /// Receives the message from `src` with `tag` into `buf`, whose length must equal the message's.
    pub fn recv<T: Pod>(&self, src: usize, tag: u32, buf: &mut [T]) -> Result<(), CommError> {
        Request::new(self.post_recv(src, tag as u64, 0, bytemuck::cast_slice_mut(buf), false, false)?, None).wait()
    }

    /// Starts sending `buf` to `dst`; the request borrows `buf` until it finishes.
    /// [`Scope::isend`](crate::Scope::isend) (in [`scope`](Self::scope)) is the safe form.
    ///
    /// # Safety
    ///
    /// The transport reads `buf` until the operation finishes, which the request's `wait`, `test` (to
    /// completion) or drop ensure. The request must not be leaked (`std::mem::forget`, a reference cycle) while
    /// `buf` may afterwards be freed or written: the borrow would end with the operation still in flight.
    pub unsafe fn isend<'a, T: Pod>(&self, dst: usize, tag: u32, buf: &'a [T]) -> Result<Request<'a>, CommError> {
        let op = self.post_send(dst, tag as u64, 0, bytemuck::cast_slice(buf), true, false)?;
        Ok(Request::new(op, None))
    }

    /// Starts receiving from `src` into `buf`; the request borrows `buf` until it finishes.
    /// [`Scope::irecv`](crate::Scope::irecv) (in [`scope`](Self::scope)) is the safe form.
    ///
    /// # Safety
    ///
    /// As for [`isend`](Self::isend): the transport writes `buf` until the operation finishes, so the request
    /// must not be leaked while `buf` may afterwards be freed or used.
    pub unsafe fn irecv<'a, T: Pod>(&self, src: usize, tag: u32, buf: &'a mut [T]) -> Result<Request<'a>, CommError> {
        let op = self.post_recv(src, tag as u64, 0, bytemuck::cast_slice_mut(buf), true, false)?;
        Ok(Request::new(op, None))
    }

    fn ring_peers(&self) -> (usize, usize) {
        let (r, n) = (self.rank(), self.world_size());
        ((r + 1) % n, (r + n - 1) % n)
    }

    /// Ring shift: sends `send` to `(rank+1)%n` and receives into `recv` from `(rank-1+n)%n`, both in flight at
    /// once. All ranks must pass the same length. With one rank, copies `send` into `recv`.
    pub fn sendrecv<T: Pod>(&self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        let (next, prev) = self.ring_peers();
        self.exchange(RING_TAG, 0, next, bytemuck::cast_slice(send), prev, bytemuck::cast_slice_mut(recv))
    }

    /// Non-blocking ring shift; the request's [`wait`](Request::wait) completes both directions. Overlap compute
    /// with it: post the shift of the next block, compute on the block in hand, wait.
    /// [`Scope::isendrecv`](crate::Scope::isendrecv) (in [`scope`](Self::scope)) is the safe form.
    ///
    /// # Safety
    ///
    /// As for [`isend`](Self::isend) and [`irecv`](Self::irecv): the request must not be leaked while `send` or
    /// `recv` may afterwards be freed or used.
    pub unsafe fn isendrecv<'a, T: Pod>(&self, send: &'a [T], recv: &'a mut [T]) -> Result<Request<'a>, CommError> {
        let (next, prev) = self.ring_peers();
        self.exchange_start(RING_TAG, 0, next, bytemuck::cast_slice(send), prev, bytemuck::cast_slice_mut(recv), true)
    }

    /// Splits into sub-communicators, with `MPI_Comm_split` semantics: ranks passing the same `color` form one
    /// communicator, in which they are numbered by ascending `key`, ties broken by their rank here. Every rank
    /// gets a communicator (there is no "undefined" color). Collective over this communicator.
    ///
    /// The new communicator has its own message space: its traffic never matches this one's, and its
    /// [`stats`](Self::stats) start at zero. It inherits the timeout.
    pub fn split(&self, color: u32, key: u32) -> Result<Communicator, CommError> {
        let n = self.world_size();
        // Each rank proposes a context id (the UCX transport needs one free on every member; threads don't).
        let proposal: u32 = match &self.transport {
            Transport::Threads(_) => 0,
            #[cfg(feature = "ucx")]
            Transport::Ucx(ep) => u32::try_from(ep.next_ctx()).unwrap_or(u32::MAX),
        };
        let mut all = vec![0u32; 3 * n];
        self.all_gather(&[color, key, proposal], &mut all)?;
        let mut members: Vec<(u32, usize)> =
            (0..n).filter(|&r| all[3 * r] == color).map(|r| (all[3 * r + 1], r)).collect();
        members.sort_unstable();
        let ranks: Vec<usize> = members.iter().map(|&(_, r)| r).collect();
        let new_rank = ranks
            .iter()
            .position(|&r| r == self.rank())
            .ok_or_else(|| CommError::InvalidArgument("split: this rank is missing from its own color group".into()))?;
        let seq = self.split_seq.fetch_add(1, Ordering::Relaxed);
        let transport = match &self.transport {
            Transport::Threads(ep) => {
                let world = ep.join_split(seq, color, ranks.len());
                Transport::Threads(threads::Endpoint::new(world, new_rank))
            }
            #[cfg(feature = "ucx")]
            Transport::Ucx(ep) => {
                let _ = seq;
                let ctx = (0..n).map(|r| all[3 * r + 2]).max().unwrap_or(0) as u64;
                Transport::Ucx(ep.split(ctx, &ranks, new_rank)?)
            }
        };
        Ok(Communicator::new(transport, self.timeout))
    }
}
