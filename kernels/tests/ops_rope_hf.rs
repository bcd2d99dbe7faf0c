//! `RopeTable` against transformers: every `rope_type` Hugging Face configs carry (`default`, `linear`,
//! `dynamic`, `yarn`, `longrope`, `llama3`), inverse frequencies and attention factor as
//! `modeling_rope_utils.ROPE_INIT_FUNCTIONS` computes them (`data/rope_hf.txt`, made by `data/make_rope_hf.py`
//! with transformers 5.24). Transformers computes in f32, the table in f64: relative 1e-6.

use longctx_kernels::{RopeConfig, RopeScaling, RopeTable};

const REFERENCE: &str = include_str!("data/rope_hf.txt");

/// The scaling of each case of `make_rope_hf.py`, by name (the parameters the script gives transformers).
fn scaling(name: &str) -> RopeScaling {
    let short: Vec<f64> = (0..32).map(|i| 1.0 + 0.01 * i as f64).collect();
    let long: Vec<f64> = (0..32).map(|i| 1.0 + 0.5 * i as f64).collect();
    let longrope = |seq_len| RopeScaling::LongRope {
        short_factor: short.clone(),
        long_factor: long.clone(),
        // No `factor` in the config: max_position_embeddings / original_max_position_embeddings.
        factor: 16384.0 / 4096.0,
        original_max_position: 4096,
        seq_len,
        attention_factor: None,
    };
    match name {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: 4.0 },
        "dynamic-long" => RopeScaling::DynamicNtk { factor: 2.0, original_max_position: 2048, seq_len: 8192 },
        "dynamic-short" => RopeScaling::DynamicNtk { factor: 2.0, original_max_position: 2048, seq_len: 1024 },
        "yarn" => RopeScaling::Yarn {
            factor: 4.0,
            original_max_position: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            truncate: true,
        },
        "yarn-mscale" => RopeScaling::Yarn {
            factor: 8.0,
            original_max_position: 2048,
            beta_fast: 16.0,
            beta_slow: 2.0,
            attention_factor: Some(RopeScaling::yarn_mscale(8.0, 0.707, 0.5)),
            truncate: false,
        },
        "longrope-long" => longrope(8192),
        "longrope-short" => longrope(4096),
        "longrope-attn" => RopeScaling::LongRope {
            short_factor: vec![1.0; 32],
            long_factor: vec![2.0; 32],
            factor: 2.0,
            original_max_position: 4096,
            seq_len: 8192,
            attention_factor: Some(1.25),
        },
        "llama3" => RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        },
        other => panic!("no case {other} in the test: add it beside make_rope_hf.py's"),
    }
}

#[test]
fn every_hf_rope_type_matches_transformers() {
    let mut cases = 0;
    for line in REFERENCE.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (name, d, base): (&str, usize, f64) = (f[0], f[1].parse().unwrap(), f[2].parse().unwrap());
        let want_af: f64 = f[4].parse().unwrap();
        let want: Vec<f64> = f[5..].iter().map(|x| x.parse().unwrap()).collect();
        assert_eq!(want.len(), d / 2, "{name}");
        let t = RopeTable::new(&RopeConfig { head_dim: d, base, scaling: scaling(name) }).unwrap();
        let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-30);
        assert!(
            rel(t.attention_factor(), want_af) < 1e-6,
            "{name}: attention factor {} vs {want_af}",
            t.attention_factor()
        );
        for (i, (&g, &w)) in t.inv_freq().iter().zip(&want).enumerate() {
            assert!(rel(g, w) < 1e-6, "{name}: inv_freq[{i}] = {g}, transformers {w}");
        }
        cases += 1;
    }
    assert_eq!(cases, 10);
}

#[test]
fn longrope_and_dynamic_refuse_bad_parameters() {
    let cfg = |scaling| RopeConfig { head_dim: 8, base: 1e4, scaling };
    let lr = |short: Vec<f64>| RopeScaling::LongRope {
        short_factor: short,
        long_factor: vec![1.0; 4],
        factor: 2.0,
        original_max_position: 16,
        seq_len: 8,
        attention_factor: None,
    };
    let e = RopeTable::new(&cfg(lr(vec![1.0; 3]))).unwrap_err().to_string();
    assert!(e.contains("short_factor") && e.contains("3 factors"), "{e}");
    assert!(RopeTable::new(&cfg(lr(vec![1.0, 0.0, 1.0, 1.0]))).is_err());
    let dynamic = RopeScaling::DynamicNtk { factor: 2.0, original_max_position: 0, seq_len: 8 };
    assert!(RopeTable::new(&cfg(dynamic)).is_err());
    // At or below the original context, dynamic NTK is plain RoPE.
    let short = RopeScaling::DynamicNtk { factor: 2.0, original_max_position: 16, seq_len: 16 };
    assert_eq!(
        RopeTable::new(&cfg(short)).unwrap().inv_freq(),
        RopeTable::new(&cfg(RopeScaling::None)).unwrap().inv_freq()
    );
}
