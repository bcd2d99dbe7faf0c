//! Every op, through the CPU backend, gives the same bits on a 1-thread and on a 2-thread (and 3-thread) rayon
//! pool: the CPU's own determinism (every backend's determinism from run to run is a conformance property, in the
//! other test files).

use half::bf16;
use longctx_kernels::testing::conformance::data::DataRng;
use longctx_kernels::{
    Backend, CpuBackend, CrossEntropyOptions, Element, GradMode, IntoDims, LayerNormSaved, LinearGrads, LinearSaved,
    NormGrads, NormParams, ProjectionGrads, RmsNormSaved, RopeConfig, RopeScaling, RopeTable, SwigluSaved, View,
    ViewMut,
};

fn view<T: Element>(x: &[T], dims: impl IntoDims) -> View<'_> {
    View::new(x, dims).unwrap()
}

fn view_mut<T: Element>(x: &mut [T], dims: impl IntoDims) -> ViewMut<'_> {
    ViewMut::new(x, dims).unwrap()
}

fn to_t<T: Element>(x: &[f64]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v as f32)).collect()
}

/// `n` NaNs, so that an element an op fails to write shows.
fn poisoned<T: Element>(n: usize) -> Vec<T> {
    vec![T::from_f32(f32::NAN); n]
}

fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap()
}

fn bits<T: Element>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

/// Runs every op through the CPU backend (on the calling thread's pool) with multi-task shapes and returns all
/// outputs as bit patterns.
fn run_all<T: Element>() -> Vec<Vec<u32>> {
    let cpu = CpuBackend::new();
    let mut r = DataRng::new(42);
    let mut out = vec![];
    let f = |r: &mut DataRng, n: usize| to_t::<T>(&r.vec(n, 1.0));
    // Linear: several 128×256 tiles, and a token reduction of 300 for dW.
    let (t, di, d_o) = (300, 96, 520);
    let (x, w, b, dy) = (f(&mut r, t * di), f(&mut r, d_o * di), f(&mut r, d_o), f(&mut r, t * d_o));
    let (xv, wv) = (view(&x, [t, di]), view(&w, [d_o, di]));
    let mut y = poisoned::<T>(t * d_o);
    cpu.linear_forward(view_mut(&mut y, [t, d_o]), xv, wv, Some(view(&b, [d_o]))).unwrap();
    let (mut dx, mut dw, mut db) = (poisoned::<T>(t * di), vec![0.5f32; d_o * di], vec![0.5f32; d_o]);
    let grads = LinearGrads {
        dx: Some(view_mut(&mut dx, [t, di])),
        dw: view_mut(&mut dw, [d_o, di]),
        dbias: Some(view_mut(&mut db, [d_o])),
    };
    cpu.linear_backward(grads, view(&dy, [t, d_o]), LinearSaved { x: xv }, wv, GradMode::Accumulate).unwrap();
    out.extend([bits(&y), bits(&dx), bits(&dw), bits(&db)]);
    // A weight gradient over 4500 tokens: the token reduction cut into chunks, summed in chunk order.
    let (t, di, d_o) = (4500, 24, 40);
    let (x, w, dy) = (f(&mut r, t * di), f(&mut r, d_o * di), f(&mut r, t * d_o));
    let mut dw = poisoned::<f32>(d_o * di);
    let grads = LinearGrads { dx: None, dw: view_mut(&mut dw, [d_o, di]), dbias: None };
    let (dyv, saved, wv) = (view(&dy, [t, d_o]), LinearSaved { x: view(&x, [t, di]) }, view(&w, [d_o, di]));
    cpu.linear_backward(grads, dyv, saved, wv, GradMode::Overwrite).unwrap();
    out.push(bits(&dw));
    // Norms: 300 rows = 19 row blocks.
    let (n, c) = (300, 64);
    let (x, wt, bt, dy) = (f(&mut r, n * c), f(&mut r, c), f(&mut r, c), f(&mut r, n * c));
    let (xv, wv, dyv) = (view(&x, [n, c]), view(&wt, [c]), view(&dy, [n, c]));
    let (mut y, mut rs, mut mu) = (poisoned::<T>(n * c), vec![0.0; n], vec![0.0; n]);
    let p = NormParams { weight: wv, bias: None, eps: 1e-5 };
    cpu.rmsnorm_forward(view_mut(&mut y, [n, c]), view_mut(&mut rs, [n]), xv, &p).unwrap();
    let (mut dx, mut dw) = (poisoned::<T>(n * c), vec![0.0f32; c]);
    let grads = NormGrads { dx: view_mut(&mut dx, [n, c]), dweight: view_mut(&mut dw, [c]), dbias: None };
    let saved = RmsNormSaved { x: xv, rstd: view(&rs, [n]) };
    cpu.rmsnorm_backward(grads, dyv, saved, wv, GradMode::Overwrite).unwrap();
    out.extend([bits(&y), bits(&dx), bits(&dw)]);
    let p = NormParams { weight: wv, bias: Some(view(&bt, [c])), eps: 1e-5 };
    cpu.layernorm_forward(view_mut(&mut y, [n, c]), view_mut(&mut mu, [n]), view_mut(&mut rs, [n]), xv, &p).unwrap();
    let mut dbias = vec![0.0f32; c];
    let grads = NormGrads {
        dx: view_mut(&mut dx, [n, c]),
        dweight: view_mut(&mut dw, [c]),
        dbias: Some(view_mut(&mut dbias, [c])),
    };
    let saved = LayerNormSaved { x: xv, mean: view(&mu, [n]), rstd: view(&rs, [n]) };
    cpu.layernorm_backward(grads, dyv, saved, wv, GradMode::Overwrite).unwrap();
    out.extend([bits(&y), bits(&dx), bits(&dw), bits(&dbias)]);
    // RoPE.
    let rope = RopeTable::new(&RopeConfig { head_dim: 64, base: 1e4, scaling: RopeScaling::None }).unwrap();
    let pos: Vec<i64> = (0..40).map(|i| 7 * i + 3).collect();
    let xr = f(&mut r, 2 * 4 * 40 * 64);
    let mut yr = xr.clone();
    cpu.rope_forward(&rope, view_mut(&mut yr, [2, 4, 40, 64]), &pos).unwrap();
    out.push(bits(&yr));
    // Activations.
    let (g, u, d) = (f(&mut r, 50_000), f(&mut r, 50_000), f(&mut r, 50_000));
    let (mut o, mut dg, mut du) = (poisoned::<T>(50_000), poisoned::<T>(50_000), poisoned::<T>(50_000));
    let saved = SwigluSaved { gate: view(&g, [50_000]), up: view(&u, [50_000]) };
    cpu.swiglu_forward(view_mut(&mut o, [50_000]), saved.gate, saved.up).unwrap();
    cpu.swiglu_backward(view_mut(&mut dg, [50_000]), view_mut(&mut du, [50_000]), view(&d, [50_000]), saved).unwrap();
    out.extend([bits(&o), bits(&dg), bits(&du)]);
    // Embedding backward with many repeated ids.
    let (v, ce) = (100, 32);
    let ids: Vec<u32> = (0..400).map(|_| r.below(20) as u32).collect();
    let dout = f(&mut r, 400 * ce);
    let mut dtab = vec![0.25f32; v * ce];
    cpu.embedding_backward(view_mut(&mut dtab, [v, ce]), view(&dout, [400, ce]), &ids, GradMode::Accumulate).unwrap();
    out.push(bits(&dtab));
    // Fused cross-entropy with several chunks.
    let (t, c, v) = (200, 48, 300);
    let (h, wv) = (f(&mut r, t * c), f(&mut r, v * c));
    let tg: Vec<i64> = (0..t).map(|i| if i % 7 == 0 { -100 } else { r.below(v) as i64 }).collect();
    let (mut dh, mut dwv) = (poisoned::<T>(t * c), vec![0.0f32; v * c]);
    let opts = CrossEntropyOptions { chunk_tokens: 64, ..Default::default() };
    let grads = ProjectionGrads { dhidden: view_mut(&mut dh, [t, c]), dweight: view_mut(&mut dwv, [v, c]) };
    let o =
        cpu.cross_entropy_fused(grads, view(&h, [t, c]), view(&wv, [v, c]), &tg, &opts, GradMode::Overwrite).unwrap();
    out.extend([vec![o.loss.to_bits()], bits(&dh), bits(&dwv)]);
    // Clip norm over several buffers.
    let mut g1: Vec<f32> = r.vec(70_000, 1.0).iter().map(|&x| x as f32).collect();
    let mut g2: Vec<f32> = r.vec(33_000, 1.0).iter().map(|&x| x as f32).collect();
    let nrm = cpu.clip_grad_norm(&mut [ViewMut::flat(&mut g1), ViewMut::flat(&mut g2)], 1.0).unwrap();
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
