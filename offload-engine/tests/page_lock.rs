//! Page-locking the host tier: each pool buffer locked once when mapped and unlocked before it is unmapped,
//! nothing locked per step, a locker's refusal a typed error (at build for the budget, at fetch for a buffer),
//! and `Mlock` really locking the tier's pages (the process's `VmLck`).

mod common;

use std::io;
use std::sync::{Arc, Mutex};

use common::{assert_same, tensor, MIB};
use longctx_offload::{DType, Mlock, OffloadEngine, OffloadError, PageLocker};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Lock(usize, usize),
    Unlock(usize, usize),
}

/// A locker that records every call, and refuses the `fail_at`-th lock (counting from 0) or any budget above
/// `max_budget`.
#[derive(Debug, Default)]
struct Recorder {
    events: Arc<Mutex<Vec<Event>>>,
    fail_at: Option<usize>,
    max_budget: Option<u64>,
}

// SAFETY: it only records the addresses it is given.
unsafe impl PageLocker for Recorder {
    fn check_budget(&self, budget: u64) -> io::Result<()> {
        match self.max_budget {
            Some(max) if budget > max => Err(io::Error::other(format!("at most {max} bytes may be locked"))),
            _ => Ok(()),
        }
    }
    unsafe fn lock(&self, ptr: *mut u8, len: usize) -> io::Result<()> {
        let mut ev = self.events.lock().unwrap();
        let locks = ev.iter().filter(|e| matches!(e, Event::Lock(..))).count();
        if self.fail_at == Some(locks) {
            return Err(io::Error::from_raw_os_error(libc::ENOMEM));
        }
        ev.push(Event::Lock(ptr as usize, len));
        Ok(())
    }
    unsafe fn unlock(&self, ptr: *mut u8, len: usize) {
        self.events.lock().unwrap().push(Event::Unlock(ptr as usize, len));
    }
}

fn locks(ev: &[Event]) -> Vec<(usize, usize)> {
    ev.iter().filter_map(|e| if let Event::Lock(p, l) = *e { Some((p, l)) } else { None }).collect()
}

fn unlocks(ev: &[Event]) -> Vec<(usize, usize)> {
    ev.iter().filter_map(|e| if let Event::Unlock(p, l) = *e { Some((p, l)) } else { None }).collect()
}

#[test]
fn every_host_buffer_is_locked_once_when_mapped_and_unlocked_before_it_is_unmapped() {
    let events = Arc::new(Mutex::new(Vec::new()));
    let locker = Recorder { events: Arc::clone(&events), ..Default::default() };
    let engine = OffloadEngine::builder().host_tier(16 * MIB).workers(2).page_lock(locker).build().unwrap();
    let shapes: [(DType, &[usize]); 4] =
        [(DType::F32, &[256, 1024]), (DType::Bf16, &[3, 1000, 7]), (DType::F16, &[2500]), (DType::F32, &[1 << 20])];
    let mut after_first = 0;
    for step in 0..3u64 {
        let want: Vec<_> =
            shapes.iter().enumerate().map(|(i, (dt, dims))| tensor(*dt, dims, step * 10 + i as u64)).collect();
        let tickets: Vec<_> =
            want.iter().enumerate().map(|(i, t)| engine.offload(i, "x", t.clone()).unwrap()).collect();
        engine.sync();
        for (i, (tk, w)) in tickets.into_iter().zip(&want).enumerate().rev() {
            assert_same(&engine.fetch(tk).unwrap(), w, &format!("step {step}, tensor {i}"));
        }
        let ev = events.lock().unwrap().clone();
        let stats = engine.stats();
        assert_eq!(locks(&ev).len() as u64, stats.host_buffers_mapped, "one lock per buffer mapped");
        assert!(unlocks(&ev).is_empty(), "nothing unlocked while the pool holds it");
        if step == 0 {
            after_first = locks(&ev).len();
        } else {
            assert_eq!(locks(&ev).len(), after_first, "a later step locks nothing");
        }
    }
    for (p, l) in locks(&events.lock().unwrap()) {
        assert!(p % 4096 == 0 && l % 4096 == 0 && l > 0, "page-aligned whole pages: {p:#x} + {l}");
    }
    drop(engine);
    let ev = events.lock().unwrap().clone();
    let (mut l, mut u) = (locks(&ev), unlocks(&ev));
    l.sort_unstable();
    u.sort_unstable();
    assert_eq!(l, u, "every locked range unlocked once, when the engine is dropped");
}

#[test]
fn a_buffer_that_fails_to_lock_is_an_error_at_its_fetch_naming_the_tensor() {
    let locker = Recorder { fail_at: Some(1), ..Default::default() };
    let engine = OffloadEngine::builder().host_tier(8 * MIB).workers(1).page_lock(locker).build().unwrap();
    let (a, b) = (tensor(DType::F32, &[1000], 1), tensor(DType::F32, &[200_000], 2));
    let ta = engine.offload(0, "a", a.clone()).unwrap();
    engine.sync();
    let tb = engine.offload(1, "b", b).unwrap();
    engine.sync();
    match engine.fetch(tb) {
        Err(OffloadError::PageLock { tensor, bytes, .. }) => {
            assert_eq!((tensor.layer, &*tensor.name, bytes), (1, "b", 800_000));
        }
        other => panic!("expected PageLock, got {other:?}"),
    }
    assert_same(&engine.fetch(ta).unwrap(), &a, "the tensor whose buffer locked");
    assert_eq!(engine.stats().failures, 1);
}

#[test]
fn a_host_budget_the_locker_refuses_is_an_error_at_build() {
    let locker = Recorder { max_budget: Some(4 * MIB), ..Default::default() };
    match OffloadEngine::builder().host_tier(5 * MIB).page_lock(locker).build() {
        Err(e @ OffloadError::PageLockBudget { budget, .. }) => {
            assert_eq!(budget, 5 * MIB);
            assert!(e.to_string().contains("5242880 bytes"), "{e}");
        }
        other => panic!("expected PageLockBudget, got {:?}", other.map(|_| ())),
    }
    let dir = tempfile::tempdir().unwrap();
    let only_disk = OffloadEngine::builder().disk_tier(dir.path(), 8 * MIB).page_lock(Recorder::default()).build();
    assert!(matches!(only_disk, Err(OffloadError::InvalidConfig { .. })), "nothing to lock without a host tier");
}

/// The process's locked memory (`VmLck`), in bytes.
fn vm_locked() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib = status.lines().find_map(|l| l.strip_prefix("VmLck:")).unwrap();
    kib.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024
}

#[test]
fn mlock_keeps_the_host_tier_resident_and_releases_it_with_the_engine() {
    // Two 1 MiB tensors: within the 8 MiB a process may lock by default, so this runs without privileges too.
    let budget = 4 * MIB;
    let engine = match OffloadEngine::builder().host_tier(budget).page_lock(Mlock).build() {
        Ok(e) => e,
        Err(e @ OffloadError::PageLockBudget { .. }) => {
            eprintln!("skipped: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let before = vm_locked();
    let want = [tensor(DType::F32, &[1 << 18], 7), tensor(DType::F16, &[1 << 19], 8)];
    let tickets: Vec<_> = want.iter().enumerate().map(|(i, t)| engine.offload(i, "t", t.clone()).unwrap()).collect();
    engine.sync();
    let held = engine.stats().host.unwrap().used_bytes;
    assert_eq!(held, 2 * MIB);
    // No other test of this binary locks memory, so the change is this engine's.
    assert!(vm_locked() >= before + held, "VmLck {} < {} + {held}", vm_locked(), before);
    for (tk, w) in tickets.into_iter().zip(&want) {
        assert_same(&engine.fetch(tk).unwrap(), w, "through locked buffers");
    }
    drop(engine);
    assert!(vm_locked() <= before, "VmLck {} after the engine, {before} before it", vm_locked());
}
