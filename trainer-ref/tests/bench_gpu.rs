//! `longctx bench --device`: a build without CUDA refuses `cuda:N` before any work; the GPU table's plumbing runs
//! end to end on the kernels' host emulator (skipping, saying so, without the kernels' `cuda` feature); the GPU
//! peer script compiles, prints its usage, and trains a tiny model on the CPU where a Python with torch and
//! transformers is at hand (`$LONGCTX_PYTHON`, else `python3`; skipped, saying so, where not).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn longctx(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_longctx")).args(args).output().expect("the longctx binary runs");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn peer_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/peer_train_gpu.py")
}

#[test]
fn the_device_is_checked_before_any_work() {
    let started = Instant::now();
    let (ok, out, err) = longctx(&["bench", "--device", "gpu0", "--python", "none"]);
    assert!(!ok && err.contains("--device") && err.contains("gpu0"), "{out}{err}");
    assert!(out.is_empty(), "{out}");
    if !cfg!(feature = "cuda") {
        // The typed error (TrainError::CudaNotCompiled) at once: no table header, no run, no peak measured.
        let (ok, out, err) = longctx(&["bench", "--device", "cuda:0", "--seqs", "128", "--steps", "1"]);
        assert!(!ok && err.contains("`cuda:0`") && err.contains("--features cuda"), "{out}{err}");
        assert!(out.is_empty(), "{out}");
    }
    // A GPU table's option on the CPU tables, and a bad layout, are refused before anything runs too.
    let (ok, out, err) = longctx(&["bench", "--model", "tiny", "--python", "none"]);
    assert!(!ok && err.contains("--model") && out.is_empty(), "{out}{err}");
    let (ok, out, err) =
        longctx(&["bench", "--device", "cuda-emulated", "--seqs", "128", "--layout", "256:cp=2", "--python", "none"]);
    assert!(!ok && err.contains("--layout") && err.contains("256") && out.is_empty(), "{out}{err}");
    assert!(started.elapsed() < Duration::from_secs(20), "took {:?}", started.elapsed());
}

#[test]
fn the_gpu_table_runs_on_the_host_emulator() {
    if let Err(e) = longctx_kernels::CudaBackend::emulated() {
        eprintln!("the_gpu_table_runs_on_the_host_emulator: skipped: {e}");
        return;
    }
    let (ok, out, err) = longctx(&[
        "bench",
        "--device",
        "cuda-emulated",
        "--model",
        "tiny",
        "--seqs",
        "128",
        "--steps",
        "1",
        "--python",
        "none",
    ]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("# longctx bench --device cuda-emulated: tiny (4 layers, d 256"), "{out}");
    assert!(out.contains("the host's FMA peak measured now"), "{out}");
    assert!(out.contains("| seq | layout | longctx tok/s | MFU | peak device MiB |"), "{out}");
    let row = out.lines().find(|l| l.starts_with("| 128 |")).unwrap_or_else(|| panic!("no row for 128:\n{out}"));
    let cells: Vec<&str> = row.split('|').map(str::trim).collect();
    // | 128 | cp 1 | tok/s | MFU | peak | – | – | – | – | – |
    assert_eq!(cells[2], "cp 1", "{row}");
    assert!(cells[3].parse::<f64>().is_ok_and(|t| t > 0.0), "{row}");
    assert!(cells[4].ends_with('%'), "{row}");
    assert_eq!(&cells[6..11], ["–"; 5], "{row}");
    assert!(out.contains("longest length each side ran: longctx 128 (cp 1); PyTorch not run (--python none)"), "{out}");
}

#[test]
fn the_gpu_peer_script_compiles_and_trains_a_tiny_model_where_torch_is() {
    let py = std::env::var("LONGCTX_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = peer_script();
    let Ok(o) =
        Command::new(&py).args(["-c", "import ast, sys; ast.parse(open(sys.argv[1]).read())"]).arg(&script).output()
    else {
        println!("SKIPPED: no {py} to check {}", script.display());
        return;
    };
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The usage needs no torch: the flags are parsed first.
    let o = Command::new(&py).arg(&script).arg("--help").output().expect("python runs");
    let usage = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && usage.contains("--kv-heads") && usage.contains("--device"), "{usage}");
    let tiny = [
        "--device",
        "cpu",
        "--seq",
        "64",
        "--steps",
        "1",
        "--layers",
        "1",
        "--d-model",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--ffn",
        "128",
        "--vocab",
        "257",
        "--theta",
        "500000",
    ];
    let o = Command::new(&py).arg(&script).args(tiny).output().expect("python runs");
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{out}{err}");
    let torch = Command::new(&py).args(["-c", "import torch, transformers"]).output();
    if !torch.is_ok_and(|t| t.status.success()) {
        // As bench/peer_train.py: a message, no JSON, status 0, so the bench prints no peer column.
        assert!(out.trim().is_empty() && err.contains("cannot be imported"), "{out}{err}");
        println!("SKIPPED: {py} cannot import torch and transformers; the tiny training run was not checked");
        return;
    }
    let line = out.lines().last().unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {out}{err}"));
    assert_eq!(v["status"], "ok", "{line}");
    assert_eq!(v["seq"], 64, "{line}");
    assert!(v["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0), "{line}");
    assert!(v["peak_alloc_mib"].is_null(), "{line}");
    // 257·64 embedding + 257·64 head + one layer (q 64·64, k and v 64·32, o 64·64, three 64·128) + 3 norms of 64.
    let params = 2 * 257 * 64 + (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 3 * 64;
    assert_eq!(v["params"], params, "{line}");
    let first = v["loss_first"].as_f64().unwrap_or(f64::NAN);
    // Random weights of std 0.02 over 257 tokens: close to ln 257 ≈ 5.55.
    assert!((first - 257f64.ln()).abs() < 0.5, "{line}");
    assert_eq!(v["attn"], "sdpa", "{line}");
}
