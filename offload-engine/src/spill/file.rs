//! Writing and reading one spill file, with direct or buffered I/O.
//!
//! Both write the data in [`CHUNK`]-byte pieces at their offsets, then the header (which holds the data's
//! checksum) at offset 0; both checksum each piece right after it passed through the cache, so the checksum
//! costs no extra trip through memory.
//!
//! - Direct (`O_DIRECT`): every transfer is a whole number of pages from a page-aligned staging buffer, so the
//!   data is copied once into the worker's staging buffer and goes to the device past the page cache. The file
//!   is padded to a page. No `fsync`: the data is on the device when `pwrite` returns, and a file nobody will
//!   read after a crash (the next start removes it) needs no durable metadata.
//! - Buffered (a filesystem that refuses `O_DIRECT`, or [`crate::OffloadEngineBuilder::direct_io`] off): the
//!   data goes straight from the tensor into the page cache, then `fdatasync` and `POSIX_FADV_DONTNEED`, so the
//!   cached pages are clean and dropped and the memory is really given back. On tmpfs the "disk" is memory
//!   itself (shared memory, outside the process's RSS): spilling there lowers the process's footprint, not the
//!   machine's.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::aligned::{align_up, AlignedBuf};
use crate::error::OffloadError;
use crate::spill::{format, sys, DiskIo};
use crate::tensor::DType;
use crate::ticket::TensorTag;

/// Bytes moved per system call, and the size of a worker's staging buffer.
pub(crate) const CHUNK: usize = 8 << 20;

/// Pieces checksummed and copied together, small enough to stay in L2 between the two.
const SUB: usize = 256 << 10;

/// Bytes a file for a tensor of `data_len` bytes takes on disk (what the disk tier's budget counts), at most.
pub(crate) fn file_bytes(data_len: usize) -> Option<u64> {
    let data = align_up(data_len)?;
    Some(format::HEADER_BYTES as u64 + data as u64)
}

/// The exact length of a complete file.
fn expected_len(mode: DiskIo, data_len: usize) -> u64 {
    match mode {
        DiskIo::Direct => file_bytes(data_len).unwrap_or(u64::MAX),
        DiskIo::Buffered => (format::HEADER_BYTES + data_len) as u64,
    }
}

fn open(path: &Path, mode: DiskIo, write: bool) -> io::Result<File> {
    let mut opts = OpenOptions::new();
    if write {
        opts.write(true).create_new(true).mode(0o600);
    } else {
        opts.read(true);
    }
    if mode == DiskIo::Direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    opts.open(path)
}

/// What one spill I/O needs to name its errors.
struct Target<'a> {
    path: &'a Path,
    tag: &'a TensorTag,
}

impl Target<'_> {
    fn io(&self, source: io::Error) -> OffloadError {
        if sys::is_out_of_space(&source) {
            OffloadError::DiskFull { tensor: self.tag.clone(), path: self.path.to_owned(), source }
        } else {
            OffloadError::Io { tensor: self.tag.clone(), path: self.path.to_owned(), source }
        }
    }

    fn corrupt(&self, reason: String) -> OffloadError {
        OffloadError::Corrupt { tensor: self.tag.clone(), path: self.path.to_owned(), reason }
    }

    /// A read error: running out of file is truncation, anything else an I/O error.
    fn read_err(&self, source: io::Error) -> OffloadError {
        if source.kind() == io::ErrorKind::UnexpectedEof {
            self.corrupt("truncated: the file ended early".into())
        } else {
            self.io(source)
        }
    }
}

/// Writes `data` (the tensor `tag`, of `dtype`) to a new file at `path`. `staging` is the worker's buffer,
/// mapped on first use under direct I/O.
pub(crate) fn write(
    path: &Path,
    mode: DiskIo,
    tag: &TensorTag,
    dtype: DType,
    data: &[u8],
    staging: &mut Option<AlignedBuf>,
) -> Result<(), OffloadError> {
    let t = Target { path, tag };
    let file = open(path, mode, true).map_err(|e| t.io(e))?;
    sys::preallocate(&file, expected_len(mode, data.len())).map_err(|e| t.io(e))?;
    let mut crc = crc32fast::Hasher::new();
    let base = format::HEADER_BYTES as u64;
    match mode {
        DiskIo::Direct => {
            let buf = staging_buf(staging).map_err(|e| t.io(e))?;
            for (i, piece) in data.chunks(CHUNK).enumerate() {
                let out = &mut buf.as_mut_slice()[..piece.len()];
                for (src, dst) in piece.chunks(SUB).zip(out.chunks_mut(SUB)) {
                    dst.copy_from_slice(src);
                    crc.update(dst);
                }
                // A short last piece is padded to a page with zeros (the buffer may hold an older piece there).
                let padded = align_up(piece.len()).unwrap_or(CHUNK);
                buf.as_mut_slice()[piece.len()..padded].fill(0);
                file.write_all_at(&buf.as_slice()[..padded], base + (i * CHUNK) as u64).map_err(|e| t.io(e))?;
            }
            format::encode(buf.as_mut_slice(), tag, dtype, data.len() as u64, crc.finalize());
            file.write_all_at(&buf.as_slice()[..format::HEADER_BYTES], 0).map_err(|e| t.io(e))?;
        }
        DiskIo::Buffered => {
            for (i, piece) in data.chunks(CHUNK).enumerate() {
                crc.update(piece);
                file.write_all_at(piece, base + (i * CHUNK) as u64).map_err(|e| t.io(e))?;
            }
            let mut page = [0u8; format::HEADER_BYTES];
            format::encode(&mut page, tag, dtype, data.len() as u64, crc.finalize());
            file.write_all_at(&page, 0).map_err(|e| t.io(e))?;
            file.sync_data().map_err(|e| t.io(e))?;
            // Advice, not a promise: a kernel that keeps the clean pages still frees them under pressure.
            let _ = sys::fadvise(&file, libc::POSIX_FADV_DONTNEED);
        }
    }
    Ok(())
}

/// Reads the file at `path` into `out` (exactly the tensor's bytes), checking header and checksum.
pub(crate) fn read(
    path: &Path,
    mode: DiskIo,
    tag: &TensorTag,
    dtype: DType,
    out: &mut [u8],
    staging: &mut Option<AlignedBuf>,
) -> Result<(), OffloadError> {
    let t = Target { path, tag };
    let file = open(path, mode, false).map_err(|e| t.io(e))?;
    let len = file.metadata().map_err(|e| t.io(e))?.len();
    let expected = expected_len(mode, out.len());
    if len != expected {
        let what = if len < expected { "truncated" } else { "too long" };
        return Err(t.corrupt(format!("{what}: {len} bytes, expected {expected}")));
    }
    let mut crc = crc32fast::Hasher::new();
    let base = format::HEADER_BYTES as u64;
    let stored = match mode {
        DiskIo::Direct => {
            let buf = staging_buf(staging).map_err(|e| t.io(e))?;
            file.read_exact_at(&mut buf.as_mut_slice()[..format::HEADER_BYTES], 0).map_err(|e| t.read_err(e))?;
            let stored = format::check(buf.as_slice(), tag, dtype, out.len() as u64).map_err(|r| t.corrupt(r))?;
            for (i, piece) in out.chunks_mut(CHUNK).enumerate() {
                let padded = align_up(piece.len()).unwrap_or(CHUNK);
                let at = base + (i * CHUNK) as u64;
                file.read_exact_at(&mut buf.as_mut_slice()[..padded], at).map_err(|e| t.read_err(e))?;
                for (src, dst) in buf.as_slice()[..piece.len()].chunks(SUB).zip(piece.chunks_mut(SUB)) {
                    crc.update(src);
                    dst.copy_from_slice(src);
                }
            }
            stored
        }
        DiskIo::Buffered => {
            // The whole file at once: the kernel reads ahead while this thread checksums what has arrived.
            let _ = sys::fadvise(&file, libc::POSIX_FADV_WILLNEED);
            let mut page = [0u8; format::HEADER_BYTES];
            file.read_exact_at(&mut page, 0).map_err(|e| t.read_err(e))?;
            let stored = format::check(&page, tag, dtype, out.len() as u64).map_err(|r| t.corrupt(r))?;
            for (i, piece) in out.chunks_mut(CHUNK).enumerate() {
                file.read_exact_at(piece, base + (i * CHUNK) as u64).map_err(|e| t.read_err(e))?;
                crc.update(piece);
            }
            stored
        }
    };
    let computed = crc.finalize();
    if computed != stored {
        return Err(t.corrupt(format!("data checksum mismatch (stored {stored:08x}, computed {computed:08x})")));
    }
    Ok(())
}

fn staging_buf(staging: &mut Option<AlignedBuf>) -> io::Result<&mut AlignedBuf> {
    let buf = match staging.take() {
        Some(buf) => buf,
        None => AlignedBuf::zeroed(CHUNK)?,
    };
    Ok(staging.insert(buf))
}
