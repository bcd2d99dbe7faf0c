//! The UCX transport: ranks are processes, messages are UCX tagged messages progressed by one worker per
//! process. Layers: [`sys`] (bindgen output + macros) → [`result`] (statuses as `Result`) → [`safe`] (owned
//! objects) → this module (the transport).
//!
//! Tag layout (64 bits): `context id (19) | source rank (12) | internal flag (1) | user tag (32)`, received with
//! a full mask, so sub-communicators (distinct context ids) never match each other's traffic. Limits: 4096 ranks.
//! Internal (collective) messages use the low 8 bits of the user field for the collective and carry a 24-bit
//! digest of the call's descriptor (sizes, root, operator) above them; their receives mask the digest out and
//! compare it on arrival, so ranks that pass different arguments get `CollectiveMismatch`, as on threads.
//!
//! Errors are diagnosed as on the threads transport, with one difference: a receive buffer of the wrong length
//! fails on the receiver only (UCX does not tell the sender, whose send completes). A receive that times out
//! probes the worker's unexpected queue: a message from the same peer with another tag is reported as
//! `TagMismatch` (another collective: `CollectiveMismatch`). Peer death is detected through the rendezvous store:
//! each process keeps its store connection open and the host marks a rank gone when it closes; waits poll that
//! every 100 ms.
//!
//! A send that fails (timeout, gone peer) while UCX still holds its buffer is withdrawn: the request is
//! cancelled, then the endpoint to that peer is force-closed (the peer counts as gone from then on), and after
//! [`ABANDON_AFTER_CLOSE`] the request is handed back to UCX, so `wait` returns and the buffer is the caller's
//! again. A peer that was only *stalled* (stopped, swapped out) in the middle of that receive goes on with it
//! when it resumes. Over TCP the sender pushes, so the rest never comes and the receive fails. Over shared
//! memory the receiver pulls the data from the sender's memory by address (CMA), and would read whatever the
//! caller has put there since: before the buffer is returned, the sender raises a flag in shared memory that
//! its peers on the host read after each receive from it ([`link_flags`]), so such a receive fails with
//! `LinkClosed` instead (test: `a_peer_stopped_mid_transfer_fails_the_sender_and_never_gets_reused_data`). If the caller *unmapped* the buffer
//! instead (freed a large allocation), the resumed receiver's read faults: from UCX 1.22 on that fails the
//! receive, reported as `LinkClosed` too (same test); UCX 1.13 to 1.21 abort the receiver. Left open: RDMA
//! reads between hosts (InfiniBand) have no flag to read; and the mirror case, a withdrawn *receive* whose
//! stalled sender resumes, is safe only because UCX's default rendezvous over shared memory has the receiver
//! read (`UCX_RNDV_SCHEME=put_zcopy` would let the resumed sender write into the buffer after it was
//! returned).
//!
//! A peer that *dies* in the middle of a large transfer fails the operations on it with `PeerGone` over TCP.
//! Over shared memory the receiver's zero-copy read (CMA) from the dead process fails inside UCX. From UCX
//! 1.22 on that fails the receive and the receiver gets `PeerGone`. UCX 1.13 to 1.21 abort the receiving process
//! instead, unless its endpoints use peer error handling (`scripts/ucx-versions` runs the test against each
//! release); with that handling UCX (1.13 to 1.22) moves a same-host peer's traffic to TCP over `lo` (no sysv,
//! no CMA), which costs much of the bandwidth of larger messages (`ucx_perftest -e` loses as much), so it is off by
//! default (under `longctx-launch` the job ends when one rank dies anyway) and `LONGCTX_UCX_PEER_ERRORS=1`
//! turns it on for jobs whose ranks must survive a peer's death on an older UCX (test:
//! `a_rank_killed_mid_transfer_is_an_error_on_its_peer`; [`ucx_version`] tells which UCX a process runs with).
//!
//! Progress: UCX moves a message only while someone calls `ucp_worker_progress` (a rendezvous waits for its
//! receiver to see the request and fetch the data; TCP needs its socket fed). A rank that posts a transfer and
//! then computes (the ring-attention pattern) would leave the wire idle until it waits. So while any operation
//! is in flight, a background thread of the process progresses the worker: often while events arrive, backing
//! off to one call per millisecond when none do, asleep when nothing is in flight. `LONGCTX_UCX_PROGRESS=0`
//! turns it off (operations then progress only in `test` and `wait`). A thread in `wait` polls the worker hard
//! while the worker reports events, and once it has reported none for 5 ms sleeps on the worker's event fd
//! (`UCP_FEATURE_WAKEUP`) until UCX has something to do; `LONGCTX_UCX_WAKEUP=0` replaces that sleep with a
//! fixed 50 µs one.

mod link_flags;
pub(crate) mod result;
pub(crate) mod safe;
#[allow(missing_docs)]
pub(crate) mod sys;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::bootstrap::Bootstrap;
use crate::error::CommError;
use crate::op::{mismatch_as, name, Op, INTERNAL};
use crate::rendezvous::{Store, StoreHost};
use crate::stats::StatsCounters;
use crate::sync::lock;
use result::Started;

/// The version of the UCX library this process runs with (`major, minor, release`, from `ucp_get_version`):
/// the one the dynamic linker found, which may be newer than the headers the crate was built against. Some
/// behaviour depends on it (see the module docs on a peer that dies mid-transfer).
pub fn ucx_version() -> (u32, u32, u32) {
    safe::library_version()
}

const CTX_BITS: u32 = 19;
const SRC_SHIFT: u32 = 33;
const CTX_SHIFT: u32 = 45;
/// Most ranks the tag layout can name.
pub(crate) const MAX_RANKS: usize = 1 << 12;
const LIVENESS_POLL: Duration = Duration::from_millis(100);
/// How long `wait` polls the worker hard after its last event before it sleeps between polls.
const SPIN: Duration = Duration::from_millis(5);
/// Longest sleep on the worker's event fd in `wait` (a bound for missed wake-ups, see `sleep_until_event`).
const EVENT_SLEEP: Duration = Duration::from_millis(1);
/// How long a liveness check waits for the store's answer before it takes the store (rank 0) for gone.
const STORE_ANSWER: Duration = Duration::from_secs(2);
/// How long an operation that lost its connection waits for the store to say whether the peer died.
const PEER_LOSS_GRACE: Duration = Duration::from_secs(2);
/// How long an aborted operation may stay unfinished once its endpoint was force-closed.
const ABANDON_AFTER_CLOSE: Duration = Duration::from_secs(1);
/// The user-tag field (the internal flag is the bit above it).
const USER_FIELD: u64 = (1 << 32) - 1;
/// Where an internal message carries the digest of its collective's descriptor.
const DIGEST_FIELD: u64 = USER_FIELD & !0xFF;

/// 24 bits of the descriptor `meta` (see `collectives::meta`), placed in [`DIGEST_FIELD`]. Two calls with
/// different arguments collide with probability 2^-24; those then surface as a length mismatch.
fn digest(meta: u64) -> u64 {
    (meta.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) << 8
}

fn is_internal(key: u64) -> bool {
    key & INTERNAL != 0
}

/// For a received message with tag `sender_tag`, matched by a receive of `key` and descriptor `meta`: the error
/// when it belongs to a call of the same collective with other arguments.
fn foreign_call(peer: usize, key: u64, meta: u64, sender_tag: u64) -> Option<CommError> {
    (is_internal(key) && sender_tag != 0 && sender_tag & DIGEST_FIELD != digest(meta))
        .then(|| mismatch_as(peer, meta, "other sizes, root or operator".into()))
}

/// How often the progress thread calls the worker: from `PROGRESS_MIN` while events arrive, doubling to
/// `PROGRESS_MAX` while none do.
const PROGRESS_MIN: Duration = Duration::from_micros(20);
const PROGRESS_MAX: Duration = Duration::from_millis(1);

struct Inner {
    eps: Vec<Option<safe::Endpoint>>,
    /// Peers whose endpoint was force-closed after a failure.
    broken: Vec<bool>,
    worker: safe::Worker,
}

/// What the communicators of one process share: the worker, endpoints to every process, the store.
pub(crate) struct Shared {
    inner: Arc<Mutex<Inner>>,
    store: Store,
    _host: Option<StoreHost>,
    next_ctx: AtomicU64,
    /// The background progress thread (`None` when turned off).
    progress: Option<Progress>,
    /// The worker's event fd, when waits sleep on it.
    efd: Option<i32>,
    /// Receive-info boxes of finished receives, reused so that posting a receive does not allocate. A box must
    /// not move while UCX may write it (the receive's callback fills it), hence boxes, not values in the op.
    #[allow(clippy::vec_box)] // each box's address is handed to UCX, so it must not move with the vector
    infos: Mutex<Vec<Box<sys::ucp_tag_recv_info_t>>>,
    /// Which peers this process gave up a send to, and which peers on this host gave up one to it.
    links: link_flags::LinkFlags,
    /// Whether device memory is posted as it is (see [`UcxEndpoint::reaches_device`]).
    cuda: bool,
}

impl Shared {
    fn take_info(&self) -> Box<sys::ucp_tag_recv_info_t> {
        let mut b =
            lock(&self.infos).pop().unwrap_or_else(|| Box::new(sys::ucp_tag_recv_info_t { sender_tag: 0, length: 0 }));
        *b = sys::ucp_tag_recv_info_t { sender_tag: 0, length: 0 };
        b
    }

    fn return_info(&self, b: Box<sys::ucp_tag_recv_info_t>) {
        lock(&self.infos).push(b);
    }
}

/// What the progress thread and the operations share.
#[derive(Default)]
struct ProgressState {
    /// Operations posted and not finished.
    inflight: AtomicUsize,
    /// Threads inside `UcxOp::wait`: they progress the worker themselves, so the thread stays off its lock.
    waiters: AtomicUsize,
    /// Set when the process's transport shuts down.
    stop: AtomicBool,
    /// Whether the thread sleeps on `wake` (so posting an op need not signal otherwise).
    asleep: Mutex<bool>,
    wake: Condvar,
}

/// The background progress thread of a process (see the module docs).
struct Progress {
    state: Arc<ProgressState>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    fn start(inner: Arc<Mutex<Inner>>) -> Result<Progress, CommError> {
        let state = Arc::new(ProgressState::default());
        let st = state.clone();
        let thread = std::thread::Builder::new()
            .name("longctx-ucx-progress".into())
            .spawn(move || progress_loop(&inner, &st))
            .map_err(|e| CommError::Bootstrap(format!("cannot start the UCX progress thread: {e}")))?;
        Ok(Progress { state, thread: Some(thread) })
    }

    /// An operation was posted: wake the thread if it sleeps.
    fn started(&self) {
        if self.state.inflight.fetch_add(1, Ordering::AcqRel) == 0 {
            let asleep = lock(&self.state.asleep);
            if *asleep {
                self.state.wake.notify_one();
            }
        }
    }

    fn finished(&self) {
        self.state.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
        {
            let _asleep = lock(&self.state.asleep);
            self.state.wake.notify_one();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Marks a thread as waiting (progressing the worker itself) for its lifetime.
struct Waiting(Arc<ProgressState>);

impl Waiting {
    fn new(st: Arc<ProgressState>) -> Self {
        st.waiters.fetch_add(1, Ordering::AcqRel);
        Waiting(st)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

fn progress_loop(inner: &Mutex<Inner>, st: &ProgressState) {
    let mut pause = PROGRESS_MIN;
    loop {
        if st.stop.load(Ordering::Acquire) {
            return;
        }
        if st.inflight.load(Ordering::Acquire) == 0 {
            let mut asleep = lock(&st.asleep);
            *asleep = true;
            // Re-checked under the lock that `started` takes before notifying, so no wake-up is lost.
            while st.inflight.load(Ordering::Acquire) == 0 && !st.stop.load(Ordering::Acquire) {
                asleep = st.wake.wait(asleep).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            *asleep = false;
            pause = PROGRESS_MIN;
            continue;
        }
        if st.waiters.load(Ordering::Acquire) > 0 {
            // A waiting thread progresses the worker itself. Back off as when idle: waking every few
            // microseconds here would preempt the waiter (or another rank) on a machine with few cores.
            pause = (pause * 2).min(PROGRESS_MAX);
            std::thread::sleep(pause);
            continue;
        }
        let events = {
            let g = lock(inner);
            let mut n = 0;
            loop {
                let k = g.worker.progress();
                if k == 0 {
                    break n;
                }
                n += k;
            }
        };
        pause = if events > 0 { PROGRESS_MIN } else { (pause * 2).min(PROGRESS_MAX) };
        std::thread::sleep(pause);
    }
}

// SAFETY: the UCX handles inside `Inner` are only touched with its mutex held (the worker is in serialized
// mode, so any one thread at a time may call it), which makes `Mutex<Inner>` shareable between threads.
unsafe impl Send for Inner {}

impl Drop for Shared {
    fn drop(&mut self) {
        // Stop the progress thread first: it holds the worker's lock while it progresses.
        drop(self.progress.take());
        let mut inner = lock(&self.inner);
        let eps: Vec<_> = inner.eps.iter_mut().filter_map(Option::take).collect();
        inner.worker.close_all(eps, false, Duration::from_secs(2));
    }
}

impl Shared {
    /// Whether rank `world_rank` (of the world) left or failed; the error to report, naming it as `rank`.
    /// [`Communicator::abort`](crate::Communicator::abort) publishes a failed rank's reason under
    /// `failed/{world_rank}` before the rank leaves, so a rank seen gone is checked for a reason after.
    fn lost(&self, world_rank: usize, rank: usize) -> Option<CommError> {
        let gone = self.gone(world_rank);
        match self.store.try_get_within(&format!("failed/{world_rank}"), STORE_ANSWER) {
            Ok(Some(reason)) => {
                Some(CommError::PeerFailed { rank, reason: String::from_utf8_lossy(&reason).into_owned() })
            }
            _ => gone.then_some(CommError::PeerGone { rank }),
        }
    }

    fn gone(&self, world_rank: usize) -> bool {
        // Bounded: the store lives in rank 0's process, which may be stalled, and a wait that checks its peer
        // must still end by its own deadline.
        match self.store.try_get_within(&format!("gone/{world_rank}"), STORE_ANSWER) {
            Ok(v) => v.is_some(),
            // The store lives in rank 0's process: losing it means rank 0 is gone. (When the launcher hosts
            // it, losing it means the launcher is gone, which takes every rank with it.)
            Err(_) => world_rank == 0,
        }
    }
}

/// Joins the job described by the environment (see [`Bootstrap::from_env`]): this process's endpoint of the
/// world communicator, which the caller completes with a barrier and then [`UcxEndpoint::joined`].
pub(crate) fn join(timeout: Duration) -> Result<UcxEndpoint, CommError> {
    let b = Bootstrap::from_env()?;
    if b.world_size > MAX_RANKS {
        return Err(CommError::Bootstrap(format!("the UCX transport supports at most {MAX_RANKS} ranks")));
    }
    // Resolved (and checked) before rank 0 binds it, so every rank meets the store at the same address.
    let store_addr = b.master_socket()?;
    let host = if b.rank == 0 && !b.store_hosted {
        let mut h = StoreHost::bind(store_addr, &b.token).map_err(|e| match e {
            CommError::Io { source, .. } => CommError::io(
                format!(
                    "rank 0 hosting the rendezvous store on MASTER_ADDR:MASTER_PORT = {store_addr} (MASTER_ADDR must \
                     be an address of rank 0's host, and the port free)"
                ),
                source,
            ),
            e => e,
        })?;
        h.set_linger(timeout);
        Some(h)
    } else {
        None
    };
    let store = Store::connect(store_addr, &b.token, timeout).map_err(|e| match e {
        CommError::Io { source, .. } if b.store_hosted => CommError::io(
            format!(
                "the rendezvous store at {store_addr} (LONGCTX_STORE_HOSTED=1: served by the launcher) did not \
                 answer within {timeout:?}"
            ),
            source,
        ),
        CommError::Io { source, .. } => CommError::io(
            format!(
                "rank 0 did not open the rendezvous store at {store_addr} within {timeout:?} (is it running, with \
                 the same MASTER_ADDR and MASTER_PORT?)"
            ),
            source,
        ),
        e => e,
    })?;
    store.register(b.rank)?;
    let (worker, efd) = match std::env::var("LONGCTX_UCX_WAKEUP").as_deref() {
        Ok("0") => (safe::Worker::new(safe::Context::new(false)?)?, None),
        _ => worker_with_event_fd()?,
    };
    // One key per rank (every rank reads every key, so a second one would double the store's traffic): the
    // length of the link flags' publication (4 bytes, little-endian), the publication, the worker address.
    let (mut links, published) = link_flags::LinkFlags::create(b.rank, b.world_size);
    let mut joined = (published.len() as u32).to_le_bytes().to_vec();
    joined.extend_from_slice(published.as_bytes());
    joined.extend_from_slice(&worker.address()?);
    store.set(&format!("ucx/{}", b.rank), &joined)?;
    let mut eps = Vec::with_capacity(b.world_size);
    for r in 0..b.world_size {
        let value = store.get(&format!("ucx/{r}")).map_err(|e| match e {
            CommError::Bootstrap(_) => CommError::Bootstrap(format!(
                "rank {r} of {} did not join within {timeout:?}: is it running, with the same MASTER_ADDR, \
                 MASTER_PORT and LONGCTX_JOB_TOKEN?",
                b.world_size
            )),
            e => e,
        })?;
        let malformed = || CommError::Bootstrap(format!("rank {r} published a malformed address"));
        let (len, rest) = value.split_first_chunk::<4>().ok_or_else(malformed)?;
        let (published, addr) = rest.split_at_checked(u32::from_le_bytes(*len) as usize).ok_or_else(malformed)?;
        links.attach(r, &String::from_utf8_lossy(published));
        eps.push(Some(worker.connect(addr)?));
    }
    let cuda = worker.reaches_cuda() && std::env::var("LONGCTX_UCX_DEVICE").as_deref() != Ok("staged");
    let inner = Arc::new(Mutex::new(Inner { eps, broken: vec![false; b.world_size], worker }));
    let progress = match std::env::var("LONGCTX_UCX_PROGRESS").as_deref() {
        Ok("0") => None,
        _ => Some(Progress::start(inner.clone())?),
    };
    let shared = Arc::new(Shared {
        inner,
        store,
        _host: host,
        next_ctx: AtomicU64::new(1),
        progress,
        efd,
        infos: Mutex::new(Vec::new()),
        links,
        cuda,
    });
    let members: Arc<[usize]> = (0..b.world_size).collect();
    Ok(UcxEndpoint { shared, ctx: 0, members, rank: b.rank })
}

/// A worker whose context has `UCP_FEATURE_WAKEUP`, with its event fd; a worker without one where this UCX
/// cannot provide it.
fn worker_with_event_fd() -> Result<(safe::Worker, Option<i32>), CommError> {
    if let Ok(w) = safe::Context::new(true).and_then(safe::Worker::new) {
        if let Ok(fd) = w.event_fd() {
            return Ok((w, Some(fd)));
        }
    }
    Ok((safe::Worker::new(safe::Context::new(false)?)?, None))
}

/// One rank's view of a UCX communicator.
pub(crate) struct UcxEndpoint {
    shared: Arc<Shared>,
    ctx: u64,
    /// World rank of each rank of this communicator.
    members: Arc<[usize]>,
    rank: usize,
}

impl UcxEndpoint {
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Publishes why this rank failed (see [`Communicator::abort`](crate::Communicator::abort)): peers find it
    /// when they check whether this rank is still there.
    pub(crate) fn abort(&self, reason: &str) {
        // Best effort: if the store is gone (rank 0 died), the peers learn only that this rank left.
        let _ = self.shared.store.set(&format!("failed/{}", self.members[self.rank]), reason.as_bytes());
    }

    /// Whether device memory (of any ordinal: UCX finds a CUDA pointer's device itself) is posted as it is, with
    /// its memory type, rather than staged through host memory: when this UCX moves CUDA memory itself (built
    /// with CUDA, e.g. the `libucx-cu13` wheel), and `LONGCTX_UCX_DEVICE=staged` does not ask for staging.
    pub(crate) fn reaches_device(&self, _ordinal: u32) -> bool {
        self.shared.cuda
    }

    /// Every rank has joined (a barrier over the new world passed): the link flags' file can go.
    pub(crate) fn joined(&self) {
        self.shared.links.unlink(); // every rank has mapped it by now
    }

    pub(crate) fn size(&self) -> usize {
        self.members.len()
    }

    /// This process's proposal for the next context id (the split takes the maximum over the ranks).
    pub(crate) fn next_ctx(&self) -> u64 {
        self.shared.next_ctx.load(Ordering::Relaxed)
    }

    /// The sub-communicator of `ranks` (ranks of this communicator, in new-rank order) with context `ctx`.
    pub(crate) fn split(&self, ctx: u64, ranks: &[usize], new_rank: usize) -> Result<UcxEndpoint, CommError> {
        if ctx >= 1 << CTX_BITS {
            return Err(CommError::InvalidArgument("split: out of UCX context ids".into()));
        }
        self.shared.next_ctx.fetch_max(ctx + 1, Ordering::Relaxed);
        let members: Arc<[usize]> = ranks.iter().map(|&r| self.members[r]).collect();
        Ok(UcxEndpoint { shared: self.shared.clone(), ctx, members, rank: new_rank })
    }

    fn tag(&self, src: usize, key: u64, meta: u64) -> u64 {
        let t = (self.ctx << CTX_SHIFT) | ((src as u64) << SRC_SHIFT) | (key & ((1 << SRC_SHIFT) - 1));
        if is_internal(key) {
            t | digest(meta)
        } else {
            t
        }
    }

    /// Posts `op` (internal messages carry a digest of its `meta`: see the module docs).
    ///
    /// # Safety
    /// `op`'s buffer must stay valid (and, for a receive, unaliased) until the returned op finishes or is
    /// dropped.
    pub(crate) unsafe fn post(&self, op: &Op, stats: &Arc<StatsCounters>) -> Result<UcxOp, CommError> {
        let Op { is_send, peer, key, meta, ptr, len, later, timeout, .. } = *op;
        // Only a context that reaches CUDA memory is handed device memory (see `reaches_device`).
        let cuda = op.device.is_some();
        let world_peer = self.members[peer];
        let mut info = (!is_send).then(|| self.shared.take_info());
        let inner = lock(&self.shared.inner);
        let ep = match (&inner.eps[world_peer], inner.broken[world_peer]) {
            (Some(ep), false) => ep,
            _ => {
                drop(inner);
                if let Some(b) = info {
                    self.shared.return_info(b);
                }
                return Err(CommError::PeerGone { rank: peer });
            }
        };
        let tag = self.tag(if is_send { self.rank } else { peer }, key, meta);
        let started = match info.as_deref_mut() {
            // SAFETY: the caller keeps the buffer alive until the op finishes.
            None => unsafe { inner.worker.tag_send(ep, ptr, len, tag, cuda) },
            Some(info) => {
                let mask = if is_internal(key) { !DIGEST_FIELD } else { u64::MAX };
                // SAFETY: as above; `info` is boxed and owned by the op (or leaked with an abandoned request).
                unsafe { inner.worker.tag_recv(ptr, len, tag, mask, info, cuda) }
            }
        };
        drop(inner);
        let started = match started {
            Ok(s) => s,
            Err(e) => {
                // Failed at once: UCX holds no request, so the box is free again.
                let (sender_tag, length) = info.as_deref().map_or((0, 0), |i| (i.sender_tag, i.length));
                if let Some(b) = info {
                    self.shared.return_info(b);
                }
                if e.0 != sys::ucs_status_t::UCS_ERR_MESSAGE_TRUNCATED {
                    let op = if is_send { "send to" } else { "receive from" };
                    return Err(CommError::Ucx(format!("{op} rank {peer}: {e}")));
                }
                if let Some(e) = foreign_call(peer, key, meta, sender_tag) {
                    return Err(e);
                }
                return Err(CommError::LengthMismatch {
                    src: peer,
                    dst: self.rank,
                    tag: key,
                    message_bytes: length,
                    buffer_bytes: len,
                });
            }
        };
        let mut op = UcxOp {
            shared: self.shared.clone(),
            req: std::ptr::null_mut(),
            info,
            abandoned: false,
            is_send,
            peer,
            world_peer,
            me: self.rank,
            key,
            meta,
            tag,
            len,
            timeout,
            stats: stats.clone(),
            done: None,
            counted: false,
        };
        match started {
            Started::Done => op.done = Some(op.outcome(Ok(()))),
            Started::Request(r) => {
                op.req = r;
                // Only for calls that return before waiting: a blocking call progresses the worker itself, and
                // waking the thread for it would cost a syscall and a context switch per message.
                if let (true, Some(p)) = (later, &self.shared.progress) {
                    p.started();
                    op.counted = true;
                }
            }
        }
        Ok(op)
    }
}

/// An operation posted on the UCX transport.
pub(crate) struct UcxOp {
    shared: Arc<Shared>,
    /// The UCX request while in flight, null once finished.
    req: *mut c_void,
    /// A receive's info, filled by UCX on completion (`None` for a send).
    info: Option<Box<sys::ucp_tag_recv_info_t>>,
    /// Whether the request was handed back to UCX unfinished: it may still write `info`, which is then leaked.
    abandoned: bool,
    is_send: bool,
    peer: usize,
    world_peer: usize,
    me: usize,
    key: u64,
    /// The collective's descriptor (0 for point-to-point).
    meta: u64,
    /// The full tag of the op (for a receive, the one the peer's send carries), to diagnose a timeout.
    tag: u64,
    len: usize,
    timeout: Duration,
    stats: Arc<StatsCounters>,
    /// Set once finished and not yet reported.
    done: Option<Result<(), CommError>>,
    /// Whether the progress thread counts this op as in flight.
    counted: bool,
}

// SAFETY: the request pointer is only used with the shared worker locked.
unsafe impl Send for UcxOp {}

impl UcxOp {
    fn outcome(&self, r: Result<(), result::UcxError>) -> Result<(), CommError> {
        let (src, dst) = if self.is_send { (self.me, self.peer) } else { (self.peer, self.me) };
        let mismatch = |message_bytes| CommError::LengthMismatch {
            src,
            dst,
            tag: self.key,
            message_bytes,
            buffer_bytes: self.len,
        };
        let arrived =
            matches!(&r, Ok(())) || matches!(&r, Err(e) if e.0 == sys::ucs_status_t::UCS_ERR_MESSAGE_TRUNCATED);
        let (sender_tag, length) = self.info.as_deref().map_or((0, self.len), |i| (i.sender_tag, i.length));
        if let (false, true, Some(e)) =
            (self.is_send, arrived, foreign_call(self.peer, self.key, self.meta, sender_tag))
        {
            return Err(e);
        }
        match r {
            Ok(()) if length != self.len => Err(mismatch(length)),
            Ok(()) if !self.is_send && self.shared.links.closed_by(self.world_peer) => {
                Err(CommError::LinkClosed { rank: self.peer })
            }
            Ok(()) => {
                self.stats.record(self.is_send, self.len);
                Ok(())
            }
            Err(e) if e.0 == sys::ucs_status_t::UCS_ERR_MESSAGE_TRUNCATED => Err(mismatch(length)),
            Err(e) => {
                // A dead peer's socket can reset before the store has seen its connection close: give the store
                // a moment, so that the error names the rank that died. (UCX 1.22 may report a TCP peer that
                // died as "not connected".)
                let lost = matches!(
                    e.0,
                    sys::ucs_status_t::UCS_ERR_CONNECTION_RESET
                        | sys::ucs_status_t::UCS_ERR_NOT_CONNECTED
                        | sys::ucs_status_t::UCS_ERR_ENDPOINT_TIMEOUT
                        | sys::ucs_status_t::UCS_ERR_UNREACHABLE
                );
                let t0 = Instant::now();
                loop {
                    if let Some(e) = self.shared.lost(self.world_peer, self.peer) {
                        return Err(e);
                    }
                    // A receive that fails after its sender withdrew the send (e.g. UCX 1.22's failed read of a
                    // send buffer the sender had freed) failed because of that withdrawal: say so.
                    if !self.is_send && self.shared.links.closed_by(self.world_peer) {
                        return Err(CommError::LinkClosed { rank: self.peer });
                    }
                    if !lost || t0.elapsed() > PEER_LOSS_GRACE {
                        let op = if self.is_send { "send to" } else { "receive from" };
                        return Err(CommError::Ucx(format!("{op} rank {}: {e}", self.peer)));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    /// One progress step; finishes the op if UCX completed it.
    fn poll(&mut self) -> bool {
        self.poll_counting().0
    }

    /// [`poll`](Self::poll), also returning how many events the worker reported.
    fn poll_counting(&mut self) -> (bool, usize) {
        if self.req.is_null() {
            return (true, 0);
        }
        let inner = lock(&self.shared.inner);
        let mut events = 0;
        loop {
            let k = inner.worker.progress() as usize;
            if k == 0 {
                break;
            }
            events += k;
        }
        // SAFETY: req is live (non-null) and belongs to this worker.
        let st = unsafe { inner.worker.status(self.req) };
        if let Some(st) = st {
            // SAFETY: completed; not used afterwards.
            unsafe { inner.worker.free(self.req) };
            drop(inner);
            self.released();
            self.done = Some(self.outcome(st));
            return (true, events);
        }
        (false, events)
    }

    /// Withdraws the op after a failure: cancels it, and if UCX keeps reading the buffer (a send to a stalled or
    /// dead peer) force-closes the endpoint to that peer so the buffer is released. Returns once UCX is done.
    fn abort(&mut self) {
        if self.req.is_null() {
            return;
        }
        {
            let inner = lock(&self.shared.inner);
            // SAFETY: req is live.
            unsafe { inner.worker.cancel(self.req) };
        }
        let t0 = Instant::now();
        let mut closed_at = None;
        while !self.poll() {
            if t0.elapsed() > Duration::from_millis(200) && closed_at.is_none() {
                if self.is_send {
                    // The receiver may still pull from the buffer after we return it: tell it (see link_flags).
                    self.shared.links.close_link_to(self.world_peer);
                }
                let mut inner = lock(&self.shared.inner);
                if let Some(ep) = inner.eps[self.world_peer].take() {
                    inner.broken[self.world_peer] = true;
                    inner.worker.close(ep, true, Duration::from_secs(5));
                }
                closed_at = Some(Instant::now());
            }
            if closed_at.is_some_and(|t| t.elapsed() > ABANDON_AFTER_CLOSE) {
                // UCX neither finished nor failed the request although its endpoint is closed (seen with a
                // rendezvous send over TCP whose receiver died: the request waits for a reply that cannot come).
                // Hand it back to UCX, which releases it whenever it ends, and stop waiting: the peer is gone, so
                // nothing moves the buffer any more.
                let inner = lock(&self.shared.inner);
                // SAFETY: req is live; it is not used afterwards.
                unsafe { inner.worker.free(self.req) };
                drop(inner);
                self.released();
                self.abandoned = true;
                break;
            }
            std::thread::yield_now();
        }
        self.done = None;
    }

    /// The request is no longer ours (finished and freed, or handed back): forget it.
    fn released(&mut self) {
        self.req = std::ptr::null_mut();
        if let (true, Some(p)) = (self.counted, &self.shared.progress) {
            p.finished();
        }
    }

    fn take_done(&mut self) -> Result<(), CommError> {
        self.done.take().unwrap_or(Ok(()))
    }

    pub(crate) fn test(&mut self) -> Result<bool, CommError> {
        if self.poll() {
            self.take_done().map(|()| true)
        } else {
            Ok(false)
        }
    }

    pub(crate) fn wait(&mut self) -> Result<(), CommError> {
        let _waiting = self.shared.progress.as_ref().map(|p| Waiting::new(p.state.clone()));
        let t0 = Instant::now();
        let (mut last_check, mut last_event) = (t0, t0);
        loop {
            let (done, events) = self.poll_counting();
            if done {
                break;
            }
            let now = Instant::now();
            if events > 0 {
                last_event = now;
            }
            if now.duration_since(t0) >= self.timeout {
                let unmatched = self.unmatched_from_peer();
                self.abort();
                if let Some(found) = unmatched {
                    return Err(self.mismatch_with(found));
                }
                let op = if self.is_send { "send" } else { "recv" };
                return Err(CommError::Timeout { op, peer: self.peer, after: self.timeout });
            }
            if now.duration_since(last_check) >= LIVENESS_POLL {
                last_check = now;
                if let Some(e) = self.shared.lost(self.world_peer, self.peer) {
                    self.abort();
                    return Err(e);
                }
            }
            // Poll hard (yielding to ranks that share our cores) while the worker has events, and for a few
            // milliseconds after the last, which covers the protocol round trips of a transfer; then sleep until
            // the worker has an event (or, without an event fd, back off), so a wait on a peer that is busy
            // elsewhere costs little CPU. Large messages over TCP keep the worker busy for their whole transfer,
            // so the spin is counted from the last event, not from the start of the wait: a sleep between turns
            // would leave the socket waiting for our wake-up.
            if now.duration_since(last_event) < SPIN {
                std::thread::yield_now();
            } else {
                self.sleep_until_event();
            }
        }
        self.take_done()
    }

    /// Sleeps until the worker signals an event on its fd, at most [`EVENT_SLEEP`]; returns at once when events
    /// are already pending. Without an event fd, sleeps a fixed 50 µs.
    fn sleep_until_event(&self) {
        let Some(fd) = self.shared.efd else {
            std::thread::sleep(Duration::from_micros(50));
            return;
        };
        // Armed under the worker's lock (serialized mode); the poll itself runs without it, so the progress
        // thread or another waiter may progress the worker meanwhile (a wake-up then at worst comes late by
        // `EVENT_SLEEP`).
        match lock(&self.shared.inner).worker.arm() {
            Ok(true) => {
                let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd for the duration of the call; an error or EINTR just ends the sleep.
                unsafe { libc::poll(&mut pfd, 1, EVENT_SLEEP.as_millis() as libc::c_int) };
            }
            Ok(false) => {} // events pending: progress them now
            Err(_) => std::thread::sleep(Duration::from_micros(50)),
        }
    }

    pub(crate) fn cancel(mut self) {
        self.abort();
    }

    /// For a receive that is giving up: the tag of a message that arrived from the same peer on the same
    /// communicator, of the same kind (user or internal), but did not match ours.
    fn unmatched_from_peer(&self) -> Option<u64> {
        if self.is_send || self.req.is_null() {
            return None;
        }
        let inner = lock(&self.shared.inner);
        while inner.worker.progress() > 0 {}
        // Context, source and the internal flag must agree; the user field (tag, or collective and digest) may not.
        let found = inner.worker.probe(self.tag, !USER_FIELD)?;
        // A message we would match (it arrived just now) is no mismatch; for collectives, the same collective
        // with another digest would have matched too (the digest is masked), so compare the collective only.
        let differs = if is_internal(self.key) { (found ^ self.tag) & 0xFF != 0 } else { found != self.tag };
        differs.then_some(found)
    }

    /// The error for a receive that timed out while the peer's message with tag `found` waited unmatched.
    fn mismatch_with(&self, found: u64) -> CommError {
        if is_internal(self.key) {
            let theirs = format!("{} (a different collective)", name(found & 0xFF));
            mismatch_as(self.peer, self.meta, theirs)
        } else {
            CommError::TagMismatch { src: self.peer, dst: self.me, expected: self.key, found: found & USER_FIELD }
        }
    }
}

impl Drop for UcxOp {
    fn drop(&mut self) {
        if !self.req.is_null() {
            if std::thread::panicking() {
                self.abort();
            } else {
                let _ = self.wait();
            }
        }
        if let Some(b) = self.info.take() {
            if self.abandoned {
                // UCX may still complete the request and write the info.
                Box::leak(b);
            } else {
                self.shared.return_info(b);
            }
        }
    }
}
