//! Placement, back-pressure, prefetch, resident layers and pooling, each as documented in the crate docs.

mod common;

use common::{assert_same, host, spill_files, tensor};
use longctx_offload::{DType, HostTensor, Location, OffloadEngine, OffloadError, TensorKind, Tier};

/// 64 KiB: exactly one host size class.
const T: usize = 16 << 10;
const T_BYTES: u64 = 4 * T as u64;
/// A spill file of a 64 KiB tensor: a page of header, then the data.
const T_FILE: u64 = T_BYTES + 4096;

fn layer_tensor(seed: u64) -> HostTensor {
    tensor(DType::F32, &[T], seed)
}

#[test]
fn offloads_fill_the_host_tier_then_spill_to_disk_then_wait() {
    let dir = tempfile::tempdir().unwrap();
    let engine =
        OffloadEngine::builder().host_tier(2 * T_BYTES).disk_tier(dir.path(), 3 * T_FILE).workers(1).prefetch_depth(0);
    let engine = engine.build().unwrap();
    let originals: Vec<_> = (0..7).map(layer_tensor).collect();
    let mut tickets: Vec<_> =
        originals.iter().enumerate().map(|(i, t)| Some(engine.offload(i, "x", t.clone()).unwrap())).collect();
    engine.sync();
    let locations = |tickets: &[Option<_>]| -> Vec<Option<Location>> {
        tickets.iter().map(|t: &Option<longctx_offload::ActivationTicket>| t.as_ref().map(|t| t.location())).collect()
    };
    let (host, disk, wait) = (Some(Location::In(Tier::Host)), Some(Location::In(Tier::Disk)), Some(Location::Waiting));
    assert_eq!(locations(&tickets), [host, host, disk, disk, disk, wait, wait]);
    let stats = engine.stats();
    let (h, d) = (stats.host.unwrap(), stats.disk.unwrap());
    assert_eq!((h.peak_bytes, d.peak_bytes), (2 * T_BYTES, 3 * T_FILE), "both tiers exactly full, not over");

    // Freeing host room places the head of the queue there; freeing disk room the next one, on disk.
    drop(tickets[0].take());
    engine.sync();
    assert_eq!(locations(&tickets), [None, host, disk, disk, disk, host, wait]);
    let x2 = engine.fetch(tickets[2].take().unwrap()).unwrap();
    assert_same(&x2, &originals[2], "spilled and fetched");
    engine.sync();
    assert_eq!(locations(&tickets), [None, host, None, disk, disk, host, disk]);

    // Everything comes back bit-exact.
    for (i, t) in tickets.iter_mut().enumerate() {
        if let Some(t) = t.take() {
            assert_same(&engine.fetch(t).unwrap(), &originals[i], "fetched");
        }
    }
    engine.sync();
    let stats = engine.stats();
    assert!(stats.host.unwrap().peak_bytes <= 2 * T_BYTES && stats.disk.unwrap().peak_bytes <= 3 * T_FILE);
    assert!(spill_files(engine.spill_dir().unwrap()).is_empty(), "every spill file is removed once read");
}

#[test]
fn a_fetch_of_a_tensor_still_waiting_takes_it_without_a_copy() {
    let engine = OffloadEngine::builder().host_tier(T_BYTES).workers(1).build().unwrap();
    let a = engine.offload(0, "a", layer_tensor(1)).unwrap();
    let b = engine.offload(1, "b", layer_tensor(2)).unwrap();
    engine.sync();
    assert_eq!((a.location(), b.location()), (Location::In(Tier::Host), Location::Waiting));
    assert_same(&engine.fetch(b).unwrap(), &layer_tensor(2), "waiting tensor");
    let stats = engine.stats();
    assert_eq!((stats.cancelled_offloads, stats.fetches_waited), (1, 0));
    assert_eq!(stats.host.unwrap().tensors_out, 1);
    drop(a);
}

#[test]
fn max_pending_bytes_makes_offload_wait_for_the_copies_but_never_for_room() {
    let dir = tempfile::tempdir().unwrap();
    let engine = OffloadEngine::builder()
        .disk_tier(dir.path(), 64 * T_FILE)
        .workers(1)
        .max_pending_bytes(2 * T_BYTES)
        .build()
        .unwrap();
    let tickets: Vec<_> = (0..12).map(|i| engine.offload(i, "x", layer_tensor(i as u64)).unwrap()).collect();
    let stats = engine.stats();
    assert!(stats.peak_pending_bytes <= 2 * T_BYTES, "{stats:?}");
    assert!(stats.offload_wait > std::time::Duration::ZERO);
    for (i, t) in tickets.into_iter().enumerate().rev() {
        assert_same(&engine.fetch(t).unwrap(), &layer_tensor(i as u64), "fetched");
    }

    // A full tier: the copies cannot progress, so offload returns and the tensors wait in memory.
    let engine = OffloadEngine::builder().host_tier(T_BYTES).workers(1).max_pending_bytes(T_BYTES).build().unwrap();
    let tickets: Vec<_> = (0..3).map(|i| engine.offload(i, "x", layer_tensor(i as u64)).unwrap()).collect();
    engine.sync();
    let at: Vec<_> = tickets.iter().map(|t| t.location()).collect();
    assert_eq!(at, [Location::In(Tier::Host), Location::Waiting, Location::Waiting]);
}

#[test]
fn fetching_layer_k_prefetches_the_layers_below_it() {
    let dir = tempfile::tempdir().unwrap();
    let engine =
        OffloadEngine::builder().disk_tier(dir.path(), 64 * T_FILE).workers(1).prefetch_depth(2).build().unwrap();
    let mut tickets: Vec<_> = (0..6).map(|i| Some(engine.offload(i, "x", layer_tensor(i as u64)).unwrap())).collect();
    engine.sync();
    let x5 = engine.fetch(tickets[5].take().unwrap()).unwrap();
    assert_same(&x5, &layer_tensor(5), "layer 5");
    engine.sync();
    let at = |tickets: &[Option<longctx_offload::ActivationTicket>]| -> Vec<Location> {
        tickets.iter().flatten().map(|t| t.location()).collect()
    };
    let disk = Location::In(Tier::Disk);
    assert_eq!(at(&tickets), [disk, disk, disk, Location::Ready, Location::Ready]);
    // The explicit hint does the same.
    engine.backward_started(3);
    engine.sync();
    assert_eq!(at(&tickets), [disk, Location::Ready, Location::Ready, Location::Ready, Location::Ready]);
    for (i, t) in tickets.iter_mut().enumerate().rev() {
        if let Some(t) = t.take() {
            assert_same(&engine.fetch(t).unwrap(), &layer_tensor(i as u64), "fetched");
        }
    }
    let stats = engine.stats();
    // Layer 5 waited (nothing hinted it); 4..1 were prefetched; 0 was prefetched by fetching 1 or 2.
    assert_eq!(stats.fetches, 6);
    assert!(stats.fetches_waited <= 2, "{stats:?}");
    assert_eq!(stats.disk.unwrap().tensors_in, 6);
}

#[test]
fn the_last_layers_stay_resident() {
    let engine = OffloadEngine::builder().host_tier(64 * T_BYTES).resident_layers(2, 4).build().unwrap();
    let tickets: Vec<_> = (0..4).map(|i| engine.offload(i, "x", layer_tensor(i as u64)).unwrap()).collect();
    engine.sync();
    let at: Vec<_> = tickets.iter().map(|t| t.location()).collect();
    let host = Location::In(Tier::Host);
    assert_eq!(at, [host, host, Location::Resident, Location::Resident]);
    let empty = engine.offload(0, "empty", HostTensor::f32(vec![], [0, 3]).unwrap()).unwrap();
    assert_eq!(empty.location(), Location::Resident, "nothing to move");
    assert_eq!(engine.fetch(empty).unwrap().dims(), &[0, 3]);
    let stats = engine.stats();
    assert_eq!((stats.resident_tensors, stats.host.as_ref().unwrap().tensors_out), (3, 2));
    for (i, t) in tickets.into_iter().enumerate().rev() {
        assert_same(&engine.fetch(t).unwrap(), &layer_tensor(i as u64), "fetched");
    }
}

#[test]
fn steady_state_training_maps_and_allocates_nothing_per_step() {
    const LAYERS: usize = 4;
    const PER_LAYER: [(&str, DType, [usize; 2]); 3] =
        [("x", DType::F32, [64, 64]), ("q", DType::Bf16, [32, 128]), ("lse", DType::F32, [1, 64])];
    let layer_bytes: u64 = PER_LAYER.iter().map(|(_, d, dims)| (d.size() * dims[0] * dims[1]) as u64).sum();
    let engine = OffloadEngine::builder()
        .host_tier(64 << 20)
        .prefetch_depth(1)
        // One layer being used, one prefetched.
        .spare_bytes(2 * layer_bytes)
        .build()
        .unwrap();
    let mut after_first_step = None;
    for step in 0..3u64 {
        let mut saved = Vec::new();
        for layer in 0..LAYERS {
            for (j, (name, dtype, dims)) in PER_LAYER.iter().enumerate() {
                let seed = step * 1000 + (layer * 10 + j) as u64;
                saved.push((seed, engine.offload(layer, *name, tensor(*dtype, dims, seed)).unwrap()));
            }
        }
        // The forward's compute gives the copies time; here the test waits for them.
        engine.sync();
        for layer in (0..LAYERS).rev() {
            let mine: Vec<_> = saved.drain(saved.len() - PER_LAYER.len()..).collect();
            let fetched: Vec<_> = mine
                .into_iter()
                .map(|(seed, t)| {
                    assert_eq!(t.layer(), layer);
                    let (dtype, dims) = (t.dtype(), t.dims().to_vec());
                    let x = engine.fetch(t).unwrap();
                    assert_same(&x, &tensor(dtype, &dims, seed), "fetched");
                    x
                })
                .collect();
            // The layer's backward is done: its tensors are spares for the next fetches.
            for x in fetched {
                engine.recycle(x);
            }
        }
        let stats = engine.stats();
        let counts = (stats.host_buffers_mapped, stats.fetch_allocations);
        match after_first_step {
            None => after_first_step = Some(counts),
            Some(first) => assert_eq!(counts, first, "step {step} mapped or allocated"),
        }
        assert!(stats.peak_spare_bytes <= 2 * layer_bytes);
    }
    assert_eq!(after_first_step.map(|c| c.1), Some(0), "every fetch found a spare");
}

#[test]
fn weights_use_the_same_mechanism_with_their_own_ticket() {
    let dir = tempfile::tempdir().unwrap();
    let engine = OffloadEngine::builder().disk_tier(dir.path(), 16 << 20).build().unwrap();
    let w = tensor(DType::Bf16, &[128, 96], 7);
    let ticket: longctx_offload::WeightsTicket = engine.offload_weights(3, "wq", w.clone()).unwrap();
    assert_eq!(ticket.tag().kind, TensorKind::Weights);
    assert_eq!(ticket.tag().to_string(), "weights 'wq' of layer 3");
    engine.sync();
    assert_eq!(ticket.location(), Location::In(Tier::Disk));
    engine.prefetch(&ticket).unwrap();
    assert_same(&engine.fetch(ticket).unwrap(), &w, "weights");
}

#[test]
fn dropping_a_ticket_frees_its_slot_even_mid_copy() {
    let dir = tempfile::tempdir().unwrap();
    let engine =
        OffloadEngine::builder().host_tier(4 << 20).disk_tier(dir.path(), 64 << 20).workers(2).build().unwrap();
    for i in 0..20 {
        // 4 MiB each: a few land in the host tier, the rest on disk; dropped at once, while moving or waiting.
        drop(engine.offload(i, "big", tensor(DType::F16, &[2 << 20], i as u64)).unwrap());
    }
    let kept = engine.offload(99, "kept", tensor(DType::F16, &[2 << 20], 99)).unwrap();
    engine.sync();
    engine.prefetch(&kept).unwrap();
    drop(kept);
    engine.sync();
    let stats = engine.stats();
    assert_eq!(stats.disk.as_ref().unwrap().used_bytes, 0, "{stats:?}");
    assert!(spill_files(engine.spill_dir().unwrap()).is_empty());
}

#[test]
fn refusals_are_typed_and_hand_the_tensor_back() {
    let engine = OffloadEngine::builder().host_tier(T_BYTES).build().unwrap();
    let big = tensor(DType::F32, &[2 * T], 5);
    match engine.offload(1, "big", big.clone()) {
        Err(OffloadError::TooLarge { tensor, bytes, returned }) => {
            assert_eq!((tensor.layer, tensor.name.as_ref(), bytes), (1, "big", 2 * T_BYTES));
            assert_same(&host(returned), &big, "handed back");
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    let other = OffloadEngine::builder().host_tier(T_BYTES).build().unwrap();
    let t = other.offload(0, "x", layer_tensor(0)).unwrap();
    assert!(matches!(engine.prefetch(&t), Err(OffloadError::ForeignTicket { .. })));
    assert!(matches!(engine.fetch(t), Err(OffloadError::ForeignTicket { .. })));

    let dir = tempfile::tempdir().unwrap();
    let invalid = [
        OffloadEngine::builder(),
        OffloadEngine::builder().host_tier(1).workers(0),
        OffloadEngine::builder().host_tier(0),
        OffloadEngine::builder().disk_tier(dir.path(), 1 << 20).host_tier(1 << 20),
        OffloadEngine::builder().host_tier(1 << 20).host_tier(1 << 20),
        OffloadEngine::builder().host_tier(1 << 20).resident_layers(5, 4),
    ];
    for builder in invalid {
        assert!(matches!(builder.build(), Err(OffloadError::InvalidConfig { .. })));
    }
}

#[test]
fn stats_display_names_each_tier() {
    let engine = OffloadEngine::builder().host_tier(T_BYTES).build().unwrap();
    let t = engine.offload(0, "x", layer_tensor(0)).unwrap();
    engine.sync();
    let _ = engine.fetch(t).unwrap();
    let s = engine.stats().to_string();
    assert!(s.contains("host: out 0.1 MiB (1 tensors") && s.contains("fetch: 1"), "{s}");
}
