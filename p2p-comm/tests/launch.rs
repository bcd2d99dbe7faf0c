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
        .arg("echo $RANK/$WORLD_SIZE/$LOCAL_RANK/$LOCAL_WORLD_SIZE $MASTER_ADDR:$MASTER_PORT $LONGCTX_JOB_TOKEN $LONGCTX_STORE_HOSTED")
        .env("LONGCTX_JOB_TOKEN", "shared")
        .output()
        .expect("run launcher");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for (rank, local) in [(2, 0), (3, 1)] {
        // With a port given, rank 0 hosts the store there.
        assert!(text.contains(&format!("[rank {rank}] {rank}/4/{local}/2 10.9.8.7:29999 shared 0")), "{text}");
    }
}

/// Without `--master-port` the launcher serves the store itself, on a port it holds before any rank starts
/// (a port picked free and left for rank 0 to bind later was once taken in between), and says so.
#[test]
fn without_a_port_the_launcher_hosts_the_store_before_the_ranks_start() {
    let (ok, out, err, _) = launch(&[
        "--nproc",
        "2",
        "--",
        "bash",
        "-c",
        "exec 3<>/dev/tcp/$MASTER_ADDR/$MASTER_PORT && echo reached $LONGCTX_STORE_HOSTED",
    ]);
    assert!(ok, "{err}");
    for r in 0..2 {
        assert!(out.contains(&format!("[rank {r}] reached 1")), "{out}\n{err}");
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

/// Starts the launcher with `args`, reads each rank's pid from its first line (`[rank k] PID`), and returns
/// the launcher and those pids.
fn start_with_pids(args: &[&str], nproc: usize) -> (std::process::Child, Vec<i32>) {
    use std::io::BufRead;
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_longctx-launch"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run launcher");
    let mut lines = std::io::BufReader::new(launcher.stdout.take().expect("stdout")).lines();
    let mut pids = vec![0; nproc];
    for _ in 0..nproc {
        let line = lines.next().expect("a rank's pid line").expect("utf-8");
        let (rank, pid) = line.strip_prefix("[rank ").and_then(|l| l.split_once("] ")).expect("prefixed line");
        pids[rank.parse::<usize>().expect("rank")] = pid.trim().parse().expect("pid");
    }
    (launcher, pids)
}

fn send(launcher: &std::process::Child, signal: libc::c_int) {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(launcher.id() as libc::pid_t, signal) }, 0, "sending signal {signal}");
}

/// Whether process `pid` still runs: a zombie (dead, not yet reaped, which depends on who reaps orphans in
/// this container) counts as gone.
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')),
        Err(_) => false,
    }
}

fn gone_within(pids: &[i32], d: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < d {
        if pids.iter().all(|&p| !alive(p)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// SIGTERM (a scheduler's cancel, `kill`) and SIGINT (Ctrl-C reaches only the launcher's process group) are
/// passed on to the ranks, which exit; a rank that ignores it is killed after `--stop-grace`; the launcher exits
/// with 128 + the signal.
#[test]
fn a_signalled_launcher_stops_its_ranks() {
    for (signal, status) in [(libc::SIGTERM, 143), (libc::SIGINT, 130)] {
        let (mut launcher, pids) = start_with_pids(&["--nproc", "2", "--", "sh", "-c", "echo $$; exec sleep 60"], 2);
        send(&launcher, signal);
        let st = launcher.wait().expect("launcher exit");
        assert_eq!(st.code(), Some(status), "signal {signal}");
        assert!(gone_within(&pids, Duration::from_secs(5)), "signal {signal}: ranks {pids:?} outlived the launcher");
    }
    // A rank that ignores SIGTERM: killed once the grace period is over.
    let script = "trap '' TERM; echo $$; while true; do sleep 0.05; done";
    let (mut launcher, pids) = start_with_pids(&["--nproc", "1", "--stop-grace", "0.5", "--", "sh", "-c", script], 1);
    let t0 = Instant::now();
    send(&launcher, libc::SIGTERM);
    assert_eq!(launcher.wait().expect("launcher exit").code(), Some(143));
    assert!(t0.elapsed() >= Duration::from_millis(400), "killed before the grace period: {:?}", t0.elapsed());
    assert!(gone_within(&pids, Duration::from_secs(5)), "the rank ignoring SIGTERM survived");
}

/// A launcher killed outright (SIGKILL: no handler runs) still takes its ranks with it.
#[test]
fn a_killed_launcher_takes_its_ranks_with_it() {
    let (mut launcher, pids) = start_with_pids(&["--nproc", "2", "--", "sh", "-c", "echo $$; exec sleep 60"], 2);
    launcher.kill().expect("SIGKILL the launcher");
    launcher.wait().expect("reap the launcher");
    assert!(gone_within(&pids, Duration::from_secs(5)), "ranks {pids:?} outlived a killed launcher");
}
