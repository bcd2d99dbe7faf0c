//! What each rank is told when something is wrong between the ranks or on one of them (threads transport): a
//! schedule that differs between ranks is a typed error naming the field on every rank, at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use longctx_ring_attn::{
    ContextParallel, CpConfig, CpMask, CpShape, CpuBackend, DType, RingError, Schedule, ThreadWorld,
};

/// Divisible for every schedule over 2 and 4 ranks (heads by the all-to-all group, tokens by 2·CP).
const SHAPE: CpShape = CpShape { batch: 1, q_heads: 4, kv_heads: 4, seq_len: 64, head_dim: 32, dtype: DType::F32 };

/// Short, so that a failure reported only when a rank gives up waiting shows as a slow test, not a hang.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Each rank's error when rank `r` plans with `schedules[r]`.
fn plan_with(schedules: &[Schedule]) -> Vec<RingError> {
    let started = Instant::now();
    let res = ThreadWorld::builder()
        .timeout(TIMEOUT)
        .try_run(schedules.len(), |comm| {
            let cfg = CpConfig { schedule: schedules[comm.rank()], ..CpConfig::default() };
            let cp = ContextParallel::new(comm, Arc::new(CpuBackend::new()), cfg)?;
            cp.plan(&SHAPE, &CpMask::causal()).map(|_| ())
        })
        .expect("no rank panicked");
    // Caught when the ranks meet, not when one of them gives up waiting for the other.
    assert!(started.elapsed() < TIMEOUT, "{schedules:?}: took {:?}", started.elapsed());
    res.into_iter()
        .enumerate()
        .map(|(r, out)| out.err().unwrap_or_else(|| panic!("{schedules:?}: rank {r} planned")))
        .collect()
}

#[test]
fn a_schedule_that_differs_between_ranks_is_named_on_every_rank() {
    use Schedule::{Ring, Ulysses};
    let (h2, h4) = (Schedule::Hybrid { group: 2 }, Schedule::Hybrid { group: 4 });
    for (schedules, want) in [
        (&[Ring, Ulysses][..], "the ranks disagree on schedule: rank 0: ring; rank 1: ulysses"),
        (&[Ulysses, Ring], "the ranks disagree on schedule: rank 0: ulysses; rank 1: ring"),
        (&[Ring, Ulysses, h2, h2], "the ranks disagree on schedule: rank 0: ring; rank 1: ulysses; ranks 2, 3: hybrid"),
        (&[h2, h2, Ulysses, Ulysses], "the ranks disagree on schedule: ranks 0, 1: hybrid; ranks 2, 3: ulysses"),
        (&[h2, h2, h4, Ring], "the ranks disagree on schedule: ranks 0, 1, 2: hybrid; rank 3: ring"),
        (&[h2, h2, h4, h4], "the ranks disagree on schedule parameter: ranks 0, 1: 2; ranks 2, 3: 4"),
    ] {
        for (r, e) in plan_with(schedules).into_iter().enumerate() {
            let field = if want.contains("parameter") { "schedule parameter" } else { "schedule" };
            assert!(matches!(&e, RingError::RanksDisagree { field: f, .. } if *f == field), "rank {r}: {e}");
            assert_eq!(e.to_string(), want, "rank {r}");
        }
    }
}
