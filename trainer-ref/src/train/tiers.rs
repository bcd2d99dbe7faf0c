//! Where a rank's kept activations go (the offload tier) and what the recompute solver prices its choices at.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use longctx_kernels::{Backend, DType, Dims};
use longctx_offload::{DeviceTensor, OffloadEngine};
use longctx_p2p::{Communicator, ReduceOp};
use longctx_recompute::{Costs, Policy};

use crate::device::Device;
use crate::error::{Result, TrainError};
use crate::model::offload_copy::{BackendBuffer, BackendCopier, BackendPageLocker};
use crate::recipe::Recipe;

/// The rates the recompute solver prices its choices at. Only `budget:` weighs them, and only against each
/// other once the run has an offload tier: then rank 0 measures both on this machine (a GEMM on the run's device,
/// and a 16 MiB round trip through the run's own tier, checksums and all) and every rank takes its figures, so all
/// ranks resolve the same plan (ring attention needs them to agree on what each layer reruns). Otherwise the
/// added time is FLOPs over a nominal rate, which only scales it.
pub(super) fn costs(
    world: &Communicator,
    policy: &Policy,
    engine: Option<&OffloadEngine>,
    device: Device,
    backend: &dyn Backend,
) -> Result<Costs> {
    let nominal = Costs { flops_per_s: 1e11, offload_bytes_per_s: 0.0 };
    let Some(engine) = engine.filter(|_| matches!(policy, Policy::Budget(_))) else {
        return Ok(nominal);
    };
    // Every rank of a run has a tier or none (one recipe), so either all reach this all-reduce or none does.
    let mut rates = [0.0f64; 2];
    if world.rank() == 0 {
        rates = [crate::metrics::device_gemm_flops(device, backend)?, tier_bytes_per_s(engine, backend)?];
    }
    world.all_reduce(&mut rates, ReduceOp::Sum)?;
    Ok(Costs { flops_per_s: rates[0], offload_bytes_per_s: rates[1] })
}

/// Bytes per second each way through `engine`: a 16 MiB buffer of the run's backend offloaded and fetched back,
/// timed (so the backend's own copy is in the figure).
fn tier_bytes_per_s(engine: &OffloadEngine, backend: &dyn Backend) -> Result<f64> {
    let n = 4 << 20;
    let buf = backend.zeros(DType::F32, Dims::new(&[n])?)?;
    let probe = DeviceTensor::new(Box::new(BackendBuffer::new(buf, backend.record_event()?)), DType::F32, vec![n])
        .map_err(|e| TrainError::Internal(format!("the offload tier's rate probe: {e}")))?;
    let started = Instant::now();
    let ticket = engine.offload(0, "rate-probe", probe)?;
    engine.fetch(ticket)?;
    Ok(2.0 * (4 * n) as f64 / started.elapsed().as_secs_f64().max(1e-9))
}

/// The rank's offload engine for `train.offload` (`None` for `none`), spilling under `spill_root`, moving
/// `backend`'s buffers with their own copies. `keep_last`: the layers past `train.offload_layers` stay resident;
/// otherwise every layer's handed tensors go out.
pub(super) fn offload_engine(
    recipe: &Recipe,
    backend: &Arc<dyn Backend>,
    rank: usize,
    spill_root: &Path,
    keep_last: bool,
) -> Result<Option<Arc<OffloadEngine>>> {
    let t = &recipe.train;
    let layers = recipe.model.layers;
    let root = if t.offload_dir.is_empty() { spill_root.to_path_buf() } else { PathBuf::from(&t.offload_dir) };
    let dir = root.join(format!("rank{rank}"));
    let budget = match (t.offload_budget.as_str(), t.offload.as_str()) {
        ("auto", "disk") => free_bytes(&dir).map_or(1 << 30, |f| f / 10 * 9),
        ("auto", _) => host_budget(),
        (b, _) => longctx_recompute::parse_bytes(b).ok_or_else(|| TrainError::InvalidField {
            field: "train.offload_budget".into(),
            detail: format!("`{b}` is not a size (8GiB, 512MiB, auto)"),
        })?,
    };
    let offloaded = match (keep_last, t.offload_layers) {
        (false, _) => layers,
        (true, 0) => layers.saturating_sub(1),
        (true, n) => n,
    };
    let b = OffloadEngine::builder()
        .workers(1)
        .prefetch_depth(1)
        .resident_layers(layers - offloaded, layers)
        .device(BackendCopier::new(backend.clone())?);
    let b = match t.offload.as_str() {
        "none" => return Ok(None),
        // On a device, the pool's buffers are registered with it, so the copies run by DMA.
        "host" if backend.device_memory().is_some() => {
            b.host_tier(budget).page_lock(BackendPageLocker::new(backend.clone()))
        }
        "host" => b.host_tier(budget),
        _ => {
            std::fs::create_dir_all(&root).map_err(|e| TrainError::io(&root, e))?;
            b.disk_tier(dir, budget)
        }
    };
    let engine =
        b.build().map_err(|e| TrainError::InvalidField { field: "train.offload".into(), detail: e.to_string() })?;
    Ok(Some(Arc::new(engine)))
}

/// Bytes free on the filesystem holding `dir` (its nearest existing ancestor).
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let existing = dir.ancestors().find(|d| d.exists())?;
    let c = std::ffi::CString::new(existing.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statvfs` is a plain C struct of integers, for which all-zero bytes are a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid C string and `st` a writable statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// Half of `MemAvailable` (bytes), or 1 GiB where `/proc/meminfo` is absent.
fn host_budget() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(1 << 30, |kb| kb * 1024 / 2)
}
