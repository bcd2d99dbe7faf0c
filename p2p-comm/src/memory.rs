//! Buffers in any memory: [`Bytes`] and [`BytesMut`] say where a message's bytes lie (host memory, or device
//! memory with the [`DeviceCopy`] that reaches it), and [`BytesRequest`] is a non-blocking transfer of them.
//!
//! The communicator itself owns no device code: whoever owns the device memory (ring attention, over a kernels
//! backend) hands a transfer its bytes with a copier. How device bytes move depends on the transport
//! ([`Communicator::reaches_device`]):
//! - threads: the ranks share the process and so the device's address space; a message is copied once, at the
//!   match, with the copier of the side in device memory (device to device: [`DeviceCopy::copy_within`]; host
//!   to device: an upload; device to host: a download). Only between two different devices does it pass
//!   through host memory.
//! - UCX built with CUDA support: the transport is told the buffer's memory type and moves the bytes itself
//!   (`cuda_ipc`, `cuda_copy`).
//! - otherwise (UCX without it): device bytes are staged through host memory with the copier (device → host on
//!   the sending side, host → device on the receiving side), two more copies per message.
//!
//! The collectives follow: [`Communicator::all_gather_bytes`] and [`Communicator::all_to_all_bytes`] move each
//! part once, point to point, where the transport reaches device memory, and stage through host memory where it
//! does not (every rank of the collective must pass the same kinds of memory, as ring attention's ranks do: the
//! two ways do not meet). [`Communicator::all_reduce_bytes`] reduces on the host, so it stages on every transport.
//!
//! Ordering: a device buffer must be idle on its device from when its operation is posted until it finishes:
//! the work that produced a send's bytes has finished (a backend's `synchronize`), and no work enqueued before
//! the post reads or writes a receive's buffer. In between, the transport may read or write it from any thread,
//! through the copier of either side, and every copier call is finished on the device when it returns. So once a
//! receive finishes ([`BytesRequest::wait`]), its bytes are in place for work on any queue.

use crate::communicator::Communicator;
pub use crate::device_copy::DeviceCopy;
use crate::error::CommError;
use crate::op::{meta, DeviceEnd, Op, ALL_GATHER, ALL_TO_ALL, INTERNAL};
use crate::owned::{OwnedRequest, SendRequest};
use crate::reduce::{Reduce, ReduceOp};
use crate::request::{Request, Scope};

/// Where a buffer's bytes lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory the CPU reads and writes.
    Host,
    /// Memory of the accelerator with this ordinal.
    Device {
        /// The device's ordinal.
        ordinal: u32,
    },
}

/// A run of device bytes and the copier that reaches them.
#[derive(Clone, Copy)]
pub struct DeviceBytes<'a> {
    /// Device address of the first byte.
    pub ptr: u64,
    /// Length in bytes.
    pub len: usize,
    /// The device's ordinal.
    pub ordinal: u32,
    /// What moves the bytes to and from host memory.
    pub copy: &'a dyn DeviceCopy,
}

impl std::fmt::Debug for DeviceBytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBytes")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl DeviceBytes<'_> {
    fn read_into(&self, dst: &mut [u8]) -> Result<(), CommError> {
        self.copy.download(self.ptr, dst).map_err(|reason| CommError::DeviceCopy { ordinal: self.ordinal, reason })
    }
    fn write_from(&self, src: &[u8]) -> Result<(), CommError> {
        self.copy.upload(self.ptr, src).map_err(|reason| CommError::DeviceCopy { ordinal: self.ordinal, reason })
    }
}

/// The bytes a send reads.
#[derive(Debug, Clone, Copy)]
pub enum Bytes<'a> {
    /// Host memory.
    Host(&'a [u8]),
    /// Device memory.
    Device(DeviceBytes<'a>),
}

/// The bytes a receive writes.
#[derive(Debug)]
pub enum BytesMut<'a> {
    /// Host memory.
    Host(&'a mut [u8]),
    /// Device memory.
    Device(DeviceBytes<'a>),
}

impl Bytes<'_> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Bytes::Host(b) => b.len(),
            Bytes::Device(d) => d.len,
        }
    }
    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where the bytes lie.
    pub fn memory(&self) -> MemoryKind {
        match self {
            Bytes::Host(_) => MemoryKind::Host,
            Bytes::Device(d) => MemoryKind::Device { ordinal: d.ordinal },
        }
    }
}

impl BytesMut<'_> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            BytesMut::Host(b) => b.len(),
            BytesMut::Device(d) => d.len,
        }
    }
    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where the bytes lie.
    pub fn memory(&self) -> MemoryKind {
        match self {
            BytesMut::Host(_) => MemoryKind::Host,
            BytesMut::Device(d) => MemoryKind::Device { ordinal: d.ordinal },
        }
    }
}

/// Runs a host collective from `send` into `recv`, staging whichever of them is device memory through host memory.
fn staged_collective(
    send: Bytes<'_>,
    recv: BytesMut<'_>,
    collective: impl FnOnce(&[u8], &mut [u8]) -> Result<(), CommError>,
) -> Result<(), CommError> {
    let staged_send;
    let send: &[u8] = match send {
        Bytes::Host(b) => b,
        Bytes::Device(d) => {
            staged_send = staged(&d)?;
            &staged_send
        }
    };
    match recv {
        BytesMut::Host(b) => collective(send, b),
        BytesMut::Device(d) => {
            let mut host = vec![0u8; d.len];
            collective(send, &mut host)?;
            d.write_from(&host)
        }
    }
}

/// Device bytes read into a new host buffer (the staging of a send).
fn staged(d: &DeviceBytes<'_>) -> Result<Vec<u8>, CommError> {
    let mut v = vec![0u8; d.len];
    d.read_into(&mut v)?;
    Ok(v)
}

/// A non-blocking transfer of [`Bytes`] or into [`BytesMut`], started in a [`Scope`] with
/// [`Scope::isend_bytes`] or [`Scope::irecv_bytes`]. [`wait`](BytesRequest::wait) finishes it (for a receive
/// into device memory, also the copy to the device). Dropping it unfinished finishes the transfer as a
/// [`Request`] does, but a receive's device copy then does not happen.
#[must_use = "a request must be waited for; dropping it blocks until it finishes"]
pub struct BytesRequest<'scope>(Flavor<'scope>);

enum Flavor<'scope> {
    /// Host bytes, moved in place.
    Direct(Request<'scope>),
    /// Device bytes read to host memory when posted.
    StagedSend(SendRequest<Vec<u8>>),
    /// Into host memory, then to the device at `wait`.
    StagedRecv(OwnedRequest<Vec<u8>>, DeviceBytes<'scope>),
    /// Device bytes through NCCL (queued until the first wait of its group).
    #[cfg(feature = "nccl")]
    Nccl(crate::nccl::comm::NcclRequest, std::marker::PhantomData<&'scope ()>),
}

impl BytesRequest<'_> {
    /// Blocks until the transfer completes (and, for a receive into device memory, its bytes are there).
    pub fn wait(self) -> Result<(), CommError> {
        match self.0 {
            Flavor::Direct(r) => r.wait(),
            Flavor::StagedSend(r) => r.wait().map(drop).map_err(|(e, _)| e),
            Flavor::StagedRecv(r, dst) => {
                let host = r.wait().map_err(|(e, _)| e)?;
                dst.write_from(&host)
            }
            #[cfg(feature = "nccl")]
            Flavor::Nccl(r, _) => r.wait(),
        }
    }
}

impl<'scope> Scope<'scope, '_> {
    /// Starts a send (or receive) of device bytes `d` with a user tag on a transport that reaches them (see
    /// [`Communicator::reaches_device`]).
    fn post_device(
        &'scope self,
        is_send: bool,
        peer: usize,
        tag: u32,
        d: &DeviceBytes<'scope>,
    ) -> Result<Request<'scope>, CommError> {
        self.post_in(is_send, peer, (tag as u64, 0), Raw::device(d))
    }

    /// Starts one message with `key` and descriptor `meta` (`(key, meta)`), from or into bytes wherever they lie
    /// (device bytes only on a transport that reaches them).
    fn post_in(
        &'scope self,
        is_send: bool,
        peer: usize,
        (key, meta): (u64, u64),
        raw: Raw<'scope>,
    ) -> Result<Request<'scope>, CommError> {
        // SAFETY: the copier is borrowed for `'scope`, which the request's op cannot outlive.
        let end = raw.device.map(|(ordinal, copy)| unsafe { DeviceEnd::new(ordinal, copy) });
        let op = Op { later: true, device: end, ..self.comm().op(is_send, peer, key, meta, (raw.ptr, raw.len)) };
        // SAFETY: the bytes are borrowed for `'scope` (host bytes by `Raw`'s maker, device bytes by the view their
        // `DeviceBytes` came from), mutably for a receive, and the scope finishes the op before `'scope` ends.
        unsafe { self.hold_op(op) }
    }
}

/// Bytes wherever they lie, as a transport's op takes them: an address (a host pointer, or a device address),
/// a length, and for device memory its ordinal and copier. Made from a borrow that outlives `'a`.
#[derive(Clone, Copy)]
struct Raw<'a> {
    ptr: *mut u8,
    len: usize,
    device: Option<(u32, &'a dyn DeviceCopy)>,
}

impl<'a> Raw<'a> {
    /// Where the bytes lie, for a copy of them.
    fn place(&self) -> crate::device_copy::Place<'a> {
        crate::device_copy::Place { addr: self.ptr as u64, device: self.device }
    }

    fn device(d: &DeviceBytes<'a>) -> Raw<'a> {
        Raw { ptr: d.ptr as *mut u8, len: d.len, device: Some((d.ordinal, d.copy)) }
    }

    /// The bytes of a send, cut into parts of `k` bytes (`n` of them).
    fn send_parts(b: Bytes<'a>, k: usize, n: usize) -> Vec<Raw<'a>> {
        match b {
            // A send is only read: the pointer is made mutable for the op's sake only.
            Bytes::Host(h) => {
                (0..n).map(|i| Raw { ptr: h[i * k..].as_ptr() as *mut u8, len: k, device: None }).collect()
            }
            Bytes::Device(d) => {
                (0..n).map(|i| Raw::device(&DeviceBytes { ptr: d.ptr + (i * k) as u64, len: k, ..d })).collect()
            }
        }
    }

    /// The bytes of a receive, cut into `n` disjoint parts of `k` bytes.
    fn recv_parts(b: BytesMut<'a>, k: usize, n: usize) -> Vec<Raw<'a>> {
        match b {
            BytesMut::Host(h) => {
                let base = h.as_mut_ptr();
                // SAFETY: `i * k ≤ n * k = h.len()`; the parts are disjoint, and the receives that write them hold
                // the whole buffer's borrow (`'a`).
                (0..n).map(|i| Raw { ptr: unsafe { base.add(i * k) }, len: k, device: None }).collect()
            }
            BytesMut::Device(d) => {
                (0..n).map(|i| Raw::device(&DeviceBytes { ptr: d.ptr + (i * k) as u64, len: k, ..d })).collect()
            }
        }
    }
}

impl Communicator {
    /// Whether a collective over `send` and `recv` moves them where they lie (a side is in device memory and the
    /// transport reaches it) rather than staging them through host memory.
    fn direct(&self, send: &Bytes<'_>, recv: &BytesMut<'_>) -> bool {
        let device = match (send, recv) {
            (Bytes::Device(d), _) | (_, BytesMut::Device(d)) => Some(d.ordinal),
            _ => None,
        };
        device.is_some_and(|o| self.reaches_device(o))
    }

    /// A collective on a transport that reaches device memory: this rank sends `sends[j]` to rank `j` and
    /// receives `recvs[j]` from it, every pair at once, each part one copy wherever it lies (its own part copied in
    /// place, not sent). Every part goes on the point-to-point path with the collective's key and descriptor `m`, so
    /// a rank calling another collective, or another size, fails with the collectives' mismatch error.
    fn direct_collective(&self, code: u64, m: u64, sends: Vec<Raw<'_>>, recvs: Vec<Raw<'_>>) -> Result<(), CommError> {
        let (r, n) = (self.rank(), self.world_size());
        let key = (INTERNAL | code, m);
        let (mine, into) = (sends[r], recvs[r]);
        // SAFETY: `mine` is `len` readable bytes of the send, `into` as many writable bytes of the receive, which
        // the caller's borrows keep; a send and a receive never overlap.
        unsafe { crate::device_copy::copy(mine.place(), into.place(), mine.len) }
            .map_err(|(ordinal, reason)| CommError::DeviceCopy { ordinal, reason })?;
        self.scope(|s| {
            let mut reqs = Vec::with_capacity(2 * n);
            // Receives first, then the sends from the nearest peer on, so a send finds its receive posted.
            for (j, raw) in recvs.into_iter().enumerate().filter(|&(j, _)| j != r) {
                reqs.push(s.post_in(false, j, key, raw)?);
            }
            for step in 1..n {
                let j = (r + step) % n;
                reqs.push(s.post_in(true, j, key, sends[j])?);
            }
            // Every request is finished, the first error returned.
            reqs.into_iter().map(Request::wait).fold(Ok(()), Result::and)
        })
    }
}

impl std::fmt::Debug for BytesRequest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.0 {
            Flavor::Direct(_) => "direct",
            Flavor::StagedSend(_) => "staged send",
            Flavor::StagedRecv(..) => "staged receive",
            #[cfg(feature = "nccl")]
            Flavor::Nccl(..) => "NCCL",
        };
        f.debug_tuple("BytesRequest").field(&kind).finish()
    }
}

impl<'scope> Scope<'scope, '_> {
    /// Starts sending `buf` to `dst` with `tag`, wherever its bytes lie (on a transport that stages device bytes,
    /// they are read to host memory before this returns: see the [module docs](crate::memory)).
    pub fn isend_bytes(
        &'scope self,
        dst: usize,
        tag: u32,
        buf: Bytes<'scope>,
    ) -> Result<BytesRequest<'scope>, CommError> {
        Ok(BytesRequest(match buf {
            Bytes::Host(b) => Flavor::Direct(self.isend(dst, tag, b)?),
            #[cfg(feature = "nccl")]
            Bytes::Device(d) if self.comm().nccl_for(d.ordinal).is_some() => {
                Flavor::Nccl(self.comm().nccl_post(true, dst, &d)?, std::marker::PhantomData)
            }
            Bytes::Device(d) if self.comm().reaches_device(d.ordinal) => {
                Flavor::Direct(self.post_device(true, dst, tag, &d)?)
            }
            Bytes::Device(d) => {
                let host = staged(&d)?;
                Flavor::StagedSend(self.comm().isend(dst, tag, host).map_err(|(e, _)| e)?)
            }
        }))
    }

    /// Starts receiving the message from `src` with `tag` into `buf` (whose length must equal the message's),
    /// wherever its bytes lie (device bytes are written during [`BytesRequest::wait`]).
    pub fn irecv_bytes(
        &'scope self,
        src: usize,
        tag: u32,
        buf: BytesMut<'scope>,
    ) -> Result<BytesRequest<'scope>, CommError> {
        Ok(BytesRequest(match buf {
            BytesMut::Host(b) => Flavor::Direct(self.irecv(src, tag, b)?),
            #[cfg(feature = "nccl")]
            BytesMut::Device(d) if self.comm().nccl_for(d.ordinal).is_some() => {
                Flavor::Nccl(self.comm().nccl_post(false, src, &d)?, std::marker::PhantomData)
            }
            BytesMut::Device(d) if self.comm().reaches_device(d.ordinal) => {
                Flavor::Direct(self.post_device(false, src, tag, &d)?)
            }
            BytesMut::Device(d) => {
                let host = vec![0u8; d.len];
                Flavor::StagedRecv(self.comm().irecv(src, tag, host).map_err(|(e, _)| e)?, d)
            }
        }))
    }
}

impl Communicator {
    /// Queues a transfer of device bytes on NCCL (attached over their device), after checking the peer.
    #[cfg(feature = "nccl")]
    fn nccl_post(
        &self,
        is_send: bool,
        peer: usize,
        d: &DeviceBytes<'_>,
    ) -> Result<crate::nccl::comm::NcclRequest, CommError> {
        self.check_peer(peer)?;
        let nccl = self.nccl_for(d.ordinal).ok_or_else(|| CommError::Nccl("detached".into()))?;
        nccl.post(is_send, peer, d.ptr, d.len)
    }

    /// Blocking [`send`](Self::send) of bytes wherever they lie.
    pub fn send_bytes_in(&self, dst: usize, tag: u32, buf: Bytes<'_>) -> Result<(), CommError> {
        match buf {
            Bytes::Host(b) => self.send(dst, tag, b),
            #[cfg(feature = "nccl")]
            Bytes::Device(d) if self.nccl_for(d.ordinal).is_some() => self.nccl_post(true, dst, &d)?.wait(),
            Bytes::Device(d) if self.reaches_device(d.ordinal) => {
                self.scope(|s| s.post_device(true, dst, tag, &d)?.wait())
            }
            Bytes::Device(d) => self.send(dst, tag, &staged(&d)?),
        }
    }

    /// Blocking [`recv`](Self::recv) into bytes wherever they lie.
    pub fn recv_bytes_in(&self, src: usize, tag: u32, buf: BytesMut<'_>) -> Result<(), CommError> {
        match buf {
            BytesMut::Host(b) => self.recv(src, tag, b),
            #[cfg(feature = "nccl")]
            BytesMut::Device(d) if self.nccl_for(d.ordinal).is_some() => self.nccl_post(false, src, &d)?.wait(),
            BytesMut::Device(d) if self.reaches_device(d.ordinal) => {
                self.scope(|s| s.post_device(false, src, tag, &d)?.wait())
            }
            BytesMut::Device(d) => {
                let mut host = vec![0u8; d.len];
                self.recv(src, tag, &mut host)?;
                d.write_from(&host)
            }
        }
    }

    /// [`all_gather`](Self::all_gather) wherever the bytes lie: `recv` (world size × `send`'s length) receives
    /// every rank's `send`, in rank order.
    pub fn all_gather_bytes(&self, send: Bytes<'_>, recv: BytesMut<'_>) -> Result<(), CommError> {
        let n = self.world_size();
        let k = send.len();
        if recv.len() != n * k {
            return Err(CommError::InvalidArgument(format!(
                "all_gather_bytes: recv has {} bytes for {n} ranks' {k}",
                recv.len()
            )));
        }
        #[cfg(feature = "nccl")]
        if let (Bytes::Device(s), BytesMut::Device(r)) = (&send, &recv) {
            if let Some(nccl) = self.nccl_for(s.ordinal).filter(|_| s.ordinal == r.ordinal) {
                return nccl.all_gather(s.ptr, r.ptr, k);
            }
        }
        if !self.direct(&send, &recv) {
            return staged_collective(send, recv, |s, r| self.all_gather(s, r));
        }
        let sends = vec![Raw::send_parts(send, k, 1)[0]; n];
        self.direct_collective(ALL_GATHER, meta(ALL_GATHER, k, 0), sends, Raw::recv_parts(recv, k, n))
    }

    /// [`all_to_all`](Self::all_to_all) wherever the bytes lie: chunk `j` of `send` goes to rank `j`, and chunk
    /// `i` of `recv` comes from rank `i`.
    pub fn all_to_all_bytes(&self, send: Bytes<'_>, recv: BytesMut<'_>) -> Result<(), CommError> {
        let n = self.world_size();
        if send.len() != recv.len() || !send.len().is_multiple_of(n) {
            return Err(CommError::InvalidArgument(format!(
                "all_to_all_bytes: send ({}) and recv ({}) must have the same length, a multiple of world_size {n}",
                send.len(),
                recv.len()
            )));
        }
        #[cfg(feature = "nccl")]
        if let (Bytes::Device(s), BytesMut::Device(r)) = (&send, &recv) {
            if let Some(nccl) = self.nccl_for(s.ordinal).filter(|_| s.ordinal == r.ordinal) {
                return nccl.all_to_all(s.ptr, r.ptr, s.len / n, n);
            }
        }
        if !self.direct(&send, &recv) {
            return staged_collective(send, recv, |s, r| self.all_to_all(s, r));
        }
        let (k, m) = (send.len() / n, meta(ALL_TO_ALL, send.len(), 0));
        self.direct_collective(ALL_TO_ALL, m, Raw::send_parts(send, k, n), Raw::recv_parts(recv, k, n))
    }

    /// [`all_reduce`](Self::all_reduce) of `T` elements wherever their bytes lie (a host buffer must be aligned
    /// for `T`). Device bytes are staged: read into host memory, reduced there, written back (the two copies of
    /// the module docs), so every rank ends with bit-identical values as with host memory.
    pub fn all_reduce_bytes<T: Reduce>(&self, buf: BytesMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        let size = std::mem::size_of::<T>();
        let len = buf.len();
        if !len.is_multiple_of(size) {
            return Err(CommError::InvalidArgument(format!(
                "all_reduce_bytes: {len} bytes are not whole elements of {size} bytes"
            )));
        }
        match buf {
            BytesMut::Host(b) => {
                let elems = bytemuck::try_cast_slice_mut::<u8, T>(b).map_err(|e| {
                    CommError::InvalidArgument(format!(
                        "all_reduce_bytes: a host buffer not aligned for its elements: {e}"
                    ))
                })?;
                self.all_reduce(elems, op)
            }
            #[cfg(feature = "nccl")]
            BytesMut::Device(d) if self.nccl_for(d.ordinal).is_some() => {
                let dtype = crate::nccl::dtype_of::<T>().ok_or_else(|| {
                    CommError::InvalidArgument("all_reduce_bytes: NCCL has no type for these elements".into())
                })?;
                let nccl = self.nccl_for(d.ordinal).ok_or_else(|| CommError::Nccl("detached".into()))?;
                nccl.all_reduce(d.ptr, len / size, dtype, crate::nccl::redop_of(op))
            }
            BytesMut::Device(d) => {
                let mut host = vec![T::zeroed(); len / size];
                d.read_into(bytemuck::cast_slice_mut(&mut host))?;
                self.all_reduce(&mut host, op)?;
                d.write_from(bytemuck::cast_slice(&host))
            }
        }
    }
}
