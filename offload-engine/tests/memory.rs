//! On a machine whose host tier is the caller's own memory, spilling to disk must really lower the process's
//! peak memory: each tensor's allocation is freed once its file is written. Measured with the kernel's own
//! resident-set counters (`VmRSS`, and `VmHWM` reset through `/proc/self/clear_refs`), in a binary of its own
//! so no other test's memory is counted.
//!
//! The tensors are 40 MiB: above the largest threshold at which glibc's `malloc` serves an allocation from
//! its own `mmap` (32 MiB), so freeing one unmaps it. Smaller allocations go back to the allocator's heap,
//! where the caller's next allocations reuse them: the peak still stays flat, as long as the caller keeps
//! allocating tensors of similar sizes.

use longctx_offload::{HostTensor, OffloadEngine, OffloadError};

const TENSOR_ELEMS: usize = 10 << 20; // 40 MiB of f32
const TENSORS: usize = 8;
const MIB: u64 = 1 << 20;

fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn value(t: usize, i: usize) -> f32 {
    (t * TENSOR_ELEMS + i) as f32
}

#[test]
fn spilling_to_disk_lowers_peak_rss_by_the_bytes_on_disk() {
    let root = tempfile::tempdir().unwrap();
    let tensor_bytes = 4 * TENSOR_ELEMS as u64;
    // The budget is what the spill takes (each file a header and the data rounded up to a page, well under a
    // MiB more), not more: CI's temporary directory has had well under a GiB free.
    let engine = OffloadEngine::builder()
        .disk_tier(root.path(), TENSORS as u64 * (tensor_bytes + MIB))
        .workers(2)
        .max_pending_bytes(2 * tensor_bytes)
        .build();
    let engine = match engine {
        Err(OffloadError::DiskTooSmall { path, budget, available }) => {
            eprintln!("{} has {available} bytes free, the spill needs {budget}; skipping", path.display());
            return;
        }
        built => built.unwrap(),
    };
    if std::fs::write("/proc/self/clear_refs", "5").is_err() {
        eprintln!("cannot reset VmHWM here; skipping");
        return;
    }
    let base = status_kib("VmRSS:") * 1024;
    // The forward: each layer makes a tensor (touching every page) and offloads it.
    let mut tickets = Vec::new();
    for t in 0..TENSORS {
        let data: Vec<f32> = (0..TENSOR_ELEMS).map(|i| value(t, i)).collect();
        tickets.push(engine.offload(t, "x", HostTensor::f32(data, [TENSOR_ELEMS]).unwrap()).unwrap());
    }
    engine.sync();
    let peak = status_kib("VmHWM:") * 1024;
    let now = status_kib("VmRSS:") * 1024;
    let stats = engine.stats();
    let on_disk = stats.disk.as_ref().unwrap().bytes_out;
    let handed_over = TENSORS as u64 * tensor_bytes;
    assert_eq!(on_disk, handed_over);
    let (peak_growth, now_growth) = (peak.saturating_sub(base), now.saturating_sub(base));
    eprintln!(
        "handed over {} MiB; peak RSS grew {} MiB, RSS after sync {} MiB above the start",
        handed_over / MIB,
        peak_growth / MIB,
        now_growth / MIB
    );
    // Without offload the peak would have grown by everything handed over. With it: the pending bound, the
    // tensor being made, two 8 MiB staging buffers, and slack for the rest of the process.
    assert!(peak_growth <= 2 * tensor_bytes + tensor_bytes + 16 * MIB + 48 * MIB, "peak grew {peak_growth}");
    assert!(now_growth <= 48 * MIB, "RSS after the spill is still {now_growth} above the start");

    // The backward gets it all back, exactly.
    for (t, ticket) in tickets.into_iter().enumerate().rev() {
        let x = engine.fetch(ticket).unwrap().into_f32().unwrap();
        assert!(x.iter().enumerate().all(|(i, &v)| v.to_bits() == value(t, i).to_bits()), "tensor {t}");
    }
}
