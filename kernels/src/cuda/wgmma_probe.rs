//! Tests of the `wgmma` wrappers (kernels/ptx_hopper.cuh) through the probe kernel (kernels/wgmma_probe.cu): every
//! case runs on the host emulator (`<case>::emulated`, everywhere) and on the GPU (`<case>::cuda`, skipped with a
//! message without one; sm_90 only, as the probe is compiled for sm_90a), each against an f64 reference of the same
//! bf16/f16 inputs: both operands from shared memory in every canonical layout, and A from registers (the `rs_`
//! cases: its register fragment, with B in each layout). The emulator implements the PTX ISA's layouts as
//! ptx_hopper.cuh states them; the GPU run is what confirms that reading is the hardware's. Also the mistakes the
//! emulator must report (reading the accumulators before the wait, no fence, exiting with a wgmma in flight,
//! overwriting an operand or the A registers in flight).

use std::sync::{Arc, OnceLock};

use half::{bf16, f16};

use super::device::{Device, DevicePtr, Kernel, KernelArgs, LaunchConfig};
use super::driver::DriverDevice;
use super::emulator::Emulator;
use super::probe::{self, EmuBuf};
use super::sources::WGMMA_PROBE;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    Bf16,
    F16,
}

/// One probe run: D (64×n) = A (64×k) · Bᵀ (B n×k), with A and B laid out K-major or MN-major in shared memory,
/// both with no swizzle or both with the 128B swizzle.
#[derive(Debug, Clone, Copy)]
struct Case {
    elem: Elem,
    n: usize,
    k: usize,
    a_mn_major: bool,
    b_mn_major: bool,
    swizzle: bool,
    /// One wgmma group per k-step, waited with `wgmma.wait_group 1`.
    pipelined: bool,
    /// A from registers (the RS form: `a_mn_major` and `swizzle` then describe B alone).
    rs: bool,
}

impl Case {
    fn kernel(&self) -> &'static str {
        match (self.elem, self.n, self.rs) {
            (Elem::Bf16, 64, false) => "longctx_wgmma_probe_bf16_n64",
            (Elem::Bf16, 128, false) => "longctx_wgmma_probe_bf16_n128",
            (Elem::F16, 64, false) => "longctx_wgmma_probe_f16_n64",
            (Elem::F16, 128, false) => "longctx_wgmma_probe_f16_n128",
            (Elem::Bf16, 64, true) => "longctx_wgmma_probe_rs_bf16_n64",
            (Elem::Bf16, 128, true) => "longctx_wgmma_probe_rs_bf16_n128",
            (Elem::F16, 64, true) => "longctx_wgmma_probe_rs_f16_n64",
            (Elem::F16, 128, true) => "longctx_wgmma_probe_rs_f16_n128",
            _ => unreachable!("N is 64 or 128"),
        }
    }

    fn shared_bytes(&self) -> u32 {
        ((64 + self.n) * self.k * 2 + 1024) as u32
    }

    /// Random values in [-1, 1) rounded to the element type: the bytes and the values they hold.
    fn operand(&self, len: usize, seed: u64) -> (Vec<u8>, Vec<f64>) {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut bytes = Vec::with_capacity(2 * len);
        let mut values = Vec::with_capacity(len);
        for _ in 0..len {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            let (b, v) = match self.elem {
                Elem::Bf16 => (bf16::from_f32(x).to_le_bytes(), bf16::from_f32(x).to_f64()),
                Elem::F16 => (f16::from_f32(x).to_le_bytes(), f16::from_f32(x).to_f64()),
            };
            bytes.extend_from_slice(&b);
            values.push(v);
        }
        (bytes, values)
    }

    fn args(&self, a: DevicePtr, b: DevicePtr, d: DevicePtr) -> KernelArgs {
        let mut args = KernelArgs::new();
        args.push(a).push(b).push(d).push(self.k as i32);
        if !self.rs {
            args.push(i32::from(self.a_mn_major));
        }
        args.push(i32::from(self.b_mn_major)).push(i32::from(self.swizzle));
        args.push(i32::from(self.pipelined));
        args
    }

    /// Runs the case through `launch` (inputs → D) and checks D against the f64 reference.
    fn check(&self, launch: impl FnOnce(&Case, &[u8], &[u8]) -> Vec<f32>) {
        let seed = (self.n * 131 + self.k * 7) as u64
            + u64::from(self.a_mn_major) * 2
            + u64::from(self.b_mn_major) * 3
            + u64::from(self.swizzle) * 5
            + u64::from(self.pipelined) * 7
            + (self.elem == Elem::F16) as u64 * 11
            + u64::from(self.rs) * 13;
        let (a_bytes, a) = self.operand(64 * self.k, seed);
        let (b_bytes, b) = self.operand(self.n * self.k, seed + 1000);
        let d = launch(self, &a_bytes, &b_bytes);
        assert_eq!(d.len(), 64 * self.n);
        let mut bad = Vec::new();
        for m in 0..64 {
            for j in 0..self.n {
                let want: f64 = (0..self.k).map(|k| a[m * self.k + k] * b[j * self.k + k]).sum();
                let got = f64::from(d[m * self.n + j]);
                // NaN (an element never written) fails too.
                let close = (got - want).abs() <= 1e-3 + 1e-4 * want.abs();
                if !close {
                    bad.push(format!("D[{m}][{j}] = {got}, want {want}"));
                }
            }
        }
        assert!(
            bad.is_empty(),
            "{self:?}: {} of {} wrong, the first: {}",
            bad.len(),
            64 * self.n,
            bad[..8.min(bad.len())].join("; ")
        );
    }
}

/// One emulator with the probe, shared by the tests.
fn emu() -> &'static Emulator {
    static EMU: OnceLock<Result<Emulator, String>> = OnceLock::new();
    probe::emulator(&EMU, &WGMMA_PROBE)
}

fn run_emulated(case: &Case) {
    case.check(|case, a, b| {
        let (a, b) = (EmuBuf::new(emu(), a), EmuBuf::new(emu(), b));
        let d = EmuBuf::new(emu(), &vec![0xffu8; 64 * case.n * 4]);
        let cfg = LaunchConfig { grid: [1, 1, 1], block: [128, 1, 1], shared_bytes: case.shared_bytes() };
        let kernel = Kernel { source: &WGMMA_PROBE, name: case.kernel() };
        // SAFETY: A, B and D hold what the probe reads and writes for this case.
        unsafe { emu().launch(&kernel, &cfg, &case.args(a.ptr, b.ptr, d.ptr)) }.unwrap_or_else(|e| panic!("{e}"));
        d.read_f32()
    });
}

/// The sm_90 GPU (checked launches), or `None` with the reason on stderr.
fn gpu(test: &str) -> Option<Arc<DriverDevice>> {
    probe::sm90_gpu(test, "wgmma")
}

fn run_cuda(test: &str, case: &Case) {
    let Some(dev) = gpu(test) else { return };
    case.check(|case, a, b| {
        let upload = |bytes: &[u8]| {
            let p = dev.alloc(bytes.len()).unwrap();
            // SAFETY: `p` holds `bytes.len()` bytes.
            unsafe { dev.upload(p, bytes) }.unwrap();
            p
        };
        let (pa, pb) = (upload(a), upload(b));
        let words = 64 * case.n;
        let pd = dev.alloc(4 * words).unwrap();
        // SAFETY: `pd` holds `words` words; NaN, so that an element the kernel does not write shows.
        unsafe { dev.memset32(pd, 0x7fc0_0000, words) }.unwrap();
        let cfg = LaunchConfig { grid: [1, 1, 1], block: [128, 1, 1], shared_bytes: case.shared_bytes() };
        let kernel = Kernel { source: &WGMMA_PROBE, name: case.kernel() };
        // SAFETY: A, B and D hold what the probe reads and writes for this case.
        unsafe { dev.launch(&kernel, &cfg, &case.args(pa, pb, pd)) }.unwrap_or_else(|e| panic!("{e}"));
        let mut out = vec![0u8; 4 * words];
        // SAFETY: `pd` holds `out.len()` bytes.
        unsafe { dev.download(&mut out, pd) }.unwrap();
        dev.synchronize().unwrap();
        // SAFETY: the work using them has run.
        unsafe {
            dev.free(pa);
            dev.free(pb);
            dev.free(pd);
        }
        probe::f32s(&out)
    });
}

/// `<name>::emulated` and `<name>::cuda` for each case.
macro_rules! cases {
    ($($name:ident: $elem:ident, n $n:literal, k $k:literal, a_mn $a:literal, b_mn $b:literal, swizzle $s:literal,
       pipelined $p:literal $(, rs $rs:literal)?;)+) => {
        $(
            mod $name {
                use super::*;
                const CASE: Case = Case {
                    elem: Elem::$elem,
                    n: $n,
                    k: $k,
                    a_mn_major: $a,
                    b_mn_major: $b,
                    swizzle: $s,
                    pipelined: $p,
                    rs: false $(|| $rs)?,
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
    bf16_n64_k_k_none: Bf16, n 64, k 64, a_mn false, b_mn false, swizzle false, pipelined false;
    bf16_n64_k_k_128b: Bf16, n 64, k 64, a_mn false, b_mn false, swizzle true, pipelined false;
    bf16_n64_k_mn_none: Bf16, n 64, k 64, a_mn false, b_mn true, swizzle false, pipelined false;
    bf16_n64_k_mn_128b: Bf16, n 64, k 64, a_mn false, b_mn true, swizzle true, pipelined false;
    bf16_n128_k_k_none: Bf16, n 128, k 64, a_mn false, b_mn false, swizzle false, pipelined false;
    bf16_n128_k_k_128b: Bf16, n 128, k 64, a_mn false, b_mn false, swizzle true, pipelined false;
    bf16_n128_k_mn_none: Bf16, n 128, k 64, a_mn false, b_mn true, swizzle false, pipelined false;
    bf16_n128_k_mn_128b: Bf16, n 128, k 64, a_mn false, b_mn true, swizzle true, pipelined false;
    bf16_n64_mn_k_none: Bf16, n 64, k 64, a_mn true, b_mn false, swizzle false, pipelined false;
    bf16_n64_mn_k_128b: Bf16, n 64, k 64, a_mn true, b_mn false, swizzle true, pipelined false;
    bf16_n128_mn_mn_128b_k128: Bf16, n 128, k 128, a_mn true, b_mn true, swizzle true, pipelined false;
    bf16_n64_k_k_128b_k128: Bf16, n 64, k 128, a_mn false, b_mn false, swizzle true, pipelined false;
    f16_n64_k_k_none: F16, n 64, k 64, a_mn false, b_mn false, swizzle false, pipelined false;
    f16_n64_k_k_128b: F16, n 64, k 64, a_mn false, b_mn false, swizzle true, pipelined false;
    f16_n64_k_mn_none: F16, n 64, k 64, a_mn false, b_mn true, swizzle false, pipelined false;
    f16_n64_k_mn_128b: F16, n 64, k 64, a_mn false, b_mn true, swizzle true, pipelined false;
    f16_n128_k_k_none: F16, n 128, k 64, a_mn false, b_mn false, swizzle false, pipelined false;
    f16_n128_k_k_128b: F16, n 128, k 64, a_mn false, b_mn false, swizzle true, pipelined false;
    f16_n128_k_mn_none: F16, n 128, k 64, a_mn false, b_mn true, swizzle false, pipelined false;
    f16_n128_k_mn_128b: F16, n 128, k 64, a_mn false, b_mn true, swizzle true, pipelined false;
    bf16_n64_k_k_128b_pipelined: Bf16, n 64, k 64, a_mn false, b_mn false, swizzle true, pipelined true;
    f16_n128_mn_mn_none_pipelined: F16, n 128, k 64, a_mn true, b_mn true, swizzle false, pipelined true;
    // A from registers: B in each layout, both types and widths, K 64 and 128, one group or pipelined.
    rs_bf16_n64_k_128b: Bf16, n 64, k 64, a_mn false, b_mn false, swizzle true, pipelined false, rs true;
    rs_bf16_n64_mn_128b: Bf16, n 64, k 64, a_mn false, b_mn true, swizzle true, pipelined false, rs true;
    rs_bf16_n128_k_none: Bf16, n 128, k 64, a_mn false, b_mn false, swizzle false, pipelined false, rs true;
    rs_bf16_n128_mn_128b_k128: Bf16, n 128, k 128, a_mn false, b_mn true, swizzle true, pipelined false, rs true;
    rs_f16_n64_mn_none: F16, n 64, k 64, a_mn false, b_mn true, swizzle false, pipelined false, rs true;
    rs_f16_n64_k_128b_k128: F16, n 64, k 128, a_mn false, b_mn false, swizzle true, pipelined false, rs true;
    rs_f16_n128_mn_128b: F16, n 128, k 64, a_mn false, b_mn true, swizzle true, pipelined false, rs true;
    rs_f16_n128_k_128b_pipelined: F16, n 128, k 64, a_mn false, b_mn false, swizzle true, pipelined true, rs true;
}

/// The mistakes kernel in `mode`: its error (modes 1-3) or D (mode 0).
fn mistake(mode: i32) -> Result<Vec<f32>, String> {
    let case = Case {
        elem: Elem::Bf16,
        n: 64,
        k: 16,
        a_mn_major: false,
        b_mn_major: false,
        swizzle: false,
        pipelined: false,
        rs: false,
    };
    let (a, b) = (EmuBuf::new(emu(), &case.operand(64 * 16, 1).0), EmuBuf::new(emu(), &case.operand(64 * 16, 2).0));
    let d = EmuBuf::new(emu(), &[0u8; 128 * 4]);
    let mut args = KernelArgs::new();
    args.push(a.ptr).push(b.ptr).push(d.ptr).push(mode);
    let cfg = LaunchConfig { grid: [1, 1, 1], block: [128, 1, 1], shared_bytes: 2 * 64 * 16 * 2 + 1024 };
    let kernel = Kernel { source: &WGMMA_PROBE, name: "longctx_wgmma_probe_mistakes" };
    // SAFETY: A and B hold 64×16 elements, D 128 floats.
    match unsafe { emu().launch(&kernel, &cfg, &args) } {
        Ok(()) => Ok(d.read_f32()),
        Err(e) => Err(e.to_string()),
    }
}

#[test]
fn emulated_accumulators_are_nan_until_the_wait() {
    let early = mistake(0).unwrap();
    assert!(early.iter().all(|x| x.is_nan()), "{early:?}");
}

#[test]
fn emulated_wgmma_without_a_fence_is_an_error() {
    let err = mistake(1).unwrap_err();
    assert!(err.contains("without a wgmma.fence") && err.contains("ptx_hopper.cuh"), "{err}");
}

#[test]
fn emulated_exit_with_a_wgmma_in_flight_is_an_error() {
    let err = mistake(2).unwrap_err();
    assert!(err.contains("still in flight"), "{err}");
}

#[test]
fn emulated_overwriting_an_operand_in_flight_is_an_error() {
    let err = mistake(3).unwrap_err();
    assert!(err.contains("overwritten before a wgmma.wait_group"), "{err}");
}

#[test]
fn emulated_overwriting_the_a_registers_in_flight_is_an_error() {
    let err = mistake(4).unwrap_err();
    assert!(err.contains("A registers") && err.contains("overwritten before a wgmma.wait_group"), "{err}");
}

#[test]
fn emulated_wgmma_outside_a_whole_warpgroup_is_an_error() {
    let case = Case {
        elem: Elem::Bf16,
        n: 64,
        k: 16,
        a_mn_major: false,
        b_mn_major: false,
        swizzle: false,
        pipelined: false,
        rs: false,
    };
    let (a, b) = (EmuBuf::new(emu(), &case.operand(64 * 16, 1).0), EmuBuf::new(emu(), &case.operand(64 * 16, 2).0));
    let d = EmuBuf::new(emu(), &[0u8; 128 * 4]);
    let mut args = KernelArgs::new();
    args.push(a.ptr).push(b.ptr).push(d.ptr).push(0i32);
    let cfg = LaunchConfig { grid: [1, 1, 1], block: [96, 1, 1], shared_bytes: 2 * 64 * 16 * 2 + 1024 };
    let kernel = Kernel { source: &WGMMA_PROBE, name: "longctx_wgmma_probe_mistakes" };
    // SAFETY: A and B hold 64×16 elements, D 128 floats (96 are written).
    let err = unsafe { emu().launch(&kernel, &cfg, &args) }.unwrap_err().to_string();
    assert!(err.contains("no whole warpgroup"), "{err}");
}
