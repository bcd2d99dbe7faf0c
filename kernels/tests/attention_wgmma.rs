//! The wgmma attention kernels (`attention_forward_wgmma.cu`, `attention_backward_wgmma.cu`,
//! [`AttentionPath::Wgmma`]) on the CUDA backend: on the host emulator (`::cuda_emulated`, everywhere with a C++
//! compiler) and on an sm_90 GPU (`::cuda`, skipped with a message elsewhere). Checked three ways:
//! - the conformance suite's attention and non-finite families with the path forced (their 16-bit, head dim 64
//!   cases are the ones that reach it: GQA, zigzag positions, windows across documents, rows that see no key,
//!   poisoned outputs, accumulated gradients, a NaN or an infinity behind every kind of mask), against the f64
//!   reference and the CPU, with each way the backward computes dQ (`WgmmaBackward`);
//! - shapes past one warpgroup's 64 rows and one 64-key tile (two warpgroups per forward block, a second query
//!   block and a last key tile cut short, hidden and partial tiles skipped or masked), bf16 and f16, head dims 64
//!   and 128, outputs and gradients in the input type and in f32, each mask kind: forward and backward against the
//!   CPU backend;
//! - the same against the mma.sync path on the same device: its backward on the wgmma forward's O and LSE (on the
//!   emulator, whose products sum exactly and round once in both, to 1e-6; on a GPU to the 16-bit rounding of P and
//!   dS), and its forward (128-key tiles against 64: P rounded to 16 bits against other running maxima, O to 4e-3
//!   and LSE to 1e-5 on the emulator; 1e-2 on a GPU).

#[allow(unused_macros)] // test_device!: this file's tests need the backend itself, to force the path
mod common;

#[cfg(feature = "cuda")]
mod wgmma {
    use longctx_kernels::attention::{AttnGrads, AttnMask, AttnOut, AttnParams, AttnSaved, AttnShape, Positions, Qkv};
    use longctx_kernels::cuda::{AttentionPath, WgmmaBackward};
    use longctx_kernels::testing::conformance::{self, Config, Family};
    use longctx_kernels::testing::uniform_nonzero;
    use longctx_kernels::{Backend, Buffer, CpuBackend, CudaBackend, DType, Dims, GradMode, View, ViewMut};

    /// The device's backend with the wgmma path forced, or `None` (said on stderr) where it cannot run: no host
    /// compiler for the emulator; no GPU, or one other than sm_90, for `cuda`.
    fn backend(emulated: bool, test: &str) -> Option<CudaBackend> {
        let b = if emulated {
            crate::common::cuda_emulated_backend(test)?
        } else {
            let b = crate::common::cuda_backend(test)?;
            if !b.device_name().contains("sm_90") {
                eprintln!("{test}: skipped, the wgmma kernels are sm_90a code and this is {}", b.device_name());
                return None;
            }
            b
        };
        Some(b.with_attention_path(AttentionPath::Wgmma))
    }

    /// The inputs of one case, in f32 (each forward rounds them to its 16-bit type).
    struct Inputs {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        d_o: Vec<f32>,
    }

    /// `[O, LSE, dQ, dK, dV]` (as f32, whatever type the kernels wrote) of a forward and a backward of `p` on `b`:
    /// the inputs and dO rounded to `dt` on the backend, O and the gradients in `ot`. Outputs start as NaN, so an
    /// element not written shows.
    fn run(b: &dyn Backend, p: &AttnParams<'_>, x: &Inputs, dt: DType, ot: DType) -> Vec<Vec<f32>> {
        run_split(b, b, p, x, dt, ot)
    }

    /// [`run`] with the forward on `b` and the backward on `bwd` (another handle of the same device: the other
    /// attention path), so that two backwards compare on the same O and LSE.
    fn run_split(
        b: &dyn Backend,
        bwd: &dyn Backend,
        p: &AttnParams<'_>,
        x: &Inputs,
        dt: DType,
        ot: DType,
    ) -> Vec<Vec<f32>> {
        let s = p.shape;
        let dims = |d: &[usize]| Dims::new(d).unwrap();
        let input = |vals: &[f32], d: &[usize]| -> Buffer {
            let mut f = b.empty(DType::F32, dims(d)).unwrap();
            b.upload(f.view_mut(), View::new(vals, d).unwrap()).unwrap();
            let mut t = b.empty(dt, dims(d)).unwrap();
            b.copy(t.view_mut(), f.view()).unwrap();
            t
        };
        let poisoned = |t: DType, d: &[usize]| -> Buffer {
            let mut buf = b.empty(t, dims(d)).unwrap();
            b.fill(buf.view_mut(), f32::NAN).unwrap();
            buf
        };
        let (q, k, v) = (input(&x.q, &s.q_dims()), input(&x.k, &s.kv_dims()), input(&x.v, &s.kv_dims()));
        let d_o = input(&x.d_o, &s.q_dims());
        let (mut o, mut lse) = (poisoned(ot, &s.q_dims()), poisoned(DType::F32, &s.lse_dims()));
        let out = AttnOut { o: o.view_mut(), lse: lse.view_mut() };
        b.attention_forward(&p.options(), out, Qkv::new(q.view(), k.view(), v.view())).unwrap();
        let (mut dq, mut dk, mut dv) =
            (poisoned(ot, &s.q_dims()), poisoned(ot, &s.kv_dims()), poisoned(ot, &s.kv_dims()));
        let saved = AttnSaved { qkv: Qkv::new(q.view(), k.view(), v.view()), o: o.view(), lse: lse.view() };
        let grads = AttnGrads { dq: dq.view_mut(), dk: dk.view_mut(), dv: dv.view_mut() };
        bwd.attention_backward(&p.options(), grads, d_o.view(), saved, GradMode::Overwrite).unwrap();
        let download = |buf: &Buffer, d: &[usize]| -> Vec<f32> {
            let mut f = b.empty(DType::F32, dims(d)).unwrap();
            b.copy(f.view_mut(), buf.view()).unwrap();
            let mut host = vec![f32::NAN; d.iter().product()];
            b.download(ViewMut::new(&mut host, d).unwrap(), f.view()).unwrap();
            host
        };
        vec![
            download(&o, &s.q_dims()),
            download(&lse, &s.lse_dims()),
            download(&dq, &s.q_dims()),
            download(&dk, &s.kv_dims()),
            download(&dv, &s.kv_dims()),
        ]
    }

    /// Every element of `got` within `abs + rel·|want|` of `want` (−inf LSEs equal), else a panic naming the first.
    fn close(what: &str, got: &[f32], want: &[f32], abs: f32, rel: f32) {
        assert_eq!(got.len(), want.len(), "{what}");
        let bad: Vec<String> = got
            .iter()
            .zip(want)
            .enumerate()
            .filter(|(_, (g, w))| !(*g == *w || (*g - *w).abs() <= abs + rel * w.abs()))
            .take(5)
            .map(|(i, (g, w))| format!("[{i}] {g} against {w}"))
            .collect();
        assert!(bad.is_empty(), "{what}: {}", bad.join("; "));
    }

    /// The masks of the shape cases: none, causal with the queries at the end of the keys, a window both ways
    /// across documents, and a zigzag shard's explicit positions (causal).
    fn masks<'a>(
        sq: usize,
        sk: usize,
        pos: &'a (Vec<i64>, Vec<i64>),
        docs: &'a (Vec<u32>, Vec<u32>),
    ) -> Vec<AttnMask<'a>> {
        let end = Positions::Offset(sk as i64 - sq as i64);
        vec![
            AttnMask::default(),
            AttnMask::causal().with_positions(end, Positions::Offset(0)),
            AttnMask::default().with_positions(end, Positions::Offset(0)).with_window(37).with_docs(&docs.0, &docs.1),
            AttnMask::causal().with_positions(Positions::Explicit(&pos.0), Positions::Explicit(&pos.1)),
        ]
    }

    fn shapes_against_cpu_and_mma(emulated: bool, test: &str) {
        let Some(wg) = backend(emulated, test) else { return };
        let mma = wg.clone().with_attention_path(AttentionPath::Mma);
        let cpu = CpuBackend::new();
        // 130 queries: two warpgroups per block and a second block of 2 rows; 150 keys: three tiles, the last of
        // 22. Grouped queries, 4 over 2.
        let (sq, sk) = (130, 150);
        let at = |start: i64, n: usize| (start..start + n as i64).collect::<Vec<i64>>();
        let pos = ([at(0, sq / 2), at(300, sq - sq / 2)].concat(), [at(0, sk / 2), at(300, sk - sk / 2)].concat());
        let docs = ((0..sq).map(|i| ((i + sk - sq) / 60) as u32).collect(), (0..sk).map(|j| (j / 60) as u32).collect());
        // The GPU's products differ from the CPU's by the 16-bit rounding of P; the emulator's wgmma and mma.sync
        // are both exact sums rounded once (the module's docs: the forwards' key tiles differ).
        let against_mma = if emulated { 1e-6 } else { 1e-2 };
        let fwd_against_mma = if emulated { [4e-3, 1e-5] } else { [1e-2, 1e-2] };
        for (d, dt, ot) in [
            (64, DType::Bf16, DType::Bf16),
            (64, DType::F16, DType::F32),
            (128, DType::Bf16, DType::F32),
            (128, DType::F16, DType::F16),
        ] {
            let shape = AttnShape { batch: 1, q_heads: 4, kv_heads: 2, q_len: sq, kv_len: sk, head_dim: d };
            let seed = d as u64 + 7 * u64::from(ot == DType::F32);
            let x = Inputs {
                q: uniform_nonzero(shape.q_elems(), seed),
                k: uniform_nonzero(shape.kv_elems(), seed + 1),
                v: uniform_nonzero(shape.kv_elems(), seed + 2),
                d_o: uniform_nonzero(shape.q_elems(), seed + 3),
            };
            for (mi, mask) in masks(sq, sk, &pos, &docs).into_iter().enumerate() {
                let p = AttnParams::new(shape).with_mask(mask);
                let what = format!("d {d}, {dt:?} in, {ot:?} out, mask {mi}");
                let got = run(&wg, &p, &x, dt, ot);
                // The CPU on the same 16-bit inputs (it keeps P in f32), its outputs in f32.
                let cpu_out = run(&cpu, &p, &x, dt, DType::F32);
                let out_tol = match ot {
                    DType::Bf16 => 8e-3,
                    DType::F16 => 1e-3,
                    DType::F32 => 0.0,
                };
                let mma_fwd = run(&mma, &p, &x, dt, ot);
                let mma_out = run_split(&wg, &mma, &p, &x, dt, ot);
                for (n, name) in ["O", "LSE", "dQ", "dK", "dV"].into_iter().enumerate() {
                    // O is an average of values in [-1, 1), mostly below 0.1, its error from the 16-bit P up to
                    // 1e-3; the gradients sum more terms (dK, dV over the group's 260 queries) and are larger.
                    let abs = [3e-3, 1e-3, 1e-2, 2e-2, 2e-2][n];
                    let rel = if n == 1 { 1e-3 } else { 1e-2 + out_tol };
                    close(&format!("{name} against the CPU, {what}"), &got[n], &cpu_out[n], abs, rel);
                    let (want, tol) =
                        if n < 2 { (&mma_fwd[n], fwd_against_mma[n]) } else { (&mma_out[n], against_mma) };
                    close(&format!("{name} against mma.sync, {what}"), &got[n], want, tol, tol);
                }
            }
        }
    }

    /// The conformance suite's attention and non-finite families with the wgmma path forced (the emulator's
    /// budget: the quick configuration; a GPU's: the default).
    fn conformance_families(emulated: bool, test: &str) {
        let Some(wg) = backend(emulated, test) else { return };
        let cfg = if emulated { Config::quick().with_cases(6) } else { Config::default() };
        // Each way the wgmma backward computes dQ (the default, split, then the two one-kernel variants).
        for how in [WgmmaBackward::Split, WgmmaBackward::Ordered, WgmmaBackward::Atomic] {
            match conformance::check(
                &wg.clone().with_wgmma_backward(how),
                &cfg,
                &[Family::Attention, Family::NonFinite],
            ) {
                Ok(report) => eprintln!("{test} ({how:?}): {report}"),
                Err(failure) => panic!("{test} ({how:?}): {failure}"),
            }
        }
    }

    mod shapes {
        #[test]
        fn cuda_emulated() {
            super::shapes_against_cpu_and_mma(true, "wgmma::shapes::cuda_emulated");
        }
        #[test]
        fn cuda() {
            super::shapes_against_cpu_and_mma(false, "wgmma::shapes::cuda");
        }
    }

    mod conformance_families {
        #[test]
        fn cuda_emulated() {
            super::conformance_families(true, "wgmma::conformance_families::cuda_emulated");
        }
        #[test]
        fn cuda() {
            super::conformance_families(false, "wgmma::conformance_families::cuda");
        }
    }

    /// The path's name from the environment, and a backend's own choice over it.
    #[test]
    fn the_path_is_the_backends_choice() {
        let Some(b) = crate::common::cuda_emulated_backend("wgmma::the_path_is_the_backends_choice") else { return };
        let b = b.with_attention_path(AttentionPath::General);
        assert_eq!(b.attention_path(), AttentionPath::General);
        assert_eq!(b.with_attention_path(AttentionPath::Wgmma).attention_path(), AttentionPath::Wgmma);
    }
}
