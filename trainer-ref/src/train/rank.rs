//! One rank's state and its set-up: communicators, the backend, weights (fresh, pretrained or, later, resumed),
//! gradients and AdamW moments, the context-parallel plan, and the recompute and offload choices.

use std::path::Path;
use std::sync::Arc;

use longctx_kernels::{DType, View};
use longctx_p2p::Communicator;
use longctx_recompute::{Action, Policy};
use longctx_ring_attn::{ContextParallel, CpConfig, CpPlan};

use super::tiers::{costs, offload_engine};
use crate::checkpoint::{LoadedTensor, SavedTokenizer};
use crate::data::Sequence;
use crate::device::{Device, RankBackends};
use crate::error::{Result, TrainError};
use crate::metrics::Predicted;
use crate::model::{LayerSaved, Model, Params};
use crate::recipe::Recipe;

/// One rank's state: its communicators, model, gradients and optimizer.
pub(super) struct Rank<'a> {
    pub(super) recipe: &'a Recipe,
    pub(super) world: Arc<Communicator>,
    pub(super) dp_index: usize,
    /// What the rank computes on (the backend is the model's).
    pub(super) device: Device,
    pub(super) model: Model,
    /// `f32` master weights for a `bf16` model (the model's own weights when it is `f32`).
    pub(super) master: Option<Params>,
    pub(super) grads: Params,
    pub(super) m: Params,
    pub(super) v: Params,
    pub(super) plan: CpPlan,
    /// Optimizer steps taken.
    pub(super) step: u64,
    /// The planner's kept and peak activation bytes and rerun FLOPs for this rank.
    pub(super) predicted: Predicted,
    /// The tokenizer the corpus was read with, saved in every checkpoint (none for byte tokens).
    pub(super) tokenizer: Option<&'a SavedTokenizer>,
    /// The weights came from a pretrained checkpoint: a fresh run measures their held-out loss before its
    /// first step, the baseline a continued training (a context extension) is judged against.
    pub(super) pretrained: bool,
}

impl<'a> Rank<'a> {
    /// A rank with fresh weights, or `init`'s (in [`crate::model::param_shapes`] order, f32), computing on a backend
    /// of `backends` (made for the recipe's device).
    pub(super) fn new(
        comm: Communicator,
        recipe: &'a Recipe,
        backends: &RankBackends,
        spill_root: &Path,
        init: Option<&[LoadedTensor]>,
    ) -> Result<Self> {
        let cfg = &recipe.model;
        let cp = recipe.parallel.cp;
        let world = Arc::new(comm);
        let (dp_index, cp_index) = (world.rank() / cp, world.rank() % cp);
        let cp_comm = world.split(dp_index as u32, cp_index as u32)?;
        let device = recipe.device()?;
        let backend = backends.for_rank()?;
        let dtype = recipe.dtype();
        let init = match init {
            None => Params::init(&*backend, cfg, recipe.train.seed)?,
            Some(tensors) => {
                let mut p = Params::zeros(&*backend, cfg, DType::F32)?;
                for (dst, src) in p.tensors.iter_mut().zip(tensors) {
                    backend.upload(dst.view_mut(), View::new(&src.data, src.dims.as_slice())?)?;
                }
                p
            }
        };
        let (weights, master) = if dtype == DType::F32 {
            (init, None)
        } else {
            let mut w = Params::zeros(&*backend, cfg, dtype)?;
            for (dst, src) in w.tensors.iter_mut().zip(&init.tensors) {
                backend.copy(dst.view_mut(), src.view())?;
            }
            (w, Some(init))
        };
        let grads = Params::zeros(&*backend, cfg, DType::F32)?;
        let m = Params::zeros(&*backend, cfg, DType::F32)?;
        let v = Params::zeros(&*backend, cfg, DType::F32)?;
        let cpc = CpConfig { partition: recipe.partition()?, schedule: recipe.schedule()?, scale: None };
        let cp = ContextParallel::new(cp_comm, backend.clone(), cpc)?;
        let plan = recipe.cp_plan(&cp, recipe.train.seq_len, dtype)?;
        let mut model = Model::new(cfg.clone(), weights, backend.clone())?;
        model.set_sequence_length(recipe.train.seq_len)?;
        let policy = recipe.recompute_policy()?;
        let costs = {
            // `budget:` probes the tier's rate on an engine of its own, gone (its spill files with it) before the
            // run's is built.
            let probe = match policy {
                Policy::Budget(_) => offload_engine(recipe, &backend, world.rank(), spill_root, true)?,
                _ => None,
            };
            costs(&world, &policy, probe.as_deref(), device, &*backend)?
        };
        let actions = policy
            .resolve(&recipe.layer_spec(), cfg.layers, &costs)
            .map_err(|e| TrainError::InvalidField { field: "train.recompute".into(), detail: e.to_string() })?;
        // A policy that names what to offload is followed layer by layer (the planner counts every layer's
        // offloaded bytes out); without one, everything kept goes out but the last layers' (`offload_layers`).
        let chosen = actions.iter().any(|a| a.actions.values().any(|&v| v == Action::Offload));
        let offload = offload_engine(recipe, &backend, world.rank(), spill_root, !chosen)?;
        let cost = longctx_recompute::plan_cost(&recipe.layer_spec(), &actions, &costs);
        let elem = if dtype == DType::Bf16 { 2 } else { 4 };
        let local = recipe.train.seq_len / recipe.parallel.cp;
        let final_norm = local * cfg.d_model * elem * 2 + local * 4;
        let predicted = Predicted {
            saved_bytes: cost.resident_bytes as usize + final_norm,
            peak_bytes: cost.peak_bytes as usize + final_norm,
            layers_peak_bytes: cost.peak_bytes as usize,
            // Per micro-batch in the cost; a rank runs `batch / dp` of them per step.
            recompute_flops: cost.recompute_flops * (recipe.train.batch / recipe.parallel.dp) as f64,
            offloaded_bytes: cost.offloaded_bytes as usize,
        };
        model.set_recompute(actions)?;
        model.set_offload(offload);
        Ok(Rank {
            recipe,
            world,
            dp_index,
            device,
            model,
            master,
            grads,
            m,
            v,
            plan,
            step: 0,
            predicted,
            tokenizer: None,
            pretrained: false,
        })
    }

    pub(super) fn is_root(&self) -> bool {
        self.world.rank() == 0
    }

    /// This rank's share of a sequence: its tokens, targets and document ids at the plan's positions.
    pub(super) fn local(&self, seq: &Sequence) -> (Vec<u32>, Vec<i64>, Vec<u32>) {
        seq.share(self.plan.positions())
    }

    /// The `f32` weights AdamW updates and checkpoints hold: the master copy of a `bf16` model, else the model's.
    pub(super) fn master(&self) -> &Params {
        self.master.as_ref().unwrap_or(&self.model.weights)
    }
}

/// Bytes of activations one layer saves per rank for a micro-batch of the recipe.
pub fn layer_saved_bytes(recipe: &Recipe) -> usize {
    let l = recipe.train.seq_len / recipe.parallel.cp;
    LayerSaved::bytes_for(&recipe.model, l, recipe.dtype())
}
