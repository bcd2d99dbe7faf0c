//! RoPE context-extension scaling as a recipe and a Hugging Face `config.json` write it, and the kernel's
//! [`RopeScaling`] it becomes.
//!
//! The recipe form is Hugging Face's `rope_scaling` object (tagged by `rope_type`), with the values
//! transformers would fill from elsewhere in the config made explicit: the original context
//! (`original_max_position_embeddings`, which Hugging Face takes from `max_position_embeddings` when absent) and
//! LongRoPE's `factor` (`max_position_embeddings / original_max_position_embeddings` when absent). So a recipe
//! says everything the table depends on, and [`RopeScalingConfig::from_hf`] does the filling-in once, on import.

use std::path::Path;

use longctx_kernels::RopeScaling;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Result, TrainError};

/// Hugging Face's `rope_scaling` / `rope_parameters` object (the `rope_type` names it); every type
/// transformers' `modeling_rope_utils` computes for Llama.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScalingConfig {
    /// Plain RoPE (what an absent `rope_scaling` means too).
    Default,
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        /// Context extension factor (8 in Llama 3.1).
        factor: f64,
        /// Low-frequency factor (1).
        low_freq_factor: f64,
        /// High-frequency factor (4).
        high_freq_factor: f64,
        /// Pre-training context (8192).
        original_max_position_embeddings: usize,
    },
    /// Position interpolation.
    Linear {
        /// Interpolation factor.
        factor: f64,
    },
    /// Dynamic NTK: the base grows with the sequence past the original context (computed for the run's
    /// sequence length, as transformers does per forward).
    Dynamic {
        /// Context extension factor.
        factor: f64,
        /// The original context: Hugging Face's `max_position_embeddings`.
        original_max_position_embeddings: usize,
    },
    /// YaRN.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// Pre-training context.
        original_max_position_embeddings: usize,
        /// Rotations above which a dimension extrapolates (32).
        #[serde(default = "default_beta_fast")]
        beta_fast: f64,
        /// Rotations below which a dimension interpolates (1).
        #[serde(default = "default_beta_slow")]
        beta_slow: f64,
        /// Override of the attention factor.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attention_factor: Option<f64>,
        /// DeepSeek's `mscale` (with `mscale_all_dim`, sets the attention factor when it is not given).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mscale: Option<f64>,
        /// DeepSeek's `mscale_all_dim`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mscale_all_dim: Option<f64>,
        /// Round the ramp bounds to whole dimensions (true).
        #[serde(default = "default_truncate")]
        truncate: bool,
    },
    /// LongRoPE (Phi-3): per-frequency factors, short within the original context, long past it.
    Longrope {
        /// `head_dim / 2` factors for sequences within the original context.
        short_factor: Vec<f64>,
        /// `head_dim / 2` factors for longer sequences.
        long_factor: Vec<f64>,
        /// Pre-training context.
        original_max_position_embeddings: usize,
        /// The extension factor behind the default attention factor.
        factor: f64,
        /// Override of the attention factor.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attention_factor: Option<f64>,
    },
}

fn default_beta_fast() -> f64 {
    32.0
}
fn default_beta_slow() -> f64 {
    1.0
}
fn default_truncate() -> bool {
    true
}

impl RopeScalingConfig {
    /// The kernel's scaling for sequences of `seq_len` tokens (only `dynamic` and `longrope` depend on it).
    pub fn to_kernel(&self, seq_len: usize) -> RopeScaling {
        match self.clone() {
            RopeScalingConfig::Default => RopeScaling::None,
            RopeScalingConfig::Linear { factor } => RopeScaling::Linear { factor },
            RopeScalingConfig::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position: original_max_position_embeddings,
            },
            RopeScalingConfig::Dynamic { factor, original_max_position_embeddings } => {
                RopeScaling::DynamicNtk { factor, original_max_position: original_max_position_embeddings, seq_len }
            }
            RopeScalingConfig::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                mscale,
                mscale_all_dim,
                truncate,
            } => {
                // Transformers: an explicit attention factor wins; else both mscales (nonzero) give the ratio;
                // else the kernel's default from the factor.
                let attention_factor = attention_factor.or(match (mscale, mscale_all_dim) {
                    (Some(m), Some(a)) if m != 0.0 && a != 0.0 => Some(RopeScaling::yarn_mscale(factor, m, a)),
                    _ => None,
                });
                RopeScaling::Yarn {
                    factor,
                    original_max_position: original_max_position_embeddings,
                    beta_fast,
                    beta_slow,
                    attention_factor,
                    truncate,
                }
            }
            RopeScalingConfig::Longrope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                factor,
                attention_factor,
            } => RopeScaling::LongRope {
                short_factor,
                long_factor,
                factor,
                original_max_position: original_max_position_embeddings,
                seq_len,
                attention_factor,
            },
        }
    }

    /// The `rope_type` name.
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScalingConfig::Default => "default",
            RopeScalingConfig::Llama3 { .. } => "llama3",
            RopeScalingConfig::Linear { .. } => "linear",
            RopeScalingConfig::Dynamic { .. } => "dynamic",
            RopeScalingConfig::Yarn { .. } => "yarn",
            RopeScalingConfig::Longrope { .. } => "longrope",
        }
    }

    /// Parses a Hugging Face `rope_scaling` (or `rope_parameters`) object of `config.json` at `path`, filling
    /// in what transformers takes from elsewhere in the config: `max_position_embeddings` (the original context
    /// of `dynamic`, and of the others when they lack `original_max_position_embeddings`), a top-level
    /// `original_max_position_embeddings` (Phi-3's, which transformers prefers), and LongRoPE's default factor.
    ///
    /// The legacy `type` key is read as `rope_type`; `rope_theta` (which `rope_parameters` carries) is left to
    /// the caller. `Ok(None)` for `default`. A key the type does not have is an error naming it.
    pub fn from_hf(
        path: &Path,
        field: &str,
        obj: &Map<String, Value>,
        max_position_embeddings: Option<usize>,
        top_original: Option<usize>,
    ) -> Result<Option<RopeScalingConfig>> {
        let err = |sub: &str, detail: String| TrainError::HfConfig {
            path: path.to_path_buf(),
            field: if sub.is_empty() { field.to_string() } else { format!("{field}.{sub}") },
            detail,
        };
        let mut obj = obj.clone();
        obj.remove("rope_theta");
        if let Some(t) = obj.remove("type") {
            match obj.get("rope_type") {
                Some(r) if r != &t => {
                    return Err(err("type", format!("{t} disagrees with rope_type {r}")));
                }
                _ => {
                    obj.insert("rope_type".into(), t);
                }
            }
        }
        if let Some(p) = obj.remove("partial_rotary_factor") {
            if p.as_f64() != Some(1.0) {
                return Err(err("partial_rotary_factor", format!("{p}: rotary on part of each head is not supported")));
            }
        }
        let kind = obj.get("rope_type").and_then(Value::as_str).unwrap_or("default").to_string();
        obj.insert("rope_type".into(), Value::String(kind.clone()));
        let need_max = |what: &str| {
            max_position_embeddings
                .ok_or_else(|| err("", format!("`{what}` needs max_position_embeddings, which the config lacks")))
        };
        match kind.as_str() {
            "dynamic" => {
                // Transformers' dynamic NTK scales against max_position_embeddings, whatever else is set.
                obj.insert("original_max_position_embeddings".into(), need_max("dynamic")?.into());
            }
            "yarn" | "longrope" | "llama3" => {
                if let Some(o) = top_original {
                    obj.insert("original_max_position_embeddings".into(), o.into());
                } else if !obj.contains_key("original_max_position_embeddings") {
                    obj.insert("original_max_position_embeddings".into(), need_max(&kind)?.into());
                }
                if kind == "longrope" && obj.get("factor").is_none_or(Value::is_null) {
                    let orig = obj.get("original_max_position_embeddings").and_then(Value::as_f64).unwrap_or(1.0);
                    obj.insert("factor".into(), (need_max("longrope")? as f64 / orig).into());
                }
                if kind == "yarn" && obj.get("factor").is_none_or(Value::is_null) {
                    let orig = obj.get("original_max_position_embeddings").and_then(Value::as_f64).unwrap_or(1.0);
                    obj.insert("factor".into(), (need_max("yarn")? as f64 / orig).into());
                }
            }
            _ => {}
        }
        // Hugging Face writes absent options as null; serde reads a missing key as the default.
        obj.retain(|_, v| !v.is_null());
        let parsed: RopeScalingConfig = serde_json::from_value(Value::Object(obj)).map_err(|e| {
            let msg = e.to_string();
            let sub = if msg.starts_with("unknown variant") {
                "rope_type".to_string()
            } else {
                msg.split('`').nth(1).unwrap_or("").to_string()
            };
            err(&sub, format!("{msg} (rope_type `{kind}`)"))
        })?;
        Ok(match parsed {
            RopeScalingConfig::Default => None,
            other => Some(other),
        })
    }

    /// This scaling as a Hugging Face `rope_scaling` object (what [`RopeScalingConfig::from_hf`] reads back).
    /// `dynamic`'s original context is `max_position_embeddings` there, so it is not repeated.
    pub fn to_hf(&self) -> Value {
        let mut v = serde_json::to_value(self).unwrap_or(Value::Null);
        if let (RopeScalingConfig::Dynamic { .. }, Some(o)) = (self, v.as_object_mut()) {
            o.remove("original_max_position_embeddings");
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value, max: Option<usize>) -> Result<Option<RopeScalingConfig>> {
        RopeScalingConfig::from_hf(Path::new("config.json"), "rope_scaling", v.as_object().unwrap(), max, None)
    }

    #[test]
    fn every_type_parses_with_the_legacy_key_and_hf_defaults() {
        let l3 = parse(
            json!({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}),
            None,
        )
        .unwrap();
        assert!(matches!(l3, Some(RopeScalingConfig::Llama3 { original_max_position_embeddings: 8192, .. })));
        assert_eq!(parse(json!({"rope_type": "default", "rope_theta": 1e4}), None).unwrap(), None);
        let d = parse(json!({"rope_type": "dynamic", "factor": 2.0}), Some(4096)).unwrap();
        assert_eq!(d, Some(RopeScalingConfig::Dynamic { factor: 2.0, original_max_position_embeddings: 4096 }));
        let y = parse(json!({"rope_type": "yarn", "factor": 4.0, "attention_factor": null}), Some(2048)).unwrap();
        assert!(matches!(y, Some(RopeScalingConfig::Yarn { beta_fast: 32.0, truncate: true, .. })));
        let lr = parse(
            json!({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
                   "original_max_position_embeddings": 4096}),
            Some(131072),
        )
        .unwrap();
        assert!(matches!(lr, Some(RopeScalingConfig::Longrope { factor: 32.0, .. })), "{lr:?}");
        let lin = Some(RopeScalingConfig::Linear { factor: 2.0 });
        assert_eq!(parse(lin.as_ref().unwrap().to_hf(), None).unwrap(), lin);
    }

    #[test]
    fn unknown_types_and_keys_are_errors_naming_them() {
        let e = parse(json!({"rope_type": "su", "factor": 2.0}), None).unwrap_err().to_string();
        assert!(e.contains("rope_scaling.rope_type") && e.contains("su"), "{e}");
        let e = parse(json!({"rope_type": "linear", "factor": 2.0, "beta": 3}), None).unwrap_err().to_string();
        assert!(e.contains("rope_scaling.beta"), "{e}");
        let e = parse(json!({"rope_type": "yarn", "factor": 2.0}), None).unwrap_err().to_string();
        assert!(e.contains("max_position_embeddings"), "{e}");
    }
}

impl RopeScalingConfig {
    /// Parses the command line's `--rope-scaling`: `none`, `linear:F`, `ntk:F[,ORIG]` (Hugging Face's dynamic
    /// NTK), `yarn:F[,ORIG]` or `llama3:F[,LOW,HIGH[,ORIG]]` (low 1, high 4 by default). `ORIG`, the context
    /// the model was trained at, defaults to `original` (the checkpoint's `max_position_embeddings`).
    ///
    /// Errors: an unknown type, a value that is not a number, or no original context to scale from.
    pub fn parse_cli(spec: &str, original: Option<usize>) -> Result<Option<RopeScalingConfig>> {
        let bad = |why: String| TrainError::InvalidOption {
            option: "--rope-scaling".into(),
            detail: format!("{spec}: {why}"),
        };
        if spec == "none" {
            return Ok(None);
        }
        let (kind, args) = spec.split_once(':').ok_or_else(|| bad("expected TYPE:FACTOR, e.g. linear:4".into()))?;
        let nums: Vec<f64> = args
            .split(',')
            .map(|a| a.trim().parse::<f64>().map_err(|_| bad(format!("`{a}` is not a number"))))
            .collect::<Result<_>>()?;
        let factor = nums[0];
        let orig = |at: usize| -> Result<usize> {
            match nums.get(at) {
                Some(&v) if v >= 1.0 && v.fract() == 0.0 => Ok(v as usize),
                Some(v) => Err(bad(format!("the original context {v} is not a whole number of tokens"))),
                None => original.ok_or_else(|| {
                    bad(format!("give the original context as {kind}:{factor},ORIG (the model names none)"))
                }),
            }
        };
        let want = |n: usize| -> Result<()> {
            if nums.len() > n {
                return Err(bad(format!("`{kind}` takes at most {n} values")));
            }
            Ok(())
        };
        Ok(Some(match kind {
            "linear" => {
                want(1)?;
                RopeScalingConfig::Linear { factor }
            }
            "ntk" | "dynamic" => {
                want(2)?;
                RopeScalingConfig::Dynamic { factor, original_max_position_embeddings: orig(1)? }
            }
            "yarn" => {
                want(2)?;
                RopeScalingConfig::Yarn {
                    factor,
                    original_max_position_embeddings: orig(1)?,
                    beta_fast: default_beta_fast(),
                    beta_slow: default_beta_slow(),
                    attention_factor: None,
                    mscale: None,
                    mscale_all_dim: None,
                    truncate: default_truncate(),
                }
            }
            "llama3" => {
                want(4)?;
                let (low, high) = (nums.get(1).copied().unwrap_or(1.0), nums.get(2).copied().unwrap_or(4.0));
                RopeScalingConfig::Llama3 {
                    factor,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: orig(3)?,
                }
            }
            other => return Err(bad(format!("unknown type `{other}` (none, linear, ntk, yarn, llama3)"))),
        }))
    }
}

#[cfg(test)]
mod cli_tests {
    use super::*;

    #[test]
    fn the_command_line_forms_parse_and_bad_ones_name_the_problem() {
        assert_eq!(RopeScalingConfig::parse_cli("none", None).unwrap(), None);
        assert_eq!(
            RopeScalingConfig::parse_cli("linear:4", None).unwrap(),
            Some(RopeScalingConfig::Linear { factor: 4.0 })
        );
        assert_eq!(
            RopeScalingConfig::parse_cli("ntk:2", Some(8192)).unwrap(),
            Some(RopeScalingConfig::Dynamic { factor: 2.0, original_max_position_embeddings: 8192 })
        );
        let Some(RopeScalingConfig::Yarn { factor, original_max_position_embeddings: o, beta_fast, .. }) =
            RopeScalingConfig::parse_cli("yarn:4,4096", Some(8192)).unwrap()
        else {
            panic!("yarn")
        };
        assert_eq!((factor, o, beta_fast), (4.0, 4096, 32.0));
        assert_eq!(
            RopeScalingConfig::parse_cli("llama3:8", Some(8192)).unwrap(),
            Some(RopeScalingConfig::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192
            })
        );
        for (spec, says) in [
            ("linear", "TYPE:FACTOR"),
            ("linear:x", "`x` is not a number"),
            ("ntk:2", "original context"),
            ("rope:2", "unknown type `rope`"),
            ("linear:2,3", "at most 1"),
        ] {
            let e = RopeScalingConfig::parse_cli(spec, None).unwrap_err().to_string();
            assert!(e.contains(says), "{spec}: {e}");
        }
    }
}
