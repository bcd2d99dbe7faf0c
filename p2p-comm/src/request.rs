//! Handles of operations in flight.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use bytemuck::Pod;

use crate::threads::{lock, ThreadOp};
use crate::{CommError, Communicator};

/// One transport-level operation.
pub(crate) enum Pending {
    Threads(ThreadOp),
    #[cfg(feature = "ucx")]
    Ucx(crate::ucx::UcxOp),
}

impl Pending {
    pub(crate) fn wait(&mut self) -> Result<(), CommError> {
        match self {
            Pending::Threads(op) => op.wait(),
            #[cfg(feature = "ucx")]
            Pending::Ucx(op) => op.wait(),
        }
    }

    pub(crate) fn test(&mut self) -> Result<bool, CommError> {
        match self {
            Pending::Threads(op) => op.test(),
            #[cfg(feature = "ucx")]
            Pending::Ucx(op) => op.test(),
        }
    }

    /// Withdraws the op if no peer matched it yet, else waits for it; used on error paths.
    pub(crate) fn cancel(self) {
        match self {
            Pending::Threads(op) => op.cancel(),
            #[cfg(feature = "ucx")]
            Pending::Ucx(op) => op.cancel(),
        }
    }
}

/// The parts of one request: a message, or both directions of a ring shift.
pub(crate) struct Parts([Option<Pending>; 2]);

impl Parts {
    /// Finishes every part; the first error.
    fn wait(&mut self) -> Result<(), CommError> {
        let mut res = Ok(());
        for slot in self.0.iter_mut() {
            if let Some(mut op) = slot.take() {
                let r = op.wait();
                if res.is_ok() {
                    res = r;
                }
            }
        }
        res
    }

    fn test(&mut self) -> Result<bool, CommError> {
        let mut all = true;
        for slot in self.0.iter_mut() {
            if let Some(op) = slot {
                match op.test() {
                    Ok(true) => *slot = None,
                    Ok(false) => all = false,
                    Err(e) => {
                        *slot = None;
                        return Err(e);
                    }
                }
            }
        }
        Ok(all)
    }

    fn in_flight(&self) -> usize {
        self.0.iter().filter(|o| o.is_some()).count()
    }
}

/// Where a request's parts live: in the request, or shared with the [`Scope`] that started it, which finishes
/// whatever its requests leave (a leaked request included) before its borrows end.
#[allow(clippy::large_enum_variant)] // boxing `Own` would allocate for every request
enum Held {
    Own(Parts),
    Scoped(Shared),
}

/// Parts shared between a request and its scope. Dropping the request's handle finishes what is left, to keep
/// "dropping waits" true for scoped requests too. (The drop lives here, not on `Request`, whose borrow `'a`
/// the borrow checker would then keep alive until the request's end of scope.)
struct Shared(Arc<Mutex<Parts>>);

impl Drop for Shared {
    fn drop(&mut self) {
        let parts = std::mem::replace(&mut *lock(&self.0), Parts([None, None]));
        drop(parts); // waits (or, unwinding, withdraws)
    }
}

/// A non-blocking operation (one message, or both directions of a ring shift) that borrows its buffers for `'a`.
///
/// Call [`wait`](Request::wait) (or poll [`test`](Request::test)) to finish it. Dropping an unfinished request
/// blocks until it finishes or times out, so the borrowed buffers are never read or written after the borrow
/// ends. While a thread unwinds from a panic, dropping withdraws the operation instead.
///
/// Requests come from a [`Scope`] ([`Communicator::scope`]), which also finishes any request that was leaked
/// (`std::mem::forget`) before its buffers' borrow ends, or from the `unsafe` [`Communicator::isend`],
/// [`Communicator::irecv`] and [`Communicator::isendrecv`], whose callers promise not to leak them.
#[must_use = "a request must be waited for; dropping it blocks until it finishes"]
pub struct Request<'a> {
    held: Held,
    _buf: PhantomData<&'a mut [u8]>,
}

impl<'a> Request<'a> {
    pub(crate) fn new(a: Pending, b: Option<Pending>) -> Self {
        Request { held: Held::Own(Parts([Some(a), b])), _buf: PhantomData }
    }

    /// Blocks until every part of the operation completes, the timeout elapses or a peer is found gone.
    /// Returns the first error; the other parts are still finished before returning.
    pub fn wait(mut self) -> Result<(), CommError> {
        match &mut self.held {
            Held::Own(p) => p.wait(),
            Held::Scoped(p) => lock(&p.0).wait(),
        }
    }

    /// Returns `Ok(true)` once every part completed, `Ok(false)` while some is in flight, and the error of a part
    /// that failed (that part is then finished; later calls report on the rest).
    pub fn test(&mut self) -> Result<bool, CommError> {
        match &mut self.held {
            Held::Own(p) => p.test(),
            Held::Scoped(p) => lock(&p.0).test(),
        }
    }
}

impl std::fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = match &self.held {
            Held::Own(p) => p.in_flight(),
            Held::Scoped(p) => lock(&p.0).in_flight(),
        };
        f.debug_struct("Request").field("parts_in_flight", &n).finish()
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
pub struct Scope<'scope, 'env: 'scope> {
    comm: &'env Communicator,
    started: Mutex<Vec<Slot>>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

type Slot = Arc<Mutex<Parts>>;

/// What a communicator keeps for its scopes between calls (see `Communicator::scope_pool`).
#[derive(Default)]
pub(crate) struct ScopePool {
    free: Vec<Slot>,
    started: Vec<Slot>,
}

impl<'scope, 'env> Scope<'scope, 'env> {
    fn hold(&'scope self, mut r: Request<'scope>) -> Request<'scope> {
        // `r` is left with no parts, so its drop does nothing.
        let parts = match std::mem::replace(&mut r.held, Held::Own(Parts([None, None]))) {
            Held::Own(p) => p,
            Held::Scoped(_) => unreachable!("the communicator's requests hold their own parts"),
        };
        let slot = lock(&self.comm.scope_pool).free.pop().unwrap_or_else(|| Arc::new(Mutex::new(Parts([None, None]))));
        *lock(&slot) = parts;
        lock(&self.started).push(slot.clone());
        Request { held: Held::Scoped(Shared(slot)), _buf: PhantomData }
    }

    /// [`Communicator::isend`] within the scope.
    pub fn isend<T: Pod>(&'scope self, dst: usize, tag: u32, buf: &'scope [T]) -> Result<Request<'scope>, CommError> {
        // SAFETY: the scope finishes the request before `'scope` ends (see `Communicator::scope`).
        let r = unsafe { self.comm.isend(dst, tag, buf) }?;
        Ok(self.hold(r))
    }

    /// [`Communicator::irecv`] within the scope.
    pub fn irecv<T: Pod>(
        &'scope self,
        src: usize,
        tag: u32,
        buf: &'scope mut [T],
    ) -> Result<Request<'scope>, CommError> {
        // SAFETY: as in `isend`.
        let r = unsafe { self.comm.irecv(src, tag, buf) }?;
        Ok(self.hold(r))
    }

    /// [`Communicator::isendrecv`] within the scope.
    pub fn isendrecv<T: Pod>(
        &'scope self,
        send: &'scope [T],
        recv: &'scope mut [T],
    ) -> Result<Request<'scope>, CommError> {
        // SAFETY: as in `isend`.
        let r = unsafe { self.comm.isendrecv(send, recv) }?;
        Ok(self.hold(r))
    }

    /// Finishes every operation started in the scope that its request left unfinished, and gives the slots no
    /// request holds any more back to the communicator.
    fn finish(&self) {
        let mut started = std::mem::take(&mut *lock(&self.started));
        for slot in started.drain(..) {
            let left = std::mem::replace(&mut *lock(&slot), Parts([None, None]));
            drop(left); // waits (or, unwinding, withdraws)
            if Arc::strong_count(&slot) == 1 {
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
