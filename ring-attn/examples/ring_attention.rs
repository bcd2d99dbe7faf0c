//! Ring attention on four thread ranks: shard a causal sequence with the zigzag partition, run the forward
//! and backward through a plan, and check each rank's rows against single-rank attention on the whole sequence.
//!
//! ```text
//! cargo run --release -p longctx-ring-attn --example ring_attention
//! ```

use std::sync::Arc;

use longctx_kernels::{AttnMask, AttnOptions, AttnShape};
use longctx_ring_attn::{
    AttnGrads, AttnOut, AttnSaved, Backend, ContextParallel, CpConfig, CpMask, CpShape, CpuBackend, DType, Partition,
    Qkv, Schedule, SeqLayout, ThreadWorld, View, ViewMut,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cp = 4;
    let shape = CpShape { batch: 1, q_heads: 8, kv_heads: 2, seq_len: 2048, head_dim: 64, dtype: DType::F32 };
    let d = shape.head_dim;
    let gen = |n: usize, f: f32| (0..n).map(|i| ((i as f32) * f).sin()).collect::<Vec<f32>>();
    let q = gen(shape.q_heads * shape.seq_len * d, 0.013);
    let k = gen(shape.kv_heads * shape.seq_len * d, 0.029);
    let v = gen(shape.kv_heads * shape.seq_len * d, 0.041);

    // Single-rank reference.
    let full = AttnShape { batch: 1, q_heads: 8, kv_heads: 2, q_len: 2048, kv_len: 2048, head_dim: d };
    let mut o_full = vec![0f32; q.len()];
    let mut lse_full = vec![0f32; full.lse_elems()];
    let (qd, kd) = (full.q_dims(), full.kv_dims());
    let qkv = Qkv::new(View::new(&q, qd)?, View::new(&k, kd)?, View::new(&v, kd)?);
    let out = AttnOut { o: ViewMut::new(&mut o_full, qd)?, lse: ViewMut::new(&mut lse_full, full.lse_dims())? };
    CpuBackend::new().attention_forward(&AttnOptions::new(AttnMask::causal()), out, qkv)?;

    let layout = SeqLayout::new(Partition::Zigzag, cp, shape.seq_len)?;
    let shards = ThreadWorld::run(cp, |comm| -> Result<_, longctx_ring_attn::RingError> {
        let r = comm.rank();
        let cfg = CpConfig { partition: Partition::Zigzag, schedule: Schedule::Ring, scale: None };
        let ring = ContextParallel::new(comm, Arc::new(CpuBackend::new()), cfg)?;
        let mut plan = ring.plan(&shape, &CpMask::causal())?;
        let (qd, kd, ld) = (plan.q_dims(), plan.kv_dims(), plan.lse_dims());
        let (ql, kl, vl) = (
            layout.shard(&q, shape.q_heads, d, r)?,
            layout.shard(&k, shape.kv_heads, d, r)?,
            layout.shard(&v, shape.kv_heads, d, r)?,
        );
        let qkv = Qkv::new(View::new(&ql, qd)?, View::new(&kl, kd)?, View::new(&vl, kd)?);
        let (mut o, mut lse) = (vec![0f32; ql.len()], vec![0f32; ql.len() / d]);
        let rep = plan.forward(AttnOut { o: ViewMut::new(&mut o, qd)?, lse: ViewMut::new(&mut lse, ld)? }, qkv)?;

        let d_o = vec![1.0f32; o.len()];
        let (mut dq, mut dk, mut dv) = (vec![0f32; ql.len()], vec![0f32; kl.len()], vec![0f32; vl.len()]);
        let grads = AttnGrads {
            dq: ViewMut::new(&mut dq, qd)?,
            dk: ViewMut::new(&mut dk, kd)?,
            dv: ViewMut::new(&mut dv, kd)?,
        };
        let saved = AttnSaved { qkv, o: View::new(&o, qd)?, lse: View::new(&lse, ld)? };
        let rb = plan.backward(grads, View::new(&d_o, qd)?, saved)?;
        let ws = plan.workspace_bytes();
        println!(
            "rank {r}: positions {:?}…, forward sent {} KiB in {} blocks ({} skipped), backward sent {} KiB; \
             workspace {} KiB forward, {} KiB backward; the forward saves {} KiB",
            &plan.positions()[..3],
            rep.bytes_sent / 1024,
            rep.blocks_computed,
            rep.blocks_skipped,
            rb.bytes_sent / 1024,
            ws.forward / 1024,
            ws.backward / 1024,
            plan.saved_bytes() / 1024,
        );
        Ok(o)
    })?;
    let shards = shards.into_iter().collect::<Result<Vec<_>, _>>()?;
    let o = layout.unshard(&shards, shape.q_heads, d)?;
    let err = o.iter().zip(&o_full).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    println!("max |O_ring - O_full| = {err:e}");
    assert!(err < 1e-5);
    Ok(())
}
