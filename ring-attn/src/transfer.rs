//! Views handed to the communicator where their bytes lie: host views as host bytes, device views as device
//! addresses with [`BackendCopy`], which moves them through the backend for transports that cannot reach the
//! device themselves (see `longctx_p2p::memory`). Public so that a caller holding backend buffers (the trainer's
//! gradients) sends them the way ring attention does:
//!
//! ```
//! use longctx_p2p::ReduceOp;
//! use longctx_ring_attn::transfer::{bytes_mut, BackendCopy};
//! use longctx_ring_attn::{CpuBackend, ThreadWorld, ViewMut};
//!
//! let sums = ThreadWorld::run(2, |c| {
//!     let backend = CpuBackend::new();
//!     let mut g = vec![1.5f32 + c.rank() as f32; 4];
//!     let copy = BackendCopy(&backend);
//!     let view = ViewMut::new(&mut g, [4]).expect("dims");
//!     c.all_reduce_bytes::<f32>(bytes_mut(view, &copy), ReduceOp::Sum).map(|()| g)
//! })?;
//! assert!(sums.iter().all(|s| s.as_ref().is_ok_and(|g| g == &[4.0; 4])));
//! # Ok::<(), longctx_p2p::CommError>(())
//! ```

use longctx_kernels::{Backend, DType, DeviceSlice, DeviceSliceMut, RawBytes, RawBytesMut, View, ViewMut};
use longctx_p2p::{Bytes, BytesMut, DeviceBytes, DeviceCopy};

/// The communicator's copier for a backend's device memory: its download, upload and copy, on raw bytes. An
/// upload or a copy waits for the backend (`synchronize`), so the bytes are in place when the receive that made it
/// finishes, for every queue. The communicator may call it from any rank's thread, with another rank's addresses on
/// the same device (see `longctx_p2p::memory`).
pub struct BackendCopy<'a>(pub &'a dyn Backend);

/// Bytes as elements a backend copies bit for bit: 4-byte words when the length allows, else 2-byte ones (every
/// message here is whole `f32`, `bf16` or `f16` elements).
fn unit(len: usize) -> DType {
    if len.is_multiple_of(4) {
        DType::F32
    } else {
        DType::F16
    }
}

impl DeviceCopy for BackendCopy<'_> {
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), String> {
        let (dtype, len) = (unit(dst.len()), dst.len());
        let n = len / dtype.size();
        // SAFETY: `src` is the address of `len` bytes of a view of this backend's memory, borrowed by the transfer
        // that asks for them (see `bytes`).
        let src = unsafe { DeviceSlice::new(src, n, dtype, self.0.memory()) };
        let src = View::device(src, [n]).map_err(|e| e.to_string())?;
        // Straight into the communicator's buffer when it is aligned for the elements (the allocator's alignment
        // makes it so in practice), else through an aligned one.
        if let Ok(direct) = ViewMut::from_host_bytes(dst, dtype, [n]) {
            return self.0.download(direct, src).map_err(|e| e.to_string());
        }
        let mut words = vec![0u32; len.div_ceil(4)];
        let host = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut words)[..len];
        let staged = ViewMut::from_host_bytes(host, dtype, [n]).map_err(|e| e.to_string())?;
        self.0.download(staged, src).map_err(|e| e.to_string())?;
        dst.copy_from_slice(host);
        Ok(())
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), String> {
        let (dtype, len) = (unit(src.len()), src.len());
        let n = len / dtype.size();
        // SAFETY: as in `download`; the receive that asks holds the view mutably.
        let dst = unsafe { DeviceSliceMut::new(dst, n, dtype, self.0.memory()) };
        let dst = ViewMut::device(dst, [n]).map_err(|e| e.to_string())?;
        let mut words = Vec::new();
        let src = match View::from_host_bytes(src, dtype, [n]) {
            Ok(direct) => direct,
            Err(_) => {
                words.resize(len.div_ceil(4), 0u32);
                let host = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut words)[..len];
                host.copy_from_slice(src);
                View::from_host_bytes(host, dtype, [n]).map_err(|e| e.to_string())?
            }
        };
        self.0.upload(dst, src).map_err(|e| e.to_string())?;
        // Upload may be asynchronous; the message's bytes must be in place when the receive finishes.
        self.0.synchronize().map_err(|e| e.to_string())
    }

    fn copy_within(&self, dst: u64, src: u64, len: usize) -> Result<(), String> {
        let dtype = unit(len);
        let n = len / dtype.size();
        // SAFETY: `src` and `dst` are the addresses of `len` bytes of views of this backend's device (maybe another
        // rank's backend on it: the same address space), borrowed by the send and the receive that ask for them.
        let (src, dst) = unsafe {
            (DeviceSlice::new(src, n, dtype, self.0.memory()), DeviceSliceMut::new(dst, n, dtype, self.0.memory()))
        };
        let src = View::device(src, [n]).map_err(|e| e.to_string())?;
        let dst = ViewMut::device(dst, [n]).map_err(|e| e.to_string())?;
        self.0.copy(dst, src).map_err(|e| e.to_string())?;
        self.0.synchronize().map_err(|e| e.to_string())
    }
}

/// The bytes of `v` for a send: host bytes, or device bytes that `copy` reaches.
pub fn bytes<'a>(v: View<'a>, copy: &'a BackendCopy<'_>) -> Bytes<'a> {
    match v.raw_bytes() {
        RawBytes::Host(b) => Bytes::Host(b),
        RawBytes::Device { ptr, len, memory } => {
            Bytes::Device(DeviceBytes { ptr, len, ordinal: ordinal(memory), copy })
        }
    }
}

/// The bytes of `v` for a receive: host bytes, or device bytes that `copy` reaches.
pub fn bytes_mut<'a>(v: ViewMut<'a>, copy: &'a BackendCopy<'_>) -> BytesMut<'a> {
    match v.into_raw_bytes() {
        RawBytesMut::Host(b) => BytesMut::Host(b),
        RawBytesMut::Device { ptr, len, memory } => {
            BytesMut::Device(DeviceBytes { ptr, len, ordinal: ordinal(memory), copy })
        }
    }
}

fn ordinal(memory: longctx_kernels::Memory) -> u32 {
    match memory {
        longctx_kernels::Memory::Cuda { ordinal } => ordinal as u32,
        _ => 0,
    }
}
