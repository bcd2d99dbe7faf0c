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

pub(crate) mod result;
pub(crate) mod safe;
#[allow(missing_docs)]
pub(crate) mod sys;

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::collectives::{digest_mismatch, mismatch_code};
use crate::communicator::INTERNAL;
use crate::rendezvous::{Store, StoreHost};
use crate::stats::StatsCounters;
use crate::threads::lock;
use crate::{Bootstrap, CommError};
use result::Started;

const CTX_BITS: u32 = 19;
const SRC_SHIFT: u32 = 33;
const CTX_SHIFT: u32 = 45;
/// Most ranks the tag layout can name.
pub(crate) const MAX_RANKS: usize = 1 << 12;
const LIVENESS_POLL: Duration = Duration::from_millis(100);
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

struct Inner {
    eps: Vec<Option<safe::Endpoint>>,
    /// Peers whose endpoint was force-closed after a failure.
    broken: Vec<bool>,
    worker: safe::Worker,
}

/// What the communicators of one process share: the worker, endpoints to every process, the store.
pub(crate) struct Shared {
    inner: Mutex<Inner>,
    store: Store,
    _host: Option<StoreHost>,
    next_ctx: AtomicU64,
}

// SAFETY: the UCX handles inside `Inner` are only touched with `inner` locked (the worker is in serialized
// mode), so moving or sharing `Shared` between threads is sound.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Drop for Shared {
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        let eps: Vec<_> = inner.eps.iter_mut().filter_map(Option::take).collect();
        for ep in eps {
            inner.worker.close(ep, false, Duration::from_secs(2));
        }
    }
}

impl Shared {
    fn gone(&self, world_rank: usize) -> bool {
        match self.store.try_get(&format!("gone/{world_rank}")) {
            Ok(v) => v.is_some(),
            // The store lives in rank 0's process: losing it means rank 0 is gone.
            Err(_) => world_rank == 0,
        }
    }
}

/// Creates the world communicator of this process from the environment (see [`Bootstrap::from_env`]).
pub(crate) fn from_env(timeout: Duration) -> Result<crate::Communicator, CommError> {
    let b = Bootstrap::from_env()?;
    if b.world_size > MAX_RANKS {
        return Err(CommError::Bootstrap(format!("the UCX transport supports at most {MAX_RANKS} ranks")));
    }
    let host = if b.rank == 0 {
        let mut h = StoreHost::bind((b.master_addr.as_str(), b.master_port), &b.token)?;
        h.set_linger(timeout);
        Some(h)
    } else {
        None
    };
    let store = Store::connect(b.master_socket()?, &b.token, timeout)?;
    store.register(b.rank)?;
    let worker = safe::Worker::new(safe::Context::new()?)?;
    store.set(&format!("ucx/{}", b.rank), &worker.address()?)?;
    let mut eps = Vec::with_capacity(b.world_size);
    for r in 0..b.world_size {
        let addr = store.get(&format!("ucx/{r}"))?;
        eps.push(Some(worker.connect(&addr)?));
    }
    let shared = Arc::new(Shared {
        inner: Mutex::new(Inner { eps, broken: vec![false; b.world_size], worker }),
        store,
        _host: host,
        next_ctx: AtomicU64::new(1),
    });
    let members: Arc<[usize]> = (0..b.world_size).collect();
    let ep = UcxEndpoint { shared, ctx: 0, members, rank: b.rank };
    let comm = crate::Communicator::from_ucx(ep, timeout);
    comm.barrier()?;
    Ok(comm.with_fresh_stats())
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

    /// Posts a send or receive (internal messages carry a digest of `meta`: see the module docs).
    ///
    /// # Safety
    /// As [`crate::Communicator::post`].
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
    ) -> Result<UcxOp, CommError> {
        let world_peer = self.members[peer];
        let mut info = Box::new(sys::ucp_tag_recv_info_t { sender_tag: 0, length: 0 });
        let inner = lock(&self.shared.inner);
        let ep = match (&inner.eps[world_peer], inner.broken[world_peer]) {
            (Some(ep), false) => ep,
            _ => return Err(CommError::PeerGone { rank: peer }),
        };
        let started = if is_send {
            // SAFETY: the caller keeps the buffer alive until the op finishes.
            unsafe { inner.worker.tag_send(ep, ptr, len, self.tag(self.rank, key, meta)) }
        } else {
            let mask = if is_internal(key) { !DIGEST_FIELD } else { u64::MAX };
            // SAFETY: as above; `info` is boxed and owned by the op.
            unsafe { inner.worker.tag_recv(ptr, len, self.tag(peer, key, meta), mask, &mut *info) }
        };
        drop(inner);
        let started = match started {
            Ok(s) => s,
            Err(e) if e.0 == sys::ucs_status_t::UCS_ERR_MESSAGE_TRUNCATED => {
                if is_internal(key) && info.sender_tag != 0 && info.sender_tag & DIGEST_FIELD != digest(meta) {
                    return Err(digest_mismatch(peer, meta));
                }
                return Err(CommError::LengthMismatch {
                    src: peer,
                    dst: self.rank,
                    tag: key,
                    message_bytes: info.length,
                    buffer_bytes: len,
                });
            }
            Err(e) => return Err(e.into()),
        };
        let mut op = UcxOp {
            shared: self.shared.clone(),
            req: std::ptr::null_mut(),
            info,
            is_send,
            peer,
            world_peer,
            me: self.rank,
            key,
            meta,
            tag: self.tag(peer, key, meta),
            len,
            timeout,
            stats: stats.clone(),
            done: None,
        };
        match started {
            Started::Done => op.done = Some(op.outcome(Ok(()))),
            Started::Request(r) => op.req = r,
        }
        Ok(op)
    }
}

/// An operation posted on the UCX transport.
pub(crate) struct UcxOp {
    shared: Arc<Shared>,
    /// The UCX request while in flight, null once finished.
    req: *mut c_void,
    info: Box<sys::ucp_tag_recv_info_t>,
    is_send: bool,
    peer: usize,
    world_peer: usize,
    me: usize,
    key: u64,
    /// The collective's descriptor (0 for point-to-point).
    meta: u64,
    /// The full tag of a receive (the peer's sends carry it), to diagnose a timeout.
    tag: u64,
    len: usize,
    timeout: Duration,
    stats: Arc<StatsCounters>,
    /// Set once finished and not yet reported.
    done: Option<Result<(), CommError>>,
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
        if !self.is_send && arrived && is_internal(self.key) && self.info.sender_tag & DIGEST_FIELD != digest(self.meta)
        {
            return Err(digest_mismatch(self.peer, self.meta));
        }
        match r {
            Ok(()) if !self.is_send && self.info.length != self.len => Err(mismatch(self.info.length)),
            Ok(()) => {
                self.stats.record(self.is_send, self.len);
                Ok(())
            }
            Err(e) if e.0 == sys::ucs_status_t::UCS_ERR_MESSAGE_TRUNCATED => Err(mismatch(self.info.length)),
            Err(e) => {
                if self.shared.gone(self.world_peer) {
                    Err(CommError::PeerGone { rank: self.peer })
                } else {
                    Err(e.into())
                }
            }
        }
    }

    /// One progress step; finishes the op if UCX completed it.
    fn poll(&mut self) -> bool {
        if self.req.is_null() {
            return true;
        }
        let inner = lock(&self.shared.inner);
        while inner.worker.progress() > 0 {}
        // SAFETY: req is live (non-null) and belongs to this worker.
        let st = unsafe { inner.worker.status(self.req) };
        if let Some(st) = st {
            // SAFETY: completed; not used afterwards.
            unsafe { inner.worker.free(self.req) };
            self.req = std::ptr::null_mut();
            drop(inner);
            self.done = Some(self.outcome(st));
            return true;
        }
        false
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
        while !self.poll() {
            if t0.elapsed() > Duration::from_millis(200) {
                let mut inner = lock(&self.shared.inner);
                if let Some(ep) = inner.eps[self.world_peer].take() {
                    inner.broken[self.world_peer] = true;
                    inner.worker.close(ep, true, Duration::from_secs(5));
                }
            }
            std::thread::yield_now();
        }
        self.done = None;
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
        let t0 = Instant::now();
        let mut last_check = t0;
        while !self.poll() {
            let now = Instant::now();
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
                if self.shared.gone(self.world_peer) {
                    self.abort();
                    return Err(CommError::PeerGone { rank: self.peer });
                }
            }
            // Poll hard (yielding to ranks that share our cores) for the first milliseconds, which covers the
            // protocol round trips of a transfer; then back off so a long wait on a slow peer costs little CPU.
            if now.duration_since(t0) < Duration::from_millis(5) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        self.take_done()
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
            mismatch_code(self.peer, self.meta, found & 0xFF)
        } else {
            CommError::TagMismatch { src: self.peer, dst: self.me, expected: self.key, found: found & USER_FIELD }
        }
    }
}

impl Drop for UcxOp {
    fn drop(&mut self) {
        if self.req.is_null() {
            return;
        }
        if std::thread::panicking() {
            self.abort();
        } else {
            let _ = self.wait();
        }
    }
}
