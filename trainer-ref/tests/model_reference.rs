//! The whole model against an independent reference: the same Llama written here in plain `f64` on a scalar
//! reverse-mode tape (sharing no code with the trainer: its own RMSNorm, RoPE with Llama 3 scaling, GQA causal
//! attention with document masking, SwiGLU, cross-entropy), checked itself by central finite differences; the
//! trainer's loss and every gradient tensor must match it. Then every parallel layout (CP 2 and 4 with each
//! partition, DP 2, gradient accumulation) must give CP 1's loss and gradients within 1e-5.
//!
//! The other families the same way: a second reference walks the tensors of any family in order and adds
//! Mixtral's mixture of experts (softmax router, top-k renormalised, SwiGLU experts, Hugging Face's
//! load-balancing loss over every layer and token) and Nemotron's layer (LayerNorm with weight + 1 and bias,
//! partial RoPE, squared ReLU), and tied embeddings.

use longctx_kernels::{CpuBackend, DType};
use longctx_trainer::data::Sequence;
use longctx_trainer::model::{param_shapes, Params};
use longctx_trainer::recipe::Recipe;
use longctx_trainer::train::{loss_and_gradients, loss_gradients_and_saved};

/// A scalar reverse-mode tape: node `i` has a value and up to two parents with their local derivatives.
#[derive(Default)]
struct Tape {
    val: Vec<f64>,
    par: Vec<[(u32, f64); 2]>,
}

const NONE: u32 = u32::MAX;

impl Tape {
    fn push(&mut self, v: f64, a: (u32, f64), b: (u32, f64)) -> u32 {
        self.val.push(v);
        self.par.push([a, b]);
        (self.val.len() - 1) as u32
    }
    fn leaf(&mut self, v: f64) -> u32 {
        self.push(v, (NONE, 0.0), (NONE, 0.0))
    }
    fn v(&self, a: u32) -> f64 {
        self.val[a as usize]
    }
    fn add(&mut self, a: u32, b: u32) -> u32 {
        self.push(self.v(a) + self.v(b), (a, 1.0), (b, 1.0))
    }
    fn mul(&mut self, a: u32, b: u32) -> u32 {
        let (x, y) = (self.v(a), self.v(b));
        self.push(x * y, (a, y), (b, x))
    }
    fn scale(&mut self, a: u32, c: f64) -> u32 {
        self.push(self.v(a) * c, (a, c), (NONE, 0.0))
    }
    fn offset(&mut self, a: u32, c: f64) -> u32 {
        self.push(self.v(a) + c, (a, 1.0), (NONE, 0.0))
    }
    fn exp(&mut self, a: u32) -> u32 {
        let e = self.v(a).exp();
        self.push(e, (a, e), (NONE, 0.0))
    }
    fn ln(&mut self, a: u32) -> u32 {
        let x = self.v(a);
        self.push(x.ln(), (a, 1.0 / x), (NONE, 0.0))
    }
    fn recip(&mut self, a: u32) -> u32 {
        let x = self.v(a);
        self.push(1.0 / x, (a, -1.0 / (x * x)), (NONE, 0.0))
    }
    fn relu_sq(&mut self, a: u32) -> u32 {
        let r = self.v(a).max(0.0);
        self.push(r * r, (a, 2.0 * r), (NONE, 0.0))
    }
    fn rsqrt(&mut self, a: u32) -> u32 {
        let x = self.v(a);
        self.push(x.powf(-0.5), (a, -0.5 * x.powf(-1.5)), (NONE, 0.0))
    }
    fn sum(&mut self, xs: &[u32]) -> u32 {
        let mut acc = xs[0];
        for &x in &xs[1..] {
            acc = self.add(acc, x);
        }
        acc
    }
    fn dot(&mut self, a: &[u32], b: &[u32]) -> u32 {
        let prods: Vec<u32> = a.iter().zip(b).map(|(&x, &y)| self.mul(x, y)).collect();
        self.sum(&prods)
    }
    fn grad(&self, out: u32) -> Vec<f64> {
        let mut g = vec![0.0; self.val.len()];
        g[out as usize] = 1.0;
        for i in (0..=out as usize).rev() {
            if g[i] == 0.0 {
                continue;
            }
            for &(p, d) in &self.par[i] {
                if p != NONE {
                    g[p as usize] += g[i] * d;
                }
            }
        }
        g
    }
}

struct RefCfg {
    c: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    f: usize,
    layers: usize,
    eps: f64,
    inv_freq: Vec<f64>,
}

/// Llama 3's scaled inverse frequencies, written from the formula (Hugging Face's `_compute_llama3_parameters`).
fn llama3_inv_freq(d: usize, theta: f64, factor: f64, low: f64, high: f64, orig: f64) -> Vec<f64> {
    (0..d / 2)
        .map(|i| {
            let inv = 1.0 / theta.powf(2.0 * i as f64 / d as f64);
            let wavelen = 2.0 * std::f64::consts::PI / inv;
            if wavelen > orig / low {
                inv / factor
            } else if wavelen < orig / high {
                inv
            } else {
                let s = (orig / wavelen - low) / (high - low);
                (1.0 - s) * inv / factor + s * inv
            }
        })
        .collect()
}

/// `y[t][o] = Σ_i x[t][i] · w[o][i]`.
fn linear(tp: &mut Tape, x: &[Vec<u32>], w: &[u32], out: usize) -> Vec<Vec<u32>> {
    let inp = x[0].len();
    x.iter().map(|row| (0..out).map(|o| tp.dot(row, &w[o * inp..(o + 1) * inp])).collect()).collect()
}

fn rmsnorm(tp: &mut Tape, x: &[Vec<u32>], w: &[u32], eps: f64) -> Vec<Vec<u32>> {
    x.iter()
        .map(|row| {
            let ss = tp.dot(row, row);
            let ms = tp.scale(ss, 1.0 / row.len() as f64);
            let ms = tp.offset(ms, eps);
            let r = tp.rsqrt(ms);
            row.iter()
                .zip(w)
                .map(|(&v, &g)| {
                    let n = tp.mul(v, r);
                    tp.mul(n, g)
                })
                .collect()
        })
        .collect()
}

/// Rotates head `h` of `x[t]` (`H·D` wide) by position `t`'s angles: pairs `(i, i + D/2)`.
fn rope(tp: &mut Tape, x: &mut [Vec<u32>], heads: usize, cfg: &RefCfg) {
    let (d, half) = (cfg.d, cfg.d / 2);
    for (t, row) in x.iter_mut().enumerate() {
        for h in 0..heads {
            for i in 0..half {
                let (a, b) = (row[h * d + i], row[h * d + i + half]);
                let (s, c) = (t as f64 * cfg.inv_freq[i]).sin_cos();
                let (ac, bs, bc, as_) = (tp.scale(a, c), tp.scale(b, -s), tp.scale(b, c), tp.scale(a, s));
                row[h * d + i] = tp.add(ac, bs);
                row[h * d + i + half] = tp.add(bc, as_);
            }
        }
    }
}

/// The loss of one sequence and the tape node of every weight, in `param_shapes` order.
fn reference_loss(
    tp: &mut Tape,
    cfg: &RefCfg,
    weights: &[Vec<f32>],
    seq: &Sequence,
    vocab: usize,
) -> (u32, Vec<Vec<u32>>) {
    let leaves: Vec<Vec<u32>> = weights.iter().map(|w| w.iter().map(|&v| tp.leaf(v as f64)).collect()).collect();
    let (c, d, hq, hkv, f) = (cfg.c, cfg.d, cfg.hq, cfg.hkv, cfg.f);
    let mut x: Vec<Vec<u32>> =
        seq.inputs.iter().map(|&id| leaves[0][id as usize * c..(id as usize + 1) * c].to_vec()).collect();
    for l in 0..cfg.layers {
        let w = &leaves[1 + 9 * l..1 + 9 * (l + 1)];
        let h1 = rmsnorm(tp, &x, &w[0], cfg.eps);
        let mut q = linear(tp, &h1, &w[1], hq * d);
        let mut k = linear(tp, &h1, &w[2], hkv * d);
        let v = linear(tp, &h1, &w[3], hkv * d);
        rope(tp, &mut q, hq, cfg);
        rope(tp, &mut k, hkv, cfg);
        let o = causal_attention(tp, &q, &k, &v, seq, cfg);
        let attn = linear(tp, &o, &w[4], c);
        let x2: Vec<Vec<u32>> =
            x.iter().zip(&attn).map(|(a, b)| a.iter().zip(b).map(|(&p, &q)| tp.add(p, q)).collect()).collect();
        let h2 = rmsnorm(tp, &x2, &w[5], cfg.eps);
        let gate = linear(tp, &h2, &w[6], f);
        let up = linear(tp, &h2, &w[7], f);
        let act: Vec<Vec<u32>> = gate
            .iter()
            .zip(&up)
            .map(|(g, u)| {
                g.iter()
                    .zip(u)
                    .map(|(&gi, &ui)| {
                        let ng = tp.scale(gi, -1.0);
                        let e = tp.exp(ng);
                        let den = tp.offset(e, 1.0);
                        let sig = tp.recip(den);
                        let silu = tp.mul(gi, sig);
                        tp.mul(silu, ui)
                    })
                    .collect()
            })
            .collect();
        let down = linear(tp, &act, &w[8], c);
        x = x2.iter().zip(&down).map(|(a, b)| a.iter().zip(b).map(|(&p, &q)| tp.add(p, q)).collect()).collect();
    }
    let n = leaves.len();
    let hf = rmsnorm(tp, &x, &leaves[n - 2], cfg.eps);
    let logits = linear(tp, &hf, &leaves[n - 1], vocab);
    (mean_cross_entropy(tp, &logits, &seq.targets), leaves)
}

fn tiny_recipe(extra: &[&str]) -> Recipe {
    let mut sets: Vec<String> = [
        "model.layers=2",
        "model.d_model=64",
        "model.heads=2",
        "model.kv_heads=1",
        "model.ffn=96",
        "model.init_std=0.3",
        "model.rope_theta=10000.0",
        "model.rope_scaling.original_max_position_embeddings=16",
        "train.seq_len=24",
        "train.batch=1",
        "train.loss_chunk=7",
        "parallel.threads=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    sets.extend(extra.iter().map(|s| s.to_string()));
    Recipe::load("tiny-llama", &sets).unwrap()
}

fn random_sequence(seed: u64, s: usize, docs: &[usize]) -> Sequence {
    let mut rng = longctx_trainer::model::Rng::new(seed);
    let tokens: Vec<u32> = (0..=s).map(|_| (rng.uniform() * 257.0) as u32 % 257).collect();
    let mut ids = Vec::with_capacity(s);
    let mut id = 0;
    for t in 0..s {
        if docs.contains(&t) {
            id += 1;
        }
        ids.push(id);
    }
    Sequence { inputs: tokens[..s].to_vec(), targets: tokens[1..].iter().map(|&t| t as i64).collect(), docs: ids }
}

fn max_rel(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0.0f64, |m, &x| m.max(x.abs())).max(1e-30);
    got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max) / scale
}

fn check_against_reference(masking: bool) {
    let recipe = tiny_recipe(if masking { &["data.document_masking=true"] } else { &[] });
    let docs: &[usize] = if masking { &[9, 17] } else { &[] };
    let seq = random_sequence(7, 24, docs);
    let (loss, grads) = loss_and_gradients(&recipe, std::slice::from_ref(&seq)).unwrap();

    let m = &recipe.model;
    let init = Params::init(&CpuBackend::new(), m, recipe.train.seed).unwrap();
    let weights: Vec<Vec<f32>> = init.tensors.iter().map(|t| t.view().as_typed::<f32>("w").unwrap().to_vec()).collect();
    let cfg = RefCfg {
        c: m.d_model,
        hq: m.heads,
        hkv: m.kv_heads,
        d: m.head_dim(),
        f: m.ffn,
        layers: m.layers,
        eps: m.norm_eps as f64,
        inv_freq: llama3_inv_freq(m.head_dim(), m.rope_theta, 8.0, 1.0, 4.0, 16.0),
    };
    let mut tp = Tape::default();
    let (out, leaves) = reference_loss(&mut tp, &cfg, &weights, &seq, m.vocab);
    let ref_loss = tp.v(out);
    assert!((loss - ref_loss).abs() <= 1e-5 * ref_loss.abs(), "loss {loss} vs reference {ref_loss}");
    let g = tp.grad(out);
    for (i, (name, _)) in param_shapes(m).iter().enumerate() {
        let want: Vec<f64> = leaves[i].iter().map(|&n| g[n as usize]).collect();
        let err = max_rel(&grads[i], &want);
        assert!(err < 2e-4, "{name}: gradient max error {err:.2e} of its largest entry (masking {masking})");
    }

    // The reference's own gradient against central finite differences, on a few weights of each kind.
    for (tensor, index) in [
        (0usize, seq.inputs[3] as usize * m.d_model + 3),
        (2, 17),
        (5, 40),
        (8, 100),
        (10, 1000),
        (19, 11),
        (20, 64 * 97 + 5),
    ] {
        let idx = index % weights[tensor].len();
        let h = 1e-4;
        let mut lp = weights.clone();
        lp[tensor][idx] += h as f32;
        let mut lm = weights.clone();
        lm[tensor][idx] -= h as f32;
        let hp = lp[tensor][idx] as f64 - weights[tensor][idx] as f64;
        let hm = weights[tensor][idx] as f64 - lm[tensor][idx] as f64;
        let (mut t1, mut t2) = (Tape::default(), Tape::default());
        let (o1, _) = reference_loss(&mut t1, &cfg, &lp, &seq, m.vocab);
        let (o2, _) = reference_loss(&mut t2, &cfg, &lm, &seq, m.vocab);
        let fd = (t1.v(o1) - t2.v(o2)) / (hp + hm);
        let tape = g[leaves[tensor][idx] as usize];
        assert!(
            (fd - tape).abs() <= 1e-6 + 1e-4 * tape.abs(),
            "tensor {tensor}[{idx}]: finite difference {fd:e}, tape {tape:e}"
        );
        let ours = grads[tensor][idx] as f64;
        assert!(
            (fd - ours).abs() <= 1e-5 + 2e-3 * fd.abs(),
            "tensor {tensor}[{idx}]: finite difference {fd:e}, trainer {ours:e}"
        );
    }
}

#[test]
fn the_models_loss_and_every_gradient_match_an_independent_f64_reference() {
    check_against_reference(false);
}

#[test]
fn with_document_masking_the_model_matches_the_f64_reference() {
    check_against_reference(true);
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0.0f32, |m, &x| m.max(x.abs())).max(1e-30) as f64;
    a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).abs()).fold(0.0, f64::max) / scale
}

#[test]
fn every_parallel_layout_gives_the_same_loss_and_gradients_as_one_rank() {
    for masking in [false, true] {
        let m = if masking { "data.document_masking=true" } else { "data.document_masking=false" };
        let seqs = [random_sequence(11, 24, &[5, 14]), random_sequence(12, 24, &[20])];
        let base = tiny_recipe(&[m, "train.batch=2"]);
        let (loss1, g1) = loss_and_gradients(&base, &seqs).unwrap();
        for layout in [
            &["parallel.cp=2"][..],
            &["parallel.cp=4"],
            &["parallel.cp=3", "parallel.partition=\"contiguous\""],
            &["parallel.cp=4", "parallel.partition=\"striped\""],
            &["parallel.cp=2", "parallel.schedule=\"allgather\""],
            &["parallel.dp=2"],
            &["parallel.dp=2", "parallel.cp=2"],
        ] {
            let mut sets = vec![m, "train.batch=2"];
            sets.extend_from_slice(layout);
            let r = tiny_recipe(&sets);
            let (loss, g) = loss_and_gradients(&r, &seqs).unwrap();
            assert!((loss - loss1).abs() <= 1e-5 * loss1.abs(), "{layout:?} masking {masking}: loss {loss} vs {loss1}");
            for (i, (a, b)) in g.iter().zip(&g1).enumerate() {
                let e = rel(a, b);
                assert!(e <= 1e-5, "{layout:?} masking {masking}: tensor {i} differs by {e:.2e}");
            }
        }
    }
}

#[test]
fn the_loss_is_not_scaled_by_the_number_of_ranks() {
    // The CP and DP pitfall of other frameworks: a mean over ranks' means, or a sum, instead of the global mean.
    let seqs = [random_sequence(3, 24, &[]), random_sequence(4, 24, &[])];
    let one = loss_and_gradients(&tiny_recipe(&["train.batch=2"]), &seqs).unwrap().0;
    let four = loss_and_gradients(&tiny_recipe(&["train.batch=2", "parallel.cp=2", "parallel.dp=2"]), &seqs).unwrap().0;
    assert!((one - four).abs() < 1e-5 * one, "{one} vs {four}");
    assert!(one > 4.0 && one < 8.0, "a random model's byte loss is near ln(257) = 5.55, got {one}");
    let _ = DType::F32;
}

#[test]
fn what_each_layer_saves_is_what_bytes_for_states_from_the_shapes() {
    use longctx_p2p::ThreadWorld;
    use longctx_ring_attn::{ContextParallel, CpConfig};
    use longctx_trainer::model::{LayerSaved, Llama};
    use std::sync::Arc;
    for (precision, dtype, cp) in [("f32", DType::F32, 1), ("bf16", DType::Bf16, 2)] {
        let recipe = tiny_recipe(&[&format!("train.precision=\"{precision}\""), &format!("parallel.cp={cp}")]);
        let sizes = ThreadWorld::run(cp, |comm| {
            let backend: Arc<dyn longctx_kernels::Backend> = Arc::new(CpuBackend::new());
            let init = Params::init(&*backend, &recipe.model, 1).unwrap();
            let mut w = Params::zeros(&*backend, &recipe.model, dtype).unwrap();
            for (d, s) in w.tensors.iter_mut().zip(&init.tensors) {
                backend.copy(d.view_mut(), s.view()).unwrap();
            }
            let model = Llama::new(recipe.model.clone(), w, backend.clone()).unwrap();
            let cp = ContextParallel::new(comm, backend, CpConfig::default()).unwrap();
            let mut plan = recipe.cp_plan(&cp, 24, dtype).unwrap();
            let ids: Vec<u32> = (0..plan.local_len() as u32).collect();
            let saved = model.forward(&ids, &mut plan).unwrap();
            (saved.layers.iter().map(LayerSaved::bytes).collect::<Vec<_>>(), saved.bytes(), plan.local_len())
        })
        .unwrap();
        for (layers, _, l) in sizes {
            for b in layers {
                assert_eq!(b, LayerSaved::bytes_for(&recipe.model, l, dtype), "{precision} cp {cp}");
            }
        }
    }
}

#[test]
fn every_recompute_policy_gives_bit_identical_loss_and_gradients_at_cp_1_and_4() {
    for (cp, masking) in
        [("parallel.cp=1", "data.document_masking=false"), ("parallel.cp=4", "data.document_masking=true")]
    {
        let seqs = [random_sequence(21, 24, &[7, 15]), random_sequence(22, 24, &[3])];
        let base = tiny_recipe(&[cp, masking, "train.batch=2", "model.layers=3"]);
        let (loss0, g0, kept0) = loss_gradients_and_saved(&base, &seqs).unwrap();
        let spec = base.layer_spec();
        // Room for two of the three layers' tensors: the solver must recompute some.
        let budget = 2 * spec.saved_bytes() + spec.backward_working_bytes;
        for policy in [
            "full",
            "selective",
            "selective:core_attn",
            "selective:mlp,attn_proj",
            "uniform:2",
            "uniform:3",
            "block:2",
            "custom:q=recompute,x2=recompute,act=recompute",
            &format!("budget:{budget}"),
        ] {
            let r = tiny_recipe(&[
                cp,
                masking,
                "train.batch=2",
                "model.layers=3",
                &format!("train.recompute=\"{policy}\""),
            ]);
            let (loss, g, kept) = loss_gradients_and_saved(&r, &seqs).unwrap();
            assert!(kept < kept0, "{cp} {policy}: kept {kept} bytes, as many as with none ({kept0})");
            assert_eq!(loss.to_bits(), loss0.to_bits(), "{cp} {policy}: loss {loss} vs {loss0}");
            for (i, (a, b)) in g.iter().zip(&g0).enumerate() {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{cp} {policy}: tensor {i} differs");
            }
        }
    }
}

#[test]
fn the_recompute_crate_describes_the_trainers_layer_exactly() {
    use longctx_trainer::model::LayerSaved;
    for (precision, dtype, cp) in [("f32", DType::F32, "parallel.cp=1"), ("bf16", DType::Bf16, "parallel.cp=4")] {
        let r = tiny_recipe(&[&format!("train.precision=\"{precision}\""), cp]);
        let l = r.train.seq_len / r.parallel.cp;
        assert_eq!(r.layer_spec().saved_bytes() as usize, LayerSaved::bytes_for(&r.model, l, dtype), "{precision}");
    }
}

/// The recompute crate's description of each family's layer and the model's saved-tensor table name the same
/// tensors, made by the same segments, in the same order; each segment is a forward helper of the model, which a
/// replay reruns by that name. A rename or an addition on either side fails here.
#[test]
fn the_recompute_crates_segment_and_tensor_names_are_the_models() {
    use longctx_trainer::model::{SavedId, SegmentId};
    let families = [
        ("llama", tiny_recipe(&[])),
        ("mixtral", family_recipe("tiny-mixtral", &[])),
        ("nemotron", family_recipe("tiny-nemotron", &[])),
    ];
    for (family, r) in families {
        let spec = r.layer_spec();
        assert_eq!(SavedId::from_name(&spec.input.name), Some(SavedId::X), "{family}: the layer's input");
        let mut named = vec![SavedId::X];
        for seg in &spec.segments {
            let Some(segment) = SegmentId::from_name(&seg.name) else {
                panic!("{family}: the recompute crate's segment `{}` is no forward helper of the model", seg.name)
            };
            for t in &seg.outputs {
                let Some(id) = SavedId::from_name(&t.name) else {
                    panic!("{family}: `{}` (made by `{}`) is not in the model's saved-tensor table", t.name, seg.name)
                };
                assert!(
                    id.made_by().contains(&segment),
                    "{family}: the model's table has `{}` made by {:?}, the recompute crate by `{}`",
                    t.name,
                    id.made_by(),
                    seg.name
                );
                named.push(id);
            }
        }
        let l = r.train.seq_len / r.parallel.cp;
        let saved: Vec<SavedId> = SavedId::all().filter(|id| id.bytes_for(&r.model, l, DType::F32).is_some()).collect();
        assert_eq!(named, saved, "{family}: the recompute crate's tensors, then the model's");
    }
}

#[test]
fn offload_to_host_or_disk_gives_bit_identical_loss_and_gradients_with_and_without_recompute() {
    for cp in ["parallel.cp=1", "parallel.cp=4"] {
        let seqs = [random_sequence(31, 24, &[11]), random_sequence(32, 24, &[])];
        let base = tiny_recipe(&[cp, "train.batch=2", "model.layers=3", "data.document_masking=true"]);
        let (loss0, g0, kept0) = loss_gradients_and_saved(&base, &seqs).unwrap();
        for (offload, recompute) in [
            ("disk", "none"),
            ("host", "none"),
            ("disk", "selective"),
            ("disk", "uniform:2"),
            ("disk", "custom:gate=offload,up=offload,act=recompute"),
        ] {
            let r = tiny_recipe(&[
                cp,
                "train.batch=2",
                "model.layers=3",
                "data.document_masking=true",
                &format!("train.offload=\"{offload}\""),
                &format!("train.recompute=\"{recompute}\""),
                "train.offload_budget=\"64MiB\"",
            ]);
            let (loss, g, kept) = loss_gradients_and_saved(&r, &seqs).unwrap();
            assert_eq!(loss.to_bits(), loss0.to_bits(), "{cp} {offload} {recompute}");
            for (i, (a, b)) in g.iter().zip(&g0).enumerate() {
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{cp} {offload} {recompute}: tensor {i}"
                );
            }
            // Two of the three layers are away while the forward ends (the last stays for the backward).
            let bound = if recompute == "none" { kept0 / 2 } else { kept0 };
            assert!(kept < bound, "{cp} {offload} {recompute}: {kept} of {kept0} bytes still held");
        }
    }
    let e = loss_and_gradients(&tiny_recipe(&["train.recompute=\"custom:q=offload\""]), &[random_sequence(1, 24, &[])]);
    assert!(e.unwrap_err().to_string().contains("--offload"));
}

/// The same training computation on the CUDA backend (device memory, the CUDA kernels, every saved tensor,
/// ring-attention block and gradient moved through the backend's own copies) gives the CPU backend's loss and
/// gradients: one rank; CP 2 with host offload and selective recompute; DP 2 (the gradient all-reduce from
/// device buffers) with disk offload; Mixtral at CP 2 and Nemotron with full recompute. On the host emulator here, on a GPU in the GPU check; each skips, saying
/// so, where its backend cannot open, except `cuda` under `LONGCTX_REQUIRE_GPU=1`.
mod the_cuda_backend_computes_the_cpus_loss_and_gradients {
    use super::*;

    #[test]
    fn cuda_emulated() {
        match longctx_kernels::CudaBackend::emulated() {
            Ok(_) => same_as_cpu("cuda-emulated"),
            Err(e) => eprintln!("the_cuda_backend_computes_the_cpus_loss_and_gradients::cuda_emulated: skipped: {e}"),
        }
    }

    #[test]
    fn cuda() {
        let opened = longctx_trainer::device::backend(longctx_trainer::device::Device::Cuda(0), 0);
        match opened {
            Ok(_) => same_as_cpu("cuda:0"),
            Err(e) if std::env::var("LONGCTX_REQUIRE_GPU").as_deref() == Ok("1") => {
                panic!("LONGCTX_REQUIRE_GPU=1 but: {e}")
            }
            Err(e) => eprintln!("the_cuda_backend_computes_the_cpus_loss_and_gradients::cuda: skipped: {e}"),
        }
    }

    fn same_as_cpu(device: &str) {
        let seqs = [random_sequence(41, 24, &[9]), random_sequence(42, 24, &[])];
        for (family, extra) in [
            ("llama", &["train.batch=1"][..]),
            ("llama", &["train.batch=1", "parallel.cp=2", "train.offload=\"host\"", "train.recompute=\"selective\""]),
            ("llama", &["train.batch=2", "parallel.dp=2", "train.offload=\"disk\"", "train.offload_budget=\"64MiB\""]),
            ("tiny-mixtral", &["train.batch=1", "parallel.cp=2"]),
            ("tiny-nemotron", &["train.batch=1", "train.recompute=\"full\""]),
        ] {
            let recipe =
                |sets: &[&str]| if family == "llama" { tiny_recipe(sets) } else { family_recipe(family, sets) };
            // f32 on both (a device's `auto` would be bf16): the comparison is of the backends, not the formats.
            let mut sets = vec!["data.document_masking=true", "train.precision=\"f32\""];
            sets.extend_from_slice(extra);
            let batch = if sets.contains(&"train.batch=2") { 2 } else { 1 };
            let (want_loss, want) = loss_and_gradients(&recipe(&sets), &seqs[..batch]).unwrap();
            let backend = format!("parallel.backend=\"{device}\"");
            sets.push(&backend);
            let (loss, got) = loss_and_gradients(&recipe(&sets), &seqs[..batch]).unwrap();
            assert!(
                (loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
                "{device} {family} {extra:?}: loss {loss} vs {want_loss}"
            );
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let err = rel(g, w);
                assert!(
                    err < 1e-4,
                    "{device} {family} {extra:?}: gradient {i} differs by {err:.2e} of its largest entry"
                );
            }
        }
    }
}

/// What the family reference needs beyond [`RefCfg`].
struct FamilyRef {
    base: RefCfg,
    family: &'static str,
    /// Rotating dims of each head (partial RoPE), with their frequencies in `base.inv_freq`.
    rotary: usize,
    experts: usize,
    top_k: usize,
    aux_coef: f64,
    tied: bool,
}

/// LayerNorm with zero-centred weight: `(x − mean)/√(var + eps)·(w + 1) + b` (Hugging Face `NemotronLayerNorm1P`).
fn layernorm1p(tp: &mut Tape, x: &[Vec<u32>], w: &[u32], b: &[u32], eps: f64) -> Vec<Vec<u32>> {
    x.iter()
        .map(|row| {
            let n = row.len() as f64;
            let s = tp.sum(row);
            let mean = tp.scale(s, -1.0 / n);
            let xc: Vec<u32> = row.iter().map(|&v| tp.add(v, mean)).collect();
            let ss = tp.dot(&xc, &xc);
            let var = tp.scale(ss, 1.0 / n);
            let var = tp.offset(var, eps);
            let r = tp.rsqrt(var);
            xc.iter()
                .zip(w.iter().zip(b))
                .map(|(&v, (&g, &bb))| {
                    let nv = tp.mul(v, r);
                    let g1 = tp.offset(g, 1.0);
                    let y = tp.mul(nv, g1);
                    tp.add(y, bb)
                })
                .collect()
        })
        .collect()
}

/// Rotates the first `rot` dims of head `h` of `x[t]` by position `t`'s angles: pairs `(i, i + rot/2)`.
fn rope_partial(tp: &mut Tape, x: &mut [Vec<u32>], heads: usize, d: usize, rot: usize, inv_freq: &[f64]) {
    let half = rot / 2;
    for (t, row) in x.iter_mut().enumerate() {
        for h in 0..heads {
            for i in 0..half {
                let (a, b) = (row[h * d + i], row[h * d + i + half]);
                let (s, c) = (t as f64 * inv_freq[i]).sin_cos();
                let (ac, bs, bc, as_) = (tp.scale(a, c), tp.scale(b, -s), tp.scale(b, c), tp.scale(a, s));
                row[h * d + i] = tp.add(ac, bs);
                row[h * d + i + half] = tp.add(bc, as_);
            }
        }
    }
}

/// `exp(z − max z)` for each of `z`, and the max (a stable softmax's numerators).
fn shifted_exps(tp: &mut Tape, z: &[u32]) -> (Vec<u32>, f64) {
    let m = z.iter().map(|&n| tp.v(n)).fold(f64::NEG_INFINITY, f64::max);
    let e = z
        .iter()
        .map(|&n| {
            let s = tp.offset(n, -m);
            tp.exp(s)
        })
        .collect();
    (e, m)
}

/// The mean over tokens of `−log softmax(logits[t])[targets[t]]`, with the max subtracted first.
fn mean_cross_entropy(tp: &mut Tape, logits: &[Vec<u32>], targets: &[i64]) -> u32 {
    let mut losses = Vec::new();
    for (t, z) in logits.iter().enumerate() {
        let (e, m) = shifted_exps(tp, z);
        let sum = tp.sum(&e);
        let lse = tp.ln(sum);
        let lse = tp.offset(lse, m);
        let neg = tp.scale(z[targets[t] as usize], -1.0);
        losses.push(tp.add(lse, neg));
    }
    let total = tp.sum(&losses);
    tp.scale(total, 1.0 / logits.len() as f64)
}

/// Causal grouped-query attention within documents.
fn causal_attention(
    tp: &mut Tape,
    q: &[Vec<u32>],
    k: &[Vec<u32>],
    v: &[Vec<u32>],
    seq: &Sequence,
    cfg: &RefCfg,
) -> Vec<Vec<u32>> {
    let (d, hq, hkv, s) = (cfg.d, cfg.hq, cfg.hkv, q.len());
    let scale = 1.0 / (d as f64).sqrt();
    let mut o = vec![Vec::with_capacity(hq * d); s];
    for h in 0..hq {
        let g = h / (hq / hkv);
        for t in 0..s {
            let seen: Vec<usize> = (0..=t).filter(|&j| seq.docs[j] == seq.docs[t]).collect();
            let scores: Vec<u32> = seen
                .iter()
                .map(|&j| {
                    let dot = tp.dot(&q[t][h * d..(h + 1) * d], &k[j][g * d..(g + 1) * d]);
                    tp.scale(dot, scale)
                })
                .collect();
            let (e, _) = shifted_exps(tp, &scores);
            let z = tp.sum(&e);
            let rz = tp.recip(z);
            for i in 0..d {
                let terms: Vec<u32> = seen.iter().zip(&e).map(|(&j, &ej)| tp.mul(ej, v[j][g * d + i])).collect();
                let num = tp.sum(&terms);
                o[t].push(tp.mul(num, rz));
            }
        }
    }
    o
}

fn swiglu_rows(tp: &mut Tape, gate: &[u32], up: &[u32]) -> Vec<u32> {
    gate.iter()
        .zip(up)
        .map(|(&gi, &ui)| {
            let ng = tp.scale(gi, -1.0);
            let e = tp.exp(ng);
            let den = tp.offset(e, 1.0);
            let sig = tp.recip(den);
            let silu = tp.mul(gi, sig);
            tp.mul(silu, ui)
        })
        .collect()
}

fn residual(tp: &mut Tape, a: &[Vec<u32>], b: &[Vec<u32>]) -> Vec<Vec<u32>> {
    a.iter().zip(b).map(|(x, y)| x.iter().zip(y).map(|(&p, &q)| tp.add(p, q)).collect()).collect()
}

/// The loss of one sequence for any family, walking the weights in `param_shapes` order; and every weight's
/// tape nodes.
fn family_reference_loss(
    tp: &mut Tape,
    fr: &FamilyRef,
    weights: &[Vec<f32>],
    seq: &Sequence,
    vocab: usize,
) -> (u32, Vec<Vec<u32>>) {
    let cfg = &fr.base;
    let leaves: Vec<Vec<u32>> = weights.iter().map(|w| w.iter().map(|&v| tp.leaf(v as f64)).collect()).collect();
    let (c, d, hq, hkv, f) = (cfg.c, cfg.d, cfg.hq, cfg.hkv, cfg.f);
    let ln = fr.family == "nemotron";
    let s = seq.inputs.len();
    let mut next = 1usize;
    let mut take = || {
        next += 1;
        next - 1
    };
    let mut x: Vec<Vec<u32>> =
        seq.inputs.iter().map(|&id| leaves[0][id as usize * c..(id as usize + 1) * c].to_vec()).collect();
    // Router probabilities of every (layer, token), and top-k assignments per expert, for the auxiliary loss.
    let (mut all_probs, mut counts): (Vec<Vec<u32>>, Vec<f64>) = (Vec::new(), vec![0.0; fr.experts]);
    let norm = |tp: &mut Tape, x: &[Vec<u32>], take: &mut dyn FnMut() -> usize| {
        if ln {
            let (w, b) = (take(), take());
            layernorm1p(tp, x, &leaves[w], &leaves[b], cfg.eps)
        } else {
            let w = take();
            rmsnorm(tp, x, &leaves[w], cfg.eps)
        }
    };
    for _ in 0..cfg.layers {
        let h1 = norm(tp, &x, &mut take);
        let (wq, wk, wv, wo) = (take(), take(), take(), take());
        let mut q = linear(tp, &h1, &leaves[wq], hq * d);
        let mut k = linear(tp, &h1, &leaves[wk], hkv * d);
        let v = linear(tp, &h1, &leaves[wv], hkv * d);
        rope_partial(tp, &mut q, hq, d, fr.rotary, &cfg.inv_freq);
        rope_partial(tp, &mut k, hkv, d, fr.rotary, &cfg.inv_freq);
        let o = causal_attention(tp, &q, &k, &v, seq, cfg);
        let attn = linear(tp, &o, &leaves[wo], c);
        let x2 = residual(tp, &x, &attn);
        let h2 = norm(tp, &x2, &mut take);
        let mlp: Vec<Vec<u32>> = match fr.family {
            "nemotron" => {
                let (wu, wd) = (take(), take());
                let up = linear(tp, &h2, &leaves[wu], f);
                let act: Vec<Vec<u32>> = up.iter().map(|r| r.iter().map(|&u| tp.relu_sq(u)).collect()).collect();
                linear(tp, &act, &leaves[wd], c)
            }
            "mixtral" => {
                let router = take();
                let ex: Vec<(usize, usize, usize)> = (0..fr.experts).map(|_| (take(), take(), take())).collect();
                let logits = linear(tp, &h2, &leaves[router], fr.experts);
                let mut out = Vec::with_capacity(s);
                for (t, z) in logits.iter().enumerate() {
                    let (e, _) = shifted_exps(tp, z);
                    let sum = tp.sum(&e);
                    let rz = tp.recip(sum);
                    let p: Vec<u32> = e.iter().map(|&n| tp.mul(n, rz)).collect();
                    let mut order: Vec<usize> = (0..fr.experts).collect();
                    order.sort_by(|&a, &b| tp.v(p[b]).partial_cmp(&tp.v(p[a])).unwrap().then(a.cmp(&b)));
                    let mut chosen = order[..fr.top_k].to_vec();
                    let sel: Vec<u32> = chosen.iter().map(|&i| p[i]).collect();
                    let total = tp.sum(&sel);
                    let rt = tp.recip(total);
                    chosen.sort_unstable();
                    let mut y: Option<Vec<u32>> = None;
                    for &i in &chosen {
                        counts[i] += 1.0;
                        let w = tp.mul(p[i], rt);
                        let (w1, w2, w3) = ex[i];
                        let row = std::slice::from_ref(&h2[t]);
                        let g = linear(tp, row, &leaves[w1], f);
                        let u = linear(tp, row, &leaves[w3], f);
                        let a = swiglu_rows(tp, &g[0], &u[0]);
                        let dn = linear(tp, std::slice::from_ref(&a), &leaves[w2], c);
                        let wy: Vec<u32> = dn[0].iter().map(|&n| tp.mul(n, w)).collect();
                        y = Some(match y {
                            None => wy,
                            Some(acc) => acc.iter().zip(&wy).map(|(&a, &b)| tp.add(a, b)).collect(),
                        });
                    }
                    all_probs.push(p);
                    out.push(y.unwrap_or_default());
                }
                out
            }
            _ => {
                let (wg, wu, wd) = (take(), take(), take());
                let gate = linear(tp, &h2, &leaves[wg], f);
                let up = linear(tp, &h2, &leaves[wu], f);
                let act: Vec<Vec<u32>> = gate.iter().zip(&up).map(|(g, u)| swiglu_rows(tp, g, u)).collect();
                linear(tp, &act, &leaves[wd], c)
            }
        };
        x = residual(tp, &x2, &mlp);
    }
    let hf = norm(tp, &x, &mut take);
    let head = if fr.tied { 0 } else { take() };
    assert_eq!(next, leaves.len(), "the reference walked every tensor");
    let logits = linear(tp, &hf, &leaves[head], vocab);
    let mut loss = mean_cross_entropy(tp, &logits, &seq.targets);
    if !all_probs.is_empty() {
        // Hugging Face `load_balancing_loss_func`: E · Σ_e (count_e / N) · (Σ p_e / N), N = layers × tokens.
        let n = all_probs.len() as f64;
        let terms: Vec<u32> = (0..fr.experts)
            .map(|e| {
                let col: Vec<u32> = all_probs.iter().map(|p| p[e]).collect();
                let pe = tp.sum(&col);
                tp.scale(pe, fr.experts as f64 * (counts[e] / n) / n)
            })
            .collect();
        let aux = tp.sum(&terms);
        let aux = tp.scale(aux, fr.aux_coef);
        loss = tp.add(loss, aux);
    }
    (loss, leaves)
}

fn family_recipe(name: &str, extra: &[&str]) -> Recipe {
    let mut sets: Vec<String> = [
        "model.layers=2",
        "model.d_model=64",
        "model.heads=2",
        "model.kv_heads=1",
        "model.ffn=32",
        "model.init_std=0.3",
        "train.seq_len=24",
        "train.batch=1",
        "train.loss_chunk=7",
        "parallel.threads=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if name == "tiny-mixtral" {
        sets.push("model.moe.aux_loss_coef=0.5".into());
    }
    sets.extend(extra.iter().map(|s| s.to_string()));
    Recipe::load(name, &sets).unwrap()
}

/// The trainer against the family reference; then the reference against finite differences on the tensors
/// `fd_tensors` names (a few entries each).
fn check_family(recipe: &Recipe, fd_tensors: &[&str]) {
    let seq = random_sequence(5, 24, &[]);
    let (loss, grads) = loss_and_gradients(recipe, std::slice::from_ref(&seq)).unwrap();
    let m = &recipe.model;
    let init = Params::init(&CpuBackend::new(), m, recipe.train.seed).unwrap();
    let weights: Vec<Vec<f32>> = init.tensors.iter().map(|t| t.view().as_typed::<f32>("w").unwrap().to_vec()).collect();
    let rot = m.rotary_dim();
    let family = match m.family {
        longctx_trainer::recipe::Family::Llama => "llama",
        longctx_trainer::recipe::Family::Mixtral => "mixtral",
        longctx_trainer::recipe::Family::Nemotron => "nemotron",
    };
    let moe = m.experts();
    let fr = FamilyRef {
        base: RefCfg {
            c: m.d_model,
            hq: m.heads,
            hkv: m.kv_heads,
            d: m.head_dim(),
            f: m.ffn,
            layers: m.layers,
            eps: m.norm_eps as f64,
            inv_freq: (0..rot / 2).map(|i| 1.0 / m.rope_theta.powf(2.0 * i as f64 / rot as f64)).collect(),
        },
        family,
        rotary: rot,
        experts: moe.map_or(0, |x| x.experts),
        top_k: moe.map_or(0, |x| x.top_k),
        aux_coef: moe.map_or(0.0, |x| x.aux_loss_coef),
        tied: m.tie_embeddings,
    };
    let mut tp = Tape::default();
    let (out, leaves) = family_reference_loss(&mut tp, &fr, &weights, &seq, m.vocab);
    let ref_loss = tp.v(out);
    assert!((loss - ref_loss).abs() <= 1e-5 * ref_loss.abs(), "{family}: loss {loss} vs reference {ref_loss}");
    let g = tp.grad(out);
    let shapes = param_shapes(m);
    for (i, (name, _)) in shapes.iter().enumerate() {
        let want: Vec<f64> = leaves[i].iter().map(|&n| g[n as usize]).collect();
        let err = max_rel(&grads[i], &want);
        assert!(err < 2e-4, "{family} {name}: gradient max error {err:.2e} of its largest entry");
    }
    for (j, want) in fd_tensors.iter().enumerate() {
        let tensor = shapes.iter().position(|(n, _)| n == want).unwrap_or_else(|| panic!("no tensor {want}"));
        let idx = (17 + 29 * j) % weights[tensor].len();
        let h = 1e-4;
        let (mut lp, mut lm) = (weights.clone(), weights.clone());
        lp[tensor][idx] += h as f32;
        lm[tensor][idx] -= h as f32;
        let width = lp[tensor][idx] as f64 - lm[tensor][idx] as f64;
        let (mut t1, mut t2) = (Tape::default(), Tape::default());
        let (o1, _) = family_reference_loss(&mut t1, &fr, &lp, &seq, m.vocab);
        let (o2, _) = family_reference_loss(&mut t2, &fr, &lm, &seq, m.vocab);
        let fd = (t1.v(o1) - t2.v(o2)) / width;
        let tape = g[leaves[tensor][idx] as usize];
        assert!(
            (fd - tape).abs() <= 1e-6 + 1e-4 * tape.abs(),
            "{want}[{idx}]: finite difference {fd:e}, tape {tape:e}"
        );
    }
}

#[test]
fn mixtral_loss_aux_loss_and_every_gradient_match_the_f64_reference() {
    let r = family_recipe("tiny-mixtral", &[]);
    check_family(
        &r,
        &[
            "model.layers.0.block_sparse_moe.gate.weight",
            "model.layers.1.block_sparse_moe.gate.weight",
            "model.layers.0.block_sparse_moe.experts.2.w1.weight",
            "model.layers.1.block_sparse_moe.experts.0.w2.weight",
            "model.layers.0.block_sparse_moe.experts.3.w3.weight",
            "model.layers.1.post_attention_layernorm.weight",
        ],
    );
}

#[test]
fn nemotron_loss_and_every_gradient_match_the_f64_reference() {
    let r = family_recipe("tiny-nemotron", &[]);
    check_family(
        &r,
        &[
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.input_layernorm.bias",
            "model.layers.1.post_attention_layernorm.bias",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.mlp.up_proj.weight",
            "model.norm.bias",
        ],
    );
}

#[test]
fn tied_embeddings_match_the_f64_reference_in_every_family() {
    for name in ["tiny-llama", "tiny-nemotron", "tiny-mixtral"] {
        let mut r = family_recipe(name, &["model.tie_embeddings=true"]);
        r.model.rope_scaling = None;
        assert!(!param_shapes(&r.model).iter().any(|(n, _)| n == "lm_head.weight"), "{name}");
        check_family(&r, &["model.embed_tokens.weight"]);
    }
}

#[test]
fn each_family_gives_the_same_loss_and_gradients_under_every_parallel_layout() {
    for name in ["tiny-mixtral", "tiny-nemotron"] {
        let seqs = [random_sequence(41, 24, &[5, 14]), random_sequence(42, 24, &[20])];
        let (loss1, g1) = loss_and_gradients(&family_recipe(name, &["train.batch=2"]), &seqs).unwrap();
        for layout in [
            &["parallel.cp=2"][..],
            &["parallel.cp=4"],
            &["parallel.cp=3", "parallel.partition=\"contiguous\""],
            &["parallel.dp=2"],
            &["parallel.dp=2", "parallel.cp=2"],
        ] {
            let mut sets = vec!["train.batch=2"];
            sets.extend_from_slice(layout);
            let (loss, g) = loss_and_gradients(&family_recipe(name, &sets), &seqs).unwrap();
            assert!((loss - loss1).abs() <= 1e-5 * loss1.abs(), "{name} {layout:?}: loss {loss} vs {loss1}");
            for (i, (a, b)) in g.iter().zip(&g1).enumerate() {
                let e = rel(a, b);
                assert!(e <= 1e-5, "{name} {layout:?}: tensor {i} differs by {e:.2e}");
            }
        }
    }
}

#[test]
fn each_family_recomputes_and_offloads_with_bit_identical_gradients() {
    for name in ["tiny-mixtral", "tiny-nemotron"] {
        let seqs = [random_sequence(51, 24, &[7]), random_sequence(52, 24, &[])];
        let base = family_recipe(name, &["train.batch=2", "model.layers=3", "parallel.cp=2"]);
        let (loss0, g0, kept0) = loss_gradients_and_saved(&base, &seqs).unwrap();
        let (modules, custom, offloaded) = if name == "tiny-mixtral" {
            ("selective:mlp,moe", "custom:router_probs=recompute,routing=recompute,act=recompute,ye=recompute", "ye")
        } else {
            ("selective:mlp", "custom:mean1=recompute,rstd2=recompute,act=recompute", "up")
        };
        let offload_custom = format!("custom:{offloaded}=offload,act=recompute");
        for (policy, offload) in [
            ("full", "none"),
            ("selective", "none"),
            (modules, "none"),
            ("uniform:2", "none"),
            (custom, "none"),
            ("none", "host"),
            (offload_custom.as_str(), "host"),
        ] {
            let r = family_recipe(
                name,
                &[
                    "train.batch=2",
                    "model.layers=3",
                    "parallel.cp=2",
                    &format!("train.recompute=\"{policy}\""),
                    &format!("train.offload=\"{offload}\""),
                    "train.offload_budget=\"64MiB\"",
                ],
            );
            let (loss, g, kept) = loss_gradients_and_saved(&r, &seqs).unwrap();
            assert!(kept < kept0, "{name} {policy} {offload}: kept {kept} of {kept0}");
            assert_eq!(loss.to_bits(), loss0.to_bits(), "{name} {policy} {offload}: loss {loss} vs {loss0}");
            for (i, (a, b)) in g.iter().zip(&g0).enumerate() {
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{name} {policy} {offload}: tensor {i}"
                );
            }
        }
    }
}

#[test]
fn each_familys_saved_bytes_are_what_bytes_for_and_the_recompute_crate_state() {
    use longctx_p2p::ThreadWorld;
    use longctx_ring_attn::{ContextParallel, CpConfig};
    use longctx_trainer::model::{LayerSaved, Model};
    use std::sync::Arc;
    for name in ["tiny-mixtral", "tiny-nemotron"] {
        for (precision, dtype) in [("f32", DType::F32), ("bf16", DType::Bf16)] {
            let recipe = family_recipe(name, &[&format!("train.precision=\"{precision}\""), "parallel.cp=2"]);
            let l = recipe.train.seq_len / 2;
            assert_eq!(recipe.layer_spec().saved_bytes() as usize, LayerSaved::bytes_for(&recipe.model, l, dtype));
            let sizes = ThreadWorld::run(2, |comm| {
                let backend: Arc<dyn longctx_kernels::Backend> = Arc::new(CpuBackend::new());
                let init = Params::init(&*backend, &recipe.model, 1).unwrap();
                let mut w = Params::zeros(&*backend, &recipe.model, dtype).unwrap();
                for (d, s) in w.tensors.iter_mut().zip(&init.tensors) {
                    backend.copy(d.view_mut(), s.view()).unwrap();
                }
                let model = Model::new(recipe.model.clone(), w, backend.clone()).unwrap();
                let cp = ContextParallel::new(comm, backend, CpConfig::default()).unwrap();
                let mut plan = recipe.cp_plan(&cp, 24, dtype).unwrap();
                let ids: Vec<u32> = (0..plan.local_len() as u32).collect();
                let saved = model.forward(&ids, &mut plan).unwrap();
                saved.layers.iter().map(LayerSaved::bytes).collect::<Vec<_>>()
            })
            .unwrap();
            for b in sizes.into_iter().flatten() {
                assert_eq!(b, LayerSaved::bytes_for(&recipe.model, l, dtype), "{name} {precision}");
            }
        }
    }
}

#[test]
fn family_fields_are_validated_naming_the_field() {
    for (name, set, field) in [
        ("tiny-mixtral", "model.moe.top_k=5", "model.moe.top_k"),
        ("tiny-mixtral", "model.moe.aux_loss_coef=-1.0", "model.moe.aux_loss_coef"),
        ("tiny-nemotron", "model.moe={ experts = 2, top_k = 1, aux_loss_coef = 0.0 }", "model.moe"),
        ("tiny-nemotron", "model.partial_rotary_factor=1.5", "model.partial_rotary_factor"),
        ("tiny-nemotron", "model.partial_rotary_factor=0.3", "model.partial_rotary_factor"),
        ("tiny-llama", "model.family=\"mixtral\"", "model.moe"),
        ("tiny-llama", "model.family=\"gpt\"", "gpt"),
    ] {
        let e = Recipe::load(name, &[set.to_string()]).unwrap_err().to_string();
        assert!(e.contains(field), "{set}: {e}");
    }
}
