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
//! The collectives ([`Communicator::all_gather_bytes`] and the others) stage device bytes through host memory on
//! every transport.
//!
//! Ordering: a device buffer must be idle on its device from when its operation is posted until it finishes:
//! the work that produced a send's bytes has finished (a backend's `synchronize`), and no work enqueued before
//! the post reads or writes a receive's buffer. In between, the transport may read or write it from any thread,
//! through the copier of either side, and every copier call is finished on the device when it returns. So once a
//! receive finishes ([`BytesRequest::wait`]), its bytes are in place for work on any queue.

use crate::communicator::Communicator;
pub use crate::device_copy::DeviceCopy;
use crate::error::CommError;
use crate::op::{DeviceEnd, Op};
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
        }
    }
}

impl<'scope> Scope<'scope, '_> {
    /// Starts a send (or receive) of device bytes `d` on a transport that reaches them (see
    /// [`Communicator::reaches_device`]).
    fn post_device(
        &'scope self,
        is_send: bool,
        peer: usize,
        tag: u32,
        d: &DeviceBytes<'scope>,
    ) -> Result<Request<'scope>, CommError> {
        let comm = self.comm();
        // SAFETY: the copier is borrowed for `'scope`, which the request's op cannot outlive.
        let end = unsafe { DeviceEnd::new(d.ordinal, d.copy) };
        let op =
            Op { later: true, device: Some(end), ..comm.op(is_send, peer, tag as u64, 0, (d.ptr as *mut u8, d.len)) };
        // SAFETY: the device bytes are borrowed for `'scope` (the `DeviceBytes` says so: its maker holds the
        // view), and the scope finishes the op before `'scope` ends.
        unsafe { self.hold_op(op) }
    }
}

impl std::fmt::Debug for BytesRequest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.0 {
            Flavor::Direct(_) => "direct",
            Flavor::StagedSend(_) => "staged send",
            Flavor::StagedRecv(..) => "staged receive",
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
    /// Blocking [`send`](Self::send) of bytes wherever they lie.
    pub fn send_bytes_in(&self, dst: usize, tag: u32, buf: Bytes<'_>) -> Result<(), CommError> {
        match buf {
            Bytes::Host(b) => self.send(dst, tag, b),
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
        staged_collective(send, recv, |s, r| self.all_gather(s, r))
    }

    /// [`all_to_all`](Self::all_to_all) wherever the bytes lie: chunk `j` of `send` goes to rank `j`, and chunk
    /// `i` of `recv` comes from rank `i`.
    pub fn all_to_all_bytes(&self, send: Bytes<'_>, recv: BytesMut<'_>) -> Result<(), CommError> {
        staged_collective(send, recv, |s, r| self.all_to_all(s, r))
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
            BytesMut::Device(d) => {
                let mut host = vec![T::zeroed(); len / size];
                d.read_into(bytemuck::cast_slice_mut(&mut host))?;
                self.all_reduce(&mut host, op)?;
                d.write_from(bytemuck::cast_slice(&host))
            }
        }
    }
}
