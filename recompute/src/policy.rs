//! Policies: what to do with each saved tensor of each layer.
//!
//! The built-in policies are the ones practitioners know from Megatron and PyTorch; `budget` is the solver
//! ([`crate::solver`]). A policy resolves, for a model of `L` identical layers, to one [`LayerActions`] per
//! layer ([`Policy::resolve`]).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::action::{Action, LayerActions};
use crate::cost::Costs;
use crate::error::{RecomputeError, Result};
use crate::layer::LayerSpec;

/// The Megatron modules `selective` recomputes when none are named: the norms and the MLP activation (cheap
/// elementwise work whose outputs are large) and the attention projections (`q, k, v` and the residual after
/// the output projection: GEMMs over `C` columns, a few percent of a layer's FLOPs beside the MLP's `3·C·F`,
/// for a further sixth of its bytes). On Llama 3 8B's layer that keeps 53% of the bytes, and the rerun adds
/// under 10% of a step's FLOPs (2.5% at 64K tokens, where attention dominates); the MLP's own projections (`mlp`) and core attention (`core_attn`) are left out because rerunning them
/// costs far more.
pub const DEFAULT_SELECTIVE: &[&str] = &["norm", "mlp_act", "attn_proj"];

/// A recomputation policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Policy {
    /// Keep everything.
    None,
    /// Keep only each layer's input; rerun the whole layer before its backward.
    Full,
    /// Recompute the outputs of the named modules ([`DEFAULT_SELECTIVE`] when empty).
    Selective(Vec<String>),
    /// Keep the input of the first layer of every chunk of `k` layers; rerun the chunk before its backward.
    Uniform(usize),
    /// Full recompute of the first `n` layers; keep the rest.
    Block(usize),
    /// The same per-tensor actions for every layer.
    Custom(LayerActions),
    /// The per-tensor actions that minimise the added time with peak activation memory within the bytes.
    Budget(u64),
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::None => write!(f, "none"),
            Policy::Full => write!(f, "full"),
            Policy::Selective(m) if m.is_empty() => write!(f, "selective"),
            Policy::Selective(m) => write!(f, "selective:{}", m.join(",")),
            Policy::Uniform(k) => write!(f, "uniform:{k}"),
            Policy::Block(n) => write!(f, "block:{n}"),
            Policy::Custom(a) => {
                let parts: Vec<String> = a.actions.iter().map(|(t, a)| format!("{t}={a:?}")).collect();
                write!(f, "custom:{}", parts.join(",").to_lowercase())
            }
            Policy::Budget(b) => write!(f, "budget:{b}"),
        }
    }
}

/// Parses `4GiB`, `512MiB`, `1e9`, `123456`.
pub fn parse_bytes(text: &str) -> Option<u64> {
    let t = text.trim();
    let (num, mult) = [
        ("TiB", 1u64 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("TB", 1_000_000_000_000),
        ("GB", 1_000_000_000),
        ("MB", 1_000_000),
        ("KB", 1000),
        ("B", 1),
    ]
    .iter()
    .find_map(|(suf, m)| t.strip_suffix(suf).map(|n| (n.trim(), *m)))
    .unwrap_or((t, 1));
    let v: f64 = num.parse().ok()?;
    (v.is_finite() && v >= 0.0).then(|| (v * mult as f64).round() as u64)
}

impl std::str::FromStr for Policy {
    type Err = RecomputeError;
    fn from_str(text: &str) -> Result<Policy> {
        let bad = |why: &str| RecomputeError::Policy { text: text.into(), why: why.into() };
        let (kind, arg) = match text.split_once(':') {
            Some((k, a)) => (k, Some(a)),
            None => (text, None),
        };
        let count = |a: Option<&str>| -> Result<usize> {
            a.and_then(|a| a.parse::<usize>().ok()).ok_or_else(|| bad("expects a whole number after `:`"))
        };
        Ok(match kind {
            "none" => Policy::None,
            "full" => Policy::Full,
            "selective" => Policy::Selective(
                arg.map(|a| a.split(',').map(|m| m.trim().to_string()).filter(|m| !m.is_empty()).collect())
                    .unwrap_or_default(),
            ),
            "uniform" => match count(arg)? {
                0 => return Err(bad("a chunk of 0 layers")),
                k => Policy::Uniform(k),
            },
            "block" => Policy::Block(count(arg)?),
            "budget" => Policy::Budget(
                arg.and_then(parse_bytes).ok_or_else(|| bad("expects a size after `:` (4GiB, 512MiB, 1e9)"))?,
            ),
            "custom" => {
                let mut a = LayerActions::default();
                for part in arg.unwrap_or("").split(',').filter(|p| !p.is_empty()) {
                    let (t, act) =
                        part.split_once('=').ok_or_else(|| bad("custom entries are tensor=keep|recompute|offload"))?;
                    let act = match act {
                        "keep" => Action::Keep,
                        "recompute" => Action::Recompute,
                        "offload" => Action::Offload,
                        _ => return Err(bad("an action is keep, recompute or offload")),
                    };
                    a.set(t.trim(), act);
                }
                Policy::Custom(a)
            }
            _ => return Err(bad("unknown policy")),
        })
    }
}

impl Policy {
    /// The actions of each of `layers` identical layers described by `spec`. `Budget` runs the solver with
    /// `costs`; the others ignore them.
    pub fn resolve(&self, spec: &LayerSpec, layers: usize, costs: &Costs) -> Result<Vec<LayerActions>> {
        spec.validate()?;
        let all_outputs = |a: &mut LayerActions| {
            for s in &spec.segments {
                for o in &s.outputs {
                    a.set(&o.name, Action::Recompute);
                }
            }
        };
        let mut full = LayerActions::default();
        all_outputs(&mut full);
        Ok(match self {
            Policy::None => vec![LayerActions::keep_all(); layers],
            Policy::Full => vec![full; layers],
            Policy::Selective(mods) => {
                let mods: Vec<&str> = if mods.is_empty() {
                    DEFAULT_SELECTIVE.to_vec()
                } else {
                    mods.iter().map(String::as_str).collect()
                };
                for m in &mods {
                    if !spec.segments.iter().any(|s| s.module == *m) {
                        let known: std::collections::BTreeSet<&str> =
                            spec.segments.iter().map(|s| s.module.as_str()).collect();
                        return Err(RecomputeError::Policy {
                            text: self.to_string(),
                            why: format!("no module `{m}` in this layer (it has {known:?})"),
                        });
                    }
                }
                let mut a = LayerActions::default();
                for s in spec.segments.iter().filter(|s| mods.contains(&s.module.as_str())) {
                    for o in &s.outputs {
                        a.set(&o.name, Action::Recompute);
                    }
                }
                vec![a; layers]
            }
            Policy::Uniform(k) => (0..layers)
                .map(|l| {
                    let mut a = full.clone();
                    if l % k != 0 {
                        a.set(&spec.input.name, Action::Recompute);
                    }
                    a
                })
                .collect(),
            Policy::Block(n) => {
                (0..layers).map(|l| if l < *n { full.clone() } else { LayerActions::keep_all() }).collect()
            }
            Policy::Custom(a) => {
                for (t, act) in &a.actions {
                    let known = spec.tensors().any(|x| &x.name == t);
                    if !known {
                        return Err(RecomputeError::Action {
                            tensor: t.clone(),
                            why: "not a tensor this layer saves".into(),
                        });
                    }
                    if *t == spec.input.name && *act == Action::Recompute {
                        return Err(RecomputeError::Action {
                            tensor: t.clone(),
                            why: "a layer's input is recomputed only by `uniform` (from the chunk's first layer)"
                                .into(),
                        });
                    }
                }
                vec![a.clone(); layers]
            }
            Policy::Budget(bytes) => crate::solver::solve(spec, layers, *bytes, costs)?.layers,
        })
    }
}
