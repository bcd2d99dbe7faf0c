//! [`DeviceCopy`]: how the communicator reaches device memory it does not own (see [`crate::memory`]), and
//! [`copy`], the one copy between two places wherever each lies.

/// Copies to, from and within one device's memory, for a transport that does not move device memory itself: the
/// threads transport copies each message with it once, a staging transport copies through host memory with it (see
/// the [memory module](crate::memory)). Implemented by the owner of the device memory (ring attention implements
/// it over its backend). Every call is finished on the device when it returns, and may come from any rank's thread.
pub trait DeviceCopy: Sync {
    /// Copies `dst.len()` bytes at device address `src` into `dst`.
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), String>;
    /// Copies `src` to device address `dst`.
    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), String>;
    /// Copies `len` bytes from device address `src` to device address `dst`, both of this copier's device and
    /// either possibly allocated by another of its users in this process (another rank's backend on the same
    /// device). The ranges do not overlap.
    fn copy_within(&self, dst: u64, src: u64, len: usize) -> Result<(), String>;
}

/// Where bytes lie for [`copy`]: host memory at `addr`, or device memory at device address `addr` with its
/// ordinal and the copier that reaches it.
#[derive(Clone, Copy)]
pub(crate) struct Place<'a> {
    pub(crate) addr: u64,
    pub(crate) device: Option<(u32, &'a dyn DeviceCopy)>,
}

/// Copies `len` bytes from `src` to `dst` in one copy: host to host by `memcpy`, host to device by the destination's
/// upload, device to host by the source's download, within one device by the destination's `copy_within`. Only
/// between two devices do the bytes pass through host memory (a download, then an upload). On failure, the
/// ordinal of the device whose copier failed, and its reason.
///
/// # Safety
/// Host places are `len` valid bytes of this process (`dst` writable), device places `len` bytes their copier
/// reaches; the two do not overlap, and nothing else writes them during the call.
pub(crate) unsafe fn copy(src: Place<'_>, dst: Place<'_>, len: usize) -> Result<(), (u32, String)> {
    // SAFETY (the host slices below): per our contract.
    unsafe {
        match (src.device, dst.device) {
            (None, None) => {
                crate::copy::copy(src.addr as usize as *const u8, dst.addr as usize as *mut u8, len);
                Ok(())
            }
            (Some((o, s)), None) => s
                .download(src.addr, std::slice::from_raw_parts_mut(dst.addr as usize as *mut u8, len))
                .map_err(|e| (o, e)),
            (None, Some((o, d))) => {
                d.upload(dst.addr, std::slice::from_raw_parts(src.addr as usize as *const u8, len)).map_err(|e| (o, e))
            }
            (Some((so, _)), Some((o, d))) if so == o => d.copy_within(dst.addr, src.addr, len).map_err(|e| (o, e)),
            (Some((so, s)), Some((o, d))) => {
                let mut host = vec![0u8; len];
                s.download(src.addr, &mut host).map_err(|e| (so, e))?;
                d.upload(dst.addr, &host).map_err(|e| (o, e))
            }
        }
    }
}
