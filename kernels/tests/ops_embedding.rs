//! Embedding lookup and its scatter-add backward through the CPU backend against f64 references.

mod ops_util;

use longctx_kernels::{Backend, CpuBackend, Element, GradMode, KernelError, View, ViewMut};
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
    let cpu = CpuBackend::new();
    let mut out = poisoned::<T>(t * c);
    let tt = to_t::<T>(&table);
    cpu.embedding_forward(view_mut(&mut out, [t, c]), &ids, view(&tt, [v, c])).unwrap();
    let mut out_ref = vec![0.0; t * c];
    for (k, &id) in ids.iter().enumerate() {
        for j in 0..c {
            out_ref[k * c + j] = table[id as usize * c + j];
        }
    }
    assert_close("embedding out", &out, &out_ref);

    let mut dt: Vec<T> = if acc { to_t(&dt0) } else { poisoned(v * c) };
    let doutt = to_t::<T>(&dout);
    cpu.embedding_backward(view_mut(&mut dt, [v, c]), view(&doutt, [t, c]), &ids, mode(acc)).unwrap();
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
    let cpu = CpuBackend::new();
    let table = vec![1.0f32; 4 * 3];
    let tv = View::new(&table, [4, 3]).unwrap();
    let mut out = vec![7.0f32; 2 * 3];
    let e = cpu.embedding_forward(ViewMut::new(&mut out, [2, 3]).unwrap(), &[1, 4], tv).unwrap_err();
    assert!(matches!(e, KernelError::InvalidArgument { name: "ids", .. }), "{e}");
    assert_eq!(out, vec![7.0; 6], "untouched on error");
    let mut dt = vec![0.0f32; 12];
    let e = cpu.embedding_backward(
        ViewMut::new(&mut dt, [4, 3]).unwrap(),
        View::new(&out, [2, 3]).unwrap(),
        &[0, u32::MAX],
        GradMode::Accumulate,
    );
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "ids", .. })), "{e:?}");
    // One id for an `out` of two rows: through views the backend compares `out`'s dims with `[ids, C]` and
    // reports a `Shape` error naming `out` (the slice kernel's `BufferLength { name: "out" }`).
    let e = cpu.embedding_forward(ViewMut::new(&mut out, [2, 3]).unwrap(), &[0], tv);
    assert!(matches!(&e, Err(KernelError::Shape(m)) if m.contains("`out`")), "{e:?}");
    // A table one element short cannot be viewed as [4, 3] (the view constructor refuses it); a flat view of it is
    // not the [V, C] the backend needs.
    assert!(matches!(View::new(&table[..11], [4, 3]), Err(KernelError::Shape(_))));
    let e = cpu.embedding_forward(ViewMut::new(&mut out, [2, 3]).unwrap(), &[0, 1], View::flat(&table[..11]));
    assert!(matches!(e, Err(KernelError::Shape(_))), "{e:?}");
    // An empty vocabulary reaches the kernel through an empty [0, 3] table.
    let e = cpu.embedding_forward(
        ViewMut::new(&mut out, [2, 3]).unwrap(),
        &[0, 1],
        View::new(&table[..0], [0, 3]).unwrap(),
    );
    assert_eq!(e, Err(KernelError::ZeroDim("v")));
}
