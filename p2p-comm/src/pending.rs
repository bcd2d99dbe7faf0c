//! Operations in flight at the transport level, and the parts of one request.

use std::sync::{Arc, Mutex};

use crate::error::CommError;
use crate::threads::ThreadOp;

/// One transport-level operation. Dropping it finishes it (or, while unwinding, withdraws it).
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

/// The parts of one request: a message, or both directions of a ring shift (the receive first).
#[derive(Default)]
pub(crate) struct Parts([Option<Pending>; 2]);

impl Parts {
    pub(crate) fn one(a: Pending) -> Self {
        Parts([Some(a), None])
    }

    pub(crate) fn two(a: Pending, b: Pending) -> Self {
        Parts([Some(a), Some(b)])
    }

    /// Finishes every part; the first error.
    pub(crate) fn wait(&mut self) -> Result<(), CommError> {
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

    /// `Ok(true)` once every part finished; the error of a part that failed (that part is then finished; later
    /// calls report on the rest).
    pub(crate) fn test(&mut self) -> Result<bool, CommError> {
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

    pub(crate) fn in_flight(&self) -> usize {
        self.0.iter().filter(|o| o.is_some()).count()
    }
}

/// Where a scoped request's parts live, shared with its scope.
pub(crate) type ScopeSlot = Arc<Mutex<Parts>>;

/// What a communicator keeps for its scopes between calls: free request slots, and the list a scope keeps of
/// the ones it handed out, so that a steady loop of scoped exchanges allocates nothing.
#[derive(Default)]
pub(crate) struct ScopePool {
    pub(crate) free: Vec<ScopeSlot>,
    pub(crate) started: Vec<ScopeSlot>,
}
