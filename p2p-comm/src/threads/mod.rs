//! The threads transport: every rank is a thread of one process.
//!
//! Ring exchanges (`sendrecv`, `isendrecv` and the collectives' steps) pair their messages by number in a
//! channel per ordered pair of ranks, with no matching (see [`channel`]). Every other message is matched
//! through mailboxes, as follows.
//!
//! Matching is rendezvous with a single copy. Each rank `d` owns a mailbox holding the sends addressed to it
//! that no receive has matched yet and the receives it posted that no send has matched yet. Whoever arrives
//! second (the sender finding a posted receive, or the receiver finding a posted send) removes the other's slot
//! under the mailbox lock. Slots are matched first-in first-out per (source, tag). Each side's
//! [`Request`](crate::Request) borrows its buffer until its completion is done, so the copy reads and writes
//! live memory.
//!
//! Who copies depends on the size:
//! - messages under [`DEFER_MIN`] bytes are copied at once by whoever arrives second, inside `post`: cheapest
//!   for latency-bound traffic;
//! - larger ones are only *matched* in `post`: the pair (both buffers) is parked in the receive's completion
//!   and copied in chunks ([`chunk_len`]): the receiver claims them from the front as soon as it waits on (or
//!   tests) its receive, the sender from the back of the back half as soon as it waits on its send (a message
//!   of one chunk would be the receiver's alone; [`chunk_len`] gives every deferred message two or more). Each
//!   side so copies the same part of a message from one exchange to the next, and a destination line stays in
//!   the cache of the core that wrote it last time. In a one-way stream the two cores split every message, so
//!   a large message is copied by two cores at once, and the sender does not first spin to leave the copy to
//!   the receiver. A sender whose receiver has not claimed its half after a spin copies it too: the receiver
//!   may be busy elsewhere, and a send must complete without it.
//!
//! Messages of which either side lies in device memory are copied at once by whoever arrives second, with the
//! copiers of the sides in device memory (see [`device`]).
//!
//! A waiter whose chunks are all claimed spins while the peer copies the last ones instead of sleeping: the
//! futex sleep and wake-up cost tens of µs and lie on the path of the next message.
//!
//! Completions are pooled per rank and the mailbox queues keep their capacity, so a steady-state exchange of
//! a given shape allocates nothing.
//!
//! When a rank's communicator is dropped (normally or while its thread unwinds from a panic) the rank is marked
//! gone: its unmatched slots leave the mailboxes, and every operation waiting on it completes with its reason
//! (see `World::depart`).

mod channel;
mod completion;
mod device;
mod endpoint;
mod exchange;
mod mailbox;
mod mailbox_op;
mod refs;
mod world;

pub(crate) use endpoint::{Endpoint, ThreadOp};
pub(crate) use mailbox::MAX_THREAD_RANKS;
pub(crate) use world::World;
