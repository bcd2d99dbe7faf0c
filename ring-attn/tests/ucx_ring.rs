//! Ring attention across UCX processes started by `longctx-launch`: the test re-runs itself in each child
//! process (one rank each), where it joins the job from the environment and checks its rows of the ring
//! forward and backward against single-rank attention on the whole sequence.
#![cfg(feature = "ucx")]

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use longctx_kernels::testing::{attention_f32, max_rel_err as rel_err, uniform_nonzero};
use longctx_kernels::{AttnMask, AttnParams, AttnShape, Positions};
use longctx_p2p::Communicator;
use longctx_ring_attn::{
    AttnGrads, AttnOut, AttnSaved, ContextParallel, CpConfig, CpMask, CpPlan, CpShape, DType, Partition, Qkv, Schedule,
    SeqLayout, StepReport, View, ViewMut,
};

const CHILD: &str = "LONGCTX_RING_UCX_CHILD";
const RESULT: &str = "LONGCTX_RING_RESULT";

/// One rank's work: ring forward and backward with packed documents; errors above tolerance are returned.
fn child(schedule: Schedule) -> Result<(), String> {
    let mut comm = Communicator::from_env().map_err(|e| e.to_string())?;
    comm.set_timeout(Duration::from_secs(60));
    let (n, r) = (comm.world_size(), comm.rank());
    let shape = CpShape { batch: 1, q_heads: 4, kv_heads: 2, seq_len: 96 * n, head_dim: 64, dtype: DType::F32 };
    let (s, d) = (shape.seq_len, shape.head_dim);
    // Every rank builds the same full sequence, runs the single-rank reference, and keeps its own rows.
    let q = uniform_nonzero(4 * s * d, 1);
    let k = uniform_nonzero(2 * s * d, 2);
    let v = uniform_nonzero(2 * s * d, 3);
    let d_o = uniform_nonzero(4 * s * d, 4);
    let docs: Vec<u32> = (0..s).map(|i| (i / 70) as u32).collect();
    let full = AttnShape { batch: 1, q_heads: 4, kv_heads: 2, q_len: s, kv_len: s, head_dim: d };
    let p = AttnParams::new(full).with_mask(
        AttnMask::causal().with_positions(Positions::Offset(0), Positions::Offset(0)).with_docs(&docs, &docs),
    );
    let [o, lse, dq, dk, dv] = attention_f32(&p, &q, &k, &v, &d_o).map_err(|e| e.to_string())?;

    let layout = SeqLayout::new(Partition::Zigzag, n, s).map_err(|e| e.to_string())?;
    let sh = |x: &[f32], h: usize, inner: usize| layout.shard(x, h, inner, r).map_err(|e| e.to_string());
    let (ql, kl, vl, dol) = (sh(&q, 4, d)?, sh(&k, 2, d)?, sh(&v, 2, d)?, sh(&d_o, 4, d)?);
    let docs_l: Vec<u32> = layout.shard(&docs, 1, 1, r).map_err(|e| e.to_string())?;
    let backend = std::sync::Arc::new(longctx_ring_attn::CpuBackend::new());
    let cp = ContextParallel::new(comm, backend, CpConfig { partition: Partition::Zigzag, schedule, scale: None })
        .map_err(|e| e.to_string())?;
    let mut plan = cp.plan(&shape, &CpMask::causal().with_documents()).map_err(|e| e.to_string())?;
    plan.set_documents(&docs_l).map_err(|e| e.to_string())?;
    let (rf, rb, [o_l, lse_l, dq_l, dk_l, dv_l]) =
        run_plan(&mut plan, [&ql, &kl, &vl, &dol]).map_err(|e| e.to_string())?;
    for (name, got, want) in [
        ("O", &o_l, sh(&o, 4, d)?),
        ("LSE", &lse_l, sh(&lse, 4, 1)?),
        ("dQ", &dq_l, sh(&dq, 4, d)?),
        ("dK", &dk_l, sh(&dk, 2, d)?),
        ("dV", &dv_l, sh(&dv, 2, d)?),
    ] {
        let e = rel_err(got, &want);
        if e >= 1e-5 {
            return Err(format!("rank {r}: {name} relative error {e:e}"));
        }
    }
    if rf.bytes_sent != rf.expected_bytes || rb.bytes_sent != rb.expected_bytes {
        return Err(format!(
            "rank {r}: bytes sent {}/{} (forward), {}/{} (backward) against the schedule's formula",
            rf.bytes_sent, rf.expected_bytes, rb.bytes_sent, rb.expected_bytes
        ));
    }
    Ok(())
}

type PlanRun = (StepReport, StepReport, [Vec<f32>; 5]);

/// Forward and backward of one rank's f32 shards through its plan.
fn run_plan(plan: &mut CpPlan, [q, k, v, d_o]: [&[f32]; 4]) -> Result<PlanRun, longctx_ring_attn::RingError> {
    let (qd, kd, ld) = (plan.q_dims(), plan.kv_dims(), plan.lse_dims());
    let qkv = Qkv::new(View::new(q, qd)?, View::new(k, kd)?, View::new(v, kd)?);
    let (mut o, mut lse) = (vec![0f32; q.len()], vec![0f32; ld.iter().product()]);
    let rf = plan.forward(AttnOut { o: ViewMut::new(&mut o, qd)?, lse: ViewMut::new(&mut lse, ld)? }, qkv)?;
    let (mut dq, mut dk, mut dv) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()]);
    let grads =
        AttnGrads { dq: ViewMut::new(&mut dq, qd)?, dk: ViewMut::new(&mut dk, kd)?, dv: ViewMut::new(&mut dv, kd)? };
    let saved = AttnSaved { qkv, o: View::new(&o, qd)?, lse: View::new(&lse, ld)? };
    let rb = plan.backward(grads, View::new(d_o, qd)?, saved)?;
    Ok((rf, rb, [o, lse, dq, dk, dv]))
}

/// `longctx-launch` from the same build as this test binary (`target/<profile>/`).
fn launcher() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(|p| p.parent()).expect("target directory");
    let path = dir.join("longctx-launch");
    assert!(
        path.exists(),
        "{} not found: build it first (`cargo build -p longctx-p2p --bin longctx-launch`, or run the suite with \
         --all-targets as ./scripts/test does)",
        path.display()
    );
    path
}

fn launch(test: &str, nproc: usize) {
    let out = Command::new(launcher())
        .args(["--nproc", &nproc.to_string(), "--"])
        .arg(std::env::current_exe().expect("test binary path"))
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .expect("run longctx-launch");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for r in 0..nproc {
        let line = stdout
            .lines()
            .filter(|l| l.starts_with(&format!("[rank {r}] ")))
            .find_map(|l| l.split_once(&format!("{RESULT} ")).map(|(_, x)| x.to_string()));
        assert_eq!(line.as_deref(), Some("ok"), "rank {r}\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
    }
    assert!(out.status.success(), "launcher failed: {:?}\n{stderr}", out.status);
}

fn report(res: Result<(), String>) -> ! {
    match res {
        Ok(()) => println!("{RESULT} ok"),
        Err(e) => println!("{RESULT} err {e}"),
    }
    std::process::exit(0)
}

#[test]
fn ring_attention_across_ucx_processes() {
    if std::env::var(CHILD).is_ok() {
        report(child(Schedule::Ring));
    }
    launch("ring_attention_across_ucx_processes", 3);
}

#[test]
fn hybrid_attention_across_ucx_processes() {
    if std::env::var(CHILD).is_ok() {
        report(child(Schedule::Hybrid { group: 2 }));
    }
    launch("hybrid_attention_across_ucx_processes", 4);
}
