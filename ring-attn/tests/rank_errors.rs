//! What each rank is told when something is wrong between the ranks or on one of them (threads transport): a
//! schedule that differs between ranks is a typed error naming the field on every rank, at once; under the
//! all-to-all schedules (Ulysses, hybrid) a rank that fails tells its peers why, as it does under the ring.

use std::sync::Arc;
use std::time::{Duration, Instant};

use longctx_ring_attn::{
    AttnOut, CommError, ContextParallel, CpConfig, CpMask, CpShape, CpuBackend, DType, Qkv, RingError, Schedule,
    ThreadWorld, View, ViewMut,
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

/// Each rank's forward result when `bad` passes a `q` of half the plan's tokens and the others pass good views.
fn forward_with_a_bad_view(n: usize, schedule: Schedule, bad: usize) -> Vec<RingError> {
    let started = Instant::now();
    let res = ThreadWorld::builder()
        .timeout(TIMEOUT)
        .try_run(n, |comm| {
            let r = comm.rank();
            let cp =
                ContextParallel::new(comm, Arc::new(CpuBackend::new()), CpConfig { schedule, ..CpConfig::default() })?;
            let mut plan = cp.plan(&SHAPE, &CpMask::causal())?;
            let (qd, kd, ld) = (plan.q_dims(), plan.kv_dims(), plan.lse_dims());
            let (q, kv) = (vec![0.5f32; qd.iter().product()], vec![0.25f32; kd.iter().product()]);
            let (mut o, mut lse) = (vec![0f32; q.len()], vec![0f32; ld.iter().product()]);
            let q_view = if r == bad {
                let half = [qd[0], qd[1], qd[2] / 2, qd[3]];
                View::new(&q[..q.len() / 2], half)?
            } else {
                View::new(&q, qd)?
            };
            let qkv = Qkv::new(q_view, View::new(&kv, kd)?, View::new(&kv, kd)?);
            plan.forward(AttnOut { o: ViewMut::new(&mut o, qd)?, lse: ViewMut::new(&mut lse, ld)? }, qkv).map(|_| ())
        })
        .expect("no rank panicked");
    assert!(started.elapsed() < TIMEOUT, "{schedule:?}: took {:?}", started.elapsed());
    res.into_iter()
        .enumerate()
        .map(|(r, out)| {
            out.err().unwrap_or_else(|| panic!("{schedule:?}: rank {r} completed a forward with a failed peer"))
        })
        .collect()
}

/// The ring (first case) runs on the communicator `ThreadWorld` settles with a failed rank's error; Ulysses and
/// hybrid exchange over communicators split from it, which the failed rank drops before that error is known.
#[test]
fn under_all_to_all_a_failing_rank_tells_its_peers_why() {
    for (n, schedule) in
        [(2, Schedule::Ring), (2, Schedule::Ulysses), (4, Schedule::Ulysses), (4, Schedule::Hybrid { group: 2 })]
    {
        let errs = forward_with_a_bad_view(n, schedule, 1);
        let reason = errs[1].to_string();
        assert!(matches!(&errs[1], RingError::NotAsPlanned { .. }), "{schedule:?}: rank 1: {reason}");
        for (r, e) in errs.iter().enumerate().filter(|(r, _)| *r != 1) {
            // The peer's reason, whether this rank waited on the failed rank itself or on one that failed because
            // of it (a hybrid's other group waits on a member of the failed rank's group).
            assert!(
                matches!(e, RingError::Comm(CommError::PeerFailed { reason: why, .. }) if why.contains(&reason)),
                "{schedule:?} over {n}: rank {r} got `{e}`, not rank 1's reason `{reason}`"
            );
        }
    }
}
