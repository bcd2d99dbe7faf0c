//! `longctx-launch --nproc N -- longctx train …` runs the same job as `longctx train` over N threads: N
//! processes, one rank each, joined over UCX, write a `metrics.jsonl` whose per-step `loss`, `grad_norm` and
//! `val_loss` are bit-identical to the threads run's, and the same final checkpoint byte for byte; a launcher
//! whose process count is not `cp × dp` is refused by every rank with an error naming both.
//!
//! `longctx-launch` must be built beside the trainer (`cargo build -p longctx-p2p --bin longctx-launch`).
#![cfg(feature = "ucx")]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A small model and a short run: three steps, one evaluation at the last.
const SMALL: &[&str] = &[
    "model.layers=2",
    "model.d_model=64",
    "model.heads=2",
    "model.kv_heads=1",
    "model.ffn=160",
    "train.seq_len=128",
    "train.batch=2",
    "train.steps=3",
    "train.eval_every=3",
    "train.eval_seqs=2",
    "parallel.threads=1",
];

/// Seconds a rank waits on its peers (joining, every collective) before it fails: a hang fails fast.
const COMM_TIMEOUT_SECS: &str = "30";
/// Wall-clock limit of one whole run (launcher and ranks, or the threads run), past which it is killed.
const RUN_LIMIT: Duration = Duration::from_secs(180);

/// The runs of this file one at a time: on a small machine four UCX ranks beside another run would only slow
/// each other down towards the timeout.
static SERIAL: Mutex<()> = Mutex::new(());

fn trainer() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_longctx"))
}

/// `longctx-launch` from the same build as the trainer (`target/<profile>/`).
fn launcher() -> PathBuf {
    let path = trainer().with_file_name("longctx-launch");
    assert!(
        path.exists(),
        "{} not found: build it first (`cargo build -p longctx-p2p --bin longctx-launch`, or run the suite with \
         --all-targets as ./scripts/test does)",
        path.display()
    );
    path
}

/// The arguments of `longctx train` for the small run into `out` with `extra` (the layout).
fn train_args(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["train", "--recipe", "tiny-llama", "--quiet", "--out"].map(String::from).to_vec();
    args.push(out.display().to_string());
    for s in SMALL {
        args.extend(["--set".to_string(), s.to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

struct Ran {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    took: Duration,
}

impl Ran {
    fn output(&self) -> String {
        format!("status {:?}\n--- stdout\n{}\n--- stderr\n{}", self.status, self.stdout, self.stderr)
    }
}

/// Runs `cmd` to the end, killing it after [`RUN_LIMIT`] (a killed launcher takes its ranks with it).
fn run(mut cmd: Command) -> Ran {
    let t0 = Instant::now();
    // A rank's variables in this test's own environment would turn the threads run into one rank of a job.
    for k in ["WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
        cmd.env_remove(k);
    }
    let mut child = cmd
        .env("LONGCTX_TIMEOUT_SECS", COMM_TIMEOUT_SECS)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the run");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = r.read_to_end(&mut s);
            String::from_utf8_lossy(&s).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("stdout")));
    let err = drain(Box::new(child.stderr.take().expect("stderr")));
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for the run") {
            break st;
        }
        if t0.elapsed() > RUN_LIMIT {
            let _ = child.kill();
            let st = child.wait().expect("reap the run");
            let (o, e) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
            panic!("the run took over {RUN_LIMIT:?} and was killed ({st:?})\n--- stdout\n{o}\n--- stderr\n{e}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (stdout, stderr) = (out.join().expect("stdout"), err.join().expect("stderr"));
    Ran { status, stdout, stderr, took: t0.elapsed() }
}

fn threads_run(out: &Path, layout: &[&str]) -> Ran {
    let mut cmd = Command::new(trainer());
    cmd.args(train_args(out, layout));
    run(cmd)
}

fn launched_run(nproc: usize, out: &Path, layout: &[&str]) -> Ran {
    let mut cmd = Command::new(launcher());
    cmd.args(["--nproc", &nproc.to_string(), "--"]).arg(trainer()).args(train_args(out, layout));
    run(cmd)
}

/// `(step, field, bits)` of every `loss`, `grad_norm` and `val_loss` in `out/metrics.jsonl`, in file order.
fn losses(out: &Path) -> Vec<(u64, &'static str, u64)> {
    let path = out.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut got = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{} line {}: {e}", path.display(), i + 1));
        let step = v["step"].as_u64().unwrap_or_else(|| panic!("{} line {}: no step", path.display(), i + 1));
        for field in ["loss", "grad_norm", "val_loss"] {
            if let Some(x) = v.get(field) {
                let x = x.as_f64().unwrap_or_else(|| panic!("{} line {}: {field} {x}", path.display(), i + 1));
                got.push((step, field, x.to_bits()));
            }
        }
    }
    got
}

fn show(v: &[(u64, &str, u64)]) -> String {
    v.iter().map(|&(s, f, b)| format!("step {s} {f} {:?} ({b:#018x})\n", f64::from_bits(b))).collect()
}

/// The same small job over threads and over `nproc` launched processes: the same losses, bit for bit.
fn processes_match_threads(nproc: usize, layout: &[&str]) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().expect("temp dir");
    let (threads_out, procs_out) = (dir.path().join("threads"), dir.path().join("processes"));

    let t = threads_run(&threads_out, layout);
    assert!(t.status.success(), "threads run {layout:?}: {}", t.output());
    let p = launched_run(nproc, &procs_out, layout);
    assert!(p.status.success(), "longctx-launch --nproc {nproc} {layout:?}: {}", p.output());
    eprintln!("{layout:?}: threads {:.1?}, {nproc} processes {:.1?}", t.took, p.took);

    let (want, got) = (losses(&threads_out), losses(&procs_out));
    let fields: Vec<(u64, &str)> = want.iter().map(|&(s, f, _)| (s, f)).collect();
    assert_eq!(
        fields,
        [(1, "loss"), (1, "grad_norm"), (2, "loss"), (2, "grad_norm"), (3, "loss"), (3, "grad_norm"), (3, "val_loss")],
        "threads run's metrics:\n{}",
        show(&want)
    );
    assert!(
        want == got,
        "{layout:?}: the losses of {nproc} processes differ from the threads run's\n--- threads\n{}--- processes\n{}",
        show(&want),
        show(&got)
    );
    // The last checkpoint's weights and optimizer state, byte for byte.
    for file in ["model.safetensors", "optim.safetensors"] {
        let read = |out: &Path| {
            let path = out.join("checkpoints/step-00000003").join(file);
            std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        };
        assert!(read(&threads_out) == read(&procs_out), "{layout:?}: {file} differs from the threads run's");
    }
    // Every rank ended with the same losses.
    let summary = |r: usize| {
        p.stdout
            .lines()
            .find_map(|l| l.strip_prefix(&format!("[rank {r}] trained steps ")))
            .map(str::to_string)
            .unwrap_or_else(|| panic!("rank {r} printed no summary: {}", p.output()))
    };
    for r in 1..nproc {
        assert_eq!(summary(r), summary(0), "rank {r} against rank 0");
    }
    assert!(procs_out.join("recipe.toml").is_file());
}

#[test]
fn two_processes_cp2_match_two_threads() {
    processes_match_threads(2, &["--cp", "2"]);
}

#[test]
fn four_processes_cp2_dp2_match_four_threads() {
    processes_match_threads(4, &["--cp", "2", "--dp", "2"]);
}

/// Three processes for a `cp 2 × dp 1` recipe: every rank refuses before any training, naming both counts, and
/// the launcher fails.
#[test]
fn a_process_count_other_than_cp_times_dp_is_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("run");
    let p = launched_run(3, &out, &["--cp", "2"]);
    assert!(!p.status.success(), "a 3-process launch of a 2-rank recipe succeeded: {}", p.output());
    assert_eq!(p.status.code(), Some(1), "{}", p.output());
    let msg = "error: the launcher started 3 ranks; the recipe needs parallel.cp × parallel.dp = 2";
    assert!(p.stderr.lines().any(|l| l.starts_with("[rank ") && l.ends_with(msg)), "{}", p.output());
    assert!(p.stderr.contains("failed (exit status 1)"), "the launcher did not name the failed rank: {}", p.output());
    assert!(!out.join("metrics.jsonl").exists(), "a refused run started training");
}
