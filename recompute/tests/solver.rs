//! The budget solver against brute force on small random layers; more budget never costs more time; the
//! built-in policies' byte counts on Llama 3 8B's layer, computed by hand; bad input is a typed error.

use longctx_recompute::solver::choices;
use longctx_recompute::{
    llama_layer, plan_cost, solve, Action, Costs, LayerActions, LayerSpec, LlamaLayerShape, Policy, RecomputeError,
    SavedTensor, Segment,
};
use proptest::prelude::*;

fn random_spec(sizes: &[(u64, u64, f64)], input: u64, working: u64) -> LayerSpec {
    // A chain: segment i reads the previous segment's first output (or the input) and saves one or two tensors.
    let mut segments = Vec::new();
    let mut prev = "x".to_string();
    for (i, &(a, b, flops)) in sizes.iter().enumerate() {
        let mut outputs = vec![SavedTensor { name: format!("t{i}a"), bytes: a }];
        if b > 0 {
            outputs.push(SavedTensor { name: format!("t{i}b"), bytes: b });
        }
        segments.push(Segment {
            name: format!("s{i}"),
            module: if i % 2 == 0 { "norm".into() } else { "mlp".into() },
            flops,
            inputs: vec![prev.clone()],
            outputs,
        });
        prev = format!("t{i}a");
    }
    LayerSpec { input: SavedTensor { name: "x".into(), bytes: input }, segments, backward_working_bytes: working }
}

/// The least added time over every assignment of per-layer choices to `layers` layers within `budget`, and
/// the fewest bytes offloaded at that time.
fn brute_force(spec: &LayerSpec, layers: usize, budget: u64, costs: &Costs) -> Option<(f64, u64)> {
    let c = choices(spec, costs).unwrap();
    let mut best: Option<(f64, u64)> = None;
    let mut idx = vec![0usize; layers];
    loop {
        let plan: Vec<LayerActions> = idx.iter().map(|&i| c[i].clone()).collect();
        let p = plan_cost(spec, &plan, costs);
        let better = |(t, off): (f64, u64)| {
            let tol = 1e-12 * t.max(1.0);
            p.added_seconds < t - tol || (p.added_seconds <= t + tol && p.offloaded_bytes < off)
        };
        if p.peak_bytes <= budget && best.is_none_or(better) {
            best = Some((p.added_seconds, p.offloaded_bytes));
        }
        let mut k = 0;
        loop {
            if k == layers {
                return best;
            }
            idx[k] += 1;
            if idx[k] < c.len() {
                break;
            }
            idx[k] = 0;
            k += 1;
        }
    }
}

fn layer_strategy() -> impl Strategy<Value = (Vec<(u64, u64, f64)>, u64, u64)> {
    (prop::collection::vec((1u64..1000, 0u64..1000, 0.0f64..1e6), 1..4), 1u64..1000, 0u64..500)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn the_solver_finds_the_brute_force_optimum(
        (sizes, input, working) in layer_strategy(),
        layers in 1usize..3,
        offload in any::<bool>(),
        frac in 0.0f64..1.2,
    ) {
        let spec = random_spec(&sizes, input, working);
        let costs = Costs { flops_per_s: 1e6, offload_bytes_per_s: if offload { 1e3 } else { 0.0 } };
        let all = plan_cost(&spec, &vec![LayerActions::keep_all(); layers], &costs).peak_bytes;
        let budget = (all as f64 * frac) as u64;
        let bf = brute_force(&spec, layers, budget, &costs);
        match solve(&spec, layers, budget, &costs) {
            Ok(s) => {
                let (bf, off) = bf.expect("brute force finds a plan too");
                prop_assert!(s.cost.peak_bytes <= budget);
                prop_assert!((s.cost.added_seconds - bf).abs() <= 1e-9 * bf.max(1.0), "solver {} brute {}", s.cost.added_seconds, bf);
                // Of the plans that take the least time, one that offloads least.
                prop_assert_eq!(s.cost.offloaded_bytes, off);
            }
            Err(RecomputeError::Budget { minimum, .. }) => {
                prop_assert!(bf.is_none(), "brute force fits in {budget} but the solver says the minimum is {minimum}");
                prop_assert!(minimum > budget);
            }
            Err(e) => prop_assert!(false, "{e}"),
        }
    }

    #[test]
    fn more_budget_never_costs_more_time(
        (sizes, input, working) in layer_strategy(),
        layers in 1usize..8,
        offload in any::<bool>(),
        a in 0.0f64..1.2,
        b in 0.0f64..1.2,
    ) {
        let spec = random_spec(&sizes, input, working);
        let costs = Costs { flops_per_s: 1e6, offload_bytes_per_s: if offload { 1e3 } else { 0.0 } };
        let all = plan_cost(&spec, &vec![LayerActions::keep_all(); layers], &costs).peak_bytes as f64;
        let (lo, hi) = if a < b { (a, b) } else { (b, a) };
        if let Ok(small) = solve(&spec, layers, (all * lo) as u64, &costs) {
            let big = solve(&spec, layers, (all * hi) as u64, &costs).unwrap();
            prop_assert!(big.cost.added_seconds <= small.cost.added_seconds + 1e-12);
        }
    }
}

fn llama3_8b(tokens: u64) -> LayerSpec {
    llama_layer(&LlamaLayerShape {
        tokens,
        seq_len: tokens,
        d_model: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        ffn: 14336,
        elem_bytes: 2,
        seq_shard: 1,
    })
}

#[test]
fn full_and_none_match_hand_computed_bytes_for_the_llama3_8b_layer() {
    // Per token, bf16: x, h1, q, o, x2, h2 are 4096 × 2 B; k, v 1024 × 2 B; gate, up, act 14336 × 2 B; the two
    // rstd 4 B each; lse 32 heads × 4 B.
    let per_token = 6 * 8192 + 2 * 2048 + 3 * 28672 + 8 + 128;
    assert_eq!(per_token, 139_400);
    let spec = llama3_8b(8192);
    let costs = Costs { flops_per_s: 1e15, offload_bytes_per_s: 0.0 };
    let resolve = |p: &str| plan_cost(&spec, &p.parse::<Policy>().unwrap().resolve(&spec, 32, &costs).unwrap(), &costs);
    assert_eq!(resolve("none").resident_bytes, 32 * 8192 * per_token);
    assert_eq!(resolve("full").resident_bytes, 32 * 8192 * 8192);
    // Full recompute reruns everything but the down projection (its output is the next layer's input).
    let fwd = spec.forward_flops();
    let down = 2.0 * 8192.0 * 14336.0 * 4096.0 + 8192.0 * 4096.0;
    assert!((resolve("full").recompute_flops - 32.0 * (fwd - down)).abs() < 1.0);
    // Selective (norms, the SwiGLU output, the attention projections) drops h1, h2, act, the two rstd, q, k, v
    // and x2: 47% of the bytes.
    let dropped = 2 * 8192 + 28672 + 8 + 8192 + 2 * 2048 + 8192;
    assert_eq!(resolve("selective").resident_bytes, 32 * 8192 * (per_token - dropped));
    assert!(dropped as f64 / per_token as f64 > 0.4);
    let extra = resolve("selective").recompute_flops / (32.0 * 3.0 * spec.forward_flops());
    assert!(extra < 0.1, "selective reruns {:.1}% of a step's FLOPs", 100.0 * extra);
    assert_eq!(resolve("block:8").resident_bytes, 8 * 8192 * 8192 + 24 * 8192 * per_token);
    let u = resolve("uniform:4");
    assert_eq!(u.resident_bytes, 8 * 8192 * 8192);
    assert!(u.peak_bytes > resolve("full").peak_bytes, "a 4-layer chunk is rebuilt at once");
    // The peak is inside one layer's backward, with the kept tensors of that layer and those below it (the
    // backward frees each layer's as it goes down). Keeping everything: the top layer's, all 32 layers kept.
    let working = spec.backward_working_bytes;
    assert_eq!(resolve("none").peak_bytes, 32 * 8192 * per_token + working);
    // Full: the top layer rebuilds all it saves but its input, beside the 32 inputs.
    assert_eq!(resolve("full").peak_bytes, 32 * 8192 * 8192 + 8192 * (per_token - 8192) + working);
    // block:8 rebuilds the first 8 layers only after the 24 kept ones above have been freed: the peak is the
    // top layer's, not the kept tensors plus a rebuild.
    assert_eq!(resolve("block:8").peak_bytes, resolve("block:8").resident_bytes + working);
    // block:31 leaves one kept layer above 31 rebuilt ones: the peak is layer 30's rebuild over 31 inputs.
    let b31 = resolve("block:31");
    assert_eq!(
        b31.peak_bytes,
        (31 * 8192 * 8192 + 8192 * (per_token - 8192) + working).max(b31.resident_bytes + working)
    );
}

#[test]
fn the_solver_puts_the_layers_that_rebuild_most_at_the_bottom() {
    // Two layers, a budget between "keep both" and "rebuild both": one layer rebuilds, and it goes below the
    // kept one, whose tensors are freed before the rebuild; above, the rebuild would sit beside them.
    let spec = random_spec(&[(100, 0, 1e3)], 10, 5);
    let costs = Costs { flops_per_s: 1e6, offload_bytes_per_s: 0.0 };
    // keep both: 220 + 5; rebuild both: 20 + 100 + 5; one of each: bottom rebuilds 10 + 100 + 5 = 115 then the
    // top 10 + 110 + 5 = 125; the other way 110 + 10 + 100 + 5 = 225.
    let s = solve(&spec, 2, 130, &costs).unwrap();
    assert_eq!(s.cost.peak_bytes, 125);
    assert_eq!(s.layers[0].of("t0a"), Action::Recompute);
    assert_eq!(s.layers[1].of("t0a"), Action::Keep);
    let flipped = plan_cost(&spec, &[s.layers[1].clone(), s.layers[0].clone()], &costs);
    assert_eq!(flipped.peak_bytes, 225);
    // Offloaded tensors come back during the backward of the layer above: with one layer of prefetch, the top
    // layer's backward holds the layer below's fetched tensors too.
    let costs = Costs { flops_per_s: 1e6, offload_bytes_per_s: 1e3 };
    let mut off = LayerActions::default();
    off.set("t0a", Action::Offload);
    let p = plan_cost(&spec, &[off.clone(), off], &costs);
    assert_eq!(p.peak_bytes, 20 + 100 + 100 + 5);
}

#[test]
fn the_budget_policy_is_never_slower_than_a_builtin_policy_that_fits() {
    let spec = llama3_8b(16384);
    let costs = Costs { flops_per_s: 400e12, offload_bytes_per_s: 20e9 };
    for p in ["none", "full", "selective", "selective:core_attn", "selective:mlp,norm", "block:4", "block:16"] {
        let plan = p.parse::<Policy>().unwrap().resolve(&spec, 32, &costs).unwrap();
        let c = plan_cost(&spec, &plan, &costs);
        let b = solve(&spec, 32, c.peak_bytes, &costs).unwrap();
        assert!(
            b.cost.added_seconds <= c.added_seconds + 1e-12,
            "{p}: budget {} vs {}",
            b.cost.added_seconds,
            c.added_seconds
        );
        assert!(b.cost.peak_bytes <= c.peak_bytes);
    }
}

#[test]
fn bad_policies_and_budgets_are_typed_errors_that_say_what_fits() {
    for bad in ["sometimes", "uniform:0", "uniform:x", "block", "budget:lots", "custom:q=maybe"] {
        assert!(matches!(bad.parse::<Policy>(), Err(RecomputeError::Policy { .. })), "{bad}");
    }
    let spec = llama3_8b(4096);
    let costs = Costs { flops_per_s: 1e15, offload_bytes_per_s: 0.0 };
    let e = "selective:moe".parse::<Policy>().unwrap().resolve(&spec, 2, &costs).unwrap_err();
    assert!(e.to_string().contains("moe"), "{e}");
    let e = "custom:nonsense=recompute".parse::<Policy>().unwrap().resolve(&spec, 2, &costs).unwrap_err();
    assert!(matches!(e, RecomputeError::Action { .. }), "{e}");
    match solve(&spec, 32, 1000, &costs) {
        Err(RecomputeError::Budget { minimum, fix, .. }) => {
            assert!(minimum > 32 * 4096 * 8192, "{minimum}");
            assert!(fix.contains("raise the budget"), "{fix}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!("budget:4GiB".parse::<Policy>().unwrap(), Policy::Budget(4 << 30));
    assert_eq!(
        "custom:q=offload,act=recompute".parse::<Policy>().unwrap().resolve(&spec, 1, &costs).unwrap()[0].of("act"),
        Action::Recompute
    );
}
