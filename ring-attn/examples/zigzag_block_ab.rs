//! The two kinds of off-diagonal zigzag block, timed alternately on one set of buffers.
//!
//! Under zigzag a rank's ring step off the diagonal computes either all of its queries against the first half
//! of the source's keys (the source holds earlier chunks: "A") or the second half of its queries against all of
//! the source's keys ("B"). Both compute the same number of scores, but their tiles stream through the cache
//! differently, so if one kind ran slower the last rank (all A) and rank 0 (all B) would differ: the schedule's
//! only possible source of imbalance. This times one block of each kind in the order A B B A A B B A ... (so a
//! slow phase of a shared machine falls on both alike) and prints the median and best of each.
//!
//! ```text
//! cargo run --release -p longctx-ring-attn --example zigzag_block_ab -- 65536 4 6 bwd   # S, CP, pairs, fwd|bwd
//! ```

use std::time::Instant;

use half::bf16;
use longctx_kernels::testing::uniform_nonzero;
use longctx_kernels::{
    AttnGrads, AttnMask, AttnOptions, AttnOut, AttnSaved, AttnShape, Backend, CpuBackend, GradMode, Positions, Qkv,
    View, ViewMut,
};
use longctx_ring_attn::SeqLayout;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, default: usize| args.get(i).and_then(|x| x.parse().ok()).unwrap_or(default);
    let (s, cp, pairs) = (num(0, 16384), num(1, 4), num(2, 6));
    let forward = args.get(3).is_some_and(|x| x == "fwd");
    if cp < 2 {
        return Err("CP must be at least 2 (CP 1 has no off-diagonal block)".into());
    }
    let (hq, hkv, d) = (8, 2, 128);
    let l = s / cp;
    let layout = SeqLayout::new(Default::default(), cp, s)?;
    let pos: Vec<Vec<i64>> = layout.all_positions();
    let rand =
        |n: usize, seed: u64| -> Vec<bf16> { uniform_nonzero(n, seed).into_iter().map(bf16::from_f32).collect() };
    let (q, k, v, d_o) = (rand(hq * l * d, 1), rand(hkv * l * d, 2), rand(hkv * l * d, 3), rand(hq * l * d, 4));
    let shape = AttnShape { batch: 1, q_heads: hq, kv_heads: hkv, q_len: l, kv_len: l, head_dim: d };
    let opts = |r: usize, src: usize| {
        AttnOptions::new(
            AttnMask::causal().with_positions(Positions::Explicit(&pos[r]), Positions::Explicit(&pos[src])),
        )
    };
    let cpu = CpuBackend::new();
    let (qd, kd, ld) = (shape.q_dims(), shape.kv_dims(), shape.lse_dims());
    let qkv = Qkv::new(View::new(&q, qd)?, View::new(&k, kd)?, View::new(&v, kd)?);
    // O and LSE of rank 0's diagonal block (finite LSE on every row, as the backward gets in the ring).
    let (mut o, mut lse) = (vec![bf16::ZERO; q.len()], vec![0f32; hq * l]);
    cpu.attention_forward(
        &opts(0, 0),
        AttnOut { o: ViewMut::new(&mut o, qd)?, lse: ViewMut::new(&mut lse, ld)? },
        qkv,
    )?;
    let saved = AttnSaved { qkv, o: View::new(&o, qd)?, lse: View::new(&lse, ld)? };
    let (mut o2, mut lse2) = (vec![0f32; q.len()], vec![0f32; hq * l]);
    let (mut dq, mut dk, mut dv) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; k.len()]);
    let blocks =
        [("A (last rank, source before it)", opts(cp - 1, cp - 2)), ("B (rank 0, last source)", opts(0, cp - 1))];
    let mut times = [Vec::new(), Vec::new()];
    for i in 0..2 * pairs {
        let which = (i + i / 2) % 2;
        let p = &blocks[which].1;
        let t = Instant::now();
        if forward {
            let out = AttnOut { o: ViewMut::new(&mut o2, qd)?, lse: ViewMut::new(&mut lse2, ld)? };
            cpu.attention_forward(p, out, qkv)?;
        } else {
            let grads = AttnGrads {
                dq: ViewMut::new(&mut dq, qd)?,
                dk: ViewMut::new(&mut dk, kd)?,
                dv: ViewMut::new(&mut dv, kd)?,
            };
            cpu.attention_backward(p, grads, View::new(&d_o, qd)?, saved, GradMode::Accumulate)?;
        }
        times[which].push(t.elapsed().as_secs_f64() * 1e3);
    }
    println!("S={s} CP={cp} {} block, {pairs} of each, ms:", if forward { "forward" } else { "backward" });
    let mut medians = [0.0; 2];
    for (w, t) in times.iter().enumerate() {
        let mut sorted = t.clone();
        sorted.sort_by(f64::total_cmp);
        medians[w] = sorted[sorted.len() / 2];
        let all: Vec<String> = t.iter().map(|x| format!("{x:.0}")).collect();
        println!("  {}: median {:.0}, best {:.0}; all {}", blocks[w].0, medians[w], sorted[0], all.join(" "));
    }
    println!("  A / B (medians): {:.3}", medians[0] / medians[1]);
    Ok(())
}
