//! A spill the filesystem has no room for is `DiskFull` at that tensor's fetch, and its partial file is removed.
//!
//! "No room" is made with a file size limit (`RLIMIT_FSIZE`, which fails the write with `EFBIG`, one of the
//! errors the engine reports as a full disk): filling a real filesystem would need root and a mount. The limit
//! is process-wide, so this test has its binary to itself.

mod common;

use common::{assert_same, spill_files, tensor};
use longctx_offload::{DType, OffloadEngine, OffloadError};

#[test]
fn a_full_disk_is_a_typed_error_at_fetch() {
    let root = tempfile::tempdir().unwrap();
    let engine = OffloadEngine::builder().disk_tier(root.path(), 64 << 20).workers(1).build().unwrap();
    // SAFETY: ignoring SIGXFSZ (so an over-limit write fails with EFBIG instead of killing the process) and
    // lowering this process's own file size limit touch no memory.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let limit = libc::rlimit { rlim_cur: 1 << 20, rlim_max: libc::RLIM_INFINITY };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
    }
    let small = engine.offload(0, "small", tensor(DType::F32, &[1000], 1)).unwrap();
    let big = engine.offload(1, "big", tensor(DType::F32, &[1 << 20], 2)).unwrap();
    engine.sync();
    let err = engine.fetch(big).unwrap_err();
    assert!(matches!(err, OffloadError::DiskFull { .. }), "{err}");
    assert!(err.to_string().contains("'big' of layer 1"), "{err}");
    assert_same(&engine.fetch(small).unwrap(), &tensor(DType::F32, &[1000], 1), "small");
    engine.sync();
    let stats = engine.stats();
    assert_eq!((stats.failures, stats.disk.unwrap().used_bytes), (1, 0));
    assert!(spill_files(engine.spill_dir().unwrap()).is_empty(), "the partial file is removed");
}
