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

/// [`World::run`] with extra environment variables for the ranks' processes.
fn run_with_env(
    n: usize,
    timeout: Duration,
    name: &str,
    env: &[(&str, &str)],
    body: &(dyn Fn(Communicator) -> Result<(), String> + Sync),
) -> Vec<Result<(), String>> {
    {
        let id = call_id(name);
        if let Ok(child) = std::env::var(CHILD) {
            if child != id {
                return vec![Ok(()); n]; // another world of this test: its own children run it
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
        (0..n)
            .map(|r| {
                let prefix = format!("[rank {r}] ");
                let tag = format!("{RESULT} ");
                let found = stdout
                    .lines()
                    .filter(|l| l.starts_with(&prefix))
                    .find_map(|l| l.split_once(&tag).map(|(_, rest)| rest));
                match found {
                    Some("ok") => Ok(()),
                    Some(e) => Err(e.strip_prefix("err ").unwrap_or(e).to_string()),
                    None => Err(format!("rank {r} left no result\n--- stdout\n{stdout}\n--- stderr\n{stderr}")),
                }
            })
            .collect()
    }
}

suite_tests!(Ucx, 64);

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
            let req = c.isend(1, 9, &buf).map_err(suite::e2s)?;
            std::thread::sleep(Duration::from_secs(2));
            req.wait().map_err(suite::e2s)
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
        let mut acc = vec![1.0f32; 1 << 15];
        for _ in 0..3 {
            c.sendrecv(&send, &mut recv).map_err(suite::e2s)?;
            c.isendrecv(&send, &mut recv).map_err(suite::e2s)?.wait().map_err(suite::e2s)?;
            c.all_reduce(&mut acc, longctx_p2p::ReduceOp::Sum).map_err(suite::e2s)?;
        }
        c.barrier().map_err(suite::e2s)?;
        let before = ALLOCS.with(|a| a.get());
        for _ in 0..20 {
            c.sendrecv(&send, &mut recv).map_err(suite::e2s)?;
            c.isendrecv(&send, &mut recv).map_err(suite::e2s)?.wait().map_err(suite::e2s)?;
            c.all_reduce(&mut acc, longctx_p2p::ReduceOp::Max).map_err(suite::e2s)?;
        }
        match ALLOCS.with(|a| a.get()) - before {
            0 => Ok(()),
            k => Err(format!("{k} allocations in 20 steady-state rounds")),
        }
    }));
}
