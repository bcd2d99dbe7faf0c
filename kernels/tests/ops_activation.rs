//! SwiGLU and squared ReLU on every backend present (`test_device!`): the conformance suite's family (forward and
//! backward against f64 formulas in both dtypes, flat and 2-D, up to 40 000 elements on the CPU; SwiGLU at gates
//! where `exp` leaves the normal range, infinite and NaN). Then the CPU's SIMD paths, which must agree bit for bit.

#[macro_use]
mod common;

use common::Device;
use half::bf16;
use longctx_kernels::cpu::SimdPath;
use longctx_kernels::testing::conformance::data::DataRng;
use longctx_kernels::testing::conformance::Family;
use longctx_kernels::{Backend, CpuBackend, SwigluSaved, View, ViewMut};

fn activation(dev: &Device) {
    dev.conformance(&[Family::Activation]);
}

test_device!(activation);

/// The activations' loops are compiled per SIMD path without fused multiply-adds: every path gives the same bits.
#[test]
fn cpu_simd_paths_give_the_same_bits() {
    let n = 40_000;
    let mut r = DataRng::new(3);
    let (g, u, d): (Vec<bf16>, Vec<bf16>, Vec<bf16>) = (
        r.vec(n, 4.0).into_iter().map(bf16::from_f64).collect(),
        r.vec(n, 1.0).into_iter().map(bf16::from_f64).collect(),
        r.vec(n, 1.0).into_iter().map(bf16::from_f64).collect(),
    );
    let g32: Vec<f32> = g.iter().map(|x| x.to_f32()).collect();
    let run = |simd: SimdPath| {
        let cpu = CpuBackend::new().with_simd(simd);
        let saved = SwigluSaved { gate: View::flat(&g), up: View::flat(&u) };
        let (mut o, mut dg, mut du) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
        cpu.swiglu_forward(ViewMut::flat(&mut o), saved.gate, saved.up).unwrap();
        cpu.swiglu_backward(ViewMut::flat(&mut dg), ViewMut::flat(&mut du), View::flat(&d), saved).unwrap();
        let mut sq = vec![0f32; n];
        cpu.squared_relu_forward(ViewMut::flat(&mut sq), View::flat(&g32)).unwrap();
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
        (bits(&o), bits(&dg), bits(&du), sq.iter().map(|x| x.to_bits()).collect::<Vec<u32>>())
    };
    let first = run(SimdPath::Portable);
    for simd in SimdPath::supported() {
        assert!(run(simd) == first, "{simd:?} differs from the portable path");
    }
}
