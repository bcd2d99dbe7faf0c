//! Embedding lookup and its scatter-add backward against f64 references.

mod ops_util;

use longctx_kernels::{embedding_backward, embedding_forward, Element, KernelError};
use ops_util::*;
use proptest::prelude::*;

fn emb_case<T: Element>(v: usize, c: usize, t: usize, acc: bool, seed: u64) {
    let mut r = DataRng::new(seed);
    let table = rounded::<T>(&r.vec(v * c, 1.0));
    // Few distinct ids so repeats (the scatter-add) are common.
    let distinct = 1 + r.below(v);
    let ids: Vec<u32> = (0..t).map(|_| r.below(distinct) as u32).collect();
    let dout = rounded::<T>(&r.vec(t * c, 1.0));
    let dt0 = rounded::<T>(&r.vec(v * c, 1.0));
    let mut out = poisoned::<T>(t * c);
    embedding_forward(&mut out, &ids, &to_t::<T>(&table), v, c).unwrap();
    let mut out_ref = vec![0.0; t * c];
    for (k, &id) in ids.iter().enumerate() {
        for j in 0..c {
            out_ref[k * c + j] = table[id as usize * c + j];
        }
    }
    assert_close("embedding out", &out, &out_ref);

    let mut dt: Vec<T> = if acc { to_t(&dt0) } else { poisoned(v * c) };
    embedding_backward(&mut dt, &to_t::<T>(&dout), &ids, v, c, acc).unwrap();
    let mut dt_ref = if acc { dt0.clone() } else { vec![0.0; v * c] };
    for (k, &id) in ids.iter().enumerate() {
        for j in 0..c {
            dt_ref[id as usize * c + j] += dout[k * c + j];
        }
    }
    // The op is linear in the table, so its gradient is the dot-product derivative: check by FD too.
    if v * c <= 200 {
        let f = |tb: &[f64]| {
            let mut s = 0.0;
            for (k, &id) in ids.iter().enumerate() {
                for j in 0..c {
                    s += dout[k * c + j] * tb[id as usize * c + j];
                }
            }
            s
        };
        let mut g = fd_grad(f, &table, 1e-3);
        if acc {
            g.iter_mut().zip(&dt0).for_each(|(a, b)| *a += b);
        }
        assert_fd("fd dtable", &g, &dt_ref, 1e-9);
    }
    assert_close("embedding dtable", &dt, &dt_ref);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(32)))]

    #[test]
    fn embedding_matches_reference(v in 1usize..60, c in 1usize..24, t in 0usize..80, acc: bool, bf: bool, seed: u64) {
        both!(bf, emb_case(v, c, t, acc, seed));
    }
}

#[test]
fn out_of_range_id_is_a_typed_error() {
    let table = vec![1.0f32; 4 * 3];
    let mut out = vec![7.0f32; 2 * 3];
    let e = embedding_forward(&mut out, &[1, 4], &table, 4, 3).unwrap_err();
    assert!(matches!(e, KernelError::InvalidArgument { name: "ids", .. }), "{e}");
    assert_eq!(out, vec![7.0; 6], "untouched on error");
    let mut dt = vec![0.0f32; 12];
    assert!(matches!(
        embedding_backward(&mut dt, &out, &[0, u32::MAX], 4, 3, true),
        Err(KernelError::InvalidArgument { name: "ids", .. })
    ));
    assert!(matches!(
        embedding_forward(&mut out, &[0], &table, 4, 3),
        Err(KernelError::BufferLength { name: "out", .. })
    ));
    assert!(matches!(embedding_forward(&mut out, &[0, 1], &table[..11], 4, 3), Err(KernelError::BufferLength { .. })));
    assert_eq!(embedding_forward(&mut out, &[0, 1], &table, 0, 3), Err(KernelError::ZeroDim("v")));
}
