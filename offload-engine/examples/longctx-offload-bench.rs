//! `longctx-offload-bench`: offload and fetch bandwidth of each tier against the machine's own limits, measured
//! in the same run, on the same sizes, in the same directory.
//!
//! `cargo run --release -p longctx-offload --example longctx-offload-bench -- [--dir DIR] [--total-mib 1024]
//! [--tensor-mib 64] [--reps 3] [--workers 1]`
//!
//! Each pass moves `total` bytes as tensors of `tensor` bytes: offload all of them (timed until
//! `OffloadEngine::sync`: every copy has landed), then fetch them in reverse (timed until the last one is back;
//! each fetch prefetches the next). Figures are medians over the repetitions, after one untimed warm-up pass of
//! every row; engine and peer alternate which goes first in each repetition.
//!
//! - host (spares on): the host tier with `spare_bytes` covering every tensor, the steady state of a trainer that
//!   lets the engine keep allocations: offload is one copy into a pooled buffer, fetch one copy into a kept
//!   allocation. Peer: `memcpy` between buffers already touched, of the same sizes, on one thread. Every
//!   large buffer here, the peers' and the tensors', gets the `MADV_HUGEPAGE` advice the engine gives its own.
//! - host (spares on, mlock): the same with the pool page-locked (`Mlock`; skipped, saying so, where
//!   `RLIMIT_MEMLOCK` is below the pool): the locking happens in the warm-up pass, so the timed passes show
//!   that a locked pool costs nothing in steady state.
//! - host (spares off): every handed-over allocation is freed after its copy, every fetch allocates. Peers:
//!   `memcpy` out of a buffer that is then freed (offload), and `memcpy` into a fresh allocation (fetch).
//! - disk (direct): the disk tier with `O_DIRECT` (when the filesystem allows it), each worker copying through
//!   its 8 MiB aligned staging buffer and checksumming. Peer: a plain sequential `O_DIRECT` write and read of
//!   the same files in 8 MiB blocks from one aligned buffer (`dd oflag=direct` / `iflag=direct bs=8M`), with no
//!   copy and no checksum. The page cache is bypassed on both sides (the share of each file cached just before
//!   it is read, from `mincore`, is printed).
//! - disk (buffered): the disk tier with `direct_io(false)`: write, `fdatasync`, `POSIX_FADV_DONTNEED`, so its
//!   reads are cold. Peer: `write` + `fdatasync` (`dd conv=fsync`), then reads after `POSIX_FADV_DONTNEED`
//!   (cold, the comparable figures) and a read straight after writing (from the page cache, for reference only).
//!   A fetch returns a new allocation unless a spare is there, and filling fresh pages costs about as much as
//!   the read itself on a VM, so the cold read is timed both ways: into a fresh allocation per file (the peer of
//!   the engine without spares) and into one buffer already touched (the peer of the engine with spares
//!   covering every tensor, whose fetches reuse the offloaded tensors' allocations: one touched buffer per file,
//!   as the engine's spares are; the read into a single buffer reused for every file, partly warm in the
//!   caches and the TLB, is printed below the table).
//!
//! The `ratio` column is the median over the repetitions of engine / peer within each repetition (the two run
//! back to back, so a disk or a neighbour that changes speed between repetitions moves both). The goals are
//! >= 0.8 for both tiers.
//!
//! Two things make the engine's disk figures differ from the peer's by design: it `fallocate`s each file before
//! writing (a plain `O_DIRECT` write that extends a file allocates blocks write by write, and was the slower
//! one on ext4 here), and it removes each file after reading it on its reaper thread,
//! once the disk stops reading (in this benchmark: after the last fetch; the peer removes its files after its
//! timing too). The time that removal takes after each pass is printed apart.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use longctx_offload::{DiskIo, HostTensor, Mlock, OffloadEngine, OffloadError};

const BLOCK: usize = 8 << 20;
const GIB: f64 = (1u64 << 30) as f64;

struct Args {
    dir: PathBuf,
    total: usize,
    tensor: usize,
    reps: usize,
    workers: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args { dir: std::env::temp_dir(), total: 1024 << 20, tensor: 64 << 20, reps: 3, workers: 1 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let mib = |s: String| s.parse::<usize>().map(|m| m << 20).map_err(|e| format!("{s}: {e}"));
        match flag.as_str() {
            "--dir" => a.dir = value()?.into(),
            "--total-mib" => a.total = mib(value()?)?,
            "--tensor-mib" => a.tensor = mib(value()?)?,
            "--reps" => a.reps = value()?.parse().map_err(|e| format!("--reps: {e}"))?,
            "--workers" => a.workers = value()?.parse().map_err(|e| format!("--workers: {e}"))?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.tensor == 0 || a.total < a.tensor || a.reps == 0 || a.workers == 0 {
        return Err("need 0 < tensor <= total, reps >= 1, workers >= 1".into());
    }
    Ok(a)
}

fn gibs(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / GIB / t.as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `MADV_HUGEPAGE` on a buffer, as the engine does for its own large buffers, so that the peers' buffers and
/// the caller's tensors are backed like the engine's (on a VM, 4 KiB faults alone cap filling fresh memory at
/// about 1 GiB/s).
fn advise_huge(b: &mut [u8]) {
    let start = (b.as_ptr() as usize).next_multiple_of(4096);
    let end = (b.as_ptr() as usize + b.len()) & !4095;
    if end > start {
        // SAFETY: the range lies within `b`, which this process owns; the advice never changes its contents.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

/// A fresh buffer of `n` bytes with the huge-page advice, untouched.
fn fresh(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    advise_huge(&mut v);
    v
}

/// A buffer of `n` bytes with the huge-page advice, every page touched.
fn touched(n: usize) -> Vec<u8> {
    let mut v = fresh(n);
    v.fill(1);
    v
}

/// Tensors of `n` bytes (bf16, `n` even), every page touched.
fn make_tensors(k: usize, n: usize) -> Vec<HostTensor> {
    (0..k)
        .map(|i| {
            let mut v = vec![half::bf16::ZERO; n / 2];
            advise_huge(bytemuck::cast_slice_mut(&mut v));
            v.fill(half::bf16::from_bits((i % 251) as u16 + 1));
            HostTensor::bf16(v, [n / 2]).expect("dims match")
        })
        .collect()
}

/// One pass through the engine: (offload time, fetch time, the tensors back in their order).
fn engine_pass(
    engine: &OffloadEngine,
    tensors: Vec<HostTensor>,
) -> Result<(Duration, Duration, Vec<HostTensor>), OffloadError> {
    let t0 = Instant::now();
    let mut tickets = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.into_iter().enumerate() {
        tickets.push(engine.offload(i, "x", t)?);
    }
    engine.sync();
    let offload = t0.elapsed();
    let t1 = Instant::now();
    let mut back = Vec::with_capacity(tickets.len());
    while let Some(t) = tickets.pop() {
        back.push(engine.fetch(t)?);
    }
    let fetch = t1.elapsed();
    back.reverse();
    // Spill files are removed while the disk is not reading: after the last fetch here. Timed apart.
    let t2 = Instant::now();
    engine.sync();
    REMOVAL_TAIL.with(|t| t.set(t.get() + t2.elapsed()));
    Ok((offload, fetch, back))
}

thread_local! {
    /// Time `sync` took after each pass's fetches (removing the spill files), summed.
    static REMOVAL_TAIL: std::cell::Cell<Duration> = const { std::cell::Cell::new(Duration::ZERO) };
}

/// A page-aligned window of a `Vec`: what `O_DIRECT` needs, without `unsafe`.
struct Aligned {
    v: Vec<u8>,
    off: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Self {
        let v = vec![7u8; len + 4096];
        let off = v.as_ptr().align_offset(4096);
        Self { v, off, len }
    }
    fn get(&mut self) -> &mut [u8] {
        &mut self.v[self.off..self.off + self.len]
    }
}

fn open_direct(path: &Path, write: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    if write {
        o.write(true).create(true).truncate(true);
    } else {
        o.read(true);
    }
    o.custom_flags(libc::O_DIRECT).open(path)
}

fn fadvise_dontneed(f: &File) {
    // SAFETY: posix_fadvise on an open descriptor; no memory is passed.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// Share of `path`'s pages in the page cache, from `mincore` over a read-only mapping.
fn cached_fraction(path: &Path) -> io::Result<f64> {
    let f = File::open(path)?;
    let len = f.metadata()?.len() as usize;
    if len == 0 {
        return Ok(0.0);
    }
    // SAFETY: a shared read-only mapping of a file we keep open; checked against MAP_FAILED, unmapped below, and
    // never dereferenced (only `mincore` looks at it).
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let pages = len.div_ceil(4096);
    let mut vec = vec![0u8; pages];
    // SAFETY: `p` is a mapping of `len` bytes and `vec` has one byte per page of it.
    let rc = unsafe { libc::mincore(p, len, vec.as_mut_ptr()) };
    // SAFETY: exactly the mapping made above.
    unsafe { libc::munmap(p, len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(vec.iter().filter(|&&b| b & 1 == 1).count() as f64 / pages as f64)
}

/// The disk peers on the same files: direct write, direct read, buffered write + fdatasync, cold reads into one
/// touched buffer, into a touched buffer per file and into fresh allocations, the warm read, and the cached share
/// before the direct, the cold and the warm read.
struct DiskPeer {
    direct_w: Duration,
    direct_r: Duration,
    buf_w: Duration,
    cold_r: Duration,
    cold_each_r: Duration,
    cold_fresh_r: Duration,
    warm_r: Duration,
    cached: [f64; 3],
}

fn disk_peer(dir: &Path, src: &[HostTensor], direct: bool) -> io::Result<DiskPeer> {
    let files: Vec<PathBuf> = (0..src.len()).map(|i| dir.join(format!("peer-{i}.bin"))).collect();
    let n = src[0].size_bytes();
    let mut block = Aligned::new(BLOCK);
    // ext4 and XFS store what they are given: the contents do not change the speed.
    block.get().fill(0x5a);
    let (mut direct_w, mut direct_r, mut cached) = (Duration::ZERO, Duration::ZERO, [0.0; 3]);
    if direct {
        // dd oflag=direct bs=8M, one file per tensor.
        let t = Instant::now();
        for p in &files {
            let f = open_direct(p, true)?;
            for off in (0..n).step_by(BLOCK) {
                let len = BLOCK.min(n - off).next_multiple_of(4096);
                f.write_all_at(&block.get()[..len], off as u64)?;
            }
        }
        direct_w = t.elapsed();
        cached[0] = cached_fraction(&files[0])?;
        let t = Instant::now();
        for p in &files {
            let f = open_direct(p, false)?;
            for off in (0..n).step_by(BLOCK) {
                let len = BLOCK.min(n - off).next_multiple_of(4096);
                f.read_exact_at(&mut block.get()[..len], off as u64)?;
            }
        }
        direct_r = t.elapsed();
    }
    // dd conv=fsync: buffered writes straight from the tensor, then fdatasync.
    let t = Instant::now();
    for (p, s) in files.iter().zip(src) {
        let mut f = File::create(p)?;
        f.write_all(s.as_bytes())?;
        f.sync_data()?;
    }
    let buf_w = t.elapsed();
    let mut dst = vec![0u8; n];
    cached[2] = cached_fraction(&files[0])?;
    let t = Instant::now();
    for p in &files {
        File::open(p)?.read_exact(&mut dst)?;
    }
    let warm_r = t.elapsed();
    for p in &files {
        fadvise_dontneed(&File::open(p)?);
    }
    cached[1] = cached_fraction(&files[0])?;
    let t = Instant::now();
    for p in &files {
        File::open(p)?.read_exact(&mut dst)?;
    }
    let cold_r = t.elapsed();
    // The same cold read into a touched buffer per file, as a fetch with spares reuses the offloaded tensors'
    // own allocations: one buffer reused eight times stays partly in the caches and the TLB, which a fetch's
    // eight do not.
    for p in &files {
        fadvise_dontneed(&File::open(p)?);
    }
    let mut dsts: Vec<Vec<u8>> = files.iter().map(|_| touched(n)).collect();
    let t = Instant::now();
    for (p, d) in files.iter().zip(dsts.iter_mut()) {
        File::open(p)?.read_exact(d)?;
    }
    let cold_each_r = t.elapsed();
    drop(dsts);
    // The same cold read into a fresh allocation per file, as a fetch without spares returns.
    for p in &files {
        fadvise_dontneed(&File::open(p)?);
    }
    // Kept until the timing ends, as the fetched tensors are: each file's pages are new memory.
    let t = Instant::now();
    let mut kept = Vec::with_capacity(files.len());
    for p in &files {
        let mut out = fresh(n);
        File::open(p)?.read_exact(&mut out)?;
        kept.push(out);
    }
    let cold_fresh_r = t.elapsed();
    drop(kept);
    for p in &files {
        std::fs::remove_file(p)?;
    }
    Ok(DiskPeer { direct_w, direct_r, buf_w, cold_r, cold_each_r, cold_fresh_r, warm_r, cached })
}

fn fs_name(dir: &Path) -> String {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else { return "?".into() };
    // SAFETY: statfs is plain old data, zeroes are a valid value, and `c` is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; both live for the call.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return "?".into();
    }
    #[allow(clippy::unnecessary_cast)]
    match st.f_type as i64 {
        0xEF53 => "ext4".into(),
        0x0102_1994 => "tmpfs".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683E => "btrfs".into(),
        0x794C_7630 => "overlayfs".into(),
        t => format!("fs 0x{t:x}"),
    }
}

struct Row {
    tier: &'static str,
    dir: &'static str,
    engine: f64,
    peer: &'static str,
    peer_gibs: f64,
    /// Median over the repetitions of each one's engine / peer (the two ran back to back).
    ratio: f64,
}

/// The row for engine column `e` against peer column `p` of `samples` (one row of figures per repetition).
fn row<S: AsRef<[f64]>>(
    samples: &[S],
    tier: &'static str,
    dir: &'static str,
    e: usize,
    peer: &'static str,
    p: usize,
) -> Row {
    let col = |i: usize| median(samples.iter().map(|s| s.as_ref()[i]).collect());
    let ratio = median(samples.iter().map(|s| s.as_ref()[e] / s.as_ref()[p]).collect());
    Row { tier, dir, engine: col(e), peer, peer_gibs: col(p), ratio }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args().map_err(|e| {
        format!(
            "{e}\nusage: longctx-offload-bench [--dir DIR] [--total-mib N] [--tensor-mib N] [--reps N] [--workers N]"
        )
    })?;
    let k = args.total / args.tensor;
    let (n, total) = (args.tensor, k * args.tensor);
    std::fs::create_dir_all(&args.dir)?;
    let work = tempfile::tempdir_in(&args.dir)?;
    let probe = OffloadEngine::builder().disk_tier(work.path(), 1 << 20).build()?;
    let direct = probe.disk_io() == Some(DiskIo::Direct);
    drop(probe);
    println!(
        "longctx-offload-bench: {k} tensors x {} MiB = {} MiB per pass, {} worker(s), median of {} reps",
        n >> 20,
        total >> 20,
        args.workers,
        args.reps
    );
    println!(
        "dir {} ({}, O_DIRECT {})",
        args.dir.display(),
        fs_name(&args.dir),
        if direct { "accepted" } else { "refused: buffered" }
    );

    // Host tier.
    let host_engine = |spare: bool| {
        OffloadEngine::builder().host_tier(total as u64).workers(args.workers).spare_bytes(if spare {
            total as u64
        } else {
            0
        })
    };
    let spare_on = host_engine(true).build()?;
    let spare_off = host_engine(false).build()?;
    // The pool page-locked with `mlock` (the warm-up pass maps and locks it; later passes lock nothing), where
    // the process may lock that much.
    let locked = match host_engine(true).page_lock(Mlock).build() {
        Ok(e) => Some(e),
        Err(e @ OffloadError::PageLockBudget { .. }) => {
            println!("host (page-locked) skipped: {e}");
            None
        }
        Err(e) => return Err(e.into()),
    };
    let mut tensors = make_tensors(k, n);
    let mut dst_warm: Vec<Vec<u8>> = (0..k)
        .map(|_| {
            let mut v = fresh(n);
            v.fill(1);
            v
        })
        .collect();
    let mut samples: Vec<[f64; 9]> = Vec::new();
    for rep in 0..=args.reps {
        let mut s = [0.0; 9];
        let peers = |s: &mut [f64; 9], dst_warm: &mut Vec<Vec<u8>>, tensors: &[HostTensor]| {
            // memcpy between touched buffers.
            let t = Instant::now();
            for (d, x) in dst_warm.iter_mut().zip(tensors) {
                d.copy_from_slice(x.as_bytes());
            }
            s[0] = gibs(total, t.elapsed());
            // memcpy into a fresh allocation (fetch without spares) ...
            let t = Instant::now();
            let fresh: Vec<Vec<u8>> = tensors
                .iter()
                .map(|x| {
                    let mut v = fresh(n);
                    v.copy_from_slice(x.as_bytes());
                    v
                })
                .collect();
            s[1] = gibs(total, t.elapsed());
            // ... and out of a buffer that is then freed (offload without spares).
            let t = Instant::now();
            for (d, v) in dst_warm.iter_mut().zip(fresh) {
                d.copy_from_slice(&v);
                drop(v);
            }
            s[2] = gibs(total, t.elapsed());
        };
        let peer_first = rep % 2 == 1;
        if peer_first {
            peers(&mut s, &mut dst_warm, &tensors);
        }
        let (o, f, back) = engine_pass(&spare_on, tensors)?;
        s[3] = gibs(total, o);
        s[4] = gibs(total, f);
        let (o, f, back) = engine_pass(&spare_off, back)?;
        s[5] = gibs(total, o);
        s[6] = gibs(total, f);
        tensors = back;
        if let Some(locked) = &locked {
            let (o, f, back) = engine_pass(locked, tensors)?;
            s[7] = gibs(total, o);
            s[8] = gibs(total, f);
            tensors = back;
        }
        if !peer_first {
            peers(&mut s, &mut dst_warm, &tensors);
        }
        // Repetition 0 is the warm-up: pools mapped, spares filled, pages touched.
        if rep > 0 {
            samples.push(s);
        }
    }
    let mut rows = vec![
        row(&samples, "host (spares on)", "offload", 3, "memcpy, touched buffers", 0),
        row(&samples, "host (spares on)", "fetch", 4, "memcpy, touched buffers", 0),
        row(&samples, "host (spares off)", "offload", 5, "memcpy, then free the source", 2),
        row(&samples, "host (spares off)", "fetch", 6, "memcpy into a fresh allocation", 1),
    ];
    if locked.is_some() {
        rows.push(row(&samples, "host (spares on, mlock)", "offload", 7, "memcpy, touched buffers", 0));
        rows.push(row(&samples, "host (spares on, mlock)", "fetch", 8, "memcpy, touched buffers", 0));
    }
    let host_wait = spare_on.stats().fetch_wait;
    drop((spare_on, spare_off, locked, dst_warm));

    // Disk tier: the engine in each mode the filesystem allows, beside the peers on the same directory.
    // (direct I/O, spares): the buffered mode also with spares covering every tensor, so its fetches read into
    // allocations already touched, like the peer's read into one buffer.
    let disk_engine = |(direct_io, spare): (bool, bool)| {
        OffloadEngine::builder()
            .disk_tier(work.path(), (total + k * 8192) as u64)
            .workers(args.workers)
            .direct_io(direct_io)
            .spare_bytes(if spare { total as u64 } else { 0 })
            .build()
    };
    let modes: Vec<(bool, bool)> =
        if direct { vec![(true, false), (false, false), (false, true)] } else { vec![(false, false), (false, true)] };
    REMOVAL_TAIL.with(|t| t.set(Duration::ZERO));
    let mut cached = [0.0f64; 3];
    let mut disk_samples: Vec<Vec<f64>> = Vec::new();
    let mut disk_wait = Duration::ZERO;
    for rep in 0..=args.reps {
        let mut s = Vec::new();
        let peer_first = rep % 2 == 1;
        let mut peer = None;
        if peer_first {
            peer = Some(disk_peer(work.path(), &tensors, direct)?);
        }
        for &m in &modes {
            let engine = disk_engine(m)?;
            let (o, f, back) = engine_pass(&engine, tensors)?;
            disk_wait += engine.stats().fetch_wait;
            tensors = back;
            s.push(gibs(total, o));
            s.push(gibs(total, f));
        }
        if !peer_first {
            peer = Some(disk_peer(work.path(), &tensors, direct)?);
        }
        let p = peer.ok_or("no peer run")?;
        cached = p.cached;
        s.extend(
            [p.direct_w, p.direct_r, p.buf_w, p.cold_r, p.warm_r, p.cold_fresh_r, p.cold_each_r]
                .map(|t| gibs(total, t)),
        );
        if rep > 0 {
            disk_samples.push(s);
        }
    }
    let e = 2 * modes.len();
    let p_warm = median(disk_samples.iter().map(|s| s[e + 4]).collect());
    let mut i = 0;
    if direct {
        rows.push(row(&disk_samples, "disk (direct)", "offload", 0, "O_DIRECT write, 8 MiB blocks", e));
        rows.push(row(&disk_samples, "disk (direct)", "fetch", 1, "O_DIRECT read, 8 MiB blocks", e + 1));
        i = 2;
    }
    rows.push(row(&disk_samples, "disk (buffered)", "offload", i, "write + fdatasync", e + 2));
    rows.push(row(&disk_samples, "disk (buffered)", "fetch", i + 1, "cold read, fresh allocation", e + 5));
    rows.push(row(&disk_samples, "disk (buf, spares)", "fetch", i + 3, "cold read, touched buffers", e + 6));
    let one_buffer = median(disk_samples.iter().map(|s| s[e + 3]).collect());

    println!();
    println!(
        "{:<18} {:<8} {:>12}   {:<32} {:>10} {:>6}",
        "tier", "", "engine GiB/s", "peer (same run, sizes, dir)", "peer GiB/s", "ratio"
    );
    for r in &rows {
        println!(
            "{:<18} {:<8} {:>12.2}   {:<32} {:>10.2} {:>6.2}",
            r.tier, r.dir, r.engine, r.peer, r.peer_gibs, r.ratio
        );
    }
    println!();
    println!(
        "page cache: share of a peer file cached just before its read: O_DIRECT read {:.0}% (bypassed either way), \
         read after FADV_DONTNEED {:.0}%, read right after writing {:.0}% ({:.2} GiB/s: the page cache, not the disk)",
        cached[0] * 100.0,
        cached[1] * 100.0,
        cached[2] * 100.0,
        p_warm
    );
    println!(
        "cold read into one touched buffer reused for every file: {one_buffer:.2} GiB/s (partly cache- and \
         TLB-warm; no fetch reads into the same memory twice in a row)"
    );
    println!(
        "exposed fetch wait, all passes: host (spares on) {:.3} s, disk {:.3} s",
        host_wait.as_secs_f64(),
        disk_wait.as_secs_f64()
    );
    let passes = (args.reps + 1) * modes.len();
    println!(
        "disk spill files removed after the fetches (not in the fetch figures): {:.3} s per {} MiB pass",
        REMOVAL_TAIL.with(|t| t.get()).as_secs_f64() / passes as f64,
        total >> 20
    );
    Ok(())
}
