//! The public way to run ranks as threads.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::endpoint::Endpoint;
use super::mailbox::MAX_THREAD_RANKS;
use super::world::World;
use crate::communicator::Communicator;
use crate::error::CommError;
use crate::op::DEFAULT_TIMEOUT;

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
    /// If a rank panics the others see [`CommError::PeerGone`] from operations that involve it, and `run`
    /// returns [`CommError::RankPanicked`] naming the rank that panicked first.
    pub fn run<R: Send, F: Fn(Communicator) -> R + Sync>(n: usize, f: F) -> Result<Vec<R>, CommError> {
        ThreadWorld::builder().run(n, f)
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
    pub fn build(&self, n: usize) -> Result<Vec<Communicator>, CommError> {
        if n == 0 {
            return Err(CommError::InvalidArgument("a world needs at least one rank".into()));
        }
        if n > MAX_THREAD_RANKS {
            return Err(CommError::InvalidArgument(format!("a threads world has at most {MAX_THREAD_RANKS} ranks")));
        }
        let world = World::new(n);
        Ok((0..n).map(|rank| Communicator::from_endpoint(Endpoint::new(world.clone(), rank), self.timeout)).collect())
    }

    /// Like [`ThreadWorld::run`], with this builder's options.
    pub fn run<R: Send, F: Fn(Communicator) -> R + Sync>(&self, n: usize, f: F) -> Result<Vec<R>, CommError> {
        let comms = self.build(n)?;
        let order = AtomicUsize::new(0);
        let outcomes: Vec<Result<R, (usize, String)>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let (f, order) = (&f, &order);
                    std::thread::Builder::new().name(format!("rank-{rank}")).spawn_scoped(s, move || {
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm))).map_err(|p| {
                            let msg = p
                                .downcast_ref::<&str>()
                                .map(|s| s.to_string())
                                .or_else(|| p.downcast_ref::<String>().cloned())
                                .unwrap_or_else(|| "non-string panic payload".into());
                            (order.fetch_add(1, Ordering::SeqCst), msg)
                        })
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h.join().unwrap_or_else(|_| Err((usize::MAX, "thread failed".into()))),
                    Err(e) => Err((usize::MAX, format!("spawning the thread failed: {e}"))),
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
