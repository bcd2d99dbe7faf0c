//! The hash of the compile cache's keys and checksums (nvrtc.rs) and of the CUDA headers' content (headers.rs).

/// FNV-1a, 128 bits: a cache key and checksum, not a defence against crafted collisions (the cache folder is the
/// user's own).
pub(crate) struct Fnv128(u128);

impl Fnv128 {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013b;

    pub fn new() -> Self {
        Self(Self::OFFSET)
    }
    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u128::from(b);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }
    /// Writes `bytes` with its length first, so that different splits of the same bytes hash differently.
    pub fn part(&mut self, bytes: &[u8]) {
        self.write(&(bytes.len() as u64).to_le_bytes());
        self.write(bytes);
    }
    pub fn finish(&self) -> u128 {
        self.0
    }
}
