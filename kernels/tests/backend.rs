//! The `Backend` interface: every op through `CpuBackend` over views, each test body run for every SIMD path
//! this CPU has, against the f64 attention reference or plain f64 loops; the views' checks give typed errors;
//! what a forward saves has the size its `bytes_for` states.

use half::bf16;
use longctx_kernels::attention::reference;
use longctx_kernels::cpu::SimdPath;
use longctx_kernels::testing::{max_rel_err, uniform_nonzero};
use longctx_kernels::{
    AttnGrads, AttnMask, AttnOptions, AttnOut, AttnParams, AttnPartial, AttnSaved, Backend, Buffer, CpuBackend, DType,
    Dims, GradMode, HostVec, KernelError, LayerNormSaved, LinearGrads, LinearSaved, NormGrads, NormParams, Qkv,
    RmsNormSaved, SwigluSaved, View, ViewMut,
};

/// Runs `body` once per SIMD path this CPU supports, each on its own backend.
fn for_each_path(body: impl Fn(&CpuBackend)) {
    for path in [SimdPath::Portable, SimdPath::Avx2, SimdPath::Avx512] {
        let b = CpuBackend::new().with_simd(path);
        if b.simd() == path {
            body(&b);
        }
    }
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

#[test]
fn attention_through_the_backend_matches_the_f64_reference() {
    for_each_path(|cpu| {
        let (b, hq, hkv, s, d) = (1, 4, 2, 200, 64);
        let (qd, kd, ld) = ([b, hq, s, d], [b, hkv, s, d], [b, hq, s]);
        let q = uniform_nonzero(b * hq * s * d, 1);
        let k = uniform_nonzero(b * hkv * s * d, 2);
        let v = uniform_nonzero(b * hkv * s * d, 3);
        let dout = uniform_nonzero(b * hq * s * d, 4);
        let opts = AttnOptions::new(AttnMask::causal().with_window(90));
        let qkv = Qkv::new(View::new(&q, qd).unwrap(), View::new(&k, kd).unwrap(), View::new(&v, kd).unwrap());
        let (mut o, mut lse) = (vec![0f32; q.len()], vec![0f32; b * hq * s]);
        let out = AttnOut { o: ViewMut::new(&mut o, qd).unwrap(), lse: ViewMut::new(&mut lse, ld).unwrap() };
        cpu.attention_forward(&opts, out, qkv).unwrap();

        let shape = qkv.shape().unwrap();
        let p = AttnParams::new(shape).with_mask(opts.mask);
        let (o_ref, lse_ref) = reference::forward(&p, &f64s(&q), &f64s(&k), &f64s(&v));
        assert!(max_rel_err(&o, &o_ref) < 1e-5, "{:?}: O", cpu.simd());
        assert!(max_rel_err(&lse, &lse_ref) < 1e-5, "{:?}: LSE", cpu.simd());

        let (mut dq, mut dk, mut dv) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()]);
        let saved = AttnSaved { qkv, o: View::new(&o, qd).unwrap(), lse: View::new(&lse, ld).unwrap() };
        assert_eq!(saved.bytes(), AttnSaved::bytes_for(&shape, DType::F32));
        let grads = AttnGrads {
            dq: ViewMut::new(&mut dq, qd).unwrap(),
            dk: ViewMut::new(&mut dk, kd).unwrap(),
            dv: ViewMut::new(&mut dv, kd).unwrap(),
        };
        cpu.attention_backward(&opts, grads, View::new(&dout, qd).unwrap(), saved, GradMode::Overwrite).unwrap();
        let (dq_ref, dk_ref, dv_ref) = reference::backward(&p, &f64s(&q), &f64s(&k), &f64s(&v), &f64s(&dout));
        assert!(max_rel_err(&dq, &dq_ref) < 1e-4, "{:?}: dQ", cpu.simd());
        assert!(max_rel_err(&dk, &dk_ref) < 1e-4, "{:?}: dK", cpu.simd());
        assert!(max_rel_err(&dv, &dv_ref) < 1e-4, "{:?}: dV", cpu.simd());
    });
}

#[test]
fn merging_two_key_blocks_through_the_backend_is_attention_over_both() {
    let cpu = CpuBackend::new();
    let (s, d) = (64, 32);
    let (qd, ld) = ([1, 1, s, d], [1, 1, s]);
    let q = uniform_nonzero(s * d, 7);
    let kv = uniform_nonzero(2 * s * d, 8);
    let block = |half: usize| {
        let k = &kv[half * s * d..(half + 1) * s * d];
        let qkv = Qkv::new(View::new(&q, qd).unwrap(), View::new(k, qd).unwrap(), View::new(k, qd).unwrap());
        let (mut o, mut lse) = (vec![0f32; s * d], vec![0f32; s]);
        let out = AttnOut { o: ViewMut::new(&mut o, qd).unwrap(), lse: ViewMut::new(&mut lse, ld).unwrap() };
        cpu.attention_forward(&AttnOptions::default(), out, qkv).unwrap();
        (o, lse)
    };
    let ((mut o, mut lse), (o2, lse2)) = (block(0), block(1));
    let acc = AttnOut { o: ViewMut::new(&mut o, qd).unwrap(), lse: ViewMut::new(&mut lse, ld).unwrap() };
    cpu.attention_merge(acc, AttnPartial { o: View::new(&o2, qd).unwrap(), lse: View::new(&lse2, ld).unwrap() })
        .unwrap();
    let p = AttnParams::new(longctx_kernels::AttnShape {
        batch: 1,
        q_heads: 1,
        kv_heads: 1,
        q_len: s,
        kv_len: 2 * s,
        head_dim: d,
    });
    let (o_ref, lse_ref) = reference::forward(&p, &f64s(&q), &f64s(&kv), &f64s(&kv));
    assert!(max_rel_err(&o, &o_ref) < 1e-5);
    assert!(max_rel_err(&lse, &lse_ref) < 1e-5);
}

#[test]
fn views_that_disagree_are_typed_errors_naming_the_argument() {
    let cpu = CpuBackend::new();
    let q = vec![0.1f32; 2 * 64 * 32];
    let k = vec![0.1f32; 64 * 32];
    let kb = vec![bf16::from_f32(0.1); 2 * 64 * 32];
    let (mut o, mut lse) = (vec![0f32; q.len()], vec![0f32; 2 * 64]);
    let qd = [1, 2, 64, 32];
    let opts = AttnOptions::default();
    // A view whose dims do not match its length never exists.
    assert!(matches!(View::new(&q, [1, 2, 64, 31]), Err(KernelError::Shape(_))));
    // K with another head dim than Q.
    let qkv = Qkv::new(
        View::new(&q, qd).unwrap(),
        View::new(&k, [1, 1, 32, 64]).unwrap(),
        View::new(&k, [1, 1, 32, 64]).unwrap(),
    );
    let out = AttnOut { o: ViewMut::new(&mut o, qd).unwrap(), lse: ViewMut::new(&mut lse, [1, 2, 64]).unwrap() };
    let e = cpu.attention_forward(&opts, out, qkv).unwrap_err();
    assert!(matches!(&e, KernelError::Shape(m) if m.contains("`k`")), "{e}");
    // V in bf16 beside f32 Q and K.
    let qkv = Qkv::new(View::new(&q, qd).unwrap(), View::new(&q, qd).unwrap(), View::new(&kb, qd).unwrap());
    let out = AttnOut { o: ViewMut::new(&mut o, qd).unwrap(), lse: ViewMut::new(&mut lse, [1, 2, 64]).unwrap() };
    let e = cpu.attention_forward(&opts, out, qkv).unwrap_err();
    assert!(matches!(e, KernelError::DType { name: "v", .. }), "{e}");
    // LSE with the wrong dims.
    let qkv = Qkv::new(View::new(&q, qd).unwrap(), View::new(&q, qd).unwrap(), View::new(&q, qd).unwrap());
    let out = AttnOut { o: ViewMut::new(&mut o, qd).unwrap(), lse: ViewMut::new(&mut lse, [2, 64]).unwrap() };
    let e = cpu.attention_forward(&opts, out, qkv).unwrap_err();
    assert!(matches!(&e, KernelError::Shape(m) if m.contains("`lse`")), "{e}");
    // A linear layer whose weight does not fit the input.
    let (x, w) = (vec![1f32; 6], vec![1f32; 8]);
    let mut y = vec![0f32; 4];
    let e = cpu
        .linear_forward(
            ViewMut::new(&mut y, [2, 2]).unwrap(),
            View::new(&x, [2, 3]).unwrap(),
            View::new(&w, [2, 4]).unwrap(),
            None,
        )
        .unwrap_err();
    assert!(matches!(e, KernelError::Shape(_)), "{e}");
}

#[test]
fn linear_matmul_and_norms_through_the_backend_match_f64_loops() {
    let cpu = CpuBackend::new();
    let (t, d_in, d_out) = (5, 7, 3);
    let x = uniform_nonzero(t * d_in, 11);
    let w = uniform_nonzero(d_out * d_in, 12);
    let bias = uniform_nonzero(d_out, 13);
    let dy = uniform_nonzero(t * d_out, 14);
    let mut y = vec![0f32; t * d_out];
    let (xv, wv) = (View::new(&x, [t, d_in]).unwrap(), View::new(&w, [d_out, d_in]).unwrap());
    cpu.linear_forward(ViewMut::new(&mut y, [t, d_out]).unwrap(), xv, wv, Some(View::flat(&bias))).unwrap();
    let mut y_ref = vec![0f64; t * d_out];
    for i in 0..t {
        for o in 0..d_out {
            y_ref[i * d_out + o] =
                bias[o] as f64 + (0..d_in).map(|c| x[i * d_in + c] as f64 * w[o * d_in + c] as f64).sum::<f64>();
        }
    }
    assert!(max_rel_err(&y, &y_ref) < 1e-6);
    assert_eq!(LinearSaved { x: xv }.bytes(), LinearSaved::bytes_for(t, d_in, DType::F32));

    // Backward twice with Accumulate on dw: twice the gradient; dx is overwritten each time.
    let (mut dx, mut dw, mut db) = (vec![9f32; t * d_in], vec![0f32; d_out * d_in], vec![0f32; d_out]);
    for _ in 0..2 {
        let grads = LinearGrads {
            dx: Some(ViewMut::new(&mut dx, [t, d_in]).unwrap()),
            dw: ViewMut::new(&mut dw, [d_out, d_in]).unwrap(),
            dbias: Some(ViewMut::flat(&mut db)),
        };
        cpu.linear_backward(
            grads,
            View::new(&dy, [t, d_out]).unwrap(),
            LinearSaved { x: xv },
            wv,
            GradMode::Accumulate,
        )
        .unwrap();
    }
    let dx_ref: Vec<f64> = (0..t * d_in)
        .map(|e| (0..d_out).map(|o| dy[e / d_in * d_out + o] as f64 * w[o * d_in + e % d_in] as f64).sum())
        .collect();
    let dw_ref: Vec<f64> = (0..d_out * d_in)
        .map(|e| 2.0 * (0..t).map(|i| dy[i * d_out + e / d_in] as f64 * x[i * d_in + e % d_in] as f64).sum::<f64>())
        .collect();
    assert!(max_rel_err(&dx, &dx_ref) < 1e-6);
    assert!(max_rel_err(&dw, &dw_ref) < 1e-6);

    // RMSNorm and LayerNorm forward against f64.
    let (n, ch) = (4, 16);
    let xn = uniform_nonzero(n * ch, 21);
    let g = uniform_nonzero(ch, 22);
    let be = uniform_nonzero(ch, 23);
    let (mut yr, mut rstd) = (vec![0f32; n * ch], vec![0f32; n]);
    let xnv = View::new(&xn, [n, ch]).unwrap();
    let p = NormParams { weight: View::flat(&g), bias: None, eps: 1e-5 };
    cpu.rmsnorm_forward(ViewMut::new(&mut yr, [n, ch]).unwrap(), ViewMut::flat(&mut rstd), xnv, &p).unwrap();
    let yr_ref: Vec<f64> = (0..n * ch)
        .map(|e| {
            let row = &xn[e / ch * ch..(e / ch + 1) * ch];
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / ch as f64;
            xn[e] as f64 / (ms + 1e-5).sqrt() * g[e % ch] as f64
        })
        .collect();
    assert!(max_rel_err(&yr, &yr_ref) < 1e-6);
    let saved = RmsNormSaved { x: xnv, rstd: View::flat(&rstd) };
    assert_eq!(saved.bytes(), RmsNormSaved::bytes_for(n, ch, DType::F32));
    let (mut dx, mut dg) = (vec![0f32; n * ch], vec![0f32; ch]);
    let grads = NormGrads { dx: ViewMut::new(&mut dx, [n, ch]).unwrap(), dweight: ViewMut::flat(&mut dg), dbias: None };
    cpu.rmsnorm_backward(grads, View::new(&yr, [n, ch]).unwrap(), saved, View::flat(&g), GradMode::Overwrite).unwrap();
    assert!(dx.iter().chain(&dg).all(|v| v.is_finite()) && dg.iter().any(|&v| v != 0.0));

    let (mut yl, mut mean, mut rstd) = (vec![0f32; n * ch], vec![0f32; n], vec![0f32; n]);
    let p = NormParams { weight: View::flat(&g), bias: Some(View::flat(&be)), eps: 1e-5 };
    cpu.layernorm_forward(
        ViewMut::new(&mut yl, [n, ch]).unwrap(),
        ViewMut::flat(&mut mean),
        ViewMut::flat(&mut rstd),
        xnv,
        &p,
    )
    .unwrap();
    let yl_ref: Vec<f64> = (0..n * ch)
        .map(|e| {
            let row: Vec<f64> = xn[e / ch * ch..(e / ch + 1) * ch].iter().map(|&v| v as f64).collect();
            let mu = row.iter().sum::<f64>() / ch as f64;
            let var = row.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / ch as f64;
            (xn[e] as f64 - mu) / (var + 1e-5).sqrt() * g[e % ch] as f64 + be[e % ch] as f64
        })
        .collect();
    assert!(max_rel_err(&yl, &yl_ref) < 1e-5);
    let saved = LayerNormSaved { x: xnv, mean: View::flat(&mean), rstd: View::flat(&rstd) };
    assert_eq!(saved.bytes(), LayerNormSaved::bytes_for(n, ch, DType::F32));
    // RMSNorm takes no bias: a typed error, not a silently ignored argument.
    let p = NormParams { weight: View::flat(&g), bias: Some(View::flat(&be)), eps: 1e-5 };
    let e = cpu.rmsnorm_forward(ViewMut::new(&mut yr, [n, ch]).unwrap(), ViewMut::flat(&mut rstd), xnv, &p);
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "bias", .. })));
}

#[test]
fn swiglu_copy_add_scale_and_sum_squares_through_the_backend() {
    let cpu = CpuBackend::new();
    let (n, f) = (3, 40);
    let gate = uniform_nonzero(n * f, 31);
    let up = uniform_nonzero(n * f, 32);
    let mut out = vec![0f32; n * f];
    let (gv, uv) = (View::new(&gate, [n, f]).unwrap(), View::new(&up, [n, f]).unwrap());
    cpu.swiglu_forward(ViewMut::new(&mut out, [n, f]).unwrap(), gv, uv).unwrap();
    let want: Vec<f64> =
        gate.iter().zip(&up).map(|(&g, &u)| g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64).collect();
    assert!(max_rel_err(&out, &want) < 1e-6);
    assert_eq!(SwigluSaved { gate: gv, up: uv }.bytes(), SwigluSaved::bytes_for(n, f, DType::F32));

    // copy widens and narrows; add accumulates; scale multiplies; sum_squares is Σx² in f64.
    let mut b16 = vec![bf16::ZERO; n * f];
    cpu.copy(ViewMut::new(&mut b16, [n, f]).unwrap(), gv).unwrap();
    assert!(b16.iter().zip(&gate).all(|(b, &g)| *b == bf16::from_f32(g)));
    let mut acc = gate.clone();
    cpu.add(ViewMut::new(&mut acc, [n, f]).unwrap(), uv).unwrap();
    cpu.scale(ViewMut::flat(&mut acc), 0.5).unwrap();
    assert!(acc.iter().zip(gate.iter().zip(&up)).all(|(a, (&g, &u))| *a == (g + u) * 0.5));
    let ss = cpu.sum_squares(&[gv, uv]).unwrap();
    let want: f64 = gate.iter().chain(&up).map(|&v| (v as f64).powi(2)).sum();
    assert!((ss - want).abs() < 1e-9 * want);
    let e = cpu.add(ViewMut::new(&mut acc, [f, n]).unwrap(), uv).unwrap_err();
    assert!(matches!(e, KernelError::Shape(_)));
    let z = cpu.zeros(DType::Bf16, Dims::new(&[2, 3]).unwrap()).unwrap();
    assert_eq!((z.dims(), z.dtype(), z.bytes()), (&[2, 3][..], DType::Bf16, 12));
}

#[test]
fn the_cuda_backend_exists_in_every_build_and_says_why_it_cannot_start() {
    match longctx_kernels::CudaBackend::new(0) {
        Err(KernelError::NotCompiled { feature: "cuda", .. }) => {
            eprintln!("cuda: not compiled (no `cuda` feature): skipped")
        }
        Err(KernelError::NoDevice { why, .. }) => eprintln!("cuda: {why}: skipped"),
        other => panic!("unexpected: {other:?}"),
    }
}

#[test]
fn transpose12_swaps_the_middle_dims_and_round_trips_through_bf16() {
    let cpu = CpuBackend::new();
    let (a, b, c, d) = (2, 3, 5, 4);
    let x: Vec<f32> = (0..a * b * c * d).map(|i| i as f32).collect();
    let mut y = vec![0f32; x.len()];
    cpu.transpose12(ViewMut::new(&mut y, [a, c, b, d]).unwrap(), View::new(&x, [a, b, c, d]).unwrap()).unwrap();
    for (ai, bi, ci, di) in (0..a)
        .flat_map(|ai| (0..b).flat_map(move |bi| (0..c).flat_map(move |ci| (0..d).map(move |di| (ai, bi, ci, di)))))
    {
        assert_eq!(y[((ai * c + ci) * b + bi) * d + di], x[((ai * b + bi) * c + ci) * d + di]);
    }
    let mut back = vec![bf16::ZERO; x.len()];
    cpu.transpose12(ViewMut::new(&mut back, [a, b, c, d]).unwrap(), View::new(&y, [a, c, b, d]).unwrap()).unwrap();
    assert!(back.iter().zip(&x).all(|(p, q)| p.to_f32() == *q), "small integers are exact in bf16");
    let err = cpu.transpose12(ViewMut::new(&mut y, [a, b, c, d]).unwrap(), View::new(&x, [a, b, c, d]).unwrap());
    assert!(matches!(err, Err(KernelError::Shape(_))), "{err:?}");
}

#[test]
fn release_scratch_frees_the_bf16_buffers_and_changes_no_result() {
    let pool = std::sync::Arc::new(rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap());
    for cpu in [CpuBackend::new(), CpuBackend::with_pool(pool)] {
        let (m, k, n) = (70, 40, 300);
        let a: Vec<bf16> = uniform_nonzero(m * k, 41).into_iter().map(bf16::from_f32).collect();
        let b: Vec<bf16> = uniform_nonzero(n * k, 42).into_iter().map(bf16::from_f32).collect();
        let run = || {
            let mut c = vec![bf16::ZERO; m * n];
            let (av, bv) = (View::new(&a, [m, k]).unwrap(), View::new(&b, [n, k]).unwrap());
            cpu.linear_forward(ViewMut::new(&mut c, [m, n]).unwrap(), av, bv, None).unwrap();
            c
        };
        let before = run();
        cpu.release_scratch();
        assert_eq!(run(), before, "{} threads", cpu.threads());
    }
}

#[test]
fn large_copies_run_on_the_pool_and_give_the_serial_elements() {
    // Past one parallel block (`2^14` elements) `copy` splits the work over the pool; every element must come
    // out as a serial copy gives it, in both dtypes and both directions of conversion, and large `zeros` are
    // zeros.
    let cpu = CpuBackend::new();
    let n = (1 << 14) * 3 + 5;
    for dt in [DType::F32, DType::Bf16] {
        let mut z = cpu.zeros(dt, Dims::new(&[n]).unwrap()).unwrap();
        assert_eq!(z.len(), n);
        let mut back = vec![1.0f32; n];
        cpu.copy(ViewMut::new(&mut back, [n]).unwrap(), z.view()).unwrap();
        assert!(back.iter().all(|&x| x == 0.0), "{dt:?}");
        let src: Vec<f32> = (0..n).map(|i| (i as f32 * 0.001).sin() * 3.0).collect();
        cpu.copy(z.view_mut(), View::new(&src, [n]).unwrap()).unwrap();
        cpu.copy(ViewMut::new(&mut back, [n]).unwrap(), z.view()).unwrap();
        let want: Vec<f32> = match dt {
            DType::F32 => src.clone(),
            DType::Bf16 => src.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
            DType::F16 => src.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
        };
        assert_eq!(back, want, "{dt:?}");
    }
    let src: Vec<bf16> = (0..n).map(|i| bf16::from_f32(i as f32 - 7.5)).collect();
    let mut dst = vec![bf16::ZERO; n];
    cpu.copy(ViewMut::new(&mut dst, [n]).unwrap(), View::new(&src, [n]).unwrap()).unwrap();
    assert_eq!(dst, src);
}

#[test]
fn a_reused_large_buffer_comes_back_zeroed_from_zeros_and_poisoned_from_empty_in_debug() {
    // A dropped buffer of 1 MiB or more is kept for the next one of its type and length: `zeros` must clear what
    // its last owner left, and `empty` (in debug builds, so in this suite) fills it with NaN, so an op that left
    // part of an output unwritten would show. Small buffers take the other path; both are checked.
    let cpu = CpuBackend::new();
    for (dt, n) in [(DType::F32, 300_000), (DType::Bf16, 600_000), (DType::F32, 1000)] {
        let dims = Dims::new(&[n]).unwrap();
        for _ in 0..3 {
            let mut dirty = cpu.zeros(dt, dims).unwrap();
            let ones = Buffer::from_host_vec(HostVec::F32(vec![1.0; n]), dims).unwrap();
            cpu.copy(dirty.view_mut(), ones.view()).unwrap();
            drop(dirty);
            let z = cpu.zeros(dt, dims).unwrap();
            assert!(z.view().as_host("z").unwrap().to_f32_vec().iter().all(|&x| x == 0.0), "{dt:?} × {n}: zeros");
            drop(z);
            let e = cpu.empty(dt, dims).unwrap();
            assert_eq!((e.dtype(), e.dims()), (dt, &[n][..]));
            if cfg!(debug_assertions) {
                assert!(
                    e.view().as_host("e").unwrap().to_f32_vec().iter().all(|x| x.is_nan()),
                    "{dt:?} × {n}: empty poisoned"
                );
            }
        }
    }
}
