//! RoPE through the CPU backend against an f64 reference (inverse frequencies rederived from the Hugging Face
//! formulas), finite differences, and properties of the scalings.

mod ops_util;

use std::f64::consts::PI;

use longctx_kernels::{Backend, CpuBackend, Element, KernelError, RopeConfig, RopeScaling, RopeTable, View, ViewMut};
use ops_util::*;
use proptest::prelude::*;

/// Inverse frequencies and attention factor, following HF `modeling_rope_utils` line by line.
fn ref_inv_freq(d: usize, base: f64, sc: RopeScaling) -> (Vec<f64>, f64) {
    let plain = |base: f64| (0..d / 2).map(|i| 1.0 / base.powf((2 * i) as f64 / d as f64)).collect::<Vec<f64>>();
    match sc {
        RopeScaling::None => (plain(base), 1.0),
        RopeScaling::Linear { factor } => (plain(base).iter().map(|f| f / factor).collect(), 1.0),
        RopeScaling::NtkAware { factor } => (plain(base * factor.powf(d as f64 / (d as f64 - 2.0))), 1.0),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
            let old = original_max_position as f64;
            let (lw, hw) = (old / low_freq_factor, old / high_freq_factor);
            let mut out = vec![];
            for f in plain(base) {
                let wl = 2.0 * PI / f;
                let mut v = if wl > lw { f / factor } else { f };
                let smooth = (old / wl - low_freq_factor) / (high_freq_factor - low_freq_factor);
                let smoothed = (1.0 - smooth) * v / factor + smooth * v;
                if wl >= hw && wl <= lw {
                    v = smoothed;
                }
                out.push(v);
            }
            (out, 1.0)
        }
        RopeScaling::Yarn { factor, original_max_position, beta_fast, beta_slow, attention_factor, truncate } => {
            let af = attention_factor.unwrap_or(if factor <= 1.0 { 1.0 } else { 0.1 * factor.ln() + 1.0 });
            let dim = d as f64;
            let cd = |rot: f64| dim * (original_max_position as f64 / (rot * 2.0 * PI)).ln() / (2.0 * base.ln());
            let (mut lo, mut hi) = (cd(beta_fast), cd(beta_slow));
            if truncate {
                lo = lo.floor();
                hi = hi.ceil();
            }
            let (lo, mut hi) = (lo.max(0.0), hi.min(dim - 1.0));
            if lo == hi {
                hi += 0.001;
            }
            let mut out = vec![];
            for (i, pf) in (0..d / 2).map(|i| base.powf((2 * i) as f64 / dim)).enumerate() {
                let (ext, int) = (1.0 / pf, 1.0 / (factor * pf));
                let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                let ef = 1.0 - ramp;
                out.push(int * (1.0 - ef) + ext * ef);
            }
            (out, af)
        }
        RopeScaling::DynamicNtk { factor, original_max_position, seq_len } => {
            let (s, s0) = (seq_len.max(original_max_position) as f64, original_max_position as f64);
            (plain(base * (factor * s / s0 - (factor - 1.0)).powf(d as f64 / (d as f64 - 2.0))), 1.0)
        }
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            factor,
            original_max_position,
            seq_len,
            attention_factor,
        } => {
            let ext = if seq_len > original_max_position { long_factor } else { short_factor };
            let af = attention_factor.unwrap_or(if factor <= 1.0 {
                1.0
            } else {
                (1.0 + factor.ln() / (original_max_position as f64).ln()).sqrt()
            });
            (plain(base).iter().zip(ext).map(|(f, e)| f / e).collect(), af)
        }
    }
}

/// y = m · R(θ) x for [B,H,S,D] (half-split pairing).
fn ref_rope(x: &[f64], pos: &[i64], inv: &[f64], af: f64, bh: usize, d: usize) -> Vec<f64> {
    let (s_len, half) = (pos.len(), d / 2);
    let mut y = vec![0.0; x.len()];
    for r in 0..bh * s_len {
        let p = pos[r % s_len] as f64;
        for i in 0..half {
            let (c, s) = ((p * inv[i]).cos() * af, (p * inv[i]).sin() * af);
            let (x1, x2) = (x[r * d + i], x[r * d + i + half]);
            y[r * d + i] = x1 * c - x2 * s;
            y[r * d + i + half] = x2 * c + x1 * s;
        }
    }
    y
}
/// dx = m · R(θ)ᵀ dy.
fn ref_rope_bwd(dy: &[f64], pos: &[i64], inv: &[f64], af: f64, bh: usize, d: usize) -> Vec<f64> {
    let neg: Vec<i64> = pos.iter().map(|p| -p).collect();
    ref_rope(dy, &neg, inv, af, bh, d)
}

fn scaling(kind: u8, factor: f64, d: usize) -> RopeScaling {
    match kind {
        0 => RopeScaling::None,
        1 => RopeScaling::Linear { factor },
        2 if d > 2 => RopeScaling::NtkAware { factor },
        2 => RopeScaling::None,
        3 => RopeScaling::Llama3 { factor, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 64 },
        6 if d > 2 => {
            RopeScaling::DynamicNtk { factor, original_max_position: 64, seq_len: 64 + (factor * 40.0) as usize }
        }
        6 => RopeScaling::None,
        7 => RopeScaling::LongRope {
            short_factor: (0..d / 2).map(|i| 1.0 + 0.1 * i as f64).collect(),
            long_factor: (0..d / 2).map(|i| factor * (1.0 + i as f64)).collect(),
            factor,
            original_max_position: 64,
            seq_len: if factor > 8.0 { 128 } else { 64 },
            attention_factor: None,
        },
        _ => RopeScaling::Yarn {
            factor,
            original_max_position: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            truncate: kind & 1 == 0,
        },
    }
}

#[allow(clippy::too_many_arguments)]
fn rope_case<T: Element>(b: usize, h: usize, d: usize, pos: Vec<i64>, base: f64, sc: RopeScaling, seed: u64) {
    let table = RopeTable::new(&RopeConfig { head_dim: d, base, scaling: sc.clone() }).unwrap();
    let (inv, af) = ref_inv_freq(d, base, sc);
    assert_close_f64("inv_freq", table.inv_freq(), &inv, 1e-12);
    assert!((table.attention_factor() - af).abs() < 1e-12);
    let n = b * h * pos.len() * d;
    let mut r = DataRng::new(seed);
    let x = rounded::<T>(&r.vec(n, 1.0));
    let dy = rounded::<T>(&r.vec(n, 1.0));
    let cpu = CpuBackend::new();
    let dims = [b, h, pos.len(), d];
    let mut y = to_t::<T>(&x);
    cpu.rope_forward(&table, view_mut(&mut y, dims), &pos).unwrap();
    assert_close("rope y", &y, &ref_rope(&x, &pos, &inv, af, b * h, d));
    let mut dx = to_t::<T>(&dy);
    cpu.rope_backward(&table, view_mut(&mut dx, dims), &pos).unwrap();
    let dx_ref = ref_rope_bwd(&dy, &pos, &inv, af, b * h, d);
    if n <= 512 {
        let fx = fd_grad(|v| dot(&dy, &ref_rope(v, &pos, &inv, af, b * h, d)), &x, 1e-4);
        assert_fd("fd rope dx", &fx, &dx_ref, 1e-8);
    }
    assert_close("rope dx", &dx, &dx_ref);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(48)))]

    #[test]
    fn rope_matches_reference(
        b in 1usize..3, h in 1usize..4, half in 1usize..17,
        pos in prop::collection::vec(-50i64..200_000, 1..9),
        base in prop::sample::select(vec![10_000.0, 500_000.0]),
        kind in 0u8..8, factor in 1.5f64..16.0, bf: bool, seed: u64,
    ) {
        let d = 2 * half;
        both!(bf, rope_case(b, h, d, pos.clone(), base, scaling(kind, factor, d), seed));
    }
}

#[test]
fn backward_inverts_forward_without_attention_factor() {
    let t = RopeTable::new(&RopeConfig { head_dim: 8, base: 10_000.0, scaling: RopeScaling::Linear { factor: 4.0 } })
        .unwrap();
    let pos = [3i64, 17, 1_000_000, 9];
    let x = DataRng::new(5).vec(2 * 4 * 8, 1.0).iter().map(|&v| v as f32).collect::<Vec<f32>>();
    let mut z = x.clone();
    let cpu = CpuBackend::new();
    cpu.rope_forward(&t, view_mut(&mut z, [1, 2, 4, 8]), &pos).unwrap();
    cpu.rope_backward(&t, view_mut(&mut z, [1, 2, 4, 8]), &pos).unwrap();
    let e = rel_err(&z.iter().map(|&v| v as f64).collect::<Vec<_>>(), &x.iter().map(|&v| v as f64).collect::<Vec<_>>());
    assert!(e < 1e-6, "{e}");
}

#[test]
fn one_table_rotates_each_call_by_its_own_positions() {
    // The table keeps the angles of the last positions: alternating positions (a context-parallel rank's two
    // zigzag halves, or a new sequence length) must still rotate by each call's own angles.
    let cfg = RopeConfig { head_dim: 8, base: 10_000.0, scaling: RopeScaling::None };
    let (shared, cpu) = (RopeTable::new(&cfg).unwrap(), CpuBackend::new());
    let x: Vec<f32> = (0..2 * 3 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
    let sets: [&[i64]; 4] = [&[0, 1, 2], &[7, 100, 3], &[0, 1, 2], &[5, 6, 7]];
    for pos in sets {
        let fresh = RopeTable::new(&cfg).unwrap();
        let (mut a, mut b) = (x.clone(), x.clone());
        cpu.rope_forward(&shared, view_mut(&mut a, [1, 2, 3, 8]), pos).unwrap();
        cpu.rope_forward(&fresh, view_mut(&mut b, [1, 2, 3, 8]), pos).unwrap();
        assert_eq!(a, b, "positions {pos:?}");
        assert_eq!(shared.cos_sin(pos), fresh.cos_sin(pos));
    }
}

#[test]
fn linear_scaling_is_position_interpolation() {
    let plain = RopeTable::new(&RopeConfig { head_dim: 16, base: 10_000.0, scaling: RopeScaling::None }).unwrap();
    let lin =
        RopeTable::new(&RopeConfig { head_dim: 16, base: 10_000.0, scaling: RopeScaling::Linear { factor: 4.0 } })
            .unwrap();
    let (c1, s1) = lin.cos_sin(&[40, 8, 400]);
    let (c2, s2) = plain.cos_sin(&[10, 2, 100]);
    for (a, b) in c1.iter().chain(&s1).zip(c2.iter().chain(&s2)) {
        assert!((a - b).abs() < 1e-6);
    }
}

#[test]
fn llama3_keeps_high_and_divides_low_frequencies() {
    // Llama 3.1: base 500000, D 128, factor 8, low 1, high 4, original 8192.
    let sc =
        RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 };
    let t = RopeTable::new(&RopeConfig { head_dim: 128, base: 500_000.0, scaling: sc }).unwrap();
    let plain = RopeTable::new(&RopeConfig { head_dim: 128, base: 500_000.0, scaling: RopeScaling::None }).unwrap();
    let (a, p) = (t.inv_freq(), plain.inv_freq());
    assert_eq!(a[0], p[0]);
    assert!((a[63] - p[63] / 8.0).abs() <= 1e-18);
    // Wavelength 2π/f between 8192/4 and 8192 is smoothed: strictly between f/8 and f.
    let mid = (0..64).find(|&i| {
        let wl = 2.0 * PI / p[i];
        (2048.0..=8192.0).contains(&wl)
    });
    let i = mid.expect("Llama 3.1 has a medium band");
    assert!(a[i] < p[i] && a[i] > p[i] / 8.0);
}

#[test]
fn yarn_attention_factor() {
    let sc = RopeScaling::Yarn {
        factor: 4.0,
        original_max_position: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: None,
        truncate: true,
    };
    let t = RopeTable::new(&RopeConfig { head_dim: 64, base: 10_000.0, scaling: sc }).unwrap();
    assert!((t.attention_factor() - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
    let (c, s) = t.cos_sin(&[0]);
    assert!((c[0] as f64 - t.attention_factor()).abs() < 1e-6 && s[0] == 0.0);
}

#[test]
fn bad_inputs_are_typed_errors() {
    let cfg = |head_dim, scaling| RopeConfig { head_dim, base: 10_000.0, scaling };
    assert!(matches!(
        RopeTable::new(&cfg(7, RopeScaling::None)),
        Err(KernelError::InvalidArgument { name: "head_dim", .. })
    ));
    assert_eq!(RopeTable::new(&cfg(0, RopeScaling::None)), Err(KernelError::ZeroDim("head_dim")));
    assert!(RopeTable::new(&cfg(8, RopeScaling::Linear { factor: 0.0 })).is_err());
    assert!(RopeTable::new(&cfg(8, RopeScaling::Linear { factor: f64::NAN })).is_err());
    assert!(RopeTable::new(&cfg(
        8,
        RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 4.0, high_freq_factor: 1.0, original_max_position: 10 }
    ))
    .is_err());
    assert!(RopeTable::new(&RopeConfig { head_dim: 8, base: -1.0, scaling: RopeScaling::None }).is_err());
    let t = RopeTable::new(&cfg(8, RopeScaling::None)).unwrap();
    let cpu = CpuBackend::new();
    let x = vec![1.0f32; 2 * 3 * 8];
    let mut y = vec![0.0f32; 2 * 3 * 8];
    // Two positions for a buffer of B = 2, H = 2 heads: 48 elements cannot be viewed as [2, 2, 2, 8] (the view
    // constructor refuses them), and viewed as the [2, 3, 1, 8] they fill, the backend finds that S is not the
    // number of positions: the slice kernel's `BufferLength` is a `Shape` error through views.
    assert!(matches!(View::new(&x, [2, 2, 2, 8]), Err(KernelError::Shape(_))));
    let e = cpu.rope_forward(&t, ViewMut::new(&mut y, [2, 3, 1, 8]).unwrap(), &[0, 1]);
    assert!(matches!(e, Err(KernelError::Shape(_))), "{e:?}");
    // No positions reach the kernel through empty [2, 3, 0, 8] views.
    let e = cpu.rope_forward(&t, ViewMut::new(&mut y[..0], [2, 3, 0, 8]).unwrap(), &[]);
    assert_eq!(e, Err(KernelError::ZeroDim("s")));
    // Eight elements for three positions: a `Shape` error through views, forward and backward.
    assert!(matches!(ViewMut::new(&mut y[..8], [2, 1, 3, 8]), Err(KernelError::Shape(_))));
    let e = cpu.rope_forward(&t, ViewMut::new(&mut y[..8], [1, 1, 1, 8]).unwrap(), &[0, 1, 2]);
    assert!(matches!(e, Err(KernelError::Shape(_))), "{e:?}");
    let e = cpu.rope_backward(&t, ViewMut::new(&mut y[..8], [1, 1, 1, 8]).unwrap(), &[0, 1, 2]);
    assert!(matches!(e, Err(KernelError::Shape(_))), "{e:?}");
    assert_eq!(x, vec![1.0f32; 2 * 3 * 8]);
}

/// Partial rotary (Nemotron, `partial_rotary_factor`): the first `R` dims of each head rotate with the
/// frequencies of an `R`-wide head; the rest pass through, in the forward and the backward.
#[test]
fn partial_rotary_rotates_the_first_dims_and_passes_the_rest() {
    let (b, h, d, rd) = (1, 3, 16, 8);
    let pos: Vec<i64> = vec![0, 5, 2, 9, 100];
    let cfg = RopeConfig { head_dim: d, base: 10_000.0, scaling: RopeScaling::None };
    let t = RopeTable::with_rotary_dim(&cfg, rd).unwrap();
    assert_eq!((t.head_dim(), t.rotary_dim()), (d, rd));
    let (inv, _) = ref_inv_freq(rd, 10_000.0, RopeScaling::None);
    assert_close_f64("partial inv_freq", t.inv_freq(), &inv, 1e-12);
    let n = b * h * pos.len() * d;
    let mut r = DataRng::new(5);
    let (x, dy) = (rounded::<f32>(&r.vec(n, 1.0)), rounded::<f32>(&r.vec(n, 1.0)));
    // Reference: rotate each row's first rd dims as an rd-wide head; copy the rest.
    let part = |v: &[f64], pos: &[i64]| -> Vec<f64> {
        let mut out = v.to_vec();
        for (ri, row) in v.chunks(d).enumerate() {
            let y = ref_rope(&row[..rd], &pos[ri % pos.len()..ri % pos.len() + 1], &inv, 1.0, 1, rd);
            out[ri * d..ri * d + rd].copy_from_slice(&y);
        }
        out
    };
    let neg: Vec<i64> = pos.iter().map(|p| -p).collect();
    let cpu = CpuBackend::new();
    let dims = [b, h, pos.len(), d];
    let mut y = to_t::<f32>(&x);
    cpu.rope_forward(&t, view_mut(&mut y, dims), &pos).unwrap();
    assert_close("partial rope y", &y, &part(&x, &pos));
    let mut dx = to_t::<f32>(&dy);
    cpu.rope_backward(&t, view_mut(&mut dx, dims), &pos).unwrap();
    let fd = fd_grad(|v| dot(&dy, &part(v, &pos)), &x, 1e-4);
    assert_fd("fd partial rope dx", &fd, &to_f64(&dx), 1e-6);
    assert_close("partial rope dx", &dx, &part(&dy, &neg));
    for bad in [0, 7, 18] {
        assert!(matches!(
            RopeTable::with_rotary_dim(&cfg, bad),
            Err(KernelError::ZeroDim(_)) | Err(KernelError::InvalidArgument { name: "rotary_dim", .. })
        ));
    }
}
