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
/// the receive's `(rp, rl)`, whose byte counts are equal. On failure, the ordinal of the device whose copier failed
/// and its reason.
///
/// # Safety
/// Both slots belong to operations in flight that keep their buffers (and regions, and copiers) alive and
/// borrowed until they are completed, after this returns; a send and a receive buffer never overlap.
pub(super) unsafe fn copy(sp: *const u8, sl: usize, rp: *mut u8, rl: usize) -> Result<(), (u32, String)> {
    let n = bytes(sl);
    debug_assert_eq!(n, bytes(rl));
    // SAFETY (all of the below): per our contract, a device slot's pointer is its live region, a host slot's the
    // `n` bytes of its buffer, and the regions' copiers are alive.
    unsafe {
        let src = is_device(sl).then(|| &*(sp as *const Region));
        let dst = is_device(rl).then(|| &*(rp as *const Region));
        match (src, dst) {
            (Some(s), None) => {
                let host = std::slice::from_raw_parts_mut(rp, n);
                s.end.copier().download(s.addr, host).map_err(|e| (s.end.ordinal, e))
            }
            (None, Some(r)) => {
                let host = std::slice::from_raw_parts(sp, n);
                r.end.copier().upload(r.addr, host).map_err(|e| (r.end.ordinal, e))
            }
            (Some(s), Some(r)) if s.end.ordinal == r.end.ordinal => {
                r.end.copier().copy_within(r.addr, s.addr, n).map_err(|e| (r.end.ordinal, e))
            }
            (Some(s), Some(r)) => {
                let mut host = vec![0u8; n];
                s.end.copier().download(s.addr, &mut host).map_err(|e| (s.end.ordinal, e))?;
                r.end.copier().upload(r.addr, &host).map_err(|e| (r.end.ordinal, e))
            }
            (None, None) => {
                crate::copy::copy(sp, rp, n);
                Ok(())
            }
        }
    }
}
