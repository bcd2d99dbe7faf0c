//! `longctx-ring-bench`: context-parallel attention on thread ranks of one process.
//!
//! For each total sequence length and CP size it prints per-rank forward and backward time, the time of the
//! same rank's attention blocks computed with no communication (same kernel calls, same masks, run at the
//! same moment on every rank so the machine is equally loaded), the exposed communication (the difference),
//! the work imbalance between ranks (those blocks timed one rank at a time with the machine otherwise idle;
//! their CPU time in the concurrent run; and visible (query, key) pairs), the bytes each rank sent and each rank's peak heap. Then it predicts,
//! from the measured compute rate and a stated link bandwidth, the exposed communication at 8 and 32 ranks.
//!
//! ```text
//! cargo run --release -p longctx-ring-attn --bin longctx-ring-bench                    # S = 16K, 64K, 128K
//! cargo run --release -p longctx-ring-attn --bin longctx-ring-bench -- --seqs 16384 --cps 1,2,4
//! cargo run --release -p longctx-ring-attn --bin longctx-ring-bench -- --seqs 65536 --cps 4 --alone-reps 0
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use half::bf16;
use longctx_kernels::testing::uniform_nonzero;
use longctx_kernels::{
    attention_backward, attention_forward, merge_partial_attention, AttnMask, AttnParams, AttnShape, Positions,
};
use longctx_p2p::ThreadWorld;
use longctx_ring_attn::{ContextParallel, CpConfig, CpMask, CpShape, SeqLayout};

const MAX_RANKS: usize = 64;

thread_local! {
    /// The rank a thread works for (its rank thread and its kernel pool's threads), for per-rank heap counts.
    static RANK: Cell<usize> = const { Cell::new(MAX_RANKS) };
}
static LIVE: [AtomicUsize; MAX_RANKS + 1] = [const { AtomicUsize::new(0) }; MAX_RANKS + 1];
static PEAK: [AtomicUsize; MAX_RANKS + 1] = [const { AtomicUsize::new(0) }; MAX_RANKS + 1];

fn rank_slot() -> usize {
    RANK.try_with(|r| r.get()).unwrap_or(MAX_RANKS)
}

/// Heap bytes by the rank of the allocating thread (memory freed by another rank's thread is credited back
/// to that one; the ring passes no heap buffers between ranks, so the counts stay per rank).
struct PerRank;
unsafe impl GlobalAlloc for PerRank {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            let s = rank_slot();
            let now = LIVE[s].fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK[s].fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE[rank_slot()].fetch_sub(l.size(), Ordering::Relaxed);
        System.dealloc(p, l)
    }
}
#[global_allocator]
static ALLOC: PerRank = PerRank;

fn arg_list(args: &[String], name: &str, default: &[usize]) -> Vec<usize> {
    match args.iter().position(|a| a == name) {
        Some(i) => {
            args.get(i + 1).map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect()).unwrap_or_default()
        }
        None => default.to_vec(),
    }
}

fn rand_bf16(n: usize, seed: u64) -> Vec<bf16> {
    uniform_nonzero(n, seed).into_iter().map(bf16::from_f32).collect()
}

/// CPU seconds the calling thread has run so far. Work imbalance is measured in CPU time, not wall time:
/// when four ranks time-slice two cores, a rank's wall time says more about the scheduler than about its work.
fn thread_cpu_secs() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID is supported on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// CPU seconds of all threads of a rank's kernel pool (the rank thread itself sleeps while the pool works).
fn pool_cpu_secs(pool: &rayon::ThreadPool) -> f64 {
    pool.broadcast(|_| thread_cpu_secs()).iter().sum()
}

struct RankResult {
    fwd: Duration,
    bwd: Duration,
    fwd_compute: Duration,
    bwd_compute: Duration,
    /// CPU seconds of the compute-only forward and backward blocks.
    compute_cpu: f64,
    /// Best wall seconds of the compute-only blocks run with no other rank working (infinite if not measured).
    alone: f64,
    bytes: u64,
    peak: usize,
    flops: f64,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seqs = arg_list(&args, "--seqs", &[16384, 65536, 131072]);
    let cps = arg_list(&args, "--cps", &[1, 2, 4]);
    let link_gbs: f64 = args
        .iter()
        .position(|a| a == "--link-gbs")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(12.5);
    // Repetitions of the one-rank-at-a-time timing of each rank's blocks (work imbalance); 0 skips it (it costs
    // `alone_reps` more compute-only passes, run serially).
    let alone_reps = arg_list(&args, "--alone-reps", &[2]).first().copied().unwrap_or(2);
    let (hq, hkv, d) = (8, 2, 128);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("# longctx ring attention: B=1 Hq={hq} Hkv={hkv} D={d}, causal, bf16, zigzag, ring schedule, thread ranks on {cores} cores");
    println!(
        "# each rank's kernels run on max(1, cores/CP) threads; compute-only = the same blocks without communication"
    );
    println!("| S | CP | fwd ms | fwd compute-only ms | fwd exposed comm | bwd ms | bwd compute-only ms | bwd exposed comm | imbalance alone max/min | imbalance CPU max/min | pairs max/min | MiB sent/rank (fwd+bwd) | peak MiB/rank | rank GFLOP/s |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut rate_samples = Vec::new();
    for &s in &seqs {
        for &cp in &cps {
            let shape = CpShape { batch: 1, q_heads: hq, kv_heads: hkv, seq_len: s, head_dim: d };
            let layout = match SeqLayout::new(Default::default(), cp, s) {
                Ok(l) => l,
                Err(e) => {
                    println!("| {s} | {cp} | skipped: {e} |");
                    continue;
                }
            };
            let threads = (cores / cp).max(1);
            let res = ThreadWorld::builder().timeout(Duration::from_secs(3600)).run(cp, |comm| -> RankResult {
                let r = comm.rank();
                RANK.with(|c| c.set(r));
                let pool = Arc::new(
                    rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .start_handler(move |_| RANK.with(|c| c.set(r)))
                        .build()
                        .expect("thread pool"),
                );
                let cpa = ContextParallel::new(&comm, CpConfig::default()).expect("config").with_pool(pool.clone());
                let l = s / cp;
                let q = rand_bf16(hq * l * d, 1 + r as u64);
                let k = rand_bf16(hkv * l * d, 100 + r as u64);
                let v = rand_bf16(hkv * l * d, 200 + r as u64);
                let d_o = rand_bf16(hq * l * d, 300 + r as u64);
                let mut o = vec![bf16::ZERO; q.len()];
                let mut lse = vec![0f32; hq * l];
                let (mut dq, mut dk, mut dv) =
                    (vec![bf16::ZERO; q.len()], vec![bf16::ZERO; k.len()], vec![bf16::ZERO; k.len()]);
                let mask = CpMask::causal();
                PEAK[r].store(LIVE[r].load(Ordering::Relaxed), Ordering::Relaxed);
                comm.barrier().expect("barrier");
                let t = Instant::now();
                let rf = cpa
                    .forward(&shape, &mask, (&q).into(), (&k).into(), (&v).into(), (&mut o).into(), &mut lse)
                    .expect("forward");
                let fwd = t.elapsed();
                comm.barrier().expect("barrier");
                let t = Instant::now();
                let rb = cpa
                    .backward(
                        &shape,
                        &mask,
                        (&q).into(),
                        (&k).into(),
                        (&v).into(),
                        (&o).into(),
                        (&d_o).into(),
                        &lse,
                        (&mut dq).into(),
                        (&mut dk).into(),
                        (&mut dv).into(),
                    )
                    .expect("backward");
                let bwd = t.elapsed();
                let peak = PEAK[r].load(Ordering::Relaxed);
                // The same blocks, no communication: every rank at once, so the load matches the real run.
                comm.barrier().expect("barrier");
                let positions: Vec<Vec<i64>> = (0..cp).map(|x| layout.positions(x)).collect();
                let local = AttnShape { batch: 1, q_heads: hq, kv_heads: hkv, q_len: l, kv_len: l, head_dim: d };
                let params = |src: usize| {
                    AttnParams::new(local).with_mask(
                        AttnMask::causal()
                            .with_positions(Positions::Explicit(&positions[r]), Positions::Explicit(&positions[src])),
                    )
                };
                // Visible (query, key) pairs of this rank's blocks, for the rate (counted outside the timing; both
                // position lists are sorted within each zigzag chunk, so a binary search per query suffices).
                let mut flops = 0f64;
                for step in 0..cp {
                    let mut kp = positions[(r + cp - step) % cp].clone();
                    kp.sort_unstable();
                    let pairs: usize = positions[r].iter().map(|&a| kp.partition_point(|&b| b <= a)).sum();
                    flops += 4.0 * (hq * pairs * d) as f64;
                }
                let blocks = || {
                    pool.install(|| {
                        let mut o32 = vec![0f32; q.len()];
                        let mut lse_acc = vec![0f32; lse.len()];
                        let mut o_part = vec![0f32; q.len()];
                        let mut lse_part = vec![0f32; lse.len()];
                        let t = Instant::now();
                        let mut first = true;
                        for step in 0..cp {
                            let p = params((r + cp - step) % cp);
                            if !p.mask.may_see_any(l, l) {
                                continue;
                            }
                            // The first visible block writes the accumulator; later ones a partial, merged in.
                            let (o_dst, lse_dst) =
                                if first { (&mut o32, &mut lse_acc) } else { (&mut o_part, &mut lse_part) };
                            attention_forward(&p, (&q).into(), (&k).into(), (&v).into(), o_dst.into(), lse_dst)
                                .expect("fwd");
                            if !first {
                                merge_partial_attention(&mut o32, &mut lse_acc, &o_part, &lse_part).expect("merge");
                            }
                            first = false;
                        }
                        let fwd_c = t.elapsed();
                        let mut dq32 = vec![0f32; q.len()];
                        let mut dkv = vec![0f32; 2 * k.len()];
                        let t = Instant::now();
                        for step in 0..cp {
                            let p = params((r + cp - step) % cp);
                            if !p.mask.may_see_any(l, l) {
                                continue;
                            }
                            dkv.fill(0.0);
                            let (dk32, dv32) = dkv.split_at_mut(k.len());
                            attention_backward(
                                &p,
                                (&q).into(),
                                (&k).into(),
                                (&v).into(),
                                (&o).into(),
                                (&d_o).into(),
                                &lse,
                                (&mut dq32).into(),
                                dk32.into(),
                                dv32.into(),
                                true,
                            )
                            .expect("bwd");
                        }
                        (fwd_c, t.elapsed())
                    })
                };
                let cpu0 = pool_cpu_secs(&pool);
                let (fwd_compute, bwd_compute) = blocks();
                let compute_cpu = pool_cpu_secs(&pool) - cpu0;
                // The same blocks again, one rank at a time while the others wait at a barrier, best of
                // `alone_reps`: ranks running together share the L3 and memory bandwidth (and on a VM perhaps a host
                // core), so a rank's speed depends on what runs beside it; alone, every rank's blocks run under the
                // same conditions, and what remains is the difference in their work.
                let mut alone = f64::INFINITY;
                if cp > 1 {
                    for _ in 0..alone_reps {
                        for turn in 0..cp {
                            comm.barrier().expect("barrier");
                            if turn == r {
                                let (a, b) = blocks();
                                alone = alone.min((a + b).as_secs_f64());
                            }
                        }
                    }
                    comm.barrier().expect("barrier");
                }
                RankResult {
                    fwd,
                    bwd,
                    fwd_compute,
                    bwd_compute,
                    compute_cpu,
                    alone,
                    bytes: rf.bytes_sent + rb.bytes_sent,
                    peak,
                    flops,
                }
            });
            let res = match res {
                Ok(r) => r,
                Err(e) => {
                    println!("| {s} | {cp} | failed: {e} |");
                    continue;
                }
            };
            let max =
                |f: &dyn Fn(&RankResult) -> Duration| res.iter().map(f).max().unwrap_or_default().as_secs_f64() * 1e3;
            let (fwd, bwd) = (max(&|x| x.fwd), max(&|x| x.bwd));
            let (fwd_c, bwd_c) = (max(&|x| x.fwd_compute), max(&|x| x.bwd_compute));
            let max_over_min =
                |v: Vec<f64>| v.iter().cloned().fold(0.0, f64::max) / v.iter().cloned().fold(f64::MAX, f64::min);
            let imbalance = max_over_min(res.iter().map(|x| x.compute_cpu).collect());
            let alone = if cp == 1 {
                "1.000".to_string()
            } else if alone_reps == 0 {
                "–".to_string()
            } else {
                format!("{:.3}", max_over_min(res.iter().map(|x| x.alone).collect()))
            };
            let pair_imbalance = max_over_min(res.iter().map(|x| x.flops).collect());
            let bytes = res.iter().map(|x| x.bytes).max().unwrap_or(0) as f64 / (1 << 20) as f64;
            let peak = res.iter().map(|x| x.peak).max().unwrap_or(0) as f64 / (1 << 20) as f64;
            let rate = res.iter().map(|x| x.flops).sum::<f64>() / cp as f64 / (fwd_c / 1e3) / 1e9;
            rate_samples.push(rate);
            println!(
                "| {s} | {cp} | {fwd:.0} | {fwd_c:.0} | {:.1}% | {bwd:.0} | {bwd_c:.0} | {:.1}% | {alone} | {imbalance:.3} | {pair_imbalance:.3} | {bytes:.1} | {peak:.1} | {rate:.1} |",
                100.0 * (fwd - fwd_c).max(0.0) / fwd,
                100.0 * (bwd - bwd_c).max(0.0) / bwd,
            );
        }
    }
    // Prediction for larger CP from the measured per-rank forward rate and the stated link bandwidth.
    let rate = rate_samples.iter().cloned().fold(0.0, f64::max);
    if rate > 0.0 {
        println!();
        println!("# prediction: per-rank forward compute rate {rate:.1} GFLOP/s (best measured above), link {link_gbs} GB/s per direction");
        println!(
            "| S | CP | KV block MiB | transfer ms/step | compute ms/step (zigzag off-diagonal) | exposed comm/step |"
        );
        println!("|---|---|---|---|---|---|");
        for &s in &[131072usize, 1 << 20] {
            for cp in [8usize, 32] {
                let l = s / cp;
                let kv_bytes = (2 * hkv * l * d * 2) as f64;
                let transfer = kv_bytes / (link_gbs * 1e9) * 1e3;
                // Off the diagonal, zigzag computes half of Q against all KV or all Q against half of KV.
                let compute = 4.0 * (hq * l * l * d) as f64 / 2.0 / (rate * 1e9) * 1e3;
                println!(
                    "| {s} | {cp} | {:.1} | {transfer:.2} | {compute:.1} | {:.2} ms |",
                    kv_bytes / (1 << 20) as f64,
                    (transfer - compute).max(0.0)
                );
            }
        }
    }
}
