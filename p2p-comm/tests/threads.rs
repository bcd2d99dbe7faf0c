//! The generic suite on the threads transport, plus property tests and allocation checks.

mod suite;

use std::time::Duration;

use longctx_p2p::{Communicator, ThreadWorld};
use proptest::prelude::*;
use suite::World;

struct Threads;

impl World for Threads {
    fn run(
        n: usize,
        timeout: Duration,
        _name: &str,
        body: &(dyn Fn(Communicator) -> Result<(), String> + Sync),
    ) -> Vec<Result<(), String>> {
        let comms = ThreadWorld::builder().timeout(timeout).build(n).expect("world");
        std::thread::scope(|s| {
            let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(move || body(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("panicked".into()))).collect()
        })
    }
    fn die() -> ! {
        panic!("rank killed on purpose")
    }
    const EXACT_ERRORS: bool = true;
}

suite_tests!(Threads, 64);

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn collectives_match_reference(n in 1usize..=5, len in 0usize..3000, seed in any::<u64>()) {
        suite::all_ok(Threads::run(n, Duration::from_secs(30), "prop", &|c| suite::collectives(c, seed, len)));
    }

    #[test]
    fn send_recv_any_sizes(n in 1usize..=4, sizes in proptest::collection::vec(0usize..200_000, 1..6), seed in any::<u64>()) {
        suite::all_ok(Threads::run(n, Duration::from_secs(30), "prop", &|c| suite::send_recv_sizes(c, seed, &sizes)));
    }
}

#[test]
fn thread_world_reports_the_first_panic() {
    let res = ThreadWorld::builder().timeout(Duration::from_secs(10)).run(3, |c| {
        if c.rank() == 2 {
            panic!("boom");
        }
        let mut b = [0u8; 1];
        c.recv(2, 0, &mut b)
    });
    match res {
        Err(longctx_p2p::CommError::RankPanicked { rank: 2, message }) => {
            assert!(message.contains("boom"))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn dropped_request_keeps_buffer_until_matched() {
    let out = ThreadWorld::run(2, |c| {
        if c.rank() == 0 {
            let buf = vec![7u32; 1000];
            let req = c.isend(1, 0, &buf).unwrap();
            drop(req); // blocks until rank 1 took the data
            drop(buf);
            0
        } else {
            std::thread::sleep(Duration::from_millis(100));
            let mut b = vec![0u32; 1000];
            c.recv(0, 0, &mut b).unwrap();
            b.iter().sum::<u32>()
        }
    })
    .unwrap();
    assert_eq!(out[1], 7000);
}

#[test]
fn communicator_and_requests_can_move_between_threads() {
    fn is_send<T: Send>() {}
    is_send::<Communicator>();
    is_send::<longctx_p2p::Request<'static>>();
}
