//! Property: random sequences of offload / prefetch / fetch / drop / hints from several threads, on random
//! shapes and dtypes and random engine options, return every tensor bit-identical, keep every tier within its
//! budget, and leave no spill file behind.

mod common;

use common::{assert_same, host, spill_files, tensor};
use longctx_offload::{ActivationTicket, DType, HostTensor, OffloadEngine, OffloadError, Ticket, Weights};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Offload { dtype: DType, dims: Vec<usize>, seed: u64, layer: usize, weights: bool },
    Prefetch(usize),
    Fetch(usize),
    Drop(usize),
    Hint(usize),
}

#[derive(Debug, Clone)]
struct Config {
    host: Option<u64>,
    disk: Option<u64>,
    workers: usize,
    depth: usize,
    resident: usize,
    spare: u64,
    max_pending: Option<u64>,
    direct_io: bool,
}

const LAYERS: usize = 6;

fn op() -> impl Strategy<Value = Op> {
    let dtype = prop_oneof![Just(DType::F32), Just(DType::Bf16), Just(DType::F16)];
    let offload = (dtype, prop::collection::vec(0usize..24, 0..=3), any::<u64>(), 0..LAYERS, any::<bool>())
        .prop_map(|(dtype, dims, seed, layer, weights)| Op::Offload { dtype, dims, seed, layer, weights });
    prop_oneof![
        4 => offload,
        1 => any::<usize>().prop_map(Op::Prefetch),
        2 => any::<usize>().prop_map(Op::Fetch),
        1 => any::<usize>().prop_map(Op::Drop),
        1 => (0..LAYERS).prop_map(Op::Hint),
    ]
}

fn config() -> impl Strategy<Value = Config> {
    (
        prop::option::of(16u64 << 10..256 << 10),
        prop::option::of(96u64 << 10..1 << 20),
        1usize..=3,
        0usize..=2,
        0usize..=2,
        prop_oneof![Just(0u64), Just(128 << 10)],
        prop::option::of(8u64 << 10..128 << 10),
        // Buffered spill files are fdatasync'ed one by one: slow on a loaded disk, so a quarter of the cases.
        prop::bool::weighted(0.75),
    )
        .prop_filter("at least one tier", |c| c.0.is_some() || c.1.is_some())
        .prop_map(|(host, disk, workers, depth, resident, spare, max_pending, direct_io)| Config {
            host,
            disk,
            workers,
            depth,
            resident,
            spare,
            max_pending,
            direct_io,
        })
}

enum Held {
    Activation(ActivationTicket),
    Weights(Ticket<Weights>),
}

/// Runs one thread's ops; returns how many tensors it checked.
fn run_thread(engine: &OffloadEngine, ops: &[Op]) -> usize {
    let mut live: Vec<(Held, HostTensor)> = Vec::new();
    let mut checked = 0;
    let fetch = |held: Held, want: &HostTensor| {
        let got = match held {
            Held::Activation(t) => engine.fetch(t),
            Held::Weights(t) => engine.fetch(t),
        };
        assert_same(&got.expect("fetch"), want, "round trip");
    };
    for op in ops {
        match op {
            Op::Offload { dtype, dims, seed, layer, weights } => {
                let t = tensor(*dtype, dims, *seed);
                let held = if *weights {
                    engine.offload_weights(*layer, "w", t.clone()).map(Held::Weights)
                } else {
                    engine.offload(*layer, "a", t.clone()).map(Held::Activation)
                };
                match held {
                    Ok(held) => live.push((held, t)),
                    Err(OffloadError::TooLarge { returned, .. }) => assert_same(&host(returned), &t, "handed back"),
                    Err(e) => panic!("offload: {e}"),
                }
            }
            Op::Prefetch(i) if !live.is_empty() => {
                let n = live.len();
                match &live[i % n].0 {
                    Held::Activation(t) => engine.prefetch(t).unwrap(),
                    Held::Weights(t) => engine.prefetch(t).unwrap(),
                }
            }
            Op::Fetch(i) if !live.is_empty() => {
                let n = live.len();
                let (held, want) = live.swap_remove(i % n);
                fetch(held, &want);
                checked += 1;
            }
            Op::Drop(i) if !live.is_empty() => {
                let n = live.len();
                drop(live.swap_remove(i % n));
            }
            Op::Hint(layer) => engine.backward_started(*layer),
            _ => {}
        }
    }
    // The backward: what is left, in reverse.
    while let Some((held, want)) = live.pop() {
        fetch(held, &want);
        checked += 1;
    }
    checked
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn random_use_from_threads_returns_bit_identical_data_within_budgets(
        cfg in config(),
        threads in prop::collection::vec(prop::collection::vec(op(), 0..40), 1..=3),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut b = OffloadEngine::builder();
        if let Some(h) = cfg.host {
            b = b.host_tier(h);
        }
        if let Some(d) = cfg.disk {
            b = b.disk_tier(dir.path(), d);
        }
        b = b.workers(cfg.workers).prefetch_depth(cfg.depth).spare_bytes(cfg.spare).direct_io(cfg.direct_io);
        if cfg.resident > 0 {
            b = b.resident_layers(cfg.resident, LAYERS);
        }
        if let Some(m) = cfg.max_pending {
            b = b.max_pending_bytes(m);
        }
        let engine = b.build().unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = threads.iter().map(|ops| s.spawn(|| run_thread(&engine, ops))).collect();
            for h in handles {
                h.join().unwrap();
            }
        });
        engine.sync();
        let stats = engine.stats();
        for tier in [&stats.host, &stats.disk].into_iter().flatten() {
            prop_assert!(tier.peak_bytes <= tier.budget_bytes, "{:?}", tier);
            prop_assert_eq!(tier.bytes_in, tier.bytes_in.min(tier.bytes_out));
        }
        if let Some(d) = &stats.disk {
            prop_assert_eq!(d.used_bytes, 0);
            prop_assert!(spill_files(engine.spill_dir().unwrap()).is_empty());
        }
        prop_assert_eq!(stats.failures, 0);
        let spill = engine.spill_dir().map(|p| p.to_owned());
        drop(engine);
        if let Some(p) = spill {
            prop_assert!(!p.exists(), "the spill directory is removed with the engine");
        }
    }
}
