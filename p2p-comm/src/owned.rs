//! Non-blocking operations that own their buffers: [`OwnedRequest`], started by [`Communicator::isend`],
//! [`Communicator::irecv`] and [`Communicator::isendrecv`].
//!
//! Why ownership: a request that only *borrows* its buffer is sound only if it cannot be leaked, since
//! `std::mem::forget` ends the borrow without finishing the transfer, which then writes into memory that may be
//! freed or reused. [`Scope`](crate::Scope) solves that for transfers that end within one region; a transfer
//! that spans loop iterations (the dK/dV accumulator of a ring backward) needs the request to hold the buffer
//! itself. An owned request moves the buffer in and hands it back from [`wait`](OwnedRequest::wait), also on
//! error, as crossbeam's `SendError<T>` does. Dropping it finishes the transfer (or withdraws it, as
//! `wait` does on a timeout) before the buffer is freed; leaking it leaks the buffer's allocation too, which
//! therefore outlives anything the transport may still write: a leak costs memory, never soundness.
//!
//! Buffers are [`OwnedBuf`]s: `Vec<T>` and `Box<[T]>` of [`Pod`] elements. The trait is sealed because what
//! makes these sound is that the elements live in a heap allocation whose address does not change when the
//! request (and the buffer in it) moves; an inline buffer (an array) would move with the request while the
//! transport still writes to its old address. A steady loop that passes its buffers through requests and gets
//! them back allocates nothing.

use std::marker::PhantomData;

use bytemuck::Pod;

use crate::communicator::Communicator;
use crate::error::CommError;
use crate::op::{Op, RING_TAG};
use crate::pending::Parts;

/// A buffer's allocation while a request holds it: only raw parts, so that nothing asserts unique access to
/// memory the transport is writing.
#[derive(Debug)]
pub struct RawBuf {
    ptr: *mut u8,
    /// Elements, and the allocation's capacity in elements (`Vec`; the length for `Box<[T]>`).
    len: usize,
    cap: usize,
    /// Length in bytes.
    bytes: usize,
}

mod sealed {
    use super::RawBuf;

    /// How a buffer becomes [`RawBuf`] and back.
    pub trait Sealed: Sized {
        fn into_raw(self) -> RawBuf;
        /// # Safety
        /// `raw` comes from `Self::into_raw`, and is used once.
        unsafe fn from_raw(raw: RawBuf) -> Self;
    }
}

/// A buffer an owned request can own: `Vec<T>` or `Box<[T]>` with `T: Pod + Send` (sealed: what makes these
/// sound is that their elements live in a heap allocation that stays put when the buffer moves, see
/// [`OwnedRequest`]).
pub trait OwnedBuf: sealed::Sealed + Send {
    /// The element type.
    type Elem: Pod;
}

impl<T: Pod + Send> sealed::Sealed for Vec<T> {
    fn into_raw(self) -> RawBuf {
        let mut v = std::mem::ManuallyDrop::new(self);
        let bytes = std::mem::size_of_val(&v[..]);
        RawBuf { ptr: v.as_mut_ptr() as *mut u8, len: v.len(), cap: v.capacity(), bytes }
    }

    unsafe fn from_raw(raw: RawBuf) -> Self {
        // SAFETY: the parts of a `Vec<T>` taken apart by `into_raw`, put together once.
        unsafe { Vec::from_raw_parts(raw.ptr as *mut T, raw.len, raw.cap) }
    }
}
impl<T: Pod + Send> OwnedBuf for Vec<T> {
    type Elem = T;
}

impl<T: Pod + Send> sealed::Sealed for Box<[T]> {
    fn into_raw(self) -> RawBuf {
        let (len, bytes) = (self.len(), std::mem::size_of_val(&self[..]));
        RawBuf { ptr: Box::into_raw(self) as *mut T as *mut u8, len, cap: len, bytes }
    }

    unsafe fn from_raw(raw: RawBuf) -> Self {
        // SAFETY: the pointer and length of a `Box<[T]>` taken apart by `into_raw`, put together once.
        unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(raw.ptr as *mut T, raw.len)) }
    }
}
impl<T: Pod + Send> OwnedBuf for Box<[T]> {
    type Elem = T;
}

/// What an owned request holds and how to give it back: one buffer, or a ring shift's two.
type Rebuild<B> = unsafe fn([Option<RawBuf>; 2]) -> B;

/// # Safety
/// `raw[0]` comes from `B::into_raw`.
unsafe fn rebuild_one<B: OwnedBuf>(mut raw: [Option<RawBuf>; 2]) -> B {
    let r = raw[0].take().expect("an owned request holds its buffer");
    // SAFETY: per our contract.
    unsafe { B::from_raw(r) }
}

/// # Safety
/// `raw` comes from `S::into_raw` and `R::into_raw`.
unsafe fn rebuild_two<S: OwnedBuf, R: OwnedBuf>(mut raw: [Option<RawBuf>; 2]) -> (S, R) {
    let (s, r) = (raw[0].take(), raw[1].take());
    let (s, r) = (s.expect("the send buffer"), r.expect("the receive buffer"));
    // SAFETY: per our contract.
    unsafe { (S::from_raw(s), R::from_raw(r)) }
}

/// A non-blocking operation that owns its buffer `B` (one [`OwnedBuf`], or for [`Communicator::isendrecv`] the
/// pair `(send, recv)`) until [`wait`](Self::wait) hands it back.
///
/// Dropping an unfinished request blocks until the operation finishes or times out (while unwinding from a
/// panic, it withdraws the operation), then frees the buffer. Leaking it (`std::mem::forget`) leaks the buffer,
/// so anything the transport still writes lands in memory nothing else uses.
///
/// ```
/// use longctx_p2p::ThreadWorld;
///
/// ThreadWorld::run(2, |comm| {
///     let (mut cur, mut nxt) = (vec![comm.rank() as f32; 1024], vec![0.0f32; 1024]);
///     for _ in 0..3 {
///         // Buffers move into the request and come back from `wait`: no allocation per step.
///         let req = comm.isendrecv(cur, nxt).map_err(|(e, _)| e)?;
///         // ... compute while the blocks move ...
///         (cur, nxt) = req.wait()?;
///         std::mem::swap(&mut cur, &mut nxt);
///     }
///     assert_eq!(cur[0] as usize, 1 - comm.rank());
///     Ok::<(), longctx_p2p::CommError>(())
/// })?;
/// # Ok::<(), longctx_p2p::CommError>(())
/// ```
#[must_use = "an owned request must be waited for to get its buffer back; dropping it blocks until it finishes"]
pub struct OwnedRequest<B> {
    parts: Parts,
    /// `None` once handed back.
    raw: [Option<RawBuf>; 2],
    rebuild: Rebuild<B>,
    /// The first error a `test` saw, reported by `wait`.
    error: Option<CommError>,
    _buf: PhantomData<B>,
}

// SAFETY: the raw parts are a `B` taken apart, and `B: Send`; the parts in flight are `Send`.
unsafe impl<B: Send> Send for OwnedRequest<B> {}

impl<B> OwnedRequest<B> {
    /// Blocks until every part of the operation completes, the timeout elapses or a peer is found gone, and
    /// hands the buffer back: `Ok(buf)`, or the first error with the buffer (whose contents, for a receive
    /// that failed, are unspecified). The other parts are still finished before returning.
    pub fn wait(mut self) -> Result<B, (CommError, B)> {
        let res = self.parts.wait();
        let res = match self.error.take() {
            Some(e) => Err(e),
            None => res,
        };
        let buf = self.take_buf();
        match res {
            Ok(()) => Ok(buf),
            Err(e) => Err((e, buf)),
        }
    }

    /// Polls: `true` once every part finished (successfully or not), after which [`wait`](Self::wait) returns
    /// at once with the outcome.
    pub fn test(&mut self) -> bool {
        loop {
            match self.parts.test() {
                Ok(done) => return done,
                Err(e) => {
                    self.error.get_or_insert(e);
                }
            }
        }
    }

    /// The buffer, after the parts finished.
    fn take_buf(&mut self) -> B {
        debug_assert_eq!(self.parts.in_flight(), 0);
        let raw = std::mem::take(&mut self.raw);
        // SAFETY: `raw` holds what `B` was taken apart into when the request was made, given back only here
        // (the request keeps `None`s afterwards, so its drop frees nothing).
        unsafe { (self.rebuild)(raw) }
    }
}

impl<B> Drop for OwnedRequest<B> {
    fn drop(&mut self) {
        // Finish (or, unwinding, withdraw) the transfer before the buffer goes.
        drop(std::mem::take(&mut self.parts));
        if self.raw.iter().any(Option::is_some) {
            drop(self.take_buf());
        }
    }
}

impl<B> std::fmt::Debug for OwnedRequest<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedRequest").field("parts_in_flight", &self.parts.in_flight()).finish()
    }
}

/// An owned send ([`Communicator::isend`]): an [`OwnedRequest`] whose buffer can also be read while it is in
/// flight (the transport only reads it too), so a rank can compute on the block it is passing on.
#[must_use = "an owned request must be waited for to get its buffer back; dropping it blocks until it finishes"]
#[derive(Debug)]
pub struct SendRequest<B: OwnedBuf>(OwnedRequest<B>);

impl<B: OwnedBuf> SendRequest<B> {
    /// The buffer being sent.
    pub fn buf(&self) -> &[B::Elem] {
        let raw = self.0.raw[0].as_ref().expect("a send request holds its buffer until `wait`");
        // SAFETY: the allocation of a `B` of `raw.len` elements, alive while the request holds it; the transport
        // only reads it, and nothing writes it until `wait` hands it back (which needs `self`).
        unsafe { std::slice::from_raw_parts(raw.ptr as *const B::Elem, raw.len) }
    }

    /// As [`OwnedRequest::wait`].
    pub fn wait(self) -> Result<B, (CommError, B)> {
        self.0.wait()
    }

    /// As [`OwnedRequest::test`].
    pub fn test(&mut self) -> bool {
        self.0.test()
    }
}

impl Communicator {
    fn post_owned<B: OwnedBuf>(
        &self,
        is_send: bool,
        peer: usize,
        tag: u32,
        buf: B,
    ) -> Result<OwnedRequest<B>, (CommError, B)> {
        let raw = buf.into_raw();
        let op = Op { later: true, ..self.op(is_send, peer, tag as u64, 0, (raw.ptr, raw.bytes)) };
        // SAFETY: the allocation stays alive and untouched (the request holds only its raw parts) until the
        // request has finished the op: in `wait`, or in its drop before the buffer is freed; a leaked request
        // leaks the allocation.
        match unsafe { self.post(op) } {
            Ok(p) => Ok(OwnedRequest {
                parts: Parts::one(p),
                raw: [Some(raw), None],
                rebuild: rebuild_one::<B>,
                error: None,
                _buf: PhantomData,
            }),
            // SAFETY: not posted, so nothing else refers to it; the raw parts of `buf`, once.
            Err(e) => Err((e, unsafe { B::from_raw(raw) })),
        }
    }

    /// Starts sending `buf` to `dst` with `tag`; the request owns `buf` (readable meanwhile through
    /// [`SendRequest::buf`]) and [`wait`](SendRequest::wait) gives it back. A failure to start (an invalid rank,
    /// a peer known gone) hands `buf` back at once.
    ///
    /// For a buffer borrowed only while the transfer runs, use [`Scope::isend`](crate::Scope::isend) in a
    /// [`scope`](Self::scope).
    pub fn isend<B: OwnedBuf>(&self, dst: usize, tag: u32, buf: B) -> Result<SendRequest<B>, (CommError, B)> {
        self.post_owned(true, dst, tag, buf).map(SendRequest)
    }

    /// Starts receiving the message from `src` with `tag` into `buf` (whose length in bytes must equal the
    /// message's); the request owns `buf` and [`wait`](OwnedRequest::wait) gives it back, filled.
    pub fn irecv<B: OwnedBuf>(&self, src: usize, tag: u32, buf: B) -> Result<OwnedRequest<B>, (CommError, B)> {
        self.post_owned(false, src, tag, buf)
    }

    /// Non-blocking ring shift ([`sendrecv`](Self::sendrecv)) that owns both buffers; [`wait`](OwnedRequest::wait)
    /// completes both directions and gives back `(send, recv)`. Overlap compute with it: post the shift of the
    /// next block, compute on the block in hand, wait, swap.
    #[allow(clippy::type_complexity)] // the pair comes back on success and on error alike
    pub fn isendrecv<S: OwnedBuf, R: OwnedBuf>(
        &self,
        send: S,
        recv: R,
    ) -> Result<OwnedRequest<(S, R)>, (CommError, (S, R))> {
        let (next, prev) = self.ring_peers();
        let (s, r) = (send.into_raw(), recv.into_raw());
        let ro = Op { later: true, exchange: true, ..self.op(false, prev, RING_TAG, 0, (r.ptr, r.bytes)) };
        let so = Op { later: true, exchange: true, ..self.op(true, next, RING_TAG, 0, (s.ptr, s.bytes)) };
        // SAFETY: as in `post_owned`, for both allocations (distinct: each is owned by its own buffer).
        match unsafe { self.post_exchange(ro, so) } {
            Ok(parts) => Ok(OwnedRequest {
                parts,
                raw: [Some(s), Some(r)],
                rebuild: rebuild_two::<S, R>,
                error: None,
                _buf: PhantomData,
            }),
            // SAFETY: not posted; the raw parts of `send` and `recv`, once.
            Err(e) => Err((e, unsafe { (S::from_raw(s), R::from_raw(r)) })),
        }
    }
}

/// The error of a failed owned request, dropping the buffer it handed back (so `?` works in functions that
/// return `CommError`).
impl<B> From<(CommError, B)> for CommError {
    fn from((e, _): (CommError, B)) -> CommError {
        e
    }
}
