//! [`DeviceCopy`]: how the communicator reaches device memory it does not own (see [`crate::memory`]).

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
