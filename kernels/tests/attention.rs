//! Attention on every backend present (`test_device!`): the conformance suite's attention family, which checks
//! forward, backward and merge against the f64 reference and the CPU backend (GQA, lengths off every tile, causal,
//! window, documents, explicit positions such as a zigzag shard's two ranges, rows that see no key, the softmax
//! scale, `f32` and `bf16` with gradients in either, `GradMode::Accumulate`, decoding shapes, tile borders and head
//! dims past 128 where the limits allow, extreme log-sum-exps in the merge, the gradients against finite
//! differences of the backend's own forward), every SIMD path of the CPU. Then what belongs to the CPU alone (the
//! same bits on any number of threads) and to the reference alone (its gradients against finite differences).

#[macro_use]
mod common;

use common::Device;
use longctx_kernels::attention::{reference, AttnMask, AttnParams, AttnShape, Positions};
use longctx_kernels::testing::conformance::Family;
use longctx_kernels::testing::{attention_f32, attention_forward, uniform_nonzero};
use longctx_kernels::{CpuBackend, KernelError};

fn attention(dev: &Device) {
    dev.conformance(&[Family::Attention]);
}

test_device!(attention);

/// The reference's own gradients against central differences of its own forward (f64): the check of the check.
#[test]
fn reference_gradients_match_finite_differences() {
    let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: 9, kv_len: 11, head_dim: 32 };
    let qd: Vec<u32> = (0..9).map(|i| (i / 5) as u32).collect();
    let kd: Vec<u32> = (0..11).map(|i| (i / 6) as u32).collect();
    let mask = AttnMask::causal()
        .with_positions(Positions::Offset(2), Positions::Offset(0))
        .with_window(7)
        .with_docs(&qd, &kd);
    let p = AttnParams::new(shape).with_mask(mask);
    let wide = |seed, n| uniform_nonzero(n, seed).into_iter().map(f64::from).collect::<Vec<f64>>();
    let (q, k, v, d_o) =
        (wide(11, shape.q_elems()), wide(12, shape.kv_elems()), wide(13, shape.kv_elems()), wide(14, shape.q_elems()));
    let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        reference::forward(&p, q, k, v).0.iter().zip(&d_o).map(|(a, b)| a * b).sum()
    };
    let grads = reference::backward(&p, &q, &k, &v, &d_o);
    for (which, grad) in [(0usize, &grads.0), (1, &grads.1), (2, &grads.2)] {
        for idx in (0..grad.len()).step_by(7) {
            let mut a = [q.clone(), k.clone(), v.clone()];
            a[which][idx] += 1e-5;
            let up = loss(&a[0], &a[1], &a[2]);
            a[which][idx] -= 2e-5;
            let fd = (up - loss(&a[0], &a[1], &a[2])) / 2e-5;
            assert!((fd - grad[idx]).abs() < 1e-7, "gradient {which}[{idx}]: {fd} against {}", grad[idx]);
        }
    }
}

/// The CPU backend: the same inputs give bit-identical outputs on 1 and 3 threads.
#[test]
fn cpu_is_deterministic_across_thread_counts() {
    let shape = AttnShape { batch: 2, q_heads: 4, kv_heads: 2, q_len: 333, kv_len: 333, head_dim: 64 };
    let p = AttnParams::new(shape).with_mask(AttnMask::causal());
    let q = uniform_nonzero(shape.q_elems(), 1);
    let k = uniform_nonzero(shape.kv_elems(), 2);
    let v = uniform_nonzero(shape.kv_elems(), 3);
    let d_o = uniform_nonzero(shape.q_elems(), 4);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            attention_f32(&p, &q, &k, &v, &d_o).unwrap().map(|x| x.iter().map(|f| f.to_bits()).collect::<Vec<u32>>())
        })
    };
    assert_eq!(run(1), run(3));
}

/// `testing`'s slice-level wrappers (which other crates' tests use) name a slice that does not fit the shape.
#[test]
fn slice_wrappers_name_a_short_buffer() {
    let good = AttnShape { batch: 1, q_heads: 4, kv_heads: 2, q_len: 8, kv_len: 8, head_dim: 32 };
    let (q, kv) = (vec![0.5f32; good.q_elems()], vec![0.5f32; good.kv_elems()]);
    let (mut o, mut lse) = (vec![0f32; good.q_elems()], vec![0f32; good.lse_elems()]);
    let p = AttnParams::new(good);
    let cpu = CpuBackend::new();
    let e = attention_forward(&cpu, &p, (&mut o).into(), &mut lse, (&q).into(), (&kv[1..]).into(), (&kv).into());
    assert!(matches!(e, Err(KernelError::BufferLength { name: "k", .. })), "{e:?}");
}
