//! A tour of the transformer ops: embedding → linear → RMSNorm → SwiGLU MLP → fused chunked cross-entropy,
//! forward and backward (the backward is the forward read in reverse, one call per line), then gradient
//! clipping and one AdamW step. Run with `cargo run -p longctx-kernels --example ops_tour --release`.

use longctx_kernels::*;

fn main() -> Result<()> {
    // Legend: T tokens, C model dim, F hidden dim, V vocabulary.
    let (t, c, f, v) = (64usize, 32usize, 88usize, 100usize);
    let mut seed = 1u64;
    let mut rnd = |n: usize, s: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * s
            })
            .collect()
    };
    // Parameters.
    let wte = rnd(v * c, 0.5); // [V, C] token embedding
    let w_in = rnd(c * c, 0.2); // [C, C]
    let norm_w = vec![1.0f32; c]; // [C]
    let w_gate = rnd(f * c, 0.2); // [F, C]
    let w_up = rnd(f * c, 0.2); // [F, C]
    let w_down = rnd(c * f, 0.1); // [C, F]
    let w_out = rnd(v * c, 0.2); // [V, C]
    let ids: Vec<u32> = (0..t as u32).map(|i| (i * 7 + 3) % v as u32).collect();
    let targets: Vec<i64> = (0..t).map(|i| if i % 9 == 8 { -100 } else { ((i * 7 + 10) % v) as i64 }).collect();

    // ---- forward ----
    let mut x0 = vec![0.0f32; t * c];
    embedding_forward(&mut x0, &ids, &wte, v, c)?; // x0[T,C]
    let mut x1 = vec![0.0f32; t * c];
    linear_forward(&mut x1, &x0, &w_in, None, t, c, c)?; // x1[T,C]
    let (mut x2, mut rstd) = (vec![0.0f32; t * c], vec![0.0f32; t]);
    rmsnorm_forward(&mut x2, &mut rstd, &x1, &norm_w, t, c, 1e-5)?; // x2[T,C]
    let (mut gate, mut up, mut act) = (vec![0.0f32; t * f], vec![0.0f32; t * f], vec![0.0f32; t * f]);
    linear_forward(&mut gate, &x2, &w_gate, None, t, c, f)?; // gate[T,F]
    linear_forward(&mut up, &x2, &w_up, None, t, c, f)?; // up[T,F]
    swiglu_forward(&mut act, &gate, &up)?; // act[T,F]
    let mut x3 = vec![0.0f32; t * c];
    linear_forward(&mut x3, &act, &w_down, None, t, f, c)?; // x3[T,C]
    let h: Vec<f32> = x1.iter().zip(&x3).map(|(a, b)| a + b).collect(); // residual

    // ---- loss and backward (forward in reverse) ----
    let opts = CrossEntropyOptions { chunk_tokens: 16, ..Default::default() };
    let (mut dh, mut dw_out) = (vec![0.0f32; t * c], vec![0.0f32; v * c]);
    let ce = cross_entropy_fused(&mut dh, &mut dw_out, &h, &w_out, &targets, t, c, v, &opts, false)?;
    let (mut dact, mut dw_down) = (vec![0.0f32; t * f], vec![0.0f32; c * f]);
    linear_backward(Some(&mut dact), &mut dw_down, None, &dh, &act, &w_down, t, f, c, false)?;
    let (mut dgate, mut dup) = (vec![0.0f32; t * f], vec![0.0f32; t * f]);
    swiglu_backward(&mut dgate, &mut dup, &dact, &gate, &up)?;
    let (mut dx2, mut dx2b) = (vec![0.0f32; t * c], vec![0.0f32; t * c]);
    let (mut dw_gate, mut dw_up) = (vec![0.0f32; f * c], vec![0.0f32; f * c]);
    linear_backward(Some(&mut dx2), &mut dw_gate, None, &dgate, &x2, &w_gate, t, c, f, false)?;
    linear_backward(Some(&mut dx2b), &mut dw_up, None, &dup, &x2, &w_up, t, c, f, false)?;
    dx2.iter_mut().zip(&dx2b).for_each(|(a, b)| *a += b);
    let (mut dx1, mut dnorm_w) = (vec![0.0f32; t * c], vec![0.0f32; c]);
    rmsnorm_backward(&mut dx1, &mut dnorm_w, &dx2, &x1, &norm_w, &rstd, t, c, false)?;
    dx1.iter_mut().zip(&dh).for_each(|(a, b)| *a += b); // residual
    let (mut dx0, mut dw_in) = (vec![0.0f32; t * c], vec![0.0f32; c * c]);
    linear_backward(Some(&mut dx0), &mut dw_in, None, &dx1, &x0, &w_in, t, c, c, false)?;
    let mut dwte = vec![0.0f32; v * c];
    embedding_backward(&mut dwte, &dx0, &ids, v, c, true)?;

    // ---- optimizer ----
    let norm = clip_grad_norm(
        &mut [
            &mut dwte[..],
            &mut dw_in[..],
            &mut dnorm_w[..],
            &mut dw_gate[..],
            &mut dw_up[..],
            &mut dw_down[..],
            &mut dw_out[..],
        ],
        1.0,
    )?;
    let mut w_out_master = w_out.clone();
    let (mut m, mut vv) = (vec![0.0f32; v * c], vec![0.0f32; v * c]);
    let mut w_out_bf16 = vec![half::bf16::ZERO; v * c];
    adamw_step_with_copy(&mut w_out_bf16, &mut w_out_master, &dw_out, &mut m, &mut vv, &AdamW::default(), 1)?;

    // The updated output weights lower the loss on the same batch.
    let (mut dh2, mut dw2) = (vec![0.0f32; t * c], vec![0.0f32; v * c]);
    let ce2 = cross_entropy_fused(&mut dh2, &mut dw2, &h, &w_out_master, &targets, t, c, v, &opts, false)?;
    println!(
        "tokens {t} (valid {}), loss {:.5} (ln V = {:.5}), grad norm {norm:.5}",
        ce.n_valid,
        ce.loss,
        (v as f32).ln()
    );
    println!("after one AdamW step on the output weights: loss {:.5}", ce2.loss);
    println!("|dwte| {:.4e}  |dw_in| {:.4e}  |dnorm_w| {:.4e}", l2(&dwte), l2(&dw_in), l2(&dnorm_w));

    // RoPE on [B,H,S,D] with context-parallel style, non-contiguous positions.
    let rope = RopeTable::new(&RopeConfig {
        head_dim: 16,
        base: 500_000.0,
        scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        },
    })?;
    let q = rnd(2 * 4 * 16, 1.0);
    let mut q_rot = vec![0.0f32; q.len()];
    rope.forward(&mut q_rot, &q, &[0, 1, 70_000, 70_001], 1, 2)?;
    println!("rope: |q| {:.5} = |rot q| {:.5}", l2(&q), l2(&q_rot));
    Ok(())
}

fn l2(x: &[f32]) -> f32 {
    x.iter().map(|v| v * v).sum::<f32>().sqrt()
}
