//! `budget(bytes)`: the per-tensor actions that add the least time while the peak activation memory stays
//! within the budget.
//!
//! Per layer the problem is solved exactly: every choice of which segments to rerun and which kept tensors to
//! offload is enumerated (a layer has a handful of segments and at most a few dozen saved tensors; the
//! enumeration is capped, see [`MAX_CHOICES`]) and reduced to those no other choice beats on resident bytes,
//! rebuilt working set, offloaded bytes and added time at once. Across the `L` identical layers the solver
//! then picks how many layers take each of two such choices and which of the two goes below (`n` layers one
//! way at the bottom, `L − n` the other above them), which is the optimum of the problem's linear relaxation
//! (an optimum uses at most two adjacent points of the per-layer trade-off) and within one layer's step of the
//! integer optimum. The order matters because the backward frees each layer's kept tensors as it goes down
//! ([`crate::cost`]): a choice that rebuilds much and keeps little costs least at the bottom, where the layers
//! above have freed theirs; for two choices, one block of each is the best order of all interleavings (the
//! top layer always sees everything kept, so only the block below can lower the peak). Layers are not chained
//! into multi-layer checkpoints (`uniform` does that), because a rebuilt chunk's working set grows with its
//! length and the per-layer choices already reach full recomputation's memory.

use crate::action::{Action, LayerActions};
use crate::cost::{layer_cost, plan_cost, Costs, PlanCost};
use crate::error::{RecomputeError, Result};
use crate::layer::LayerSpec;

/// Per-layer choices enumerated at most: `3^segments × 2` (each segment's outputs kept, recomputed or
/// offloaded; the input kept or offloaded).
pub const MAX_CHOICES: usize = 1 << 20;

/// What the solver chose.
#[derive(Debug, Clone, PartialEq)]
pub struct Solution {
    /// One entry per layer.
    pub layers: Vec<LayerActions>,
    /// What it costs.
    pub cost: PlanCost,
}

/// One candidate per-layer choice with its costs.
#[derive(Debug, Clone)]
pub(crate) struct Candidate {
    pub actions: LayerActions,
    pub resident: u64,
    /// Rebuilt and fetched bytes plus the backward's working set.
    pub working: u64,
    /// Bytes fetched back, which the layer above's backward prefetches.
    pub offloaded: u64,
    pub seconds: f64,
}

/// Every per-layer choice (see [`choices`]) that no other choice dominates.
pub(crate) fn frontier(spec: &LayerSpec, costs: &Costs) -> Result<Vec<Candidate>> {
    let mut all: Vec<Candidate> = choices(spec, costs)?
        .into_iter()
        .map(|actions| {
            let c = layer_cost(spec, &actions, costs);
            Candidate {
                resident: c.resident_bytes,
                working: c.recomputed_bytes + c.offloaded_bytes + spec.backward_working_bytes,
                offloaded: c.offloaded_bytes,
                seconds: c.added_seconds,
                actions,
            }
        })
        .collect();
    all.sort_by(|a, b| {
        a.resident
            .cmp(&b.resident)
            .then(a.working.cmp(&b.working))
            .then(a.offloaded.cmp(&b.offloaded))
            .then(a.seconds.total_cmp(&b.seconds))
    });
    let mut keep: Vec<Candidate> = Vec::new();
    for c in all {
        let dominated = keep.iter().any(|k| {
            k.resident <= c.resident && k.working <= c.working && k.offloaded <= c.offloaded && k.seconds <= c.seconds
        });
        if !dominated {
            keep.push(c);
        }
    }
    Ok(keep)
}

/// The per-layer choices the solver searches: each segment's outputs kept, recomputed or (with an offload
/// tier) offloaded together, and the input kept or offloaded. Offload is decided per segment because its
/// outputs are made together and move as one transfer.
pub fn choices(spec: &LayerSpec, costs: &Costs) -> Result<Vec<LayerActions>> {
    let segs: Vec<usize> = (0..spec.segments.len()).filter(|&i| !spec.segments[i].outputs.is_empty()).collect();
    let ways: usize = if costs.offload_bytes_per_s > 0.0 { 3 } else { 2 };
    let total = ways.checked_pow(segs.len() as u32).and_then(|n| n.checked_mul(ways - 1)).unwrap_or(usize::MAX);
    if total > MAX_CHOICES {
        return Err(RecomputeError::Layer(format!("{} segments are too many to enumerate exactly", segs.len())));
    }
    let mut out = Vec::with_capacity(total);
    for code in 0..total {
        let mut a = LayerActions::default();
        let mut rest = code;
        for &si in &segs {
            let act = match rest % ways {
                0 => Action::Keep,
                1 => Action::Recompute,
                _ => Action::Offload,
            };
            rest /= ways;
            for o in &spec.segments[si].outputs {
                if act != Action::Keep {
                    a.set(&o.name, act);
                }
            }
        }
        if rest % (ways - 1) == 1 {
            a.set(&spec.input.name, Action::Offload);
        }
        out.push(a);
    }
    Ok(out)
}

/// The peak of `n` layers taking `a` below `m` layers taking `b`: the largest of [`crate::cost`]'s per-layer
/// sums is at the top of each block, or at the first layer of the upper block (which prefetches the lower
/// block's offloaded tensors).
fn stacked_peak(a: &Candidate, n: u64, b: &Candidate, m: u64) -> u64 {
    let mut peak = 0;
    if n > 0 {
        peak = n * a.resident + a.working + if n >= 2 { a.offloaded } else { 0 };
    }
    if m > 0 {
        let below = n * a.resident;
        peak = peak.max(below + b.resident + b.working + if n > 0 { a.offloaded } else { 0 });
        if m >= 2 {
            peak = peak.max(below + m * b.resident + b.working + b.offloaded);
        }
    }
    peak
}

/// The cheapest plan for `layers` layers of `spec` within `budget` bytes of peak activation memory.
pub fn solve(spec: &LayerSpec, layers: usize, budget: u64, costs: &Costs) -> Result<Solution> {
    solve_within(spec, layers, budget, u64::MAX, costs)
}

/// [`solve`] with the offload tier holding at most `offload_room` bytes of all layers' offloaded tensors at
/// once (a device's share of host memory; the tensors of every layer are out together at the end of the
/// forward).
pub fn solve_within(
    spec: &LayerSpec,
    layers: usize,
    budget: u64,
    offload_room: u64,
    costs: &Costs,
) -> Result<Solution> {
    spec.validate()?;
    let f = frontier(spec, costs)?;
    let l = layers as u64;
    let mut best: Option<(f64, u64, usize, usize, u64)> = None;
    let mut least = u64::MAX;
    // `n` layers take `f[i]` at the bottom, the other `l − n` take `f[j]` above them; both orders of a pair.
    // Among plans of the same time, the one that offloads least: a transfer hidden under compute is free in
    // time, not in host memory or link traffic.
    for (i, a) in f.iter().enumerate() {
        for (j, b) in f.iter().enumerate() {
            for n in 0..=l {
                let offloaded = n * a.offloaded + (l - n) * b.offloaded;
                if offloaded > offload_room {
                    continue;
                }
                let peak = stacked_peak(a, n, b, l - n);
                least = least.min(peak);
                if peak > budget {
                    continue;
                }
                let t = n as f64 * a.seconds + (l - n) as f64 * b.seconds;
                let better = |(bt, bo, ..): (f64, u64, usize, usize, u64)| {
                    t < bt - 1e-15 * bt.max(1.0) || (t <= bt + 1e-15 * bt.max(1.0) && offloaded < bo)
                };
                if best.is_none_or(better) {
                    best = Some((t, offloaded, i, j, n));
                }
            }
        }
    }
    let Some((_, _, i, j, n)) = best else {
        let keep_all = plan_cost(spec, &vec![LayerActions::keep_all(); layers], costs).peak_bytes;
        return Err(RecomputeError::Budget {
            budget,
            minimum: least,
            why: format!(
                "{layers} layers keeping only their inputs{}, plus one layer's rebuilt tensors and backward working set",
                if costs.offload_bytes_per_s > 0.0 { " or offloading them" } else { "" }
            ),
            fix: format!(
                "raise the budget by {} bytes, or split the sequence over more context-parallel ranks (keeping everything needs {keep_all})",
                least - budget
            ),
        });
    };
    let mut plan = vec![f[i].actions.clone(); n as usize];
    plan.extend(std::iter::repeat_n(f[j].actions.clone(), layers - n as usize));
    let cost = plan_cost(spec, &plan, costs);
    Ok(Solution { layers: plan, cost })
}
