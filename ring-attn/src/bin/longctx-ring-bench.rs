//! `longctx-ring-bench`: context-parallel attention on thread ranks of one process.
//!
//! For each total sequence length and CP size it prints per-rank forward and backward time, the time of the
//! same rank's attention blocks computed with no communication (same kernel calls, same masks, run at the
//! same moment on every rank so the machine is equally loaded), the exposed communication (the difference),
//! the work imbalance between ranks (those blocks timed one rank at a time on every core of the machine, block
//! by block in turns, with the other ranks idle; their CPU time in the concurrent run; and visible (query, key)
//! pairs), the bytes each rank sent and each rank's share of the process's peak heap. Then it predicts,
//! from the measured compute rate and a stated link bandwidth, the exposed communication at 8 and 32 ranks.
//!
//! ```text
//! cargo run --release -p longctx-ring-attn --bin longctx-ring-bench                    # S = 16K, 64K, 128K
//! cargo run --release -p longctx-ring-attn --bin longctx-ring-bench -- --seqs 16384 --cps 1,2,4
//! cargo run --release -p longctx-ring-attn --bin longctx-ring-bench -- --seqs 65536 --cps 4 --alone-reps 0
//! cargo run --release -p longctx-ring-attn --bin longctx-ring-bench -- --seqs 131072 --cps 4 --no-compute-only
//! ```
//!
//! "ring wait" is the ring's own count of the time it spent blocked on communication (its `StepReport`; this
//! includes waiting for a slower peer), a second measure of the exposed communication that needs no
//! compute-only pass: `--no-compute-only` skips the concurrent compute-only pass (half the time) and leaves it
//! as the only one. `--alone-reps N` (default 4) sets how often each block is timed alone; 0 skips that timing.
//!
//! The schedule's own imbalance is measured apart (thread ranks only): every rank's blocks timed on one set of
//! buffers and data, only the positions differing, `--schedule-reps N` times (default 4; 0 skips it), summed
//! per rank from each block's median, beside the exact count of the scores the kernels compute per rank
//! (`attention_work`). `--schedule-only` runs just that (no ring, no compute-only pass; with
//! `--schedule-reps 0`, only the exact count):
//!
//! ```text
//! cargo run --release -p longctx-ring-attn --bin longctx-ring-bench -- --seqs 16384 --cps 2,4 --schedule-only --schedule-reps 8
//! ```
//!
//! With `--ucx` each rank is a process of a job started by `longctx-launch` (UCX transport; CP = the number of
//! processes; rank 0 prints):
//!
//! ```text
//! cargo build --release -p longctx-ring-attn --features ucx --bin longctx-ring-bench
//! cargo build --release -p longctx-p2p --features ucx --bin longctx-launch
//! target/release/longctx-launch --nproc 2 -- target/release/longctx-ring-bench --ucx --seqs 16384
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use half::bf16;
use longctx_kernels::testing::uniform_nonzero;
use longctx_kernels::{attention_work, AttnMask, AttnParams, AttnPartial, AttnShape, GradMode, Positions};
use longctx_p2p::{Communicator, ThreadWorld};
use longctx_ring_attn::{
    AttnGrads, AttnOut, AttnSaved, Backend, ContextParallel, CpConfig, CpMask, CpShape, CpuBackend, DType, Qkv,
    SeqLayout, View, ViewMut,
};

// Heap bytes of the whole process: the ranks are threads that share the CPU backend's cache of large buffers, which
// hands a buffer one rank freed to the next that asks, so bytes cannot be told apart by rank; a rank's share of the
// process's peak is the figure printed.
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

struct Counting;
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
    /// Time the ring itself spent blocked on communication (its `StepReport`), forward and backward.
    fwd_wait: Duration,
    bwd_wait: Duration,
    /// CPU seconds of the compute-only forward and backward blocks.
    compute_cpu: f64,
    /// Best wall seconds of the compute-only blocks run with no other rank working (infinite if not measured).
    alone: f64,
    /// Best seconds of each ring step's forward and backward block alone.
    alone_steps: Vec<[f64; 2]>,
    bytes: u64,
    peak: usize,
    flops: f64,
}

/// One rank's compute-only work: the attention blocks of its ring steps (same kernel calls, masks and merges as
/// the ring) on buffers allocated once, timed one step at a time.
struct RankBlocks<'a> {
    /// The kernel parameters of each ring step (the mask with this rank's and the source rank's positions).
    steps: Vec<AttnParams<'a>>,
    x: Inputs<'a>,
    /// The first step the mask lets see anything: it writes the forward accumulator, later ones a partial.
    first: Option<usize>,
    o_acc: Vec<f32>,
    lse_acc: Vec<f32>,
    o_part: Vec<f32>,
    lse_part: Vec<f32>,
    d_q: Vec<f32>,
    d_kv: Vec<f32>,
    /// The kernels, through the backend the ring calls, on the calling thread's pool.
    cpu: CpuBackend,
}

/// A rank's own tensors, as the ring's forward and backward take them.
#[derive(Clone, Copy)]
struct Inputs<'a> {
    qkv: Qkv<'a>,
    o: View<'a>,
    d_o: View<'a>,
    lse: View<'a>,
}

impl<'a> RankBlocks<'a> {
    fn new(steps: Vec<AttnParams<'a>>, x: Inputs<'a>) -> Self {
        let (q, kv, rows) = (x.qkv.q.len(), x.qkv.k.len(), x.lse.len());
        let mut blocks = Self {
            cpu: CpuBackend::new(),
            steps: Vec::new(),
            x,
            first: None,
            o_acc: vec![0.0; q],
            lse_acc: vec![0.0; rows],
            o_part: vec![0.0; q],
            lse_part: vec![0.0; rows],
            d_q: vec![0.0; q],
            d_kv: vec![0.0; 2 * kv],
        };
        blocks.set_steps(steps);
        blocks
    }

    /// Replaces the steps' kernel parameters (another rank's schedule on the same buffers).
    fn set_steps(&mut self, steps: Vec<AttnParams<'a>>) {
        let l = steps.first().map_or(0, |p| p.shape.kv_len);
        self.first = steps.iter().position(|p| p.mask.may_see_any(l, l));
        self.steps = steps;
    }

    fn visible(&self, step: usize) -> bool {
        let l = self.steps[step].shape.kv_len;
        self.steps[step].mask.may_see_any(l, l)
    }

    /// The forward block of `step` (merged into the accumulator after the first), timed.
    fn forward_step(&mut self, step: usize) -> Duration {
        if !self.visible(step) {
            return Duration::ZERO;
        }
        let (t, x) = (Instant::now(), self.x);
        let (opts, qd, ld) = (self.steps[step].options(), x.qkv.q.shape(), x.lse.shape());
        let acc = AttnOut {
            o: ViewMut::new(&mut self.o_acc, qd).expect("dims"),
            lse: ViewMut::new(&mut self.lse_acc, ld).expect("dims"),
        };
        if self.first == Some(step) {
            self.cpu.attention_forward(&opts, acc, x.qkv).expect("fwd");
        } else {
            let part = AttnOut {
                o: ViewMut::new(&mut self.o_part, qd).expect("dims"),
                lse: ViewMut::new(&mut self.lse_part, ld).expect("dims"),
            };
            self.cpu.attention_forward(&opts, part, x.qkv).expect("fwd");
            let part = AttnPartial {
                o: View::new(&self.o_part, qd).expect("dims"),
                lse: View::new(&self.lse_part, ld).expect("dims"),
            };
            self.cpu.attention_merge(acc, part).expect("merge");
        }
        t.elapsed()
    }

    /// The backward block of `step` (dQ accumulated, dK and dV into the buffer that travels), timed.
    fn backward_step(&mut self, step: usize) -> Duration {
        if !self.visible(step) {
            return Duration::ZERO;
        }
        let t = Instant::now();
        self.d_kv.fill(0.0);
        let x = self.x;
        let (qd, kd) = (x.qkv.q.shape(), x.qkv.k.shape());
        let (dk, dv) = self.d_kv.split_at_mut(x.qkv.k.len());
        let grads = AttnGrads {
            dq: ViewMut::new(&mut self.d_q, qd).expect("dims"),
            dk: ViewMut::new(dk, kd).expect("dims"),
            dv: ViewMut::new(dv, kd).expect("dims"),
        };
        let saved = AttnSaved { qkv: x.qkv, o: x.o, lse: x.lse };
        let opts = self.steps[step].options();
        self.cpu.attention_backward(&opts, grads, x.d_o, saved, GradMode::Accumulate).expect("bwd");
        t.elapsed()
    }
}

/// One benchmark case: total length `s` over `cp` ranks, each rank's kernels on `threads` threads.
struct Job<'a> {
    s: usize,
    cp: usize,
    threads: usize,
    alone_reps: usize,
    /// The pool every rank's blocks run on when timed alone: all cores, so every rank is timed on the same
    /// threads and cores (a rank's own single-thread pool would put each rank on whichever core its worker
    /// happened to live on, and a VM's vCPUs need not run at the same speed).
    alone_pool: &'a rayon::ThreadPool,
    /// Whether to run the compute-only passes (they double the time; `--no-compute-only` skips them, and the
    /// exposed communication is then the ring's own count of its waits).
    compute_only: bool,
    hq: usize,
    hkv: usize,
    d: usize,
    layout: SeqLayout,
}

/// Runs one rank of a case: the ring forward and backward, then the same blocks without communication (all
/// ranks at once, then one rank at a time).
fn view(x: &[bf16], dims: [usize; 4]) -> View<'_> {
    View::new(x, dims).expect("dims")
}

fn run_rank(comm: &Arc<Communicator>, job: &Job) -> RankResult {
    let Job { s, cp, threads, alone_reps, alone_pool, compute_only, hq, hkv, d, ref layout } = *job;
    let shape = CpShape { batch: 1, q_heads: hq, kv_heads: hkv, seq_len: s, head_dim: d, dtype: DType::Bf16 };
    let r = comm.rank();
    let pool = Arc::new(rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool"));
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::with_pool(pool.clone()));
    let cpa = ContextParallel::new(comm.clone(), backend, CpConfig::default()).expect("config");
    let mut plan = cpa.plan(&shape, &CpMask::causal()).expect("plan");
    let (qd, kd, ld) = (plan.q_dims(), plan.kv_dims(), plan.lse_dims());
    let l = s / cp;
    let q = rand_bf16(hq * l * d, 1 + r as u64);
    let k = rand_bf16(hkv * l * d, 100 + r as u64);
    let v = rand_bf16(hkv * l * d, 200 + r as u64);
    let d_o = rand_bf16(hq * l * d, 300 + r as u64);
    let mut o = vec![bf16::ZERO; q.len()];
    let mut lse = vec![0f32; hq * l];
    let (mut dq, mut dk, mut dv) = (vec![bf16::ZERO; q.len()], vec![bf16::ZERO; k.len()], vec![bf16::ZERO; k.len()]);
    // Every rank sets the same mark before the barrier: the timed region's peak starts from what is live then.
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    comm.barrier().expect("barrier");
    let t = Instant::now();
    let qkv = Qkv::new(view(&q, qd), view(&k, kd), view(&v, kd));
    let out = AttnOut { o: ViewMut::new(&mut o, qd).expect("dims"), lse: ViewMut::new(&mut lse, ld).expect("dims") };
    let rf = plan.forward(out, qkv).expect("forward");
    let fwd = t.elapsed();
    comm.barrier().expect("barrier");
    let t = Instant::now();
    let x = Inputs { qkv, o: view(&o, qd), d_o: view(&d_o, qd), lse: View::new(&lse, ld).expect("dims") };
    let grads = AttnGrads {
        dq: ViewMut::new(&mut dq, qd).expect("dims"),
        dk: ViewMut::new(&mut dk, kd).expect("dims"),
        dv: ViewMut::new(&mut dv, kd).expect("dims"),
    };
    let saved = AttnSaved { qkv, o: view(&o, qd), lse: View::new(&lse, ld).expect("dims") };
    let rb = plan.backward(grads, view(&d_o, qd), saved).expect("backward");
    let bwd = t.elapsed();
    let peak = PEAK.load(Ordering::Relaxed) / cp;
    // The same blocks, no communication: every rank at once, so the load matches the real run.
    comm.barrier().expect("barrier");
    let positions: Vec<Vec<i64>> = layout.all_positions();
    let local = AttnShape { batch: 1, q_heads: hq, kv_heads: hkv, q_len: l, kv_len: l, head_dim: d };
    let params = |src: usize| block_params(local, &positions, r, src);
    // Visible (query, key) pairs of this rank's blocks, for the rate (counted outside the timing; both
    // position lists are sorted within each zigzag chunk, so a binary search per query suffices).
    let mut flops = 0f64;
    for step in 0..cp {
        let mut kp = positions[(r + cp - step) % cp].clone();
        kp.sort_unstable();
        let pairs: usize = positions[r].iter().map(|&a| kp.partition_point(|&b| b <= a)).sum();
        flops += 4.0 * (hq * pairs * d) as f64;
    }
    let (fwd_wait, bwd_wait, bytes) = (rf.comm_wait, rb.comm_wait, rf.bytes_sent + rb.bytes_sent);
    let timed_alone = cp > 1 && alone_reps > 0;
    if !compute_only && !timed_alone {
        // Nothing more to time: skip the blocks' buffers (f32 copies of Q-sized outputs, GiBs at 128K).
        return RankResult {
            fwd,
            bwd,
            fwd_compute: Duration::ZERO,
            bwd_compute: Duration::ZERO,
            fwd_wait,
            bwd_wait,
            compute_cpu: f64::NAN,
            alone: f64::NAN,
            alone_steps: Vec::new(),
            bytes,
            peak,
            flops,
        };
    }
    let mut work = RankBlocks::new((0..cp).map(|step| params((r + cp - step) % cp)).collect(), x);
    let (fwd_compute, bwd_compute, compute_cpu) = if compute_only {
        let cpu0 = pool_cpu_secs(&pool);
        let (fwd, bwd) = pool.install(|| {
            let fwd: Duration = (0..cp).map(|step| work.forward_step(step)).sum();
            let bwd: Duration = (0..cp).map(|step| work.backward_step(step)).sum();
            (fwd, bwd)
        });
        (fwd, bwd, pool_cpu_secs(&pool) - cpu0)
    } else {
        (Duration::ZERO, Duration::ZERO, f64::NAN)
    };
    // The same blocks again, one rank at a time on every core while the others wait at a barrier: ranks
    // running together share the L3 and memory bandwidth (and on a VM perhaps a host core), so a rank's
    // speed depends on what runs beside it; alone, every rank's blocks run under the same conditions, on
    // the same threads, and what remains is the difference in their work. The ranks take turns block by
    // block (forward step 0 of every rank, then step 1, ...), in an order reversed every repetition, and
    // each block keeps its best time: slow phases of a shared host then fall on every rank alike instead
    // of on whichever rank happened to be running, which swamped the figure when each rank ran all its
    // blocks in one go.
    let mut alone = vec![[f64::INFINITY; 2]; cp];
    if timed_alone {
        for rep in 0..alone_reps {
            for pass in 0..2 {
                for (step, best) in alone.iter_mut().enumerate() {
                    for i in 0..cp {
                        let turn = if rep % 2 == 0 { i } else { cp - 1 - i };
                        comm.barrier().expect("barrier");
                        if turn == r {
                            let t = alone_pool.install(|| {
                                if pass == 0 {
                                    work.forward_step(step)
                                } else {
                                    work.backward_step(step)
                                }
                            });
                            best[pass] = best[pass].min(t.as_secs_f64());
                        }
                    }
                }
            }
        }
        comm.barrier().expect("barrier");
    }
    let alone_steps = if timed_alone { alone } else { Vec::new() };
    let alone = alone_steps.iter().map(|b| b[0] + b[1]).sum();
    RankResult {
        fwd,
        bwd,
        fwd_compute,
        bwd_compute,
        fwd_wait,
        bwd_wait,
        compute_cpu,
        alone,
        alone_steps,
        bytes,
        peak,
        flops,
    }
}

/// The kernel parameters of rank `r`'s block against the keys of rank `src` (causal, global positions).
fn block_params<'a>(local: AttnShape, positions: &'a [Vec<i64>], r: usize, src: usize) -> AttnParams<'a> {
    AttnParams::new(local).with_mask(
        AttnMask::causal().with_positions(Positions::Explicit(&positions[r]), Positions::Explicit(&positions[src])),
    )
}

/// The scores the kernels compute for each rank over all its ring steps ([`attention_work`]: the tile pairs
/// its masks leave visible, exactly what the forward and backward loop over).
fn kernel_work(job: &Job) -> Vec<u64> {
    let (cp, l) = (job.cp, job.s / job.cp);
    let positions: Vec<Vec<i64>> = job.layout.all_positions();
    let local = AttnShape { batch: 1, q_heads: job.hq, kv_heads: job.hkv, q_len: l, kv_len: l, head_dim: job.d };
    (0..cp)
        .map(|r| {
            (0..cp).map(|src| attention_work(&block_params(local, &positions, r, src)).expect("work").scores).sum()
        })
        .collect()
}

/// The schedule's own imbalance: every rank's ring-step blocks timed on ONE set of buffers and data (rank 0's
/// tensors), only the positions, and so the masks, changing from rank to rank. Ranks whose own buffers sit at
/// other addresses, or whose values differ, can run at slightly different speeds on the same work (the "alone"
/// timing shows that); here only the work the schedule gives each rank differs. Timed one block at a time on
/// every core, the ranks taking turns block by block, the first turn rotating every repetition so each rank
/// runs as often in each place of the order. Returns every sample: `[rep][rank][step][forward, backward]`
/// seconds.
// The indices pick the rank whose turn it is, not an element to iterate over.
#[allow(clippy::needless_range_loop)]
fn time_schedule(job: &Job, reps: usize, pool: &rayon::ThreadPool) -> Vec<Vec<Vec<[f64; 2]>>> {
    let Job { s, cp, hq, hkv, d, ref layout, .. } = *job;
    if reps == 0 {
        return Vec::new();
    }
    let l = s / cp;
    let positions: Vec<Vec<i64>> = layout.all_positions();
    let local = AttnShape { batch: 1, q_heads: hq, kv_heads: hkv, q_len: l, kv_len: l, head_dim: d };
    let (q, k, v, d_o) = (
        rand_bf16(hq * l * d, 1),
        rand_bf16(hkv * l * d, 100),
        rand_bf16(hkv * l * d, 200),
        rand_bf16(hq * l * d, 300),
    );
    // O and LSE of rank 0's diagonal block: every row sees at least itself, so every LSE is finite, as in the
    // ring, where the backward gets the merged result.
    let mut o = vec![bf16::ZERO; q.len()];
    let mut lse = vec![0f32; hq * l];
    let (qd, kd, ld) = (local.q_dims(), local.kv_dims(), local.lse_dims());
    let qkv = Qkv::new(view(&q, qd), view(&k, kd), view(&v, kd));
    let out = AttnOut { o: ViewMut::new(&mut o, qd).expect("dims"), lse: ViewMut::new(&mut lse, ld).expect("dims") };
    let opts = block_params(local, &positions, 0, 0).options();
    pool.install(|| CpuBackend::new().attention_forward(&opts, out, qkv)).expect("forward");
    let x = Inputs { qkv, o: view(&o, qd), d_o: view(&d_o, qd), lse: View::new(&lse, ld).expect("dims") };
    let steps_of = |r: usize| (0..cp).map(|step| block_params(local, &positions, r, (r + cp - step) % cp)).collect();
    let mut blocks = RankBlocks::new(steps_of(0), x);
    let mut samples = vec![vec![vec![[0.0; 2]; cp]; cp]; reps];
    for (rep, sample) in samples.iter_mut().enumerate() {
        for pass in 0..2 {
            for step in 0..cp {
                for i in 0..cp {
                    let r = (i + rep) % cp;
                    blocks.set_steps(steps_of(r));
                    let t =
                        pool.install(|| if pass == 0 { blocks.forward_step(step) } else { blocks.backward_step(step) });
                    sample[r][step][pass] = t.as_secs_f64();
                }
            }
        }
    }
    samples
}

/// What the schedule timing shows: per-rank totals of each block's median (robust to the bursts of a shared
/// host) and of each block's best, their max/min, the spread of step 0 (identical work on every rank: the
/// measure's noise floor), and a bootstrap 95% interval of the median imbalance (repetitions resampled).
struct ScheduleStats {
    median_totals: Vec<f64>,
    median_imbalance: f64,
    best_imbalance: f64,
    step0_spread: f64,
    interval: (f64, f64),
}

fn max_over_min(v: &[f64]) -> f64 {
    v.iter().cloned().fold(0.0, f64::max) / v.iter().cloned().fold(f64::MAX, f64::min)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

impl ScheduleStats {
    fn new(samples: &[Vec<Vec<[f64; 2]>>]) -> Self {
        let (cp, steps) = (samples[0].len(), samples[0][0].len());
        // Per rank and block: the statistic over the chosen repetitions.
        let per_block = |reps: &[usize], stat: &dyn Fn(Vec<f64>) -> f64| -> Vec<Vec<f64>> {
            (0..cp)
                .map(|r| {
                    (0..steps)
                        .flat_map(|st| (0..2).map(move |pass| (st, pass)))
                        .map(|(st, pass)| stat(reps.iter().map(|&i| samples[i][r][st][pass]).collect()))
                        .collect()
                })
                .collect()
        };
        let all: Vec<usize> = (0..samples.len()).collect();
        let totals = |b: &[Vec<f64>]| b.iter().map(|x| x.iter().sum()).collect::<Vec<f64>>();
        let med = per_block(&all, &median);
        let best = per_block(&all, &|v| v.into_iter().fold(f64::INFINITY, f64::min));
        let median_totals = totals(&med);
        let step0: Vec<f64> = med.iter().map(|x| x[0] + x[1]).collect();
        // Bootstrap: resample the repetitions (a repetition runs every block of every rank once, interleaved).
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let mut draws: Vec<f64> = (0..400)
            .map(|_| {
                let pick: Vec<usize> = (0..samples.len())
                    .map(|_| {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        (rng % samples.len() as u64) as usize
                    })
                    .collect();
                max_over_min(&totals(&per_block(&pick, &median)))
            })
            .collect();
        draws.sort_by(f64::total_cmp);
        Self {
            median_imbalance: max_over_min(&median_totals),
            median_totals,
            best_imbalance: max_over_min(&totals(&best)),
            step0_spread: max_over_min(&step0),
            interval: (draws[10], draws[389]),
        }
    }
}

/// The wire form of a [`RankResult`] (UCX processes gather them on rank 0): scalars, then the steps' times.
fn pack(x: &RankResult) -> Vec<f64> {
    let mut v = vec![
        x.fwd.as_secs_f64(),
        x.bwd.as_secs_f64(),
        x.fwd_compute.as_secs_f64(),
        x.bwd_compute.as_secs_f64(),
        x.compute_cpu,
        x.alone,
        x.bytes as f64,
        x.peak as f64,
        x.flops,
        x.fwd_wait.as_secs_f64(),
        x.bwd_wait.as_secs_f64(),
    ];
    v.extend(x.alone_steps.iter().flatten());
    v
}

fn unpack(v: &[f64]) -> RankResult {
    let secs = |x: f64| Duration::from_secs_f64(x);
    RankResult {
        fwd: secs(v[0]),
        bwd: secs(v[1]),
        fwd_compute: secs(v[2]),
        bwd_compute: secs(v[3]),
        compute_cpu: v[4],
        alone: v[5],
        bytes: v[6] as u64,
        peak: v[7] as usize,
        flops: v[8],
        fwd_wait: secs(v[9]),
        bwd_wait: secs(v[10]),
        alone_steps: v[11..].chunks(2).map(|c| [c[0], c[1]]).collect(),
    }
}

/// Every rank's result, on every rank of a UCX world.
fn gather(comm: &Communicator, mine: &RankResult) -> Result<Vec<RankResult>, String> {
    let send = pack(mine);
    let mut all = vec![0f64; send.len() * comm.world_size()];
    comm.all_gather(&send, &mut all).map_err(|e| e.to_string())?;
    Ok(all.chunks(send.len()).map(unpack).collect())
}

/// The world of a job started by `longctx-launch` (UCX transport).
#[cfg(feature = "ucx")]
fn ucx_world() -> Communicator {
    match Communicator::from_env() {
        Ok(mut c) => {
            c.set_timeout(Duration::from_secs(3600));
            c
        }
        Err(e) => {
            eprintln!("--ucx: cannot join the job: {e}");
            std::process::exit(2)
        }
    }
}

#[cfg(not(feature = "ucx"))]
fn ucx_world() -> Communicator {
    eprintln!("--ucx needs the `ucx` feature: cargo build --release -p longctx-ring-attn --features ucx");
    std::process::exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        // The module docs are the usage text.
        let doc: String = include_str!("longctx-ring-bench.rs")
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .map(|l| format!("{}\n", l.trim_start_matches("//!").strip_prefix(' ').unwrap_or("")))
            .collect();
        print!("{doc}");
        return;
    }
    let seqs = arg_list(&args, "--seqs", &[16384, 65536, 131072]);
    let mut cps = arg_list(&args, "--cps", &[1, 2, 4]);
    let link_gbs: f64 = args
        .iter()
        .position(|a| a == "--link-gbs")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(12.5);
    // Repetitions of the one-rank-at-a-time timing of each rank's blocks (work imbalance); 0 skips it (it costs
    // `alone_reps` more compute-only passes, run serially on all cores).
    let alone_reps = arg_list(&args, "--alone-reps", &[4]).first().copied().unwrap_or(4);
    let compute_only = !args.iter().any(|a| a == "--no-compute-only");
    // Repetitions of the schedule timing (every rank's blocks on one set of buffers; thread ranks only); 0 skips
    // it. `--schedule-only` runs nothing else (no ring, no compute-only pass).
    let schedule_reps = arg_list(&args, "--schedule-reps", &[4]).first().copied().unwrap_or(4);
    let schedule_only = args.iter().any(|a| a == "--schedule-only");
    let (hq, hkv, d) = (8, 2, 128);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let alone_pool = rayon::ThreadPoolBuilder::new().num_threads(cores).build().expect("thread pool");
    // `--ucx`: this process is one rank of a job started by `longctx-launch` (CP = its world size); rank 0 prints.
    let processes = if args.iter().any(|a| a == "--ucx") { Some(Arc::new(ucx_world())) } else { None };
    let lead = processes.as_ref().is_none_or(|c| c.rank() == 0);
    let ranks = match &processes {
        Some(c) => {
            cps = vec![c.world_size()];
            format!("UCX processes (one per rank) on {cores} cores")
        }
        None => format!("thread ranks on {cores} cores"),
    };
    if lead && !schedule_only {
        println!("# longctx ring attention: B=1 Hq={hq} Hkv={hkv} D={d}, causal, bf16, zigzag, ring schedule, {ranks}");
        println!(
            "# each rank's kernels run on max(1, cores/CP) threads; compute-only = the same blocks without communication"
        );
        println!("| S | CP | fwd ms | fwd compute-only ms | fwd exposed comm | fwd ring wait | bwd ms | bwd compute-only ms | bwd exposed comm | bwd ring wait | imbalance alone max/min | imbalance CPU max/min | pairs max/min | kernel work max/min | MiB sent/rank (fwd+bwd) | peak MiB/rank | rank GFLOP/s |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    }
    let mut rate_samples = Vec::new();
    let mut alone_rows = Vec::new();
    let mut schedule_rows = Vec::new();
    for &s in &seqs {
        for &cp in &cps {
            let layout = match SeqLayout::new(Default::default(), cp, s) {
                Ok(l) => l,
                Err(e) => {
                    println!("| {s} | {cp} | skipped: {e} |");
                    continue;
                }
            };
            let threads = (cores / cp).max(1);
            let job = Job { s, cp, threads, alone_reps, alone_pool: &alone_pool, compute_only, hq, hkv, d, layout };
            let work = kernel_work(&job);
            let work_imbalance = max_over_min(&work.iter().map(|&w| w as f64).collect::<Vec<_>>());
            // With `--schedule-only --schedule-reps 0` only the exact work count is printed (instant at any S).
            if processes.is_none() && cp > 1 && (schedule_reps > 0 || schedule_only) {
                schedule_rows.push((s, cp, time_schedule(&job, schedule_reps, &alone_pool), work_imbalance));
            }
            if schedule_only {
                continue;
            }
            let res = match &processes {
                None => ThreadWorld::builder()
                    .timeout(Duration::from_secs(3600))
                    .run(cp, |comm| run_rank(&Arc::new(comm), &job))
                    .map_err(|e| e.to_string()),
                Some(comm) => gather(comm, &run_rank(comm, &job)),
            };
            if !lead {
                continue;
            }
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
            // The ring's own count of its waits, worst rank, as a share of the step.
            let wait_share = |w: &dyn Fn(&RankResult) -> Duration, t: &dyn Fn(&RankResult) -> Duration| {
                res.iter().map(|x| w(x).as_secs_f64() / t(x).as_secs_f64()).fold(0.0, f64::max) * 100.0
            };
            let (fwd_w, bwd_w) = (wait_share(&|x| x.fwd_wait, &|x| x.fwd), wait_share(&|x| x.bwd_wait, &|x| x.bwd));
            let imbalance = max_over_min(&res.iter().map(|x| x.compute_cpu).collect::<Vec<_>>());
            let alone = if cp == 1 {
                "1.000".to_string()
            } else if alone_reps == 0 {
                "–".to_string()
            } else {
                alone_rows.push((s, cp, res.iter().map(|x| (x.alone, x.alone_steps.clone())).collect::<Vec<_>>()));
                format!("{:.3}", max_over_min(&res.iter().map(|x| x.alone).collect::<Vec<_>>()))
            };
            let pair_imbalance = max_over_min(&res.iter().map(|x| x.flops).collect::<Vec<_>>());
            let bytes = res.iter().map(|x| x.bytes).max().unwrap_or(0) as f64 / (1 << 20) as f64;
            let peak = res.iter().map(|x| x.peak).max().unwrap_or(0) as f64 / (1 << 20) as f64;
            // Per-rank forward rate over the compute-only blocks (or, without them, over the ring's forward).
            let rate = res.iter().map(|x| x.flops).sum::<f64>()
                / cp as f64
                / (if compute_only { fwd_c } else { fwd } / 1e3)
                / 1e9;
            rate_samples.push(rate);
            let (fwd_c, bwd_c, fwd_x, bwd_x, imbalance) = if compute_only {
                (
                    format!("{fwd_c:.0}"),
                    format!("{bwd_c:.0}"),
                    format!("{:.1}%", 100.0 * (fwd - fwd_c).max(0.0) / fwd),
                    format!("{:.1}%", 100.0 * (bwd - bwd_c).max(0.0) / bwd),
                    format!("{imbalance:.3}"),
                )
            } else {
                ("–".into(), "–".into(), "–".into(), "–".into(), "–".into())
            };
            println!(
                "| {s} | {cp} | {fwd:.0} | {fwd_c} | {fwd_x} | {fwd_w:.1}% | {bwd:.0} | {bwd_c} | {bwd_x} | {bwd_w:.1}% | {alone} | {imbalance} | {pair_imbalance:.3} | {work_imbalance:.3} | {bytes:.1} | {peak:.1} | {rate:.1} |",
            );
        }
    }
    if !lead {
        return;
    }
    if !schedule_rows.is_empty() {
        println!();
        println!(
            "# schedule imbalance: every rank's blocks on ONE set of buffers and data, only the positions differing,"
        );
        println!(
            "# {schedule_reps} repetitions, one block at a time on {cores} threads, ranks interleaved block by block."
        );
        println!(
            "# Per rank: the sum of each block's median; max/min of those, with a bootstrap 95% interval over the"
        );
        println!(
            "# repetitions, and of each block's best. Step 0 (the diagonal) is the same work on every rank, so its"
        );
        println!("# spread is the measure's noise floor. Kernel work: scores the kernels compute per rank (exact).");
        println!("| S | CP | per-rank fwd+bwd ms (medians) | imbalance max/min (medians) | 95% interval | imbalance (best of each block) | step-0 spread | kernel work max/min |");
        println!("|---|---|---|---|---|---|---|---|");
        for (s, cp, samples, work) in &schedule_rows {
            if samples.is_empty() {
                println!("| {s} | {cp} | – | – | – | – | – | {work:.3} |");
                continue;
            }
            let st = ScheduleStats::new(samples);
            let shown: Vec<String> = st.median_totals.iter().map(|t| format!("{:.0}", t * 1e3)).collect();
            println!(
                "| {s} | {cp} | {} | {:.3} | {:.3}–{:.3} | {:.3} | {:.3} | {work:.3} |",
                shown.join(" / "),
                st.median_imbalance,
                st.interval.0,
                st.interval.1,
                st.best_imbalance,
                st.step0_spread
            );
        }
        for (s, cp, samples, _) in schedule_rows.iter().filter(|x| !x.2.is_empty()) {
            for r in 0..*cp {
                let steps: Vec<String> = (0..*cp)
                    .map(|st| {
                        let m = |pass: usize| median(samples.iter().map(|x| x[r][st][pass]).collect()) * 1e3;
                        format!("{:.0}/{:.0}", m(0), m(1))
                    })
                    .collect();
                println!("# schedule S={s} CP={cp} rank {r}: median fwd/bwd per step {}", steps.join(" + "));
            }
        }
    }
    if !alone_rows.is_empty() {
        println!();
        println!(
            "# compute-only blocks timed alone (ms; each block's best of {alone_reps}): per rank the total, then the"
        );
        println!("# forward / backward block of each ring step (step k computes on the KV block of rank r - k)");
        for (s, cp, ranks) in &alone_rows {
            for (r, (total, steps)) in ranks.iter().enumerate() {
                let steps: Vec<String> = steps.iter().map(|[f, b]| format!("{:.0}/{:.0}", f * 1e3, b * 1e3)).collect();
                println!("# S={s} CP={cp} rank {r}: {:.0} = {}", total * 1e3, steps.join(" + "));
            }
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
