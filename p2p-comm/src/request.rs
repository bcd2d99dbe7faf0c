//! Handles of operations in flight.

use std::marker::PhantomData;

use crate::threads::ThreadOp;
use crate::CommError;

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

/// A non-blocking operation (one message, or both directions of a ring shift) that borrows its buffers for `'a`.
///
/// Call [`wait`](Request::wait) (or poll [`test`](Request::test)) to finish it. Dropping an unfinished request
/// blocks until it finishes or times out, so the borrowed buffers are never read or written after the borrow
/// ends. While a thread unwinds from a panic, dropping withdraws the operation instead.
///
/// The transports copy straight from and into the borrowed buffers, so the borrow must not end while the
/// operation is in flight: do not [`std::mem::forget`] a request whose buffer is then freed or reused (like
/// pre-1.0 `thread::scoped`, leaking the guard is the one way to break this guarantee).
#[must_use = "a request must be waited for; dropping it blocks until it finishes"]
pub struct Request<'a> {
    ops: [Option<Pending>; 2],
    _buf: PhantomData<&'a mut [u8]>,
}

impl<'a> Request<'a> {
    pub(crate) fn new(a: Pending, b: Option<Pending>) -> Self {
        Request { ops: [Some(a), b], _buf: PhantomData }
    }

    /// Blocks until every part of the operation completes, the timeout elapses or a peer is found gone.
    /// Returns the first error; the other parts are still finished before returning.
    pub fn wait(mut self) -> Result<(), CommError> {
        let mut res = Ok(());
        for slot in self.ops.iter_mut() {
            if let Some(mut op) = slot.take() {
                let r = op.wait();
                if res.is_ok() {
                    res = r;
                }
            }
        }
        res
    }

    /// Returns `Ok(true)` once every part completed, `Ok(false)` while some is in flight, and the error of a part
    /// that failed (that part is then finished; later calls report on the rest).
    pub fn test(&mut self) -> Result<bool, CommError> {
        let mut all = true;
        for slot in self.ops.iter_mut() {
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
}

impl std::fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.ops.iter().filter(|o| o.is_some()).count();
        f.debug_struct("Request").field("parts_in_flight", &n).finish()
    }
}
