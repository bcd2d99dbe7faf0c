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

    fn die() -> ! {
        std::process::exit(0) // no result line, no communicator shutdown: like a crash, minus the launcher's kill
    }
    const EXACT_ERRORS: bool = false;
}

suite_tests!(Ucx, 64);
