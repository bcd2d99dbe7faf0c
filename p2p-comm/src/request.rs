//! Non-blocking operations that borrow their buffers: [`Request`]s started in a [`Scope`].

use std::marker::PhantomData;
use std::sync::Mutex;

use bytemuck::Pod;

use crate::communicator::Communicator;
use crate::error::CommError;
use crate::op::{Op, RING_TAG};
use crate::pending::{Parts, ScopeSlot};
use crate::sync::lock;

/// A request's parts, shared with the [`Scope`] that started it, which finishes whatever its requests leave (a
/// leaked request included) before its borrows end. Dropping the handle finishes what is left, to keep "dropping
/// waits" true. (The drop lives here, not on `Request`, whose borrow `'a` the borrow checker would then keep
/// alive until the request's end of scope.)
struct Shared(ScopeSlot);

impl Drop for Shared {
    fn drop(&mut self) {
        let parts = std::mem::take(&mut *lock(&self.0));
        drop(parts); // waits (or, unwinding, withdraws)
    }
}

/// A non-blocking operation (one message, or both directions of a ring shift) that borrows its buffers for `'a`,
/// started in a [`Scope`] ([`Communicator::scope`]).
///
/// Call [`wait`](Request::wait) (or poll [`test`](Request::test)) to finish it. Dropping an unfinished request
/// blocks until it finishes or times out, so the borrowed buffers are never read or written after the borrow
/// ends. While a thread unwinds from a panic, dropping withdraws the operation instead. The scope also finishes a
/// request that was leaked (`std::mem::forget`) before its buffers' borrow ends.
///
/// For a transfer that outlives any one borrow (a buffer rotated through a loop), see the owned requests:
/// [`Communicator::isend`] and friends.
#[must_use = "a request must be waited for; dropping it blocks until it finishes"]
pub struct Request<'a> {
    parts: Shared,
    _buf: PhantomData<&'a mut [u8]>,
}

impl Request<'_> {
    /// Blocks until every part of the operation completes, the timeout elapses or a peer is found gone.
    /// Returns the first error; the other parts are still finished before returning.
    pub fn wait(self) -> Result<(), CommError> {
        lock(&self.parts.0).wait()
    }

    /// Returns `Ok(true)` once every part completed, `Ok(false)` while some is in flight, and the error of a part
    /// that failed (that part is then finished; later calls report on the rest).
    pub fn test(&mut self) -> Result<bool, CommError> {
        lock(&self.parts.0).test()
    }
}

impl std::fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request").field("parts_in_flight", &lock(&self.parts.0).in_flight()).finish()
    }
}

/// A region in which non-blocking operations borrow buffers safely: when [`Communicator::scope`] returns, every
/// operation started through the scope has finished, whether its [`Request`] was waited for, dropped or leaked.
/// The buffers must outlive the scope, so nothing can free or reuse them while an operation may still touch
/// them (the guarantee `std::mem::forget` would otherwise break, as for `std::thread::scope`).
///
/// ```
/// use longctx_p2p::ThreadWorld;
///
/// ThreadWorld::run(2, |comm| {
///     let mine = vec![comm.rank() as f32; 1024];
///     let mut theirs = vec![0.0f32; 1024];
///     comm.scope(|s| {
///         let req = s.isendrecv(&mine, &mut theirs)?;
///         // ... compute while the blocks move ...
///         req.wait()
///     })?;
///     assert_eq!(theirs[0] as usize, 1 - comm.rank());
///     Ok::<(), longctx_p2p::CommError>(())
/// })?;
/// # Ok::<(), longctx_p2p::CommError>(())
/// ```
///
/// While a request is in flight its buffers stay borrowed: reading a receive buffer before the request
/// finished does not compile.
///
/// ```compile_fail,E0502
/// use longctx_p2p::ThreadWorld;
///
/// ThreadWorld::run(2, |comm| {
///     let mine = vec![comm.rank() as f32; 1024];
///     let mut theirs = vec![0.0f32; 1024];
///     comm.scope(|s| {
///         let req = s.isendrecv(&mine, &mut theirs)?;
///         let early = theirs[0]; // error: `theirs` is mutably borrowed by the request in flight
///         req.wait()?;
///         Ok::<f32, longctx_p2p::CommError>(early)
///     })
/// });
/// ```
pub struct Scope<'scope, 'env: 'scope> {
    comm: &'env Communicator,
    started: Mutex<Vec<ScopeSlot>>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl<'scope> Scope<'scope, '_> {
    /// The communicator the scope's operations run on.
    pub(crate) fn comm(&self) -> &Communicator {
        self.comm
    }

    /// Keeps `parts` in a slot the scope finishes on its way out; the request shares it.
    fn hold(&'scope self, parts: Parts) -> Request<'scope> {
        let slot = lock(&self.comm.scope_pool).free.pop().unwrap_or_default();
        *lock(&slot) = parts;
        lock(&self.started).push(slot.clone());
        Request { parts: Shared(slot), _buf: PhantomData }
    }

    /// Posts `op` as a request of this scope.
    ///
    /// # Safety
    /// `op`'s buffer (and device copier) must stay valid, and for a receive unaliased, for `'scope`.
    pub(crate) unsafe fn hold_op(&'scope self, op: Op) -> Result<Request<'scope>, CommError> {
        // SAFETY: per our contract; the scope finishes the op before `'scope` ends.
        let p = unsafe { self.comm.post(op) }?;
        Ok(self.hold(Parts::one(p)))
    }

    /// Starts sending `buf` to `dst` with `tag`; the request borrows `buf` until it finishes.
    pub fn isend<T: Pod>(&'scope self, dst: usize, tag: u32, buf: &'scope [T]) -> Result<Request<'scope>, CommError> {
        let b: &[u8] = bytemuck::cast_slice(buf);
        let op = Op { later: true, ..self.comm.op(true, dst, tag as u64, 0, (b.as_ptr() as *mut u8, b.len())) };
        // SAFETY: the scope finishes the op before `'scope`, and so the borrow of `buf`, ends (see `scope`).
        let p = unsafe { self.comm.post(op) }?;
        Ok(self.hold(Parts::one(p)))
    }

    /// Starts receiving the message from `src` with `tag` into `buf` (whose length must equal the message's);
    /// the request borrows `buf` until it finishes.
    pub fn irecv<T: Pod>(
        &'scope self,
        src: usize,
        tag: u32,
        buf: &'scope mut [T],
    ) -> Result<Request<'scope>, CommError> {
        let b: &mut [u8] = bytemuck::cast_slice_mut(buf);
        let op = Op { later: true, ..self.comm.op(false, src, tag as u64, 0, (b.as_mut_ptr(), b.len())) };
        // SAFETY: as in `isend`; `buf` is borrowed mutably, so nothing else reads or writes it meanwhile.
        let p = unsafe { self.comm.post(op) }?;
        Ok(self.hold(Parts::one(p)))
    }

    /// Non-blocking ring shift ([`Communicator::sendrecv`]); the request's [`wait`](Request::wait) completes
    /// both directions. Overlap compute with it: post the shift of the next block, compute on the block in hand,
    /// wait.
    pub fn isendrecv<T: Pod>(
        &'scope self,
        send: &'scope [T],
        recv: &'scope mut [T],
    ) -> Result<Request<'scope>, CommError> {
        let (next, prev) = self.comm.ring_peers();
        let to = (next, bytemuck::cast_slice(send));
        let (r, s) = self.comm.exchange_ops(RING_TAG, 0, to, (prev, bytemuck::cast_slice_mut(recv)), true);
        // SAFETY: as in `isend` and `irecv`.
        let parts = unsafe { self.comm.post_exchange(r, s) }?;
        Ok(self.hold(parts))
    }

    /// Finishes every operation started in the scope that its request left unfinished, and gives the slots no
    /// request holds any more back to the communicator.
    fn finish(&self) {
        let mut started = std::mem::take(&mut *lock(&self.started));
        for slot in started.drain(..) {
            let left = std::mem::take(&mut *lock(&slot));
            drop(left); // waits (or, unwinding, withdraws)
            if std::sync::Arc::strong_count(&slot) == 1 {
                lock(&self.comm.scope_pool).free.push(slot); // else a leaked request still points at it
            }
        }
        let mut pool = lock(&self.comm.scope_pool);
        if pool.started.capacity() < started.capacity() {
            pool.started = started;
        }
    }
}

impl Communicator {
    /// Runs `f` with a [`Scope`] whose non-blocking operations may borrow buffers from outside it; returns once
    /// every operation started in it has finished (a leaked request's too). If `f` panics, the operations are
    /// withdrawn (or finished) before the panic goes on.
    pub fn scope<'env, R>(&'env self, f: impl for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> R) -> R {
        let started = std::mem::take(&mut lock(&self.scope_pool).started);
        let scope = Scope { comm: self, started: Mutex::new(started), _scope: PhantomData, _env: PhantomData };
        struct Finish<'a, 'scope, 'env>(&'a Scope<'scope, 'env>);
        impl Drop for Finish<'_, '_, '_> {
            fn drop(&mut self) {
                self.0.finish();
            }
        }
        let finish = Finish(&scope);
        let out = f(&scope);
        drop(finish);
        out
    }
}
