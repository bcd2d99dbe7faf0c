//! The `Communicator`: ranks, point-to-point messages and ring shifts, over a private transport enum.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytemuck::Pod;

use crate::error::CommError;
use crate::op::{Op, DEFAULT_TIMEOUT, RING_TAG};
use crate::pending::{Parts, Pending};
use crate::stats::{CommStats, StatsCounters};
use crate::sync::lock;
use crate::threads;

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
    pub(crate) scope_pool: Mutex<crate::pending::ScopePool>,
    split_seq: AtomicU64,
    /// Set by [`abort`](Self::abort): why this rank failed.
    aborted: OnceLock<String>,
    /// Set by [`attach_nccl`](Self::attach_nccl): NCCL over one device.
    #[cfg(feature = "nccl")]
    nccl: OnceLock<Arc<crate::nccl::comm::NcclComm>>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("transport", &self.transport())
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
            aborted: OnceLock::new(),
            #[cfg(feature = "nccl")]
            nccl: OnceLock::new(),
        }
    }

    pub(crate) fn from_endpoint(ep: threads::Endpoint, timeout: Duration) -> Self {
        Self::new(Transport::Threads(ep), timeout)
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
            let comm = Self::new(Transport::Ucx(crate::ucx::join(timeout)?), timeout);
            comm.barrier()?;
            if let Transport::Ucx(ep) = &comm.transport {
                ep.joined();
            }
            // The traffic counters start after the bootstrap's own messages.
            Ok(Communicator { stats: Arc::new(StatsCounters::default()), ..comm })
        }
        #[cfg(not(feature = "ucx"))]
        {
            let _ = timeout;
            Err(CommError::NotCompiled("ucx"))
        }
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

    /// Tells the other ranks that this one failed, and why, before it leaves: their pending and later operations
    /// with this rank fail with [`CommError::PeerFailed`] naming it and carrying `reason` (instead of the bare
    /// [`CommError::PeerGone`] a dropped communicator leaves them), and so do this rank's own later operations.
    /// Only the first call's reason counts. It concerns this communicator: in those split from it the rank stays
    /// until it drops them, and then its peers there get the same reason.
    ///
    /// [`ThreadWorld::run`](crate::ThreadWorld::run) does this with the panic message of a rank that panics,
    /// and [`ThreadWorld::try_run`](crate::ThreadWorld::try_run) also with the error a rank returns.
    ///
    /// ```
    /// use longctx_p2p::{CommError, ThreadWorld};
    ///
    /// let comms = ThreadWorld::builder().build(2)?;
    /// let mut it = comms.into_iter();
    /// let (c0, c1) = (it.next().unwrap(), it.next().unwrap());
    /// let t = std::thread::spawn(move || c0.recv(1, 0, &mut [0u8; 4]));
    /// c1.abort("shard 1 of the input is corrupt");
    /// let e = t.join().unwrap().unwrap_err();
    /// assert!(matches!(e, CommError::PeerFailed { rank: 1, ref reason } if reason.contains("corrupt")));
    /// # Ok::<(), CommError>(())
    /// ```
    pub fn abort(&self, reason: &str) {
        if self.aborted.set(reason.to_string()).is_err() {
            return;
        }
        match &self.transport {
            Transport::Threads(ep) => ep.world.depart(ep.rank, Some(reason.to_string())),
            #[cfg(feature = "ucx")]
            Transport::Ucx(ep) => ep.abort(reason),
        }
    }

    pub(crate) fn check_peer(&self, peer: usize) -> Result<(), CommError> {
        let n = self.world_size();
        if peer >= n {
            return Err(CommError::InvalidRank { rank: peer, world_size: n });
        }
        Ok(())
    }

    /// Whether this communicator's transport reaches device memory of device `ordinal` itself (in one copy, or
    /// with no copy of ours: see the [memory module](crate::memory)) rather than staging it through host memory.
    #[cfg_attr(not(feature = "ucx"), allow(unused_variables))]
    pub fn reaches_device(&self, ordinal: u32) -> bool {
        if self.nccl_ordinal() == Some(ordinal) {
            return true;
        }
        match &self.transport {
            // The ranks share the process, and with it every device's address space.
            Transport::Threads(_) => true,
            #[cfg(feature = "ucx")]
            Transport::Ucx(ep) => ep.reaches_device(ordinal),
        }
    }

    /// The transport's name: `threads` or `ucx`.
    pub fn transport(&self) -> &'static str {
        match &self.transport {
            Transport::Threads(_) => "threads",
            #[cfg(feature = "ucx")]
            Transport::Ucx(_) => "ucx",
        }
    }

    /// Gives this communicator NCCL over device `ordinal` (collective: every rank calls it, each with its own
    /// device, which NCCL requires). From then on device memory of that device given to the byte-level operations
    /// ([`memory`](crate::memory)) moves through NCCL; host memory still moves on this communicator's transport.
    /// Sub-communicators made later by [`split`](Self::split) do not inherit it.
    ///
    /// Fails on every rank, with [`CommError::Nccl`], when any rank cannot load NCCL or the CUDA driver or open its
    /// device, and with [`CommError::Timeout`] when a rank does not join within the timeout. Without the `nccl`
    /// feature it returns [`CommError::NotCompiled`].
    #[cfg_attr(not(feature = "nccl"), allow(unused_variables))]
    pub fn attach_nccl(&self, ordinal: u32) -> Result<(), CommError> {
        #[cfg(feature = "nccl")]
        {
            if self.nccl.get().is_some() {
                return Err(CommError::InvalidArgument("attach_nccl: NCCL is already attached".into()));
            }
            let me = (self.rank(), self.world_size(), self.timeout);
            let comm = crate::nccl::comm::NcclComm::new(me, ordinal, self.stats.clone(), |mine, all| {
                self.all_gather(mine, all)
            })?;
            let _ = self.nccl.set(comm);
            Ok(())
        }
        #[cfg(not(feature = "nccl"))]
        Err(CommError::NotCompiled("nccl"))
    }

    /// The device whose memory this communicator moves through NCCL ([`attach_nccl`](Self::attach_nccl)), if any.
    pub fn nccl_ordinal(&self) -> Option<u32> {
        #[cfg(feature = "nccl")]
        if let Some(n) = self.nccl.get() {
            return Some(n.ordinal());
        }
        None
    }

    /// NCCL, when it is attached over device `ordinal`.
    #[cfg(feature = "nccl")]
    pub(crate) fn nccl_for(&self, ordinal: u32) -> Option<&Arc<crate::nccl::comm::NcclComm>> {
        self.nccl.get().filter(|n| n.ordinal() == ordinal)
    }

    /// Posts `op` on the transport.
    ///
    /// # Safety
    /// `op`'s buffer must stay valid, and for a receive unaliased, until the returned op finishes; callers ensure
    /// it by tying the op to a borrow of the buffer ([`Request`](crate::Request) in a [`Scope`](crate::Scope)),
    /// by owning the buffer until it finishes ([`OwnedRequest`](crate::OwnedRequest)), or by finishing it before
    /// returning.
    pub(crate) unsafe fn post(&self, op: Op) -> Result<Pending, CommError> {
        self.check_peer(op.peer)?;
        if let Some(reason) = self.aborted.get() {
            return Err(CommError::PeerFailed { rank: self.rank(), reason: reason.clone() });
        }
        match &self.transport {
            // Threads: the copy is the transfer and it runs on a waiting rank's thread, so `later` changes nothing.
            // SAFETY: per our contract.
            Transport::Threads(ep) => unsafe { ep.post(&op, &self.stats) }.map(Pending::Threads),
            #[cfg(feature = "ucx")]
            // SAFETY: per our contract.
            Transport::Ucx(ep) => unsafe { ep.post(&op, &self.stats) }.map(Pending::Ucx),
        }
    }

    /// An [`Op`] with this communicator's timeout.
    pub(crate) fn op(&self, is_send: bool, peer: usize, key: u64, meta: u64, buf: (*mut u8, usize)) -> Op {
        let (ptr, len) = buf;
        Op { is_send, peer, key, meta, ptr, len, device: None, later: false, exchange: false, timeout: self.timeout }
    }

    /// Posts a receive and a send (one exchange: both in flight at once) as the two parts of one request.
    ///
    /// # Safety
    /// As for [`post`](Self::post), for both ops' buffers.
    pub(crate) unsafe fn post_exchange(&self, recv: Op, send: Op) -> Result<Parts, CommError> {
        if matches!(self.transport, Transport::Threads(_)) {
            // Threads: the send first. Its offer is what the peer waits for, and a receive whose message is
            // already there copies it in `post`, which would hold the offer back by a copy and by the wait for the
            // peer's cache line that the copy's completion writes. The request still finishes the receive first.
            // SAFETY: per our contract.
            let s = unsafe { self.post(send) }?;
            // SAFETY: per our contract.
            return match unsafe { self.post(recv) } {
                Ok(r) => Ok(Parts::two(r, s)),
                Err(e) => {
                    s.cancel();
                    Err(e)
                }
            };
        }
        // SAFETY: per our contract.
        let r = unsafe { self.post(recv) }?;
        // SAFETY: per our contract.
        match unsafe { self.post(send) } {
            Ok(s) => Ok(Parts::two(r, s)),
            Err(e) => {
                r.cancel();
                Err(e)
            }
        }
    }

    /// The ops of a ring exchange of `send` to `dst` and `recv` from `src` (`later`: see [`Op::later`]).
    pub(crate) fn exchange_ops(
        &self,
        key: u64,
        meta: u64,
        (dst, send): (usize, &[u8]),
        (src, recv): (usize, &mut [u8]),
        later: bool,
    ) -> (Op, Op) {
        let r = Op { later, exchange: true, ..self.op(false, src, key, meta, (recv.as_mut_ptr(), recv.len())) };
        let s = Op { later, exchange: true, ..self.op(true, dst, key, meta, (send.as_ptr() as *mut u8, send.len())) };
        (r, s)
    }

    /// A blocking ring exchange: sends `send` to `dst` and receives `recv` from `src`, both in flight at once.
    /// Both directions are finished even if one fails, so a failure here never withdraws a message a peer is
    /// about to receive.
    pub(crate) fn exchange(
        &self,
        key: u64,
        meta: u64,
        to: (usize, &[u8]),
        from: (usize, &mut [u8]),
    ) -> Result<(), CommError> {
        let (r, s) = self.exchange_ops(key, meta, to, from, false);
        // SAFETY: both buffers stay borrowed until the parts are finished here.
        unsafe { self.post_exchange(r, s) }?.wait()
    }

    /// Blocking send of raw bytes with an internal or user key.
    pub(crate) fn send_bytes(&self, dst: usize, key: u64, meta: u64, buf: &[u8]) -> Result<(), CommError> {
        let op = self.op(true, dst, key, meta, (buf.as_ptr() as *mut u8, buf.len()));
        // SAFETY: `buf` is borrowed until the op is finished here; a send never writes through the pointer.
        Parts::one(unsafe { self.post(op) }?).wait()
    }

    /// Blocking receive of raw bytes with an internal or user key.
    pub(crate) fn recv_bytes(&self, src: usize, key: u64, meta: u64, buf: &mut [u8]) -> Result<(), CommError> {
        let op = self.op(false, src, key, meta, (buf.as_mut_ptr(), buf.len()));
        // SAFETY: `buf` is mutably borrowed until the op is finished here.
        Parts::one(unsafe { self.post(op) }?).wait()
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
        self.send_bytes(dst, tag as u64, 0, bytemuck::cast_slice(buf))
    }

    /// Receives the message from `src` with `tag` into `buf`, whose length must equal the message's.
    pub fn recv<T: Pod>(&self, src: usize, tag: u32, buf: &mut [T]) -> Result<(), CommError> {
        self.recv_bytes(src, tag as u64, 0, bytemuck::cast_slice_mut(buf))
    }

    /// `(next, prev)` on the ring: the ranks a ring shift sends to and receives from.
    pub(crate) fn ring_peers(&self) -> (usize, usize) {
        let (r, n) = (self.rank(), self.world_size());
        ((r + 1) % n, (r + n - 1) % n)
    }

    /// Ring shift: sends `send` to `(rank+1)%n` and receives into `recv` from `(rank-1+n)%n`, both in flight at
    /// once. All ranks must pass the same length. With one rank, copies `send` into `recv`.
    pub fn sendrecv<T: Pod>(&self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        let (next, prev) = self.ring_peers();
        self.exchange(RING_TAG, 0, (next, bytemuck::cast_slice(send)), (prev, bytemuck::cast_slice_mut(recv)))
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
                let world = ep.join_split(seq, color, &ranks);
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
