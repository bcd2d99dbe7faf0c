//! What a transport is asked to do: one send or receive, described by an [`Op`], and the layout of the keys
//! and descriptors that travel with it.

use std::time::Duration;

use crate::device_copy::DeviceCopy;
use crate::error::CommError;

/// Timeout of a new communicator.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Keys of user messages occupy `0..2^32` (the tag); messages of collectives and ring shifts use this channel
/// above them.
pub(crate) const INTERNAL: u64 = 1 << 32;
/// Key of [`Communicator::sendrecv`](crate::Communicator::sendrecv) /
/// [`Scope::isendrecv`](crate::Scope::isendrecv) messages.
pub(crate) const RING_TAG: u64 = INTERNAL | 0xFF;

/// One send or receive of raw bytes, as the communicator hands it to a transport.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Op {
    /// A send (else a receive).
    pub(crate) is_send: bool,
    /// The peer, a rank of the communicator.
    pub(crate) peer: usize,
    /// The tag, or an internal key (see [`INTERNAL`]).
    pub(crate) key: u64,
    /// The collective's descriptor ([`meta`]; 0 for point-to-point): matched messages must agree on it.
    pub(crate) meta: u64,
    /// The buffer: read by a send, written by a receive. Kept valid (and, for a receive, unaliased) by whoever
    /// posts the op until it finishes: see [`Communicator::post`](crate::Communicator). For device memory
    /// (`device` set), the device address.
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    /// The device memory the buffer lies in, if it does not lie in host memory. Only a transport that reaches
    /// device memory is handed one (see [`Communicator::reaches_device`](crate::Communicator::reaches_device)).
    pub(crate) device: Option<DeviceEnd>,
    /// The caller will not wait at once (a non-blocking call), so the transport should move the message in the
    /// background meanwhile (UCX: its progress thread; the threads transport copies on a waiting rank's thread,
    /// so it has nothing to do with this).
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(crate) later: bool,
    /// One direction of a ring exchange, whose peer is exchanging with its own neighbours at the same moment, in
    /// the same order as every rank (threads: paired by number in the pair's exchange channel).
    pub(crate) exchange: bool,
    /// How long a wait on it may take.
    pub(crate) timeout: Duration,
}

/// The device of an op's buffer and the copier that reaches it. The copier's borrow is erased: whoever posts the
/// op keeps it alive until the op finishes, as it does the buffer.
#[derive(Clone, Copy)]
pub(crate) struct DeviceEnd {
    pub(crate) ordinal: u32,
    pub(crate) copy: *const (dyn DeviceCopy + 'static),
}

// SAFETY: the end is a borrow of a `DeviceCopy`, which is `Sync`, so sharing or sending the borrow is sound.
unsafe impl Send for DeviceEnd {}
// SAFETY: as for `Send`.
unsafe impl Sync for DeviceEnd {}

impl std::fmt::Debug for DeviceEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceEnd").field("ordinal", &self.ordinal).finish_non_exhaustive()
    }
}

impl DeviceEnd {
    /// The end of `copy`'s device `ordinal`.
    ///
    /// # Safety
    /// `copy` must outlive every op that carries the returned end.
    pub(crate) unsafe fn new(ordinal: u32, copy: &dyn DeviceCopy) -> DeviceEnd {
        let copy: *const (dyn DeviceCopy + '_) = copy;
        // SAFETY: only the borrow's lifetime changes; the caller keeps the copier alive as long as the op.
        let copy =
            unsafe { std::mem::transmute::<*const (dyn DeviceCopy + '_), *const (dyn DeviceCopy + 'static)>(copy) };
        DeviceEnd { ordinal, copy }
    }

    /// The copier.
    ///
    /// # Safety
    /// Only while the op that carries this end is in flight (see [`DeviceEnd::new`]).
    pub(crate) unsafe fn copier(&self) -> &dyn DeviceCopy {
        // SAFETY: per our contract.
        unsafe { &*self.copy }
    }
}

// Collectives' codes, in the descriptor's top byte.
pub(crate) const BARRIER: u64 = 1;
pub(crate) const ALL_REDUCE: u64 = 2;
pub(crate) const ALL_GATHER: u64 = 3;
pub(crate) const REDUCE_SCATTER: u64 = 4;
pub(crate) const BROADCAST: u64 = 5;
pub(crate) const ALL_TO_ALL: u64 = 6;

/// Name of the collective with internal code `code` (UCX carries only the code in a message's tag).
pub(crate) fn name(code: u64) -> &'static str {
    match code {
        BARRIER => "barrier",
        ALL_REDUCE => "all_reduce",
        ALL_GATHER => "all_gather",
        REDUCE_SCATTER => "reduce_scatter",
        BROADCAST => "broadcast",
        ALL_TO_ALL => "all_to_all",
        _ => "point-to-point",
    }
}

/// Descriptor of a collective's call: operation in bits 56.., `extra` (root, operator) in bits 48..56, byte
/// count in bits 0..48.
pub(crate) fn meta(code: u64, bytes: usize, extra: u64) -> u64 {
    (code << 56) | ((extra & 0xFF) << 48) | (bytes as u64 & ((1 << 48) - 1))
}

fn describe(m: u64) -> String {
    format!("{} of {} bytes (root/operator {})", name(m >> 56), m & ((1 << 48) - 1), (m >> 48) & 0xFF)
}

/// The error for two matched messages whose descriptors differ.
pub(crate) fn mismatch(peer: usize, ours: u64, theirs: u64) -> CommError {
    mismatch_as(peer, ours, describe(theirs))
}

/// The error for a collective whose peer's call is known only in words (UCX: by a digest of its descriptor, or
/// by the collective its message belongs to).
pub(crate) fn mismatch_as(peer: usize, ours: u64, theirs: String) -> CommError {
    CommError::CollectiveMismatch { op: name(ours >> 56), peer, ours: describe(ours), theirs }
}
