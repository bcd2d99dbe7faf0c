//! Attention benchmark: forward and forward+backward time, GFLOP/s, fraction of this machine's peak
//! (measured in the same run) and peak heap memory, over sequence length, head dim, mask and dtype.
//!
//! ```text
//! cargo run --release -p longctx-kernels --example attn_bench                 # the full table
//! cargo run --release -p longctx-kernels --example attn_bench -- --seqs 1024,4096 --dims 128 --causal
//! cargo run --release -p longctx-kernels --example attn_bench -- --seqs 4096 --dims 64 --full --bf16 --reps 5
//! RAYON_NUM_THREADS=1 cargo run --release -p longctx-kernels --example attn_bench -- --seqs 4096 --cpu-time
//! RAYON_NUM_THREADS=1 valgrind --tool=callgrind target/release/examples/attn_bench --seqs 2048 --no-peak --reps 1
//! LONGCTX_PEER_PYTHON=~/venv/bin/python cargo run --release -p longctx-kernels --example attn_bench -- --rounds 3
//! ```
//!
//! **The peer.** When a Python with `torch` is found (`$LONGCTX_PEER_PYTHON`, else `python3`), every row also runs
//! PyTorch's CPU `scaled_dot_product_attention` on the same shape, dtype and thread count through
//! `bench/peer_sdpa.py`, right after our own measurement, and prints both side by side with the ratio.
//! `--rounds R` repeats that pair R times per row, swapping which of the two goes first each round, and prints
//! medians (the ratio is the median of the R paired ratios): on a shared machine the same row's time moves by
//! ±15% from minute to minute, which a single pair cannot tell from a real difference. PyTorch's bf16 backward
//! on CPU runs at about 17 GFLOP/s with AVX2 (a minute per call at S = 4096, D = 64, causal) and about 80 with
//! AVX-512, so it is timed only with `--peer-bf16-backward`.
//! `--no-torch` skips the peer. `--reps N` applies to the peer too (by default each side takes about 1 s of work,
//! a single repetition from S = 4096 at D = 128).
//! `--docs L` packs documents of `L` tokens into each sequence (a query sees only keys of its own document, and
//! with the causal mask only earlier ones): the packed-sequence mask, whose diagonal tiles are masked per element.
//! FLOP counts stay those of the plain mask.
//! `--simd avx2` (or `portable`) caps the attention kernels' instruction set, to compare paths on one machine;
//! the header names the path that runs. `--simd avx2` caps the peer too (`ATEN_CPU_CAPABILITY=avx2`,
//! `ONEDNN_MAX_CPU_ISA=AVX2`, `MKL_ENABLE_INSTRUCTIONS=AVX2`, each unless already set), so an AVX-512 machine
//! shows both sides as they would run on an AVX2-only one; the header prints the capability torch reports.
//!
//! **The peak.** Two figures, both measured at start-up on all threads: a 2048³ f32 GEMM with the `gemm` crate,
//! and the FMA throughput of the kernels' instruction set (independent multiply-add chains in registers: the
//! hardware's ceiling). "% peak" is against the higher of the two, so with `--simd avx2` on an AVX-512 machine it
//! is against the machine's AVX-512 peak.
//! FLOP counts follow the usual convention (also used by `bench/peer_sdpa.py`): forward `4·B·Hq·Sq·Sk·D`,
//! halved for causal; backward 2.5× forward.
//!
//! **On a GPU** (`--device cuda`, built with `--features cuda`; `--device cpu` is the default and everything above):
//! bf16, B = 1, Hq = Hkv = 32, D = 128, S = 8K, 16K, 32K and 64K, causal and full, forward and backward timed apart
//! (the backward on what the forward saved), each the median of up to `--reps` (20) calls fitting about a second
//! after two warm-up calls, timed with the backend's CUDA events. Inputs are random, outputs poisoned with NaN and
//! checked finite after the timed calls. "% GEMM" is against a bf16 `--gemm N` (8192) GEMM through the backend's
//! linear layer (cuBLASLt) in the same run. The peer, `bench/peer_sdpa_gpu.py` (`$LONGCTX_PEER_SCRIPTS`), runs after
//! ours with `$LONGCTX_PEER_PYTHON` (else `python3`, which needs torch with CUDA): PyTorch's
//! `scaled_dot_product_attention` under `sdpa_kernel(FLASH_ATTENTION)` and `sdpa_kernel(CUDNN_ATTENTION)`, timed the
//! same way, with ours/flash and ours/cuDNN per direction; without it, our columns alone and why. `--seqs`,
//! `--dims`, `--hq`, `--hkv`, `--causal`, `--full`, `--no-backward`, `--no-torch` as above. `--device cuda-emulated`
//! runs the same code on the host emulator with tiny sizes (S 128 and 256, 2 heads, one timed call: `--quick`), a
//! smoke test of this path without a GPU. `--compile-only` compiles every kernel for the device (NVRTC, in parallel,
//! into the disk cache: `$LONGCTX_CUDA_CACHE`) and exits; `--compile-for sm_90` does the same for a GPU of that
//! architecture with no GPU (`scripts/gpu-check --pack` ships the cache it fills).
//!
//! ```text
//! cargo run --release -p longctx-kernels --features cuda --example attn_bench -- --device cuda
//! cargo run --release -p longctx-kernels --features cuda --example attn_bench -- --device cuda --seqs 16384 --causal
//! cargo run --release -p longctx-kernels --features cuda --example attn_bench -- --device cuda-emulated
//! ```

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use half::bf16;
use longctx_kernels::attention::{AttnMask, AttnParams, AttnShape};
use longctx_kernels::cpu::SimdPath;
use longctx_kernels::{
    AttnGrads, AttnOut, AttnSaved, Backend, CpuBackend, GradMode, HostSlice, HostSliceMut, Qkv, View, ViewMut,
};

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

/// PyTorch's CPU SDPA through `bench/peer_sdpa.py`, when a Python with `torch` is available.
struct Peer {
    python: String,
    script: std::path::PathBuf,
    /// Variables that cap torch's instruction set to match `--simd avx2` (empty otherwise).
    env: Vec<(&'static str, &'static str)>,
    /// What `torch.backends.cpu.get_cpu_capability()` reports under `env`, e.g. "AVX512".
    capability: String,
    /// Query and key/value heads, as ours.
    heads: (usize, usize),
}

impl Peer {
    fn detect(avx2: bool, heads: (usize, usize)) -> Option<Self> {
        let python = std::env::var("LONGCTX_PEER_PYTHON").unwrap_or_else(|_| "python3".into());
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/peer_sdpa.py");
        let script = script.canonicalize().unwrap_or(script);
        // ATen's vectorised kernels, oneDNN and MKL each choose their instruction set on their own.
        let env: Vec<_> = if avx2 {
            [("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"), ("MKL_ENABLE_INSTRUCTIONS", "AVX2")]
                .into_iter()
                .filter(|(k, _)| std::env::var_os(k).is_none())
                .collect()
        } else {
            Vec::new()
        };
        let out = std::process::Command::new(&python)
            .args(["-c", "import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())"])
            .envs(env.iter().copied())
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())?;
        let capability = String::from_utf8_lossy(&out.stdout).trim().to_string();
        script.exists().then_some(Self { python, script, env, capability, heads })
    }

    /// Forward and forward+backward GFLOP/s of one row (`None` for a part not run or a failed run).
    #[allow(clippy::too_many_arguments)]
    fn row(
        &self,
        s: usize,
        d: usize,
        causal: bool,
        bf: bool,
        backward: bool,
        threads: usize,
        reps: Option<usize>,
    ) -> (Option<f64>, Option<f64>) {
        let mut cmd = std::process::Command::new(&self.python);
        cmd.envs(self.env.iter().copied());
        cmd.arg(&self.script).arg("--rows-only").args(["--seqs", &s.to_string(), "--dims", &d.to_string()]);
        cmd.args(["--threads", &threads.to_string(), "--dtypes", if bf { "bf16" } else { "f32" }]);
        cmd.args(["--hq", &self.heads.0.to_string(), "--hkv", &self.heads.1.to_string()]);
        cmd.arg(if causal { "--causal" } else { "--full" });
        if !backward {
            cmd.arg("--no-backward");
        }
        if let Some(r) = reps {
            cmd.args(["--reps", &r.to_string()]);
        }
        let Ok(out) = cmd.output() else { return (None, None) };
        let text = String::from_utf8_lossy(&out.stdout);
        let Some(line) = text.lines().find(|l| l.starts_with("| ")) else { return (None, None) };
        let cols: Vec<&str> = line.split('|').map(str::trim).collect();
        (cols.get(6).and_then(|x| x.parse().ok()), cols.get(8).and_then(|x| x.parse().ok()))
    }
}

/// Median of the finite values (NaN if there are none).
fn median(x: &[f64]) -> f64 {
    let mut x: Vec<f64> = x.iter().copied().filter(|v| v.is_finite()).collect();
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

/// A figure with `prec` decimals, or a dash when it is missing.
fn fmt(x: f64, prec: usize) -> String {
    if x.is_finite() {
        format!("{x:.prec$}")
    } else {
        "–".into()
    }
}

/// A share of the peak, or a dash without one.
fn pct(x: f64, peak: f64) -> String {
    if (x / peak).is_finite() {
        format!("{:.0}%", 100.0 * x / peak)
    } else {
        "–".into()
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        // The module docs are the usage text.
        let doc: String = include_str!("attn_bench.rs")
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .map(|l| format!("{}\n", l.trim_start_matches("//!").strip_prefix(' ').unwrap_or("")))
            .collect();
        print!("{doc}");
        return;
    }
    if let Some(i) = args.iter().position(|a| a == "--compile-for") {
        // No device: NVRTC compiles for the named architecture into the disk cache.
        let Some(arch) = args.get(i + 1) else {
            eprintln!("attn_bench: --compile-for needs an architecture, e.g. sm_90");
            std::process::exit(2);
        };
        match longctx_kernels::CudaBackend::precompile(arch) {
            Ok(n) => println!("# {n} kernel sources compiled for {arch} (or found) in the disk cache"),
            Err(e) => {
                eprintln!("attn_bench: --compile-for {arch}: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    match common::DeviceKind::from_args(&args) {
        Ok(common::DeviceKind::Cpu) => {}
        Ok(kind) => {
            if let Err(e) = on_device::main(&args, kind) {
                eprintln!("attn_bench: {e}");
                std::process::exit(1);
            }
            return;
        }
        Err(e) => {
            eprintln!("attn_bench: {e}");
            std::process::exit(2);
        }
    }
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
    let docs = arg_list(&args, "--docs", &[]).first().copied().filter(|&l| l > 0);
    // `--reps N`: a fixed number of timed repetitions (the minimum is reported); more of them filter out
    // bursts of load from other processes on a shared machine.
    let cpu = args.iter().any(|a| a == "--cpu-time");
    let reps_override = arg_list(&args, "--reps", &[]).first().copied().filter(|&r| r > 0);
    // `--hq N`: query heads (default 8; the trainer's bench model has 4). `--hkv N`: KV heads (default 2; equal
    // to Hq = no grouping, every K/V tile used by one query head).
    let hq = arg_list(&args, "--hq", &[8]).first().copied().unwrap_or(8);
    let hkv = arg_list(&args, "--hkv", &[2]).first().copied().unwrap_or(2);
    if hq == 0 || hkv == 0 || hq % hkv != 0 {
        eprintln!("--hkv must divide --hq (default 8)");
        std::process::exit(2);
    }
    let simd_arg = args.iter().position(|a| a == "--simd").and_then(|i| args.get(i + 1)).map(String::as_str);
    let simd = match simd_arg {
        None | Some("avx512") => SimdPath::Avx512,
        Some("portable") => SimdPath::Portable,
        Some("avx2") => SimdPath::Avx2,
        Some(other) => {
            eprintln!("--simd takes portable, avx2 or avx512, not {other}");
            std::process::exit(2);
        }
    }
    .clamp_supported();
    let batch = 1;
    let threads = rayon::current_num_threads();
    // `--no-peak`: skip the peak (e.g. under valgrind, where it dominates); "% peak" then shows a dash.
    let (gemm, fma) = if args.iter().any(|a| a == "--no-peak") {
        (f64::NAN, None)
    } else {
        (gemm_peak(), longctx_kernels::cpu::fma_peak_flops(simd).map(|f| f / 1e9))
    };
    let peak = fma.map_or(gemm, |f| f.max(gemm));
    let rounds = arg_list(&args, "--rounds", &[1]).first().copied().unwrap_or(1).max(1);
    let peer =
        if args.iter().any(|a| a == "--no-torch") { None } else { Peer::detect(simd_arg == Some("avx2"), (hq, hkv)) };
    let peer_bf16_bwd = args.iter().any(|a| a == "--peer-bf16-backward");
    println!("# longctx attention benchmark: B={batch} Hq={hq} Hkv={hkv}, {threads} threads, {simd:?} kernels",);
    if peak.is_finite() {
        let fma = fma.map_or("not measured (portable path)".into(), |f| format!("{f:.1} GFLOP/s"));
        println!(
            "# machine peak, same run, all threads: gemm crate 2048^3 f32 {gemm:.1} GFLOP/s; {simd:?} FMA chains {fma}; % peak is against the higher",
        );
    } else {
        println!("# machine peak: not measured (--no-peak)");
    }
    match &peer {
        Some(p) => println!(
            "# peer: PyTorch {} CPU SDPA ({} {}{}), same shapes and threads, alternating with ours, {rounds} round(s) per row{}",
            p.capability,
            p.python,
            p.script.display(),
            p.env.iter().map(|(k, v)| format!(" {k}={v}")).collect::<String>(),
            if rounds > 1 { "; figures are medians over the rounds" } else { "" }
        ),
        None => println!("# peer: none (no Python with torch; set LONGCTX_PEER_PYTHON), {rounds} round(s) per row"),
    }
    let peer_head = if peer.is_some() {
        " PyTorch fwd GFLOP/s | PyTorch fwd+bwd GFLOP/s | fwd ours/PyTorch | fwd+bwd ours/PyTorch |"
    } else {
        ""
    };
    println!(
        "| S | D | mask | dtype | fwd ms | fwd GFLOP/s | fwd % peak | fwd+bwd ms | fwd+bwd GFLOP/s | fwd+bwd % peak | peak MiB | inputs MiB |{peer_head}"
    );
    println!(
        "|---|---|---|---|---|---|---|---|---|---|---|---|{}",
        if peer.is_some() { "---|---|---|---|" } else { "" }
    );
    for &s in &seqs {
        for &d in &dims {
            for &causal in &masks {
                for &bf in &dtypes {
                    let shape = AttnShape { batch, q_heads: hq, kv_heads: hkv, q_len: s, kv_len: s, head_dim: d };
                    let flops = 4.0 * (batch * hq * s * s * d) as f64 * if causal { 0.5 } else { 1.0 };
                    // Enough repetitions for about a second of work, at least one.
                    let reps = reps_override.unwrap_or(((2e11 / flops) as usize).clamp(1, 20));
                    let peer_bwd = !no_bwd && (!bf || peer_bf16_bwd);
                    let (mut fwd, mut fb, mut peer_fwd, mut peer_fb) = (vec![], vec![], vec![], vec![]);
                    let (mut peak_mem, mut inputs) = (0, 0);
                    for round in 0..rounds {
                        // The peer goes first in odd rounds, so a drift in the machine's speed favours neither.
                        let run_peer = |pf: &mut Vec<f64>, pfb: &mut Vec<f64>| {
                            if let Some(p) = &peer {
                                let (f, b) = p.row(s, d, causal, bf, peer_bwd, threads, reps_override);
                                pf.push(f.unwrap_or(f64::NAN));
                                pfb.push(b.unwrap_or(f64::NAN));
                            }
                        };
                        if round % 2 == 1 {
                            run_peer(&mut peer_fwd, &mut peer_fb);
                        }
                        let m = measure(simd, shape, causal, docs, bf, reps, no_bwd, cpu, threads);
                        (peak_mem, inputs) = (m.peak_mem, m.inputs);
                        fwd.push(m.fwd);
                        fb.push(m.fwd + m.bwd);
                        if round % 2 == 0 {
                            run_peer(&mut peer_fwd, &mut peer_fb);
                        }
                    }
                    let gf = |t: &[f64], mult: f64| t.iter().map(|t| mult * flops / t / 1e9).collect::<Vec<_>>();
                    let (fwd_gfs, fb_gfs) = (gf(&fwd, 1.0), gf(&fb, 3.5));
                    let ratios = |ours: &[f64], theirs: &[f64]| {
                        median(&ours.iter().zip(theirs).map(|(a, b)| a / b).collect::<Vec<_>>())
                    };
                    let (fwd_ms, fwd_gf) = (median(&fwd) * 1e3, median(&fwd_gfs));
                    // With `--no-backward` the forward+backward columns are dashes, not NaN.
                    let fb_cols = if no_bwd {
                        "– | – | –".to_string()
                    } else {
                        let fb_gf = median(&fb_gfs);
                        format!("{} | {} | {}", fmt(median(&fb) * 1e3, 1), fmt(fb_gf, 1), pct(fb_gf, peak))
                    };
                    let peer_cols = if peer.is_some() {
                        format!(
                            " {} | {} | {} | {} |",
                            fmt(median(&peer_fwd), 1),
                            fmt(median(&peer_fb), 1),
                            fmt(ratios(&fwd_gfs, &peer_fwd), 2),
                            fmt(ratios(&fb_gfs, &peer_fb), 2),
                        )
                    } else {
                        String::new()
                    };
                    println!(
                        "| {s} | {d} | {} | {} | {} | {} | {} | {fb_cols} | {:.1} | {:.1} |{peer_cols}",
                        match (causal, docs) {
                            (true, None) => "causal".to_string(),
                            (false, None) => "full".to_string(),
                            (true, Some(l)) => format!("causal docs {l}"),
                            (false, Some(l)) => format!("docs {l}"),
                        },
                        if bf { "bf16" } else { "f32" },
                        fmt(fwd_ms, 1),
                        fmt(fwd_gf, 1),
                        pct(fwd_gf, peak),
                        peak_mem as f64 / (1 << 20) as f64,
                        inputs as f64 / (1 << 20) as f64,
                    );
                }
            }
        }
    }
}

/// One row's timings (best of `reps`) and memory.
struct Measured {
    fwd: f64,
    /// NaN when the backward was not run.
    bwd: f64,
    peak_mem: usize,
    inputs: usize,
}

#[allow(clippy::too_many_arguments)]
fn measure(
    simd: SimdPath,
    shape: AttnShape,
    causal: bool,
    docs: Option<usize>,
    bf: bool,
    reps: usize,
    no_bwd: bool,
    cpu: bool,
    threads: usize,
) -> Measured {
    let mut mask = if causal { AttnMask::causal() } else { AttnMask::full() };
    let doc_ids: Vec<u32> = docs.map_or(Vec::new(), |l| (0..shape.q_len).map(|i| (i / l) as u32).collect());
    if docs.is_some() {
        mask = mask.with_docs(&doc_ids, &doc_ids);
    }
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
    // The kernels run through the CPU backend limited to `simd`, on the calling thread's pool; the views are
    // made inside the timed calls (they only borrow the buffers).
    let backend = CpuBackend::new().with_simd(simd);
    let (qd, kd, ld) = (shape.q_dims(), shape.kv_dims(), shape.lse_dims());
    let opts = p.options();
    let qkv = Qkv::new(
        View::host(q.view(), qd).unwrap(),
        View::host(k.view(), kd).unwrap(),
        View::host(v.view(), kd).unwrap(),
    );
    let dout = View::host(d_o.view(), qd).unwrap();
    let mut fwd = f64::MAX;
    for _ in 0..reps {
        let t = timed(cpu, threads, || {
            let out = AttnOut { o: ViewMut::host(o.view_mut(), qd).unwrap(), lse: ViewMut::new(&mut lse, ld).unwrap() };
            backend.attention_forward(&opts, out, qkv).expect("forward")
        });
        fwd = fwd.min(t);
    }
    let mut bwd = f64::NAN;
    if !no_bwd {
        bwd = f64::MAX;
        for _ in 0..reps {
            let t = timed(cpu, threads, || {
                let saved = AttnSaved { qkv, o: View::host(o.view(), qd).unwrap(), lse: View::new(&lse, ld).unwrap() };
                let grads = AttnGrads {
                    dq: ViewMut::host(dq.view_mut(), qd).unwrap(),
                    dk: ViewMut::host(dk.view_mut(), kd).unwrap(),
                    dv: ViewMut::host(dv.view_mut(), kd).unwrap(),
                };
                backend.attention_backward(&opts, grads, dout, saved, GradMode::Overwrite).expect("backward")
            });
            bwd = bwd.min(t);
        }
    }
    Measured { fwd, bwd, peak_mem: PEAK.load(Ordering::Relaxed) - base, inputs }
}

/// `--device cuda|cuda-emulated`: our attention on the CUDA backend beside PyTorch's SDPA on the same GPU (see the
/// module docs, "On a GPU").
mod on_device {
    use std::collections::HashMap;
    use std::time::Duration;

    use longctx_kernels::attention::{AttnMask, AttnParams, AttnShape};
    use longctx_kernels::{AttnGrads, AttnOut, AttnSaved, DType, GradMode, Qkv, Result};

    use super::common::{self, Device, DeviceKind, Timed};

    /// One row's figures: forward and backward times, or why the row failed.
    struct Row {
        s: usize,
        d: usize,
        causal: bool,
        fwd: Option<Timed>,
        bwd: Option<Timed>,
        error: Option<String>,
    }

    /// PyTorch's TFLOP/s for one row: flash forward, flash backward, cuDNN forward, cuDNN backward (NaN: failed or
    /// not run).
    type PeerRow = [f64; 4];

    struct Options {
        seqs: Vec<usize>,
        dims: Vec<usize>,
        hq: usize,
        hkv: usize,
        masks: Vec<bool>,
        backward: bool,
        gemm: usize,
        warmup: usize,
        budget: Duration,
        reps: (usize, usize),
        peer: bool,
    }

    fn options(args: &[String], kind: DeviceKind) -> std::result::Result<Options, String> {
        // The emulator runs one fiber per CUDA thread: tiny sizes, one timed repetition.
        let quick = kind == DeviceKind::CudaEmulated || args.iter().any(|a| a == "--quick");
        let seqs = common::arg_list(args, "--seqs", if quick { &[128, 256] } else { &[8192, 16384, 32768, 65536] })?;
        let dims = common::arg_list(args, "--dims", &[128])?;
        let hq = common::arg(args, "--hq", if quick { 2 } else { 32 })?;
        let hkv = common::arg(args, "--hkv", hq)?;
        if hq == 0 || hkv == 0 || hq % hkv != 0 || seqs.contains(&0) || dims.contains(&0) {
            return Err("--hkv must divide --hq, and every size must be positive".into());
        }
        let masks = if args.iter().any(|a| a == "--causal") {
            vec![true]
        } else if args.iter().any(|a| a == "--full") {
            vec![false]
        } else {
            vec![true, false]
        };
        let max_reps = common::arg(args, "--reps", if quick { 1 } else { 20 })?.max(1);
        Ok(Options {
            seqs,
            dims,
            hq,
            hkv,
            masks,
            backward: !args.iter().any(|a| a == "--no-backward"),
            gemm: common::arg(args, "--gemm", if quick { 128 } else { 8192 })?,
            warmup: if quick { 1 } else { 2 },
            budget: Duration::from_secs_f64(if quick { 0.0 } else { 1.0 }),
            reps: (if quick { 1 } else { 3 }.min(max_reps), max_reps),
            peer: !args.iter().any(|a| a == "--no-torch"),
        })
    }

    /// Forward FLOPs of a row (`4·B·Hq·S²·D`, halved for causal); the backward counts 2.5 times as many.
    fn fwd_flops(o: &Options, s: usize, d: usize, causal: bool) -> f64 {
        4.0 * (o.hq * s * s * d) as f64 * if causal { 0.5 } else { 1.0 }
    }

    /// TFLOP/s of a bf16 GEMM `[n, n]·[n, n]ᵀ` through the backend's linear layer (cuBLASLt on a GPU): the peak
    /// the rows are a fraction of.
    pub(crate) fn gemm_peak(dev: &Device, o: (usize, usize, Duration, (usize, usize))) -> Result<f64> {
        let (n, warmup, budget, reps) = o;
        let b = dev.backend();
        let x = common::random(dev, DType::Bf16, &[n, n], 11, 1.0)?;
        let w = common::random(dev, DType::Bf16, &[n, n], 12, 0.05)?;
        let mut y = common::poisoned(dev, DType::Bf16, &[n, n])?;
        let t =
            common::measure(dev, warmup, budget, reps, || b.linear_forward(y.view_mut(), x.view(), w.view(), None))?;
        common::check_finite(dev, "the GEMM", &[y.view()])?;
        Ok(2.0 * (n as f64).powi(3) / t.secs() / 1e12)
    }

    /// Times one row's forward, then its backward on what the forward saved.
    fn run_row(dev: &Device, o: &Options, s: usize, d: usize, causal: bool) -> Result<(Timed, Option<Timed>)> {
        let shape = AttnShape { batch: 1, q_heads: o.hq, kv_heads: o.hkv, q_len: s, kv_len: s, head_dim: d };
        let p = AttnParams::new(shape).with_mask(if causal { AttnMask::causal() } else { AttnMask::full() });
        let opts = p.options();
        let (qd, kd, ld) = (shape.q_dims(), shape.kv_dims(), shape.lse_dims());
        let bf = DType::Bf16;
        let q = common::random(dev, bf, &qd, 1, 1.0)?;
        let k = common::random(dev, bf, &kd, 2, 1.0)?;
        let v = common::random(dev, bf, &kd, 3, 1.0)?;
        let (mut out, mut lse) = (common::poisoned(dev, bf, &qd)?, common::poisoned(dev, DType::F32, &ld)?);
        let b = dev.backend();
        let qkv = Qkv::new(q.view(), k.view(), v.view());
        let fwd = common::measure(dev, o.warmup, o.budget, o.reps, || {
            b.attention_forward(&opts, AttnOut { o: out.view_mut(), lse: lse.view_mut() }, qkv)
        })?;
        common::check_finite(dev, "the forward", &[out.view(), lse.view()])?;
        if !o.backward {
            return Ok((fwd, None));
        }
        let dout = common::random(dev, bf, &qd, 4, 1.0)?;
        let (mut dq, mut dk, mut dv) =
            (common::poisoned(dev, bf, &qd)?, common::poisoned(dev, bf, &kd)?, common::poisoned(dev, bf, &kd)?);
        let bwd = common::measure(dev, o.warmup, o.budget, o.reps, || {
            let saved = AttnSaved { qkv, o: out.view(), lse: lse.view() };
            let grads = AttnGrads { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut() };
            b.attention_backward(&opts, grads, dout.view(), saved, GradMode::Overwrite)
        })?;
        common::check_finite(dev, "the backward", &[dq.view(), dk.view(), dv.view()])?;
        Ok((fwd, Some(bwd)))
    }

    /// What the peer ran, and its rows by `(S, D, causal)`.
    struct Peer {
        who: String,
        rows: HashMap<(usize, usize, bool), PeerRow>,
    }

    /// PyTorch's rows from `bench/peer_sdpa_gpu.py` (one run for every row), or why there are none.
    fn peer(o: &Options) -> std::result::Result<Peer, String> {
        let (python, torch) = common::python_with_cuda_torch()?;
        let script = common::peer_script("peer_sdpa_gpu.py")?;
        let list = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
        let masks: Vec<&str> = o.masks.iter().map(|&c| if c { "causal" } else { "full" }).collect();
        let mut args = vec!["--seqs".to_string(), list(&o.seqs), "--dims".into(), list(&o.dims)];
        args.extend(["--hq".into(), o.hq.to_string(), "--hkv".into(), o.hkv.to_string()]);
        args.extend(["--masks".into(), masks.join(","), "--max-reps".into(), o.reps.1.to_string()]);
        args.extend(["--budget".into(), o.budget.as_secs_f64().to_string()]);
        if !o.backward {
            args.push("--no-backward".into());
        }
        let out = common::run_peer(&python, &script, &args)?;
        let mut rows = HashMap::new();
        for line in out.lines().filter(|l| !l.starts_with('#')) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if let [s, d, mask, rest @ ..] = f.as_slice() {
                if let (Ok(s), Ok(d), [a, b, c, e]) = (s.parse(), d.parse(), rest) {
                    let v = [a, b, c, e].map(|x| x.parse::<f64>().unwrap_or(f64::NAN));
                    rows.insert((s, d, *mask == "causal"), v);
                }
            }
        }
        Ok(Peer { who: format!("PyTorch {torch} ({python} {})", script.display()), rows })
    }

    pub(crate) fn main(args: &[String], kind: DeviceKind) -> std::result::Result<(), String> {
        let o = options(args, kind)?;
        let dev = Device::open(kind).map_err(|e| e.to_string())?;
        if args.iter().any(|a| a == "--compile-only") {
            // Device::open compiled every kernel (and filled the disk cache): what scripts/gpu-check's run does first.
            println!("# {}: every kernel compiled", dev.describe());
            return Ok(());
        }
        let peak = gemm_peak(&dev, (o.gemm, o.warmup, o.budget, o.reps)).map_err(|e| format!("GEMM: {e}"))?;
        println!(
            "# longctx attention benchmark on {} ({}): bf16, B=1, Hq={} Hkv={}; TFLOP/s count causal as half, backward \
             as 2.5x forward; median of up to {} timed calls after {} warm-up",
            dev.describe(),
            dev.attention_kernels(),
            o.hq,
            o.hkv,
            o.reps.1,
            o.warmup
        );
        println!(
            "# peak: bf16 GEMM {n}x{n}x{n} through the backend's linear layer, same run: {} TFLOP/s",
            common::rate(peak),
            n = o.gemm
        );
        let mut rows = Vec::new();
        for &s in &o.seqs {
            for &d in &o.dims {
                for &causal in &o.masks {
                    let (fwd, bwd, error) = match run_row(&dev, &o, s, d, causal) {
                        Ok((f, b)) => (Some(f), b, None),
                        Err(e) => (None, None, Some(e.to_string())),
                    };
                    // As each row is measured (the table comes after the peer): what a run cut short still shows.
                    let mask = if causal { "causal" } else { "full" };
                    match (&error, fwd) {
                        (Some(e), _) => eprintln!("attn_bench: S={s} D={d} {mask}: {e}"),
                        (None, Some(f)) => eprintln!(
                            "attn_bench: S={s} D={d} {mask}: forward {:.3} ms, backward {} ms",
                            f.secs() * 1e3,
                            bwd.map_or("–".into(), |b| format!("{:.3}", b.secs() * 1e3))
                        ),
                        (None, None) => {}
                    }
                    rows.push(Row { s, d, causal, fwd, bwd, error });
                }
            }
        }
        // The peer needs the GPU's memory, which our pool keeps until asked.
        dev.trim().map_err(|e| e.to_string())?;
        let peer = if o.peer { peer(&o) } else { Err("--no-torch".into()) };
        match &peer {
            Ok(p) => println!("# peer: {}: SDPA with the flash and the cuDNN backends, same shapes, after ours", p.who),
            Err(why) => println!("# peer: none ({why})"),
        }
        let with_peer = peer.is_ok();
        print!("| S | D | mask | fwd ms | fwd TFLOP/s | fwd % GEMM | bwd ms | bwd TFLOP/s | bwd % GEMM |");
        if with_peer {
            print!(" flash fwd | flash bwd | cuDNN fwd | cuDNN bwd | fwd ours/flash | bwd ours/flash | fwd ours/cuDNN | bwd ours/cuDNN |");
        }
        println!(
            "\n|---|---|---|---|---|---|---|---|---|{}",
            if with_peer { "---|---|---|---|---|---|---|---|" } else { "" }
        );
        let mut failed = 0;
        for r in &rows {
            let mask = if r.causal { "causal" } else { "full" };
            if let Some(e) = &r.error {
                failed += 1;
                println!("| {} | {} | {mask} | failed: {e} |", r.s, r.d);
                continue;
            }
            let flops = fwd_flops(&o, r.s, r.d, r.causal);
            let rate = |t: Option<Timed>, mult: f64| t.map_or(f64::NAN, |t| mult * flops / t.secs() / 1e12);
            let ms = |t: Option<Timed>| t.map_or(f64::NAN, |t| t.secs() * 1e3);
            let (f, b) = (rate(r.fwd, 1.0), rate(r.bwd, 2.5));
            print!(
                "| {} | {} | {mask} | {} | {} | {} | {} | {} | {} |",
                r.s,
                r.d,
                common::fmt(ms(r.fwd), 2),
                common::rate(f),
                common::pct(f, peak),
                common::fmt(ms(r.bwd), 2),
                common::rate(b),
                common::pct(b, peak)
            );
            if let Ok(p) = &peer {
                let t = p.rows.get(&(r.s, r.d, r.causal)).copied().unwrap_or([f64::NAN; 4]);
                print!(
                    " {} | {} | {} | {} | {} | {} | {} | {} |",
                    common::rate(t[0]),
                    common::rate(t[1]),
                    common::rate(t[2]),
                    common::rate(t[3]),
                    common::fmt(f / t[0], 2),
                    common::fmt(b / t[1], 2),
                    common::fmt(f / t[2], 2),
                    common::fmt(b / t[3], 2)
                );
            }
            println!();
        }
        if failed > 0 {
            return Err(format!("{failed} row(s) failed"));
        }
        Ok(())
    }
}
