//! The planner behind `longctx plan`: per-device memory and step time of a model at a sequence length under a
//! parallel layout and a recompute policy, and the cheapest policy that fits.
//!
//! # Memory (per device, bytes)
//! - Weights `2·P/(TP·PP)` (bf16); gradients `4·P/(TP·PP)` (f32 accumulation, as Megatron's `main_grad`);
//!   optimizer `12·P/(TP·PP)` (f32 master, Adam's two moments), divided by `DP·CP` with the distributed
//!   optimizer (NeMo shards it over both).
//! - Activations: one layer's saved tensors ([`crate::llama_layer`], [`crate::models::nemotron_layer`]; MoE as
//!   the routed tokens' MLP, `top_k·ffn` wide) with `S/CP` tokens, heads and MLP divided by TP, the norm-side
//!   tensors also by TP with sequence parallelism; times `layers/PP`; the first pipeline stage holds `PP`
//!   micro-batches in flight under 1F1B. The policy decides what stays ([`crate::plan_cost`]).
//! - The loss's working set: chunked cross-entropy's `chunk × V/TP` f32 logits and their gradient.
//! - Communication buffers: the ring's three KV blocks on a device (in hand, arriving, and the one the step before
//!   computed on, so the compute queue never drains) and its dK/dV accumulators (f32).
//! - With `offload`, the solver may also move saved tensors to host memory over the device's host link
//!   ([`Device::host_bytes_per_s`]); what is out at the end of the forward (every layer's offloaded tensors,
//!   times the micro-batches in flight) must fit the device's share of host memory
//!   ([`Device::host_memory_bytes`]), and is reported beside device memory, not in it.
//!
//! # Time (per step)
//! Compute is the model's FLOPs ([`ModelDesc::flops_per_token`]) plus recomputation, at `efficiency` of the
//! device's peak; the ring adds, per layer and ring step, whatever its block transfer takes beyond the block's
//! attention compute (forward sends K/V, backward K/V and dK/dV); tensor parallelism adds its all-gathers and
//! reduce-scatters (4 per layer forward, 4 backward, over NVLink, not overlapped); the pipeline adds its
//! bubble `(PP−1)/(m+PP−1)`. Data-parallel gradient reduction is taken as overlapped with the backward.
//! Offload adds, per layer, whatever its transfer out takes beyond the layer's forward and its transfer back
//! beyond the backward of the layer above ([`crate::cost`]); at long context a layer's attention hides it.

use serde::{Deserialize, Serialize};

use crate::cost::{plan_cost, Costs, PlanCost};
use crate::error::{RecomputeError, Result};
use crate::layer::{llama_layer, LayerSpec, LlamaLayerShape, SavedTensor, Segment};
use crate::models::{nemotron_layer, Device, Mlp, ModelDesc};
use crate::policy::Policy;
use crate::solver::solve_within;

/// How the devices are arranged.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    /// Devices in all.
    pub gpus: u64,
    /// Tensor parallelism.
    pub tp: u64,
    /// Context parallelism.
    pub cp: u64,
    /// Pipeline parallelism.
    pub pp: u64,
    /// Sequence parallelism (norm-side activations sharded over TP).
    pub sequence_parallel: bool,
    /// Optimizer state sharded over data- and context-parallel ranks.
    pub distributed_optimizer: bool,
    /// Sequences per step over all data-parallel ranks.
    pub global_batch: u64,
}

impl Layout {
    /// Data-parallel ranks: what is left of the devices.
    pub fn dp(&self) -> u64 {
        self.gpus / (self.tp * self.cp * self.pp).max(1)
    }
}

/// What to plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanInput {
    /// The model.
    pub model: ModelDesc,
    /// The device.
    pub device: Device,
    /// The layout.
    pub layout: Layout,
    /// Tokens per sequence.
    pub seq_len: u64,
    /// The policy (`None`: the cheapest that fits).
    pub policy: Option<Policy>,
    /// Fraction of peak the kernels sustain.
    pub efficiency: f64,
    /// Use the device's FP8 peak for the matrix products (NeMo's published tables are FP8).
    pub fp8: bool,
    /// Tokens per chunk of the loss.
    pub loss_chunk: u64,
    /// Let the policy move saved tensors to host memory (the solver weighs it against recomputation).
    #[serde(default)]
    pub offload: bool,
}

/// Memory per device, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    /// Weights.
    pub weights: u64,
    /// Gradients.
    pub gradients: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Saved activations at peak (all layers of the stage, micro-batches in flight, the rebuilt working set).
    pub activations: u64,
    /// Saved activations of one layer under the policy.
    pub activations_per_layer: u64,
    /// The loss's working set.
    pub loss: u64,
    /// Communication buffers.
    pub comm: u64,
    /// The sum.
    pub total: u64,
    /// Saved activations in host memory at the end of the forward (not part of `total`).
    #[serde(default)]
    pub host_offload: u64,
}

/// Predicted step time.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct TimeEstimate {
    /// Seconds per step.
    pub step_seconds: f64,
    /// Model TFLOP/s per device (recomputation not counted as useful work).
    pub tflops_per_device: f64,
    /// Of which: compute.
    pub compute_seconds: f64,
    /// Recomputation.
    pub recompute_seconds: f64,
    /// Offload transfers not hidden under the layers' compute.
    #[serde(default)]
    pub offload_exposed_seconds: f64,
    /// The ring's transfer not hidden under attention.
    pub ring_exposed_seconds: f64,
    /// Tensor-parallel collectives.
    pub tp_seconds: f64,
    /// Pipeline bubble.
    pub bubble_seconds: f64,
}

/// What the planner found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanReport {
    /// The input.
    pub input: PlanInput,
    /// The policy used (the one given, or the cheapest that fits).
    pub policy: String,
    /// Memory.
    pub memory: MemoryBreakdown,
    /// Whether it fits the device.
    pub fits: bool,
    /// Time.
    pub time: TimeEstimate,
}

fn plan_err(what: &str, why: String, fix: String) -> RecomputeError {
    RecomputeError::Plan { what: what.into(), why, fix }
}

/// One layer of `m` on one device of `layout` at `seq` tokens, bf16.
pub fn layer_for(m: &ModelDesc, layout: &Layout, seq: u64) -> LayerSpec {
    let shape = LlamaLayerShape {
        tokens: seq / layout.cp,
        seq_len: seq,
        d_model: m.d_model,
        heads: m.heads / layout.tp,
        kv_heads: (m.kv_heads / layout.tp).max(1),
        head_dim: m.head_dim,
        ffn: m.top_k * m.ffn / layout.tp,
        elem_bytes: 2,
        seq_shard: if layout.sequence_parallel { layout.tp } else { 1 },
    };
    let mut spec = if m.mlp == Mlp::SquaredRelu { nemotron_layer(&shape) } else { llama_layer(&shape) };
    if m.experts > 1 {
        let l = shape.tokens;
        spec.segments.insert(
            5,
            Segment {
                name: "router".into(),
                module: "moe".into(),
                flops: 2.0 * (l * m.d_model * m.experts) as f64,
                inputs: vec!["h2".into()],
                outputs: vec![SavedTensor { name: "router_probs".into(), bytes: l * m.experts * 4 }],
            },
        );
    }
    spec
}

/// Checks the layout against the model and the sequence; each error names the smallest change that fits.
pub fn check(input: &PlanInput) -> Result<()> {
    let (m, l) = (&input.model, &input.layout);
    if l.tp == 0 || l.cp == 0 || l.pp == 0 || l.gpus == 0 {
        return Err(plan_err("layout", "a parallel size of 0".into(), "use 1 for a dimension not split".into()));
    }
    if l.gpus % (l.tp * l.cp * l.pp) != 0 {
        return Err(plan_err(
            "layout",
            format!("{} devices do not split into TP {} × CP {} × PP {}", l.gpus, l.tp, l.cp, l.pp),
            format!("use a multiple of {} devices", l.tp * l.cp * l.pp),
        ));
    }
    if !input.seq_len.is_multiple_of(2 * l.cp) {
        return Err(plan_err(
            "sequence",
            format!("{} tokens do not split into 2·CP = {} zigzag chunks", input.seq_len, 2 * l.cp),
            format!("use a multiple of {}", 2 * l.cp),
        ));
    }
    if !m.heads.is_multiple_of(l.tp) {
        return Err(plan_err(
            "layout",
            format!("TP {} does not divide {} query heads", l.tp, m.heads),
            "use a TP that divides the heads".into(),
        ));
    }
    if l.tp > m.kv_heads || !m.kv_heads.is_multiple_of(l.tp) {
        let best = (1..=m.kv_heads).rev().find(|t| m.kv_heads.is_multiple_of(*t) && *t <= l.tp).unwrap_or(1);
        return Err(plan_err(
            "layout",
            format!("TP {} does not divide the {} KV heads (longctx does not replicate KV heads)", l.tp, m.kv_heads),
            format!("use TP {best}"),
        ));
    }
    if !m.layers.is_multiple_of(l.pp) {
        return Err(plan_err(
            "layout",
            format!("PP {} does not divide {} layers", l.pp, m.layers),
            "use a PP that divides the layers".into(),
        ));
    }
    if l.global_batch == 0 || !l.global_batch.is_multiple_of(l.dp()) {
        return Err(plan_err(
            "layout",
            format!("a global batch of {} does not split over DP {}", l.global_batch, l.dp()),
            format!("use a multiple of {}", l.dp()),
        ));
    }
    Ok(())
}

/// Plans `input`: the given policy, or (when `None`) the cheapest that fits the device.
pub fn plan(input: &PlanInput) -> Result<PlanReport> {
    check(input)?;
    let (m, l, d) = (&input.model, &input.layout, &input.device);
    let p = m.params() as f64 / (l.tp * l.pp) as f64;
    let opt_shard = if l.distributed_optimizer { (l.dp() * l.cp) as f64 } else { 1.0 };
    let weights = (2.0 * p) as u64;
    let gradients = (4.0 * p) as u64;
    let optimizer = (12.0 * p / opt_shard) as u64;
    let loss = 2 * input.loss_chunk * (m.vocab / l.tp) * 4 + input.loss_chunk * m.d_model * 2;
    let tokens = input.seq_len / l.cp;
    let kv_block = 2 * tokens * (m.kv_heads / l.tp).max(1) * m.head_dim * 2;
    let comm = if l.cp > 1 { 3 * kv_block + kv_block * 2 } else { 0 };
    let spec = layer_for(m, l, input.seq_len);
    let stage_layers = (m.layers / l.pp) as usize;
    let peak = if input.fp8 && d.fp8_flops > 0.0 { d.fp8_flops } else { d.bf16_flops };
    let rate = peak * input.efficiency;
    let costs = Costs { flops_per_s: rate, offload_bytes_per_s: if input.offload { d.host_bytes_per_s } else { 0.0 } };
    let in_flight = l.pp;
    let fixed = weights + gradients + optimizer + loss + comm;
    let (policy_name, actions) = match &input.policy {
        Some(pol) => (pol.to_string(), pol.resolve(&spec, stage_layers, &costs)?),
        None => {
            let room = d.memory_bytes.saturating_sub(fixed);
            // Micro-batches in flight multiply the resident and the offloaded part; solve for one and scale
            // the budgets.
            let budget = room / in_flight.max(1);
            let host_room = d.host_memory_bytes / in_flight.max(1);
            let keep_all = Policy::None.resolve(&spec, stage_layers, &costs)?;
            if plan_cost(&spec, &keep_all, &costs).peak_bytes <= budget {
                ("none (fits)".to_string(), keep_all)
            } else {
                match solve_within(&spec, stage_layers, budget, host_room, &costs) {
                    Ok(s) => {
                        let dropped = s.cost.recompute_flops / spec.forward_flops() / stage_layers as f64;
                        let out = if s.cost.offloaded_bytes > 0 {
                            format!(", offloads {:.1} GiB", s.cost.offloaded_bytes as f64 / (1u64 << 30) as f64)
                        } else {
                            String::new()
                        };
                        let name =
                            format!("budget:{budget} (solver; reruns {:.0}% of the forward{out})", 100.0 * dropped);
                        (name, s.layers)
                    }
                    Err(_) => ("full (nothing fits)".to_string(), Policy::Full.resolve(&spec, stage_layers, &costs)?),
                }
            }
        }
    };
    let pc: PlanCost = plan_cost(&spec, &actions, &costs);
    let activations = pc.resident_bytes * in_flight + (pc.peak_bytes - pc.resident_bytes);
    let host_offload = pc.offloaded_bytes * in_flight;
    let memory = MemoryBreakdown {
        weights,
        gradients,
        optimizer,
        activations,
        activations_per_layer: pc.resident_bytes / stage_layers.max(1) as u64,
        loss,
        comm,
        total: fixed + activations,
        host_offload,
    };

    // Time.
    let dp = l.dp();
    let micro = l.global_batch / dp;
    let step_tokens = (l.global_batch * input.seq_len) as f64;
    let model_flops = m.flops_per_token(input.seq_len) * step_tokens;
    let per_device_flops = model_flops / l.gpus as f64;
    let compute = per_device_flops / rate;
    let recompute = pc.recompute_flops * micro as f64 / rate;
    let offload = pc.offload_seconds * micro as f64;
    let ring = if l.cp > 1 {
        let link = if l.cp * l.tp <= d.per_node { d.intra_node_bytes_per_s } else { d.inter_node_bytes_per_s };
        let block_flops = 4.0 * (tokens * tokens * (m.heads / l.tp) * m.head_dim) as f64 / 2.0;
        let fwd = (kv_block as f64 / link - block_flops / rate).max(0.0);
        let bwd = (2.0 * kv_block as f64 / link - 2.5 * block_flops / rate).max(0.0);
        (fwd + bwd) * (l.cp - 1) as f64 * m.layers as f64 / l.pp as f64 * micro as f64
    } else {
        0.0
    };
    let tp = if l.tp > 1 {
        let bytes = (tokens * m.d_model * 2) as f64;
        8.0 * bytes * (l.tp - 1) as f64 / l.tp as f64 / d.intra_node_bytes_per_s * m.layers as f64 / l.pp as f64
            * micro as f64
    } else {
        0.0
    };
    let busy = compute + recompute + offload + ring + tp;
    let bubble = busy * (l.pp - 1) as f64 / (micro + l.pp - 1) as f64;
    let step = busy + bubble;
    let time = TimeEstimate {
        step_seconds: step,
        tflops_per_device: per_device_flops / step / 1e12,
        compute_seconds: compute,
        recompute_seconds: recompute,
        offload_exposed_seconds: offload,
        ring_exposed_seconds: ring,
        tp_seconds: tp,
        bubble_seconds: bubble,
    };
    let fits = memory.total <= d.memory_bytes && host_offload <= d.host_memory_bytes;
    Ok(PlanReport { input: input.clone(), policy: policy_name, fits, memory, time })
}

/// When `report` does not fit: the smallest doubling of context parallelism (with as many more devices) that
/// does, as a sentence; `None` when it fits or nothing up to 64× does.
pub fn suggest(report: &PlanReport) -> Option<String> {
    if report.fits {
        return None;
    }
    let mut input = report.input.clone();
    for k in 1..=6u32 {
        let f = 1u64 << k;
        input.layout.cp = report.input.layout.cp * f;
        input.layout.gpus = report.input.layout.gpus * f;
        if let Ok(r) = plan(&input) {
            if r.fits {
                return Some(format!(
                    "CP {} on {} devices fits ({} of {}, policy {})",
                    input.layout.cp, input.layout.gpus, r.memory.total, r.input.device.memory_bytes, r.policy
                ));
            }
        }
    }
    None
}

/// Parses `8K`, `128K`, `1M`, `131072` (powers of two for K and M).
pub fn parse_tokens(text: &str) -> Option<u64> {
    let t = text.trim();
    let (num, mult) = if let Some(n) = t.strip_suffix(['K', 'k']) {
        (n, 1024)
    } else if let Some(n) = t.strip_suffix(['M', 'm']) {
        (n, 1024 * 1024)
    } else {
        (t, 1)
    };
    num.parse::<u64>().ok().map(|n| n * mult)
}

/// Korthikanti et al. (2022), eq. 2: activation bytes per transformer layer without recomputation, with
/// tensor and sequence parallelism, `s·b·h·(34 + 5·a·s/h)/t` (fp16, with dropout masks and the `a·s²`
/// attention scores and softmax that a flash kernel does not keep).
pub fn korthikanti_layer_bytes(s: u64, b: u64, h: u64, a: u64, t: u64) -> f64 {
    (s * b * h) as f64 * (34.0 + 5.0 * a as f64 * s as f64 / h as f64) / t as f64
}

/// NVIDIA's published NeMo long-context throughput for Llama 3 8B (FP8, DGX-B200, NeMo 25.04): sequence,
/// CP, TP, TFLOP/s per GPU with CP.
pub const NEMO_LLAMA3_8B: &[(u64, u64, u64, f64)] = &[
    (8192, 1, 1, 1671.0),
    (16384, 1, 1, 1717.0),
    (32768, 2, 1, 1624.0),
    (65536, 4, 1, 1600.0),
    (131072, 4, 2, 1588.0),
    (262144, 4, 4, 1590.0),
    (524288, 8, 4, 1619.0),
    (1048576, 16, 4, 1608.0),
];
