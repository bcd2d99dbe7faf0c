//! Every op gives the same bits on a 1-thread and on a 2-thread (and 3-thread) rayon pool.

mod ops_util;

use half::bf16;
use longctx_kernels::*;
use ops_util::*;

fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap()
}

fn bits<T: Element>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

/// Runs every op with multi-task shapes and returns all outputs as bit patterns.
fn run_all<T: Element>() -> Vec<Vec<u32>> {
    let mut r = DataRng::new(42);
    let mut out = vec![];
    let f = |r: &mut DataRng, n: usize| to_t::<T>(&r.vec(n, 1.0));
    // Linear: several 128×256 tiles, and a token reduction of 300 for dW.
    let (t, di, d_o) = (300, 96, 520);
    let (x, w, b, dy) = (f(&mut r, t * di), f(&mut r, d_o * di), f(&mut r, d_o), f(&mut r, t * d_o));
    let mut y = poisoned::<T>(t * d_o);
    linear_forward(&mut y, &x, &w, Some(&b), t, di, d_o).unwrap();
    let (mut dx, mut dw, mut db) = (poisoned::<T>(t * di), vec![0.5f32; d_o * di], vec![0.5f32; d_o]);
    linear_backward(Some(&mut dx), &mut dw, Some(&mut db), &dy, &x, &w, t, di, d_o, true).unwrap();
    out.extend([bits(&y), bits(&dx), bits(&dw), bits(&db)]);
    // Norms: 300 rows = 19 row blocks.
    let (n, c) = (300, 64);
    let (x, wt, bt, dy) = (f(&mut r, n * c), f(&mut r, c), f(&mut r, c), f(&mut r, n * c));
    let (mut y, mut rs, mut mu) = (poisoned::<T>(n * c), vec![0.0; n], vec![0.0; n]);
    rmsnorm_forward(&mut y, &mut rs, &x, &wt, n, c, 1e-5).unwrap();
    let (mut dx, mut dw) = (poisoned::<T>(n * c), vec![0.0f32; c]);
    rmsnorm_backward(&mut dx, &mut dw, &dy, &x, &wt, &rs, n, c, false).unwrap();
    out.extend([bits(&y), bits(&dx), bits(&dw)]);
    layernorm_forward(&mut y, &mut mu, &mut rs, &x, &wt, &bt, n, c, 1e-5).unwrap();
    let mut dbias = vec![0.0f32; c];
    layernorm_backward(&mut dx, &mut dw, &mut dbias, &dy, &x, &wt, &mu, &rs, n, c, false).unwrap();
    out.extend([bits(&y), bits(&dx), bits(&dw), bits(&dbias)]);
    // RoPE.
    let rope = RopeTable::new(&RopeConfig { head_dim: 64, base: 1e4, scaling: RopeScaling::None }).unwrap();
    let pos: Vec<i64> = (0..40).map(|i| 7 * i + 3).collect();
    let xr = f(&mut r, 2 * 4 * 40 * 64);
    let mut yr = poisoned::<T>(xr.len());
    rope.forward(&mut yr, &xr, &pos, 2, 4).unwrap();
    out.push(bits(&yr));
    // Activations.
    let (g, u, d) = (f(&mut r, 50_000), f(&mut r, 50_000), f(&mut r, 50_000));
    let (mut o, mut dg, mut du) = (poisoned::<T>(50_000), poisoned::<T>(50_000), poisoned::<T>(50_000));
    swiglu_forward(&mut o, &g, &u).unwrap();
    swiglu_backward(&mut dg, &mut du, &d, &g, &u).unwrap();
    out.extend([bits(&o), bits(&dg), bits(&du)]);
    // Embedding backward with many repeated ids.
    let (v, ce) = (100, 32);
    let ids: Vec<u32> = (0..400).map(|_| r.below(20) as u32).collect();
    let dout = f(&mut r, 400 * ce);
    let mut dtab = vec![0.25f32; v * ce];
    embedding_backward(&mut dtab, &dout, &ids, v, ce, true).unwrap();
    out.push(bits(&dtab));
    // Fused cross-entropy with several chunks.
    let (t, c, v) = (200, 48, 300);
    let (h, wv) = (f(&mut r, t * c), f(&mut r, v * c));
    let tg: Vec<i64> = (0..t).map(|i| if i % 7 == 0 { -100 } else { r.below(v) as i64 }).collect();
    let (mut dh, mut dwv) = (poisoned::<T>(t * c), vec![0.0f32; v * c]);
    let opts = CrossEntropyOptions { chunk_tokens: 64, ..Default::default() };
    let o = cross_entropy_fused(&mut dh, &mut dwv, &h, &wv, &tg, t, c, v, &opts, false).unwrap();
    out.extend([vec![o.loss.to_bits()], bits(&dh), bits(&dwv)]);
    // Clip norm over several slices.
    let mut g1: Vec<f32> = r.vec(70_000, 1.0).iter().map(|&x| x as f32).collect();
    let mut g2: Vec<f32> = r.vec(33_000, 1.0).iter().map(|&x| x as f32).collect();
    let nrm = clip_grad_norm(&mut [&mut g1[..], &mut g2[..]], 1.0).unwrap();
    out.extend([vec![(nrm as f32).to_bits()], bits(&g1), bits(&g2)]);
    out
}

#[test]
fn same_bits_for_any_thread_count() {
    let one = pool(1).install(run_all::<f32>);
    let two = pool(2).install(run_all::<f32>);
    let three = pool(3).install(run_all::<f32>);
    for (i, ((a, b), c)) in one.iter().zip(&two).zip(&three).enumerate() {
        assert!(a == b && a == c, "f32 output {i} differs between thread counts");
    }
    let one = pool(1).install(run_all::<bf16>);
    let two = pool(2).install(run_all::<bf16>);
    for (i, (a, b)) in one.iter().zip(&two).enumerate() {
        assert!(a == b, "bf16 output {i} differs between thread counts");
    }
}
