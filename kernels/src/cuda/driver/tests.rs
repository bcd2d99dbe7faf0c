//! Tests of [`DriverDevice`]. The first runs everywhere (no driver here means `NoDevice`, never a panic); the
//! others need a GPU and skip with a message when `DriverDevice::new(0)` finds none, unless
//! `LONGCTX_REQUIRE_GPU=1` (set it on GPU machines so that a broken setup fails instead of skipping). They run
//! with checked launches except where a test needs work left in flight.
//!
//! On a GPU machine without cargo: build here with `cargo test -p longctx-kernels --features cuda --lib --no-run`
//! (the path of the test binary is printed), carry it, and run there
//! `LONGCTX_REQUIRE_GPU=1 LONGCTX_REQUIRE_NVRTC=1 <binary> cuda:: --test-threads=4`. The driver, NVRTC, cuBLASLt
//! and the CUDA headers are found at run time (`LONGCTX_CUDA_LIB_DIRS`, `LONGCTX_CUDA_INCLUDE` when they are
//! somewhere unusual); `a_checked_launch_names_the_faulting_kernel` runs the binary again as a child process.

use std::sync::Arc;
use std::time::Duration;

use half::bf16;

use super::*;
use crate::cuda::device::{Device, DevicePtr, Gemm, Kernel, KernelArgs, KernelSource, LaunchConfig};
use crate::dtype::DType;

/// Device 0 with `options`, or `None` (and why, on stderr) when there is no GPU.
fn gpu_with(test: &str, options: DriverOptions) -> Option<Arc<DriverDevice>> {
    crate::cuda::probe::gpu_or_skip(test, options)
}

/// Device 0 with checked launches.
fn gpu(test: &str) -> Option<Arc<DriverDevice>> {
    gpu_with(test, DriverOptions { checked: true })
}

static TEST_KERNELS: KernelSource = KernelSource {
    file: "driver_tests.cu",
    code: r#"
extern "C" __global__ void longctx_test_affine(float* out, const float* in, float scale, float shift, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] * scale + shift;
}

// Reverses `n` floats through dynamic shared memory (more than 48 KiB of it in the test).
extern "C" __global__ void longctx_test_reverse(float* out, const float* in, int n) {
    extern __shared__ float tile[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) tile[i] = in[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = tile[n - 1 - i];
}

// Spins for `cycles` clock cycles, then writes `v`: a slow producer for the stream-ordering tests.
extern "C" __global__ void longctx_test_slow_fill(float* out, float v, int n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = v;
}

// Writes through a null pointer: an illegal address, for the checked-launch test (in a child process, since the
// fault breaks the context for good).
extern "C" __global__ void longctx_test_fault(float* out) {
    *(volatile float*)nullptr = out[0];
}
"#,
    kernels: &["longctx_test_affine", "longctx_test_reverse", "longctx_test_slow_fill", "longctx_test_fault"],
    includes: &[],
};

fn kernel(name: &'static str) -> Kernel {
    Kernel { source: &TEST_KERNELS, name }
}

fn values(n: usize, seed: usize) -> Vec<f32> {
    // Multiples of 1/8 in [-1, 1]: exact in bf16 and TF32, and their products' sums exact in f32.
    (0..n).map(|i| ((i * 7 + seed * 13 + 3) % 17) as f32 / 8.0 - 1.0).collect()
}

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_bf16(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect()
}

fn upload(dev: &DriverDevice, bytes: &[u8]) -> DevicePtr {
    let p = dev.alloc(bytes.len()).unwrap();
    // SAFETY: `p` holds `bytes.len()` bytes.
    unsafe { dev.upload(p, bytes) }.unwrap();
    p
}

fn download(dev: &DriverDevice, p: DevicePtr, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `p` holds at least `len` bytes.
    unsafe { dev.download(&mut out, p) }.unwrap();
    out
}

fn as_f32(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn as_bf16(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(2).map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect()
}

/// Fills `words` 32-bit words at `p` with NaN, so that an output a call fails to write shows.
fn poison(dev: &DriverDevice, p: DevicePtr, words: usize) {
    // SAFETY: `p` holds `words` words.
    unsafe { dev.memset32(p, 0x7fc0_7fc0, words) }.unwrap();
}

#[test]
fn no_driver_or_no_such_device_is_no_device_not_a_panic() {
    match DriverDevice::new(0) {
        Ok(dev) => assert!(!dev.info().name.is_empty()),
        Err(KernelError::NoDevice { why, .. }) => {
            if !CudaLib::Driver.loader_finds() {
                assert!(why.contains("libcuda.so.1"), "{why}");
            }
        }
        Err(e) => panic!("{e}"),
    }
    match DriverDevice::new(1 << 20) {
        Err(KernelError::NoDevice { why, .. }) => {
            if CudaLib::Driver.loader_finds() {
                assert!(why.contains("device(s)"), "{why}");
            }
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn info_arch_and_aligned_allocations() {
    let Some(dev) = gpu("info_arch_and_aligned_allocations") else { return };
    let info = dev.info().clone();
    eprintln!("{info:?}, driver {}, arch {}", dev.driver_version(), dev.arch());
    assert!(!info.name.is_empty() && info.multiprocessors > 0 && info.total_memory > 0);
    assert!(info.compute_capability.0 >= 7, "{info:?}");
    if std::env::var_os("LONGCTX_CUDA_ARCH").is_none() {
        assert_eq!(dev.arch(), format!("sm_{}{}", info.compute_capability.0, info.compute_capability.1));
    }
    assert_eq!(dev.memory(), Memory::Cuda { ordinal: 0 });
    let mut ptrs = Vec::new();
    for bytes in [0, 1, 3, 255, 257, 1000, 1 << 20, (1 << 20) + 1] {
        let p = dev.alloc(bytes).unwrap();
        assert_eq!(p % 256, 0, "{bytes} bytes at {p:#x}");
        ptrs.push(p);
    }
    for p in ptrs {
        // SAFETY: allocated above, unused.
        unsafe { dev.free(p) };
    }
    dev.synchronize().unwrap();
}

#[test]
fn copies_round_trip_and_upload_is_done_with_its_source() {
    let Some(dev) = gpu("copies_round_trip_and_upload_is_done_with_its_source") else { return };
    for len in [4usize, 256, 4 * 1000, STAGING_BYTES + 4 * 12345, 3 * STAGING_BYTES] {
        // Not periodic in the staging size, so that a chunk copied from a refilled buffer shows.
        let mut src: Vec<u8> = (0..len).map(|i| (i * 31 + i / 4093 + len) as u8).collect();
        let expected = src.clone();
        let a = dev.alloc(len).unwrap();
        let b = dev.alloc(len).unwrap();
        poison(&dev, a, len / 4);
        poison(&dev, b, len / 4);
        // SAFETY: `a` holds `len` bytes.
        unsafe { dev.upload(a, &src) }.unwrap();
        // The upload has read `src` when it returns: changing it now must not change what arrives.
        src.iter_mut().for_each(|x| *x = !*x);
        // SAFETY: both hold `len` bytes.
        unsafe { dev.copy(b, a, len) }.unwrap();
        assert!(download(&dev, b, len) == expected, "{len} bytes");
        // SAFETY: `a` holds `len / 4` words.
        unsafe { dev.memset32(a, 0x0102_0304, len / 4) }.unwrap();
        assert!(download(&dev, a, len).chunks_exact(4).all(|w| w == [4, 3, 2, 1]), "{len} bytes");
        // SAFETY: allocated above; the stream orders the frees after the copies.
        unsafe {
            dev.free(a);
            dev.free(b);
        }
    }
    // Empty copies are no-ops, whatever the addresses.
    // SAFETY: nothing is touched.
    unsafe {
        dev.upload(0, &[]).unwrap();
        dev.download(&mut [], 0).unwrap();
        dev.copy(0, 0, 0).unwrap();
        dev.memset32(0, 0, 0).unwrap();
    }
    // SAFETY: never dereferenced: the alignment is checked first.
    assert!(matches!(unsafe { dev.memset32(2, 0, 1) }, Err(KernelError::InvalidArgument { .. })));

    // A device dropped with an upload in flight waits for it before releasing its staging buffers.
    let other = dev.fork_driver().unwrap();
    drop(dev);
    let p = other.alloc(1 << 20).unwrap();
    // SAFETY: `p` holds 1 MiB; it is freed after the copy in stream order.
    unsafe {
        other.upload(p, &vec![7u8; 1 << 20]).unwrap();
        other.free(p);
    }
    drop(other);
}

#[test]
fn a_kernel_runs_and_its_parameters_are_checked() {
    let Some(dev) = gpu("a_kernel_runs_and_its_parameters_are_checked") else { return };
    let n = 10_000usize;
    let input = values(n, 1);
    let x = upload(&dev, &bytes_f32(&input));
    let y = dev.alloc(4 * n).unwrap();
    poison(&dev, y, n);
    let mut args = KernelArgs::new();
    args.push(y).push(x).push(2.0f32).push(0.5f32).push(n as i32);
    let cfg = LaunchConfig::linear(n.div_ceil(256) as u32, 256);
    // SAFETY: `y` and `x` hold `n` floats; the parameters are the kernel's.
    unsafe { dev.launch(&kernel("longctx_test_affine"), &cfg, &args) }.unwrap();
    let got = as_f32(&download(&dev, y, 4 * n));
    assert!(got.iter().zip(&input).all(|(g, x)| *g == x * 2.0 + 0.5));

    if driver_has("cuFuncGetParamInfo") {
        let mut wrong = KernelArgs::new();
        wrong.push(y).push(x).push(2.0f32).push(0.5f32).push(n as i64);
        // SAFETY: refused before launching.
        match unsafe { dev.launch(&kernel("longctx_test_affine"), &cfg, &wrong) } {
            Err(KernelError::Device { op, why, .. }) => {
                assert_eq!(op, "longctx_test_affine");
                assert!(why.contains("[8, 8, 4, 4, 4]") && why.contains("[8, 8, 4, 4, 8]"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        let mut short = KernelArgs::new();
        short.push(y).push(x);
        // SAFETY: refused before launching.
        assert!(unsafe { dev.launch(&kernel("longctx_test_affine"), &cfg, &short) }.is_err());
    } else {
        eprintln!("a_kernel_runs_and_its_parameters_are_checked: the driver cannot report parameter sizes");
    }
    // SAFETY: refused before launching.
    let missing = unsafe { dev.launch(&Kernel { source: &TEST_KERNELS, name: "longctx_nope" }, &cfg, &args) };
    assert!(matches!(missing, Err(KernelError::Device { ref op, .. }) if op == "longctx_nope"), "{missing:?}");
    // SAFETY: refused before launching.
    let empty = unsafe { dev.launch(&kernel("longctx_test_affine"), &LaunchConfig::linear(0, 256), &args) };
    assert!(empty.is_err());
    // SAFETY: 2048 threads per block is more than any GPU allows: the driver refuses the launch.
    let too_big = unsafe { dev.launch(&kernel("longctx_test_affine"), &LaunchConfig::linear(1, 2048), &args) };
    assert!(matches!(too_big, Err(KernelError::Device { ref op, .. }) if op == "longctx_test_affine"), "{too_big:?}");
    // A refused launch leaves the context usable.
    dev.synchronize().unwrap();
    // SAFETY: the work using them has run.
    unsafe {
        dev.free(x);
        dev.free(y);
    }
    dev.synchronize().unwrap();
}

#[test]
fn more_than_48k_of_dynamic_shared_memory() {
    let Some(dev) = gpu("more_than_48k_of_dynamic_shared_memory") else { return };
    let n = 20_000usize; // 80,000 bytes
    let input = values(n, 2);
    let x = upload(&dev, &bytes_f32(&input));
    let y = dev.alloc(4 * n).unwrap();
    poison(&dev, y, n);
    let mut args = KernelArgs::new();
    args.push(y).push(x).push(n as i32);
    let cfg = LaunchConfig { grid: [1, 1, 1], block: [256, 1, 1], shared_bytes: (4 * n) as u32 };
    // SAFETY: `x`, `y` hold `n` floats; the shared memory holds `n` floats.
    unsafe { dev.launch(&kernel("longctx_test_reverse"), &cfg, &args) }.unwrap();
    let got = as_f32(&download(&dev, y, 4 * n));
    assert!(got.iter().rev().zip(&input).all(|(g, x)| g == x));
    let huge = LaunchConfig { shared_bytes: 16 << 20, ..cfg };
    // SAFETY: refused before launching.
    let err = unsafe { dev.launch(&kernel("longctx_test_reverse"), &huge, &args) }.unwrap_err();
    assert!(matches!(&err, KernelError::Device { op, .. } if op == "longctx_test_reverse"), "{err}");
    // SAFETY: the work using them has run.
    unsafe {
        dev.free(x);
        dev.free(y);
    }
    dev.synchronize().unwrap();
}

#[test]
fn events_order_forks_and_time_work() {
    // Unchecked: checked launches would synchronise each launch and the ordering would be trivial.
    let Some(a) = gpu_with("events_order_forks_and_time_work", DriverOptions { checked: false }) else { return };
    let b = a.fork_driver().unwrap();
    let n = 1 << 20;
    let buf = a.alloc(4 * n).unwrap();
    let out = a.alloc(4 * n).unwrap();
    // SAFETY: both hold `n` words.
    unsafe {
        a.memset32(buf, 0, n).unwrap();
        a.memset32(out, 0x7fc0_0000, n).unwrap();
    }
    // The allocations and memsets must be complete before the fork's stream uses the buffers.
    a.synchronize().unwrap();
    let start = a.timing_event().unwrap();
    let mut fill = KernelArgs::new();
    fill.push(buf).push(7.0f32).push(n as i32).push(20_000_000i64);
    // SAFETY: `buf` holds `n` floats.
    unsafe { a.launch(&kernel("longctx_test_slow_fill"), &LaunchConfig::linear((n / 256) as u32, 256), &fill) }
        .unwrap();
    let end = a.timing_event().unwrap();
    let filled = a.record_event().unwrap();
    b.wait_event(filled.as_ref()).unwrap();
    let mut copy = KernelArgs::new();
    copy.push(out).push(buf).push(1.0f32).push(0.0f32).push(n as i32);
    // SAFETY: both hold `n` floats; ordered after the fill by the event.
    unsafe { b.launch(&kernel("longctx_test_affine"), &LaunchConfig::linear((n / 256) as u32, 256), &copy) }.unwrap();
    assert!(as_f32(&download(&b, out, 4 * n)).iter().all(|&v| v == 7.0), "the fork ran before the event");
    filled.synchronize().unwrap();
    let ms = elapsed_ms(&start, &end).unwrap();
    assert!(ms > 0.0, "{ms} ms");
    eprintln!("slow fill: {ms:.2} ms");

    let other = gpu_with("events_order_forks_and_time_work", DriverOptions::default()).unwrap();
    let foreign = other.record_event().unwrap();
    assert!(matches!(a.wait_event(foreign.as_ref()), Err(KernelError::InvalidArgument { .. })));
    // SAFETY: the buffers were last used by work on `b`, which the download synchronised.
    unsafe {
        a.free(buf);
        a.free(out);
    }
    a.synchronize().unwrap();

    // Another thread (no context current on it yet) forks, uploads, launches and records: every call binds.
    std::thread::scope(|s| {
        s.spawn(|| {
            let c = a.fork_driver().unwrap();
            let v = values(1000, 5);
            let x = upload(&c, &bytes_f32(&v));
            let mut args = KernelArgs::new();
            args.push(x).push(x).push(1.0f32).push(1.0f32).push(1000i32);
            // SAFETY: `x` holds 1000 floats, read and written by the same thread of the kernel.
            unsafe { c.launch(&kernel("longctx_test_affine"), &LaunchConfig::linear(4, 256), &args) }.unwrap();
            c.record_event().unwrap().synchronize().unwrap();
            let got = as_f32(&download(&c, x, 4000));
            assert!(got.iter().zip(&v).all(|(g, v)| *g == v + 1.0));
            // SAFETY: the download synchronised the work using it.
            unsafe { c.free(x) };
        });
    });
}

/// `Device::time` stamps with timing events around the work: a slow kernel takes longer than no work, work
/// enqueued before the call is not counted, and a failure of the work comes back as it is.
#[test]
fn time_counts_the_work_it_wraps() {
    // Unchecked: a checked launch would synchronise and the host would wait inside the timed work.
    let Some(dev) = gpu_with("time_counts_the_work_it_wraps", DriverOptions { checked: false }) else { return };
    let n = 1 << 16;
    let buf = dev.alloc(4 * n).unwrap();
    let slow_fill = |cycles: i64| {
        let mut fill = KernelArgs::new();
        fill.push(buf).push(3.0f32).push(n as i32).push(cycles);
        // SAFETY: `buf` holds `n` floats.
        unsafe { dev.launch(&kernel("longctx_test_slow_fill"), &LaunchConfig::linear((n / 256) as u32, 256), &fill) }
    };
    // About 10 ms of spinning on any recent GPU clock.
    let cycles = 20_000_000;
    let slow = dev.time(&mut || slow_fill(cycles)).unwrap();
    // Enqueued before the timed (empty) work: the first stamp waits for it, so it is not counted.
    slow_fill(cycles).unwrap();
    let nothing = dev.time(&mut || Ok(())).unwrap();
    eprintln!("{}: slow fill {slow:?}, no work {nothing:?}", dev.info().name);
    assert!(slow > Duration::ZERO);
    if dev.info().name != "Mock H200" {
        // The mock driver answers 1.5 ms for every pair of events.
        assert!(slow > Duration::from_millis(1) && nothing < slow / 10, "{slow:?} vs {nothing:?}");
    }
    let failed = dev.time(&mut || Err(KernelError::Unsupported("the timed work failed")));
    assert!(matches!(failed, Err(KernelError::Unsupported("the timed work failed"))), "{failed:?}");
    assert!(as_f32(&download(&dev, buf, 4 * n)).iter().all(|&v| v == 3.0));
    // SAFETY: the download synchronised the work using it.
    unsafe { dev.free(buf) };
    dev.synchronize().unwrap();
}

#[test]
fn the_pool_keeps_memory_until_trimmed_and_oom_is_an_error() {
    let Some(dev) = gpu("the_pool_keeps_memory_until_trimmed_and_oom_is_an_error") else { return };
    let big = 256 << 20;
    let p = dev.alloc(big).unwrap();
    dev.synchronize().unwrap();
    let held = dev.memory_stats();
    assert!(held.used >= big && held.reserved >= big && held.used_high >= big, "{held:?}");
    // SAFETY: allocated above, unused.
    unsafe { dev.free(p) };
    dev.synchronize().unwrap();
    let kept = dev.memory_stats();
    assert!(kept.used < big && kept.reserved >= big, "freed memory stays in the pool: {kept:?}");
    dev.trim().unwrap();
    let trimmed = dev.memory_stats();
    assert!(trimmed.reserved < big && trimmed.reserved_high >= big, "{trimmed:?}");
    dev.reset_peak_memory().unwrap();
    assert!(dev.memory_stats().reserved_high < big);

    let total = dev.info().total_memory;
    let oom = |r: Result<DevicePtr>, asked: usize| match r {
        Err(KernelError::OutOfMemory { bytes, free, memory }) => {
            assert_eq!((bytes, memory), (asked, Memory::Cuda { ordinal: 0 }));
            assert!(free <= total);
        }
        other => panic!("{other:?}"),
    };
    // More than the device has: refused without asking the driver.
    oom(dev.alloc(total * 2), total * 2);
    // Twice 60%: the second fails in the driver, the pool is trimmed, the retry fails too.
    let most = total / 10 * 6;
    let first = dev.alloc(most).unwrap();
    oom(dev.alloc(most), most);
    // Out of memory is not sticky.
    let q = dev.alloc(1 << 20).unwrap();
    // SAFETY: allocated above, unused.
    unsafe {
        dev.free(q);
        dev.free(first);
    }
    dev.trim().unwrap();
}

/// `D = alpha · op(A) · op(B) + beta · C (+ bias)` on the host, in f64, column-major like [`Gemm`].
fn host_gemm(g: &Gemm, a: &[f32], b: &[f32], c: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
    let mut d = c.to_vec();
    for batch in 0..g.batch {
        let (a0, b0, c0) = (batch * g.stride_a, batch * g.stride_b, batch * g.stride_c);
        for j in 0..g.n {
            for i in 0..g.m {
                let mut acc = 0f64;
                for p in 0..g.k {
                    let x = if g.trans_a { a[a0 + p + i * g.lda] } else { a[a0 + i + p * g.lda] };
                    let y = if g.trans_b { b[b0 + j + p * g.ldb] } else { b[b0 + p + j * g.ldb] };
                    acc += f64::from(x) * f64::from(y);
                }
                let at = c0 + i + j * g.ldc;
                let mut v = f64::from(g.alpha) * acc + f64::from(g.beta) * f64::from(c[at]);
                if let Some(bias) = bias {
                    v += f64::from(bias[i]);
                }
                d[at] = v as f32;
            }
        }
    }
    d
}

struct GemmCase {
    name: &'static str,
    g: Gemm,
    /// Element offset of A in its buffer (a view into the middle of one).
    a_offset: usize,
    bias: bool,
}

fn base_gemm(m: usize, n: usize, k: usize, ab: DType, c: DType) -> Gemm {
    Gemm {
        m,
        n,
        k,
        a: 0,
        lda: m,
        trans_a: false,
        stride_a: 0,
        b: 0,
        ldb: k,
        trans_b: false,
        stride_b: 0,
        c: 0,
        ldc: m,
        stride_c: 0,
        ab_type: ab,
        c_type: c,
        batch: 1,
        alpha: 1.0,
        beta: 0.0,
        bias: None,
        tf32: false,
    }
}

fn run_case(dev: &DriverDevice, case: &GemmCase) {
    let mut g = case.g;
    let a_len = case.a_offset + (g.batch - 1) * g.stride_a + g.lda * if g.trans_a { g.m } else { g.k };
    let b_len = (g.batch - 1) * g.stride_b + g.ldb * if g.trans_b { g.k } else { g.n };
    let c_len = (g.batch - 1) * g.stride_c + g.ldc * g.n;
    let (a, b, c0, bias) = (values(a_len, 1), values(b_len, 2), values(c_len, 3), values(g.m, 4));
    let enc = |t: DType, v: &[f32]| if t == DType::F32 { bytes_f32(v) } else { bytes_bf16(v) };
    let a_buf = upload(dev, &enc(g.ab_type, &a));
    let b_buf = upload(dev, &enc(g.ab_type, &b));
    let c_bytes = (c_len * g.c_type.size()).next_multiple_of(4);
    let c_buf = dev.alloc(c_bytes).unwrap();
    if g.beta == 0.0 {
        // beta = 0 must not read C: NaN there must not show.
        poison(dev, c_buf, c_bytes / 4);
    } else {
        // SAFETY: `c_buf` holds `c_len` elements.
        unsafe { dev.upload(c_buf, &enc(g.c_type, &c0)) }.unwrap();
    }
    let bias_buf = case.bias.then(|| upload(dev, &enc(g.c_type, &bias)));
    g.a = a_buf + (case.a_offset * g.ab_type.size()) as u64;
    g.b = b_buf;
    g.c = c_buf;
    g.bias = bias_buf;
    // SAFETY: every buffer covers what the product touches.
    unsafe { dev.gemm(&g) }.unwrap_or_else(|e| panic!("{}: {e}", case.name));
    let raw = download(dev, c_buf, c_len * g.c_type.size());
    let got = if g.c_type == DType::F32 { as_f32(&raw) } else { as_bf16(&raw) };
    let c_in = if g.beta == 0.0 { vec![0.0; c_len] } else { c0 };
    let want = host_gemm(&g, &a[case.a_offset..], &b, &c_in, case.bias.then_some(bias.as_slice()));
    for batch in 0..g.batch {
        for j in 0..g.n {
            for i in 0..g.m {
                let at = batch * g.stride_c + i + j * g.ldc;
                // Every input is a multiple of 1/8 in [-1, 1], so f32 sums are exact in any order: an f32 output
                // must be exact. A bf16 output is the exact value rounded, once if the epilogue adds beta · C and
                // the bias in f32 as documented; one bf16 step of slack allows a second rounding.
                let (w, slack) = if g.c_type == DType::F32 {
                    (want[at], 0.0)
                } else {
                    let w = bf16::from_f32(want[at]).to_f32();
                    (w, w.abs() * 2f32.powi(-7))
                };
                assert!(
                    (got[at] - w).abs() <= slack,
                    "{}: D[{i}, {j}] of batch {batch} = {}, expected {w}",
                    case.name,
                    got[at]
                );
            }
        }
    }
    for p in [Some(a_buf), Some(b_buf), Some(c_buf), bias_buf].into_iter().flatten() {
        // SAFETY: allocated above; the product was enqueued before these frees.
        unsafe { dev.free(p) };
    }
}

#[test]
fn products_match_the_host() {
    let Some(dev) = gpu("products_match_the_host") else { return };
    let mut cases = Vec::new();
    let mut g = base_gemm(37, 29, 53, DType::F32, DType::F32);
    (g.lda, g.ldb, g.ldc) = (40, 60, 41);
    cases.push(GemmCase { name: "f32 NN, padded leading dimensions", g, a_offset: 0, bias: false });
    let mut g = base_gemm(37, 29, 53, DType::F32, DType::F32);
    (g.trans_a, g.lda, g.alpha, g.beta) = (true, 53, 0.5, 2.0);
    cases.push(GemmCase { name: "f32 TN, alpha and beta", g, a_offset: 0, bias: false });
    let mut g = base_gemm(64, 48, 96, DType::F32, DType::F32);
    (g.trans_b, g.ldb, g.tf32) = (true, 48, true);
    cases.push(GemmCase { name: "f32 NT with TF32", g, a_offset: 0, bias: true });
    let mut g = base_gemm(64, 32, 128, DType::Bf16, DType::F32);
    (g.batch, g.stride_a, g.stride_b, g.stride_c) = (3, 64 * 128 + 8, 128 * 32, 64 * 32 + 64);
    cases.push(GemmCase { name: "bf16 → f32, batched, bias", g, a_offset: 0, bias: true });
    let g = base_gemm(128, 64, 256, DType::Bf16, DType::Bf16);
    cases.push(GemmCase { name: "bf16 → bf16, bias", g, a_offset: 0, bias: true });
    let mut g = base_gemm(33, 17, 45, DType::Bf16, DType::Bf16);
    (g.lda, g.beta) = (35, 1.0);
    cases.push(GemmCase { name: "bf16 → bf16, A one element into its buffer, odd lda", g, a_offset: 1, bias: false });
    let mut g = base_gemm(24, 40, 72, DType::Bf16, DType::F32);
    (g.trans_a, g.lda, g.trans_b, g.ldb) = (true, 73, true, 41);
    cases.push(GemmCase { name: "bf16 → f32 TT, A 2-byte aligned", g, a_offset: 3, bias: true });
    for case in &cases {
        run_case(&dev, case);
    }
    // Same shapes again: the algorithms come from the cache.
    let cached = dev.shared.blas().unwrap().cached();
    for case in &cases {
        run_case(&dev, case);
    }
    assert_eq!(dev.shared.blas().unwrap().cached(), cached);
    // SAFETY: refused before anything is enqueued.
    let mut g = base_gemm(8, 8, 8, DType::F32, DType::Bf16);
    (g.a, g.b, g.c) = (256, 256, 256);
    assert!(matches!(unsafe { dev.gemm(&g) }, Err(KernelError::Unsupported(_))));
    dev.synchronize().unwrap();
}

/// The same product twice gives the same bits, with a long K that invites split-K (see gemm.rs, "Determinism").
#[test]
fn gemm_is_bitwise_reproducible() {
    let Some(dev) = gpu("gemm_is_bitwise_reproducible") else { return };
    for (m, n, k, c_type) in
        [(64, 64, 1 << 16, DType::F32), (96, 80, 1 << 15, DType::Bf16), (1024, 1024, 4096, DType::F32)]
    {
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        let a_buf = upload(&dev, &bytes_bf16(&a));
        let b_buf = upload(&dev, &bytes_bf16(&b));
        let mut outs = Vec::new();
        for _ in 0..3 {
            let c = dev.alloc(m * n * c_type.size()).unwrap();
            poison(&dev, c, m * n * c_type.size() / 4);
            let mut g = base_gemm(m, n, k, DType::Bf16, c_type);
            (g.a, g.b, g.c) = (a_buf, b_buf, c);
            // SAFETY: the buffers cover the product.
            unsafe { dev.gemm(&g) }.unwrap();
            outs.push(download(&dev, c, m * n * c_type.size()));
            // SAFETY: downloaded, unused.
            unsafe { dev.free(c) };
        }
        assert!(outs.iter().all(|o| o == &outs[0]), "{m}×{n}×{k} → {c_type:?} differs run to run");
        // SAFETY: the products using them were synchronised by the downloads.
        unsafe {
            dev.free(a_buf);
            dev.free(b_buf);
        }
    }
}

/// With checked launches a fault is reported by the launch that caused it, naming the kernel. The fault breaks
/// the context for the rest of the process, so it runs in a child process (the ignored test below).
#[test]
fn a_checked_launch_names_the_faulting_kernel() {
    if gpu("a_checked_launch_names_the_faulting_kernel").is_none() {
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args(["--exact", "cuda::driver::tests::fault_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env("LONGCTX_FAULT_CHILD", "1")
        .output()
        .expect("running the child test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stdout.contains("FAULT NAMED: "), "child:\n{stdout}\n{stderr}");
}

#[test]
#[ignore = "run by a_checked_launch_names_the_faulting_kernel in a child process"]
fn fault_child() {
    if std::env::var("LONGCTX_FAULT_CHILD").as_deref() != Ok("1") {
        return;
    }
    fault_is_named(&gpu("fault_child").expect("a GPU in the child"));
}

/// Launches the faulting kernel with checked launches and prints `FAULT NAMED: …` when the launch reports it.
fn fault_is_named(dev: &DriverDevice) {
    let p = dev.alloc(256).unwrap();
    let mut args = KernelArgs::new();
    args.push(p);
    // SAFETY: the kernel faults on purpose; the context is not used for anything else afterwards.
    match unsafe { dev.launch(&kernel("longctx_test_fault"), &LaunchConfig::linear(1, 1), &args) } {
        Err(KernelError::Device { op, why, .. }) if op == "longctx_test_fault" => println!("FAULT NAMED: {why}"),
        other => panic!("expected the fault to name the kernel: {other:?}"),
    }
    // Sticky: the next call fails too.
    assert!(dev.synchronize().is_err());
    // SAFETY: allocated above; nothing will run.
    unsafe { dev.free(p) };
}

/// Where there is no driver, every path of `DriverDevice` except cuBLASLt's runs against `mock_cuda.c`, a
/// stand-in for `libcuda.so.1` that executes streams late (so early reuse of a staging buffer corrupts data),
/// insists on a current context where the driver uses it, and counts what is left alive: the GPU tests above
/// run in a child process with it as the driver, and then nothing may be leaked or misused.
#[test]
fn driver_paths_against_a_mock_driver() {
    let test = "driver_paths_against_a_mock_driver";
    if CudaLib::Driver.loader_finds() {
        eprintln!("{test}: skipped, a real driver is here (the GPU tests run for real)");
        return;
    }
    if !crate::cuda::nvrtc::tests::nvrtc_or_skip(test) {
        return;
    }
    let dir = crate::cuda::places::tests::TempDir::new("mock-cuda");
    let src = dir.file("mock_cuda.c", include_bytes!("mock_cuda.c"));
    let lib = dir.0.join("libcuda.so.1");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let built = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-Wl,-soname,libcuda.so.1", "-o"])
        .arg(&lib)
        .arg(&src)
        .arg("-lpthread")
        .output();
    match built {
        Err(e) => {
            eprintln!("{test}: skipped, no C compiler `{cc}`: {e}");
            return;
        }
        Ok(o) => assert!(o.status.success(), "building the mock driver:\n{}", String::from_utf8_lossy(&o.stderr)),
    }
    let mut dirs = dir.0.as_os_str().to_os_string();
    if let Some(more) = std::env::var_os("LONGCTX_CUDA_LIB_DIRS") {
        dirs.push(":");
        dirs.push(more);
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args(["--exact", "cuda::driver::tests::mock_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env("LONGCTX_MOCK_CHILD", "1")
        .env("LONGCTX_CUDA_LIB_DIRS", dirs)
        .env_remove("LONGCTX_CUDA_SYNC")
        .env_remove("LONGCTX_CUDA_ARCH")
        .output()
        .expect("running the child test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stdout.contains("MOCK DRIVER OK"), "child:\n{stdout}\n{stderr}");
}

#[test]
#[ignore = "run by driver_paths_against_a_mock_driver in a child process"]
fn mock_child() {
    if std::env::var("LONGCTX_MOCK_CHILD").as_deref() != Ok("1") {
        return;
    }
    // Loads the mock (the first folder of LONGCTX_CUDA_LIB_DIRS) as the driver.
    libraries::ensure(CudaLib::Driver).expect("the mock driver");
    let symbol = |name: &std::ffi::CStr| {
        // SAFETY: looks a symbol up among the libraries loaded with RTLD_GLOBAL (the mock is one).
        let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
        assert!(!p.is_null(), "{name:?}: the driver loaded is not the mock");
        p
    };
    // SAFETY: the mock defines these with exactly these C signatures.
    let (live, counter, violation) = unsafe {
        (
            std::mem::transmute::<*mut c_void, extern "C" fn(i32) -> i64>(symbol(c"longctx_mock_live")),
            std::mem::transmute::<*mut c_void, extern "C" fn(*const std::ffi::c_char) -> i64>(symbol(
                c"longctx_mock_counter",
            )),
            std::mem::transmute::<*mut c_void, extern "C" fn() -> *const std::ffi::c_char>(symbol(
                c"longctx_mock_violation",
            )),
        )
    };
    let check = |after: &str| {
        let v = violation();
        if !v.is_null() {
            // SAFETY: a NUL-terminated string of the mock's, valid for the process's life.
            panic!("after {after}: {}", unsafe { std::ffi::CStr::from_ptr(v) }.to_string_lossy());
        }
    };
    let steps: [(&str, fn()); 8] = [
        ("no_driver_or_no_such_device_is_no_device_not_a_panic", no_driver_or_no_such_device_is_no_device_not_a_panic),
        ("info_arch_and_aligned_allocations", info_arch_and_aligned_allocations),
        ("copies_round_trip_and_upload_is_done_with_its_source", copies_round_trip_and_upload_is_done_with_its_source),
        ("a_kernel_runs_and_its_parameters_are_checked", a_kernel_runs_and_its_parameters_are_checked),
        ("more_than_48k_of_dynamic_shared_memory", more_than_48k_of_dynamic_shared_memory),
        ("events_order_forks_and_time_work", events_order_forks_and_time_work),
        ("time_counts_the_work_it_wraps", time_counts_the_work_it_wraps),
        (
            "the_pool_keeps_memory_until_trimmed_and_oom_is_an_error",
            the_pool_keeps_memory_until_trimmed_and_oom_is_an_error,
        ),
    ];
    for (name, step) in steps {
        step();
        check(name);
    }
    assert!(counter(c"trims".as_ptr()) >= 2, "an out-of-memory retry trims the pool");
    fault_is_named(&gpu("mock_child").expect("the mock device"));
    check("the fault");
    // Every device is dropped by now: nothing of the driver's may be left.
    for (kind, what) in
        ["pools", "streams", "events", "page-locked buffers", "device allocations", "modules"].iter().enumerate()
    {
        assert_eq!(live(kind as i32), 0, "{what} left alive");
    }
    assert_eq!(counter(c"primary_refs".as_ptr()), 0, "the primary context was not released");
    assert!(counter(c"launches".as_ptr()) > 0 && counter(c"module_loads".as_ptr()) > 0);
    println!("MOCK DRIVER OK");
}

/// The kernels above compile cleanly (checked here, without a GPU, so that a GPU run does not find out).
#[test]
fn the_test_kernels_compile() {
    if !crate::cuda::nvrtc::tests::nvrtc_or_skip("the_test_kernels_compile") {
        return;
    }
    for arch in ["sm_80", "sm_90"] {
        let c = nvrtc::compile(&TEST_KERNELS, arch).unwrap_or_else(|e| panic!("{e}"));
        assert!(c.log.is_empty(), "warnings for {arch}:\n{}", c.log);
    }
}
