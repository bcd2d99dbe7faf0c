//! `longctx-launch --nproc N [--master-addr A] [--master-port P] [--nnodes M --node-rank K] -- CMD ARGS…`
//!
//! Starts N local processes of CMD with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` and a fresh random `LONGCTX_JOB_TOKEN` set, prefixes each line they print with `[rank k]`, and
//! if one exits with an error (or is killed) kills the others and exits with status 1 naming that rank.
//!
//! Without `--master-port` the launcher hosts the rendezvous store itself, on a port the system picks, and
//! tells the ranks so (`LONGCTX_STORE_HOSTED=1`): a port found free and left for rank 0 to bind later can be
//! taken in between, by any process's outgoing connection from the same ephemeral range. With `--master-port`
//! rank 0 hosts it there.
//!
//! Each rank leads its own process group (so that killing it reaches what it started), which also keeps a
//! terminal's Ctrl-C from reaching the ranks directly. So the launcher passes SIGINT, SIGTERM and SIGHUP on to
//! every rank's group, gives them `--stop-grace` seconds (10) to exit, then kills them, and exits with 128 + the
//! signal's number; a second signal kills at once. A launcher that is itself killed (SIGKILL, a crash) takes
//! its ranks with it through Linux's parent-death signal.
//!
//! On several hosts without Slurm or `mpirun` (as torchrun's `--nnodes`/`--node-rank`): run one launcher per
//! host with the same `--nnodes M`, `--nproc N`, `--master-addr` (an address of node 0's host that the others
//! reach), `--master-port` and `LONGCTX_JOB_TOKEN` in the environment, and `--node-rank` 0..M on each; the
//! launcher of node K starts global ranks `K*N .. K*N+N`. A failing rank ends its own node's ranks; the other
//! nodes' ranks learn of it through the communicator (an error naming the rank), and so their launchers exit
//! non-zero too.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use clap::Parser;
use longctx_p2p::rendezvous::StoreHost;

#[derive(Parser, Debug)]
#[command(name = "longctx-launch", about = "Start N local ranks of a longctx job")]
struct Args {
    /// Number of processes.
    #[arg(long)]
    nproc: usize,
    /// Address the rendezvous store binds (the launcher hosts it, or rank 0 with `--master-port`).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store, hosted by rank 0 (default: a port the system picks, the store hosted by
    /// the launcher; required with `--nnodes` above 1).
    #[arg(long)]
    master_port: Option<u16>,
    /// Number of hosts, each running one launcher with the same arguments but its own `--node-rank`.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This host's place among the `--nnodes` hosts; node 0 hosts rank 0 and its rendezvous store.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Seconds the ranks get to exit after the launcher passed them SIGINT, SIGTERM or SIGHUP, before it kills
    /// them.
    #[arg(long, default_value_t = 10.0)]
    stop_grace: f64,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    cmd: Vec<String>,
}

fn token() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn describe(s: ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(sig)) => format!("signal {sig}"),
        _ => "unknown status".into(),
    }
}

fn pump(rank: usize, src: impl Read + Send + 'static, to_stderr: bool) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(src).split(b'\n') {
            let Ok(line) = line else { break };
            let text = String::from_utf8_lossy(&line);
            if to_stderr {
                let _ = writeln!(std::io::stderr().lock(), "[rank {rank}] {text}");
            } else {
                let _ = writeln!(std::io::stdout().lock(), "[rank {rank}] {text}");
            }
        }
    })
}

fn kill_group(child: &Child) {
    signal_group(child, libc::SIGKILL);
}

fn signal_group(child: &Child, signal: libc::c_int) {
    // Each rank leads its own process group, so this also reaches the processes it started.
    // SAFETY: kill(2) on a process group id we created; no memory is involved.
    unsafe {
        libc::kill(-(child.id() as libc::pid_t), signal);
    }
}

/// The last of SIGINT, SIGTERM, SIGHUP received (0: none), and how many so far; set by [`on_signal`].
static SIGNALLED: AtomicI32 = AtomicI32::new(0);
static SIGNALS: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    // Only atomics here: a signal handler may do nothing that is not async-signal-safe.
    SIGNALLED.store(signal, Ordering::SeqCst);
    SIGNALS.fetch_add(1, Ordering::SeqCst);
}

/// Routes SIGINT, SIGTERM and SIGHUP to [`on_signal`], for the wait loop to pass on to the ranks.
fn catch_stop_signals() -> std::io::Result<()> {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction with a handler that only touches atomics, installed for signals whose
        // default action would end the launcher and orphan the ranks.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            action.sa_flags = libc::SA_RESTART;
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn signal_name(signal: libc::c_int) -> &'static str {
    match signal {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.nproc == 0 {
        eprintln!("longctx-launch: --nproc must be at least 1");
        return ExitCode::from(2);
    }
    if args.nnodes == 0 || args.node_rank >= args.nnodes {
        eprintln!("longctx-launch: --node-rank {} is not in --nnodes {}", args.node_rank, args.nnodes);
        return ExitCode::from(2);
    }
    let job_token = std::env::var("LONGCTX_JOB_TOKEN").ok().filter(|t| !t.is_empty());
    if args.nnodes > 1 {
        // Each host's launcher would otherwise pick its own port and token, and the ranks would never meet.
        let missing: Vec<&str> = [
            ("--master-port", args.master_port.is_none()),
            ("LONGCTX_JOB_TOKEN (environment)", job_token.is_none()),
            ("--master-addr", args.master_addr == "127.0.0.1"),
        ]
        .into_iter()
        .filter_map(|(what, missing)| missing.then_some(what))
        .collect();
        if !missing.is_empty() {
            eprintln!(
                "longctx-launch: with --nnodes {} every host's launcher needs the same --master-addr (node 0's \
                 address, not loopback), --master-port and LONGCTX_JOB_TOKEN: set {}",
                args.nnodes,
                missing.join(", ")
            );
            return ExitCode::from(2);
        }
    }
    if !(args.stop_grace >= 0.0 && args.stop_grace.is_finite()) {
        eprintln!("longctx-launch: --stop-grace must be a number of seconds, not {}", args.stop_grace);
        return ExitCode::from(2);
    }
    if let Err(e) = catch_stop_signals() {
        eprintln!("longctx-launch: installing the signal handlers: {e}");
        return ExitCode::from(2);
    }
    let world_size = args.nnodes * args.nproc;
    let first_rank = args.node_rank * args.nproc;
    let token = match job_token.map(Ok).unwrap_or_else(token) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("longctx-launch: reading /dev/urandom: {e}");
            return ExitCode::from(2);
        }
    };
    // The store is kept until the ranks have exited (see the module docs).
    let (store, port) = match args.master_port {
        Some(p) => (None, p),
        None => match StoreHost::bind((args.master_addr.as_str(), 0), &token) {
            Ok(h) => {
                let port = h.addr().port();
                (Some(h), port)
            }
            Err(e) => {
                eprintln!("longctx-launch: hosting the rendezvous store on {}: {e}", args.master_addr);
                return ExitCode::from(2);
            }
        },
    };
    let mut children: Vec<Child> = Vec::new();
    let mut pumps = Vec::new();
    for local in 0..args.nproc {
        let rank = first_rank + local;
        let mut cmd = Command::new(&args.cmd[0]);
        cmd.args(&args.cmd[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("LONGCTX_JOB_TOKEN", &token)
            .env("LONGCTX_STORE_HOSTED", if store.is_some() { "1" } else { "0" })
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let launcher = std::process::id() as libc::pid_t;
        // SAFETY: runs in the forked child before exec; prctl, getppid and _exit are async-signal-safe and
        // touch no memory of the parent.
        unsafe {
            cmd.pre_exec(move || {
                // Die with the launcher even if it is killed outright; if it died before this line, leave.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0
                    || libc::getppid() != launcher
                {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        match cmd.spawn() {
            Ok(mut c) => {
                if let Some(o) = c.stdout.take() {
                    pumps.push(pump(rank, o, false));
                }
                if let Some(e) = c.stderr.take() {
                    pumps.push(pump(rank, e, true));
                }
                children.push(c);
            }
            Err(e) => {
                eprintln!("longctx-launch: starting rank {rank} ({}): {e}", args.cmd[0]);
                children.iter().for_each(kill_group);
                return ExitCode::from(2);
            }
        }
    }
    let mut running: Vec<bool> = vec![true; children.len()];
    let mut failed: Option<(usize, ExitStatus)> = None;
    // The signal passed on to the ranks, when, and how many the launcher had received then.
    let mut stopping: Option<(libc::c_int, std::time::Instant, i32)> = None;
    while running.iter().any(|&r| r) && failed.is_none() {
        let signal = SIGNALLED.load(Ordering::SeqCst);
        if signal != 0 {
            match stopping {
                None => {
                    eprintln!(
                        "longctx-launch: got {}; passing it on to the ranks ({} s to exit)",
                        signal_name(signal),
                        args.stop_grace
                    );
                    for (local, c) in children.iter().enumerate() {
                        if running[local] {
                            signal_group(c, signal);
                        }
                    }
                    stopping = Some((signal, std::time::Instant::now(), SIGNALS.load(Ordering::SeqCst)));
                }
                Some((_, since, seen)) => {
                    let again = SIGNALS.load(Ordering::SeqCst) > seen;
                    if again || since.elapsed().as_secs_f64() > args.stop_grace {
                        for (local, c) in children.iter().enumerate() {
                            if running[local] {
                                kill_group(c);
                            }
                        }
                    }
                }
            }
        }
        for (local, child) in children.iter_mut().enumerate() {
            if !running[local] {
                continue;
            }
            match child.try_wait() {
                Ok(Some(st)) => {
                    running[local] = false;
                    if !st.success() && stopping.is_none() {
                        failed = Some((first_rank + local, st));
                        break;
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    eprintln!("longctx-launch: waiting for rank {}: {e}", first_rank + local);
                    running[local] = false;
                    failed = Some((first_rank + local, ExitStatus::from_raw(1 << 8)));
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some((rank, st)) = failed {
        for (r, c) in children.iter_mut().enumerate() {
            if running[r] {
                kill_group(c);
            }
            let _ = c.wait();
        }
        for p in pumps {
            let _ = p.join();
        }
        let others = if args.nnodes > 1 { "this host's other ranks" } else { "the other ranks" };
        eprintln!("longctx-launch: rank {rank} failed ({}); killed {others}", describe(st));
        return ExitCode::from(1);
    }
    for p in pumps {
        let _ = p.join();
    }
    if let Some((signal, since, _)) = stopping {
        eprintln!(
            "longctx-launch: stopped by {}; the ranks exited in {:.1} s",
            signal_name(signal),
            since.elapsed().as_secs_f64()
        );
        return ExitCode::from(128 + signal as u8);
    }
    ExitCode::SUCCESS
}
