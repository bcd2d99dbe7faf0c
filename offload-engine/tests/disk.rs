//! The disk tier: corruption and truncation are errors naming the tensor, files and directories are cleaned up
//! (also after a crash), and an unusable directory or too small a disk is a typed error.

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;

use common::{assert_same, spill_files, tensor};
use longctx_offload::{DType, DiskIo, Location, OffloadEngine, OffloadError, Tier};
use proptest::prelude::*;

fn disk_engine(root: &Path, direct: bool) -> OffloadEngine {
    OffloadEngine::builder().disk_tier(root, 256 << 20).workers(1).prefetch_depth(0).direct_io(direct).build().unwrap()
}

#[derive(Debug, Clone)]
enum Damage {
    /// XOR a byte of the header page or of the data.
    Flip { at: usize, mask: u8 },
    /// Cut the file to a fraction (in 1/1000) of its length.
    Truncate { keep_permille: u64 },
    /// Append bytes.
    Extend { by: u64 },
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(at, mask)| Damage::Flip { at, mask }),
        (0u64..1000).prop_map(|keep_permille| Damage::Truncate { keep_permille }),
        (1u64..10_000).prop_map(|by| Damage::Extend { by }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn a_damaged_spill_file_is_an_error_naming_the_tensor(
        damage in damage(),
        numel in 1usize..200_000,
        direct in any::<bool>(),
    ) {
        let root = tempfile::tempdir().unwrap();
        let engine = disk_engine(root.path(), direct);
        let ticket = engine.offload(7, "attn.q", tensor(DType::Bf16, &[numel], 3)).unwrap();
        let intact = engine.offload(8, "attn.k", tensor(DType::F32, &[100], 4)).unwrap();
        engine.sync();
        prop_assert_eq!(ticket.location(), Location::In(Tier::Disk));
        let files = spill_files(engine.spill_dir().unwrap());
        prop_assert_eq!(files.len(), 2);
        // Slots are numbered in offload order, and so are their files.
        let path = &files[0];
        let file = OpenOptions::new().read(true).write(true).open(path).unwrap();
        let len = file.metadata().unwrap().len();
        let data_bytes = 2 * numel;
        match damage {
            Damage::Flip { at, mask } => {
                // Anywhere in the header page or the data (the page padding after the data carries nothing).
                let at = (at % (4096 + data_bytes)) as u64;
                let mut b = [0u8];
                file.read_exact_at(&mut b, at).unwrap();
                file.write_all_at(&[b[0] ^ mask], at).unwrap();
            }
            Damage::Truncate { keep_permille } => file.set_len(len * keep_permille / 1000).unwrap(),
            Damage::Extend { by } => file.set_len(len + by).unwrap(),
        }
        drop(file);
        match engine.fetch(ticket) {
            Err(e @ OffloadError::Corrupt { .. }) => {
                let msg = e.to_string();
                prop_assert!(msg.contains("'attn.q' of layer 7"), "{}", msg);
            }
            other => prop_assert!(false, "expected Corrupt, got {:?}", other.map(|t| t.dims().to_vec())),
        }
        // The other tensor is unaffected, and the damaged file is gone.
        assert_same(&engine.fetch(intact).unwrap(), &tensor(DType::F32, &[100], 4), "intact");
        // Spill files are removed by the reaper thread; `sync` waits for it.
        engine.sync();
        prop_assert!(spill_files(engine.spill_dir().unwrap()).is_empty());
        prop_assert_eq!(engine.stats().disk.unwrap().used_bytes, 0, "{:?}", engine.stats());
    }
}

#[test]
fn a_file_swapped_for_another_tensors_is_detected() {
    let root = tempfile::tempdir().unwrap();
    let engine = disk_engine(root.path(), true);
    let a = engine.offload(1, "a", tensor(DType::F16, &[2500], 1)).unwrap();
    let b = engine.offload(2, "b", tensor(DType::F16, &[2500], 2)).unwrap();
    engine.sync();
    let files = spill_files(engine.spill_dir().unwrap());
    std::fs::copy(&files[1], &files[0]).unwrap();
    let err = engine.fetch(a).unwrap_err();
    assert!(matches!(&err, OffloadError::Corrupt { reason, .. } if reason.contains("another tensor")), "{err}");
    assert_same(&engine.fetch(b).unwrap(), &tensor(DType::F16, &[2500], 2), "b");
}

#[test]
fn both_io_modes_round_trip_and_clean_up() {
    for direct in [true, false] {
        let root = tempfile::tempdir().unwrap();
        let engine = disk_engine(root.path(), direct);
        // Ext4 and XFS take O_DIRECT; the engine says what it uses.
        let mode = engine.disk_io().unwrap();
        assert!(direct || mode == DiskIo::Buffered);
        // Elements of f16: 2 bytes each, so a page and a direct-I/O piece (8 MiB) are crossed by one element.
        let sizes = [1usize, 2047, 2048, 2049, (4 << 20) + 3, 3 << 19];
        let tickets: Vec<_> =
            sizes.iter().map(|&n| engine.offload(n, "x", tensor(DType::F16, &[n], n as u64)).unwrap()).collect();
        engine.sync();
        let spill = engine.spill_dir().unwrap().to_owned();
        assert!(spill.starts_with(root.path()));
        assert_eq!(spill_files(&spill).len(), sizes.len(), "{mode:?}");
        let stats = engine.stats();
        let d = stats.disk.as_ref().unwrap();
        assert_eq!(d.bytes_out, 2 * sizes.iter().sum::<usize>() as u64);
        assert!(d.used_bytes <= d.budget_bytes);
        for (t, &n) in tickets.into_iter().zip(&sizes) {
            assert_same(&engine.fetch(t).unwrap(), &tensor(DType::F16, &[n], n as u64), "fetched");
        }
        engine.sync();
        assert!(spill_files(&spill).is_empty(), "files are removed after fetch");
        // A ticket still alive when the engine goes: its file goes with the directory.
        let _alive = engine.offload(0, "late", tensor(DType::F16, &[500], 0)).unwrap();
        engine.sync();
        drop(engine);
        assert!(!spill.exists(), "the spill directory is removed on drop");
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
    }
}

#[test]
fn an_unusable_directory_or_too_small_a_disk_is_a_typed_error() {
    let root = tempfile::tempdir().unwrap();
    let file = root.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let err = OffloadEngine::builder().disk_tier(file.join("spill"), 1 << 20).build().unwrap_err();
    assert!(matches!(err, OffloadError::SpillDir { .. }), "{err}");
    let err = OffloadEngine::builder().disk_tier(root.path(), u64::MAX / 2).build().unwrap_err();
    assert!(matches!(err, OffloadError::DiskTooSmall { budget, available, .. } if available < budget), "{err}");
    // Nothing was left behind by the failed attempts.
    assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
}

#[test]
fn a_live_engines_directory_is_left_alone() {
    let root = tempfile::tempdir().unwrap();
    let first = disk_engine(root.path(), true);
    let t = first.offload(0, "x", tensor(DType::F32, &[1000], 9)).unwrap();
    first.sync();
    let second = disk_engine(root.path(), true);
    assert_eq!(second.stats().stale_files_removed, 0);
    assert_ne!(first.spill_dir(), second.spill_dir());
    assert_same(&first.fetch(t).unwrap(), &tensor(DType::F32, &[1000], 9), "first engine's tensor");
}

/// Set in the child process: offload to disk in this directory, then abort without cleaning up.
const CRASH_DIR: &str = "LONGCTX_OFFLOAD_TEST_CRASH_DIR";

#[test]
fn crash_child() {
    // Only does something when started by `leftovers_of_a_crashed_run_are_removed_at_the_next_start`.
    let Some(root) = std::env::var_os(CRASH_DIR) else { return };
    let engine = disk_engine(Path::new(&root), true);
    let tickets: Vec<_> =
        (0..3).map(|i| engine.offload(i, "x", tensor(DType::F16, &[5_000], i as u64)).unwrap()).collect();
    engine.sync();
    assert_eq!(spill_files(engine.spill_dir().unwrap()).len(), 3);
    std::mem::forget(tickets);
    std::process::abort();
}

#[test]
fn leftovers_of_a_crashed_run_are_removed_at_the_next_start() {
    let root = tempfile::tempdir().unwrap();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .env(CRASH_DIR, root.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success(), "the child aborts");
    let leftovers: Vec<_> = std::fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(leftovers.len(), 1, "the crashed run's directory");
    assert_eq!(spill_files(&leftovers[0]).len(), 3);
    // A user's file in the root is not touched.
    std::fs::write(root.path().join("notes.txt"), b"mine").unwrap();

    let engine = disk_engine(root.path(), true);
    assert_eq!(engine.stats().stale_files_removed, 3);
    assert!(!leftovers[0].exists());
    drop(engine);
    let names: Vec<_> = std::fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["notes.txt"]);
}
