//! Messages in device memory on the threads transport.
//!
//! The ranks share the process, so a device address means the same to every copier of that device (every rank's
//! backend on it): a message between two device buffers is one [`DeviceCopy::copy_within`], and one between host
//! and device memory one upload or download, made with the copier of the side in device memory. Only a message
//! between two different devices passes through host memory (a download, then an upload). These copies are made
//! at the match, by whichever side posts second, never in chunks: the copier's call is one transfer on the device
//! and is finished when it returns (see [`crate::memory`] for the contract on the buffers).
//!
//! A mailbox slot holds one pointer and one length: the slot of an operation in device memory points at the
//! [`Region`] the operation owns, and its length carries the [`DEVICE`] flag.
//!
//! [`DeviceCopy::copy_within`]: crate::DeviceCopy::copy_within

use crate::device_copy::Place;
use crate::op::DeviceEnd;

/// Flag in a slot's length: its pointer is a [`Region`].
pub(super) const DEVICE: usize = 1 << (usize::BITS - 1);

/// Where the bytes of an operation in device memory lie, owned by the operation (in an `Arc`, so moving the
/// operation never moves it) for as long as its slot may be matched.
#[derive(Debug)]
pub(super) struct Region {
    pub(super) addr: u64,
    pub(super) end: DeviceEnd,
}

/// The byte count of a slot's length.
pub(super) fn bytes(len: usize) -> usize {
    len & !DEVICE
}

/// Whether a slot's length says device memory.
pub(super) fn is_device(len: usize) -> bool {
    len & DEVICE != 0
}

/// Copies a matched message of which at least one side lies in device memory, from the send's slot `(sp, sl)` to
/// the receive's `(rp, rl)`, whose byte counts are equal ([`crate::device_copy::copy`]). On failure, the ordinal of
/// the device whose copier failed and its reason.
///
/// # Safety
/// Both slots belong to operations in flight that keep their buffers (and regions, and copiers) alive and
/// borrowed until they are completed, after this returns; a send and a receive buffer never overlap.
pub(super) unsafe fn copy(sp: *const u8, sl: usize, rp: *mut u8, rl: usize) -> Result<(), (u32, String)> {
    debug_assert_eq!(bytes(sl), bytes(rl));
    // SAFETY: per our contract, a device slot's pointer is its live region (whose copier is alive), a host slot's
    // the bytes of its buffer.
    unsafe {
        let place = |p: *const u8, len: usize| {
            if is_device(len) {
                let r = &*(p as *const Region);
                Place { addr: r.addr, device: Some((r.end.ordinal, r.end.copier())) }
            } else {
                Place { addr: p as u64, device: None }
            }
        };
        crate::device_copy::copy(place(sp, sl), place(rp, rl), bytes(sl))
    }
}
