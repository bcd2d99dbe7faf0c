//! Tests of the TMA and mbarrier wrappers (kernels/ptx_tma.cuh) and of tensor maps (tensor_map.rs) through the probe
//! kernel (kernels/tma_probe.cu): a warp-specialised pipeline (a producer warpgroup issuing TMA loads into a ring of
//! shared-memory stages guarded by full/empty mbarriers, two consumer warpgroups reading each tile and writing it out,
//! setmaxnreg between them). Every case runs on the host emulator (`<case>::emulated`, everywhere) and on the GPU
//! (`<case>::cuda`, skipped with a message without one; sm_90 only, as the probe is compiled for sm_90a), each
//! against a host reference: the tensor padded up to whole boxes with zeros. Tensors whose sizes are not multiples of
//! the box (the zero fill), every swizzle (the consumers undo it), ranks 2, 3 and 4 (an attention input
//! [batch, seq, heads, dim]); TMA stores writing each tile back from its stage (`*_store`: the coordinates and the
//! clipping out of bounds; the swizzle cancels out, the store reading with the pattern the load wrote with); and wgmma reading tiles the TMA loaded with the 128B swizzle (`wgmma_on_tma_tiles`,
//! the pattern of a FlashAttention-3 consumer). Also the mistakes the emulator must report (a wait on the wrong
//! parity, transaction bytes that never come, reading a stage before its wait, a misaligned destination) and
//! try_wait's answers on its own.

use std::sync::{Arc, OnceLock};

use half::bf16;

use super::device::{Device, DevicePtr, Kernel, KernelArgs, LaunchConfig};
use super::driver::DriverDevice;
use super::emulator::Emulator;
use super::probe::{self, EmuBuf};
use super::sources::TMA_PROBE;
use super::tensor_map::{TensorMap, TensorMapDesc, TmaElem, TmaSwizzle};

/// One probe run: a contiguous bf16 tensor of `dims` (innermost first) copied tile by tile through the pipeline.
#[derive(Debug, Clone, Copy)]
struct Case {
    dims: &'static [u64],
    box_dims: &'static [u32],
    swizzle: TmaSwizzle,
    stages: i32,
    blocks: u32,
    /// The consumers write each tile back through a TMA store (into a copy of the tensor) rather than as f32.
    store: bool,
}

impl Case {
    fn rank(&self) -> usize {
        self.dims.len()
    }

    fn elements(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }

    /// Boxes along each dimension (the last one partly out of bounds where the size is not a multiple).
    fn tiles(&self) -> Vec<u64> {
        self.dims.iter().zip(self.box_dims).map(|(&d, &b)| d.div_ceil(u64::from(b))).collect()
    }

    /// The padded output's size per dimension.
    fn padded(&self) -> Vec<u64> {
        self.tiles().iter().zip(self.box_dims).map(|(&t, &b)| t * u64::from(b)).collect()
    }

    /// The tensor: small integers, exact in bf16 and never zero (so the zero fill shows), as bytes.
    fn input(&self) -> Vec<u8> {
        (0..self.elements()).flat_map(|i| bf16::from_f32(((i * 37 + 11) % 251) as f32 + 1.0).to_le_bytes()).collect()
    }

    /// What the probe must write: the input at each padded position inside the tensor, zero outside.
    fn reference(&self) -> Vec<f32> {
        let padded = self.padded();
        let total: u64 = padded.iter().product();
        (0..total)
            .map(|o| {
                let (mut rest, mut src, mut scale, mut inside) = (o, 0u64, 1u64, true);
                for (d, &p) in padded.iter().enumerate() {
                    let g = rest % p;
                    rest /= p;
                    inside &= g < self.dims[d];
                    src += g * scale;
                    scale *= self.dims[d];
                }
                if inside {
                    ((src as usize * 37 + 11) % 251) as f32 + 1.0
                } else {
                    0.0
                }
            })
            .collect()
    }

    fn desc(&self, address: DevicePtr) -> TensorMapDesc {
        let mut strides = Vec::new();
        let mut s = 2 * self.dims[0];
        for &d in &self.dims[1..] {
            strides.push(s);
            s *= d;
        }
        TensorMapDesc {
            elem: TmaElem::Bf16,
            address,
            dims: self.dims.to_vec(),
            strides,
            box_dims: self.box_dims.to_vec(),
            swizzle: self.swizzle,
        }
    }

    fn config(&self) -> LaunchConfig {
        let box_bytes: u32 = self.box_dims.iter().product::<u32>() * 2;
        let stage = box_bytes.div_ceil(1024) * 1024;
        LaunchConfig { grid: [self.blocks, 1, 1], block: [384, 1, 1], shared_bytes: self.stages as u32 * stage + 1024 }
    }

    fn args(&self, map: TensorMap, store_map: TensorMap, out: DevicePtr, mode: i32) -> KernelArgs {
        let mut bx = [1i32; 4];
        let mut nt = [1i32; 4];
        for (d, (&b, t)) in self.box_dims.iter().zip(self.tiles()).enumerate() {
            bx[d] = b as i32;
            nt[d] = t as i32;
        }
        let mut args = KernelArgs::new();
        args.push(map).push(store_map).push(out).push(self.rank() as i32).push(bx).push(nt);
        args.push(i32::from(self.swizzle.code())).push(self.stages).push(i32::from(self.store)).push(mode);
        args
    }

    /// With `store`: the copy the TMA stores wrote must be the input, byte for byte (poison where nothing was written).
    fn check_store(&self, copy: &[u8]) {
        let input = self.input();
        let bad = copy.chunks_exact(2).zip(input.chunks_exact(2)).filter(|(g, w)| g != w).count();
        let first = copy.chunks_exact(2).zip(input.chunks_exact(2)).position(|(g, w)| g != w);
        assert!(bad == 0, "{self:?}: {bad} of {} elements wrong, the first at {first:?}", self.elements());
    }

    fn check(&self, out: &[f32]) {
        let want = self.reference();
        assert_eq!(out.len(), want.len());
        let bad: Vec<String> = out
            .iter()
            .zip(&want)
            .enumerate()
            .filter(|(_, (g, w))| g.to_bits() != w.to_bits())
            .map(|(i, (g, w))| format!("out[{i}] = {g}, want {w}"))
            .collect();
        assert!(
            bad.is_empty(),
            "{self:?}: {} of {} wrong, the first: {}",
            bad.len(),
            want.len(),
            bad[..8.min(bad.len())].join("; ")
        );
    }
}

/// One emulator with the probe, shared by the tests.
fn emu() -> &'static Emulator {
    static EMU: OnceLock<Result<Emulator, String>> = OnceLock::new();
    probe::emulator(&EMU, &TMA_PROBE)
}

/// The probe on the emulator in `mode` (0: the pipeline; others: tma_probe.cu's mistakes): the output or the error.
fn launch_emulated(case: &Case, mode: i32) -> Result<Vec<f32>, String> {
    launch_emulated_with_copy(case, mode).map(|(out, _)| out)
}

/// [`launch_emulated`], with the bytes of the copy the TMA stores write (`case.store`).
fn launch_emulated_with_copy(case: &Case, mode: i32) -> Result<(Vec<f32>, Vec<u8>), String> {
    let input = EmuBuf::new(emu(), &case.input());
    let copy = EmuBuf::new(emu(), &vec![0xffu8; 2 * case.elements()]);
    let words = case.padded().iter().product::<u64>() as usize;
    let out = EmuBuf::new(emu(), &vec![0xffu8; 4 * words]);
    let map = case.desc(input.ptr).encode_emulated().unwrap();
    let store_map = case.desc(copy.ptr).encode_emulated().unwrap();
    let kernel = Kernel { source: &TMA_PROBE, name: "longctx_tma_probe" };
    // SAFETY: the maps describe `input` and `copy`, and `out` holds the padded tensor the probe writes.
    match unsafe { emu().launch(&kernel, &case.config(), &case.args(map, store_map, out.ptr, mode)) } {
        Ok(()) => {
            let bytes = copy.bytes();
            Ok((out.read_f32(), bytes))
        }
        Err(e) => Err(e.to_string()),
    }
}

fn run_emulated(case: &Case) {
    let (out, copy) = launch_emulated_with_copy(case, 0).unwrap_or_else(|e| panic!("{e}"));
    if case.store {
        case.check_store(&copy);
    } else {
        case.check(&out);
    }
}

/// The sm_90 GPU (checked launches), or `None` with the reason on stderr.
fn gpu(test: &str) -> Option<Arc<DriverDevice>> {
    probe::sm90_gpu(test, "the probe")
}

fn run_cuda(test: &str, case: &Case) {
    let Some(dev) = gpu(test) else { return };
    let input = case.input();
    let pin = dev.alloc(input.len()).unwrap();
    // SAFETY: `pin` holds `input.len()` bytes.
    unsafe { dev.upload(pin, &input) }.unwrap();
    let words = case.padded().iter().product::<u64>() as usize;
    let pout = dev.alloc(4 * words).unwrap();
    // SAFETY: `pout` holds `words` words; NaN, so that an element the kernel does not write shows.
    unsafe { dev.memset32(pout, 0x7fc0_0000, words) }.unwrap();
    let pcopy = dev.alloc(input.len()).unwrap();
    // SAFETY: `pcopy` holds `input.len()` bytes: poison (bf16 NaN), so that an element no store writes shows.
    unsafe { dev.memset32(pcopy, 0xffff_ffff, input.len() / 4) }.unwrap();
    let map = dev.encode_tensor_map(&case.desc(pin)).unwrap_or_else(|e| panic!("{e}"));
    let store_map = dev.encode_tensor_map(&case.desc(pcopy)).unwrap_or_else(|e| panic!("{e}"));
    let kernel = Kernel { source: &TMA_PROBE, name: "longctx_tma_probe" };
    // SAFETY: the maps describe the input and its copy, and `pout` holds the padded tensor the probe writes.
    unsafe { dev.launch(&kernel, &case.config(), &case.args(map, store_map, pout, 0)) }
        .unwrap_or_else(|e| panic!("{e}"));
    let mut out = vec![0u8; 4 * words];
    let mut copy = vec![0u8; input.len()];
    // SAFETY: `pout` and `pcopy` hold `out.len()` and `copy.len()` bytes.
    unsafe {
        dev.download(&mut out, pout).unwrap();
        dev.download(&mut copy, pcopy).unwrap();
    }
    dev.synchronize().unwrap();
    // SAFETY: the work using them has run.
    unsafe {
        dev.free(pin);
        dev.free(pout);
        dev.free(pcopy);
    }
    if case.store {
        case.check_store(&copy);
    } else {
        case.check(&probe::f32s(&out));
    }
}

/// `<name>::emulated` and `<name>::cuda` for each case.
macro_rules! cases {
    ($($name:ident: dims $dims:expr, box $box:expr, $swizzle:ident, stages $stages:literal, blocks $blocks:literal,
       store $store:literal;)+) => {
        $(
            mod $name {
                use super::*;
                const CASE: Case = Case {
                    dims: &$dims,
                    box_dims: &$box,
                    swizzle: TmaSwizzle::$swizzle,
                    stages: $stages,
                    blocks: $blocks,
                    store: $store,
                };

                #[test]
                fn emulated() {
                    run_emulated(&CASE);
                }

                #[test]
                fn cuda() {
                    run_cuda(concat!(stringify!($name), "::cuda"), &CASE);
                }
            }
        )+
    };
}

cases! {
    // 80 × 50 in 32 × 16 boxes: the last column and row of boxes partly out of bounds.
    rank2_none: dims [80, 50], box [32, 16], None, stages 2, blocks 1, store false;
    rank2_none_3_stages_2_blocks: dims [80, 50], box [32, 16], None, stages 3, blocks 2, store false;
    // 136 × 40 in 64 × 16 boxes of 128-byte rows: the layout wgmma's 128B swizzle reads.
    rank2_128b: dims [136, 40], box [64, 16], B128, stages 2, blocks 1, store false;
    rank3_64b: dims [32, 20, 3], box [32, 8, 1], B64, stages 2, blocks 1, store false;
    rank3_32b: dims [16, 24, 2], box [16, 8, 1], B32, stages 3, blocks 1, store false;
    // An attention input [batch 2, seq 40, heads 3, dim 64] (innermost first): 16-row boxes of one head, 128B.
    rank4_attention_128b: dims [64, 3, 40, 2], box [64, 1, 16, 1], B128, stages 2, blocks 2, store false;
    // The same through TMA stores: every box back where it came from, its out-of-bounds part not written.
    rank2_none_store: dims [80, 50], box [32, 16], None, stages 2, blocks 1, store true;
    rank3_64b_store: dims [32, 20, 3], box [32, 8, 1], B64, stages 2, blocks 2, store true;
    rank4_attention_128b_store: dims [64, 3, 40, 2], box [64, 1, 16, 1], B128, stages 3, blocks 2, store true;
}

/// The small case the mistakes run on.
const MISTAKES: Case =
    Case { dims: &[80, 50], box_dims: &[32, 16], swizzle: TmaSwizzle::None, stages: 2, blocks: 1, store: false };

#[test]
fn emulated_a_wait_on_the_wrong_parity_is_a_deadlock() {
    let err = launch_emulated(&MISTAKES, 1).unwrap_err();
    assert!(err.contains("deadlock") && err.contains("mbarrier_wait parity 0 at tma_probe.cu"), "{err}");
}

#[test]
fn emulated_transaction_bytes_that_never_come_are_a_deadlock() {
    let err = launch_emulated(&MISTAKES, 2).unwrap_err();
    assert!(err.contains("deadlock") && err.contains("0 of 1 arrivals and 16 transaction bytes to come"), "{err}");
}

#[test]
fn emulated_reading_a_stage_before_its_wait_sees_nan() {
    let out = launch_emulated(&MISTAKES, 3).unwrap();
    assert!(out.iter().any(|x| x.is_nan()), "no NaN: the reads before the wait saw data");
}

#[test]
fn emulated_a_misaligned_destination_is_an_error() {
    let err = launch_emulated(&MISTAKES, 4).unwrap_err();
    assert!(err.contains("not 128-byte aligned") && err.contains("tma_probe.cu"), "{err}");
}

#[test]
fn emulated_releasing_a_stage_before_its_store_read_it_shows() {
    let case = Case { store: true, ..MISTAKES };
    let (_, copy) = launch_emulated_with_copy(&case, 5).unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(copy, case.input(), "the stores read their stages after the next tiles landed there");
}

#[test]
fn emulated_a_map_from_elsewhere_is_an_error() {
    let input = EmuBuf::new(emu(), &MISTAKES.input());
    let out = EmuBuf::new(emu(), &[0xffu8; 4 * 96 * 64]);
    let kernel = Kernel { source: &TMA_PROBE, name: "longctx_tma_probe" };
    let map = TensorMap([0u8; 128]);
    // SAFETY: the probe fails at the first copy, before it reads or writes anything through the map.
    let err = unsafe { emu().launch(&kernel, &MISTAKES.config(), &MISTAKES.args(map, map, out.ptr, 0)) }
        .unwrap_err()
        .to_string();
    drop(input);
    assert!(err.contains("not one the emulator's encoder wrote"), "{err}");
}

/// The try_wait kernel in `mode`: its three answers, or the error.
fn try_wait(mode: i32) -> Result<Vec<i32>, String> {
    let out = EmuBuf::new(emu(), &[0xffu8; 16]);
    let mut args = KernelArgs::new();
    args.push(out.ptr).push(mode);
    let kernel = Kernel { source: &TMA_PROBE, name: "longctx_tma_probe_try_wait" };
    // SAFETY: `out` holds the 4 ints the kernel may write.
    match unsafe { emu().launch(&kernel, &LaunchConfig::linear(1, 32), &args) } {
        Ok(()) => Ok(out.read_f32()[..3].iter().map(|x| x.to_bits() as i32).collect()),
        Err(e) => Err(e.to_string()),
    }
}

#[test]
fn emulated_try_wait_answers_for_the_phase_of_its_parity() {
    assert_eq!(try_wait(0).unwrap(), [0, 1, 0]);
}

#[test]
fn emulated_a_try_wait_loop_that_nothing_ends_is_a_deadlock() {
    let err = try_wait(1).unwrap_err();
    assert!(err.contains("deadlock") && err.contains("mbarrier.try_wait.parity 0 at tma_probe.cu"), "{err}");
}

#[test]
fn emulated_more_arrivals_than_the_count_is_an_error() {
    let err = try_wait(2).unwrap_err();
    assert!(err.contains("more arrivals than its count") && err.contains("tma_probe.cu"), "{err}");
}

#[test]
fn emulated_an_uninitialised_mbarrier_is_an_error() {
    let err = try_wait(3).unwrap_err();
    assert!(err.contains("not an initialised mbarrier") && err.contains("tma_probe.cu"), "{err}");
}

/// wgmma on 64 × 64 bf16 tiles of A and B the TMA loaded with the 128B swizzle (tma_probe.cu's
/// `longctx_tma_probe_wgmma`): D = A·Bᵀ against an f64 reference. `encode` makes the tensor maps for the device,
/// `launch` runs the kernel (A, B, D addresses) and returns D.
fn wgmma_on_tma_tiles(
    alloc: &dyn Fn(&[u8]) -> DevicePtr,
    encode: &dyn Fn(&TensorMapDesc) -> TensorMap,
    launch: &dyn Fn(KernelArgs, DevicePtr) -> Vec<f32>,
) {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut operand = || -> (Vec<u8>, Vec<f64>) {
        let mut bytes = Vec::with_capacity(2 * 64 * 64);
        let mut values = Vec::with_capacity(64 * 64);
        for _ in 0..64 * 64 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = bf16::from_f32((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0);
            bytes.extend_from_slice(&x.to_le_bytes());
            values.push(x.to_f64());
        }
        (bytes, values)
    };
    let ((a_bytes, a), (b_bytes, b)) = (operand(), operand());
    let (pa, pb, pd) = (alloc(&a_bytes), alloc(&b_bytes), alloc(&[0xffu8; 64 * 64 * 4]));
    let desc = |address| TensorMapDesc {
        elem: TmaElem::Bf16,
        address,
        dims: vec![64, 64],
        strides: vec![128],
        box_dims: vec![64, 64],
        swizzle: TmaSwizzle::B128,
    };
    let mut args = KernelArgs::new();
    args.push(encode(&desc(pa))).push(encode(&desc(pb))).push(pd);
    let d = launch(args, pd);
    let mut bad = Vec::new();
    for m in 0..64 {
        for n in 0..64 {
            let want: f64 = (0..64).map(|k| a[m * 64 + k] * b[n * 64 + k]).sum();
            let got = f64::from(d[m * 64 + n]);
            // NaN (an element never written) fails too.
            let close = (got - want).abs() <= 1e-3 + 1e-4 * want.abs();
            if !close {
                bad.push(format!("D[{m}][{n}] = {got}, want {want}"));
            }
        }
    }
    assert!(bad.is_empty(), "{} of 4096 wrong, the first: {}", bad.len(), bad[..8.min(bad.len())].join("; "));
}

const WGMMA_CONFIG: LaunchConfig = LaunchConfig { grid: [1, 1, 1], block: [128, 1, 1], shared_bytes: 2 * 8192 + 1024 };

mod wgmma_on_tma_tiles {
    use super::*;

    #[test]
    fn emulated() {
        let bufs = std::cell::RefCell::new(Vec::new());
        wgmma_on_tma_tiles(
            &|bytes| {
                let b = EmuBuf::new(emu(), bytes);
                let p = b.ptr;
                bufs.borrow_mut().push(b);
                p
            },
            &|desc| desc.encode_emulated().unwrap(),
            &|args, pd| {
                let kernel = Kernel { source: &TMA_PROBE, name: "longctx_tma_probe_wgmma" };
                // SAFETY: the maps describe A and B (64 × 64 bf16 each); D holds 64 × 64 floats.
                unsafe { emu().launch(&kernel, &WGMMA_CONFIG, &args) }.unwrap_or_else(|e| panic!("{e}"));
                let bufs = bufs.borrow();
                let d = bufs.iter().find(|b| b.ptr == pd).expect("D is one of the buffers");
                d.read_f32()
            },
        );
    }

    #[test]
    fn cuda() {
        let Some(dev) = gpu("wgmma_on_tma_tiles::cuda") else { return };
        let ptrs = std::cell::RefCell::new(Vec::new());
        wgmma_on_tma_tiles(
            &|bytes| {
                let p = dev.alloc(bytes.len()).unwrap();
                // SAFETY: `p` holds `bytes.len()` bytes.
                unsafe { dev.upload(p, bytes) }.unwrap();
                ptrs.borrow_mut().push(p);
                p
            },
            &|desc| dev.encode_tensor_map(desc).unwrap_or_else(|e| panic!("{e}")),
            &|args, pd| {
                let kernel = Kernel { source: &TMA_PROBE, name: "longctx_tma_probe_wgmma" };
                // SAFETY: the maps describe A and B (64 × 64 bf16 each); D holds 64 × 64 floats.
                unsafe { dev.launch(&kernel, &WGMMA_CONFIG, &args) }.unwrap_or_else(|e| panic!("{e}"));
                let mut out = vec![0u8; 64 * 64 * 4];
                // SAFETY: `pd` holds `out.len()` bytes.
                unsafe { dev.download(&mut out, pd) }.unwrap();
                dev.synchronize().unwrap();
                probe::f32s(&out)
            },
        );
        for p in ptrs.into_inner() {
            // SAFETY: the work using them has run.
            unsafe { dev.free(p) };
        }
    }
}

/// The bulk reduce-add probe (`longctx_tma_probe_reduce`): 16 blocks of four warps each adding their 4 KiB to the same
/// 4096 floats, which must hold (k % 7 + 1)·136 (the sum of 1..16), exactly.
fn check_reduce(dst: &[f32]) {
    let bad: Vec<String> = (0..4096)
        .filter(|&i| dst[i] != ((i % 1024 % 7 + 1) * 136) as f32)
        .map(|i| format!("[{i}] = {}", dst[i]))
        .collect();
    assert!(bad.is_empty(), "{} of 4096 wrong, the first: {}", bad.len(), bad[..8.min(bad.len())].join("; "));
}

const REDUCE_CONFIG: LaunchConfig = LaunchConfig { grid: [16, 1, 1], block: [128, 1, 1], shared_bytes: 0 };

/// The reduce probe on the emulator in `mode`: the 4096 floats, or the error.
fn reduce_emulated(mode: i32) -> Result<Vec<f32>, String> {
    let dst = EmuBuf::new(emu(), &[0u8; 4 * 4096]);
    let mut args = KernelArgs::new();
    args.push(dst.ptr).push(mode);
    let kernel = Kernel { source: &TMA_PROBE, name: "longctx_tma_probe_reduce" };
    // SAFETY: `dst` holds the 4096 floats the probe adds to.
    match unsafe { emu().launch(&kernel, &REDUCE_CONFIG, &args) } {
        Ok(()) => Ok(dst.read_f32()),
        Err(e) => Err(e.to_string()),
    }
}

mod bulk_reduce_add {
    use super::*;

    #[test]
    fn emulated() {
        check_reduce(&reduce_emulated(0).unwrap_or_else(|e| panic!("{e}")));
    }

    #[test]
    fn cuda() {
        let Some(dev) = gpu("tma_probe::bulk_reduce_add::cuda") else { return };
        let pd = dev.alloc(4 * 4096).unwrap();
        // SAFETY: `pd` holds 4096 floats, zeroed here.
        unsafe { dev.memset32(pd, 0, 4096) }.unwrap();
        let mut args = KernelArgs::new();
        args.push(pd).push(0i32);
        let kernel = Kernel { source: &TMA_PROBE, name: "longctx_tma_probe_reduce" };
        // SAFETY: `pd` holds the 4096 floats the probe adds to.
        unsafe { dev.launch(&kernel, &REDUCE_CONFIG, &args) }.unwrap_or_else(|e| panic!("{e}"));
        let mut out = vec![0u8; 4 * 4096];
        // SAFETY: `pd` holds `out.len()` bytes.
        unsafe { dev.download(&mut out, pd) }.unwrap();
        check_reduce(&probe::f32s(&out));
    }
}

#[test]
fn emulated_a_bulk_reduce_of_a_size_not_a_multiple_of_16_is_an_error() {
    let err = reduce_emulated(1).unwrap_err();
    assert!(err.contains("cp.reduce.async.bulk") && err.contains("multiple of 16"), "{err}");
}
