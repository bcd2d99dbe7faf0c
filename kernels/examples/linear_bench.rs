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
