//! The model's tensors as one list ([`Params`]: weights, gradients or optimizer moments, in checkpoint order) and
//! the seeded generator of the initial weights ([`Rng`]).

use longctx_kernels::{Backend, Buffer, DType, Dims, View};

use super::layout::param_shapes;
use crate::error::Result;
use crate::recipe::{Family, ModelConfig};

/// The model's tensors (weights, or their gradients, or an optimizer moment), one buffer each, named as in a
/// Hugging Face checkpoint of the family, in a fixed order (see [`param_shapes`]).
#[derive(Debug)]
pub struct Params {
    /// Hugging Face names (`model.layers.3.self_attn.q_proj.weight`).
    pub names: Vec<String>,
    /// One buffer per name.
    pub tensors: Vec<Buffer>,
}

impl Params {
    /// Zeroed tensors of `dtype` for `cfg`, in `backend`'s memory.
    pub fn zeros(backend: &dyn Backend, cfg: &ModelConfig, dtype: DType) -> Result<Params> {
        let (mut names, mut tensors) = (Vec::new(), Vec::new());
        for (name, dims) in param_shapes(cfg) {
            tensors.push(backend.zeros(dtype, Dims::new(&dims)?)?);
            names.push(name);
        }
        Ok(Params { names, tensors })
    }

    /// The initial weights (`f32`): norms 1 (Nemotron's zero-centred LayerNorm weights 0, so effectively 1, and
    /// biases 0), matrices normal with `init_std` (residual output projections divided by `√(2·layers)`, GPT-2's
    /// rule), from a generator seeded by `seed` alone, so every rank draws the same weights.
    pub fn init(backend: &dyn Backend, cfg: &ModelConfig, seed: u64) -> Result<Params> {
        let mut p = Params::zeros(backend, cfg, DType::F32)?;
        let mut rng = Rng::new(seed);
        let resid = cfg.init_std / ((2 * cfg.layers) as f32).sqrt();
        let zero_centred = cfg.family == Family::Nemotron;
        for (name, t) in p.names.iter().zip(p.tensors.iter_mut()) {
            let host: Vec<f32> = if t.dims().len() == 1 {
                let one = if zero_centred || name.ends_with(".bias") { 0.0 } else { 1.0 };
                vec![one; t.len()]
            } else {
                let residual = ["o_proj.weight", "down_proj.weight", ".w2.weight"].iter().any(|s| name.ends_with(s));
                let std = if residual { resid } else { cfg.init_std };
                (0..t.len()).map(|_| rng.normal() * std).collect()
            };
            let dims = t.dims().to_vec();
            backend.upload(t.view_mut(), View::new(&host, dims)?)?;
        }
        Ok(p)
    }

    /// Elements over all tensors.
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(Buffer::len).sum()
    }

    /// The tensors as views, in order.
    pub fn views(&self) -> Vec<View<'_>> {
        self.tensors.iter().map(Buffer::view).collect()
    }
}

/// A small deterministic generator (SplitMix64, Box–Muller): the initial weights depend on the seed only.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal.
    pub fn normal(&mut self) -> f32 {
        let (u1, u2) = (1.0 - self.uniform(), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
}
