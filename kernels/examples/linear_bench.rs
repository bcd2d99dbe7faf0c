//! Linear-layer benchmark: GFLOP/s of the three products of a linear layer (`Y = X·Wᵀ`, `dX = dY·W`,
//! `dW = dYᵀ·X`) through the CPU backend, beside PyTorch's (MKL) on the same shapes and threads, against the
//! machine's FMA ceiling measured in the same run.
//!
//! ```text
//! cargo run --release -p longctx-kernels --example linear_bench                      # the trainer's bench model
//! cargo run --release -p longctx-kernels --example linear_bench -- --tokens 16384 --shapes 4096x4096
//! LONGCTX_PEER_PYTHON=~/venv/bin/python cargo run --release -p longctx-kernels --example linear_bench
//! ```
//!
//! `--shapes IN×OUT,...` (default: the bench model's projections, d 256 with 4/2 heads of 64 and SwiGLU 688);
//! `--tokens T` rows of `X`; `--reps N` repetitions per product, the best kept. **The peer**: when a Python with
//! `torch` is found (`$LONGCTX_PEER_PYTHON`, else `python3`), `bench/peer_linear.py` times `x @ w.t()`,
//! `dy @ w` and `dy.t() @ x` on the same shapes after ours; `ours/PyTorch` is the ratio of the rates.
//!
//! **On a GPU** (`--device cuda`, built with `--features cuda`; `--device cpu` is the default and everything above):
//! bf16 at the trainer's shapes (Llama 3 8B: `--tokens 16384`, `4096x4096,4096x14336,14336x4096,4096x128256`), in
//! TFLOP/s, beside PyTorch's `x @ w.t()`, `dy @ w` and `dy.t() @ x` on the same GPU (cuBLAS;
//! `bench/peer_linear_gpu.py`, run after ours with `$LONGCTX_PEER_PYTHON`, else `python3`; scripts from
//! `$LONGCTX_PEER_SCRIPTS`). Each figure is the median of up to `--reps` (20) calls fitting about a second after two
//! warm-up calls, timed with the backend's CUDA events; inputs are random, outputs poisoned and checked finite.
//! The backward is timed whole (`dX` and `dW`, as the trainer calls it) and with `dW` alone; `dX` is their
//! difference, so it is the product the backward runs. `--device cuda-emulated` runs the same code on the host
//! emulator with tiny shapes (`--tokens 64 --shapes 64x32,32x96`, one timed call), a smoke test without a GPU.
//!
//! ```text
//! cargo run --release -p longctx-kernels --features cuda --example linear_bench -- --device cuda
//! cargo run --release -p longctx-kernels --features cuda --example linear_bench -- --device cuda-emulated
//! ```

mod common;

use std::time::Instant;

use longctx_kernels::cpu::{fma_peak_flops, SimdPath};
use longctx_kernels::{Backend, CpuBackend, GradMode, LinearGrads, LinearSaved, Result, View, ViewMut};

struct Args {
    tokens: usize,
    shapes: Vec<(usize, usize)>,
    reps: usize,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut a = Args { tokens: 4096, shapes: vec![(256, 256), (256, 128), (256, 688), (688, 256)], reps: 20 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--device" => {
                value()?;
            }
            "--tokens" => a.tokens = value()?.parse().map_err(|e| format!("--tokens: {e}"))?,
            "--reps" => a.reps = value()?.parse().map_err(|e| format!("--reps: {e}"))?,
            "--shapes" => {
                a.shapes = value()?
                    .split(',')
                    .map(|s| {
                        let (i, o) = s.split_once('x').ok_or(format!("--shapes: `{s}` is not INxOUT"))?;
                        Ok((
                            i.parse().map_err(|e| format!("--shapes {s}: {e}"))?,
                            o.parse().map_err(|e| format!("--shapes {s}: {e}"))?,
                        ))
                    })
                    .collect::<std::result::Result<_, String>>()?
            }
            _ => return Err(format!("unknown argument {flag} (see the example's docs)")),
        }
    }
    if a.tokens == 0 || a.reps == 0 || a.shapes.iter().any(|&(i, o)| i == 0 || o == 0) {
        return Err("--tokens, --reps and every shape must be positive".into());
    }
    Ok(a)
}

/// Best seconds of `reps` calls of `f`.
fn best_of(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// PyTorch's fwd, dX, dW GFLOP/s per shape, or `None` without a Python with torch.
fn peer(a: &Args) -> Option<Vec<[f64; 3]>> {
    let python = std::env::var("LONGCTX_PEER_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/peer_linear.py");
    let shapes: Vec<String> = a.shapes.iter().map(|(i, o)| format!("{i}x{o}")).collect();
    let out = std::process::Command::new(python)
        .arg(script)
        .args(["--tokens", &a.tokens.to_string(), "--reps", &a.reps.to_string()])
        .args(["--threads", &rayon::current_num_threads().to_string(), "--shapes", &shapes.join(",")])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let rows: Vec<[f64; 3]> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let v: Vec<f64> = l.split_whitespace().skip(2).filter_map(|x| x.parse().ok()).collect();
            (v.len() == 3).then(|| [v[0], v[1], v[2]])
        })
        .collect();
    (rows.len() == a.shapes.len()).then_some(rows)
}

fn main() -> Result<()> {
    let all: Vec<String> = std::env::args().skip(1).collect();
    if all.iter().any(|a| a == "--help" || a == "-h") {
        // The module docs are the usage text.
        let doc: String = include_str!("linear_bench.rs")
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .map(|l| format!("{}\n", l.trim_start_matches("//!").strip_prefix(' ').unwrap_or("")))
            .collect();
        print!("{doc}");
        return Ok(());
    }
    match common::DeviceKind::from_args(&all) {
        Ok(common::DeviceKind::Cpu) => {}
        Ok(kind) => {
            if let Err(e) = on_device::main(&all, kind) {
                eprintln!("linear_bench: {e}");
                std::process::exit(1);
            }
            return Ok(());
        }
        Err(e) => {
            eprintln!("linear_bench: {e}");
            std::process::exit(2);
        }
    }
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("linear_bench: {e}");
            std::process::exit(2);
        }
    };
    let cpu = CpuBackend::new();
    let peak = fma_peak_flops(SimdPath::detect()).map_or(f64::NAN, |f| f / 1e9);
    let mut ours = Vec::new();
    for &(d_in, d_out) in &a.shapes {
        let t = a.tokens;
        let fill = |n: usize, s: f32| (0..n).map(|i| ((i * 7919 % 2003) as f32 / 1001.0 - 1.0) * s).collect::<Vec<_>>();
        let (x, w, dy) = (fill(t * d_in, 1.0), fill(d_out * d_in, 0.05), fill(t * d_out, 1.0));
        let (mut y, mut dx, mut dw) = (vec![0f32; t * d_out], vec![0f32; t * d_in], vec![0f32; d_out * d_in]);
        let (xv, wv, dyv) = (View::new(&x, [t, d_in])?, View::new(&w, [d_out, d_in])?, View::new(&dy, [t, d_out])?);
        let fwd = best_of(a.reps, || cpu.linear_forward(ViewMut::new(&mut y, [t, d_out])?, xv, wv, None))?;
        // dX alone: `linear_backward` always computes dW too, so dX is timed as the product it runs for it,
        // `dY·W`, here as a linear layer of the transposed weight (the same tiled `gemm` call). Timed as the
        // difference of two backward calls it read past the FMA ceiling whenever a repetition of the longer call
        // was disturbed.
        let wt: Vec<f32> = (0..d_in * d_out).map(|i| w[(i % d_out) * d_in + i / d_out]).collect();
        let wtv = View::new(&wt, [d_in, d_out])?;
        let dx_only = best_of(a.reps, || cpu.linear_forward(ViewMut::new(&mut dx, [t, d_in])?, dyv, wtv, None))?;
        let dw_only = best_of(a.reps, || {
            let g = LinearGrads { dx: None, dw: ViewMut::new(&mut dw, [d_out, d_in])?, dbias: None };
            cpu.linear_backward(g, dyv, LinearSaved { x: xv }, wv, GradMode::Overwrite)
        })?;
        let flops = 2.0 * (t * d_in * d_out) as f64 / 1e9;
        ours.push([flops / fwd, flops / dx_only, flops / dw_only]);
    }
    let theirs = peer(&a);
    println!(
        "# linear_bench: {} threads; FMA ceiling measured here {peak:.1} GFLOP/s; best of {} per product",
        rayon::current_num_threads(),
        a.reps
    );
    match &theirs {
        Some(_) => println!("# peer: PyTorch (bench/peer_linear.py), same shapes and threads, after ours"),
        None => println!("# peer: none (no Python with torch; set LONGCTX_PEER_PYTHON)"),
    }
    println!("| T | IN → OUT | fwd | dX | dW | PyTorch fwd | dX | dW | ours/PyTorch fwd | dX | dW |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (i, &(d_in, d_out)) in a.shapes.iter().enumerate() {
        let o = ours[i];
        let (p, r) = match &theirs {
            Some(t) => (t[i].map(|v| format!("{v:.1}")), [0, 1, 2].map(|j| format!("{:.2}", o[j] / t[i][j]))),
            None => (["–".to_string(), "–".into(), "–".into()], ["–".to_string(), "–".into(), "–".into()]),
        };
        println!(
            "| {} | {d_in} → {d_out} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} |",
            a.tokens, o[0], o[1], o[2], p[0], p[1], p[2], r[0], r[1], r[2]
        );
    }
    Ok(())
}

/// `--device cuda|cuda-emulated`: the backend's linear layer on the CUDA backend beside PyTorch's products on the
/// same GPU (see the module docs, "On a GPU").
mod on_device {
    use std::time::Duration;

    use longctx_kernels::{DType, GradMode, LinearGrads, LinearSaved, Result};

    use super::common::{self, Device, DeviceKind, Timed};

    struct Options {
        tokens: usize,
        shapes: Vec<(usize, usize)>,
        warmup: usize,
        budget: Duration,
        reps: (usize, usize),
        peer: bool,
    }

    fn options(args: &[String], kind: DeviceKind) -> std::result::Result<Options, String> {
        let quick = kind == DeviceKind::CudaEmulated || args.iter().any(|a| a == "--quick");
        let default = if quick { "64x32,32x96" } else { "4096x4096,4096x14336,14336x4096,4096x128256" };
        let shapes = common::arg(args, "--shapes", default.to_string())?
            .split(',')
            .map(|s| {
                let (i, o) = s.split_once('x').ok_or(format!("--shapes: `{s}` is not INxOUT"))?;
                Ok((
                    i.parse().map_err(|e| format!("--shapes {s}: {e}"))?,
                    o.parse().map_err(|e| format!("--shapes {s}: {e}"))?,
                ))
            })
            .collect::<std::result::Result<Vec<(usize, usize)>, String>>()?;
        let tokens = common::arg(args, "--tokens", if quick { 64 } else { 16384 })?;
        if tokens == 0 || shapes.iter().any(|&(i, o)| i == 0 || o == 0) {
            return Err("--tokens and every shape must be positive".into());
        }
        let max_reps = common::arg(args, "--reps", if quick { 1 } else { 20 })?.max(1);
        Ok(Options {
            tokens,
            shapes,
            warmup: if quick { 1 } else { 2 },
            budget: Duration::from_secs_f64(if quick { 0.0 } else { 1.0 }),
            reps: (if quick { 1 } else { 3 }.min(max_reps), max_reps),
            peer: !args.iter().any(|a| a == "--no-torch"),
        })
    }

    /// One shape's times: forward, backward (dX and dW), dW alone.
    struct Times {
        fwd: Timed,
        bwd: Timed,
        dw: Timed,
    }

    fn run_shape(dev: &Device, o: &Options, d_in: usize, d_out: usize) -> Result<Times> {
        let (t, bf, b) = (o.tokens, DType::Bf16, dev.backend());
        let x = common::random(dev, bf, &[t, d_in], 1, 1.0)?;
        let w = common::random(dev, bf, &[d_out, d_in], 2, 0.05)?;
        let dy = common::random(dev, bf, &[t, d_out], 3, 1.0)?;
        let mut y = common::poisoned(dev, bf, &[t, d_out])?;
        let fwd = common::measure(dev, o.warmup, o.budget, o.reps, || {
            b.linear_forward(y.view_mut(), x.view(), w.view(), None)
        })?;
        common::check_finite(dev, "the forward", &[y.view()])?;
        drop(y);
        let (mut dx, mut dw) = (common::poisoned(dev, bf, &[t, d_in])?, common::poisoned(dev, bf, &[d_out, d_in])?);
        let dw_only = common::measure(dev, o.warmup, o.budget, o.reps, || {
            let g = LinearGrads { dx: None, dw: dw.view_mut(), dbias: None };
            b.linear_backward(g, dy.view(), LinearSaved { x: x.view() }, w.view(), GradMode::Overwrite)
        })?;
        common::check_finite(dev, "dW", &[dw.view()])?;
        let bwd = common::measure(dev, o.warmup, o.budget, o.reps, || {
            let g = LinearGrads { dx: Some(dx.view_mut()), dw: dw.view_mut(), dbias: None };
            b.linear_backward(g, dy.view(), LinearSaved { x: x.view() }, w.view(), GradMode::Overwrite)
        })?;
        common::check_finite(dev, "the backward", &[dx.view(), dw.view()])?;
        Ok(Times { fwd, bwd, dw: dw_only })
    }

    /// What the peer ran, and cuBLAS's fwd, dX, dW TFLOP/s per shape (`None`: missing from its output).
    struct Peer {
        who: String,
        rows: Vec<Option<[f64; 3]>>,
    }

    /// The peer's figures from `bench/peer_linear_gpu.py`, or why there are none.
    fn peer(o: &Options) -> std::result::Result<Peer, String> {
        let (python, torch) = common::python_with_cuda_torch()?;
        let script = common::peer_script("peer_linear_gpu.py")?;
        let shapes: Vec<String> = o.shapes.iter().map(|(i, o)| format!("{i}x{o}")).collect();
        let args = [
            "--tokens".to_string(),
            o.tokens.to_string(),
            "--shapes".into(),
            shapes.join(","),
            "--max-reps".into(),
            o.reps.1.to_string(),
            "--budget".into(),
            o.budget.as_secs_f64().to_string(),
        ];
        let out = common::run_peer(&python, &script, &args)?;
        let rows = o
            .shapes
            .iter()
            .map(|&(i, d)| {
                out.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    let rates = |k: usize| f.get(k).map_or(f64::NAN, |x| x.parse().unwrap_or(f64::NAN));
                    (f.len() == 5 && f[0] == i.to_string() && f[1] == d.to_string())
                        .then(|| [rates(2), rates(3), rates(4)])
                })
            })
            .collect();
        Ok(Peer { who: format!("PyTorch {torch} ({python} {})", script.display()), rows })
    }

    pub(crate) fn main(args: &[String], kind: DeviceKind) -> std::result::Result<(), String> {
        let o = options(args, kind)?;
        let dev = Device::open(kind).map_err(|e| e.to_string())?;
        let mut results = Vec::new();
        for &(d_in, d_out) in &o.shapes {
            let r = run_shape(&dev, &o, d_in, d_out).map_err(|e| e.to_string());
            // As each shape is measured (the table comes after the peer): what a run cut short still shows.
            match &r {
                Err(e) => eprintln!("linear_bench: {d_in}x{d_out}: {e}"),
                Ok(t) => eprintln!(
                    "linear_bench: {d_in}x{d_out}: forward {:.3} ms, backward {:.3} ms, dW alone {:.3} ms",
                    t.fwd.secs() * 1e3,
                    t.bwd.secs() * 1e3,
                    t.dw.secs() * 1e3
                ),
            }
            results.push(r);
        }
        dev.trim().map_err(|e| e.to_string())?;
        let peer = if o.peer { peer(&o) } else { Err("--no-torch".into()) };
        println!(
            "# linear_bench on {}: bf16 TFLOP/s; median of up to {} timed calls after {} warm-up; dX = backward − dW",
            dev.describe(),
            o.reps.1,
            o.warmup
        );
        match &peer {
            Ok(p) => println!("# peer: {}: x @ w.t(), dy @ w, dy.t() @ x (cuBLAS), same shapes, after ours", p.who),
            Err(why) => println!("# peer: none ({why})"),
        }
        print!("| T | IN → OUT | fwd | dX | dW | bwd ms |");
        if peer.is_ok() {
            print!(" cuBLAS fwd | dX | dW | ours/cuBLAS fwd | dX | dW |");
        }
        println!("\n|---|---|---|---|---|---|{}", if peer.is_ok() { "---|---|---|---|---|---|" } else { "" });
        let mut failed = 0;
        for (k, (&(d_in, d_out), r)) in o.shapes.iter().zip(&results).enumerate() {
            let times = match r {
                Ok(t) => t,
                Err(e) => {
                    failed += 1;
                    println!("| {} | {d_in} → {d_out} | failed: {e} |", o.tokens);
                    continue;
                }
            };
            let flops = 2.0 * (o.tokens * d_in * d_out) as f64 / 1e12;
            let dx_secs = times.bwd.secs() - times.dw.secs();
            let ours = [
                flops / times.fwd.secs(),
                if dx_secs > 0.0 { flops / dx_secs } else { f64::NAN },
                flops / times.dw.secs(),
            ];
            print!(
                "| {} | {d_in} → {d_out} | {} | {} | {} | {} |",
                o.tokens,
                common::rate(ours[0]),
                common::rate(ours[1]),
                common::rate(ours[2]),
                common::fmt(times.bwd.secs() * 1e3, 2)
            );
            if let Ok(peer) = &peer {
                let p = peer.rows[k].unwrap_or([f64::NAN; 3]);
                print!(
                    " {} | {} | {} | {} | {} | {} |",
                    common::rate(p[0]),
                    common::rate(p[1]),
                    common::rate(p[2]),
                    common::fmt(ours[0] / p[0], 2),
                    common::fmt(ours[1] / p[1], 2),
                    common::fmt(ours[2] / p[2], 2)
                );
            }
            println!();
        }
        if failed > 0 {
            return Err(format!("{failed} shape(s) failed"));
        }
        Ok(())
    }
}
