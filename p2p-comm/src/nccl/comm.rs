//! One rank's NCCL communicator over one device: created collectively through the host communicator, its
//! transfers enqueued on a stream of its own and finished by polling an event, so that a wait honours the
//! communicator's timeout (a stalled or dead peer makes NCCL's kernels spin forever; on timeout the communicator is
//! aborted, which ends them, and is unusable afterwards).
//!
//! Point-to-point transfers are queued and launched together, as one NCCL group, when one of them is first waited
//! for (or when a collective is called): so a ring shift whose sends and receives every rank posts before it waits
//! cannot deadlock, whatever the order of the posts. NCCL has no tags: the transfers between two ranks match in the
//! order they are posted, so both sides must post them in the same order (ring attention does).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::library::{nccl, Nccl, RawComm, UniqueId};
use crate::error::CommError;
use crate::stats::StatsCounters;
use crate::sync::lock;

/// A rank's NCCL communicator (see the module docs).
pub(crate) struct NcclComm {
    lib: &'static Nccl,
    raw: RawComm,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: u32,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// The transfers posted and not yet launched. Every NCCL call is made with this lock held (a communicator is
    /// not thread-safe).
    open: Mutex<OpenGroup>,
    /// Set when the communicator was aborted (after a timeout or an error): every later call fails.
    aborted: AtomicBool,
    stats: Arc<StatsCounters>,
}

// SAFETY: `raw` is only passed to NCCL with `open` locked (or, in `drop`, with exclusive access); the CUDA handles
// are cudarc's, which are Send and Sync.
unsafe impl Send for NcclComm {}
// SAFETY: as above.
unsafe impl Sync for NcclComm {}

#[derive(Default)]
struct OpenGroup {
    ops: Vec<Transfer>,
    group: Arc<Group>,
}

#[derive(Clone, Copy)]
struct Transfer {
    is_send: bool,
    peer: usize,
    ptr: u64,
    len: usize,
}

/// The launch of one group of transfers: the event recorded after it, once launched.
#[derive(Default)]
struct Group {
    /// The error is kept as text: every request of the group reports it.
    launched: OnceLock<Result<Arc<CudaEvent>, String>>,
}

/// A queued or launched transfer; [`wait`](NcclRequest::wait) launches its group if need be and waits for it.
/// Dropping it waits too (a buffer must not be freed under a transfer).
pub(crate) struct NcclRequest {
    comm: Arc<NcclComm>,
    group: Arc<Group>,
    transfer: Transfer,
    done: bool,
}

impl NcclComm {
    /// Creates rank `rank`'s communicator of `world` ranks on device `ordinal` (collective: every rank calls it,
    /// each with its own device; NCCL refuses two ranks on one device). `all_gather` is the host communicator's
    /// all-gather of equal byte strings, in rank order: it carries rank 0's unique id to the others, and whether
    /// every rank is ready, so that a rank that cannot load NCCL or the driver makes every rank fail before any
    /// enters NCCL's initialisation.
    pub(crate) fn new(
        (rank, world, timeout): (usize, usize, Duration),
        ordinal: u32,
        stats: Arc<StatsCounters>,
        all_gather: impl FnOnce(&[u8], &mut [u8]) -> Result<(), CommError>,
    ) -> Result<Arc<Self>, CommError> {
        let local = prepare(ordinal, rank == 0);
        // Every rank learns whether every rank is ready, and rank 0's id: [ok, id…] per rank.
        let mut mine = vec![0u8; 1 + 128];
        if let Ok((_, _, id)) = &local {
            mine[0] = 1;
            if let Some(id) = id {
                for (d, s) in mine[1..].iter_mut().zip(id.internal.iter()) {
                    *d = *s as u8;
                }
            }
        }
        let mut all = vec![0u8; world * mine.len()];
        all_gather(&mine, &mut all)?;
        let (lib, ctx, _) = local?;
        if let Some(r) = all.chunks(mine.len()).position(|c| c[0] == 0) {
            return Err(CommError::Nccl(format!(
                "rank {r} could not load NCCL or the CUDA driver, so no rank starts NCCL"
            )));
        }
        let mut id = UniqueId { internal: [0; 128] };
        for (d, s) in id.internal.iter_mut().zip(&all[1..mine.len()]) {
            *d = *s as std::ffi::c_char;
        }
        let stream = ctx.new_stream().map_err(|e| driver_err(ordinal, "creating the NCCL stream", e))?;
        let raw = init_rank(lib, &ctx, ordinal, id, rank, world, timeout)?;
        Ok(Arc::new(NcclComm {
            lib,
            raw,
            ctx,
            stream,
            ordinal,
            rank,
            world,
            timeout,
            open: Mutex::new(OpenGroup::default()),
            aborted: AtomicBool::new(false),
            stats,
        }))
    }

    /// The device this communicator moves memory of.
    pub(crate) fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Queues a send (or receive) of `len` bytes at device address `ptr` to (from) `peer`, launched with the
    /// other queued transfers at the first wait.
    pub(crate) fn post(
        self: &Arc<Self>,
        is_send: bool,
        peer: usize,
        ptr: u64,
        len: usize,
    ) -> Result<NcclRequest, CommError> {
        self.usable()?;
        let transfer = Transfer { is_send, peer, ptr, len };
        let mut open = lock(&self.open);
        open.ops.push(transfer);
        Ok(NcclRequest { comm: self.clone(), group: open.group.clone(), transfer, done: false })
    }

    /// Sums (or maximises) `count` elements of NCCL type `dtype` at `ptr` over the ranks, in place; blocking.
    /// NCCL's internal messages are not counted in the communicator's statistics.
    pub(crate) fn all_reduce(&self, ptr: u64, count: usize, dtype: i32, op: i32) -> Result<(), CommError> {
        let event = self.launch("ncclAllReduce", |lib, raw, stream| {
            // SAFETY: `ptr` holds `count` elements of `dtype` on this communicator's device, idle until this
            // returns (the memory module's contract); in place is allowed.
            unsafe { (lib.all_reduce)(ptr as *const _, ptr as *mut _, count, dtype, op, raw, stream) }
        })?;
        self.finish(&event, "all_reduce", self.rank)
    }

    /// Gathers every rank's `bytes` at `send` into `recv` (world size × `bytes`), in rank order; blocking.
    pub(crate) fn all_gather(&self, send: u64, recv: u64, bytes: usize) -> Result<(), CommError> {
        let event = self.launch("ncclAllGather", |lib, raw, stream| {
            // SAFETY: as in all_reduce; `recv` holds world × `bytes`.
            unsafe {
                (lib.all_gather)(send as *const _, recv as *mut _, bytes, super::library::dtype::UINT8, raw, stream)
            }
        })?;
        self.finish(&event, "all_gather", self.rank)?;
        self.count_parts(bytes);
        Ok(())
    }

    /// Counts a collective's parts as the host transports' direct collectives do: one message to and one from
    /// every other rank (NCCL's own routing of them is not seen).
    fn count_parts(&self, bytes: usize) {
        for _ in 1..self.world {
            self.stats.record(true, bytes);
            self.stats.record(false, bytes);
        }
    }

    /// Chunk `j` of `send` to rank `j`, chunk `i` of `recv` from rank `i` (`chunk` bytes each): one group of sends
    /// and receives; blocking.
    pub(crate) fn all_to_all(&self, send: u64, recv: u64, chunk: usize, world: usize) -> Result<(), CommError> {
        let mut open = lock(&self.open);
        for peer in 0..world {
            let off = (peer * chunk) as u64;
            open.ops.push(Transfer { is_send: true, peer, ptr: send + off, len: chunk });
            open.ops.push(Transfer { is_send: false, peer, ptr: recv + off, len: chunk });
        }
        let event = self.launch_open(&mut open)?;
        drop(open);
        self.finish(&event, "all_to_all", self.rank)?;
        self.count_parts(chunk);
        Ok(())
    }

    fn usable(&self) -> Result<(), CommError> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(CommError::Nccl("the NCCL communicator was aborted after an earlier failure".into()));
        }
        Ok(())
    }

    /// Launches the queued transfers (so they keep their order before what follows), then `call`, and records an
    /// event after them.
    fn launch(
        &self,
        what: &str,
        call: impl FnOnce(&Nccl, RawComm, super::library::RawStream) -> i32,
    ) -> Result<Arc<CudaEvent>, CommError> {
        self.usable()?;
        let mut open = lock(&self.open);
        self.launch_open(&mut open)?;
        self.bind()?;
        let r = call(self.lib, self.raw, self.stream.cu_stream() as _);
        self.lib.check(what, r, self.raw).inspect_err(|_| self.abort())?;
        self.record()
    }

    /// Launches the open group (if it has transfers) as one NCCL group, records its event and opens a new one.
    fn launch_open(&self, open: &mut OpenGroup) -> Result<Arc<CudaEvent>, CommError> {
        let ops = std::mem::take(&mut open.ops);
        let group = std::mem::take(&mut open.group);
        let result = self.launch_group(&ops);
        let _ = group.launched.set(result.as_ref().map(Arc::clone).map_err(|e| e.to_string()));
        result
    }

    fn launch_group(&self, ops: &[Transfer]) -> Result<Arc<CudaEvent>, CommError> {
        self.usable()?;
        self.bind()?;
        if !ops.is_empty() {
            let (lib, raw, stream) = (self.lib, self.raw, self.stream.cu_stream() as _);
            // SAFETY: group calls take no arguments.
            lib.check("ncclGroupStart", unsafe { (lib.group_start)() }, raw)?;
            for t in ops {
                let f = if t.is_send { lib.send } else { lib.recv };
                // SAFETY: each transfer's `len` bytes at `ptr` are on this device and idle until its request is
                // finished (the memory module's contract; requests wait for the group when dropped).
                let r = unsafe { f(t.ptr as *mut _, t.len, super::library::dtype::UINT8, t.peer as i32, raw, stream) };
                if let Err(e) = lib.check(if t.is_send { "ncclSend" } else { "ncclRecv" }, r, raw) {
                    // SAFETY: closes the group opened above.
                    unsafe { (lib.group_end)() };
                    self.abort();
                    return Err(e);
                }
            }
            // SAFETY: closes the group opened above.
            let r = unsafe { (lib.group_end)() };
            lib.check("ncclGroupEnd", r, raw).inspect_err(|_| self.abort())?;
        }
        self.record()
    }

    fn bind(&self) -> Result<(), CommError> {
        self.ctx.bind_to_thread().map_err(|e| driver_err(self.ordinal, "making the device's context current", e))
    }

    fn record(&self) -> Result<Arc<CudaEvent>, CommError> {
        self.stream
            .record_event(None)
            .map(Arc::new)
            .map_err(|e| driver_err(self.ordinal, "recording the NCCL stream's event", e))
    }

    /// Waits for `event`, polling it and NCCL's asynchronous error, until the timeout; on an error or the timeout
    /// aborts the communicator.
    fn finish(&self, event: &CudaEvent, op: &'static str, peer: usize) -> Result<(), CommError> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    self.abort();
                    return Err(driver_err(self.ordinal, "waiting for an NCCL transfer", e));
                }
            }
            let mut async_err = 0;
            {
                let _open = lock(&self.open);
                // SAFETY: writes one result; the lock serialises calls on the communicator.
                let r = unsafe { (self.lib.comm_get_async_error)(self.raw, &mut async_err) };
                self.lib.check("ncclCommGetAsyncError", r, self.raw)?;
            }
            // 7 is ncclInProgress: not an error.
            if async_err != 0 && async_err != 7 {
                let e = self.lib.check("an NCCL transfer", async_err, self.raw);
                self.abort();
                return e;
            }
            if start.elapsed() > self.timeout {
                self.abort();
                return Err(CommError::Timeout { op, peer, after: self.timeout });
            }
            spins += 1;
            if spins < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Aborts the communicator: NCCL's kernels in flight end, and every later call fails.
    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            // SAFETY: the communicator is valid; after this it is only destroyed (in drop, which skips aborted ones).
            unsafe { (self.lib.comm_abort)(self.raw) };
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::Acquire) {
            let _ = self.bind();
            // Finishes what is in flight (every request holds an Arc, so none is pending), then frees.
            let _ = self.stream.synchronize();
            // SAFETY: exclusive access; no request refers to it any longer.
            unsafe { (self.lib.comm_destroy)(self.raw) };
        }
    }
}

impl NcclRequest {
    /// Launches the request's group if it is still queued, then waits for it (honouring the timeout).
    pub(crate) fn wait(mut self) -> Result<(), CommError> {
        self.finish()
    }

    fn finish(&mut self) -> Result<(), CommError> {
        self.done = true;
        let comm = &self.comm;
        if self.group.launched.get().is_none() {
            let mut open = lock(&comm.open);
            if Arc::ptr_eq(&open.group, &self.group) {
                comm.launch_open(&mut open)?;
            }
        }
        let event = match self.group.launched.get() {
            Some(Ok(e)) => e.clone(),
            Some(Err(e)) => return Err(CommError::Nccl(e.clone())),
            None => return Err(CommError::Nccl("an NCCL group was neither queued nor launched".into())),
        };
        let t = self.transfer;
        comm.finish(&event, if t.is_send { "send" } else { "recv" }, t.peer)?;
        comm.stats.record(t.is_send, t.len);
        Ok(())
    }
}

impl Drop for NcclRequest {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.finish();
        }
    }
}

/// This rank's half of the set-up: NCCL, the device's context, and on rank 0 the unique id.
fn prepare(ordinal: u32, make_id: bool) -> Result<(&'static Nccl, Arc<CudaContext>, Option<UniqueId>), CommError> {
    let lib = nccl()?;
    // SAFETY: only dlopens candidate names (cudarc panics on its first call when the driver is missing).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CommError::Nccl("the CUDA driver (libcuda.so.1) was not found".into()));
    }
    let ctx = CudaContext::new(ordinal as usize).map_err(|e| driver_err(ordinal, "opening the device", e))?;
    let id = if make_id {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: writes one unique id.
        let r = unsafe { (lib.get_unique_id)(&mut id) };
        lib.check("ncclGetUniqueId", r, std::ptr::null_mut())?;
        Some(id)
    } else {
        None
    };
    Ok((lib, ctx, id))
}

/// `ncclCommInitRank` on a thread of its own, so that a rank that never joins fails the others within `timeout`
/// (the thread is then left blocked in NCCL).
fn init_rank(
    lib: &'static Nccl,
    ctx: &Arc<CudaContext>,
    ordinal: u32,
    id: UniqueId,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> Result<RawComm, CommError> {
    struct Raw(RawComm);
    // SAFETY: the handle is only moved to the caller's thread, which uses it alone.
    unsafe impl Send for Raw {}
    let (tx, rx) = std::sync::mpsc::channel();
    let ctx = ctx.clone();
    std::thread::Builder::new()
        .name(format!("nccl-init-{rank}"))
        .spawn(move || {
            let result = ctx
                .bind_to_thread()
                .map_err(|e| driver_err(ordinal, "making the device's context current", e))
                .and_then(|()| {
                    let mut raw: RawComm = std::ptr::null_mut();
                    // SAFETY: writes one communicator handle; `id` is rank 0's, shared by every rank.
                    let r = unsafe { (lib.comm_init_rank)(&mut raw, world as i32, id, rank as i32) };
                    lib.check("ncclCommInitRank", r, std::ptr::null_mut()).map(|()| Raw(raw))
                });
            let _ = tx.send(result);
        })
        .map_err(|e| CommError::io("spawning NCCL's initialisation thread", e))?;
    match rx.recv_timeout(timeout) {
        Ok(r) => r.map(|r| r.0),
        Err(_) => Err(CommError::Timeout { op: "ncclCommInitRank", peer: 0, after: timeout }),
    }
}

fn driver_err(ordinal: u32, what: &str, e: cudarc::driver::DriverError) -> CommError {
    CommError::Nccl(format!("device {ordinal}: {what}: {e:?}"))
}
