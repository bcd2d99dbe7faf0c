//! `longctx-p2p-bench`: bandwidth and latency of the communicator against the machine's limits.
//!
//! Threads (one process, 2 ranks):   `cargo run --release -p longctx-p2p --example longctx-p2p-bench`
//! UCX (2 processes, `ucx` feature): `cargo build --release -p longctx-p2p --features ucx --example longctx-p2p-bench`
//!                                   then `target/release/longctx-launch --nproc 2 -- target/release/examples/longctx-p2p-bench`
//!
//! For each message size (4 KiB .. 256 MiB) it measures, between ranks 0 and 1:
//! - ring: `sendrecv` ring shift, GiB/s per rank and direction (both directions in flight);
//! - send: blocking `send`/`recv` stream 0 -> 1, GiB/s: one message at a time, so each pays a full hand-off;
//! - send xW: the same stream with a window of W messages in flight on both sides (`isend`/`irecv` into W
//!   receive buffers, W = 16 up to 4 MiB, fewer above so the window stays within 64 MiB), the way OSU's `osu_bw`
//!   and `ucx_perftest -t tag_bw -O W` measure bandwidth. One difference: perftest receives every message of the
//!   window into one buffer, which only a benchmark that throws the data away can do (and Rust's borrows
//!   forbid); with W buffers a 4 MiB window covers 64 MiB, which over TCP ran at 3.3-3.7 GiB/s against 5.3-6.1
//!   with one buffer, in a plain UCX program as in ours (`bench/ucx_tag_stream.c`);
//! - send W→1: the sender keeps W `isend`s in flight (a sliding window), the receiver takes one message at a time
//!   with a blocking `recv` into one buffer: a sender running ahead of a receiver that consumes each message
//!   before it takes the next. In both windowed columns hand-offs overlap copies instead of adding to them;
//! - lat: ping-pong, half round trip in µs;
//! - all_reduce (f32 sum) bus bandwidth: bytes * 2(n-1)/n / time;
//! - hidden: the ring shift posted with `isendrecv`, then twice its own time of busy compute on the rank's
//!   thread, then `wait`: the share of the shift's time that no longer shows in the wait. This is what ring
//!   attention gets from posting the next block early. Threads: ~0 by design (the copy is the transfer, done by
//!   the waiting rank, and a spare core would be needed to hide it), except that a message under 16 KiB that is
//!   already there when its receive is posted is copied inside `isendrecv`; UCX: the process's progress thread
//!   moves the message during the compute (`LONGCTX_UCX_PROGRESS=0` turns it off, for comparison);
//! - peer: `memcpy` of the same size on one thread in the same run (threads); for UCX, when it is installed,
//!   `ucx_perftest -t tag_bw` between two processes, twice: with `-O 1` (one send and one receive in flight at a
//!   time, as our `send`) and with `-O W` (W of each, as our `send xW`); and `bench/ucx_tag_stream.c`, a plain
//!   UCX tag stream with W sends and W receives in flight, each receive into its own buffer as ours (the bench
//!   compiles it with `cc` against `pkg-config ucx` when both are there);
//! - memcpy x2 (threads): both ranks `memcpy` their own buffers of the size at once, GiB/s per thread. A ring
//!   shift does exactly this much copying (each rank copies one message, both at once), so this is its ceiling on
//!   the machine as it is during the run: below the one-thread peer when the two copies compete for cache and
//!   memory bandwidth, or for the cores when other processes run.
//! - hand-off floor (threads): the blocking stream with nothing but the hand-off a single-copy transport cannot
//!   avoid. Two threads share one flag line each way: the sender publishes message `i`, the receiver (already
//!   spinning on it) copies the bytes with `memcpy` and publishes `i` back, the sender spins until it sees it.
//!   No matching, tags, timeouts or completions: two cache-line trips between the cores per message plus the
//!   copy, the fastest any blocking send/recv between two threads can go here. Where it is far below `memcpy`
//!   (small messages) the trips, not the copy, bound every transport;
//! - ring fwd: the ring shift as ring attention uses it, each step sending the block the step before received
//!   (two buffers per rank, swapped every step), so every message was just written by the sender's core. The
//!   `ring` column sends one unchanged buffer, whose lines the copier may already hold;
//! - ring floor (threads): the same for the ring shift. Each of two threads publishes step `i` (its send buffer
//!   is ready), spins until the other has too, copies the other's send buffer into its receive buffer with
//!   `memcpy`, publishes that it has, and spins until the other has copied as well (only then may a blocking
//!   shift return: its send buffer is free again). Both copy at once, as in the ring shift. `ring fwd floor`
//!   is the same with forwarding;
//! - ratios (threads): `send / peer` and `ring / peer` to one thread's `memcpy`, `send / floor` to the hand-off
//!   floor, `ring / ring floor` and `ring fwd / its floor` to the ring floors.
//!
//! Threads, when `ucx_perftest` is installed: a second table sets the threads transport's streams beside the
//! same streams between two processes of this machine over UCX's shared memory (`ucx_perftest -t tag_bw` with
//! `-O 1` and `-O W`, UCX's choice of transports, sizes up to 1 MiB): another engineered transport moving the
//! same messages between the same two cores. It is not a ceiling (it copies twice for small messages, through
//! its shared FIFO), but it shows what a tuned transport reaches where `memcpy` is out of reach.
//!
//! Every timed loop first runs a tenth of its iterations (at least one) untimed.
//!
//! Set `LONGCTX_BENCH_MAX` (bytes) to stop at a smaller size, `LONGCTX_BENCH_MIN` to start at a larger one,
//! `LONGCTX_BENCH_WINDOW` to change W's upper bound (16).
//! `LONGCTX_BENCH_ROUNDS=R` runs the sweep R times (UCX: ours, then `ucx_perftest`, per round) and prints the
//! medians, with each ratio to a peer as the median of each round's paired ratio: over loopback TCP a single
//! `ucx_perftest` run at 1 MiB was seen anywhere from 2.9 to 7.2 GiB/s on one machine within minutes.

use std::process::Command;
use std::time::{Duration, Instant};

use longctx_p2p::{CommError, Communicator, ReduceOp, ThreadWorld};

#[derive(Debug, Clone, Copy, Default)]
struct Row {
    bytes: usize,
    ring_gibs: f64,
    send_gibs: f64,
    window: usize,
    window_gibs: f64,
    window1_gibs: f64,
    lat_us: f64,
    allreduce_busbw: f64,
    hidden_pct: f64,
    memcpy_gibs: f64,
    memcpy2_gibs: f64,
    floor_gibs: f64,
    ring_floor_gibs: f64,
    ring_fwd_gibs: f64,
    ring_fwd_floor_gibs: f64,
}

const GIB: f64 = (1u64 << 30) as f64;
/// Messages in flight in the windowed stream, and the most bytes the window may hold.
const WINDOW: usize = 16;
const WINDOW_BYTES: usize = 64 << 20;

fn sizes() -> Vec<usize> {
    let env = |name: &str, default: usize| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    let (min, max) = (env("LONGCTX_BENCH_MIN", 0), env("LONGCTX_BENCH_MAX", 256 << 20));
    (0..).map(|i| 4096usize << (2 * i)).take_while(|&s| s <= max).filter(|&s| s >= min).collect()
}

/// W, the messages in flight in the windowed streams of `bytes`-byte messages.
fn window(bytes: usize) -> usize {
    let max_window = std::env::var("LONGCTX_BENCH_WINDOW").ok().and_then(|v| v.parse().ok()).unwrap_or(WINDOW);
    (WINDOW_BYTES / bytes.max(1)).clamp(1, max_window.max(1))
}

/// Iterations so each measurement moves about 2 GiB, within [3, 20000].
fn iters(bytes: usize) -> usize {
    ((2usize << 30) / bytes.max(1)).clamp(3, 20_000)
}

/// Runs `f` `it` times after a warm-up of a tenth as many (at least one) and a barrier; returns seconds per
/// iteration (max over ranks). With a single warm-up call the first size of a round (4 KiB, right after the rank
/// threads start) read anywhere from 1.4 to 5.9 GiB/s in the ring column from run to run, against 4.6-5.5 in
/// every run of a steady loop.
fn timed(c: &Communicator, it: usize, mut f: impl FnMut() -> Result<(), CommError>) -> Result<f64, CommError> {
    for _ in 0..(it / 10).max(1) {
        f()?;
    }
    c.barrier()?;
    let t0 = Instant::now();
    for _ in 0..it {
        f()?;
    }
    let mut t = [t0.elapsed().as_secs_f64() / it as f64];
    c.all_reduce(&mut t, ReduceOp::Max)?;
    Ok(t[0])
}

/// `len` bytes filled with `fill`, starting on a page boundary inside `buf` (which is resized to hold them).
///
/// The `memcpy` peer copies between two such buffers. Two same-sized heap blocks of under 128 KiB come out of
/// `malloc` with the second 16 bytes past the first modulo 4 KiB, and with the destination 1 to 31 bytes past
/// the source modulo 4 KiB glibc's `rep movsb` path runs at about 2 GiB/s on this Zen 3 machine, against
/// 30+ GiB/s for any other offset (`copy.rs`). Measured that way the peer was the CPU's pathology, not `memcpy`.
fn page_aligned(buf: &mut Vec<u8>, len: usize, fill: u8) -> &mut [u8] {
    buf.clear();
    buf.resize(len + 4096, fill);
    let off = buf.as_ptr().align_offset(4096);
    &mut buf[off..off + len]
}

/// Seconds per message of the W→1 stream (see the module docs): rank 0 keeps `window` sends in flight, rank 1
/// receives them one at a time (max over ranks, after one warm-up message and a barrier).
fn window_to_one(c: &Communicator, it: usize, window: usize, send: &[u8], recv: &mut [u8]) -> Result<f64, CommError> {
    match c.rank() {
        0 => c.send(1, 4, send)?,
        1 => c.recv(0, 4, recv)?,
        _ => {}
    }
    c.barrier()?;
    let t0 = Instant::now();
    match c.rank() {
        0 => c.scope(|s| {
            let mut in_flight = std::collections::VecDeque::with_capacity(window);
            for _ in 0..it {
                if in_flight.len() == window {
                    in_flight.pop_front().map_or(Ok(()), |q: longctx_p2p::Request<'_>| q.wait())?;
                }
                in_flight.push_back(s.isend(1, 4, send)?);
            }
            in_flight.into_iter().try_for_each(|q| q.wait())
        })?,
        1 => (0..it).try_for_each(|_| c.recv(0, 4, recv))?,
        _ => {}
    }
    let mut t = [t0.elapsed().as_secs_f64() / it as f64];
    c.all_reduce(&mut t, ReduceOp::Max)?;
    Ok(t[0])
}

/// Seconds per ring shift spent in `wait` when the shift is posted, then `compute` seconds of busy work run on
/// the rank's thread, then waited for (max over ranks).
fn exposed_wait(c: &Communicator, it: usize, send: &[u8], recv: &mut [u8], compute: f64) -> Result<f64, CommError> {
    let compute = Duration::from_secs_f64(compute);
    c.scope(|s| s.isendrecv(send, &mut *recv)?.wait())?;
    c.barrier()?;
    let mut waited = 0.0;
    for _ in 0..it {
        c.scope(|s| {
            let req = s.isendrecv(send, &mut *recv)?;
            let t = Instant::now();
            while t.elapsed() < compute {
                std::hint::spin_loop();
            }
            let t = Instant::now();
            req.wait()?;
            waited += t.elapsed().as_secs_f64();
            Ok::<(), CommError>(())
        })?;
    }
    let mut t = [waited / it as f64];
    c.all_reduce(&mut t, ReduceOp::Max)?;
    Ok(t[0])
}

fn measure(c: &Communicator, with_memcpy: bool) -> Result<Vec<Row>, CommError> {
    let (r, n) = (c.rank(), c.world_size());
    let mut rows = Vec::new();
    for bytes in sizes() {
        let it = iters(bytes);
        let send = vec![r as u8 + 1; bytes];
        let mut recv = vec![0u8; bytes];
        let ring = timed(c, it, || c.sendrecv(&send, &mut recv))?;
        // Forwarding: each step sends what the step before received (ring attention's pattern).
        let (mut fwd_send, mut fwd_recv) = (send.clone(), vec![0u8; bytes]);
        let ring_fwd = timed(c, it, || {
            c.sendrecv(&fwd_send, &mut fwd_recv)?;
            std::mem::swap(&mut fwd_send, &mut fwd_recv);
            Ok(())
        })?;
        drop((fwd_send, fwd_recv));
        let stream = timed(c, it, || match r {
            0 => c.send(1, 1, &send),
            1 => c.recv(0, 1, &mut recv),
            _ => Ok(()),
        })?;
        let window = window(bytes);
        let mut recv_w: Vec<Vec<u8>> = (0..if r == 1 { window } else { 0 }).map(|_| vec![0u8; bytes]).collect();
        let windowed = timed(c, it.div_ceil(window), || {
            c.scope(|s| {
                let reqs = match r {
                    0 => (0..window).map(|_| s.isend(1, 3, &send)).collect::<Result<Vec<_>, _>>()?,
                    1 => recv_w.iter_mut().map(|b| s.irecv(0, 3, b)).collect::<Result<Vec<_>, _>>()?,
                    _ => Vec::new(),
                };
                reqs.into_iter().try_for_each(|q| q.wait())
            })
        })? / window as f64;
        drop(recv_w);
        let window1 = window_to_one(c, it, window, &send, &mut recv)?;
        let lat_it = it.min(5000);
        let pingpong = timed(c, lat_it, || match r {
            0 => c.send(1, 2, &send).and_then(|()| c.recv(1, 2, &mut recv)),
            1 => c.recv(0, 2, &mut recv).and_then(|()| c.send(0, 2, &send)),
            _ => Ok(()),
        })?;
        let mut acc = vec![1.0f32; bytes / 4];
        let ar = timed(c, it, || c.all_reduce(&mut acc, ReduceOp::Sum))?;
        let exposed = exposed_wait(c, (it / 4).max(3), &send, &mut recv, 2.0 * ring)?;
        let (mut memcpy, mut memcpy2) = (0.0, 0.0);
        if with_memcpy {
            // The peer: one thread copying the same bytes, with the other rank idle at the barrier.
            let t = if r == 0 {
                let (mut src_buf, mut dst_buf) = (Vec::new(), Vec::new());
                let (src, dst) = (page_aligned(&mut src_buf, bytes, 1), page_aligned(&mut dst_buf, bytes, 0));
                let src = &*src;
                dst.copy_from_slice(src);
                // At least 100 ms of copying, so small sizes are not lost in timer noise.
                let (t0, mut done) = (Instant::now(), 0usize);
                while done < it || t0.elapsed().as_secs_f64() < 0.1 {
                    dst.copy_from_slice(std::hint::black_box(src));
                    std::hint::black_box(&mut *dst);
                    done += 1;
                }
                t0.elapsed().as_secs_f64() / done as f64
            } else {
                0.0
            };
            let mut t1 = [t];
            c.all_reduce(&mut t1, ReduceOp::Max)?;
            memcpy = bytes as f64 / t1[0].max(f64::MIN_POSITIVE) / GIB;
            // Both ranks copying at once, the same number of times (about 100 ms) so the copies overlap
            // throughout; each its own buffers, as each rank of a ring writes its own receive buffer.
            let n2 = ((0.1 / t1[0].max(1e-9)) as usize).max(it);
            let (mut src_buf, mut dst_buf) = (Vec::new(), Vec::new());
            let (src, dst) = (page_aligned(&mut src_buf, bytes, 1), page_aligned(&mut dst_buf, bytes, 0));
            let src = &*src;
            dst.copy_from_slice(src);
            c.barrier()?;
            let t0 = Instant::now();
            for _ in 0..n2 {
                dst.copy_from_slice(std::hint::black_box(src));
                std::hint::black_box(&mut *dst);
            }
            let mut t2 = [t0.elapsed().as_secs_f64() / n2 as f64];
            c.all_reduce(&mut t2, ReduceOp::Max)?;
            memcpy2 = bytes as f64 / t2[0].max(f64::MIN_POSITIVE) / GIB;
        }
        rows.push(Row {
            bytes,
            ring_gibs: bytes as f64 / ring / GIB,
            send_gibs: bytes as f64 / stream / GIB,
            window,
            window_gibs: bytes as f64 / windowed / GIB,
            window1_gibs: bytes as f64 / window1 / GIB,
            lat_us: pingpong / 2.0 * 1e6,
            allreduce_busbw: bytes as f64 * 2.0 * (n - 1) as f64 / n as f64 / ar / GIB,
            hidden_pct: 100.0 * (1.0 - exposed / ring).clamp(0.0, 1.0),
            memcpy_gibs: memcpy,
            memcpy2_gibs: memcpy2,
            floor_gibs: f64::NAN,
            ring_floor_gibs: f64::NAN,
            ring_fwd_gibs: bytes as f64 / ring_fwd / GIB,
            ring_fwd_floor_gibs: f64::NAN,
        });
    }
    Ok(rows)
}

/// The hand-off floor (see the module docs): GiB/s of a blocking stream of `bytes`-byte messages between two
/// threads that share nothing but one flag line each way, the receiver copying with `memcpy`. At least 100 ms of
/// messages, like the `memcpy` peer: a few milliseconds of them varied by 2x from run to run.
fn handoff_floor(bytes: usize) -> f64 {
    use crossbeam::utils::CachePadded;
    use std::sync::atomic::{AtomicUsize, Ordering};
    /// What the sender publishes instead of a message number to end the stream.
    const STOP: usize = usize::MAX;
    let it = iters(bytes);
    let (sent, copied) = (CachePadded::new(AtomicUsize::new(0)), CachePadded::new(AtomicUsize::new(0)));
    let (mut src_buf, mut dst_buf) = (Vec::new(), Vec::new());
    let src = &*page_aligned(&mut src_buf, bytes, 1);
    let dst = page_aligned(&mut dst_buf, bytes, 0);
    let spin_until = |a: &AtomicUsize, v: usize| loop {
        let x = a.load(Ordering::Acquire);
        if x == v || x == STOP {
            return x;
        }
        std::hint::spin_loop();
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 1.. {
                if spin_until(&sent, i) == STOP {
                    return;
                }
                dst.copy_from_slice(std::hint::black_box(src));
                std::hint::black_box(&mut *dst);
                copied.store(i, Ordering::Release);
            }
        });
        // One warm-up message, then the timed ones.
        sent.store(1, Ordering::Release);
        spin_until(&copied, 1);
        let t0 = Instant::now();
        let mut i = 1;
        while i <= it || t0.elapsed().as_secs_f64() < 0.1 {
            i += 1;
            sent.store(i, Ordering::Release);
            spin_until(&copied, i);
        }
        let t = t0.elapsed().as_secs_f64() / (i - 1) as f64;
        sent.store(STOP, Ordering::Release);
        bytes as f64 / t / GIB
    })
}

/// The ring floor (see the module docs): GiB/s per thread and direction of a blocking ring shift of `bytes`-byte
/// messages between two threads that share nothing but two flag lines each, both copying with `memcpy` at once.
/// `forward`: each thread sends at step `i + 1` the buffer it received at step `i` (two buffers each, swapped
/// every step), so what the other copies was just written by this thread's core; else every step sends the same
/// buffer. At least 100 ms of steps.
fn ring_floor(bytes: usize, forward: bool) -> f64 {
    use crossbeam::utils::CachePadded;
    use std::sync::atomic::{AtomicUsize, Ordering};
    /// The threads' buffers: `[thread][k]`, each `bytes` long, page-aligned inside `_storage`.
    struct Buffers {
        ptrs: [[*mut u8; 2]; 2],
        _storage: Vec<Vec<u8>>,
    }
    // SAFETY: the step protocol below gives every buffer one writer at a time and no reader while it is written.
    unsafe impl Sync for Buffers {}
    let it = iters(bytes);
    let flags = || [CachePadded::new(AtomicUsize::new(0)), CachePadded::new(AtomicUsize::new(0))];
    // Per thread: the step whose send buffer is ready, and the step whose message it has copied.
    let (ready, copied) = (flags(), flags());
    // The last step thread 0 runs, set before that step starts.
    let last = CachePadded::new(AtomicUsize::new(usize::MAX));
    let spin_until = |a: &AtomicUsize, v: usize| {
        while a.load(Ordering::Acquire) < v {
            std::hint::spin_loop();
        }
    };
    let mut storage: Vec<Vec<u8>> = (0..4).map(|_| Vec::new()).collect();
    let mut ptrs = [[std::ptr::null_mut(); 2]; 2];
    for (j, buf) in storage.iter_mut().enumerate() {
        ptrs[j / 2][j % 2] = page_aligned(buf, bytes, (j / 2) as u8 + 1).as_mut_ptr();
    }
    let bufs = Buffers { ptrs, _storage: storage };
    // Captured whole (a closure would otherwise capture the field `ptrs` alone, which is not `Sync`).
    let bufs = &bufs;
    // Which of thread `t`'s buffers it sends at step `i` (it receives into the other).
    let sent = |i: usize| if forward { i % 2 } else { 0 };
    let step = |t: usize, i: usize| {
        ready[t].store(i, Ordering::Release);
        spin_until(&ready[1 - t], i);
        let (src, dst) = (bufs.ptrs[1 - t][sent(i)], bufs.ptrs[t][1 - sent(i)]);
        // SAFETY: `src` is the other thread's send buffer of step `i`, which it does not write before we publish
        // `copied` for this step; `dst` is ours and nobody reads it during this step (the other thread read it,
        // as our send buffer of step `i - 1`, before it published `copied` for that step, which we waited for).
        unsafe { std::ptr::copy_nonoverlapping(std::hint::black_box(src as *const u8), dst, bytes) };
        std::hint::black_box(dst);
        copied[t].store(i, Ordering::Release);
        spin_until(&copied[1 - t], i);
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            // Follows thread 0 step by step. Thread 0 sets `last` before it publishes that step, and this thread
            // cannot finish the step before thread 0 has copied, so it reads the final value after it.
            for i in 1.. {
                step(1, i);
                if i >= last.load(Ordering::Acquire) {
                    return;
                }
            }
        });
        step(0, 1); // warm-up
        let t0 = Instant::now();
        let mut i = 1;
        loop {
            i += 1;
            let done = i > it && t0.elapsed().as_secs_f64() >= 0.1;
            if done {
                last.store(i, Ordering::Release);
            }
            step(0, i);
            if done {
                break;
            }
        }
        bytes as f64 / (t0.elapsed().as_secs_f64() / (i - 1) as f64) / GIB
    })
}

/// The plain UCX peer (`bench/ucx_tag_stream.c`), compiled with `cc` against the system's UCX (`pkg-config ucx`)
/// into the temporary directory; `None` (its column then reads n/a) if either is missing or the build fails.
fn plain_ucx_program() -> Option<std::path::PathBuf> {
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/ucx_tag_stream.c");
    let flags = Command::new("pkg-config").args(["--cflags", "--libs", "ucx"]).output().ok()?;
    if !flags.status.success() {
        return None;
    }
    let flags = String::from_utf8(flags.stdout).ok()?;
    let bin = std::env::temp_dir().join(format!("longctx-ucx_tag_stream-{}", std::process::id()));
    let built = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&bin)
        .arg(src)
        .args(flags.split_whitespace())
        .stderr(std::process::Stdio::null())
        .status()
        .ok()?;
    built.success().then_some(bin)
}

/// The plain UCX peer with `window` sends and `window` receives in flight, each receive into its own buffer (as
/// our `send xW`); the receiver's GiB/s, or `None` if it fails.
fn plain_ucx(program: &std::path::Path, bytes: usize, window: usize) -> Option<f64> {
    let n = iters(bytes).min(1000).to_string();
    let w = window.to_string();
    let out = Command::new(program).args([bytes.to_string(), w.clone(), w, n]).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.contains("(receiver)"))?;
    line.split_whitespace().rev().nth(1)?.parse().ok()
}

/// `ucx_perftest -t tag_bw` between two local processes with `outstanding` sends and receives in flight (`-O`);
/// GiB/s, or `None` if it is not installed or fails.
fn ucx_perftest(bytes: usize, outstanding: usize) -> Option<f64> {
    let n = iters(bytes).min(1000).to_string();
    let s = bytes.to_string();
    let o = outstanding.to_string();
    let port = "13437";
    let mut server = Command::new("ucx_perftest")
        .args(["-t", "tag_bw", "-s", &s, "-n", &n, "-O", &o, "-p", port])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(std::time::Duration::from_millis(300));
    let out = Command::new("ucx_perftest")
        .args(["127.0.0.1", "-t", "tag_bw", "-s", &s, "-n", &n, "-O", &o, "-p", port])
        .output();
    let _ = server.wait();
    let out = out.ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.trim_start().starts_with("Final:"))?;
    let mibs: f64 = line.split_whitespace().nth(6)?.parse().ok()?;
    Some(mibs / 1024.0)
}

fn size_name(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else {
        format!("{} KiB", b >> 10)
    }
}

/// `LONGCTX_BENCH_ROUNDS` (default 1): how many times the whole sweep (ours, then the peer) runs.
fn rounds() -> usize {
    std::env::var("LONGCTX_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(1).max(1)
}

/// Median of `x` (NaN for none).
fn median(mut x: Vec<f64>) -> f64 {
    x.retain(|v| v.is_finite());
    if x.is_empty() {
        return f64::NAN;
    }
    x.sort_by(f64::total_cmp);
    let n = x.len();
    if n % 2 == 1 {
        x[n / 2]
    } else {
        0.5 * (x[n / 2 - 1] + x[n / 2])
    }
}

/// Per size, the median over rounds of every column.
fn medians(rounds: &[Vec<Row>]) -> Vec<Row> {
    (0..rounds[0].len())
        .map(|i| {
            let col = |f: fn(&Row) -> f64| median(rounds.iter().map(|r| f(&r[i])).collect());
            Row {
                bytes: rounds[0][i].bytes,
                window: rounds[0][i].window,
                ring_gibs: col(|r| r.ring_gibs),
                send_gibs: col(|r| r.send_gibs),
                window_gibs: col(|r| r.window_gibs),
                window1_gibs: col(|r| r.window1_gibs),
                lat_us: col(|r| r.lat_us),
                allreduce_busbw: col(|r| r.allreduce_busbw),
                hidden_pct: col(|r| r.hidden_pct),
                memcpy_gibs: col(|r| r.memcpy_gibs),
                memcpy2_gibs: col(|r| r.memcpy2_gibs),
                floor_gibs: col(|r| r.floor_gibs),
                ring_floor_gibs: col(|r| r.ring_floor_gibs),
                ring_fwd_gibs: col(|r| r.ring_fwd_gibs),
                ring_fwd_floor_gibs: col(|r| r.ring_fwd_floor_gibs),
            }
        })
        .collect()
}

/// Per size, the median over rounds of a peer measured once per round.
fn peer_medians(peers: &[Vec<f64>]) -> Vec<f64> {
    (0..peers.first().map_or(0, Vec::len)).map(|i| median(peers.iter().map(|p| p[i]).collect())).collect()
}

/// Per size, the median over rounds of the paired ratio `f(ours) / peer`: each round's figure against the peer
/// measured in the same round, so a drift of the machine between rounds cancels.
fn paired(rounds: &[Vec<Row>], peers: &[Vec<f64>], f: fn(&Row) -> f64) -> Vec<f64> {
    (0..rounds[0].len()).map(|i| median(rounds.iter().zip(peers).map(|(r, p)| f(&r[i]) / p[i]).collect())).collect()
}

/// As [`paired`], for a peer measured in the same round and stored in the row (`peer`).
fn paired_in_row(rounds: &[Vec<Row>], f: fn(&Row) -> f64, peer: fn(&Row) -> f64) -> Vec<f64> {
    (0..rounds[0].len()).map(|i| median(rounds.iter().map(|r| f(&r[i]) / peer(&r[i])).collect())).collect()
}

fn fmt_or_na(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.2}")
    } else {
        "n/a".into()
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().any(|a| a == "--help" || a == "-h") {
        // The module docs are the usage text.
        let doc: String = include_str!("longctx-p2p-bench.rs")
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .map(|l| format!("{}\n", l.trim_start_matches("//!").strip_prefix(' ').unwrap_or("")))
            .collect();
        print!("{doc}");
        return Ok(());
    }
    let ucx = std::env::var("RANK").is_ok();
    let n_rounds = rounds();
    if ucx {
        let c = Communicator::from_env()?;
        let (mut ours, mut peers1, mut peers_w, mut peers_plain) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let program = if c.rank() == 0 { plain_ucx_program() } else { None };
        for _ in 0..n_rounds {
            ours.push(measure(&c, false)?);
            // Rank 0 runs the peer right after our sweep while rank 1 waits in the barrier (asleep on UCX's
            // event fd after its first 5 ms), so both sides of a round see the machine in the same state.
            if c.rank() == 0 {
                let perftest = |o: fn(usize) -> usize| {
                    sizes().into_iter().map(|b| ucx_perftest(b, o(b)).unwrap_or(f64::NAN)).collect::<Vec<_>>()
                };
                peers1.push(perftest(|_| 1));
                peers_w.push(perftest(window));
                peers_plain.push(
                    sizes()
                        .into_iter()
                        .map(|b| program.as_deref().and_then(|p| plain_ucx(p, b, window(b))).unwrap_or(f64::NAN))
                        .collect::<Vec<_>>(),
                );
            }
            c.barrier()?;
        }
        let rank = c.rank();
        drop(c);
        if rank == 0 {
            // Only reached with the `ucx` feature (`from_env` fails without it), but it must build without.
            #[cfg(feature = "ucx")]
            let version = {
                let (major, minor, release) = longctx_p2p::ucx_version();
                format!("{major}.{minor}.{release}")
            };
            #[cfg(not(feature = "ucx"))]
            let version = "(none)";
            println!(
                "UCX {version} transport, 2 processes (UCX_TLS={}, progress thread {}), median of \
                 {n_rounds} round(s)",
                std::env::var("UCX_TLS").unwrap_or_else(|_| "default".into()),
                if std::env::var("LONGCTX_UCX_PROGRESS").as_deref() == Ok("0") { "off" } else { "on" }
            );
            println!("| size | ring GiB/s | ring fwd GiB/s | send GiB/s | send xW GiB/s | send W→1 GiB/s | latency µs | all_reduce busbw GiB/s | hidden % | peer: ucx_perftest -O 1 GiB/s | peer: ucx_perftest -O W GiB/s | peer: plain UCX xW GiB/s | send / perftest -O 1 | send xW / perftest -O W | send xW / plain UCX xW |");
            println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
            let (p1, pw, pp) = (peer_medians(&peers1), peer_medians(&peers_w), peer_medians(&peers_plain));
            let (r1, rw) = (paired(&ours, &peers1, |r| r.send_gibs), paired(&ours, &peers_w, |r| r.window_gibs));
            let rp = paired(&ours, &peers_plain, |r| r.window_gibs);
            for (i, r) in medians(&ours).into_iter().enumerate() {
                println!(
                    "| {} | {:.2} | {:.2} | {:.2} | {:.2} (x{}) | {:.2} | {:.1} | {:.2} | {:.0} | {} | {} | {} | {} | {} | {} |",
                    size_name(r.bytes),
                    r.ring_gibs,
                    r.ring_fwd_gibs,
                    r.send_gibs,
                    r.window_gibs,
                    r.window,
                    r.window1_gibs,
                    r.lat_us,
                    r.allreduce_busbw,
                    r.hidden_pct,
                    fmt_or_na(p1[i]),
                    fmt_or_na(pw[i]),
                    fmt_or_na(pp[i]),
                    fmt_or_na(r1[i]),
                    fmt_or_na(rw[i]),
                    fmt_or_na(rp[i])
                );
            }
        }
        if let Some(p) = program {
            let _ = std::fs::remove_file(p);
        }
    } else {
        // Per round: our sweep on two rank threads, then the hand-off floor on two fresh threads, then (when
        // installed) `ucx_perftest` over shared memory up to 1 MiB.
        let mut ours = Vec::new();
        let (mut peers1, mut peers_w) = (Vec::new(), Vec::new());
        let perftest_sizes: Vec<usize> = sizes().into_iter().filter(|&b| b <= 1 << 20).collect();
        let have_perftest = Command::new("ucx_perftest").arg("-h").output().is_ok();
        for _ in 0..n_rounds {
            let mut round = ThreadWorld::run(2, |c| measure(&c, true))?.swap_remove(0)?;
            for r in &mut round {
                r.floor_gibs = handoff_floor(r.bytes);
                r.ring_floor_gibs = ring_floor(r.bytes, false);
                r.ring_fwd_floor_gibs = ring_floor(r.bytes, true);
            }
            ours.push(round);
            if have_perftest {
                peers1.push(perftest_sizes.iter().map(|&b| ucx_perftest(b, 1).unwrap_or(f64::NAN)).collect());
                peers_w.push(perftest_sizes.iter().map(|&b| ucx_perftest(b, window(b)).unwrap_or(f64::NAN)).collect());
            }
        }
        let vs_memcpy = paired_in_row(&ours, |r| r.send_gibs, |r| r.memcpy_gibs);
        let vs_floor = paired_in_row(&ours, |r| r.send_gibs, |r| r.floor_gibs);
        let ring_vs_memcpy = paired_in_row(&ours, |r| r.ring_gibs, |r| r.memcpy_gibs);
        let ring_vs_floor = paired_in_row(&ours, |r| r.ring_gibs, |r| r.ring_floor_gibs);
        let fwd_vs_floor = paired_in_row(&ours, |r| r.ring_fwd_gibs, |r| r.ring_fwd_floor_gibs);
        println!("threads transport, 2 ranks in one process, median of {n_rounds} round(s)");
        println!(
            "| size | ring GiB/s | ring fwd GiB/s | send GiB/s | send xW GiB/s | send W→1 GiB/s | latency µs | all_reduce busbw GiB/s | hidden % | peer: memcpy GiB/s | memcpy x2 GiB/s | hand-off floor GiB/s | ring floor GiB/s | ring fwd floor GiB/s | send / peer | send / floor | ring / peer | ring / ring floor | ring fwd / its floor |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for (i, r) in medians(&ours).into_iter().enumerate() {
            println!(
                "| {} | {:.2} | {:.2} | {:.2} | {:.2} (x{}) | {:.2} | {:.1} | {:.2} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                size_name(r.bytes),
                r.ring_gibs,
                r.ring_fwd_gibs,
                r.send_gibs,
                r.window_gibs,
                r.window,
                r.window1_gibs,
                r.lat_us,
                r.allreduce_busbw,
                r.hidden_pct,
                r.memcpy_gibs,
                r.memcpy2_gibs,
                r.floor_gibs,
                r.ring_floor_gibs,
                r.ring_fwd_floor_gibs,
                vs_memcpy[i],
                vs_floor[i],
                ring_vs_memcpy[i],
                ring_vs_floor[i],
                fwd_vs_floor[i]
            );
        }
        if have_perftest && !perftest_sizes.is_empty() {
            let k = perftest_sizes.len();
            let head: Vec<Vec<Row>> = ours.iter().map(|r| r[..k].to_vec()).collect();
            let (p1, pw) = (peer_medians(&peers1), peer_medians(&peers_w));
            let (r1, rw) = (paired(&head, &peers1, |r| r.send_gibs), paired(&head, &peers_w, |r| r.window_gibs));
            println!();
            println!(
                "the same streams between two processes over UCX shared memory (ucx_perftest -t tag_bw, UCX_TLS={}), \
                 median of {n_rounds} round(s)",
                std::env::var("UCX_TLS").unwrap_or_else(|_| "default".into())
            );
            println!("| size | threads send GiB/s | ucx_perftest -O 1 GiB/s | send / perftest -O 1 | threads send xW GiB/s | ucx_perftest -O W GiB/s | send xW / perftest -O W | memcpy GiB/s |");
            println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
            for (i, r) in medians(&head).into_iter().enumerate() {
                println!(
                    "| {} | {:.2} | {} | {} | {:.2} (x{}) | {} | {} | {:.2} |",
                    size_name(r.bytes),
                    r.send_gibs,
                    fmt_or_na(p1[i]),
                    fmt_or_na(r1[i]),
                    r.window_gibs,
                    r.window,
                    fmt_or_na(pw[i]),
                    fmt_or_na(rw[i]),
                    r.memcpy_gibs
                );
            }
        }
    }
    Ok(())
}
