//! Attention benchmark: forward and forward+backward time, GFLOP/s, fraction of this machine's GEMM peak
//! (measured in the same run) and peak heap memory, over sequence length, head dim, mask and dtype.
//!
//! ```text
//! cargo run --release -p longctx-kernels --example attn_bench                 # the full table
//! cargo run --release -p longctx-kernels --example attn_bench -- --seqs 1024,4096 --dims 128 --causal
//! cargo run --release -p longctx-kernels --example attn_bench -- --seqs 4096 --dims 64 --full --bf16 --reps 5
//! RAYON_NUM_THREADS=1 cargo run --release -p longctx-kernels --example attn_bench -- --seqs 4096 --cpu-time
//! RAYON_NUM_THREADS=1 valgrind --tool=callgrind target/release/examples/attn_bench --seqs 2048 --no-peak --reps 1
//! ```
//! FLOP counts follow the usual convention (also used by `bench/peer_sdpa.py`): forward `4·B·Hq·Sq·Sk·D`,
//! halved for causal; backward 2.5× forward.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use half::bf16;
use longctx_kernels::attention::{attention_backward, attention_forward, AttnMask, AttnParams, AttnShape};
use longctx_kernels::{HostSlice, HostSliceMut};

/// Counts live heap bytes and their high-water mark.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        System.dealloc(p, l)
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn reset_peak() -> usize {
    let live = LIVE.load(Ordering::Relaxed);
    PEAK.store(live, Ordering::Relaxed);
    live
}

fn arg_list(args: &[String], name: &str, default: &[usize]) -> Vec<usize> {
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
            .unwrap_or_else(|| default.to_vec()),
        None => default.to_vec(),
    }
}

/// GFLOP/s of a 2048³ f32 GEMM with the `gemm` crate on all threads: the machine's practical peak.
fn gemm_peak() -> f64 {
    let n = 2048;
    let a = vec![1.0f32; n * n];
    let b = vec![1.0f32; n * n];
    let mut c = vec![0.0f32; n * n];
    let threads = rayon::current_num_threads();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        // SAFETY: all three buffers are n×n, row-major, and do not overlap.
        unsafe {
            gemm::gemm(
                n,
                n,
                n,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr(),
                1,
                n as isize,
                b.as_ptr(),
                1,
                n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(threads),
            );
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n * n * n) as f64 / best / 1e9
}

/// CPU time of all this process's threads so far, in seconds (Linux `schedstat`; `None` elsewhere).
fn cpu_seconds() -> Option<f64> {
    let mut ns = 0u64;
    for t in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok()?;
        ns += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 * 1e-9)
}

/// Seconds taken by `f`: wall-clock, or with `cpu` the process's CPU time divided by the thread count.
/// CPU time is for A/B comparisons on a shared machine: time slices lost to other processes do not count
/// (cache and memory contention still do, and idle workers spinning adds a little).
fn timed(cpu: bool, threads: usize, f: impl FnOnce()) -> f64 {
    let c0 = if cpu { cpu_seconds() } else { None };
    let t = Instant::now();
    f();
    let wall = t.elapsed().as_secs_f64();
    match (c0, cpu_seconds().filter(|_| cpu)) {
        (Some(a), Some(b)) => (b - a) / threads as f64,
        _ => wall,
    }
}

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

enum Bufs {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}
impl Bufs {
    fn new(n: usize, seed: u64, bf: bool) -> Self {
        let v = rand(n, seed);
        if bf {
            Bufs::Bf16(v.into_iter().map(bf16::from_f32).collect())
        } else {
            Bufs::F32(v)
        }
    }
    fn view(&self) -> HostSlice<'_> {
        match self {
            Bufs::F32(v) => v.into(),
            Bufs::Bf16(v) => v.into(),
        }
    }
    fn view_mut(&mut self) -> HostSliceMut<'_> {
        match self {
            Bufs::F32(v) => v.into(),
            Bufs::Bf16(v) => v.into(),
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seqs = arg_list(&args, "--seqs", &[1024, 4096, 16384, 32768]);
    let dims = arg_list(&args, "--dims", &[64, 128]);
    let masks: Vec<bool> = if args.iter().any(|a| a == "--causal") {
        vec![true]
    } else if args.iter().any(|a| a == "--full") {
        vec![false]
    } else {
        vec![true, false]
    };
    let dtypes: Vec<bool> = if args.iter().any(|a| a == "--f32") {
        vec![false]
    } else if args.iter().any(|a| a == "--bf16") {
        vec![true]
    } else {
        vec![false, true]
    };
    let no_bwd = args.iter().any(|a| a == "--no-backward");
    // `--reps N`: a fixed number of timed repetitions (the minimum is reported); more of them filter out
    // bursts of load from other processes on a shared machine.
    let cpu = args.iter().any(|a| a == "--cpu-time");
    let reps_override = arg_list(&args, "--reps", &[]).first().copied().filter(|&r| r > 0);
    // `--hkv N`: KV heads (default 2; 8 = no grouping, every K/V tile used by one query head).
    let hkv = arg_list(&args, "--hkv", &[2]).first().copied().unwrap_or(2);
    if hkv == 0 || 8 % hkv != 0 {
        eprintln!("--hkv must divide Hq = 8");
        std::process::exit(2);
    }
    let (batch, hq) = (1, 8);
    let threads = rayon::current_num_threads();
    // `--no-peak`: skip the GEMM peak (e.g. under valgrind, where it dominates); "% peak" then shows NaN.
    let peak = if args.iter().any(|a| a == "--no-peak") { f64::NAN } else { gemm_peak() };
    println!("# longctx attention benchmark: B={batch} Hq={hq} Hkv={hkv}, {threads} threads");
    println!("# machine peak (gemm crate, 2048^3 f32, same run): {peak:.1} GFLOP/s");
    println!(
        "| S | D | mask | dtype | fwd ms | fwd GFLOP/s | fwd % peak | fwd+bwd ms | fwd+bwd GFLOP/s | fwd+bwd % peak | peak MiB | inputs MiB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for &s in &seqs {
        for &d in &dims {
            for &causal in &masks {
                for &bf in &dtypes {
                    let shape = AttnShape { batch, q_heads: hq, kv_heads: hkv, q_len: s, kv_len: s, head_dim: d };
                    let mask = if causal { AttnMask::causal() } else { AttnMask::full() };
                    let p = AttnParams::new(shape).with_mask(mask);
                    let base = reset_peak();
                    let q = Bufs::new(shape.q_elems(), 1, bf);
                    let k = Bufs::new(shape.kv_elems(), 2, bf);
                    let v = Bufs::new(shape.kv_elems(), 3, bf);
                    let d_o = Bufs::new(shape.q_elems(), 4, bf);
                    let mut o = Bufs::new(shape.q_elems(), 5, bf);
                    let mut lse = vec![0f32; shape.lse_elems()];
                    let mut dq = Bufs::new(shape.q_elems(), 6, bf);
                    let mut dk = Bufs::new(shape.kv_elems(), 7, bf);
                    let mut dv = Bufs::new(shape.kv_elems(), 8, bf);
                    let inputs = LIVE.load(Ordering::Relaxed) - base;
                    let flops = 4.0 * (batch * hq * s * s * d) as f64 * if causal { 0.5 } else { 1.0 };
                    // Enough repetitions for about a second of work, at least one.
                    let reps = reps_override.unwrap_or(((2e11 / flops) as usize).clamp(1, 20));
                    let mut fwd = f64::MAX;
                    for _ in 0..reps {
                        let t = timed(cpu, threads, || {
                            attention_forward(&p, q.view(), k.view(), v.view(), o.view_mut(), &mut lse)
                                .expect("forward")
                        });
                        fwd = fwd.min(t);
                    }
                    let mut bwd = f64::NAN;
                    if !no_bwd {
                        bwd = f64::MAX;
                        for _ in 0..reps {
                            let t = timed(cpu, threads, || {
                                attention_backward(
                                    &p,
                                    q.view(),
                                    k.view(),
                                    v.view(),
                                    o.view_mut().as_slice(),
                                    d_o.view(),
                                    &lse,
                                    dq.view_mut(),
                                    dk.view_mut(),
                                    dv.view_mut(),
                                    false,
                                )
                                .expect("backward")
                            });
                            bwd = bwd.min(t);
                        }
                    }
                    let peak_mem = PEAK.load(Ordering::Relaxed) - base;
                    let fb = fwd + bwd;
                    let fwd_gf = flops / fwd / 1e9;
                    let fb_gf = 3.5 * flops / fb / 1e9;
                    // With `--no-backward` the forward+backward columns are dashes, not NaN.
                    let fb_cols = if no_bwd {
                        "– | – | –".to_string()
                    } else {
                        format!("{:.1} | {:.1} | {:.0}%", fb * 1e3, fb_gf, 100.0 * fb_gf / peak)
                    };
                    println!(
                        "| {s} | {d} | {} | {} | {:.1} | {:.1} | {:.0}% | {fb_cols} | {:.1} | {:.1} |",
                        if causal { "causal" } else { "full" },
                        if bf { "bf16" } else { "f32" },
                        fwd * 1e3,
                        fwd_gf,
                        100.0 * fwd_gf / peak,
                        peak_mem as f64 / (1 << 20) as f64,
                        inputs as f64 / (1 << 20) as f64,
                    );
                }
            }
        }
    }
}
