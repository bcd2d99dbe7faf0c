//! A tour of the transformer ops through the CPU backend: embedding → linear → RMSNorm → SwiGLU MLP → fused
//! chunked cross-entropy, forward and backward (the backward is the forward read in reverse, one call per line),
//! then gradient clipping and one AdamW step. Run with `cargo run -p longctx-kernels --example ops_tour --release`.

use longctx_kernels::{
    AdamW, AdamwState, Backend, CpuBackend, CrossEntropyOptions, GradMode, LinearGrads, LinearSaved, NormGrads,
    NormParams, ProjectionGrads, Result, RmsNormSaved, RopeConfig, RopeScaling, RopeTable, SwigluSaved, View, ViewMut,
};

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

    let cpu = CpuBackend::new();
    // A vector and an [R, C] matrix view of an f32 buffer.
    fn v1(x: &[f32]) -> View<'_> {
        View::flat(x)
    }
    fn v2(x: &[f32], r: usize, c: usize) -> Result<View<'_>> {
        View::new(x, [r, c])
    }

    // ---- forward ----
    let mut x0 = vec![0.0f32; t * c];
    cpu.embedding_forward(ViewMut::new(&mut x0, [t, c])?, &ids, v2(&wte, v, c)?)?; // x0[T,C]
    let mut x1 = vec![0.0f32; t * c];
    cpu.linear_forward(ViewMut::new(&mut x1, [t, c])?, v2(&x0, t, c)?, v2(&w_in, c, c)?, None)?; // x1[T,C]
    let (mut x2, mut rstd) = (vec![0.0f32; t * c], vec![0.0f32; t]);
    let norm = NormParams { weight: v1(&norm_w), bias: None, eps: 1e-5 };
    cpu.rmsnorm_forward(ViewMut::new(&mut x2, [t, c])?, ViewMut::flat(&mut rstd), v2(&x1, t, c)?, &norm)?; // x2[T,C]
    let (mut gate, mut up, mut act) = (vec![0.0f32; t * f], vec![0.0f32; t * f], vec![0.0f32; t * f]);
    cpu.linear_forward(ViewMut::new(&mut gate, [t, f])?, v2(&x2, t, c)?, v2(&w_gate, f, c)?, None)?; // gate[T,F]
    cpu.linear_forward(ViewMut::new(&mut up, [t, f])?, v2(&x2, t, c)?, v2(&w_up, f, c)?, None)?; // up[T,F]
    cpu.swiglu_forward(ViewMut::new(&mut act, [t, f])?, v2(&gate, t, f)?, v2(&up, t, f)?)?; // act[T,F]
    let mut x3 = vec![0.0f32; t * c];
    cpu.linear_forward(ViewMut::new(&mut x3, [t, c])?, v2(&act, t, f)?, v2(&w_down, c, f)?, None)?; // x3[T,C]
    let h: Vec<f32> = x1.iter().zip(&x3).map(|(a, b)| a + b).collect(); // residual

    // ---- loss and backward (forward in reverse) ----
    let opts = CrossEntropyOptions { chunk_tokens: 16, ..Default::default() };
    let ow = GradMode::Overwrite;
    let (mut dh, mut dw_out) = (vec![0.0f32; t * c], vec![0.0f32; v * c]);
    let grads =
        ProjectionGrads { dhidden: ViewMut::new(&mut dh, [t, c])?, dweight: ViewMut::new(&mut dw_out, [v, c])? };
    let ce = cpu.cross_entropy_fused(grads, v2(&h, t, c)?, v2(&w_out, v, c)?, &targets, &opts, ow)?;
    let (mut dact, mut dw_down) = (vec![0.0f32; t * f], vec![0.0f32; c * f]);
    let grads = LinearGrads {
        dx: Some(ViewMut::new(&mut dact, [t, f])?),
        dw: ViewMut::new(&mut dw_down, [c, f])?,
        dbias: None,
    };
    cpu.linear_backward(grads, v2(&dh, t, c)?, LinearSaved { x: v2(&act, t, f)? }, v2(&w_down, c, f)?, ow)?;
    let (mut dgate, mut dup) = (vec![0.0f32; t * f], vec![0.0f32; t * f]);
    let saved = SwigluSaved { gate: v2(&gate, t, f)?, up: v2(&up, t, f)? };
    cpu.swiglu_backward(ViewMut::new(&mut dgate, [t, f])?, ViewMut::new(&mut dup, [t, f])?, v2(&dact, t, f)?, saved)?;
    let (mut dx2, mut dx2b) = (vec![0.0f32; t * c], vec![0.0f32; t * c]);
    let (mut dw_gate, mut dw_up) = (vec![0.0f32; f * c], vec![0.0f32; f * c]);
    let grads =
        LinearGrads { dx: Some(ViewMut::new(&mut dx2, [t, c])?), dw: ViewMut::new(&mut dw_gate, [f, c])?, dbias: None };
    cpu.linear_backward(grads, v2(&dgate, t, f)?, LinearSaved { x: v2(&x2, t, c)? }, v2(&w_gate, f, c)?, ow)?;
    let grads =
        LinearGrads { dx: Some(ViewMut::new(&mut dx2b, [t, c])?), dw: ViewMut::new(&mut dw_up, [f, c])?, dbias: None };
    cpu.linear_backward(grads, v2(&dup, t, f)?, LinearSaved { x: v2(&x2, t, c)? }, v2(&w_up, f, c)?, ow)?;
    cpu.add(ViewMut::flat(&mut dx2), v1(&dx2b))?;
    let (mut dx1, mut dnorm_w) = (vec![0.0f32; t * c], vec![0.0f32; c]);
    let grads = NormGrads { dx: ViewMut::new(&mut dx1, [t, c])?, dweight: ViewMut::flat(&mut dnorm_w), dbias: None };
    let saved = RmsNormSaved { x: v2(&x1, t, c)?, rstd: v1(&rstd) };
    cpu.rmsnorm_backward(grads, v2(&dx2, t, c)?, saved, v1(&norm_w), ow)?;
    cpu.add(ViewMut::flat(&mut dx1), v1(&dh))?; // residual
    let (mut dx0, mut dw_in) = (vec![0.0f32; t * c], vec![0.0f32; c * c]);
    let grads =
        LinearGrads { dx: Some(ViewMut::new(&mut dx0, [t, c])?), dw: ViewMut::new(&mut dw_in, [c, c])?, dbias: None };
    cpu.linear_backward(grads, v2(&dx1, t, c)?, LinearSaved { x: v2(&x0, t, c)? }, v2(&w_in, c, c)?, ow)?;
    let mut dwte = vec![0.0f32; v * c];
    cpu.embedding_backward(ViewMut::new(&mut dwte, [v, c])?, v2(&dx0, t, c)?, &ids, GradMode::Accumulate)?;

    // ---- optimizer ----
    let norm = cpu.clip_grad_norm(
        &mut [
            ViewMut::flat(&mut dwte),
            ViewMut::flat(&mut dw_in),
            ViewMut::flat(&mut dnorm_w),
            ViewMut::flat(&mut dw_gate),
            ViewMut::flat(&mut dw_up),
            ViewMut::flat(&mut dw_down),
            ViewMut::flat(&mut dw_out),
        ],
        1.0,
    )?;
    let mut w_out_master = w_out.clone();
    let (mut m, mut vv) = (vec![0.0f32; v * c], vec![0.0f32; v * c]);
    let mut w_out_bf16 = vec![half::bf16::ZERO; v * c];
    let state = AdamwState { m: ViewMut::flat(&mut m), v: ViewMut::flat(&mut vv) };
    let copy_to = Some(ViewMut::flat(&mut w_out_bf16));
    cpu.adamw_step(ViewMut::flat(&mut w_out_master), copy_to, v1(&dw_out), state, &AdamW::default(), 1)?;

    // The updated output weights lower the loss on the same batch.
    let (mut dh2, mut dw2) = (vec![0.0f32; t * c], vec![0.0f32; v * c]);
    let grads = ProjectionGrads { dhidden: ViewMut::new(&mut dh2, [t, c])?, dweight: ViewMut::new(&mut dw2, [v, c])? };
    let ce2 = cpu.cross_entropy_fused(grads, v2(&h, t, c)?, v2(&w_out_master, v, c)?, &targets, &opts, ow)?;
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
    let mut q_rot = q.clone();
    cpu.rope_forward(&rope, ViewMut::new(&mut q_rot, [1, 2, 4, 16])?, &[0, 1, 70_000, 70_001])?;
    println!("rope: |q| {:.5} = |rot q| {:.5}", l2(&q), l2(&q_rot));
    Ok(())
}

fn l2(x: &[f32]) -> f32 {
    x.iter().map(|v| v * v).sum::<f32>().sqrt()
}
