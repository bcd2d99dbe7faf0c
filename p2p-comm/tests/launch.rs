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

/// One launcher of a job on two hosts: node 1 of 2 starts global ranks 2 and 3 of a world of 4, with the
/// shared address, port and token it was given.
#[test]
fn node_rank_offsets_the_ranks_of_a_job_on_several_hosts() {
    let out = Command::new(env!("CARGO_BIN_EXE_longctx-launch"))
        .args(["--nnodes", "2", "--node-rank", "1", "--nproc", "2", "--master-addr", "10.9.8.7"])
        .args(["--master-port", "29999", "--", "sh", "-c"])
        .arg("echo $RANK/$WORLD_SIZE/$LOCAL_RANK/$LOCAL_WORLD_SIZE $MASTER_ADDR:$MASTER_PORT $LONGCTX_JOB_TOKEN")
        .env("LONGCTX_JOB_TOKEN", "shared")
        .output()
        .expect("run launcher");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for (rank, local) in [(2, 0), (3, 1)] {
        assert!(text.contains(&format!("[rank {rank}] {rank}/4/{local}/2 10.9.8.7:29999 shared")), "{text}");
    }
}

/// Several hosts need what every launcher must agree on: without it the launcher refuses to start.
#[test]
fn several_hosts_without_a_shared_port_token_and_address_are_refused() {
    let (ok, _, err, _) = launch(&["--nnodes", "2", "--node-rank", "0", "--nproc", "1", "--", "true"]);
    assert!(!ok);
    assert!(err.contains("--master-port") && err.contains("--master-addr"), "{err}");
    let (ok, _, err, _) = launch(&["--nnodes", "2", "--node-rank", "2", "--nproc", "1", "--", "true"]);
    assert!(!ok && err.contains("--node-rank 2 is not in --nnodes 2"), "{err}");
}
