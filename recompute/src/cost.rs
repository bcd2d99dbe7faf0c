//! What a choice of actions costs: the bytes that stay resident, the peak during the backward, and the time
//! it adds to a step.
//!
//! Memory model: every layer's kept tensors stay resident from its forward to the end of its backward, which
//! frees them; the backward runs from the last layer down, so while layer `l`'s backward runs, the kept
//! tensors of layers `0..=l` are resident and those above it are gone. Present with them: what layer `l`
//! recomputed or fetched back, its backward's own working set, and the offloaded tensors of layer `l − 1`,
//! coming back during `l`'s backward (one layer of prefetch, as the time model below assumes). A layer whose
//! input is recomputed (`uniform`) is rebuilt together with the layers before it back to the chunk's first
//! layer, so the whole chunk's tensors are present at once. The peak is the largest of these sums over the
//! layers: the top layer's (everything kept, plus its working set) or a lower layer's whose rebuilt tensors
//! outweigh what the layers above it have already freed (`block:N`'s recomputed first layers).
//!
//! Time model: recomputation adds its segments' FLOPs at `flops_per_s`; an offloaded tensor travels out during
//! the layer's forward and back during the layer before's backward, so only the transfer time beyond that
//! compute (the forward's, and twice that for the backward) is added.

use serde::{Deserialize, Serialize};

use crate::action::{Action, LayerActions};
use crate::layer::LayerSpec;

/// The machine's rates.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Costs {
    /// Sustained FLOP/s of the layer's kernels.
    pub flops_per_s: f64,
    /// Offload bandwidth each way, bytes per second (0: no offload tier; the solver never offloads).
    pub offload_bytes_per_s: f64,
}

/// What one layer's actions cost.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct LayerCost {
    /// Bytes kept from the forward to the backward.
    pub resident_bytes: u64,
    /// Bytes moved out and back.
    pub offloaded_bytes: u64,
    /// Bytes regenerated before the backward.
    pub recomputed_bytes: u64,
    /// FLOPs rerun.
    pub recompute_flops: f64,
    /// Seconds of transfer not hidden under the layer's compute (part of `added_seconds`).
    pub offload_seconds: f64,
    /// Seconds added to the step.
    pub added_seconds: f64,
}

/// What a whole plan costs.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct PlanCost {
    /// Bytes resident over all layers between their forward and backward.
    pub resident_bytes: u64,
    /// Peak activation bytes during the backward: the largest, over the layers, of the kept bytes of that layer
    /// and those below it, plus its rebuilt or fetched tensors, its working set and the layer below's prefetch.
    pub peak_bytes: u64,
    /// FLOPs rerun over all layers.
    pub recompute_flops: f64,
    /// Bytes offloaded over all layers.
    pub offloaded_bytes: u64,
    /// Seconds of offload transfer not hidden under compute (part of `added_seconds`).
    pub offload_seconds: f64,
    /// Seconds added to a step.
    pub added_seconds: f64,
}

/// The cost of one layer's actions (the rerun of earlier layers in a `uniform` chunk is charged to the
/// layers whose tensors it regenerates, except their output, charged here).
pub fn layer_cost(spec: &LayerSpec, a: &LayerActions, costs: &Costs) -> LayerCost {
    let mut c = LayerCost::default();
    for t in spec.tensors() {
        match a.of(&t.name) {
            Action::Keep => c.resident_bytes += t.bytes,
            Action::Offload => c.offloaded_bytes += t.bytes,
            Action::Recompute => c.recomputed_bytes += t.bytes,
        }
    }
    for s in &spec.segments {
        if s.outputs.iter().any(|o| a.of(&o.name) == Action::Recompute) {
            c.recompute_flops += s.flops;
        }
    }
    if a.of(&spec.input.name) == Action::Recompute {
        // The layer before reruns its segments that save nothing here (they made this input).
        c.recompute_flops += spec.segments.iter().filter(|s| s.outputs.is_empty()).map(|s| s.flops).sum::<f64>();
    }
    let fwd = spec.forward_flops() / costs.flops_per_s;
    c.added_seconds = c.recompute_flops / costs.flops_per_s;
    if c.offloaded_bytes > 0 {
        let t = if costs.offload_bytes_per_s > 0.0 {
            c.offloaded_bytes as f64 / costs.offload_bytes_per_s
        } else {
            f64::INFINITY
        };
        c.offload_seconds = (t - fwd).max(0.0) + (t - 2.0 * fwd).max(0.0);
        c.added_seconds += c.offload_seconds;
    }
    c
}

/// The cost of `plan` (one entry per layer).
pub fn plan_cost(spec: &LayerSpec, plan: &[LayerActions], costs: &Costs) -> PlanCost {
    let per: Vec<LayerCost> = plan.iter().map(|a| layer_cost(spec, a, costs)).collect();
    let mut p = PlanCost::default();
    for c in &per {
        p.resident_bytes += c.resident_bytes;
        p.recompute_flops += c.recompute_flops;
        p.offloaded_bytes += c.offloaded_bytes;
        p.offload_seconds += c.offload_seconds;
        p.added_seconds += c.added_seconds;
    }
    // Rebuild groups: a layer whose input is recomputed joins the group of the layer before it, whose tensors
    // (fetched ones included) are then already present; otherwise the layer below's offloaded tensors are
    // coming back.
    let mut worst = 0u64;
    let mut group = 0u64;
    let mut kept_below = 0u64;
    for (l, c) in per.iter().enumerate() {
        let joins = l > 0 && plan[l].of(&spec.input.name) == Action::Recompute;
        let here = c.recomputed_bytes + c.offloaded_bytes;
        group = if joins { group + here } else { here };
        let prefetch = if l > 0 && !joins { per[l - 1].offloaded_bytes } else { 0 };
        kept_below += c.resident_bytes;
        worst = worst.max(kept_below + group + prefetch + spec.backward_working_bytes);
    }
    p.peak_bytes = worst;
    p
}
