//! What a decoder layer's forward saves for its backward, and what the recompute and offload policies do to it.
//!
//! One table ([`SavedId`]) names every saved tensor of every family, with the recompute segment that makes it
//! ([`SegmentId`], the names of `longctx_recompute::llama_layer` and its family variants) and its size from the
//! shapes (llm.c's `ActivationTensors` and `fill_in_activation_sizes`). [`LayerSaved`] holds one layer's tensors
//! by id between its forward and its backward and carries out the policies' decisions: free what is recomputed
//! ([`LayerSaved::keep`]), move tensors out and back ([`LayerSaved::offload`], [`LayerSaved::restore`]) and rerun
//! each segment whose outputs were freed ([`LayerSaved::replay`]).
//!
//! Shapes: `L` tokens on this rank, `C` the model width, `Hq`/`Hkv` query and KV heads of width `D`, `F` the MLP
//! width (of one expert), `E` experts, `K` experts per token, `N` rows through the MLP (`L·K` with experts, else
//! `L`). Activations are in the working dtype, the norms' statistics and the router's outputs in `f32`.

use longctx_kernels::{Buffer, DType, Event, Routing};
use longctx_offload::{Activation, Device, DeviceTensor, OffloadEngine, Ticket};
use longctx_recompute::{Action, LayerActions, LayerSpec};

use crate::error::{Result, TrainError};
use crate::recipe::{Family, ModelConfig};

use super::offload_copy::BackendBuffer;

/// A tensor a decoder layer's forward saves for its backward. The layer's input is `x`; the others are named by
/// the op that made them. Some belong to some families only: LayerNorm's means (Nemotron), the gate (Llama,
/// Mixtral), the router's and experts' tensors (Mixtral). In a Mixtral layer `gate`, `up` and `act` hold the
/// `N = L·K` dispatched rows, grouped by expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SavedId {
    /// The layer's input `[L, C]` (the previous layer's output; the attention norm's input and the residual).
    X,
    /// Attention LayerNorm: mean per token `[L]` (Nemotron).
    Mean1,
    /// Attention norm: `1/rms` (or LayerNorm's `1/std`) per token `[L]`.
    Rstd1,
    /// Attention norm output `[L, C]`: the input of the Q, K and V projections.
    H1,
    /// Rotated queries `[1, Hq, L, D]`.
    Q,
    /// Rotated keys `[1, Hkv, L, D]`.
    K,
    /// Values `[1, Hkv, L, D]`.
    V,
    /// Attention output `[1, Hq, L, D]` (the output projection's input, transposed back in the backward).
    O,
    /// Attention log-sum-exp `[1, Hq, L]`.
    Lse,
    /// The residual after attention `[L, C]`: the MLP norm's input.
    X2,
    /// MLP LayerNorm: mean per token `[L]` (Nemotron).
    Mean2,
    /// MLP norm: `1/rms` (or `1/std`) per token `[L]`.
    Rstd2,
    /// MLP norm output `[L, C]`: the MLP's (and the router's) input.
    H2,
    /// Router probabilities `[L, E]` (Mixtral).
    RouterProbs,
    /// Each token's renormalised top-k weights `[L, K]` (Mixtral).
    TopkW,
    /// Which experts each token goes to and the dispatch order (Mixtral; host metadata, not a buffer).
    Routing,
    /// Gate projection `[N, F]` (the experts' `w1`); not in Nemotron's MLP.
    Gate,
    /// Up projection `[N, F]` (the experts' `w3`): the activation's input.
    Up,
    /// SwiGLU or squared-ReLU output `[N, F]`: the down projection's input.
    Act,
    /// The experts' outputs `[N, C]` before their weighted sum (Mixtral).
    Ye,
}

/// A stretch of the layer's forward between saved tensors, named as the recompute crate names it. Each is one
/// forward helper of the layer, which a replay reruns by this name; the layer's last segment (`down_proj`, or
/// `combine` with experts) saves nothing and makes the layer's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SegmentId {
    /// `mean1, rstd1, h1 = norm(x)`.
    AttnNorm,
    /// `q, k, v` from `h1`, rotated.
    QkvProj,
    /// `o, lse` = attention over the whole sequence.
    CoreAttn,
    /// `x2 = x + o·Woᵀ`.
    OProj,
    /// `mean2, rstd2, h2 = norm(x2)`.
    MlpNorm,
    /// `router_probs, topk_w, routing` from `h2` (Mixtral).
    Router,
    /// `gate, up` projections of `h2` (of its dispatched rows with experts).
    GateUp,
    /// `up` projection of `h2` (Nemotron).
    UpProj,
    /// `act = silu(gate) ∘ up`.
    Swiglu,
    /// `act = relu(up)²`.
    SquaredRelu,
    /// The layer's output `x2 + act·Wdownᵀ`; with experts, each expert's output `ye`.
    DownProj,
    /// The layer's output `x2 + Σ_j w[t,j]·ye[row(t,j)]` (Mixtral).
    Combine,
}

impl SegmentId {
    /// Every segment.
    pub const ALL: [SegmentId; 12] = [
        SegmentId::AttnNorm,
        SegmentId::QkvProj,
        SegmentId::CoreAttn,
        SegmentId::OProj,
        SegmentId::MlpNorm,
        SegmentId::Router,
        SegmentId::GateUp,
        SegmentId::UpProj,
        SegmentId::Swiglu,
        SegmentId::SquaredRelu,
        SegmentId::DownProj,
        SegmentId::Combine,
    ];

    /// Its name in the recompute crate's layer descriptions.
    pub fn name(self) -> &'static str {
        match self {
            SegmentId::AttnNorm => "attn_norm",
            SegmentId::QkvProj => "qkv_proj",
            SegmentId::CoreAttn => "core_attn",
            SegmentId::OProj => "o_proj",
            SegmentId::MlpNorm => "mlp_norm",
            SegmentId::Router => "router",
            SegmentId::GateUp => "gate_up",
            SegmentId::UpProj => "up_proj",
            SegmentId::Swiglu => "swiglu",
            SegmentId::SquaredRelu => "squared_relu",
            SegmentId::DownProj => "down_proj",
            SegmentId::Combine => "combine",
        }
    }

    /// The segment named `name`.
    pub fn from_name(name: &str) -> Option<SegmentId> {
        SegmentId::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// The sizes one layer's tensors are stated in (see the module's legend).
#[derive(Debug, Clone, Copy)]
struct LayerShape {
    l: usize,
    c: usize,
    f: usize,
    d: usize,
    hq: usize,
    hkv: usize,
    n: usize,
    /// `(E, K)` (Mixtral).
    moe: Option<(usize, usize)>,
    /// LayerNorm, which saves its mean (Nemotron), rather than RMSNorm.
    layernorm: bool,
    /// A gated MLP (SwiGLU: Llama, Mixtral).
    gated: bool,
    /// Bytes per activation element.
    e: usize,
}

impl LayerShape {
    fn new(cfg: &ModelConfig, l: usize, dtype: DType) -> Self {
        let moe = match (cfg.family, cfg.experts()) {
            (Family::Mixtral, Some(m)) => Some((m.experts, m.top_k)),
            _ => None,
        };
        LayerShape {
            l,
            c: cfg.d_model,
            f: cfg.ffn,
            d: cfg.head_dim(),
            hq: cfg.heads,
            hkv: cfg.kv_heads,
            n: l * moe.map_or(1, |(_, k)| k),
            moe,
            layernorm: cfg.family == Family::Nemotron,
            gated: cfg.family != Family::Nemotron,
            e: dtype.size(),
        }
    }
}

/// One saved tensor's entry in [`TABLE`].
struct Row {
    id: SavedId,
    name: &'static str,
    /// The segment that saves it, one per MLP kind where they differ (`up`, `act`); none for the layer's input.
    made_by: &'static [SegmentId],
    /// Its bytes in a layer of that shape; `None` where the family has no such tensor.
    bytes: fn(&LayerShape) -> Option<usize>,
}

/// Bytes of an `f32` element.
const F32: usize = 4;

/// Every saved tensor, in [`SavedId`] order: the order the forward makes them.
#[rustfmt::skip]
const TABLE: [Row; SavedId::COUNT] = {
    use SavedId as T;
    use SegmentId as S;
    [
        Row { id: T::X, name: "x", made_by: &[], bytes: |s| Some(s.l * s.c * s.e) },
        Row { id: T::Mean1, name: "mean1", made_by: &[S::AttnNorm], bytes: |s| s.layernorm.then_some(s.l * F32) },
        Row { id: T::Rstd1, name: "rstd1", made_by: &[S::AttnNorm], bytes: |s| Some(s.l * F32) },
        Row { id: T::H1, name: "h1", made_by: &[S::AttnNorm], bytes: |s| Some(s.l * s.c * s.e) },
        Row { id: T::Q, name: "q", made_by: &[S::QkvProj], bytes: |s| Some(s.hq * s.l * s.d * s.e) },
        Row { id: T::K, name: "k", made_by: &[S::QkvProj], bytes: |s| Some(s.hkv * s.l * s.d * s.e) },
        Row { id: T::V, name: "v", made_by: &[S::QkvProj], bytes: |s| Some(s.hkv * s.l * s.d * s.e) },
        Row { id: T::O, name: "o", made_by: &[S::CoreAttn], bytes: |s| Some(s.hq * s.l * s.d * s.e) },
        Row { id: T::Lse, name: "lse", made_by: &[S::CoreAttn], bytes: |s| Some(s.hq * s.l * F32) },
        Row { id: T::X2, name: "x2", made_by: &[S::OProj], bytes: |s| Some(s.l * s.c * s.e) },
        Row { id: T::Mean2, name: "mean2", made_by: &[S::MlpNorm], bytes: |s| s.layernorm.then_some(s.l * F32) },
        Row { id: T::Rstd2, name: "rstd2", made_by: &[S::MlpNorm], bytes: |s| Some(s.l * F32) },
        Row { id: T::H2, name: "h2", made_by: &[S::MlpNorm], bytes: |s| Some(s.l * s.c * s.e) },
        Row { id: T::RouterProbs, name: "router_probs", made_by: &[S::Router], bytes: |s| s.moe.map(|(e, _)| s.l * e * F32) },
        Row { id: T::TopkW, name: "topk_w", made_by: &[S::Router], bytes: |s| s.moe.map(|(_, k)| s.l * k * F32) },
        Row { id: T::Routing, name: "routing", made_by: &[S::Router], bytes: |s| s.moe.map(|(e, k)| Routing::bytes_for(s.l, e, k)) },
        Row { id: T::Gate, name: "gate", made_by: &[S::GateUp], bytes: |s| s.gated.then_some(s.n * s.f * s.e) },
        Row { id: T::Up, name: "up", made_by: &[S::GateUp, S::UpProj], bytes: |s| Some(s.n * s.f * s.e) },
        Row { id: T::Act, name: "act", made_by: &[S::Swiglu, S::SquaredRelu], bytes: |s| Some(s.n * s.f * s.e) },
        Row { id: T::Ye, name: "ye", made_by: &[S::DownProj], bytes: |s| s.moe.map(|_| s.n * s.c * s.e) },
    ]
};

// `SavedId as usize` indexes the table.
const _: () = {
    let mut i = 0;
    while i < SavedId::COUNT {
        assert!(TABLE[i].id as usize == i);
        i += 1;
    }
};

impl SavedId {
    /// How many there are.
    pub const COUNT: usize = SavedId::Ye as usize + 1;

    /// Every saved tensor, in the order the forward makes them.
    pub fn all() -> impl Iterator<Item = SavedId> {
        (0..SavedId::COUNT).map(|i| TABLE[i].id)
    }

    /// Its name, as recompute policies and the offload engine call it.
    pub fn name(self) -> &'static str {
        TABLE[self as usize].name
    }

    /// The tensor named `name`.
    pub fn from_name(name: &str) -> Option<SavedId> {
        TABLE.iter().find(|r| r.name == name).map(|r| r.id)
    }

    /// The segment that saves it (one per MLP kind where they differ; none for the layer's input).
    pub fn made_by(self) -> &'static [SegmentId] {
        TABLE[self as usize].made_by
    }

    /// Its bytes in a layer of `cfg` over `l` tokens with activations of `dtype`; `None` where the family does
    /// not save it.
    pub fn bytes_for(self, cfg: &ModelConfig, l: usize, dtype: DType) -> Option<usize> {
        (TABLE[self as usize].bytes)(&LayerShape::new(cfg, l, dtype))
    }
}

/// A layer's tensor that its policy dropped and nothing rebuilt (a broken invariant of the replay).
pub(crate) fn missing(layer: usize, name: &str) -> TrainError {
    TrainError::Internal(format!("layer {layer}: `{name}` was not rebuilt"))
}

/// One segment of the family's layer, with the saved tensors it makes: a step of a replay.
#[derive(Debug, Clone)]
pub(crate) struct ReplayStep {
    pub segment: SegmentId,
    pub outputs: Vec<SavedId>,
}

/// The segments of `spec` (the family's layer as the recompute crate describes it) in forward order, every name
/// resolved in the model's tables.
pub(crate) fn replay_steps(spec: &LayerSpec) -> Result<Vec<ReplayStep>> {
    let unknown = |what: &str, name: &str| {
        TrainError::Internal(format!("the recompute crate's layer has {what} `{name}`, which the model does not know"))
    };
    spec.segments
        .iter()
        .map(|seg| {
            let segment = SegmentId::from_name(&seg.name).ok_or_else(|| unknown("segment", &seg.name))?;
            let outputs = seg
                .outputs
                .iter()
                .map(|t| SavedId::from_name(&t.name).ok_or_else(|| unknown("saved tensor", &t.name)))
                .collect::<Result<_>>()?;
            Ok(ReplayStep { segment, outputs })
        })
        .collect()
}

/// One layer's saved tensors, by [`SavedId`], from its forward to its backward: what the forward made, less what
/// its recompute policy dropped (until a replay makes it again) and what is with the offload engine (until it is
/// restored).
#[derive(Debug)]
pub struct LayerSaved {
    layer: usize,
    /// The buffers; `Routing`'s entry stays empty (the routing is host metadata, held beside them).
    buffers: [Option<Buffer>; SavedId::COUNT],
    routing: Option<Routing>,
    /// Tensors handed to the offload engine.
    away: Vec<(SavedId, Ticket<Activation, Device>)>,
}

impl LayerSaved {
    /// Layer `layer`'s, holding its input `x` alone.
    pub(crate) fn new(layer: usize, x: Buffer) -> Self {
        let mut s = LayerSaved { layer, buffers: Default::default(), routing: None, away: Vec::new() };
        s.put(SavedId::X, x);
        s
    }

    /// The layer's index.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// Whether `id` is held here (not dropped, not away).
    pub fn holds(&self, id: SavedId) -> bool {
        match id {
            SavedId::Routing => self.routing.is_some(),
            _ => self.buffers[id as usize].is_some(),
        }
    }

    /// The buffer `id`.
    pub fn get(&self, id: SavedId) -> Result<&Buffer> {
        self.buffers[id as usize].as_ref().ok_or_else(|| missing(self.layer, id.name()))
    }

    /// The buffer `id`, given up by the store (freed after its last use in the backward).
    pub(crate) fn take(&mut self, id: SavedId) -> Result<Buffer> {
        self.buffers[id as usize].take().ok_or_else(|| missing(self.layer, id.name()))
    }

    /// The buffer `id` where the family saves it (LayerNorm's means).
    pub(crate) fn take_if_held(&mut self, id: SavedId) -> Option<Buffer> {
        self.buffers[id as usize].take()
    }

    /// Holds `buf` as `id` (a buffer: not [`SavedId::Routing`]).
    pub(crate) fn put(&mut self, id: SavedId, buf: Buffer) {
        debug_assert_ne!(id, SavedId::Routing, "the routing is held by put_routing");
        self.buffers[id as usize] = Some(buf);
    }

    /// The routing (Mixtral).
    pub fn routing(&self) -> Result<&Routing> {
        self.routing.as_ref().ok_or_else(|| missing(self.layer, SavedId::Routing.name()))
    }

    /// The routing, given up by the store.
    pub(crate) fn take_routing(&mut self) -> Result<Routing> {
        self.routing.take().ok_or_else(|| missing(self.layer, SavedId::Routing.name()))
    }

    /// Holds the routing.
    pub(crate) fn put_routing(&mut self, routing: Routing) {
        self.routing = Some(routing);
    }

    /// The buffers held, with their ids, in table order.
    pub fn buffers(&self) -> impl Iterator<Item = (SavedId, &Buffer)> {
        SavedId::all().zip(&self.buffers).filter_map(|(id, b)| b.as_ref().map(|b| (id, b)))
    }

    /// Bytes held (buffers and routing metadata).
    pub fn bytes(&self) -> usize {
        self.buffers().map(|(_, b)| b.bytes()).sum::<usize>() + self.routing.as_ref().map_or(0, Routing::bytes)
    }

    /// Bytes one layer's forward over `l` tokens saves, from the shapes alone (equals [`LayerSaved::bytes`]
    /// after a forward).
    pub fn bytes_for(cfg: &ModelConfig, l: usize, dtype: DType) -> usize {
        SavedId::all().filter_map(|id| id.bytes_for(cfg, l, dtype)).sum()
    }

    /// Frees what `actions` recomputes (by [`SavedId::name`]). An `Offload` action needs an offload engine
    /// (`offload_ok`): without one it is an error, except for the routing, which stays in place either way.
    pub fn keep(&mut self, actions: &LayerActions, offload_ok: bool) -> Result<()> {
        for id in SavedId::all() {
            if !self.holds(id) {
                continue;
            }
            match actions.of(id.name()) {
                Action::Keep => {}
                Action::Recompute if id == SavedId::Routing => self.routing = None,
                Action::Recompute => self.buffers[id as usize] = None,
                Action::Offload if offload_ok || id == SavedId::Routing => {}
                Action::Offload => {
                    return Err(TrainError::InvalidField {
                        field: "train.offload".into(),
                        detail: format!(
                            "the recompute policy offloads `{}`: give the run an offload tier (--offload host|disk)",
                            id.name()
                        ),
                    })
                }
            }
        }
        Ok(())
    }

    /// Hands the buffers `which` selects to `engine` (they come back through [`LayerSaved::restore`]): each
    /// goes as it is, in the backend's memory, with `ready`, an event of the compute queue recorded after the
    /// layer's forward, and the engine's copier moves it (see [`super::offload_copy`]).
    pub(crate) fn offload(
        &mut self,
        engine: &OffloadEngine,
        ready: &Event,
        which: impl Fn(SavedId) -> bool,
    ) -> Result<()> {
        let layer = self.layer;
        for id in SavedId::all().filter(|&id| which(id)) {
            let Some(buf) = self.buffers[id as usize].take() else { continue };
            let (dtype, dims) = (buf.dtype(), buf.dims().to_vec());
            let t = DeviceTensor::new(Box::new(BackendBuffer::new(buf, ready.clone())), dtype, dims)
                .map_err(|e| TrainError::Internal(format!("offload of layer {layer} `{}`: {e}", id.name())))?;
            let ticket = engine.offload(layer, id.name(), t)?;
            self.away.push((id, ticket));
        }
        Ok(())
    }

    /// Fetches back what was offloaded (bit-exact), as buffers of the backend again.
    pub(crate) fn restore(&mut self, engine: Option<&OffloadEngine>) -> Result<()> {
        let Some(engine) = engine else { return Ok(()) };
        let layer = self.layer;
        for (id, ticket) in std::mem::take(&mut self.away) {
            let back = engine.fetch(ticket)?.downcast::<BackendBuffer>().map_err(|t| {
                TrainError::Internal(format!("layer {layer} `{}` came back as another buffer: {t:?}", id.name()))
            })?;
            self.buffers[id as usize] = Some(back.into_buffer());
        }
        Ok(())
    }

    /// Reruns, in forward order, every segment of `steps` with an output the policy dropped, through `run` (the
    /// layer's forward helper of that segment's name), from what was kept: the same ops on the same inputs, so
    /// the rebuilt tensors are bit-identical to the forward's. The input must be held and nothing away.
    pub(crate) fn replay(
        &mut self,
        steps: &[ReplayStep],
        mut run: impl FnMut(SegmentId, &mut LayerSaved) -> Result<()>,
    ) -> Result<()> {
        if let Some((id, _)) = self.away.first() {
            return Err(missing(self.layer, id.name()));
        }
        if !self.holds(SavedId::X) {
            return Err(TrainError::Internal(format!("layer {}: its input was neither kept nor rebuilt", self.layer)));
        }
        for step in steps {
            if step.outputs.iter().any(|&id| !self.holds(id)) {
                run(step.segment, self)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_segment_names_are_unique() {
        let mut names: Vec<&str> = SavedId::all().map(SavedId::name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), SavedId::COUNT);
        for id in SavedId::all() {
            assert_eq!(SavedId::from_name(id.name()), Some(id));
        }
        for s in SegmentId::ALL {
            assert_eq!(SegmentId::from_name(s.name()), Some(s));
        }
    }
}
