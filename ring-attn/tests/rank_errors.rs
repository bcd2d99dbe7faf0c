//! What each rank is told when something is wrong between the ranks or on one of them (threads transport): a
//! schedule that differs between ranks is a typed error naming the field on every rank, at once; under the
//! all-to-all schedules (Ulysses, hybrid) a rank that fails tells its peers why, as it does under the ring; and a
//! view that does not fit the plan is one error type naming the view, whichever view it is.

use std::sync::Arc;
use std::time::{Duration, Instant};

use longctx_ring_attn::{
    AttnGrads, AttnOut, AttnSaved, CommError, ContextParallel, CpConfig, CpMask, CpShape, CpuBackend, DType, Qkv,
    RingError, Schedule, ThreadWorld, View, ViewMut,
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

/// A view whose dims are not the plan's is one error type whichever view it is, naming the view and giving both
/// dims: each of the forward's views (q, k, v, o, lse) and the backward's (dq, dk, dv, dout and the saved q, k, v,
/// o, lse) in turn, with half the plan's tokens, and a few with half its heads.
#[test]
fn a_view_that_does_not_fit_the_plan_is_one_error_naming_it() {
    // Grouped-query heads, so that q's and k's dims differ.
    let shape = CpShape { q_heads: 4, kv_heads: 2, ..SHAPE };
    let mut cases: Vec<(bool, &str, usize)> = Vec::new(); // (backward, the wrong view, the dim halved)
    cases.extend(["q", "k", "v", "o", "lse"].map(|name| (false, name, 2)));
    cases.extend(["dq", "dk", "dv", "dout", "q", "k", "v", "o", "lse"].map(|name| (true, name, 2)));
    cases.extend([(false, "q", 1), (false, "k", 1), (false, "v", 1), (true, "o", 1), (true, "dv", 1)]);
    let halved = |planned: &[usize], dim: usize| -> Vec<usize> {
        let mut d = planned.to_vec();
        d[dim] /= 2;
        d
    };
    let res = ThreadWorld::run(1, |comm| {
        let cp = ContextParallel::new(comm, Arc::new(CpuBackend::new()), CpConfig::default()).unwrap();
        let mut plan = cp.plan(&shape, &CpMask::causal()).unwrap();
        let (qd, kd, ld) = (plan.q_dims().to_vec(), plan.kv_dims().to_vec(), plan.lse_dims().to_vec());
        let full = |d: &[usize]| vec![0.5f32; d.iter().product()];
        let (q, kv, d_o) = (full(&qd), full(&kd), full(&qd));
        let (mut o, mut lse) = (full(&qd), full(&ld));
        let (mut dq, mut dk, mut dv) = (full(&qd), full(&kd), full(&kd));
        let errs: Vec<Option<RingError>> = cases
            .iter()
            .map(|&(backward, bad, dim)| {
                // Each view over the front of its buffer, with the plan's dims or, for `bad`, the wrong ones.
                let dims = |name: &str, planned: &[usize]| {
                    if name == bad {
                        halved(planned, dim)
                    } else {
                        planned.to_vec()
                    }
                };
                fn view<'a>(buf: &'a [f32], d: &[usize]) -> View<'a> {
                    View::new(&buf[..d.iter().product()], d).unwrap()
                }
                fn view_mut<'a>(buf: &'a mut [f32], d: &[usize]) -> ViewMut<'a> {
                    ViewMut::new(&mut buf[..d.iter().product()], d).unwrap()
                }
                let qkv = Qkv::new(view(&q, &dims("q", &qd)), view(&kv, &dims("k", &kd)), view(&kv, &dims("v", &kd)));
                let r = if backward {
                    let saved = AttnSaved { qkv, o: view(&o, &dims("o", &qd)), lse: view(&lse, &dims("lse", &ld)) };
                    let grads = AttnGrads {
                        dq: view_mut(&mut dq, &dims("dq", &qd)),
                        dk: view_mut(&mut dk, &dims("dk", &kd)),
                        dv: view_mut(&mut dv, &dims("dv", &kd)),
                    };
                    plan.backward(grads, view(&d_o, &dims("dout", &qd)), saved)
                } else {
                    let out =
                        AttnOut { o: view_mut(&mut o, &dims("o", &qd)), lse: view_mut(&mut lse, &dims("lse", &ld)) };
                    plan.forward(out, qkv)
                };
                r.err()
            })
            .collect();
        (errs, [qd, kd, ld])
    })
    .unwrap();
    let (errs, [qd, kd, ld]) = res.into_iter().next().unwrap();
    let mut failures = Vec::new();
    for (&(backward, bad, dim), e) in cases.iter().zip(errs) {
        let planned = match bad {
            "q" | "o" | "dq" | "dout" => &qd,
            "lse" => &ld,
            _ => &kd,
        };
        let call = if backward { "backward" } else { "forward" };
        let Some(e) = e else {
            failures.push(format!("{call} with a wrong `{bad}` succeeded"));
            continue;
        };
        let (got, want) = (format!("{:?}", halved(planned, dim)), format!("{planned:?}"));
        let text = e.to_string();
        let named = matches!(&e, RingError::NotAsPlanned { name, .. } if *name == bad);
        if !(named && text.contains(&got) && text.contains(&want)) {
            failures.push(format!("{call}, `{bad}` {got} for {want}: {e:?}"));
        }
    }
    assert!(failures.is_empty(), "not one error naming the view and both dims:\n{}", failures.join("\n"));
}

/// Every dtype is named in a disagreement (f16 was shown as `?`).
#[test]
fn a_dtype_that_differs_between_ranks_is_named() {
    let res = ThreadWorld::run(2, |comm| {
        let dtype = if comm.rank() == 0 { DType::F32 } else { DType::F16 };
        let cp = ContextParallel::new(comm, Arc::new(CpuBackend::new()), CpConfig::default()).unwrap();
        cp.plan(&CpShape { dtype, ..SHAPE }, &CpMask::causal()).unwrap_err().to_string()
    })
    .unwrap();
    for e in res {
        assert_eq!(e, "the ranks disagree on dtype: rank 0: f32; rank 1: f16");
    }
}
