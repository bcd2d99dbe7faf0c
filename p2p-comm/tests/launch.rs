//! The launcher: environment, output prefixes, failure propagation.

use std::process::Command;
use std::time::{Duration, Instant};

fn launch(args: &[&str]) -> (bool, String, String, Duration) {
    let t0 = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_longctx-launch")).args(args).output().expect("run launcher");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
        t0.elapsed(),
    )
}

#[test]
fn sets_the_environment_and_prefixes_lines() {
    let (ok, out, err, _) = launch(&[
        "--nproc",
        "3",
        "--",
        "sh",
        "-c",
        "echo $RANK/$WORLD_SIZE/$LOCAL_RANK ${#LONGCTX_JOB_TOKEN} $MASTER_ADDR; echo err >&2",
    ]);
    assert!(ok, "{err}");
    for r in 0..3 {
        assert!(out.contains(&format!("[rank {r}] {r}/3/{r} 32 127.0.0.1")), "{out}");
        assert!(err.contains(&format!("[rank {r}] err")), "{err}");
    }
}

#[test]
fn a_failing_rank_kills_the_others_and_is_named() {
    let (ok, _, err, took) =
        launch(&["--nproc", "3", "--", "sh", "-c", "if [ $RANK = 1 ]; then sleep 0.2; exit 3; fi; sleep 30"]);
    assert!(!ok);
    assert!(err.contains("rank 1 failed (exit status 3)"), "{err}");
    assert!(took < Duration::from_secs(10), "the sleeping ranks were not killed: {took:?}");
}
