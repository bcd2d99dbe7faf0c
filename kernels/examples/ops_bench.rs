//! Memory-bound ops benchmark: the element-wise ops, the norms, RoPE, SwiGLU and AdamW at a model's activation
//! sizes, each as GB/s moved and as a fraction of the device's copy bandwidth measured in the same run; the fused
//! cross-entropy (its products make it compute-bound) as TFLOP/s beside its bytes.
//!
//! ```text
//! cargo run --release -p longctx-kernels --example ops_bench                                  # the CPU backend
//! cargo run --release -p longctx-kernels --features cuda --example ops_bench -- --device cuda
//! cargo run --release -p longctx-kernels --features cuda --example ops_bench -- --device cuda-emulated
//! cargo run --release -p longctx-kernels --features cuda --example ops_bench -- --device cuda --tokens 32768
//! ```
//!
//! **Sizes.** `T` tokens (`--tokens`) of a model of width `C` (`--hidden`), MLP width `F` (`--ffn`), vocabulary `V`
//! (`--vocab`), heads of 128 (or `C` when smaller); activations bf16. On a GPU (`--device cuda`, built with
//! `--features cuda`) the defaults are Llama 3 8B's at T = 16384 (C 4096, F 14336, V 128256: a `[T, C]` bf16
//! tensor is 128 MiB, past any GPU's L2), on the CPU T = 2048, C 1024, F 2816, V 32000, on the host emulator
//! (`--device cuda-emulated`, a smoke test of the code path) T = 64, C 64, F 96, V 100. AdamW updates `C·F` f32
//! parameters (with their bf16 copy).
//!
//! **Bytes moved** count each tensor an op must read or write once (what a perfect kernel moves; the per-row
//! statistics and `[C]` weights included): e.g. RMSNorm forward reads `x` and writes `y` and `rstd`, its backward
//! reads `dy`, `x`, `rstd` and the weight and writes `dx` and the `f32` weight gradient; AdamW reads and writes the
//! master weights and both moments, reads the `f32` gradient and writes the bf16 copy (30 bytes a parameter). The
//! **copy** row (the backend's `copy` of a `[T, C]` bf16 tensor, a device-to-device copy on a GPU) is the reference:
//! "% copy" is each row's GB/s against it. The cross-entropy moves little and computes `6·T·C·V` FLOPs (logits,
//! `dhidden`, `dweight`), so its row shows TFLOP/s.
//!
//! **Timing.** Each row is the median of up to `--reps` (100; 3 on the emulator) calls fitting about
//! `--budget` seconds (0.3) after two warm-up calls, timed with the backend's CUDA events on a GPU (the host clock on
//! the CPU and the emulator). Inputs are random; outputs are poisoned with NaN before and checked finite after.

mod common;

use std::time::Duration;

use common::{Device, DeviceKind, Timed};
use longctx_kernels::{
    AdamW, AdamwState, Backend, CrossEntropyOptions, DType, GradMode, LayerNormSaved, NormGrads, NormParams,
    ProjectionGrads, Result, RmsNormSaved, RopeConfig, RopeScaling, RopeTable, SwigluSaved, View,
};

/// The sizes of a run (see the module docs).
struct Sizes {
    tokens: usize,
    hidden: usize,
    ffn: usize,
    vocab: usize,
}

struct Options {
    sizes: Sizes,
    warmup: usize,
    budget: Duration,
    reps: (usize, usize),
}

fn options(args: &[String], kind: DeviceKind) -> std::result::Result<Options, String> {
    let (t, c, f, v) = match kind {
        DeviceKind::Cuda => (16384, 4096, 14336, 128256),
        DeviceKind::Cpu => (2048, 1024, 2816, 32000),
        DeviceKind::CudaEmulated => (64, 64, 96, 100),
    };
    let sizes = Sizes {
        tokens: common::arg(args, "--tokens", t)?,
        hidden: common::arg(args, "--hidden", c)?,
        ffn: common::arg(args, "--ffn", f)?,
        vocab: common::arg(args, "--vocab", v)?,
    };
    let head = sizes.hidden.min(128);
    if [sizes.tokens, sizes.hidden, sizes.ffn, sizes.vocab].contains(&0)
        || !sizes.hidden.is_multiple_of(head)
        || !head.is_multiple_of(2)
    {
        return Err("sizes must be positive, and --hidden even and a multiple of 128 when above it".into());
    }
    let quick = kind == DeviceKind::CudaEmulated;
    let max_reps = common::arg(args, "--reps", if quick { 3 } else { 100 })?.max(1);
    let budget = common::arg(args, "--budget", if quick { 0.0 } else { 0.3 })?;
    Ok(Options {
        sizes,
        warmup: if quick { 1 } else { 2 },
        budget: Duration::from_secs_f64(budget),
        reps: (3.min(max_reps), max_reps),
    })
}

/// One row: what was timed, the bytes it moves, the FLOPs it computes (compute-bound rows only).
struct Row {
    name: String,
    bytes: f64,
    flops: Option<f64>,
    time: std::result::Result<Timed, String>,
}

/// Runs every op once per row; a failure is kept in its row (and fails the run at the end).
fn run(dev: &Device, o: &Options) -> Result<Vec<Row>> {
    let b: &dyn Backend = dev.backend();
    let Sizes { tokens: t, hidden: c, ffn: f, vocab: v } = o.sizes;
    let (bf, f32t) = (DType::Bf16, DType::F32);
    let act = (t * c) as f64;
    let mut rows = Vec::new();
    let mut row = |name: &str, bytes: f64, flops: Option<f64>, time: Result<Timed>| {
        if let Err(e) = &time {
            eprintln!("ops_bench: {name}: {e}");
        }
        rows.push(Row { name: name.to_string(), bytes, flops, time: time.map_err(|e| e.to_string()) });
    };
    let time = |f: &mut dyn FnMut() -> Result<()>| common::measure(dev, o.warmup, o.budget, o.reps, f);

    // Element-wise, on [T, C].
    let x = common::random(dev, bf, &[t, c], 1, 1.0)?;
    let x32 = common::random(dev, f32t, &[t, c], 2, 1.0)?;
    let mut y = common::poisoned(dev, bf, &[t, c])?;
    let r = time(&mut || b.copy(y.view_mut(), x.view()));
    let r = r.and_then(|r| common::check_finite(dev, "copy", &[y.view()]).map(|()| r));
    row("copy bf16 (the reference)", 4.0 * act, None, r);
    let mut y = common::poisoned(dev, bf, &[t, c])?;
    let r = time(&mut || b.copy(y.view_mut(), x32.view()));
    let r = r.and_then(|r| common::check_finite(dev, "convert", &[y.view()]).map(|()| r));
    row("copy f32 → bf16", 6.0 * act, None, r);
    let r = time(&mut || b.fill(y.view_mut(), 0.5));
    let r = r.and_then(|r| common::check_finite(dev, "fill", &[y.view()]).map(|()| r));
    row("fill bf16", 2.0 * act, None, r);
    // `y` holds 0.5 everywhere: adding `x` and scaling keep it finite however often they run.
    let r = time(&mut || b.add(y.view_mut(), x.view()));
    let r = r.and_then(|r| common::check_finite(dev, "add", &[y.view()]).map(|()| r));
    row("add bf16", 6.0 * act, None, r);
    b.fill(y.view_mut(), 0.5)?;
    let r = time(&mut || b.scale(y.view_mut(), 0.999));
    let r = r.and_then(|r| common::check_finite(dev, "scale", &[y.view()]).map(|()| r));
    row("scale bf16", 4.0 * act, None, r);

    // Norms over C, on [T, C]: y, rstd (and mean); backward dx and the f32 weight (and bias) gradients.
    let weight = common::random(dev, bf, &[c], 3, 1.0)?;
    let bias = common::random(dev, bf, &[c], 4, 0.1)?;
    let dy = common::random(dev, bf, &[t, c], 5, 1.0)?;
    let (mut y, mut rstd, mut mean) =
        (common::poisoned(dev, bf, &[t, c])?, common::poisoned(dev, f32t, &[t])?, common::poisoned(dev, f32t, &[t])?);
    let (mut dx, mut dw, mut db) =
        (common::poisoned(dev, bf, &[t, c])?, common::poisoned(dev, f32t, &[c])?, common::poisoned(dev, f32t, &[c])?);
    let (stat, vec_c) = (4.0 * t as f64, 2.0 * c as f64);
    let rms = NormParams { weight: weight.view(), bias: None, eps: 1e-5 };
    let r = time(&mut || b.rmsnorm_forward(y.view_mut(), rstd.view_mut(), x.view(), &rms));
    let r = r.and_then(|r| common::check_finite(dev, "RMSNorm", &[y.view(), rstd.view()]).map(|()| r));
    row("RMSNorm forward", 4.0 * act + stat + vec_c, None, r);
    let r = time(&mut || {
        let grads = NormGrads { dx: dx.view_mut(), dweight: dw.view_mut(), dbias: None };
        let saved = RmsNormSaved { x: x.view(), rstd: rstd.view() };
        b.rmsnorm_backward(grads, dy.view(), saved, weight.view(), GradMode::Overwrite)
    });
    let r = r.and_then(|r| common::check_finite(dev, "RMSNorm backward", &[dx.view(), dw.view()]).map(|()| r));
    row("RMSNorm backward", 6.0 * act + stat + vec_c + 2.0 * vec_c, None, r);
    let ln = NormParams { weight: weight.view(), bias: Some(bias.view()), eps: 1e-5 };
    let r = time(&mut || b.layernorm_forward(y.view_mut(), mean.view_mut(), rstd.view_mut(), x.view(), &ln));
    let r = r.and_then(|r| common::check_finite(dev, "LayerNorm", &[y.view(), mean.view(), rstd.view()]).map(|()| r));
    row("LayerNorm forward", 4.0 * act + 2.0 * stat + 2.0 * vec_c, None, r);
    let r = time(&mut || {
        let grads = NormGrads { dx: dx.view_mut(), dweight: dw.view_mut(), dbias: Some(db.view_mut()) };
        let saved = LayerNormSaved { x: x.view(), mean: mean.view(), rstd: rstd.view() };
        b.layernorm_backward(grads, dy.view(), saved, weight.view(), GradMode::Overwrite)
    });
    let r =
        r.and_then(|r| common::check_finite(dev, "LayerNorm backward", &[dx.view(), dw.view(), db.view()]).map(|()| r));
    row("LayerNorm backward", 6.0 * act + 2.0 * stat + vec_c + 4.0 * vec_c, None, r);
    drop((y, rstd, mean, dx, dw, db, dy, weight, bias, x32));

    // RoPE in place on [1, H, T, D]; the positions are host memory, uploaded per call on a device.
    let head = c.min(128);
    let table = RopeTable::new(&RopeConfig { head_dim: head, base: 500000.0, scaling: RopeScaling::None })?;
    let positions: Vec<i64> = (0..t as i64).collect();
    let mut q = common::random(dev, bf, &[1, c / head, t, head], 6, 1.0)?;
    let r = time(&mut || b.rope_forward(&table, q.view_mut(), &positions));
    let r = r.and_then(|r| common::check_finite(dev, "RoPE", &[q.view()]).map(|()| r));
    row("RoPE forward", 4.0 * act + 8.0 * t as f64, None, r);
    let r = time(&mut || b.rope_backward(&table, q.view_mut(), &positions));
    let r = r.and_then(|r| common::check_finite(dev, "RoPE backward", &[q.view()]).map(|()| r));
    row("RoPE backward", 4.0 * act + 8.0 * t as f64, None, r);
    drop(q);

    // SwiGLU on [T, F].
    let mlp = (t * f) as f64;
    let gate = common::random(dev, bf, &[t, f], 7, 2.0)?;
    let up = common::random(dev, bf, &[t, f], 8, 1.0)?;
    let dout = common::random(dev, bf, &[t, f], 9, 1.0)?;
    let mut out = common::poisoned(dev, bf, &[t, f])?;
    let r = time(&mut || b.swiglu_forward(out.view_mut(), gate.view(), up.view()));
    let r = r.and_then(|r| common::check_finite(dev, "SwiGLU", &[out.view()]).map(|()| r));
    row("SwiGLU forward", 6.0 * mlp, None, r);
    let (mut dgate, mut dup) = (out, common::poisoned(dev, bf, &[t, f])?);
    b.fill(dgate.view_mut(), f32::NAN)?;
    let r = time(&mut || {
        let saved = SwigluSaved { gate: gate.view(), up: up.view() };
        b.swiglu_backward(dgate.view_mut(), dup.view_mut(), dout.view(), saved)
    });
    let r = r.and_then(|r| common::check_finite(dev, "SwiGLU backward", &[dgate.view(), dup.view()]).map(|()| r));
    row("SwiGLU backward", 10.0 * mlp, None, r);
    drop((gate, up, dout, dgate, dup));

    // The fused cross-entropy: hidden [T, C] and weight [V, C] in bf16, dweight in f32.
    let hidden = common::random(dev, bf, &[t, c], 10, 1.0)?;
    let w_out = common::random(dev, bf, &[v, c], 11, 0.02)?;
    let (mut dh, mut dwo) = (common::poisoned(dev, bf, &[t, c])?, common::poisoned(dev, f32t, &[v, c])?);
    let targets: Vec<i64> =
        common::random_f32(t, 12, 1.0).iter().map(|&u| ((u * 0.5 + 0.5) * v as f32) as i64).collect();
    let targets: Vec<i64> = targets.into_iter().map(|y| y.clamp(0, v as i64 - 1)).collect();
    let ce = CrossEntropyOptions::default();
    let r = time(&mut || {
        let grads = ProjectionGrads { dhidden: dh.view_mut(), dweight: dwo.view_mut() };
        b.cross_entropy_fused(grads, hidden.view(), w_out.view(), &targets, &ce, GradMode::Overwrite).map(|_| ())
    });
    let r = r.and_then(|r| common::check_finite(dev, "cross-entropy", &[dh.view(), dwo.view()]).map(|()| r));
    let ce_bytes = 4.0 * act + 2.0 * (v * c) as f64 + 4.0 * (v * c) as f64 + 8.0 * t as f64;
    row("cross-entropy fused (fwd+bwd)", ce_bytes, Some(6.0 * (t * c * v) as f64), r);
    drop((hidden, w_out, dh, dwo));

    // AdamW on C·F f32 parameters with a bf16 copy.
    let p = c * f;
    let mut master = common::random(dev, f32t, &[p], 13, 1.0)?;
    let grads = common::random(dev, f32t, &[p], 14, 1.0)?;
    let mut m = common::random(dev, f32t, &[p], 15, 0.1)?;
    let v_abs: Vec<f32> = common::random_f32(p, 16, 0.01).into_iter().map(f32::abs).collect();
    let mut vv = b.empty(f32t, longctx_kernels::Dims::new(&[p])?)?;
    b.upload(vv.view_mut(), View::new(&v_abs, [p])?)?;
    drop(v_abs);
    let mut copy = common::poisoned(dev, bf, &[p])?;
    let hp = AdamW::default();
    let r = time(&mut || {
        let state = AdamwState { m: m.view_mut(), v: vv.view_mut() };
        b.adamw_step(master.view_mut(), Some(copy.view_mut()), grads.view(), state, &hp, 1)
    });
    let r = r.and_then(|r| {
        common::check_finite(dev, "AdamW", &[master.view(), m.view(), vv.view(), copy.view()]).map(|()| r)
    });
    row("AdamW step (f32, bf16 copy)", 30.0 * p as f64, None, r);
    Ok(rows)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        let doc: String = include_str!("ops_bench.rs")
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .map(|l| format!("{}\n", l.trim_start_matches("//!").strip_prefix(' ').unwrap_or("")))
            .collect();
        print!("{doc}");
        return;
    }
    let kind = DeviceKind::from_args(&args).and_then(|k| options(&args, k).map(|o| (k, o)));
    let (kind, o) = match kind {
        Ok(ko) => ko,
        Err(e) => {
            eprintln!("ops_bench: {e}");
            std::process::exit(2);
        }
    };
    let dev = match Device::open(kind) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("ops_bench: {e}");
            std::process::exit(1);
        }
    };
    let rows = match run(&dev, &o) {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("ops_bench: {e}");
            std::process::exit(1);
        }
    };
    let s = &o.sizes;
    println!(
        "# longctx ops benchmark on {}: T={} C={} F={} V={}, bf16 activations; median of up to {} timed calls after {} \
         warm-up",
        dev.describe(),
        s.tokens,
        s.hidden,
        s.ffn,
        s.vocab,
        o.reps.1,
        o.warmup
    );
    let gbs = |r: &Row| r.time.as_ref().map_or(f64::NAN, |t| r.bytes / t.secs() / 1e9);
    let copy = rows.first().map_or(f64::NAN, gbs);
    println!("# reference: the backend's copy of a [T, C] bf16 tensor, same run: {copy:.1} GB/s (read + write)");
    println!("| op | MiB moved | µs | GB/s | % copy | TFLOP/s |");
    println!("|---|---|---|---|---|---|");
    let mut failed = 0;
    for r in &rows {
        match &r.time {
            Ok(t) => {
                let rate = gbs(r);
                let tflops = r.flops.map_or("–".to_string(), |fl| common::fmt(fl / t.secs() / 1e12, 2));
                println!(
                    "| {} | {:.1} | {} | {} | {} | {tflops} |",
                    r.name,
                    r.bytes / (1u64 << 20) as f64,
                    common::fmt(t.secs() * 1e6, 1),
                    common::fmt(rate, 1),
                    common::pct(rate, copy)
                );
            }
            Err(e) => {
                failed += 1;
                println!("| {} | failed: {e} |", r.name);
            }
        }
    }
    if failed > 0 {
        eprintln!("ops_bench: {failed} op(s) failed");
        std::process::exit(1);
    }
}
