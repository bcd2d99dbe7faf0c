//! Ring attention on four thread ranks: shard a causal sequence with the zigzag partition, run the forward
//! and backward, and check each rank's rows against single-rank attention on the whole sequence.
//!
//! ```text
//! cargo run --release -p longctx-ring-attn --example ring_attention
//! ```

use longctx_kernels::{attention_forward, AttnMask, AttnParams, AttnShape};
use longctx_p2p::ThreadWorld;
use longctx_ring_attn::{ContextParallel, CpConfig, CpMask, CpShape, Partition, Schedule, SeqLayout};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cp = 4;
    let shape = CpShape { batch: 1, q_heads: 8, kv_heads: 2, seq_len: 2048, head_dim: 64 };
    let d = shape.head_dim;
    let gen = |n: usize, f: f32| (0..n).map(|i| ((i as f32) * f).sin()).collect::<Vec<f32>>();
    let q = gen(shape.q_heads * shape.seq_len * d, 0.013);
    let k = gen(shape.kv_heads * shape.seq_len * d, 0.029);
    let v = gen(shape.kv_heads * shape.seq_len * d, 0.041);

    // Single-rank reference.
    let full = AttnShape { batch: 1, q_heads: 8, kv_heads: 2, q_len: 2048, kv_len: 2048, head_dim: d };
    let mut o_full = vec![0f32; q.len()];
    let mut lse_full = vec![0f32; full.lse_elems()];
    let p = AttnParams::new(full).with_mask(AttnMask::causal());
    attention_forward(&p, (&q).into(), (&k).into(), (&v).into(), (&mut o_full).into(), &mut lse_full)?;

    let layout = SeqLayout::new(Partition::Zigzag, cp, shape.seq_len)?;
    let shards = ThreadWorld::run(cp, |comm| -> Result<_, longctx_ring_attn::RingError> {
        let r = comm.rank();
        let cfg = CpConfig { partition: Partition::Zigzag, schedule: Schedule::Ring, scale: None };
        let ring = ContextParallel::new(&comm, cfg)?;
        let (ql, kl, vl) = (
            layout.shard(&q, shape.q_heads, d, r)?,
            layout.shard(&k, shape.kv_heads, d, r)?,
            layout.shard(&v, shape.kv_heads, d, r)?,
        );
        let mut o = vec![0f32; ql.len()];
        let mut lse = vec![0f32; ql.len() / d];
        let rep = ring.forward(
            &shape,
            &CpMask::causal(),
            (&ql).into(),
            (&kl).into(),
            (&vl).into(),
            (&mut o).into(),
            &mut lse,
        )?;
        let d_o = vec![1.0f32; o.len()];
        let (mut dq, mut dk, mut dv) = (vec![0f32; ql.len()], vec![0f32; kl.len()], vec![0f32; vl.len()]);
        let rb = ring.backward(
            &shape,
            &CpMask::causal(),
            (&ql).into(),
            (&kl).into(),
            (&vl).into(),
            (&o).into(),
            (&d_o).into(),
            &lse,
            (&mut dq).into(),
            (&mut dk).into(),
            (&mut dv).into(),
        )?;
        println!(
            "rank {r}: positions {:?}…, forward sent {} KiB in {} blocks ({} skipped), backward sent {} KiB",
            &layout.positions(r)[..3],
            rep.bytes_sent / 1024,
            rep.blocks_computed,
            rep.blocks_skipped,
            rb.bytes_sent / 1024
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
