//! Cross-crate: RoPE (kernels) at each rank's global positions (ring-attn layout), then context-parallel
//! attention over thread ranks (p2p), forward and backward, equals RoPE + attention on the whole sequence.

use longctx_kernels::testing::{attention_f32, max_rel_err as rel_err, uniform_nonzero};
use longctx_kernels::{AttnMask, AttnParams, AttnShape, RopeConfig, RopeScaling, RopeTable};
use std::sync::Arc;

use longctx_ring_attn::{
    AttnGrads, AttnOut, AttnSaved, Backend, ContextParallel, CpConfig, CpMask, CpShape, CpuBackend, DType, Partition,
    Qkv, Schedule, SeqLayout, ThreadWorld, View, ViewMut,
};
use proptest::prelude::*;

/// Raw (pre-RoPE) q, k, v and d_o over the whole sequence → (O, dQ_raw, dK_raw, dV) on one rank.
fn full_path(rope: &RopeTable, shape: CpShape, q: &[f32], k: &[f32], v: &[f32], d_o: &[f32]) -> [Vec<f32>; 4] {
    let s = shape.seq_len;
    let pos: Vec<i64> = (0..s as i64).collect();
    let cpu = CpuBackend::new();
    let qd = [shape.batch, shape.q_heads, s, shape.head_dim];
    let kd = [shape.batch, shape.kv_heads, s, shape.head_dim];
    let (mut qr, mut kr) = (q.to_vec(), k.to_vec());
    cpu.rope_forward(rope, ViewMut::new(&mut qr, qd).unwrap(), &pos).unwrap();
    cpu.rope_forward(rope, ViewMut::new(&mut kr, kd).unwrap(), &pos).unwrap();
    let a = AttnShape {
        batch: shape.batch,
        q_heads: shape.q_heads,
        kv_heads: shape.kv_heads,
        q_len: s,
        kv_len: s,
        head_dim: shape.head_dim,
    };
    let p = AttnParams::new(a).with_mask(AttnMask::causal());
    let [o, _, dqr, dkr, dv] = attention_f32(&p, &qr, &kr, v, d_o).unwrap();
    let (mut dq, mut dk) = (dqr, dkr);
    cpu.rope_backward(rope, ViewMut::new(&mut dq, qd).unwrap(), &pos).unwrap();
    cpu.rope_backward(rope, ViewMut::new(&mut dk, kd).unwrap(), &pos).unwrap();
    [o, dq, dk, dv]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn rope_then_context_parallel_attention_matches_full(
        cp in 1usize..=4,
        part in 0usize..3,
        hybrid in any::<bool>(),
        m in 1usize..=6,
        seed in any::<u64>(),
    ) {
        let partition = [Partition::Zigzag, Partition::Contiguous, Partition::Striped][part];
        let schedule = if hybrid && cp % 2 == 0 { Schedule::Hybrid { group: 2 } } else { Schedule::Ring };
        let shape = CpShape { batch: 1, q_heads: 4, kv_heads: 2, seq_len: 2 * cp * 8 * m, head_dim: 32, dtype: DType::F32 };
        let rope = RopeTable::new(&RopeConfig {
            head_dim: 32,
            base: 500_000.0,
            scaling: RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 64 },
        }).unwrap();
        let (d, s) = (shape.head_dim, shape.seq_len);
        let q = uniform_nonzero(shape.q_heads * s * d, seed);
        let k = uniform_nonzero(shape.kv_heads * s * d, seed ^ 1);
        let v = uniform_nonzero(shape.kv_heads * s * d, seed ^ 2);
        let d_o = uniform_nonzero(shape.q_heads * s * d, seed ^ 3);
        let want = full_path(&rope, shape, &q, &k, &v, &d_o);

        let layout = SeqLayout::new(partition, cp, s).unwrap();
        let per_rank = ThreadWorld::run(cp, |comm| {
            // The path a model takes: everything through the backend, attention through the plan.
            let r = comm.rank();
            let cpu = Arc::new(CpuBackend::new());
            let cpa = ContextParallel::new(comm, cpu.clone(), CpConfig { partition, schedule, scale: None }).unwrap();
            let mut plan = cpa.plan(&shape, &CpMask::causal()).unwrap();
            let (qd, kd, ld) = (plan.q_dims(), plan.kv_dims(), plan.lse_dims());
            let pos = plan.positions().to_vec();
            let sh = |x: &[f32], h: usize| layout.shard(x, h, d, r).unwrap();
            let (mut qr, mut kr, vl, dol) = (sh(&q, 4), sh(&k, 2), sh(&v, 2), sh(&d_o, 4));
            cpu.rope_forward(&rope, ViewMut::new(&mut qr, qd).unwrap(), &pos).unwrap();
            cpu.rope_forward(&rope, ViewMut::new(&mut kr, kd).unwrap(), &pos).unwrap();
            let qkv = Qkv::new(View::new(&qr, qd).unwrap(), View::new(&kr, kd).unwrap(), View::new(&vl, kd).unwrap());
            let (mut o, mut lse) = (vec![0f32; qr.len()], vec![0f32; qr.len() / d]);
            plan.forward(AttnOut { o: ViewMut::new(&mut o, qd).unwrap(), lse: ViewMut::new(&mut lse, ld).unwrap() }, qkv).unwrap();
            let (mut dq, mut dk, mut dv) = (vec![0f32; qr.len()], vec![0f32; kr.len()], vec![0f32; vl.len()]);
            let grads = AttnGrads {
                dq: ViewMut::new(&mut dq, qd).unwrap(),
                dk: ViewMut::new(&mut dk, kd).unwrap(),
                dv: ViewMut::new(&mut dv, kd).unwrap(),
            };
            let saved = AttnSaved { qkv, o: View::new(&o, qd).unwrap(), lse: View::new(&lse, ld).unwrap() };
            plan.backward(grads, View::new(&dol, qd).unwrap(), saved).unwrap();
            cpu.rope_backward(&rope, ViewMut::new(&mut dq, qd).unwrap(), &pos).unwrap();
            cpu.rope_backward(&rope, ViewMut::new(&mut dk, kd).unwrap(), &pos).unwrap();
            [o, dq, dk, dv]
        }).unwrap();
        let gather = |i: usize, h: usize| {
            let shards: Vec<Vec<f32>> = per_rank.iter().map(|x| x[i].clone()).collect();
            layout.unshard(&shards, h, d).unwrap()
        };
        for (i, (name, h)) in [("O", 4), ("dQ", 4), ("dK", 2), ("dV", 2)].iter().enumerate() {
            let e = rel_err(&gather(i, *h), &want[i]);
            prop_assert!(e < 1e-5, "{name}: relative error {e:e} (cp {cp}, {partition:?}, {schedule:?})");
        }
    }
}
