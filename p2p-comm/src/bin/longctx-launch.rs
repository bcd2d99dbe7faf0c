//! `longctx-launch --nproc N [--master-addr A] [--master-port P] [--nnodes M --node-rank K] -- CMD ARGS…`
//!
//! Starts N local processes of CMD with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` and a fresh random `LONGCTX_JOB_TOKEN` set, prefixes each line they print with `[rank k]`, and
//! if one exits with an error (or is killed) kills the others and exits with status 1 naming that rank.
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
use std::time::Duration;

use clap::Parser;

#[derive(Parser, Debug)]
#[command(name = "longctx-launch", about = "Start N local ranks of a longctx job")]
struct Args {
    /// Number of processes.
    #[arg(long)]
    nproc: usize,
    /// Address the rendezvous store binds (rank 0 hosts it).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store (default: a free port; required with `--nnodes` above 1).
    #[arg(long)]
    master_port: Option<u16>,
    /// Number of hosts, each running one launcher with the same arguments but its own `--node-rank`.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This host's place among the `--nnodes` hosts; node 0 hosts rank 0 and its rendezvous store.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    cmd: Vec<String>,
}

fn token() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn free_port(addr: &str) -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind((addr, 0))?.local_addr()?.port())
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
    // Each rank leads its own process group, so this also reaches the processes it started.
    // SAFETY: kill(2) on a process group id we created; no memory is involved.
    unsafe {
        libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL);
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
    let world_size = args.nnodes * args.nproc;
    let first_rank = args.node_rank * args.nproc;
    let port = match args.master_port.map(Ok).unwrap_or_else(|| free_port(&args.master_addr)) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("longctx-launch: no free port on {}: {e}", args.master_addr);
            return ExitCode::from(2);
        }
    };
    let token = match job_token.map(Ok).unwrap_or_else(token) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("longctx-launch: reading /dev/urandom: {e}");
            return ExitCode::from(2);
        }
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
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
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
    while running.iter().any(|&r| r) && failed.is_none() {
        for (local, child) in children.iter_mut().enumerate() {
            if !running[local] {
                continue;
            }
            match child.try_wait() {
                Ok(Some(st)) => {
                    running[local] = false;
                    if !st.success() {
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
    ExitCode::SUCCESS
}
