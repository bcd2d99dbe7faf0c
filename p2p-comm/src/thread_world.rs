//! The public way to run ranks as threads.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::communicator::Communicator;
use crate::error::CommError;
use crate::op::DEFAULT_TIMEOUT;
use crate::threads::{Endpoint, World, MAX_THREAD_RANKS};

/// Runs a closure on `n` ranks, one thread each, connected by the threads transport.
///
/// ```
/// use longctx_p2p::ThreadWorld;
/// let ranks = ThreadWorld::run(3, |c| c.rank() * 10)?;
/// assert_eq!(ranks, vec![0, 10, 20]);
/// # Ok::<(), longctx_p2p::CommError>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct ThreadWorld;

impl ThreadWorld {
    /// Runs `f` on `n` ranks with the default timeout and returns each rank's result, in rank order.
    ///
    /// If a rank panics, the others' operations that involve it fail with [`CommError::PeerFailed`] carrying
    /// the panic message, and `run` returns [`CommError::RankPanicked`] naming the rank that panicked first. A
    /// rank whose closure returns leaves its peers [`CommError::PeerGone`]; with [`try_run`](Self::try_run), a
    /// rank that returns an error tells them why.
    pub fn run<R: Send, F: Fn(Communicator) -> R + Sync>(n: usize, f: F) -> Result<Vec<R>, CommError> {
        ThreadWorld::builder().run(n, f)
    }

    /// [`run`](Self::run) for a closure that returns a `Result`: a rank that returns `Err(e)` leaves its peers
    /// [`CommError::PeerFailed`] with `e`'s `Display` as the reason (as if it had called
    /// [`Communicator::abort`]), so they learn why the job failed rather than only that the rank is gone. So do
    /// its peers in communicators split from the one it was given, which it dropped before the error was known.
    ///
    /// ```
    /// use longctx_p2p::{CommError, ThreadWorld};
    ///
    /// let out = ThreadWorld::try_run(2, |comm| {
    ///     if comm.rank() == 1 {
    ///         return Err(CommError::InvalidArgument("bad input".into()));
    ///     }
    ///     comm.recv(1, 0, &mut [0u8; 4])
    /// })?;
    /// assert!(matches!(&out[0], Err(CommError::PeerFailed { rank: 1, reason }) if reason.contains("bad input")));
    /// # Ok::<(), CommError>(())
    /// ```
    pub fn try_run<T, E, F>(n: usize, f: F) -> Result<Vec<Result<T, E>>, CommError>
    where
        T: Send,
        E: std::fmt::Display + Send,
        F: Fn(Communicator) -> Result<T, E> + Sync,
    {
        ThreadWorld::builder().try_run(n, f)
    }

    /// A builder to set options (the timeout) before running.
    pub fn builder() -> ThreadWorldBuilder {
        ThreadWorldBuilder { timeout: DEFAULT_TIMEOUT }
    }
}

/// Options of a [`ThreadWorld`].
#[derive(Debug, Clone)]
pub struct ThreadWorldBuilder {
    timeout: Duration,
}

impl ThreadWorldBuilder {
    /// The timeout of every rank's communicator (default 5 minutes).
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }

    /// Creates the communicators without running anything: one per rank, in rank order, to be moved to threads.
    /// (A rank that fails should then call [`Communicator::abort`] to tell its peers why.)
    pub fn build(&self, n: usize) -> Result<Vec<Communicator>, CommError> {
        Ok(self.world(n)?.1)
    }

    fn world(&self, n: usize) -> Result<(Arc<World>, Vec<Communicator>), CommError> {
        if n == 0 {
            return Err(CommError::InvalidArgument("a world needs at least one rank".into()));
        }
        if n > MAX_THREAD_RANKS {
            return Err(CommError::InvalidArgument(format!("a threads world has at most {MAX_THREAD_RANKS} ranks")));
        }
        let world = World::new(n);
        let comms =
            (0..n).map(|rank| Communicator::from_endpoint(Endpoint::new(world.clone(), rank), self.timeout)).collect();
        Ok((world, comms))
    }

    /// Like [`ThreadWorld::run`], with this builder's options.
    pub fn run<R: Send, F: Fn(Communicator) -> R + Sync>(&self, n: usize, f: F) -> Result<Vec<R>, CommError> {
        self.supervised(n, f, |_| None)
    }

    /// Like [`ThreadWorld::try_run`], with this builder's options.
    pub fn try_run<T, E, F>(&self, n: usize, f: F) -> Result<Vec<Result<T, E>>, CommError>
    where
        T: Send,
        E: std::fmt::Display + Send,
        F: Fn(Communicator) -> Result<T, E> + Sync,
    {
        self.supervised(n, f, |r| r.as_ref().err().map(|e| e.to_string()))
    }

    /// Runs `f` on every rank; when a rank's closure returns, its departure is settled with the reason
    /// `failure` finds in its result (or its panic message), so its peers learn why it left.
    fn supervised<R: Send, F: Fn(Communicator) -> R + Sync>(
        &self,
        n: usize,
        f: F,
        failure: impl Fn(&R) -> Option<String> + Sync,
    ) -> Result<Vec<R>, CommError> {
        let (world, comms) = self.world(n)?;
        (0..n).for_each(|r| world.supervise(r));
        let order = AtomicUsize::new(0);
        let outcomes: Vec<Result<R, (usize, String)>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let (f, order, world, failure) = (&f, &order, &world, &failure);
                    std::thread::Builder::new().name(format!("rank-{rank}")).spawn_scoped(s, move || {
                        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm))).map_err(|p| {
                            let msg = p
                                .downcast_ref::<&str>()
                                .map(|s| s.to_string())
                                .or_else(|| p.downcast_ref::<String>().cloned())
                                .unwrap_or_else(|| "non-string panic payload".into());
                            (order.fetch_add(1, Ordering::SeqCst), msg)
                        });
                        let reason = match &out {
                            Ok(r) => failure(r),
                            Err((_, msg)) => Some(format!("panicked: {msg}")),
                        };
                        world.settle(rank, reason);
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| match h {
                    Ok(h) => h.join().unwrap_or_else(|_| Err((usize::MAX, "thread failed".into()))),
                    Err(e) => {
                        let msg = format!("spawning the thread failed: {e}");
                        world.settle(rank, Some(msg.clone()));
                        Err((usize::MAX, msg))
                    }
                })
                .collect()
        });
        let first = outcomes
            .iter()
            .enumerate()
            .filter_map(|(rank, o)| o.as_ref().err().map(|(ord, msg)| (*ord, rank, msg.clone())))
            .min();
        if let Some((_, rank, message)) = first {
            return Err(CommError::RankPanicked { rank, message });
        }
        Ok(outcomes.into_iter().filter_map(Result::ok).collect())
    }
}
