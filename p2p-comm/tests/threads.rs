//! The generic suite on the threads transport, plus property tests and allocation checks.

mod suite;

use std::time::Duration;

use longctx_p2p::{CommError, Communicator, ThreadWorld};
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
    const SENDER_SEES_REJECTION: bool = true;
}

suite_tests!(Threads, 64);

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn collectives_match_reference(n in 1usize..=5, len in 0usize..3000, seed in any::<u64>()) {
        suite::all_ok(Threads::run(n, Duration::from_secs(30), "prop", &|c| suite::collectives(c, seed, len)));
    }

    /// Ring exchanges with random sizes, any number in flight (up to three channels' worth), each rank finishing
    /// them in its own random order, some by polling: every message lands where it belongs.
    #[test]
    fn exchanges_in_flight_in_any_order(
        n in 1usize..=4,
        lens in proptest::collection::vec(0usize..40_000, 1..26),
        seed in any::<u64>(),
    ) {
        let out = ThreadWorld::builder().timeout(Duration::from_secs(30)).run(n, |c| {
            let (r, n) = (c.rank() as u32, c.world_size() as u32);
            let prev = (r + n - 1) % n;
            let tag = |rank: u32, i: usize| rank.wrapping_mul(7919) ^ (i as u32).wrapping_mul(104_729) ^ seed as u32;
            let sends: Vec<Vec<u32>> = lens.iter().enumerate().map(|(i, &l)| pattern(tag(r, i), l)).collect();
            let mut recvs: Vec<Vec<u32>> = vec![Vec::new(); lens.len()];
            let mut reqs = Vec::new();
            for (s, &l) in sends.into_iter().zip(&lens) {
                reqs.push(Some(c.isendrecv(s, vec![0u32; l]).map_err(suite::oe2s)?));
            }
            // This rank's order: a permutation drawn from the seed and the rank.
            let mut order: Vec<usize> = (0..reqs.len()).collect();
            let mut x = seed ^ (r as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            for i in (1..order.len()).rev() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            for (k, &i) in order.iter().enumerate() {
                let mut q = reqs[i].take().expect("each request once");
                if k % 3 == 0 {
                    while !q.test() {
                        std::hint::spin_loop();
                    }
                }
                recvs[i] = q.wait().map_err(suite::oe2s)?.1;
            }
            for (i, rv) in recvs.iter().enumerate() {
                if *rv != pattern(tag(prev, i), lens[i]) {
                    return Err(format!("exchange {i} of {}: wrong data", lens.len()));
                }
            }
            Ok::<(), String>(())
        });
        suite::all_ok(out.expect("no rank panicked"));
    }

    /// Messages between host memory and two fake devices in every pairing, any sizes, either side first.
    #[test]
    fn device_messages_any_places(
        n in 1usize..=4,
        msgs in proptest::collection::vec((0usize..100_000, 0u8..3, 0u8..3), 1..8),
        seed in any::<u64>(),
    ) {
        let place = |k: u8| [suite::Place::Host, suite::Place::Device7, suite::Place::Device8][k as usize];
        let msgs: Vec<_> = msgs.into_iter().map(|(len, s, r)| (len, place(s), place(r))).collect();
        suite::all_ok(Threads::run(n, Duration::from_secs(30), "prop", &|c| suite::device_messages(c, seed, &msgs)));
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

/// `ThreadWorld` tells a failed rank's peers why it failed: the error its closure returned (`try_run`) or its
/// panic message (`run` and `try_run`), in their pending and later operations with it.
#[test]
fn thread_world_tells_peers_why_a_rank_failed() {
    let builder = ThreadWorld::builder().timeout(Duration::from_secs(20));
    let peer_sees = |c: &Communicator, why: &str| -> Result<(), String> {
        let mut b = [0u8; 4];
        for when in ["pending", "later"] {
            match c.recv(2, 0, &mut b) {
                Err(CommError::PeerFailed { rank: 2, reason }) if reason.contains(why) => {}
                other => return Err(format!("{when} receive from the failed rank: {other:?}")),
            }
        }
        Ok(())
    };
    let out = builder
        .try_run(3, |c| {
            if c.rank() == 2 {
                std::thread::sleep(Duration::from_millis(100));
                return Err("shard 2 is empty".to_string());
            }
            peer_sees(&c, "shard 2 is empty")
        })
        .unwrap();
    assert!(out[0].is_ok() && out[1].is_ok(), "{out:?}");
    assert_eq!(out[2].as_ref().unwrap_err(), "shard 2 is empty");
    let seen = std::sync::Mutex::new(Vec::new());
    let res = builder.run(3, |c| {
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(100));
            panic!("index out of bounds in rank 2");
        }
        seen.lock().unwrap().push(peer_sees(&c, "panicked: index out of bounds"));
    });
    assert!(matches!(res, Err(CommError::RankPanicked { rank: 2, .. })), "{res:?}");
    let seen = seen.into_inner().unwrap();
    assert!(seen.len() == 2 && seen.iter().all(Result::is_ok), "{seen:?}");
    // A rank that merely returns (or whose communicator outlives its closure) leaves no reason.
    let out = builder
        .run(2, |c| {
            if c.rank() == 1 {
                return Ok(());
            }
            match c.recv(1, 0, &mut [0u8]) {
                Err(CommError::PeerGone { rank: 1 }) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .unwrap();
    suite::all_ok(out);
    let comms = builder.run(2, |c| c).unwrap();
    let (a, b) = comms.split_at(1);
    std::thread::scope(|s| {
        let h = s.spawn(|| a[0].sendrecv(&[1u32], &mut [0u32]));
        b[0].sendrecv(&[2u32], &mut [0u32]).unwrap();
        h.join().unwrap().unwrap();
    });
}

/// A failed rank's reason also reaches its peers in communicators split from the one it was given, though it
/// drops those (leaving them without a word) before its closure's error or its abort says why: in a pending
/// receive and a later one, with the rank named as that communicator numbers it.
#[test]
fn peers_in_a_split_communicator_learn_why_a_rank_failed() {
    let builder = ThreadWorld::builder().timeout(Duration::from_secs(20));
    // Groups {0, 2} and {1, 3}: world rank 2 is rank 1 of its group.
    let peer_sees = |sub: &Communicator, why: &str| -> Result<(), String> {
        for when in ["pending", "later"] {
            match sub.recv(1, 0, &mut [0u8; 4]) {
                Err(CommError::PeerFailed { rank: 1, reason }) if reason.contains(why) => {}
                other => return Err(format!("{when} receive from the failed rank: {other:?}")),
            }
        }
        Ok(())
    };
    let started = std::time::Instant::now();
    let out = builder
        .try_run(4, |c| {
            let sub = c.split((c.rank() % 2) as u32, c.rank() as u32).map_err(|e| e.to_string())?;
            match c.rank() {
                2 => {
                    std::thread::sleep(Duration::from_millis(100));
                    Err("shard 2 is empty".to_string())
                }
                0 => peer_sees(&sub, "shard 2 is empty"),
                _ => Ok(()),
            }
        })
        .unwrap();
    assert!(out[0].is_ok(), "{out:?}");
    // A split member that returns without failing leaves no reason, and its peers are not kept waiting for one.
    let out = builder
        .try_run(2, |c| {
            let sub = c.split(0, c.rank() as u32).map_err(|e| e.to_string())?;
            if c.rank() == 1 {
                return Ok(());
            }
            match sub.recv(1, 0, &mut [0u8]) {
                Err(CommError::PeerGone { rank: 1 }) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .unwrap();
    suite::all_ok(out);
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    // Unsupervised ranks: one that aborts its communicator, then drops the split one.
    let comms = builder.build(2).unwrap();
    let subs: Vec<Communicator> = std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(move || c.split(0, c.rank() as u32).unwrap())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (mut comms, mut subs) = (comms.into_iter(), subs.into_iter());
    let (_c0, c1) = (comms.next().unwrap(), comms.next().unwrap());
    let (s0, s1) = (subs.next().unwrap(), subs.next().unwrap());
    std::thread::scope(|s| {
        let h = s.spawn(|| peer_sees(&s0, "checkpoint is corrupt"));
        std::thread::sleep(Duration::from_millis(100));
        c1.abort("checkpoint is corrupt");
        drop(s1);
        h.join().unwrap().unwrap();
    });
}

#[test]
fn dropped_request_keeps_buffer_until_matched() {
    let out = ThreadWorld::run(2, |c| {
        if c.rank() == 0 {
            let req = c.isend(1, 0, vec![7u32; 1000]).unwrap();
            drop(req); // blocks until rank 1 took the data, then frees the buffer
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
    is_send::<longctx_p2p::OwnedRequest<Vec<f32>>>();
    is_send::<longctx_p2p::OwnedRequest<(Vec<u8>, Box<[f64]>)>>();
}

/// Runs `body` on 2 ranks with a 20 s timeout and returns each rank's result (a panic becomes `Err`).
fn two(body: impl Fn(&Communicator) -> Result<(), String> + Sync) -> Vec<Result<(), String>> {
    let comms = ThreadWorld::builder().timeout(Duration::from_secs(20)).build(2).expect("world");
    std::thread::scope(|s| {
        let body = &body;
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(move || body(&c))).collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("panicked".into()))).collect()
    })
}

fn pattern(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ seed).collect()
}

const BIG: usize = 1 << 18; // 1 MiB of u32: above the deferred-copy threshold

#[test]
fn large_messages_in_both_arrival_orders() {
    for receiver_first in [true, false] {
        suite::all_ok(two(|c| {
            let late = Duration::from_millis(50);
            if c.rank() == 0 {
                if receiver_first {
                    std::thread::sleep(late);
                }
                c.send(1, 3, &pattern(7, BIG)).map_err(suite::e2s)
            } else {
                if !receiver_first {
                    std::thread::sleep(late);
                }
                let mut b = vec![0u32; BIG];
                c.recv(0, 3, &mut b).map_err(suite::e2s)?;
                if b != pattern(7, BIG) {
                    return Err("wrong data".into());
                }
                Ok(())
            }
        }));
    }
}

#[test]
fn large_ring_both_directions_waited_and_polled() {
    suite::all_ok(two(|c| {
        let r = c.rank() as u32;
        let mut send = pattern(r, BIG);
        for polled in [false, true, false, true] {
            let mut req = c.isendrecv(send, vec![0u32; BIG]).map_err(suite::oe2s)?;
            if polled {
                while !req.test() {
                    std::hint::spin_loop();
                }
            }
            let recv;
            (send, recv) = req.wait().map_err(suite::oe2s)?;
            if recv != pattern(1 - r, BIG) {
                return Err(format!("wrong data (polled: {polled})"));
            }
        }
        Ok(())
    }));
}

/// A blocked sender copies a matched large message itself when its receiver is busy waiting on something else
/// (here: a message the sender only sends after this one), in both arrival orders.
#[test]
fn large_send_progresses_while_receiver_waits_elsewhere() {
    for receiver_first in [true, false] {
        suite::all_ok(two(|c| {
            if c.rank() == 0 {
                if receiver_first {
                    std::thread::sleep(Duration::from_millis(50));
                }
                c.send(1, 1, &pattern(1, BIG)).map_err(suite::e2s)?;
                c.send(1, 2, &pattern(2, BIG)).map_err(suite::e2s)
            } else {
                if !receiver_first {
                    std::thread::sleep(Duration::from_millis(50));
                }
                let (mut a, mut b) = (vec![0u32; BIG], vec![0u32; BIG]);
                c.scope(|s| {
                    let ra = s.irecv(0, 1, &mut a)?;
                    c.recv(0, 2, &mut b)?;
                    ra.wait()
                })
                .map_err(suite::e2s)?;
                if a != pattern(1, BIG) || b != pattern(2, BIG) {
                    return Err("wrong data".into());
                }
                Ok(())
            }
        }));
    }
}

/// Both ranks post a large receive, then each blocks in a large send to the other before waiting on its
/// receive: neither receiver copies its half while blocked in its own send, so each sender must take the whole
/// copy over (in every message-size class: the smallest deferred message, of two chunks; many chunks; streamed).
#[test]
fn crossed_blocking_sends_after_posted_receives_complete() {
    for len in [BIG / 16, BIG, 5 << 20] {
        suite::all_ok(two(|c| {
            let (me, peer) = (c.rank(), 1 - c.rank());
            let r = c.irecv(peer, 7, vec![0u32; len]).map_err(suite::oe2s)?;
            c.send(peer, 7, &pattern(me as u32, len)).map_err(suite::e2s)?;
            let inp = r.wait().map_err(suite::oe2s)?;
            if inp != pattern(peer as u32, len) {
                return Err(format!("wrong data at {len} words"));
            }
            Ok(())
        }));
    }
}

#[test]
fn large_length_mismatch_is_reported_to_both() {
    let out = two(|c| {
        let res = if c.rank() == 0 {
            c.send(1, 0, &pattern(0, BIG))
        } else {
            let mut b = vec![0u32; BIG + 1];
            c.recv(0, 0, &mut b)
        };
        match res {
            Err(longctx_p2p::CommError::LengthMismatch { message_bytes, buffer_bytes, .. })
                if message_bytes == BIG * 4 && buffer_bytes == BIG * 4 + 4 =>
            {
                Ok(())
            }
            other => Err(format!("{other:?}")),
        }
    });
    suite::all_ok(out);
}

/// Dropping matched large requests (normally, or while unwinding from a panic) finishes the copy first, so the
/// peer gets its data and nothing touches a buffer after its borrow ends.
#[test]
fn dropping_matched_large_requests_finishes_the_copy() {
    for panic in [false, true] {
        let out = two(|c| {
            if c.rank() == 0 {
                // Dropping blocks until rank 1's copy is done, then frees the buffer.
                drop(c.isend(1, 0, pattern(5, BIG)).map_err(suite::oe2s)?);
                c.send(1, 1, &[0u32]).map_err(suite::e2s)?;
                let mut back = vec![0u32; BIG];
                c.recv(1, 2, &mut back).map_err(suite::e2s)?;
                if back != pattern(6, BIG) {
                    return Err("wrong data back".into());
                }
                Ok(())
            } else {
                std::thread::sleep(Duration::from_millis(50)); // rank 0's send is posted: our irecv matches it
                let mut b = vec![0u32; BIG];
                // Dropping the request (not the scope's end) finishes the copy.
                c.scope(|s| s.irecv(0, 0, &mut b).map(drop)).map_err(suite::e2s)?;
                let mut one = [1u32];
                c.recv(0, 1, &mut one).map_err(suite::e2s)?;
                if b != pattern(5, BIG) || one[0] != 0 {
                    return Err("wrong data".into());
                }
                let req = c.isend(0, 2, pattern(6, BIG)).map_err(suite::oe2s)?;
                std::thread::sleep(Duration::from_millis(50)); // rank 0's receive matched our send
                if panic {
                    std::panic::panic_any("rank 1 dies with a matched send in flight");
                }
                drop(req);
                Ok(())
            }
        });
        if panic {
            assert!(out[0].is_ok(), "{:?}", out[0]);
            assert!(out[1].is_err());
        } else {
            suite::all_ok(out);
        }
    }
}

/// Lengths that end in a short chunk, below and above the streaming-copy threshold (16 MiB): copied by the
/// receiver with its sender's help (ring shift), and by the sender alone (its receiver blocked elsewhere).
#[test]
fn chunked_and_streamed_copies_with_odd_tails() {
    for len in [4 * BIG + 3, (4 << 20) + 1] {
        suite::all_ok(two(|c| {
            let r = c.rank() as u32;
            let send = pattern(r + 10, len);
            let mut recv = vec![0u32; len];
            c.sendrecv(&send, &mut recv).map_err(suite::e2s)?;
            if recv != pattern(11 - r, len) {
                return Err(format!("ring: wrong data ({len} words)"));
            }
            if r == 0 {
                c.send(1, 1, &pattern(1, len)).map_err(suite::e2s)?;
                c.send(1, 2, &[7u32]).map_err(suite::e2s)
            } else {
                let mut go = [0u32];
                let ra = c.irecv(0, 1, vec![0u32; len]).map_err(suite::oe2s)?;
                c.recv(0, 2, &mut go).map_err(suite::e2s)?;
                let a = ra.wait().map_err(suite::oe2s)?;
                if a != pattern(1, len) {
                    return Err(format!("sender alone: wrong data ({len} words)"));
                }
                Ok(())
            }
        }));
    }
}

/// Three senders stream large messages to one receiver that reuses its completions between them, with more
/// threads than the CI machine's 2 cores, so ranks are descheduled mid-operation, and receives both waited and
/// polled. (That a sender which read where its pair was parked never claims chunks of the next pair parked there
/// is checked directly by the threads module's unit test of the claim generation.)
#[test]
fn large_messages_from_three_senders_reuse_completions_safely() {
    const SENDERS: usize = 3;
    let msgs: usize = std::env::var("LONGCTX_TEST_STALE_MSGS").ok().and_then(|v| v.parse().ok()).unwrap_or(400);
    let size = |from: usize, i: usize| (64 << 10) / 4 + (from * 7919 + i * 104_729) % (128 << 10) / 4;
    let comms = ThreadWorld::builder().timeout(Duration::from_secs(60)).build(SENDERS + 1).expect("world");
    let out: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let r = c.rank();
                    if r > 0 {
                        for i in 0..msgs {
                            let data = pattern((r * 100_000 + i) as u32, size(r, i));
                            // Every third message non-blocking and waited late, so the sender helps at odd times.
                            if i % 3 == 0 {
                                let req = c.isend(0, 5, data).map_err(suite::oe2s)?;
                                std::hint::black_box(pattern(0, 1000));
                                req.wait().map_err(suite::oe2s)?;
                            } else {
                                c.send(0, 5, &data).map_err(suite::e2s)?;
                            }
                        }
                        return Ok(());
                    }
                    for i in 0..msgs {
                        let mut reqs = Vec::new();
                        for f in 1..=SENDERS {
                            reqs.push(c.irecv(f, 5, vec![0u32; size(f, i)]).map_err(suite::oe2s)?);
                        }
                        let mut bufs = Vec::new();
                        for (k, mut req) in reqs.into_iter().enumerate() {
                            if (i + k) % 2 == 0 {
                                while !req.test() {
                                    std::hint::spin_loop();
                                }
                            }
                            bufs.push(req.wait().map_err(suite::oe2s)?);
                        }
                        for (f, b) in bufs.iter().enumerate() {
                            if *b != pattern(((f + 1) * 100_000 + i) as u32, b.len()) {
                                return Err(format!("message {i} from rank {}: wrong data", f + 1));
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("panicked".into()))).collect()
    });
    suite::all_ok(out);
}

/// Ring exchanges go through per-pair channels with a fixed number of slots: many more in flight than slots,
/// small and large, finished in reverse order on some ranks and in order on others, on 2 and 3 ranks.
#[test]
fn many_exchanges_in_flight_finish_in_any_order() {
    for n in [2usize, 3] {
        let out = ThreadWorld::builder().timeout(Duration::from_secs(20)).run(n, |c| {
            let (r, n) = (c.rank() as u32, c.world_size() as u32);
            let prev = (r + n - 1) % n;
            let lens: Vec<usize> = (0..27).map(|i| if i % 5 == 0 { 70_000 } else { 1 + 97 * i }).collect();
            let sends: Vec<Vec<u32>> = lens.iter().enumerate().map(|(i, &l)| pattern(r * 100 + i as u32, l)).collect();
            let mut recvs: Vec<Vec<u32>> = lens.iter().map(|&l| vec![0u32; l]).collect();
            c.scope(|s| {
                let mut reqs = Vec::new();
                for (snd, rv) in sends.iter().zip(recvs.iter_mut()) {
                    reqs.push(s.isendrecv(snd, rv)?);
                }
                if r % 2 == 0 {
                    reqs.reverse();
                }
                reqs.into_iter().try_for_each(|q| q.wait())
            })
            .map_err(suite::e2s)?;
            for (i, rv) in recvs.iter().enumerate() {
                if *rv != pattern(prev * 100 + i as u32, lens[i]) {
                    return Err(format!("exchange {i}: wrong data"));
                }
            }
            // The channels are still in step afterwards.
            let mut x = [r as f32];
            c.all_reduce(&mut x, longctx_p2p::ReduceOp::Sum).map_err(suite::e2s)?;
            if x[0] != (0..n).sum::<u32>() as f32 {
                return Err("all_reduce after the burst".into());
            }
            Ok::<(), String>(())
        });
        suite::all_ok(out.expect("no rank panicked"));
    }
}

/// A rank that comes to a ring exchange after its peer timed out on it fails at once, and the next exchange of
/// both works.
#[test]
fn a_timed_out_exchange_fails_on_both_sides_and_the_next_one_works() {
    let timeout = Duration::from_millis(500);
    // Rank 1 comes to the first exchange only once rank 0 has timed out on it (both directions).
    let rank0_failed = &std::sync::Barrier::new(2);
    let out = ThreadWorld::builder().timeout(timeout).run(2, |c| {
        let r = c.rank() as u32;
        let send = pattern(r, 5000);
        let mut recv = vec![0u32; 5000];
        if r == 1 {
            rank0_failed.wait();
        }
        let t0 = std::time::Instant::now();
        let first = c.sendrecv(&send, &mut recv);
        if r == 0 {
            rank0_failed.wait();
        }
        match first {
            Err(longctx_p2p::CommError::Timeout { peer, .. }) if peer == 1 - r as usize => {}
            other => return Err(format!("first exchange: {other:?}")),
        }
        if r == 1 && t0.elapsed() > timeout / 2 {
            return Err(format!("the late rank waited {:?} for a withdrawn message", t0.elapsed()));
        }
        c.sendrecv(&send, &mut recv).map_err(suite::e2s)?;
        if recv != pattern(1 - r, 5000) {
            return Err("wrong data after the timeout".into());
        }
        Ok(())
    });
    suite::all_ok(out.expect("no rank panicked"));
}

/// A rank that panics with exchanges in flight that nobody took yet, or leaves, makes its peers' exchanges
/// with it fail naming it, quickly.
#[test]
fn exchanges_with_a_rank_that_panics_or_leaves_fail_naming_it() {
    for panics in [true, false] {
        let comms = ThreadWorld::builder().timeout(Duration::from_secs(20)).build(3).expect("world");
        // Ranks 0 and 1 stay until both are done: a rank that leaves is a gone peer too.
        let both_done = &std::sync::Barrier::new(2);
        let out: Vec<Result<(), String>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let r = c.rank();
                        let send = pattern(r as u32, 100_000);
                        let mut recv = vec![0u32; 100_000];
                        if r == 2 {
                            if panics {
                                let _req = c.isendrecv(send, recv).map_err(suite::oe2s)?;
                                panic!("rank 2 fails with an exchange in flight");
                            }
                            return Ok(());
                        }
                        std::thread::sleep(Duration::from_millis(100));
                        let t0 = std::time::Instant::now();
                        // Rank 0 receives from rank 2, rank 1 sends to it; their exchange with each other works.
                        let res = match c.sendrecv(&send, &mut recv) {
                            Err(longctx_p2p::CommError::PeerGone { rank: 2 })
                                if t0.elapsed() < Duration::from_secs(5) =>
                            {
                                Ok(())
                            }
                            other => Err(format!("rank {r}: {other:?} after {:?}", t0.elapsed())),
                        };
                        both_done.wait();
                        res
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("panicked".into()))).collect()
        });
        assert!(out[0].is_ok() && out[1].is_ok(), "panics: {panics}: {out:?}");
    }
}

/// A rank that times out on more exchanges than a channel has slots while its peer stalls, and a peer that then
/// runs into all of them: every call returns in bounded time, and the two get back in step.
#[test]
fn exchanges_resynchronize_after_a_run_of_timeouts() {
    let timeout = Duration::from_millis(100);
    let (rank0_failed, both_failed) = (&std::sync::Barrier::new(2), &std::sync::Barrier::new(2));
    let out = ThreadWorld::builder().timeout(timeout).run(2, |c| {
        let r = c.rank() as u32;
        let send = pattern(r, 3000);
        let mut recv = vec![0u32; 3000];
        // Rank 1 stalls until rank 0 has timed out on all of its exchanges.
        if r == 1 {
            rank0_failed.wait();
        }
        let t0 = std::time::Instant::now();
        for i in 0..12 {
            if c.sendrecv(&send, &mut recv).is_ok() {
                return Err(format!("exchange {i} succeeded against a stalled or withdrawn peer"));
            }
        }
        if t0.elapsed() > Duration::from_secs(5) {
            return Err(format!("12 failing exchanges took {:?}", t0.elapsed()));
        }
        if r == 0 {
            rank0_failed.wait();
        }
        both_failed.wait();
        for _ in 0..30 {
            if c.sendrecv(&send, &mut recv).is_ok() {
                if recv != pattern(1 - r, 3000) {
                    return Err("wrong data after resynchronizing".into());
                }
                // Once in step, the next ones work too.
                return (0..5).try_for_each(|_| c.sendrecv(&send, &mut recv)).map_err(suite::e2s);
            }
        }
        Err("never back in step".into())
    });
    suite::all_ok(out.expect("no rank panicked"));
}

/// A rank that only polls its exchange with `test` completes it while its peer is blocked on something else
/// that needs this rank (a message sent only after the exchange).
#[test]
fn a_polled_exchange_completes_while_the_peer_waits_elsewhere() {
    suite::all_ok(two(|c| {
        let r = c.rank() as u32;
        let mut req = c.isendrecv(pattern(r, 50_000), vec![0u32; 50_000]).map_err(suite::oe2s)?;
        if r == 0 {
            let t0 = std::time::Instant::now();
            while !req.test() {
                if t0.elapsed() > Duration::from_secs(5) {
                    return Err("polling never completed the exchange".into());
                }
                std::hint::spin_loop();
            }
            c.send(1, 9, &[1u8]).map_err(suite::e2s)?;
        } else {
            let mut b = [0u8];
            c.recv(0, 9, &mut b).map_err(suite::e2s)?;
        }
        let (_, recv) = req.wait().map_err(suite::oe2s)?;
        if recv != pattern(1 - r, 50_000) {
            return Err("wrong data".into());
        }
        Ok(())
    }));
}

/// Ring exchanges of random sizes, waited, polled or dropped, with now and then a rank sleeping past the
/// (short) timeout or a receive buffer of the wrong length, for a second on 2 and on 3 ranks: no call hangs,
/// every exchange that succeeds delivers the previous rank's whole message, and messages never arrive older
/// than one already received.
#[test]
fn random_exchanges_with_timeouts_never_hang_tear_or_reorder() {
    for n in [2usize, 3] {
        let finished = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let watchdog = {
            let finished = finished.clone();
            std::thread::spawn(move || {
                let t0 = std::time::Instant::now();
                while !finished.load(std::sync::atomic::Ordering::Relaxed) {
                    if t0.elapsed() > Duration::from_secs(60) {
                        eprintln!("random exchanges on {n} ranks hung");
                        std::process::abort();
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        };
        let out = ThreadWorld::builder().timeout(Duration::from_millis(20)).run(n, |c| {
            let (r, n) = (c.rank() as u64, c.world_size() as u64);
            let prev = (r + n - 1) % n;
            let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (r + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
            let mut next = || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let word = |src: u64, seq: u64, i: usize| (src << 56) | (seq << 20) | (i as u64 & 0xF_FFFF);
            let (t0, mut last_seen, mut succeeded) = (std::time::Instant::now(), 0u64, 0u64);
            for seq in 1u64.. {
                // Every rank draws the same size for the same exchange.
                let len = [0usize, 8, 1000, 5000, 20_000, 70_000]
                    [(seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as usize % 6];
                let send: Vec<u64> = (0..len).map(|i| word(r, seq, i)).collect();
                let recv = vec![0u64; if next() % 200 == 0 { len + 1 } else { len }];
                if next() % 400 == 0 {
                    std::thread::sleep(Duration::from_millis(next() % 30));
                }
                let mode = next() % 4;
                let (res, recv) = match mode {
                    0 => {
                        let mut recv = recv;
                        (c.sendrecv(&send, &mut recv), recv)
                    }
                    1 => match c.isendrecv(send, recv) {
                        Ok(mut q) => {
                            while !q.test() {
                                std::hint::spin_loop();
                            }
                            match q.wait() {
                                Ok((_, recv)) => (Ok(()), recv),
                                Err((e, (_, recv))) => (Err(e), recv),
                            }
                        }
                        Err((e, (_, recv))) => (Err(e), recv),
                    },
                    2 => (c.isendrecv(send, recv).map(drop).map_err(CommError::from), Vec::new()),
                    _ => match c.isendrecv(send, recv).and_then(|q| q.wait()) {
                        Ok((_, recv)) => (Ok(()), recv),
                        Err((e, (_, recv))) => (Err(e), recv),
                    },
                };
                if res.is_ok() && mode != 2 && !recv.is_empty() {
                    succeeded += 1;
                    let (src, s) = (recv[0] >> 56, (recv[0] >> 20) & 0xF_FFFF_FFFF);
                    if src != prev || s <= last_seen {
                        return Err(format!("rank {r}: message {s} from rank {src} after message {last_seen}"));
                    }
                    last_seen = s;
                    if let Some(i) = (0..recv.len()).find(|&i| recv[i] != word(prev, s, i)) {
                        return Err(format!("rank {r}: message {s} torn at word {i}"));
                    }
                }
                if seq % 64 == 0 && t0.elapsed() > Duration::from_secs(1) {
                    break;
                }
            }
            if succeeded == 0 {
                return Err(format!("rank {r}: no exchange succeeded"));
            }
            Ok(())
        });
        finished.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = watchdog.join();
        suite::all_ok(out.expect("no rank panicked"));
    }
}

/// A panic inside a scope withdraws its operations before the panic leaves the scope: the receive buffer of the
/// withdrawn operation is never written, and the message it would have matched goes to the next receive. Both
/// sizes: copied at once, and in chunks.
#[test]
fn a_panic_in_a_scope_withdraws_its_operations() {
    for len in [64usize, BIG] {
        suite::all_ok(two(|c| {
            if c.rank() == 0 {
                let mut withdrawn = vec![0u32; len];
                let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    c.scope(|s| {
                        let _pending = s.irecv(1, 5, &mut withdrawn);
                        panic!("a panic with a receive in flight");
                    })
                }));
                if caught.is_ok() {
                    return Err("the scope did not panic".into());
                }
                c.barrier().map_err(suite::e2s)?;
                let mut got = vec![0u32; len];
                c.recv(1, 5, &mut got).map_err(suite::e2s)?;
                if got != pattern(9, len) {
                    return Err("the next receive did not get the message".into());
                }
                if withdrawn.iter().any(|&x| x != 0) {
                    return Err("the withdrawn receive's buffer was written".into());
                }
            } else {
                c.barrier().map_err(suite::e2s)?;
                c.send(0, 5, &pattern(9, len)).map_err(suite::e2s)?;
            }
            Ok(())
        }));
    }
}
