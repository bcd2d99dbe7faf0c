//! Writing and reading one spill file, with direct or buffered I/O.
//!
//! Both write the data in [`CHUNK`]-byte pieces at their offsets, then the header (which holds the data's
//! checksum) at offset 0; both checksum each piece right after it passed through the cache, so the checksum
//! costs no extra trip through memory.
//!
//! - Direct (`O_DIRECT`): every transfer is a whole number of pages from a page-aligned staging buffer, so the
//!   data is copied once into one of the worker's two staging buffers and goes to the device past the page
//!   cache. A file of more than one piece is pipelined: a thread of the file's own moves one buffer to or from
//!   the device while the worker copies and checksums the other, so the copy hides behind the transfer instead
//!   of adding to it (on a fast disk, done in turn, they cost a quarter of the transfer's speed). The file is
//!   padded to a page. No `fsync`: the data is on the device when `pwrite` returns, and a file nobody will
//!   read after a crash (the next start removes it) needs no durable metadata.
//! - Buffered (a filesystem that refuses `O_DIRECT`, or [`crate::OffloadEngineBuilder::direct_io`] off): the
//!   data goes straight from the tensor into the page cache, then `fdatasync` and `POSIX_FADV_DONTNEED`, so the
//!   cached pages are clean and dropped and the memory is really given back. On tmpfs the "disk" is memory
//!   itself (shared memory, outside the process's RSS): spilling there lowers the process's footprint, not the
//!   machine's.

use std::fs::{File, OpenOptions};
use std::io;
use std::mem::MaybeUninit;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::mpsc;
use std::thread;

use crate::aligned::{align_up, fill, AlignedBuf};
use crate::error::OffloadError;
use crate::spill::{format, sys, DiskIo};
use crate::tag::TensorTag;
use crate::tensor::DType;

/// Bytes moved per system call, and the size of a worker's staging buffer.
pub(crate) const CHUNK: usize = 8 << 20;

/// Pieces checksummed and copied together, small enough to stay in L2 between the two.
const SUB: usize = 256 << 10;

/// Staging buffers per worker: one on the device, one being copied.
const DEPTH: usize = 2;

/// A worker's direct-I/O staging buffers ([`DEPTH`] of [`CHUNK`] bytes), mapped on first use and kept for the
/// worker's life.
#[derive(Default)]
pub(crate) struct Staging {
    bufs: Vec<AlignedBuf>,
    /// Buffers mapped so far: [`DEPTH`] at most while none is lost.
    mapped: usize,
}

impl Staging {
    fn take(&mut self) -> io::Result<AlignedBuf> {
        match self.bufs.pop() {
            Some(b) => Ok(b),
            None => {
                self.mapped += 1;
                AlignedBuf::zeroed(CHUNK)
            }
        }
    }

    fn put(&mut self, buf: AlignedBuf) {
        if self.bufs.len() < DEPTH {
            self.bufs.push(buf);
        }
    }
}

/// Bytes `O_DIRECT` moves for a piece of `n` bytes: `n` rounded up to a page.
fn padded(n: usize) -> usize {
    align_up(n).unwrap_or(CHUNK)
}

/// [`padded`] length of the `i`-th piece of a payload of `len` bytes.
fn padded_piece(len: usize, i: usize) -> usize {
    padded((len - i * CHUNK).min(CHUNK))
}

/// Copies `piece` into the front of `buf`, checksumming it as it goes, and zeroes the rest of its last page
/// (the buffer may hold an older piece there).
fn stage(buf: &mut AlignedBuf, piece: &[u8], crc: &mut crc32fast::Hasher) {
    let out = &mut buf.as_mut_slice()[..piece.len()];
    for (src, dst) in piece.chunks(SUB).zip(out.chunks_mut(SUB)) {
        dst.copy_from_slice(src);
        crc.update(dst);
    }
    buf.as_mut_slice()[piece.len()..padded(piece.len())].fill(0);
}

/// Copies the front of `buf` into `piece`, checksumming it as it goes.
fn unstage(buf: &AlignedBuf, piece: &mut [MaybeUninit<u8>], crc: &mut crc32fast::Hasher) {
    for (src, dst) in buf.as_slice()[..piece.len()].chunks(SUB).zip(piece.chunks_mut(SUB)) {
        crc.update(src);
        fill(dst, src);
    }
}

/// Writes `data` in pieces at `base` with `O_DIRECT`: the calling thread stages each piece while a writer
/// thread puts the one before on the device.
fn write_direct(
    file: &File,
    data: &[u8],
    base: u64,
    staging: &mut Staging,
    crc: &mut crc32fast::Hasher,
) -> io::Result<()> {
    if data.len() <= CHUNK {
        let mut buf = staging.take()?;
        stage(&mut buf, data, crc);
        let r = file.write_all_at(&buf.as_slice()[..padded(data.len())], base);
        staging.put(buf);
        return r;
    }
    let (full_tx, full_rx) = mpsc::sync_channel::<(u64, usize, AlignedBuf)>(DEPTH);
    let (empty_tx, empty_rx) = mpsc::channel::<AlignedBuf>();
    for _ in 0..DEPTH {
        // The receiver is alive: this cannot fail.
        let _ = empty_tx.send(staging.take()?);
    }
    let result = thread::scope(|s| {
        let writer = s.spawn(move || -> io::Result<()> {
            for (at, len, buf) in full_rx {
                let r = file.write_all_at(&buf.as_slice()[..len], at);
                let _ = empty_tx.send(buf);
                r?;
            }
            Ok(())
        });
        for (i, piece) in data.chunks(CHUNK).enumerate() {
            // Either fails only when the writer stopped on an error, which its join returns.
            let Ok(mut buf) = empty_rx.recv() else { break };
            stage(&mut buf, piece, crc);
            if full_tx.send((base + (i * CHUNK) as u64, padded_piece(data.len(), i), buf)).is_err() {
                break;
            }
        }
        drop(full_tx);
        writer.join().unwrap_or_else(|_| Err(io::Error::other("the spill writer thread panicked")))
    });
    empty_rx.try_iter().for_each(|b| staging.put(b));
    result
}

/// Reads `out.len()` bytes in pieces from `base` with `O_DIRECT`: a reader thread brings each piece into a
/// staging buffer while the calling thread copies out the one before. `Err` carries the read's own error.
fn read_direct(
    file: &File,
    out: &mut [MaybeUninit<u8>],
    base: u64,
    staging: &mut Staging,
    crc: &mut crc32fast::Hasher,
) -> io::Result<()> {
    let len = out.len();
    if len <= CHUNK {
        let mut buf = staging.take()?;
        let r = file.read_exact_at(&mut buf.as_mut_slice()[..padded(len)], base);
        if r.is_ok() {
            unstage(&buf, out, crc);
        }
        staging.put(buf);
        return r;
    }
    let pieces = len.div_ceil(CHUNK);
    let (full_tx, full_rx) = mpsc::sync_channel::<io::Result<AlignedBuf>>(DEPTH);
    let (empty_tx, empty_rx) = mpsc::channel::<AlignedBuf>();
    for _ in 0..DEPTH {
        // The receiver is alive: this cannot fail.
        let _ = empty_tx.send(staging.take()?);
    }
    let (result, back) = thread::scope(|s| {
        // The reader hands its end of the empty buffers back when it ends, so that none is lost with it.
        let reader = s.spawn(move || {
            for i in 0..pieces {
                // Fails only when the calling thread stopped (on an error of its own).
                let Ok(mut buf) = empty_rx.recv() else { break };
                let r = file.read_exact_at(&mut buf.as_mut_slice()[..padded_piece(len, i)], base + (i * CHUNK) as u64);
                let failed = r.is_err();
                if full_tx.send(r.map(|()| buf)).is_err() || failed {
                    break;
                }
            }
            empty_rx
        });
        let mut back = Vec::new();
        let mut result = Ok(());
        for piece in out.chunks_mut(CHUNK) {
            match full_rx.recv() {
                Ok(Ok(buf)) => {
                    unstage(&buf, piece, crc);
                    let _ = empty_tx.send(buf);
                }
                Ok(Err(e)) => {
                    result = Err(e);
                    break;
                }
                Err(_) => {
                    result = Err(io::Error::other("the spill reader thread panicked"));
                    break;
                }
            }
        }
        // Unblocks a reader still waiting for a buffer, then collects every buffer: those it did not take, and
        // those it read that were not copied out (after an error).
        drop(empty_tx);
        if let Ok(empty_rx) = reader.join() {
            back.extend(empty_rx.try_iter());
        }
        back.extend(full_rx.try_iter().filter_map(Result::ok));
        (result, back)
    });
    back.into_iter().for_each(|b| staging.put(b));
    result
}

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
    staging: &mut Staging,
) -> Result<(), OffloadError> {
    let t = Target { path, tag };
    let file = open(path, mode, true).map_err(|e| t.io(e))?;
    sys::preallocate(&file, expected_len(mode, data.len())).map_err(|e| t.io(e))?;
    let mut crc = crc32fast::Hasher::new();
    let base = format::HEADER_BYTES as u64;
    match mode {
        DiskIo::Direct => {
            write_direct(&file, data, base, staging, &mut crc).map_err(|e| t.io(e))?;
            let mut buf = staging.take().map_err(|e| t.io(e))?;
            format::encode(buf.as_mut_slice(), tag, dtype, data.len() as u64, crc.finalize());
            let r = file.write_all_at(&buf.as_slice()[..format::HEADER_BYTES], 0);
            staging.put(buf);
            r.map_err(|e| t.io(e))?;
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

/// Reads the file at `path` into `out` (exactly the tensor's bytes), checking header and checksum. `out` may be
/// memory never written (a fetch into a fresh allocation); on success every byte of it has been.
pub(crate) fn read(
    path: &Path,
    mode: DiskIo,
    tag: &TensorTag,
    dtype: DType,
    out: &mut [MaybeUninit<u8>],
    staging: &mut Staging,
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
            let mut buf = staging.take().map_err(|e| t.io(e))?;
            let header = file.read_exact_at(&mut buf.as_mut_slice()[..format::HEADER_BYTES], 0);
            let stored = header
                .map_err(|e| t.read_err(e))
                .and_then(|()| format::check(buf.as_slice(), tag, dtype, out.len() as u64).map_err(|r| t.corrupt(r)));
            staging.put(buf);
            let stored = stored?;
            read_direct(&file, out, base, staging, &mut crc).map_err(|e| t.read_err(e))?;
            stored
        }
        DiskIo::Buffered => {
            // The whole file at once: the kernel reads ahead while this thread checksums what has arrived.
            let _ = sys::fadvise(&file, libc::POSIX_FADV_WILLNEED);
            let mut page = [0u8; format::HEADER_BYTES];
            file.read_exact_at(&mut page, 0).map_err(|e| t.read_err(e))?;
            let stored = format::check(&page, tag, dtype, out.len() as u64).map_err(|r| t.corrupt(r))?;
            for (i, piece) in out.chunks_mut(CHUNK).enumerate() {
                let piece = sys::read_exact_at(&file, piece, base + (i * CHUNK) as u64).map_err(|e| t.read_err(e))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aligned::as_unfilled;
    use crate::tag::TensorKind;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 13) as u8).collect()
    }

    #[test]
    fn pipelined_direct_files_round_trip_reuse_the_staging_buffers_and_catch_truncation() {
        let dir = tempfile::tempdir().unwrap();
        let probe = dir.path().join("probe");
        if open(&probe, DiskIo::Direct, true).is_err() {
            eprintln!("skipped: {} refuses O_DIRECT", dir.path().display());
            return;
        }
        let tag = TensorTag { layer: 3, name: "x".into(), kind: TensorKind::Activation };
        let mut staging = Staging::default();
        // One piece, exactly two, and several with a short last one.
        for (k, n) in [(0, 5000), (1, 2 * CHUNK), (2, 3 * CHUNK + 4097)] {
            let data = pattern(n, k as u8);
            let path = dir.path().join(format!("{k}.spill"));
            write(&path, DiskIo::Direct, &tag, DType::Bf16, &data, &mut staging).unwrap();
            let mut out = vec![0u8; n];
            read(&path, DiskIo::Direct, &tag, DType::Bf16, as_unfilled(&mut out), &mut staging).unwrap();
            assert!(out == data, "{n} bytes differ");
            // A one-piece file needs one buffer; a longer one both.
            assert_eq!(staging.bufs.len(), if n <= CHUNK { 1 } else { DEPTH }, "every buffer back after {n} bytes");
            if k == 2 {
                // Cut in the middle of the third piece: an error naming truncation, and no buffer lost.
                let f = OpenOptions::new().write(true).open(&path).unwrap();
                f.set_len((format::HEADER_BYTES + 2 * CHUNK + 4096) as u64).unwrap();
                let e =
                    read(&path, DiskIo::Direct, &tag, DType::Bf16, as_unfilled(&mut out), &mut staging).unwrap_err();
                assert!(e.to_string().contains("truncated"), "{e}");
                assert_eq!(staging.bufs.len(), DEPTH);
            }
            assert_eq!(staging.mapped, staging.bufs.len(), "the same buffers, none mapped again");
        }
    }
}
