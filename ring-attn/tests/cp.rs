//! Context-parallel attention against single-rank full attention, over random CP sizes, shapes, masks,
//! schedules, partitions and dtypes (threads transport).

use half::bf16;
use longctx_kernels::attention::reference;
use longctx_kernels::testing::{max_rel_err as rel_err, reference_f64, uniform_nonzero};
use std::sync::Arc;

use longctx_kernels::{AttnMask, AttnParams, AttnShape, Buffer, CudaBackend, Dims, Element, Memory, Positions};
use longctx_ring_attn::{
    AttnGrads, AttnOut, AttnSaved, Backend, ContextParallel, CpConfig, CpMask, CpPlan, CpShape, CpuBackend, DType,
    Partition, Qkv, RingError, Schedule, SeqLayout, ThreadWorld, View, ViewMut,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    cp: usize,
    shape: CpShape,
    partition: Partition,
    schedule: Schedule,
    causal: bool,
    window: Option<u64>,
    /// Document boundaries every `doc_len` tokens when set.
    doc_len: Option<usize>,
    seed: u64,
}

/// Everything one rank returns: o, lse, dq, dk, dv (as f32) and (bytes sent, bytes expected) for fwd and bwd.
type RankOut = ([Vec<f32>; 5], [(u64, u64); 2]);

/// The full-sequence inputs, rounded to the case's dtype (so the single-rank run sees the same numbers).
struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_o: Vec<f32>,
    docs: Option<Vec<u32>>,
}

fn inputs(c: &Case) -> Inputs {
    let s = c.shape;
    let round = |x: Vec<f32>| -> Vec<f32> {
        match c.shape.dtype {
            DType::F32 => x,
            DType::Bf16 => x.into_iter().map(|v| bf16::from_f32(v).to_f32()).collect(),
            DType::F16 => x.into_iter().map(|v| half::f16::from_f32(v).to_f32()).collect(),
        }
    };
    let qn = s.batch * s.q_heads * s.seq_len * s.head_dim;
    let kn = s.batch * s.kv_heads * s.seq_len * s.head_dim;
    Inputs {
        q: round(uniform_nonzero(qn, c.seed)),
        k: round(uniform_nonzero(kn, c.seed ^ 1)),
        v: round(uniform_nonzero(kn, c.seed ^ 2)),
        d_o: round(uniform_nonzero(qn, c.seed ^ 3)),
        docs: c.doc_len.map(|dl| (0..s.seq_len).map(|i| (i / dl) as u32).collect()),
    }
}

/// Full attention (forward and backward) on the whole sequence by the plain f64 reference: exact, so a gradient
/// that vanishes (a window of 1) is exactly zero there and measured absolutely.
fn full(c: &Case, x: &Inputs) -> [Vec<f64>; 5] {
    let s = c.shape;
    let shape = AttnShape {
        batch: s.batch,
        q_heads: s.q_heads,
        kv_heads: s.kv_heads,
        q_len: s.seq_len,
        kv_len: s.seq_len,
        head_dim: s.head_dim,
    };
    let mut mask = AttnMask::full().with_positions(Positions::Offset(0), Positions::Offset(0));
    mask.causal = c.causal;
    mask.window = c.window;
    if let Some(d) = &x.docs {
        mask = mask.with_docs(d, d);
    }
    let p = AttnParams::new(shape).with_mask(mask);
    reference_f64(&p, &x.q, &x.k, &x.v, &x.d_o)
}

/// Runs the case on `c.cp` thread ranks; returns the unsharded outputs and each rank's byte counts.
/// Unsharded outputs and, per rank, (sent, expected) bytes of forward and backward.
type CpRun = ([Vec<f32>; 5], Vec<[(u64, u64); 2]>);

/// Makes one rank's backend.
type MakeBackend = fn() -> Arc<dyn Backend>;

fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::new())
}

/// Forward and backward of one rank through its plan, in the element type `T`, on buffers of the backend `b`
/// (inputs uploaded, outputs poisoned with NaN first and downloaded after); outputs widened to f32.
fn fwd_bwd<T: Element>(b: &dyn Backend, plan: &mut CpPlan, [q, k, v, d_o]: [&[f32]; 4]) -> RankOut {
    let (qd, kd, ld) = (plan.q_dims(), plan.kv_dims(), plan.lse_dims());
    let up = |x: &[f32], dims: &[usize]| {
        let host: Vec<T> = x.iter().map(|&a| T::from_f32(a)).collect();
        let mut buf = b.empty(T::DTYPE, Dims::new(dims).unwrap()).unwrap();
        b.upload(buf.view_mut(), View::new(&host, dims).unwrap()).unwrap();
        buf
    };
    let poisoned = |dtype: DType, dims: &[usize]| {
        let mut buf = b.empty(dtype, Dims::new(dims).unwrap()).unwrap();
        b.fill(buf.view_mut(), f32::NAN).unwrap();
        buf
    };
    let down = |buf: &Buffer| {
        if buf.dtype() == DType::F32 {
            let mut host = vec![0f32; buf.len()];
            b.download(ViewMut::new(&mut host, buf.dims()).unwrap(), buf.view()).unwrap();
            return host;
        }
        let mut host = vec![T::from_f32(0.0); buf.len()];
        b.download(ViewMut::new(&mut host, buf.dims()).unwrap(), buf.view()).unwrap();
        host.iter().map(|a| a.to_f32()).collect()
    };
    let (q, k, v, d_o) = (up(q, &qd), up(k, &kd), up(v, &kd), up(d_o, &qd));
    let (mut o, mut lse) = (poisoned(T::DTYPE, &qd), poisoned(DType::F32, &ld));
    let qkv = Qkv::new(q.view(), k.view(), v.view());
    let rf = plan.forward(AttnOut { o: o.view_mut(), lse: lse.view_mut() }, qkv).unwrap();
    let (mut dq, mut dk, mut dv) = (poisoned(T::DTYPE, &qd), poisoned(T::DTYPE, &kd), poisoned(T::DTYPE, &kd));
    let grads = AttnGrads { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut() };
    let saved = AttnSaved { qkv, o: o.view(), lse: lse.view() };
    let rb = plan.backward(grads, d_o.view(), saved).unwrap();
    b.synchronize().unwrap();
    // The compute queue's idle time in the ring is measured on a GPU's clock only; never on host memory, and
    // never more than the calls took.
    let idle = plan.take_totals().device_idle;
    assert!(b.memory() != Memory::Host || idle.is_none(), "device_idle {idle:?} on the CPU");
    assert!(idle.is_none_or(|d| d < std::time::Duration::from_secs(60)), "device_idle {idle:?}");
    let outs = [down(&o), down(&lse), down(&dq), down(&dk), down(&dv)];
    (outs, [(rf.bytes_sent, rf.expected_bytes), (rb.bytes_sent, rb.expected_bytes)])
}

fn run_cp(c: &Case, x: &Inputs) -> CpRun {
    run_cp_on(c, x, cpu)
}

fn run_cp_on(c: &Case, x: &Inputs, make: MakeBackend) -> CpRun {
    let s = c.shape;
    let layout = SeqLayout::new(c.partition, c.cp, s.seq_len).unwrap();
    let d = s.head_dim;
    let outs: Vec<RankOut> = ThreadWorld::builder()
        .timeout(std::time::Duration::from_secs(60))
        .run(c.cp, |comm| {
            let r = comm.rank();
            let cfg = CpConfig { partition: c.partition, schedule: c.schedule, scale: None };
            let backend = make();
            let cpa = ContextParallel::new(comm, backend.clone(), cfg).unwrap();
            let sh = |full: &[f32], heads: usize| layout.shard(full, s.batch * heads, d, r).unwrap();
            let (q, k, v, d_o) =
                (sh(&x.q, s.q_heads), sh(&x.k, s.kv_heads), sh(&x.v, s.kv_heads), sh(&x.d_o, s.q_heads));
            let mask = CpMask { causal: c.causal, window: c.window, documents: x.docs.is_some() };
            let mut plan = cpa.plan(&s, &mask).unwrap();
            if let Some(dd) = &x.docs {
                plan.set_documents(&layout.shard(dd, 1, 1, r).unwrap()).unwrap();
            }
            match c.shape.dtype {
                DType::F32 => fwd_bwd::<f32>(&*backend, &mut plan, [&q, &k, &v, &d_o]),
                DType::Bf16 => fwd_bwd::<bf16>(&*backend, &mut plan, [&q, &k, &v, &d_o]),
                DType::F16 => fwd_bwd::<half::f16>(&*backend, &mut plan, [&q, &k, &v, &d_o]),
            }
        })
        .unwrap();
    let mut per_rank: [Vec<Vec<f32>>; 5] = Default::default();
    let mut bytes = Vec::new();
    for (bufs, b) in outs {
        for (i, x) in bufs.into_iter().enumerate() {
            per_rank[i].push(x);
        }
        bytes.push(b);
    }
    let un = |i: usize, heads: usize, inner: usize| layout.unshard(&per_rank[i], s.batch * heads, inner).unwrap();
    ([un(0, s.q_heads, d), un(1, s.q_heads, 1), un(2, s.q_heads, d), un(3, s.kv_heads, d), un(4, s.kv_heads, d)], bytes)
}

fn check(c: &Case) -> Result<(), TestCaseError> {
    check_on(c, cpu)
}

/// [`check`] with each rank on a backend from `make`.
fn check_on(c: &Case, make: MakeBackend) -> Result<(), TestCaseError> {
    let x = inputs(c);
    let want = full(c, &x);
    let (got, bytes) = run_cp_on(c, &x, make);
    let tol = match c.shape.dtype {
        DType::F32 => 1e-5,
        DType::Bf16 => 2e-2,
        DType::F16 => 5e-3,
    };
    for (i, name) in ["O", "LSE", "dQ", "dK", "dV"].iter().enumerate() {
        let e = rel_err(&got[i], &want[i]);
        prop_assert!(e < tol, "{name}: relative error {e:e} for {c:?}");
    }
    for (r, [(f, fe), (b, be)]) in bytes.iter().enumerate() {
        prop_assert_eq!(f, fe, "rank {} forward bytes for {:?}", r, c);
        prop_assert_eq!(b, be, "rank {} backward bytes for {:?}", r, c);
    }
    Ok(())
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        1usize..=8,
        0usize..4,
        0usize..3,
        (1usize..=2, 1usize..=2, 1usize..=3, 4usize..=8),
        (any::<bool>(), prop::option::of(1u64..100), prop::option::of(5usize..60), any::<bool>()),
        any::<u64>(),
        (any::<prop::sample::Index>(), 1usize..=3),
    )
        .prop_map(|(cp, sched, part, (b, hkv_mul, g, d8), (causal, window, doc_len, bf), seed, (gi, m))| {
            let partition = [Partition::Zigzag, Partition::Contiguous, Partition::Striped][part];
            let divisors: Vec<usize> = (1..=cp).filter(|u| cp % u == 0).collect();
            let (schedule, group) = match sched {
                0 => (Schedule::Ring, 1),
                1 => (Schedule::AllGather { kv_heads_per_step: 1 + seed as usize % 2 }, 1),
                2 => (Schedule::Ulysses, cp),
                _ => {
                    let u = *gi.get(&divisors);
                    (Schedule::Hybrid { group: u }, u)
                }
            };
            // Ulysses and hybrid need the head counts divisible by the group: scale KV heads by it.
            let kv_heads = hkv_mul * group;
            let div = if partition == Partition::Zigzag { 2 * cp } else { cp };
            let seq_len = div * m * (1 + (seed as usize >> 8) % (48 / div).max(1));
            Case {
                cp,
                shape: CpShape {
                    batch: b,
                    q_heads: kv_heads * g,
                    kv_heads,
                    seq_len,
                    head_dim: d8 * 8,
                    dtype: if bf { DType::Bf16 } else { DType::F32 },
                },
                partition,
                schedule,
                causal,
                window,
                doc_len,
                seed,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    /// Forward O, LSE and backward dQ, dK, dV match full attention; bytes sent match each schedule's formula.
    #[test]
    fn matches_full_attention(c in case_strategy()) {
        check(&c)?;
    }
}

/// Every schedule and partition on one fixed causal case with CP = 4 and 8, f32 and bf16.
#[test]
fn every_schedule_and_partition() {
    for cp in [4, 8] {
        for partition in [Partition::Zigzag, Partition::Contiguous, Partition::Striped] {
            for schedule in [
                Schedule::Ring,
                Schedule::AllGather { kv_heads_per_step: 1 },
                Schedule::Ulysses,
                Schedule::Hybrid { group: 2 },
            ] {
                for dtype in [DType::F32, DType::Bf16] {
                    let c = Case {
                        cp,
                        shape: CpShape { batch: 1, q_heads: 16, kv_heads: 8, seq_len: 32 * cp, head_dim: 32, dtype },
                        partition,
                        schedule,
                        causal: true,
                        window: None,
                        doc_len: Some(45),
                        seed: 7,
                    };
                    check(&c).unwrap_or_else(|e| panic!("{e}"));
                }
            }
        }
    }
}

/// The same exchange on device memory: every schedule, on the CUDA backend's host emulator (its buffers are
/// device allocations, so every transfer goes through `BackendCopy` and every fill, sum and re-shard runs as a
/// CUDA kernel), and on a GPU. Each skips, saying so, where its backend cannot open (a build without the `cuda`
/// feature, no GPU), except that `cuda` fails under `LONGCTX_REQUIRE_GPU=1`, as the GPU check runs it.
mod device_memory_matches_full_attention {
    use super::*;

    #[test]
    fn cuda_emulated() {
        fn make() -> Arc<dyn Backend> {
            CudaBackend::emulated().expect("the emulator opened once already").into_shared()
        }
        match CudaBackend::emulated() {
            Ok(_) => every_schedule("cuda_emulated", make),
            Err(e) => eprintln!("device_memory_matches_full_attention::cuda_emulated: skipped: {e}"),
        }
    }

    #[test]
    fn cuda() {
        fn make() -> Arc<dyn Backend> {
            CudaBackend::new(0).expect("the GPU opened once already").into_shared()
        }
        match CudaBackend::new(0) {
            Ok(_) => every_schedule("cuda", make),
            Err(e) if std::env::var("LONGCTX_REQUIRE_GPU").as_deref() == Ok("1") => {
                panic!("device_memory_matches_full_attention::cuda: LONGCTX_REQUIRE_GPU=1 but: {e}")
            }
            Err(e) => eprintln!("device_memory_matches_full_attention::cuda: skipped, no GPU: {e}"),
        }
    }

    fn every_schedule(name: &str, make: MakeBackend) {
        for (schedule, dtype, head_dim) in [
            (Schedule::Ring, DType::Bf16, 64),
            (Schedule::Ring, DType::F32, 32),
            (Schedule::AllGather { kv_heads_per_step: 1 }, DType::Bf16, 64),
            (Schedule::Ulysses, DType::Bf16, 64),
            (Schedule::Hybrid { group: 2 }, DType::F32, 32),
        ] {
            let c = Case {
                cp: 4,
                shape: CpShape { batch: 1, q_heads: 8, kv_heads: 4, seq_len: 64, head_dim, dtype },
                partition: Partition::Zigzag,
                schedule,
                causal: true,
                window: None,
                doc_len: Some(21),
                seed: 11,
            };
            check_on(&c, make).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
}

/// A window of 1: every row sees only its own key, so the exact dQ and dK are zero (CI once drew this case with
/// zigzag, CP = 3 and bf16; it is pinned here for every schedule, both mask kinds and both dtypes).
#[test]
fn single_key_window() {
    for schedule in [Schedule::Ring, Schedule::AllGather { kv_heads_per_step: 1 }, Schedule::Ulysses] {
        for causal in [false, true] {
            for dtype in [DType::F32, DType::Bf16] {
                let c = Case {
                    cp: 3,
                    shape: CpShape { batch: 1, q_heads: 3, kv_heads: 3, seq_len: 18, head_dim: 40, dtype },
                    partition: Partition::Zigzag,
                    schedule,
                    causal,
                    window: Some(1),
                    doc_len: None,
                    seed: 283798062639290881,
                };
                check(&c).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}

/// The f32 error against the f64 reference does not grow with CP: CP = 8 stays within 2× of CP = 1.
#[test]
fn error_does_not_grow_with_cp() {
    let case = |cp| Case {
        cp,
        shape: CpShape { batch: 1, q_heads: 2, kv_heads: 1, seq_len: 1024, head_dim: 64, dtype: DType::F32 },
        partition: Partition::Zigzag,
        schedule: Schedule::Ring,
        causal: true,
        window: None,
        doc_len: None,
        seed: 3,
    };
    // The same data for every CP, so one reference serves them all (forward only: the f64 backward at this
    // length would cost more than the rest of the test).
    let x = inputs(&case(1));
    let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: 1024, kv_len: 1024, head_dim: 64 };
    let p = AttnParams::new(shape).with_mask(AttnMask::causal());
    let wide = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    let (o, _) = reference::forward(&p, &wide(&x.q), &wide(&x.k), &wide(&x.v));
    let errs: Vec<f64> = [1, 2, 4, 8].map(|cp| rel_err(&run_cp(&case(cp), &x).0[0], &o)).to_vec();
    assert!(errs[3] <= 2.0 * errs[0], "f32 error by CP (1, 2, 4, 8): {errs:?}");
}

/// Misconfigurations are typed errors, never a silent fallback to local attention.
#[test]
fn misconfiguration_is_a_typed_error() {
    let res = ThreadWorld::run(4, |comm| {
        let comm = Arc::new(comm);
        let cpu: Arc<dyn longctx_ring_attn::Backend> = Arc::new(CpuBackend::new());
        let hybrid = CpConfig { schedule: Schedule::Hybrid { group: 3 }, ..CpConfig::default() };
        let e1 = ContextParallel::new(comm.clone(), cpu.clone(), hybrid).err();
        let e1 = matches!(e1, Some(RingError::GroupSize { group: 3, world: 4 }));
        let uly = CpConfig { schedule: Schedule::Ulysses, ..CpConfig::default() };
        let cpa = ContextParallel::new(comm.clone(), cpu.clone(), uly).unwrap();
        let shape = CpShape { batch: 1, q_heads: 6, kv_heads: 2, seq_len: 64, head_dim: 32, dtype: DType::F32 };
        let e2 = cpa.plan(&shape, &CpMask::causal()).err();
        let e2 = matches!(e2, Some(RingError::HeadsNotDivisibleByGroup { what: "query", heads: 6, group: 4 }));
        let ring = ContextParallel::new(comm.clone(), cpu.clone(), CpConfig::default()).unwrap();
        let e3 = ring.plan(&CpShape { seq_len: 60, ..shape }, &CpMask::causal()).err();
        let e3 = matches!(e3, Some(RingError::SeqNotDivisible { seq_len: 60, divisor: 8, .. }));
        let e4 =
            matches!(ring.plan(&CpShape { seq_len: 0, ..shape }, &CpMask::causal()), Err(RingError::EmptySequence));
        let e5 = matches!(ring.plan(&shape, &CpMask::causal().with_window(0)), Err(RingError::ZeroWindow));
        let bad_scale = CpConfig { scale: Some(-1.0), ..CpConfig::default() };
        let e6 = matches!(ContextParallel::new(comm.clone(), cpu.clone(), bad_scale), Err(RingError::Scale(_)));
        let zero = CpConfig { schedule: Schedule::AllGather { kv_heads_per_step: 0 }, ..CpConfig::default() };
        let e7 = matches!(ContextParallel::new(comm.clone(), cpu.clone(), zero), Err(RingError::ZeroKvHeadsPerStep));
        // A plan made for documents refuses a call without them, and one made without refuses ids.
        let mut docs_plan = ring.plan(&shape, &CpMask::causal().with_documents()).unwrap();
        let mut plain = ring.plan(&shape, &CpMask::causal()).unwrap();
        let e8 = matches!(plain.set_documents(&[0; 16]), Err(RingError::Documents(_)));
        let e9 = matches!(docs_plan.set_documents(&[0; 15]), Err(RingError::BufferLength { name: "documents", .. }));
        let (qd, kd, ld) = (plain.q_dims(), plain.kv_dims(), plain.lse_dims());
        let (q, kv) = (vec![0.5f32; 6 * 16 * 32], vec![0.5f32; 2 * 16 * 32]);
        let (mut o, mut lse) = (vec![0f32; q.len()], vec![0f32; 6 * 16]);
        let qkv = Qkv::new(View::new(&q, qd).unwrap(), View::new(&kv, kd).unwrap(), View::new(&kv, kd).unwrap());
        let out = AttnOut { o: ViewMut::new(&mut o, qd).unwrap(), lse: ViewMut::new(&mut lse, ld).unwrap() };
        let e10 = matches!(docs_plan.forward(out, qkv), Err(RingError::Documents(_)));
        [e1, e2, e3, e4, e5, e6, e7, e8, e9, e10]
    })
    .unwrap();
    for r in res {
        assert_eq!(r, [true; 10]);
    }
}

/// Ranks that plan different problems all fail at planning, with the field and who holds which value.
#[test]
fn ranks_that_disagree_fail_together_naming_the_field() {
    let shape = CpShape { batch: 1, q_heads: 4, kv_heads: 2, seq_len: 64, head_dim: 32, dtype: DType::F32 };
    let started = std::time::Instant::now();
    let res = ThreadWorld::run(4, |comm| {
        let r = comm.rank();
        let cp = ContextParallel::new(comm, Arc::new(CpuBackend::new()), CpConfig::default()).unwrap();
        let mask = CpMask { causal: r != 2, ..CpMask::default() };
        let e1 = cp.plan(&shape, &mask).unwrap_err().to_string();
        let heads = CpShape { q_heads: if r == 0 { 2 } else { 4 }, ..shape };
        let e2 = cp.plan(&heads, &CpMask::causal()).unwrap_err().to_string();
        let dtype = CpShape { dtype: if r >= 2 { DType::Bf16 } else { DType::F32 }, ..shape };
        let e3 = cp.plan(&dtype, &CpMask::causal()).unwrap_err().to_string();
        (e1, e2, e3)
    })
    .unwrap();
    for (e1, e2, e3) in res {
        assert_eq!(e1, "the ranks disagree on causal: ranks 0, 1, 3: true; rank 2: false");
        assert_eq!(e2, "the ranks disagree on q_heads: rank 0: 2; ranks 1, 2, 3: 4");
        assert_eq!(e3, "the ranks disagree on dtype: ranks 0, 1: f32; ranks 2, 3: bf16");
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}

/// A model can own its `ContextParallel` and its plan side by side; the plan reused for a second step gives the
/// same bits, and it states its workspace and what the forward saves.
#[test]
fn a_model_owns_its_plan_and_reuses_it() {
    struct Layer {
        _cp: ContextParallel,
        plan: CpPlan,
    }
    let shape = CpShape { batch: 1, q_heads: 4, kv_heads: 2, seq_len: 128, head_dim: 32, dtype: DType::F32 };
    let res = ThreadWorld::run(2, |comm| {
        let cp = ContextParallel::new(comm, Arc::new(CpuBackend::new()), CpConfig::default()).unwrap();
        let mut layer = Layer { plan: cp.plan(&shape, &CpMask::causal()).unwrap(), _cp: cp };
        let n: usize = layer.plan.q_dims().iter().product();
        let nk: usize = layer.plan.kv_dims().iter().product();
        let x = [uniform_nonzero(n, 1), uniform_nonzero(nk, 2), uniform_nonzero(nk, 3), uniform_nonzero(n, 4)];
        let a = fwd_bwd::<f32>(&CpuBackend::new(), &mut layer.plan, [&x[0], &x[1], &x[2], &x[3]]).0;
        let b = fwd_bwd::<f32>(&CpuBackend::new(), &mut layer.plan, [&x[0], &x[1], &x[2], &x[3]]).0;
        let ws = layer.plan.workspace_bytes();
        (a == b, ws, layer.plan.saved_bytes(), layer.plan.positions().to_vec())
    })
    .unwrap();
    let l = 64;
    for (r, (same, ws, saved, pos)) in res.into_iter().enumerate() {
        assert!(same, "rank {r}: a reused plan gives other bits");
        // Q, K, V, O (f32) and the LSE of the local block.
        assert_eq!(saved, (2 * 4 * l * 32 + 2 * 2 * l * 32) * 4 + 4 * l * 4);
        // At least the two travelling KV blocks and the f32 output accumulator.
        assert!(ws.forward >= 2 * 2 * 2 * l * 32 * 4 + 4 * l * 32 * 4, "{ws:?}");
        assert!(ws.backward > ws.forward, "{ws:?}");
        // Kept between calls: the f32 accumulators (Q, dK, dV), two f32 KV blocks, the shared partial
        // (the larger of O and dK|dV), the LSE partial and the two travelling dK/dV accumulators.
        let (q, kv) = (4 * l * 32, 2 * l * 32);
        assert_eq!(ws.held, (q + 2 * kv) * 4 + 2 * 2 * kv * 4 + (q.max(2 * kv) + 4 * l + 4 * kv) * 4, "{ws:?}");
        assert_eq!(pos, SeqLayout::new(Partition::Zigzag, 2, 128).unwrap().positions(r).unwrap());
    }
}

#[test]
fn layout_helpers_round_trip() {
    let l = SeqLayout::new(Partition::Zigzag, 4, 16).unwrap();
    assert_eq!(l.positions(0).unwrap(), vec![0, 1, 14, 15]);
    assert_eq!(l.positions(3).unwrap(), vec![6, 7, 8, 9]);
    let s = SeqLayout::new(Partition::Striped, 4, 8).unwrap();
    assert_eq!(s.positions(1).unwrap(), vec![1, 5]);
    // A rank past the world is a typed error, from every function that takes one.
    assert!(matches!(l.positions(4), Err(RingError::RankOutOfRange { rank: 4, world: 4 })));
    assert!(matches!(l.shard(&[0u32; 16], 1, 1, 7), Err(RingError::RankOutOfRange { rank: 7, world: 4 })));
    assert!(matches!(l.unshard(&[vec![0u32; 4]], 1, 1), Err(RingError::ShardCount { got: 1, world: 4 })));
    assert!(matches!(SeqLayout::new(Partition::Zigzag, 4, 0), Err(RingError::EmptySequence)));
    let full: Vec<u32> = (0..2 * 16 * 3).collect();
    for layout in
        [l, SeqLayout::new(Partition::Contiguous, 4, 16).unwrap(), SeqLayout::new(Partition::Striped, 4, 16).unwrap()]
    {
        let shards: Vec<Vec<u32>> = (0..4).map(|r| layout.shard(&full, 2, 3, r).unwrap()).collect();
        assert_eq!(layout.unshard(&shards, 2, 3).unwrap(), full);
    }
    assert!(matches!(SeqLayout::new(Partition::Zigzag, 3, 9), Err(RingError::SeqNotDivisible { divisor: 6, .. })));
}

/// A rank that dies mid-job makes the others fail with a communication error naming it, not hang.
#[test]
fn dead_rank_is_an_error_on_the_others() {
    let shape = CpShape { batch: 1, q_heads: 2, kv_heads: 1, seq_len: 256, head_dim: 32, dtype: DType::F32 };
    let started = std::time::Instant::now();
    let res = ThreadWorld::builder()
        .timeout(std::time::Duration::from_secs(5))
        .run(4, |comm| {
            let r = comm.rank();
            let cp = ContextParallel::new(comm, Arc::new(CpuBackend::new()), CpConfig::default()).unwrap();
            let mut plan = cp.plan(&shape, &CpMask::causal()).unwrap();
            if r == 2 {
                return None; // rank 2 leaves after planning: its communicator is dropped
            }
            drop(cp);
            let (qd, kd, ld) = (plan.q_dims(), plan.kv_dims(), plan.lse_dims());
            let q = vec![0.5f32; 2 * 64 * 32];
            let kv = vec![0.5f32; 64 * 32];
            let (mut o, mut lse) = (vec![0f32; q.len()], vec![0f32; 2 * 64]);
            let qkv = Qkv::new(View::new(&q, qd).unwrap(), View::new(&kv, kd).unwrap(), View::new(&kv, kd).unwrap());
            Some(plan.forward(
                AttnOut { o: ViewMut::new(&mut o, qd).unwrap(), lse: ViewMut::new(&mut lse, ld).unwrap() },
                qkv,
            ))
        })
        .unwrap();
    for (r, out) in res.into_iter().enumerate() {
        if r == 2 {
            continue;
        }
        let e = out.expect("ran").expect_err("a ring with a dead rank cannot complete");
        assert!(matches!(e, RingError::Comm(_)), "rank {r}: {e}");
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
}
