//! Owned UCX objects. None of them is thread-safe by itself: the transport keeps the worker (and through it the
//! endpoints and requests) behind one mutex, and the worker is created in `UCS_THREAD_MODE_SERIALIZED`.

use std::ffi::c_void;
use std::ptr;

use super::result::{check, started, Started, UcxError};
use super::sys;

/// The version of the UCX library loaded at run time (`ucp_get_version`), which may differ from the headers
/// the bindings were generated from.
pub fn library_version() -> (u32, u32, u32) {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: ucp_get_version only writes the three integers.
    unsafe { sys::ucp_get_version(&mut major, &mut minor, &mut release) };
    (major, minor, release)
}

/// A UCP context with the TAG feature.
pub struct Context(sys::ucp_context_h);

impl Context {
    /// `ucp_init` (through `ucp_init_version`, as the header's inline `ucp_init` does).
    /// `wakeup` adds `UCP_FEATURE_WAKEUP`, so a worker can be armed and slept on through its event fd.
    pub fn new(wakeup: bool) -> Result<Context, UcxError> {
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: null env prefix and file name select the defaults; config is released below.
        check(unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut config) })?;
        let params = sys::ucp_params_t {
            field_mask: sys::ucp_params_field_UCP_PARAM_FIELD_FEATURES as u64,
            features: (sys::ucp_feature_UCP_FEATURE_TAG | if wakeup { sys::ucp_feature_UCP_FEATURE_WAKEUP } else { 0 })
                as u64,
            ..Default::default()
        };
        let mut h: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: params and config are valid for the call; h receives the context on success.
        let s = unsafe { sys::ucp_init_version(sys::UCP_API_MAJOR, sys::UCP_API_MINOR, &params, config, &mut h) };
        // SAFETY: config came from ucp_config_read and is not used after this.
        unsafe { sys::ucp_config_release(config) };
        check(s)?;
        Ok(Context(h))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context is valid and every worker of it was destroyed first (Worker holds the Context).
        unsafe { sys::ucp_cleanup(self.0) }
    }
}

/// A UCP worker, the engine that progresses communication. Field order drops the worker before its context.
pub struct Worker {
    h: sys::ucp_worker_h,
    _ctx: Context,
}

impl Worker {
    /// Creates a worker in serialized thread mode.
    pub fn new(ctx: Context) -> Result<Worker, UcxError> {
        let params = sys::ucp_worker_params_t {
            field_mask: sys::ucp_worker_params_field_UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::ucs_thread_mode_t_UCS_THREAD_MODE_SERIALIZED,
            ..Default::default()
        };
        let mut h: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: ctx is a live context; h receives the worker.
        check(unsafe { sys::ucp_worker_create(ctx.0, &params, &mut h) })?;
        Ok(Worker { h, _ctx: ctx })
    }

    /// Whether this worker's context moves CUDA device memory itself (UCX built with CUDA support, its
    /// `cuda_copy`/`cuda_ipc` transports loaded): the `UCS_MEMORY_TYPE_CUDA` bit of the context's memory types.
    pub fn reaches_cuda(&self) -> bool {
        let mut attr = sys::ucp_context_attr_t {
            field_mask: sys::ucp_context_attr_field_UCP_ATTR_FIELD_MEMORY_TYPES as u64,
            ..Default::default()
        };
        // SAFETY: the context is live (the worker holds it); the call only writes the fields the mask names.
        let queried = check(unsafe { sys::ucp_context_query(self._ctx.0, &mut attr) }).is_ok();
        queried && attr.memory_types & (1 << sys::ucs_memory_type_UCS_MEMORY_TYPE_CUDA) != 0
    }

    /// The worker's address, to give to peers out of band.
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        let mut a: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: the worker is live; a/len receive a buffer we copy and release.
        check(unsafe { sys::ucp_worker_get_address(self.h, &mut a, &mut len) })?;
        // SAFETY: UCX returned `len` readable bytes at `a`.
        let v = unsafe { std::slice::from_raw_parts(a as *const u8, len) }.to_vec();
        // SAFETY: `a` came from ucp_worker_get_address on this worker.
        unsafe { sys::ucp_worker_release_address(self.h, a) };
        Ok(v)
    }

    /// Makes progress; returns the number of events processed.
    pub fn progress(&self) -> u32 {
        // SAFETY: the worker is live and the caller holds the transport's lock (serialized mode).
        unsafe { sys::ucp_worker_progress(self.h) }
    }

    /// The worker's event file descriptor (context created with `wakeup`): readable after [`Worker::arm`] once
    /// an event arrives.
    pub fn event_fd(&self) -> Result<i32, UcxError> {
        let mut fd = -1;
        // SAFETY: the worker is live; fd receives the descriptor, owned by the worker.
        check(unsafe { sys::ucp_worker_get_efd(self.h, &mut fd) })?;
        Ok(fd)
    }

    /// Arms the event fd: `Ok(true)` when armed (sleeping on the fd is safe), `Ok(false)` when events are pending
    /// and the worker must be progressed first.
    pub fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: the worker is live and the caller holds the transport's lock.
        let s = unsafe { sys::ucp_worker_arm(self.h) };
        if s == sys::ucs_status_t::UCS_ERR_BUSY {
            return Ok(false);
        }
        check(s).map(|()| true)
    }

    /// Creates an endpoint to the worker whose address is `addr`.
    pub fn connect(&self, addr: &[u8]) -> Result<Endpoint, UcxError> {
        // By default no UCP_ERR_HANDLING_MODE_PEER: it restricts UCX to transports that can detect peer failure,
        // which puts a peer on the same host on TCP over `lo` (no sysv, no cma), at a large cost in bandwidth
        // (BENCHMARKS.md, "Cost of UCX's peer error handling"); the transport detects dead peers itself, through
        // the store. The price: UCX 1.13 to 1.21 abort a process whose cma read from a peer that died mid-transfer
        // fails (1.22 fails the read's request). `LONGCTX_UCX_PEER_ERRORS=1` buys survival of that case with the
        // bandwidth.
        let peer = std::env::var("LONGCTX_UCX_PEER_ERRORS").as_deref() == Ok("1");
        let params = sys::ucp_ep_params_t {
            field_mask: sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64
                | if peer { sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE as u64 } else { 0 },
            address: addr.as_ptr() as *const sys::ucp_address_t,
            err_mode: if peer {
                sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_NONE
            },
            ..Default::default()
        };
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: addr stays alive for the call (UCX copies what it needs); ep receives the endpoint.
        check(unsafe { sys::ucp_ep_create(self.h, &params, &mut ep) })?;
        Ok(Endpoint(ep))
    }

    /// Starts a tagged send of `len` bytes at `buf`, in CUDA device memory if `cuda`.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid until the returned request completes (or `Done` is returned).
    pub(crate) unsafe fn tag_send(
        &self,
        ep: &Endpoint,
        buf: *const u8,
        len: usize,
        tag: u64,
        cuda: bool,
    ) -> Result<Started, UcxError> {
        let mut param = sys::ucp_request_param_t::default();
        if cuda {
            param.op_attr_mask |= sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            param.memory_type = sys::ucs_memory_type_UCS_MEMORY_TYPE_CUDA;
        }
        // SAFETY: per the caller's contract; contiguous bytes, no callback.
        started(unsafe { sys::ucp_tag_send_nbx(ep.0, buf as *const c_void, len, tag, &param) })
    }

    /// Starts a tagged receive into `buf` (in CUDA device memory if `cuda`) of the first message whose tag equals
    /// `tag` on the bits set in `mask`; `info` receives the message's length and full tag.
    ///
    /// # Safety
    /// `buf..buf+len` and `info` must stay valid until the request completes (or `Done` is returned).
    pub(crate) unsafe fn tag_recv(
        &self,
        buf: *mut u8,
        len: usize,
        tag: u64,
        mask: u64,
        info: *mut sys::ucp_tag_recv_info_t,
        cuda: bool,
    ) -> Result<Started, UcxError> {
        let mut param = sys::ucp_request_param_t {
            op_attr_mask: sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_RECV_INFO
                | sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_CALLBACK
                | sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_USER_DATA
                // UCX 1.13 leaves `recv_info` unset on immediate completion: always get a request instead.
                | sys::ucp_op_attr_t_UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            user_data: info as *mut c_void,
            ..Default::default()
        };
        if cuda {
            param.op_attr_mask |= sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            param.memory_type = sys::ucs_memory_type_UCS_MEMORY_TYPE_CUDA;
        }
        // The callback fills `info` on completion.
        param.recv_info.tag_info = info;
        param.cb.recv = Some(recv_done);
        // SAFETY: per the caller's contract.
        started(unsafe { sys::ucp_tag_recv_nbx(self.h, buf as *mut c_void, len, tag, mask, &param) })
    }

    /// The full tag of an arrived, not yet received message whose tag equals `tag` on the bits set in `mask`,
    /// if there is one (the message stays queued). Call after progressing the worker.
    pub fn probe(&self, tag: u64, mask: u64) -> Option<u64> {
        let mut info = sys::ucp_tag_recv_info_t { sender_tag: 0, length: 0 };
        // SAFETY: the worker is live and the caller holds the transport's lock; remove = 0 leaves the message
        // queued, so no handle is returned to us to release.
        let h = unsafe { sys::ucp_tag_probe_nb(self.h, tag, mask, 0, &mut info) };
        (!h.is_null()).then_some(info.sender_tag)
    }

    /// Status of a send or receive request (`None` while in progress).
    ///
    /// # Safety
    /// `req` must be a live request of this worker.
    pub(crate) unsafe fn status(&self, req: *mut c_void) -> Option<Result<(), UcxError>> {
        // SAFETY: per the caller's contract.
        let s = unsafe { sys::ucp_request_check_status(req) };
        (s != sys::ucs_status_t::UCS_INPROGRESS).then(|| check(s))
    }

    /// Asks UCX to cancel a request (completes it with `UCS_ERR_CANCELED` if it was not matched yet).
    ///
    /// # Safety
    /// `req` must be a live request of this worker.
    pub(crate) unsafe fn cancel(&self, req: *mut c_void) {
        // SAFETY: per the caller's contract.
        unsafe { sys::ucp_request_cancel(self.h, req) }
    }

    /// Releases a request: a completed one at once, one still in progress when it ends (no callback then).
    ///
    /// # Safety
    /// `req` must be a live request of this worker, not used afterwards.
    pub(crate) unsafe fn free(&self, req: *mut c_void) {
        // SAFETY: per the caller's contract.
        unsafe { sys::ucp_request_free(req) }
    }

    /// Closes an endpoint (`force`: without flushing, failing its outstanding requests) and progresses until the
    /// close completes or `patience` elapses.
    pub fn close(&self, ep: Endpoint, force: bool, patience: std::time::Duration) {
        self.close_all(vec![ep], force, patience);
    }

    /// Closes every endpoint of `eps` at once, progressing them together for at most `patience` in all: closing
    /// one after the other, each stalled peer would cost its own `patience`.
    pub fn close_all(&self, eps: Vec<Endpoint>, force: bool, patience: std::time::Duration) {
        let mut param = sys::ucp_request_param_t::default();
        if force {
            param.op_attr_mask = sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = sys::ucp_ep_close_flags_t_UCP_EP_CLOSE_FLAG_FORCE;
        }
        let mut pending: Vec<*mut c_void> = eps
            .into_iter()
            .filter_map(|ep| {
                // SAFETY: ep is a live endpoint of this worker, consumed here.
                let p = unsafe { sys::ucp_ep_close_nbx(ep.0, &param) };
                match started(p) {
                    Ok(Started::Request(req)) => Some(req),
                    _ => None,
                }
            })
            .collect();
        let t0 = std::time::Instant::now();
        while !pending.is_empty() {
            self.progress();
            pending.retain(|&req| {
                // SAFETY: req is a live close request.
                if unsafe { sys::ucp_request_check_status(req) } == sys::ucs_status_t::UCS_INPROGRESS {
                    return true;
                }
                // SAFETY: completed; not used afterwards.
                unsafe { sys::ucp_request_free(req) };
                false
            });
            if t0.elapsed() > patience {
                // Those peers do not answer (stalled or gone). Hand the requests back to UCX, which releases them
                // when they end or with the worker: a request left unreleased made `ucp_worker_destroy` fail an
                // assertion and abort the process (seen over TCP with two stopped peers).
                for req in pending {
                    // SAFETY: a live request, not used afterwards.
                    unsafe { sys::ucp_request_free(req) };
                }
                break;
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: the worker is live; its endpoints were closed by the transport.
        unsafe { sys::ucp_worker_destroy(self.h) }
    }
}

/// Receive completion callback: records the message length in the `ucp_tag_recv_info_t` given as user data.
unsafe extern "C" fn recv_done(
    _req: *mut c_void,
    status: sys::ucs_status_t,
    info: *const sys::ucp_tag_recv_info_t,
    user_data: *mut c_void,
) {
    let ok = status == sys::ucs_status_t::UCS_OK || status == sys::ucs_status_t::UCS_ERR_MESSAGE_TRUNCATED;
    if ok && !info.is_null() && !user_data.is_null() {
        // SAFETY: UCX passes a valid info for completed receives; user_data is the op's boxed info, alive until
        // the request is freed.
        unsafe { *(user_data as *mut sys::ucp_tag_recv_info_t) = *info };
    }
}

/// A UCP endpoint (a connection to one peer worker). Closed with [`Worker::close`].
pub struct Endpoint(sys::ucp_ep_h);
