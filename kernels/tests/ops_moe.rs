//! Mixture-of-experts routing and dispatch through the CPU backend against plain f64 loops (Hugging Face
//! `MixtralSparseMoeBlock`'s arithmetic), finite differences of the router, ties, splits and bad shapes.

mod ops_util;

use longctx_kernels::{Backend, CpuBackend, KernelError, MoeCombineSaved, MoeRouterSaved, Routing};
use ops_util::*;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Softmax over each row, the top `k` (ties to the lower index) and the renormalised weights, in f64.
fn ref_router(logits: &[f64], e: usize, k: usize) -> (Vec<f64>, Vec<u32>, Vec<f64>) {
    let (mut p, mut c, mut w) = (vec![], vec![], vec![]);
    for row in logits.chunks(e) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = row.iter().map(|x| (x - m).exp()).sum();
        let pr: Vec<f64> = row.iter().map(|x| (x - m).exp() / z).collect();
        let mut idx: Vec<usize> = (0..e).collect();
        idx.sort_by(|&a, &b| pr[b].partial_cmp(&pr[a]).unwrap().then(a.cmp(&b)));
        let s: f64 = idx[..k].iter().map(|&i| pr[i]).sum();
        for &i in &idx[..k] {
            c.push(i as u32);
            w.push(pr[i] / s);
        }
        p.extend(pr);
    }
    (p, c, w)
}

/// `J = Σ g·w + Σ_t Σ_e aux[e]·p[t,e]` with the choices held fixed (as they are away from ties).
fn ref_router_objective(logits: &[f64], e: usize, k: usize, choice: &[u32], g: &[f64], aux: &[f64]) -> f64 {
    let mut j = 0.0;
    for (t, row) in logits.chunks(e).enumerate() {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = row.iter().map(|x| (x - m).exp()).sum();
        let pr: Vec<f64> = row.iter().map(|x| (x - m).exp() / z).collect();
        let c = &choice[t * k..(t + 1) * k];
        let s: f64 = c.iter().map(|&i| pr[i as usize]).sum();
        for (jj, &i) in c.iter().enumerate() {
            j += g[t * k + jj] * pr[i as usize] / s;
        }
        j += pr.iter().zip(aux).map(|(p, a)| p * a).sum::<f64>();
    }
    j
}

#[test]
fn router_matches_the_reference_and_finite_differences() {
    let (l, e, k) = (37, 5, 2);
    let mut r = DataRng::new(7);
    let logits = rounded::<f32>(&r.vec(l * e, 2.0));
    let (p_ref, c_ref, w_ref) = ref_router(&logits, e, k);
    let cpu = CpuBackend::new();
    let (mut p, mut w) = (poisoned::<f32>(l * e), poisoned::<f32>(l * k));
    let x = to_t::<f32>(&logits);
    let out = cpu.moe_router_forward(view_mut(&mut p, [l, e]), view_mut(&mut w, [l, k]), view(&x, [l, e]), k).unwrap();
    assert_close("probs", &p, &p_ref);
    assert_close("weights", &w, &w_ref);
    assert_eq!(out.routing.choice(), c_ref.as_slice());
    let sums: Vec<f64> = (0..e).map(|i| p_ref.iter().skip(i).step_by(e).sum()).collect();
    assert_close_f64("prob_sum", &out.prob_sum, &sums, 1e-6);
    let counts: Vec<u64> = (0..e as u32).map(|i| c_ref.iter().filter(|&&c| c == i).count() as u64).collect();
    assert_eq!(out.routing.counts(), counts);

    let (g, aux) = (r.vec(l * k, 1.0), r.vec(e, 1.0));
    let (gt, at) = (to_t::<f32>(&g), to_t::<f32>(&aux));
    let mut dl = poisoned::<f32>(l * e);
    let saved = MoeRouterSaved { probs: view(&p, [l, e]), weights: view(&w, [l, k]), routing: &out.routing };
    cpu.moe_router_backward(view_mut(&mut dl, [l, e]), view(&gt, [l, k]), Some(view(&at, [e])), saved).unwrap();
    let fd = fd_grad(|v| ref_router_objective(v, e, k, &c_ref, &g, &aux), &logits, 1e-6);
    assert_fd("dlogits", &fd, &to_f64(&dl), 1e-5);
}

#[test]
fn router_ties_go_to_the_lower_expert() {
    let cpu = CpuBackend::new();
    let x = [0.5f32, 1.0, 1.0, 1.0, 0.0, 0.0];
    let (mut p, mut w) = (vec![0f32; 6], vec![0f32; 4]);
    let out = cpu.moe_router_forward(view_mut(&mut p, [2, 3]), view_mut(&mut w, [2, 2]), view(&x, [2, 3]), 2).unwrap();
    assert_eq!(out.routing.choice(), &[1, 2, 0, 1]);
    assert_eq!(w[0], 0.5);
    assert_eq!(out.routing.offsets(), &[0, 1, 3, 4]);
    assert_eq!(out.routing.row_tokens(), &[1, 0, 1, 0]);
}

#[test]
fn dispatch_and_combine_match_the_reference_and_are_adjoint() {
    let (l, e, k, c) = (29, 4, 2, 6);
    let mut r = DataRng::new(11);
    let choice: Vec<u32> = (0..l)
        .flat_map(|_| {
            let a = r.below(e) as u32;
            let b = (a + 1 + r.below(e - 1) as u32) % e as u32;
            [a, b]
        })
        .collect();
    let routing = Routing::new(choice.clone(), l, e, k).unwrap();
    let n = l * k;
    let (x, w, ye, dout) = (r.vec(l * c, 1.0), r.vec(l * k, 1.0), r.vec(n * c, 1.0), r.vec(l * c, 1.0));
    let cpu = CpuBackend::new();
    let (xt, wt, yt, gt) = (to_t::<f32>(&x), to_t::<f32>(&w), to_t::<f32>(&ye), to_t::<f32>(&dout));
    // Gather: rows grouped by expert, in token order within an expert.
    let mut xe = poisoned::<f32>(n * c);
    cpu.moe_gather_forward(view_mut(&mut xe, [n, c]), view(&xt, [l, c]), &routing).unwrap();
    let mut want = vec![];
    let mut row_of = vec![0usize; l * k];
    for ex in 0..e as u32 {
        for t in 0..l {
            for j in 0..k {
                if choice[t * k + j] == ex {
                    row_of[t * k + j] = want.len() / c;
                    want.extend_from_slice(&x[t * c..(t + 1) * c]);
                }
            }
        }
    }
    assert_close("xe", &xe, &want);
    // Gather backward is its adjoint: ⟨gather(x), g⟩ = ⟨x, gatherᵀ(g)⟩.
    let mut dx = poisoned::<f32>(l * c);
    cpu.moe_gather_backward(view_mut(&mut dx, [l, c]), view(&yt, [n, c]), &routing).unwrap();
    assert!((dot(&to_f64(&xe), &ye) - dot(&x, &to_f64(&dx))).abs() < 1e-4);
    // Combine: out[t] = Σ_j w[t,j]·ye[row(t,j)].
    let mut out = poisoned::<f32>(l * c);
    cpu.moe_combine_forward(view_mut(&mut out, [l, c]), view(&yt, [n, c]), view(&wt, [l, k]), &routing).unwrap();
    let mut want = vec![0.0; l * c];
    for t in 0..l {
        for j in 0..k {
            for i in 0..c {
                want[t * c + i] += w[t * k + j] * ye[row_of[t * k + j] * c + i];
            }
        }
    }
    assert_close("combine", &out, &want);
    // Its backward: finite differences of J = ⟨dout, combine(ye, w)⟩ (bilinear, so exact up to round-off).
    let (mut dye, mut dw) = (poisoned::<f32>(n * c), poisoned::<f32>(l * k));
    let saved = MoeCombineSaved { ye: view(&yt, [n, c]), weights: view(&wt, [l, k]), routing: &routing };
    cpu.moe_combine_backward(view_mut(&mut dye, [n, c]), view_mut(&mut dw, [l, k]), view(&gt, [l, c]), saved).unwrap();
    let j = |ye: &[f64], w: &[f64]| -> f64 {
        let mut s = 0.0;
        for t in 0..l {
            for jj in 0..k {
                for i in 0..c {
                    s += dout[t * c + i] * w[t * k + jj] * ye[row_of[t * k + jj] * c + i];
                }
            }
        }
        s
    };
    assert_fd("dye", &fd_grad(|v| j(v, &w), &ye, 1e-6), &to_f64(&dye), 1e-6);
    assert_fd("dweights", &fd_grad(|v| j(&ye, v), &w, 1e-6), &to_f64(&dw), 1e-6);
}

#[test]
fn routing_does_not_depend_on_which_tokens_share_the_call() {
    // A context-parallel rank routes its tokens exactly as the whole sequence would.
    let (l, e, k, c) = (40, 4, 2, 8);
    let mut r = DataRng::new(3);
    let (logits, ye) = (to_t::<f32>(&r.vec(l * e, 2.0)), to_t::<f32>(&r.vec(l * k * c, 1.0)));
    let cpu = CpuBackend::new();
    let route = |x: &[f32], l: usize| {
        let (mut p, mut w) = (vec![0f32; l * e], vec![0f32; l * k]);
        let out =
            cpu.moe_router_forward(view_mut(&mut p, [l, e]), view_mut(&mut w, [l, k]), view(x, [l, e]), k).unwrap();
        (p, w, out.routing)
    };
    let (p, w, whole) = route(&logits, l);
    let (p2, w2, half) = route(&logits[l / 2 * e..], l / 2);
    assert_eq!(bits(&p[l / 2 * e..]), bits(&p2));
    assert_eq!(bits(&w[l / 2 * k..]), bits(&w2));
    assert_eq!(&whole.choice()[l / 2 * k..], half.choice());
    // Each token's combine sums its own rows in expert order: the same bits for the half as for the whole.
    let mut ye_half = vec![0f32; l / 2 * k * c];
    for (n, &t) in whole.row_tokens().iter().enumerate() {
        if t as usize >= l / 2 {
            let ex = whole.offsets().iter().rposition(|&o| o <= n).unwrap_or(0);
            let within = n - whole.offsets()[ex];
            let before = whole.row_tokens()[whole.offsets()[ex]..n].iter().filter(|&&u| (u as usize) < l / 2).count();
            let m = half.offsets()[ex] + within - before;
            ye_half[m * c..(m + 1) * c].copy_from_slice(&ye[n * c..(n + 1) * c]);
        }
    }
    let (mut a, mut b) = (vec![0f32; l * c], vec![0f32; l / 2 * c]);
    cpu.moe_combine_forward(view_mut(&mut a, [l, c]), view(&ye, [l * k, c]), view(&w, [l, k]), &whole).unwrap();
    cpu.moe_combine_forward(view_mut(&mut b, [l / 2, c]), view(&ye_half, [l / 2 * k, c]), view(&w2, [l / 2, k]), &half)
        .unwrap();
    assert_eq!(bits(&a[l / 2 * c..]), bits(&b));
}

#[test]
fn bad_shapes_and_arguments_are_typed_errors() {
    let cpu = CpuBackend::new();
    let x = vec![0f32; 12];
    let (mut p, mut w) = (vec![0f32; 12], vec![0f32; 20]);
    let e = cpu.moe_router_forward(view_mut(&mut p, [4, 3]), view_mut(&mut w, [4, 5]), view(&x, [4, 3]), 5);
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "top_k", .. })), "{e:?}");
    let e = cpu.moe_router_forward(view_mut(&mut p, [4, 3]), view_mut(&mut w[..8], [4, 2]), view(&x, [3, 4]), 2);
    assert!(matches!(e, Err(KernelError::Shape(_))), "{e:?}");
    assert!(matches!(Routing::new(vec![0, 0], 1, 3, 2), Err(KernelError::InvalidArgument { name: "choice", .. })));
    assert!(matches!(Routing::new(vec![0, 3], 1, 3, 2), Err(KernelError::InvalidArgument { name: "choice", .. })));
    let routing = Routing::new(vec![0, 1, 1, 2], 2, 3, 2).unwrap();
    let mut xe = vec![0f32; 4 * 3];
    let e = cpu.moe_gather_forward(view_mut(&mut xe, [4, 3]), view(&x, [3, 4]), &routing);
    assert!(matches!(e, Err(KernelError::Shape(_))), "{e:?}");
}
