//! The `Backend` interface on every backend present (`test_device!`): the conformance suite's families for data
//! (upload/download round trips of every bit pattern, row ranges, `zeros`, `empty`, a fork's queue and events),
//! the utilities (`copy`, `fill`, `add`, `scale`, `transpose12`, `sum_squares`, `clip_grad_norm`) and typed errors
//! (bad dims, dtypes and scalars of every op give the CPU backend's error and leave the outputs untouched; on a
//! device backend, a host view is a `Memory` error naming it). Then what belongs to one backend: the CPU's SIMD
//! paths, scratch and host cache; the CUDA backend in every build; views of another backend's memory; the saved
//! tensors' sizes.

#[macro_use]
mod common;

use common::Device;
use half::bf16;
use longctx_kernels::cpu::SimdPath;
use longctx_kernels::testing::conformance::Family;
use longctx_kernels::testing::uniform_nonzero;
use longctx_kernels::{
    AttnSaved, AttnShape, Backend, Buffer, CpuBackend, DType, Dims, HostVec, KernelError, LayerNormSaved, LinearSaved,
    RmsNormSaved, SwigluSaved, View, ViewMut,
};

fn memory(dev: &Device) {
    dev.conformance(&[Family::Memory]);
}

fn elementwise(dev: &Device) {
    dev.conformance(&[Family::Elementwise]);
}

fn errors(dev: &Device) {
    dev.conformance(&[Family::Errors]);
}

/// Host memory registered with the backend (what a host tier's pool buffers are): an upload from part of it and a
/// download into another part round-trip every value, and unregistering leaves it ordinary memory (on the CUDA
/// backend, the upload takes the registered path: one DMA copy, no staging).
fn registered_host_memory(dev: &Device) {
    let b = dev.backend();
    let layout = std::alloc::Layout::from_size_align(1 << 16, 4096).unwrap();
    // SAFETY: a non-zero size; freed below with the same layout.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!ptr.is_null());
    // SAFETY: 64 KiB of this process's memory, mapped until the dealloc below, which follows the unregister.
    unsafe { b.register_host(ptr, layout.size()) }.unwrap();
    {
        // SAFETY: the allocation holds 16384 f32, aligned to 4096; nothing else refers to it.
        let all = unsafe { std::slice::from_raw_parts_mut(ptr.cast::<f32>(), 1 << 14) };
        let (src, dst) = all.split_at_mut(1 << 13);
        for (i, x) in src.iter_mut().enumerate() {
            *x = (i as f32 * 0.37).sin() + 2.0;
        }
        let mut on = b.empty(DType::F32, Dims::new(&[64, 128]).unwrap()).unwrap();
        b.upload(on.view_mut(), View::new(&*src, [64, 128]).unwrap()).unwrap();
        dst.fill(f32::NAN);
        b.download(ViewMut::new(&mut *dst, [64, 128]).unwrap(), on.view()).unwrap();
        assert!(src.iter().zip(dst.iter()).all(|(a, c)| a.to_bits() == c.to_bits()), "{}", dev.name());
    }
    b.synchronize().unwrap();
    // SAFETY: registered above, no copy in flight (synchronised).
    unsafe { b.unregister_host(ptr, layout.size()) };
    // SAFETY: allocated above with `layout`.
    unsafe { std::alloc::dealloc(ptr, layout) };
}

/// A buffer allocated and filled on a fork (a copy queue) and adopted by the backend: the backend's own work sees
/// what the fork wrote, and the buffer, dropped after that work, goes back to the pool on the backend's queue
/// (on a GPU, the memory is not handed out again while the backend still reads it: a loop of such hand-overs
/// reading each buffer gives every value back). Adopting its own buffer, or a host buffer, changes nothing.
fn adopted_buffers(dev: &Device) {
    let b = dev.backend();
    let copier = b.fork().unwrap();
    let dims = Dims::new(&[32, 257]).unwrap();
    let mut total = 0.0f64;
    let mut want = 0.0f64;
    for round in 0..8 {
        let src: Vec<f32> = (0..32 * 257).map(|i| ((i + round * 7) % 97) as f32).collect();
        want += src.iter().map(|&x| f64::from(x) * 2.0).sum::<f64>();
        let mut on = copier.empty(DType::F32, dims).unwrap();
        copier.upload(on.view_mut(), View::new(&src, [32, 257]).unwrap()).unwrap();
        b.adopt(&mut on).unwrap();
        b.scale(on.view_mut(), 2.0).unwrap();
        let mut back = vec![0.0f32; src.len()];
        b.download(ViewMut::new(&mut back, [32, 257]).unwrap(), on.view()).unwrap();
        total += back.iter().map(|&x| f64::from(x)).sum::<f64>();
        drop(on);
    }
    assert_eq!(total, want, "{}", dev.name());
    let mut own = b.zeros(DType::F32, dims).unwrap();
    b.adopt(&mut own).unwrap();
    let mut host = longctx_kernels::Buffer::host_zeros(DType::F32, dims).unwrap();
    b.adopt(&mut host).unwrap();
    b.synchronize().unwrap();
}

test_device!(memory, elementwise, errors, registered_host_memory, adopted_buffers);

#[test]
fn simd_levels_are_listed_and_clamped() {
    let all = SimdPath::supported();
    assert_eq!(all[0], SimdPath::Portable);
    assert_eq!(*all.last().unwrap(), SimdPath::detect());
    assert!(all.windows(2).all(|w| w[0] < w[1]));
    for p in SimdPath::ALL {
        let c = p.clamp_supported();
        assert!(c <= p && c.is_supported() && all.contains(&c));
        assert_eq!(p.is_supported(), c == p);
    }
    assert_eq!(SimdPath::Avx512.clamp_supported(), SimdPath::detect());
}

#[test]
fn the_cuda_backend_exists_in_every_build_and_says_why_it_cannot_start() {
    match longctx_kernels::CudaBackend::new(0) {
        Err(KernelError::NotCompiled { feature: "cuda", .. }) => {
            eprintln!("cuda: not compiled (no `cuda` feature): skipped")
        }
        Err(KernelError::NoDevice { why, .. }) => eprintln!("cuda: {why}: skipped"),
        Ok(_) => eprintln!("cuda: device 0 is present"),
        Err(other) => panic!("unexpected: {other:?}"),
    }
}

/// A view of one backend's memory given to another is a `Memory` error naming it, both ways (the emulated CUDA
/// backend's device memory and the CPU's host memory).
#[cfg(feature = "cuda")]
#[test]
fn a_view_of_another_backends_memory_is_a_memory_error() {
    let Some(emu) = common::cuda_emulated("a_view_of_another_backends_memory_is_a_memory_error") else { return };
    let cpu = CpuBackend::new();
    let mut dev = emu.zeros(DType::F32, Dims::new(&[4]).unwrap()).unwrap();
    let mut host = [7.0f32; 4];
    let e = cpu.copy(ViewMut::new(&mut host, [4]).unwrap(), dev.view()).unwrap_err();
    assert!(matches!(e, KernelError::Memory { name: "src", got, .. } if got == emu.memory()), "{e:?}");
    assert_eq!(host, [7.0; 4], "untouched on error");
    let e = emu.copy(dev.view_mut(), View::new(&host, [4]).unwrap()).unwrap_err();
    assert!(matches!(e, KernelError::Memory { name: "src", got: longctx_kernels::Memory::Host, .. }), "{e:?}");
}

/// `CudaBackend::time` counts what the device waits for between its two stamps (here the host, sleeping) and the
/// ops enqueued between them, and hands back the closure's error; `is_emulated` tells the two devices apart;
/// `compile_kernels` succeeds (on the emulator there is nothing left to compile).
#[cfg(feature = "cuda")]
fn times_its_work(test: &str, b: &longctx_kernels::CudaBackend, emulated: bool) {
    assert_eq!(b.is_emulated(), emulated);
    b.compile_kernels().unwrap();
    let n = 1 << 20;
    let src = b.zeros(DType::F32, Dims::new(&[n]).unwrap()).unwrap();
    let mut dst = b.empty(DType::F32, Dims::new(&[n]).unwrap()).unwrap();
    let nap = std::time::Duration::from_millis(20);
    let slept = b.time(|| {
        std::thread::sleep(nap);
        b.copy(dst.view_mut(), src.view())
    });
    let slept = slept.unwrap();
    assert!(slept >= nap - std::time::Duration::from_millis(1), "{slept:?}");
    let copy = b.time(|| b.copy(dst.view_mut(), src.view())).unwrap();
    assert!(copy > std::time::Duration::ZERO, "{copy:?}");
    let failed = b.time(|| Err(KernelError::Unsupported("the timed work failed")));
    assert!(matches!(failed, Err(KernelError::Unsupported("the timed work failed"))), "{failed:?}");
    eprintln!("{test}: {}: 4 MiB copy {copy:?}, with a {nap:?} nap {slept:?}", b.device_name());
}

#[cfg(feature = "cuda")]
#[test]
fn the_emulated_cuda_backend_times_its_work() {
    let test = "the_emulated_cuda_backend_times_its_work";
    if let Some(b) = common::cuda_emulated_backend(test) {
        times_its_work(test, &b, true);
    }
}

#[cfg(feature = "cuda")]
#[test]
fn the_cuda_backend_times_its_work() {
    let test = "the_cuda_backend_times_its_work";
    if let Some(b) = common::cuda_backend(test) {
        times_its_work(test, &b, false);
    }
}

/// What a forward saves has the size its `bytes_for` states, from the shapes alone.
#[test]
fn saved_tensors_have_the_sizes_bytes_for_states() {
    let (n, c, f) = (5, 7, 12);
    let (x, r, g) = (vec![0.5f32; n * c], vec![1.0f32; n], vec![bf16::ONE; n * f]);
    let xv = View::new(&x, [n, c]).unwrap();
    assert_eq!(LinearSaved { x: xv }.bytes(), LinearSaved::bytes_for(n, c, DType::F32));
    let saved = RmsNormSaved { x: xv, rstd: View::flat(&r) };
    assert_eq!(saved.bytes(), RmsNormSaved::bytes_for(n, c, DType::F32));
    let saved = LayerNormSaved { x: xv, mean: View::flat(&r), rstd: View::flat(&r) };
    assert_eq!(saved.bytes(), LayerNormSaved::bytes_for(n, c, DType::F32));
    let gv = View::new(&g, [n, f]).unwrap();
    assert_eq!(SwigluSaved { gate: gv, up: gv }.bytes(), SwigluSaved::bytes_for(n, f, DType::Bf16));
    let shape = AttnShape { batch: 1, q_heads: 4, kv_heads: 2, q_len: 3, kv_len: 5, head_dim: 32 };
    let (q, kv, lse) = (vec![0f32; shape.q_elems()], vec![0f32; shape.kv_elems()], vec![0f32; shape.lse_elems()]);
    let qkv = longctx_kernels::Qkv::new(
        View::new(&q, shape.q_dims()).unwrap(),
        View::new(&kv, shape.kv_dims()).unwrap(),
        View::new(&kv, shape.kv_dims()).unwrap(),
    );
    let saved =
        AttnSaved { qkv, o: View::new(&q, shape.q_dims()).unwrap(), lse: View::new(&lse, shape.lse_dims()).unwrap() };
    assert_eq!(saved.bytes(), AttnSaved::bytes_for(&shape, DType::F32));
}

/// The CPU backend frees its bf16 scratch on request without changing a result, on rayon's pool and on its own.
#[test]
fn cpu_release_scratch_frees_the_bf16_buffers_and_changes_no_result() {
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
fn cpu_reuses_a_large_buffer_zeroed_from_zeros_and_poisoned_from_empty_in_debug() {
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

/// A view is checked once, when it is made: dims its data does not fill, or whose element count overflows, are a
/// `Shape` error, so no backend ever sees such a view.
#[test]
fn views_refuse_dims_their_data_does_not_fill() {
    let mut x = vec![1.0f32; 6];
    assert!(matches!(View::new(&x[..5], [2, 3]), Err(KernelError::Shape(_))));
    assert!(matches!(View::new(&x, [usize::MAX, 3]), Err(KernelError::Shape(_))));
    assert!(matches!(View::new(&x, [1, 1, 1, 1, 6]), Err(KernelError::Shape(_))));
    assert!(matches!(ViewMut::new(&mut x[..3], [2, 2]), Err(KernelError::Shape(_))));
    let v = View::new(&x, [2, 3]).unwrap();
    assert!(matches!(v.rows(1, 2), Err(KernelError::Shape(_))));
    assert_eq!(v.rows(1, 1).unwrap().dims(), &[1, 3]);
    let z = CpuBackend::new().zeros(DType::Bf16, Dims::new(&[2, 3]).unwrap()).unwrap();
    assert_eq!((z.dims(), z.dtype(), z.bytes()), (&[2, 3][..], DType::Bf16, 12));
}
