//! The generic suite on the UCX transport: each world is 2-4 processes of this test binary started through
//! `longctx-launch`, re-running the same test in "child" mode where `run` executes the body for its rank.
#![cfg(feature = "ucx")]

mod suite;

use std::collections::HashMap;
use std::io::Write;
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use longctx_p2p::Communicator;
use suite::World;

struct Ucx;

/// Counts this thread's allocations through Rust's allocator (UCX's own `malloc`s are not seen), for the
/// steady-state test below.
struct Counting;

thread_local! {
    static ALLOCS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

// SAFETY: forwards to the system allocator; the counter is a thread-local cell.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        ALLOCS.with(|a| a.set(a.get() + 1));
        // SAFETY: per the caller's contract.
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        // SAFETY: per the caller's contract.
        unsafe { std::alloc::System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, n: usize) -> *mut u8 {
        ALLOCS.with(|a| a.set(a.get() + 1));
        // SAFETY: per the caller's contract.
        unsafe { std::alloc::System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const CHILD: &str = "LONGCTX_P2P_CHILD";
const RESULT: &str = "LONGCTX_RESULT";

/// Index of this `run` call within its test, so parent and child agree on which world a child belongs to.
fn call_id(name: &str) -> String {
    static CALLS: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);
    let mut g = CALLS.lock().unwrap_or_else(|e| e.into_inner());
    let k = g.get_or_insert_with(HashMap::new).entry(name.to_string()).or_insert(0);
    *k += 1;
    format!("{name}#{k}")
}

impl World for Ucx {
    fn run(
        n: usize,
        timeout: Duration,
        name: &str,
        body: &(dyn Fn(Communicator) -> Result<(), String> + Sync),
    ) -> Vec<Result<(), String>> {
        run_with_env(n, timeout, name, &[], body)
    }

    fn die() -> ! {
        std::process::exit(0) // no result line, no communicator shutdown: like a crash, minus the launcher's kill
    }
    const SENDER_SEES_REJECTION: bool = false;
}

/// In a child process of world `id` (this test binary re-run by the parent): joins the job from the
/// environment, runs `body` for this rank, prints the result line and exits. Returns in the parent, and in a
/// child of another world of the same test (`true`: its own children run it).
fn child_mode(id: &str, timeout: Duration, body: &(dyn Fn(Communicator) -> Result<(), String> + Sync)) -> bool {
    let Ok(child) = std::env::var(CHILD) else { return false };
    if child != id {
        return true;
    }
    let res = Communicator::from_env().map_err(|e| e.to_string()).and_then(|mut c| {
        c.set_timeout(timeout);
        body(c)
    });
    let line = match &res {
        Ok(()) => format!("{RESULT} ok"),
        Err(e) => format!("{RESULT} err {e}"),
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
    // Exit 0 either way: the result line carries the outcome, and the launcher must not kill the others.
    std::process::exit(0);
}

/// The result a child printed on `stdout` (its lines, each prefixed by `prefix`), or what it left.
fn child_result(stdout: &str, prefix: &str, r: usize, stderr: &str) -> Result<(), String> {
    let tag = format!("{RESULT} ");
    let found = stdout.lines().filter(|l| l.starts_with(prefix)).find_map(|l| l.split_once(&tag).map(|(_, rest)| rest));
    match found {
        Some("ok") => Ok(()),
        Some(e) => Err(e.strip_prefix("err ").unwrap_or(e).to_string()),
        None => Err(format!("rank {r} left no result\n--- stdout\n{stdout}\n--- stderr\n{stderr}")),
    }
}

/// [`World::run`] with extra environment variables for the ranks' processes.
fn run_with_env(
    n: usize,
    timeout: Duration,
    name: &str,
    env: &[(&str, &str)],
    body: &(dyn Fn(Communicator) -> Result<(), String> + Sync),
) -> Vec<Result<(), String>> {
    let id = call_id(name);
    if child_mode(&id, timeout, body) {
        return vec![Ok(()); n];
    }
    let exe = std::env::current_exe().expect("test binary path");
    let out = Command::new(env!("CARGO_BIN_EXE_longctx-launch"))
        .args(["--nproc", &n.to_string(), "--"])
        .arg(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, &id)
        .envs(env.iter().copied())
        .output()
        .expect("run longctx-launch");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    (0..n).map(|r| child_result(&stdout, &format!("[rank {r}] "), r, &stderr)).collect()
}

/// Starts `n` processes of this test the way `srun` or `mpirun` would, without `longctx-launch`: each gets
/// only the variables `env_of(rank)` gives (the launcher's own variables removed), and the store's address
/// and port come from `Bootstrap::from_env` reading them.
fn run_like_a_scheduler(
    n: usize,
    timeout: Duration,
    name: &str,
    env_of: &dyn Fn(usize) -> Vec<(String, String)>,
    body: &(dyn Fn(Communicator) -> Result<(), String> + Sync),
) -> Vec<Result<(), String>> {
    let id = call_id(name);
    if child_mode(&id, timeout, body) {
        return vec![Ok(()); n];
    }
    let exe = std::env::current_exe().expect("test binary path");
    let children: Vec<_> = (0..n)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            cmd.args([name, "--exact", "--nocapture", "--test-threads=1"]).env(CHILD, &id);
            for k in [
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "UCX_TLS",
                "LONGCTX_UCX_PEER_ERRORS",
            ] {
                cmd.env_remove(k);
            }
            cmd.envs(env_of(r)).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
            cmd.spawn().expect("spawn a rank")
        })
        .collect();
    children
        .into_iter()
        .enumerate()
        .map(|(r, child)| {
            let out = child.wait_with_output().expect("wait for a rank");
            child_result(&String::from_utf8_lossy(&out.stdout), "", r, &String::from_utf8_lossy(&out.stderr))
        })
        .collect()
}

suite_tests!(Ucx, 64);

/// The generic suite again under other UCX settings: a module per variant, whose ranks run with `$env` set.
macro_rules! ucx_suite_variant {
    ($module:ident, $world:ident, $env:expr) => {
        mod $module {
            use super::*;

            struct $world;

            impl World for $world {
                fn run(
                    n: usize,
                    timeout: Duration,
                    name: &str,
                    body: &(dyn Fn(Communicator) -> Result<(), String> + Sync),
                ) -> Vec<Result<(), String>> {
                    // The children re-run this module's test, whose full name has the module's path.
                    run_with_env(n, timeout, &format!("{}::{name}", stringify!($module)), $env, body)
                }

                fn die() -> ! {
                    std::process::exit(0)
                }
                const SENDER_SEES_REJECTION: bool = false;
            }

            suite_tests!($world, 64);
        }
    };
}

// UCX restricted to TCP, the wire between hosts without InfiniBand: the processes of one machine then talk over
// loopback TCP sockets as they would across a network.
ucx_suite_variant!(tcp, UcxTcp, &[("UCX_TLS", "tcp,self")]);
// UCX's peer error handling on, the mode in which a rank survives a peer that dies in the middle of a transfer
// over shared memory.
ucx_suite_variant!(peer_errors, UcxPeerErrors, &[("LONGCTX_UCX_PEER_ERRORS", "1")]);

/// While a UCX job runs, a connection to its rendezvous port that does not present the job token is refused,
/// and the job carries on.
#[test]
fn stray_connection_without_token_is_refused() {
    suite::all_ok(Ucx::run(2, Duration::from_secs(30), "stray_connection_without_token_is_refused", &|c| {
        use std::io::{Read, Write};
        if c.rank() == 1 {
            let port: u16 = std::env::var("MASTER_PORT").map_err(|e| e.to_string())?.parse().map_err(|_| "port")?;
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
            // A well-formed frame with the wrong token, then a request.
            s.write_all(&5u32.to_le_bytes()).and_then(|()| s.write_all(b"guess")).map_err(|e| e.to_string())?;
            let mut reply = Vec::new();
            s.read_to_end(&mut reply).map_err(|e| e.to_string())?;
            if reply != [0] {
                return Err(format!("stray connection got {reply:?}"));
            }
            // And with the real token the store answers (so the refusal was about the token).
            let token = std::env::var("LONGCTX_JOB_TOKEN").map_err(|e| e.to_string())?;
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            let st =
                longctx_p2p::rendezvous::Store::connect(addr, &token, Duration::from_secs(5)).map_err(suite::e2s)?;
            st.set("probe", b"1").map_err(suite::e2s)?;
        }
        c.barrier().map_err(suite::e2s)?;
        let mut x = [1u64];
        c.all_reduce(&mut x, longctx_p2p::ReduceOp::Sum).map_err(suite::e2s)?;
        if x[0] != 2 {
            return Err(format!("all_reduce after the stray connection: {}", x[0]));
        }
        Ok(())
    }));
}

/// The random cases of the threads transport's property tests, on UCX processes: world sizes, lengths, message
/// sizes (up to 16 MiB) and data drawn from the run's seed (`PROPTEST_RNG_SEED`, which `./scripts/test` fixes and
/// which the children inherit, so they draw the same cases), checked against the sequential reference.
#[test]
fn random_cases_from_the_run_seed() {
    let seed: u64 = std::env::var("PROPTEST_RNG_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5EED);
    let mut rng = suite::Rng::new(seed);
    for _ in 0..3 {
        let n = 2 + (rng.next() % 3) as usize;
        let len = (rng.next() % 5000) as usize;
        let data_seed = rng.next();
        let sizes: Vec<usize> = (0..4)
            .map(|i| if i == 0 { (rng.next() % (16 << 20)) as usize } else { (rng.next() % 300_000) as usize })
            .collect();
        let what = format!("seed {seed}: {n} ranks, collectives of {len} elements, messages of {sizes:?} bytes");
        let name = "random_cases_from_the_run_seed";
        let out = Ucx::run(n, Duration::from_secs(30), name, &|c| suite::collectives(c, data_seed, len));
        assert!(out.iter().all(Result::is_ok), "{what}: {out:?}");
        let out = Ucx::run(n, Duration::from_secs(30), name, &|c| suite::send_recv_sizes(c, data_seed, &sizes));
        assert!(out.iter().all(Result::is_ok), "{what}: {out:?}");
    }
}

/// A non-blocking send moves while its rank does something else: over TCP (where the sender must feed the socket
/// and nothing moves unless its worker is progressed) rank 0 posts 64 MiB and sleeps 2 s before waiting, and
/// rank 1's blocking receive must finish within 1 s. With the progress thread turned off the same receive times
/// out, which shows the test measures the progress thread.
#[test]
fn nonblocking_send_moves_while_the_sender_computes() {
    let body = |c: Communicator| -> Result<(), String> {
        let mut c = c;
        let buf = vec![3u8; 64 << 20];
        if c.rank() == 0 {
            let req = c.isend(1, 9, buf).map_err(suite::oe2s)?;
            std::thread::sleep(Duration::from_secs(2));
            req.wait().map(drop).map_err(suite::oe2s)
        } else {
            c.set_timeout(Duration::from_secs(1));
            let mut got = vec![0u8; buf.len()];
            c.recv(0, 9, &mut got).map_err(suite::e2s)?;
            if got != buf {
                return Err("wrong data".into());
            }
            Ok(())
        }
    };
    let name = "nonblocking_send_moves_while_the_sender_computes";
    let tcp = [("UCX_TLS", "tcp,self")];
    suite::all_ok(run_with_env(2, Duration::from_secs(30), name, &tcp, &body));
    let off = [("UCX_TLS", "tcp,self"), ("LONGCTX_UCX_PROGRESS", "0")];
    let out = run_with_env(2, Duration::from_secs(30), name, &off, &body);
    assert!(matches!(&out[1], Err(e) if e.contains("timed out")), "without the progress thread: {out:?}");
}

/// A ring exchange and an all-reduce of a fixed size allocate nothing on the rank's thread after their first
/// calls (this crate's side; UCX's own memory pools are not counted).
#[test]
fn steady_state_ring_exchange_and_all_reduce_do_not_allocate() {
    let name = "steady_state_ring_exchange_and_all_reduce_do_not_allocate";
    suite::all_ok(Ucx::run(3, Duration::from_secs(30), name, &|c| {
        let send = vec![c.rank() as f32; 1 << 16];
        let mut recv = vec![0.0f32; 1 << 16];
        let (mut cur, mut nxt) = (send.clone(), recv.clone());
        let mut acc = vec![1.0f32; 1 << 15];
        for _ in 0..3 {
            c.sendrecv(&send, &mut recv).map_err(suite::e2s)?;
            (cur, nxt) = c.isendrecv(cur, nxt).and_then(|q| q.wait()).map_err(suite::oe2s)?;
            std::mem::swap(&mut cur, &mut nxt);
            c.all_reduce(&mut acc, longctx_p2p::ReduceOp::Sum).map_err(suite::e2s)?;
        }
        c.barrier().map_err(suite::e2s)?;
        let before = ALLOCS.with(|a| a.get());
        for _ in 0..20 {
            c.sendrecv(&send, &mut recv).map_err(suite::e2s)?;
            (cur, nxt) = c.isendrecv(cur, nxt).and_then(|q| q.wait()).map_err(suite::oe2s)?;
            std::mem::swap(&mut cur, &mut nxt);
            c.all_reduce(&mut acc, longctx_p2p::ReduceOp::Max).map_err(suite::e2s)?;
        }
        match ALLOCS.with(|a| a.get()) - before {
            0 => Ok(()),
            k => Err(format!("{k} allocations in 20 steady-state rounds")),
        }
    }));
}

/// An address of this machine other than loopback (the one its default route leaves from), to stand in for a
/// second host's view of it; `None` on a machine with no route out.
fn non_loopback_address() -> Option<std::net::IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("198.51.100.1:9").ok()?; // sends nothing: only picks the route's source address
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

/// A port on `ip` for a rank 0 to host the store on, free now, in 30000..32768: below Linux's ephemeral ports
/// (32768 up), so no process's outgoing connection takes it before rank 0 binds it (a port the system picked
/// for a listener that was then closed can be, and once was), and above the Slurm ports of
/// [`slurm_job_with_a_free_port`].
fn unused_port(ip: std::net::IpAddr) -> u16 {
    // Distinct starts for concurrent tests of this process (which would otherwise find the same port free).
    static CALLS: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let start = (std::process::id() as u16).wrapping_mul(7919).wrapping_add(call.wrapping_mul(101)) % 2768;
    (0..2768u16)
        .map(|k| 30000 + (start + k) % 2768)
        .find(|&p| std::net::TcpListener::bind((ip, p)).is_ok())
        .expect("a free port in 30000..32768")
}

/// A Slurm job id whose derived store port (`20000 + 10 * (id % 1000) + step`) is free on `ip` now.
fn slurm_job_with_a_free_port(ip: std::net::IpAddr, step: u16) -> u32 {
    let start = std::process::id() % 1000;
    (0..1000)
        .map(|k| (start + k) % 1000)
        .find(|&j| std::net::TcpListener::bind((ip, 20000 + 10 * j as u16 + step)).is_ok())
        .map(|j| j + 7000)
        .expect("a free port in 20000..30000")
}

/// Ranks started as `srun` and `mpirun` start them on several hosts, without `longctx-launch`, find each other
/// from those schedulers' variables, over TCP on a non-loopback address as between hosts (`UCX_TLS=tcp,self`;
/// the "hosts" are this machine under its outside address):
/// - Slurm on 2 nodes, `MASTER_ADDR` and `MASTER_PORT` unset: rank 0's host is the first of the step's node
///   list, the port comes from the job and step ids;
/// - Open MPI with one rank per host (`OMPI_COMM_WORLD_LOCAL_SIZE=1`) and `MASTER_ADDR` exported;
/// - the same with `MASTER_ADDR=127.0.0.1`: every rank fails at once, naming the loopback address, instead of
///   the remote ones waiting out their timeout.
#[test]
fn ranks_started_by_slurm_or_mpirun_on_several_hosts_find_each_other() {
    let name = "ranks_started_by_slurm_or_mpirun_on_several_hosts_find_each_other";
    let body = |c: Communicator| -> Result<(), String> {
        // The store is where the test meant the scheduler's variables to put it.
        let store = longctx_p2p::Bootstrap::from_env().and_then(|b| b.master_socket()).map_err(suite::e2s)?;
        if Some(store.to_string()) != std::env::var("LONGCTX_TEST_STORE").ok() {
            return Err(format!("the store is at {store}"));
        }
        let n = c.world_size();
        let mine = vec![c.rank() as u32; 1 << 18];
        let mut got = vec![0u32; 1 << 18];
        c.sendrecv(&mine, &mut got).map_err(suite::e2s)?;
        if got.iter().any(|&x| x as usize != (c.rank() + n - 1) % n) {
            return Err("ring shift delivered the wrong block".into());
        }
        let mut x = [c.rank() as f64];
        c.all_reduce(&mut x, longctx_p2p::ReduceOp::Sum).map_err(suite::e2s)?;
        match x[0] as usize == n * (n - 1) / 2 {
            true => Ok(()),
            false => Err(format!("all_reduce gave {}", x[0])),
        }
    };
    let timeout = Duration::from_secs(20);
    let Some(ip) = non_loopback_address() else {
        eprintln!("skipped: this machine has no address besides loopback to stand in for a second host");
        return;
    };
    let common = |store: String| {
        vec![
            ("UCX_TLS".to_string(), "tcp,self".to_string()),
            ("LONGCTX_JOB_TOKEN".to_string(), "srun-test-token".to_string()),
            ("LONGCTX_TEST_STORE".to_string(), store),
        ]
    };
    // In a child the variables are already set: only the parent looks for a free port.
    let job = if std::env::var(CHILD).is_ok() { 0 } else { slurm_job_with_a_free_port(ip, 3) };
    let slurm = |r: usize| {
        let mut v = common(format!("{ip}:{}", 20000 + 10 * (job % 1000) + 3));
        for (k, val) in [
            ("SLURM_PROCID", r.to_string()),
            ("SLURM_NTASKS", "2".into()),
            ("SLURM_LOCALID", "0".into()),
            ("SLURM_NNODES", "2".into()),
            ("SLURM_JOB_NODELIST", "nodes-of-the-job[1-2]".into()),
            ("SLURM_STEP_NODELIST", format!("{ip},{ip}")),
            ("SLURM_JOB_ID", job.to_string()),
            ("SLURM_STEP_ID", "3".into()),
        ] {
            v.push((k.to_string(), val));
        }
        v
    };
    suite::all_ok(run_like_a_scheduler(2, timeout, name, &slurm, &body));

    let free = unused_port(ip);
    let mpirun = |addr: String| {
        move |r: usize| {
            let mut v = common(format!("{addr}:{free}"));
            for (k, val) in [
                ("OMPI_COMM_WORLD_RANK", r.to_string()),
                ("OMPI_COMM_WORLD_SIZE", "3".into()),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "0".into()),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "1".into()),
                ("MASTER_ADDR", addr.clone()),
                ("MASTER_PORT", free.to_string()),
            ] {
                v.push((k.to_string(), val));
            }
            v
        }
    };
    suite::all_ok(run_like_a_scheduler(3, timeout, name, &mpirun(ip.to_string()), &body));

    let started = std::time::Instant::now();
    let out = run_like_a_scheduler(3, timeout, name, &mpirun("127.0.0.1".into()), &body);
    assert!(out.iter().all(|o| matches!(o, Err(e) if e.contains("loopback"))), "{out:?}");
    assert!(started.elapsed() < timeout, "loopback MASTER_ADDR took {:?} to fail", started.elapsed());
}

/// Two launchers started as on two hosts (`--nnodes 2 --node-rank 0|1`, two ranks each, the shared address,
/// port and token), meeting over TCP on the machine's outside address: the four ranks form one world. Then
/// rank 3 (on node 1) fails: node 1's launcher names it, and node 0's ranks learn of it through the
/// communicator, so both launchers exit non-zero within the timeout.
#[test]
fn launchers_on_two_nodes_form_one_world() {
    let name = "launchers_on_two_nodes_form_one_world";
    let Some(ip) = non_loopback_address() else {
        eprintln!("skipped: this machine has no address besides loopback to stand in for a second host");
        return;
    };
    let run_nodes = |fail: bool, body: &(dyn Fn(Communicator) -> Result<(), String> + Sync)| {
        let id = call_id(name);
        if child_mode(&id, Duration::from_secs(20), body) {
            return None;
        }
        let port = unused_port(ip);
        let exe = std::env::current_exe().expect("test binary path");
        let launchers: Vec<_> = (0..2)
            .map(|node| {
                Command::new(env!("CARGO_BIN_EXE_longctx-launch"))
                    .args(["--nnodes", "2", "--node-rank", &node.to_string(), "--nproc", "2"])
                    .args(["--master-addr", &ip.to_string(), "--master-port", &port.to_string(), "--"])
                    .arg(&exe)
                    .args([name, "--exact", "--nocapture", "--test-threads=1"])
                    .env(CHILD, &id)
                    .env("UCX_TLS", "tcp,self")
                    .env("LONGCTX_JOB_TOKEN", "two-node-test")
                    .env("LONGCTX_TEST_FAIL", if fail { "1" } else { "0" })
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .expect("start a launcher")
            })
            .collect();
        Some(launchers.into_iter().map(|l| l.wait_with_output().expect("wait for a launcher")).collect::<Vec<_>>())
    };
    let body = |c: Communicator| -> Result<(), String> {
        if c.world_size() != 4 {
            return Err(format!("a world of {}", c.world_size()));
        }
        if std::env::var("LONGCTX_TEST_FAIL").as_deref() == Ok("1") {
            if c.rank() == 3 {
                std::process::exit(3);
            }
            let mut x = [0u8; 8];
            return match c.recv(3, 1, &mut x) {
                Err(longctx_p2p::CommError::PeerGone { rank: 3 }) => Err("saw rank 3 gone".into()),
                other => Err(format!("waiting on the failed rank 3: {other:?}")),
            };
        }
        let mine = vec![c.rank() as u16; 100_000];
        let mut got = vec![0u16; 100_000];
        c.sendrecv(&mine, &mut got).map_err(suite::e2s)?;
        let mut x = [1.0f32];
        c.all_reduce(&mut x, longctx_p2p::ReduceOp::Sum).map_err(suite::e2s)?;
        match (got[0] as usize == (c.rank() + 3) % 4, x[0]) {
            (true, 4.0) => Ok(()),
            other => Err(format!("ring shift or all_reduce went wrong: {other:?}")),
        }
    };
    // `None` in a child process of the other world: it goes on to the call its world belongs to.
    if let Some(outs) = run_nodes(false, &body) {
        for (node, out) in outs.iter().enumerate() {
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "node {node}: {text}\n{}", String::from_utf8_lossy(&out.stderr));
            for r in [2 * node, 2 * node + 1] {
                assert_eq!(child_result(&text, &format!("[rank {r}] "), r, ""), Ok(()), "node {node}");
            }
        }
    }
    let started = std::time::Instant::now();
    if let Some(outs) = run_nodes(true, &body) {
        assert!(started.elapsed() < Duration::from_secs(20), "took {:?}", started.elapsed());
        let err1 = String::from_utf8_lossy(&outs[1].stderr);
        assert!(!outs[1].status.success() && err1.contains("rank 3 failed (exit status 3)"), "{err1}");
        let text0 = String::from_utf8_lossy(&outs[0].stdout);
        for r in [0, 1] {
            let got = child_result(&text0, &format!("[rank {r}] "), r, "");
            assert_eq!(got, Err("saw rank 3 gone".into()), "{text0}");
        }
    }
}

/// A peer that stops in the middle of a large transfer (SIGSTOP, as a debugger or a swapped-out node would):
/// the sender's wait fails within its timeout naming it, and the sender reuses its buffer (writes other data in
/// it). The stopped rank, once continued, must not complete its receive with that data: over shared memory,
/// where the receiver pulls the message from the sender's memory, it gets `LinkClosed` (the sender raised its
/// flag before returning the buffer); over TCP, where the sender pushes, it sees the closed connection or times
/// out, as it does anywhere if the withdrawn message never reached it. From UCX 1.22 on also with the buffer
/// freed instead of reused: the resumed receiver's read faults, and it gets `LinkClosed` too (older releases
/// abort it).
#[test]
fn a_peer_stopped_mid_transfer_fails_the_sender_and_never_gets_reused_data() {
    let name = "a_peer_stopped_mid_transfer_fails_the_sender_and_never_gets_reused_data";
    let body =
        |mut c: Communicator| -> Result<(), String> {
            let mut pids = [0u32; 2];
            c.all_gather(&[std::process::id()], &mut pids).map_err(suite::e2s)?;
            // The sender gives up after 1 s. The receiver is continued about 2.2 s after it stopped; its own
            // deadline, 5 s, leaves its receive time to end by what the transfer does (complete, or fail).
            c.set_timeout(Duration::from_secs(if c.rank() == 0 { 1 } else { 5 }));
            let len = 512 << 20;
            // Rank 1 creates this file once its receive has ended.
            let done = std::env::temp_dir().join(format!("longctx-stop-test-{}", pids[0]));
            if c.rank() == 0 {
                let data = vec![7u8; len];
                c.barrier().map_err(suite::e2s)?; // rank 1's receive is posted
                let t0 = std::time::Instant::now();
                let (res, mut data) = match c.isend(1, 5, data).and_then(|r| r.wait()) {
                    Ok(data) => (Ok(()), data),
                    Err((e, data)) => (Err(e), data),
                };
                let took = t0.elapsed();
                // The buffer is the caller's again, and reused, or freed (a 512 MiB allocation is unmapped).
                let unmap = std::env::var("LONGCTX_TEST_UNMAP").is_ok();
                if unmap {
                    data = Vec::new();
                } else {
                    data.fill(9);
                }
                // SAFETY: kill(2) to the peer's pid, which it sent us.
                unsafe { libc::kill(pids[1] as libc::pid_t, libc::SIGCONT) };
                // This process lives on with the reused buffer until the peer's receive has ended (its exit would
                // unmap the buffer, and its store going would turn the peer's error into "gone").
                let t = std::time::Instant::now();
                while !done.exists() && t.elapsed() < Duration::from_secs(25) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                let _ = std::fs::remove_file(&done);
                drop(data);
                return match res {
                    Err(
                        longctx_p2p::CommError::Timeout { peer: 1, .. } | longctx_p2p::CommError::PeerGone { rank: 1 },
                    ) if took < Duration::from_secs(4) => Ok(()),
                    other => Err(format!("send to the stopped rank: {other:?} after {took:?}")),
                };
            }
            let req = c.irecv(0, 5, vec![0u8; len]).map_err(suite::oe2s)?;
            c.barrier().map_err(suite::e2s)?;
            // Let part of it move, then stop.
            std::thread::sleep(Duration::from_millis(2));
            // SAFETY: raise(3) on this process; rank 0 sends SIGCONT once its wait has failed.
            unsafe { libc::raise(libc::SIGSTOP) };
            let over_tcp = std::env::var("UCX_TLS").is_ok_and(|t| t.starts_with("tcp"));
            let res = req.wait().map_err(|(e, _)| e);
            std::fs::write(&done, b"").map_err(|e| e.to_string())?;
            match res {
                // The data arrived, from the reused buffer, or the read of the freed buffer failed: refused.
                // (Over TCP too, if the sender had to force-close the endpoint to withdraw the send.)
                Err(longctx_p2p::CommError::LinkClosed { rank: 0 }) => Ok(()),
                // The closed socket.
                Err(longctx_p2p::CommError::Ucx(_)) if over_tcp => Ok(()),
                // The withdrawn message never came (on a loaded machine the sender may withdraw it before UCX
                // has delivered its announcement, or the rest of it over TCP).
                Err(longctx_p2p::CommError::Timeout { peer: 0, .. }) => Ok(()),
                Err(e) => Err(format!("the resumed receive failed, but with {e}")),
                Ok(got) => Err(format!(
                    "the resumed receive completed although the sender gave up: {} bytes of the reused data",
                    got.iter().filter(|&&b| b == 9).count()
                )),
            }
        };
    suite::all_ok(run_with_env(2, Duration::from_secs(30), name, &[], &body));
    suite::all_ok(run_with_env(2, Duration::from_secs(30), name, &[("UCX_TLS", "tcp,self")], &body));
    // A freed send buffer: UCX 1.13 to 1.21 abort the resumed receiver when its read faults.
    if longctx_p2p::ucx_version() >= (1, 22, 0) {
        suite::all_ok(run_with_env(2, Duration::from_secs(30), name, &[("LONGCTX_TEST_UNMAP", "1")], &body));
    }
}

/// A rank killed (SIGKILL) in the middle of a large transfer, sender or receiver, its peer started without the
/// launcher (which would end it at once): the peer gets `PeerGone` and its process lives on. Over TCP as set up
/// by default; over shared memory with `LONGCTX_UCX_PEER_ERRORS=1` (UCX's peer error handling), and without it
/// where UCX allows: UCX 1.13 to 1.21 abort a process whose zero-copy read from a dead sender fails when
/// endpoints have no error handling, 1.22 fails the receive (`scripts/ucx-versions`), so a dead sender over
/// shared memory in the default mode is run from 1.22 on (a dead receiver is run in it with every version).
#[test]
fn a_rank_killed_mid_transfer_is_an_error_on_its_peer() {
    let name = "a_rank_killed_mid_transfer_is_an_error_on_its_peer";
    let body = |mut c: Communicator| -> Result<(), String> {
        c.set_timeout(Duration::from_secs(5));
        let len = 512 << 20;
        let victim = std::env::var("LONGCTX_TEST_VICTIM").map_err(|e| e.to_string())? == "sender";
        let die = |c: &Communicator| {
            if (c.rank() == 0) == victim {
                std::thread::sleep(Duration::from_millis(2));
                // SAFETY: raise(3) on this process: it dies here, as a crashed rank would.
                unsafe { libc::raise(libc::SIGKILL) };
            }
        };
        let t0 = std::time::Instant::now();
        let res = if c.rank() == 0 {
            let data = vec![7u8; len];
            c.barrier().map_err(suite::e2s)?;
            let req = c.isend(1, 5, data).map_err(suite::oe2s)?;
            die(&c);
            req.wait().map(drop).map_err(|(e, _)| e)
        } else {
            let req = c.irecv(0, 5, vec![0u8; len]).map_err(suite::oe2s)?;
            c.barrier().map_err(suite::e2s)?;
            die(&c);
            req.wait().map(drop).map_err(|(e, _)| e)
        };
        let other = 1 - c.rank();
        match res {
            Err(longctx_p2p::CommError::PeerGone { rank }) if rank == other => Ok(()),
            Err(e) => Err(format!("the transfer with the killed rank failed with {e} after {:?}", t0.elapsed())),
            // 512 MiB take 50 ms or more here: 2 ms in, the message is still on its way.
            Ok(()) => Err("the transfer with the killed rank completed".into()),
        }
    };
    let mut cases = vec![
        ("sender", "tcp,self", false),
        ("sender", "", true),
        ("receiver", "tcp,self", false),
        ("receiver", "", false),
    ];
    if longctx_p2p::ucx_version() >= (1, 22, 0) {
        cases.push(("sender", "", false));
    }
    for (victim, tls, peer_errors) in cases {
        let store = std::net::SocketAddr::from(([127, 0, 0, 1], unused_port([127, 0, 0, 1].into())));
        let env = |r: usize| {
            let mut v = vec![
                ("RANK".to_string(), r.to_string()),
                ("WORLD_SIZE".to_string(), "2".to_string()),
                ("MASTER_ADDR".to_string(), "127.0.0.1".to_string()),
                ("MASTER_PORT".to_string(), store.port().to_string()),
                ("LONGCTX_JOB_TOKEN".to_string(), "kill-test".to_string()),
                ("LONGCTX_TEST_VICTIM".to_string(), victim.to_string()),
            ];
            if !tls.is_empty() {
                v.push(("UCX_TLS".to_string(), tls.to_string()));
            }
            if peer_errors {
                v.push(("LONGCTX_UCX_PEER_ERRORS".to_string(), "1".to_string()));
            }
            v
        };
        let out = run_like_a_scheduler(2, Duration::from_secs(30), name, &env, &body);
        if std::env::var(CHILD).is_ok() {
            continue; // a child of another world: its outcomes here are stand-ins
        }
        let (dead, alive) = if victim == "sender" { (0, 1) } else { (1, 0) };
        assert!(out[dead].is_err(), "the killed rank reported a result");
        assert_eq!(out[alive], Ok(()), "{victim} killed, UCX_TLS={tls:?}, peer errors {peer_errors}");
    }
}

/// A rank that never starts: the others' `Communicator::from_env` fails within the timeout
/// `LONGCTX_TIMEOUT_SECS` sets, naming it, instead of waiting the default 5 minutes. First rank 2 of 3 is
/// missing, then rank 0 (which would host the store) of 2.
#[test]
fn a_rank_that_never_joins_is_named_within_the_timeout() {
    let name = "a_rank_that_never_joins_is_named_within_the_timeout";
    let store = std::net::SocketAddr::from(([127, 0, 0, 1], unused_port([127, 0, 0, 1].into())));
    let env = |r: usize| {
        [
            ("RANK", r.to_string()),
            ("WORLD_SIZE", "3".to_string()), // rank 2 is never started
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", store.port().to_string()),
            ("LONGCTX_JOB_TOKEN", "join-test".to_string()),
            ("LONGCTX_TIMEOUT_SECS", "1.5".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    };
    let t0 = std::time::Instant::now();
    let out = run_like_a_scheduler(2, Duration::from_secs(30), name, &env, &|_| Ok(()));
    if std::env::var(CHILD).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
        for o in &out {
            assert!(matches!(o, Err(e) if e.contains("rank 2 of 3 did not join within 1.5s")), "{out:?}");
        }
    }
    // Rank 1 of 2 alone (the child is started as rank 1 of a world of 2).
    let env1 = |_: usize| {
        let mut v = env(1);
        v.retain(|(k, _)| k != "WORLD_SIZE");
        v.push(("WORLD_SIZE".to_string(), "2".to_string()));
        v
    };
    let t0 = std::time::Instant::now();
    let out = run_like_a_scheduler(1, Duration::from_secs(30), name, &env1, &|_| Ok(()));
    if std::env::var(CHILD).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
        assert!(matches!(&out[0], Err(e) if e.contains("rank 0 did not open the rendezvous store")), "{out:?}");
    }
}

/// Rank 0, which hosts the rendezvous store, stops (SIGSTOP): the other ranks' waits, which ask the store
/// whether their peer is alive, still fail in bounded time naming their peer (rank 0 itself, or a live rank
/// that sends nothing), and rank 0 carries on once continued. (They used to hang on the store's answer.)
#[test]
fn a_stopped_store_host_does_not_hang_the_others() {
    let name = "a_stopped_store_host_does_not_hang_the_others";
    suite::all_ok(Ucx::run(3, Duration::from_secs(30), name, &|mut c| {
        let mut pids = [0u32; 3];
        c.all_gather(&[std::process::id()], &mut pids).map_err(suite::e2s)?;
        c.set_timeout(Duration::from_secs(1));
        c.barrier().map_err(suite::e2s)?;
        if c.rank() == 0 {
            // SAFETY: raise(3) on this process; rank 1 continues it.
            unsafe { libc::raise(libc::SIGSTOP) };
            return Ok(());
        }
        let mut buf = [0u8; 8];
        let t0 = std::time::Instant::now();
        let from = if c.rank() == 1 { 0 } else { 1 }; // rank 2 waits on a live rank that sends nothing
        let res = c.recv(from, 9, &mut buf);
        let took = t0.elapsed();
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(500)); // rank 2 is still waiting or done
                                                            // SAFETY: kill(2) to rank 0's pid, which it sent us.
            unsafe { libc::kill(pids[0] as libc::pid_t, libc::SIGCONT) };
        }
        // The 1 s timeout, plus at most the 2 s a liveness check waits for the store's answer.
        match res {
            Err(longctx_p2p::CommError::Timeout { peer, .. } | longctx_p2p::CommError::PeerGone { rank: peer })
                if peer == from && took < Duration::from_secs(6) =>
            {
                Ok(())
            }
            other => Err(format!("waiting on rank {from} with rank 0 stopped: {other:?} after {took:?}")),
        }
    }));
}

/// A rank that leaves (drops its communicator) while two of its peers are stalled (SIGSTOP), over TCP, where a
/// close waits for the peer: it closes its endpoints together, about one close's patience (2 s) in all rather
/// than one per stalled peer (4.0 s when they were closed one by one), and it exits cleanly (UCX used to abort
/// it in `ucp_worker_destroy` over the close requests left unreleased).
#[test]
fn leaving_with_stalled_peers_takes_one_patience_not_one_per_peer() {
    let name = "leaving_with_stalled_peers_takes_one_patience_not_one_per_peer";
    suite::all_ok(run_with_env(4, Duration::from_secs(30), name, &[("UCX_TLS", "tcp,self")], &|c| {
        let mut pids = [0u32; 4];
        c.all_gather(&[std::process::id()], &mut pids).map_err(suite::e2s)?;
        c.barrier().map_err(suite::e2s)?;
        match c.rank() {
            0 => std::thread::sleep(Duration::from_secs(1)),
            1 => {
                std::thread::sleep(Duration::from_millis(200)); // ranks 2 and 3 are stopped by now
                let t0 = std::time::Instant::now();
                drop(c);
                let took = t0.elapsed();
                for p in &pids[2..] {
                    // SAFETY: kill(2) to a peer's pid, which it sent us.
                    unsafe { libc::kill(*p as libc::pid_t, libc::SIGCONT) };
                }
                if took > Duration::from_millis(3500) {
                    return Err(format!("leaving took {took:?}"));
                }
            }
            // SAFETY: raise(3) on this process; rank 1 continues it.
            _ => unsafe {
                libc::raise(libc::SIGSTOP);
            },
        }
        Ok(())
    }));
}
