// Inline-PTX wrappers for Hopper's tensor memory accelerator (TMA: cp.async.bulk.tensor loads and stores) and the
// shared-memory barriers (mbarrier) its loads complete on. Prepended (after common.cuh and ptx.cuh, before
// ptx_hopper.cuh when a source lists both) to the sources that list it among their includes. As in ptx.cuh, every
// wrapper has its GPU side (inline PTX) and its emulator side (LONGCTX_EMU: runtime.cpp), with the same semantics.
//
// Architecture: everything here is plain sm_90 PTX (PTX ISA 8.0), not sm_90a: NVRTC compiles it for sm_90 and
// sm_90a and refuses it for sm_80 (the #error below says so first). sources.rs records the rule: a source including
// this header needs at least sm_90 (sources::needs_sm90); one that also includes ptx_hopper.cuh is sm_90a-only, as
// any source including that header is. setmaxnreg, which warp-specialised kernels use beside TMA, is sm_90a and lives
// in ptx_hopper.cuh.
//
// Sources: NVIDIA's PTX ISA 8.x: "Parallel Synchronization and Communication Instructions: mbarrier" (9.7.13.15):
// the object's phase, pending-arrival and tx-count (9.7.13.15.1-9.7.13.15.4), mbarrier.init (9.7.13.15.9),
// mbarrier.expect_tx (9.7.13.15.11), mbarrier.arrive (9.7.13.15.13), mbarrier.test_wait/try_wait (9.7.13.15.16);
// "Data Movement: cp.async.bulk.tensor" (9.7.9.25.5.1) and the tensor copies' "Tensor Data" chapter (5.5: bounding
// box, traversal stride, out-of-bound access, swizzling modes 5.5.6); "Membar/Fence" (9.7.13.4: fence.proxy.async,
// fence.mbarrier_init); "prefetch, prefetchu" (9.7.9.15: .tensormap). The CUDA driver API's cuTensorMapEncodeTiled
// states the tensor map's rules (tensor_map.rs checks them on the host).
//
// The mbarrier (a 64-bit object in shared memory, 8-byte aligned):
// - Its state is the current phase (its parity: 0 first), the pending-arrival count, the expected-arrival count
//   and the tx-count (bytes of asynchronous transactions still to come, may go negative).
// - mbarrier.init.shared::cta.b64 [bar], count (mbarrier_init): phase 0, expected = pending = count (1..2^20-1),
//   tx-count 0. Then fence.mbarrier_init.release.cluster (mbarrier_fence_init) and a barrier (__syncthreads) before
//   other threads or the TMA use it.
// - mbarrier.arrive.shared::cta.b64 (mbarrier_arrive): pending-arrival count - 1; returns a state token (unused
//   here: the kernels wait on parities).
// - mbarrier.arrive.expect_tx.shared::cta.b64 [bar], tx (mbarrier_arrive_expect_tx): tx-count += tx, then an arrive.
// - complete-tx (done by the TMA, not by an instruction of ours): tx-count -= the bytes a copy wrote.
// - The current phase completes when its pending-arrival count is 0 and its tx-count is 0: the phase parity flips,
//   the pending count is reset to the expected count, and waiters of the completed phase are released.
// - mbarrier.try_wait.parity.shared::cta.b64 p, [bar], parity (mbarrier_try_wait): p = whether the phase of parity
//   `parity` has completed, i.e. the current phase's parity differs from `parity` (parity names the current phase or
//   the one just before it). try_wait may suspend the thread a while before answering false.
// - mbarrier_wait(bar, parity): try_wait in a loop until true. The producer/consumer idiom: consumer k waits on a
//   "full" barrier with the parity of its k-th use of the stage ((k / stages) & 1); the producer waits on the
//   "empty" barrier with the opposite parity (the first wait, parity 1, passes at once: it names the phase "before"
//   phase 0).
//
// The tensor copy (cp.async.bulk.tensor.{2,3,4}d.shared::cluster.global.mbarrier::complete_tx::bytes, tma_load_*d):
// one thread issues the copy of a box of the tensor a tensor map describes (tensor_map.rs: element size, dims,
// byte strides, box dims, swizzle), starting at integer coordinates c0 (innermost) .. c{r-1} (signed: a box may start
// before 0 or run past the end; elements out of bounds are written as zeros). The box lands in shared memory densely,
// innermost coordinate fastest (box0 · elem bytes per row), with the map's swizzle applied to the shared address:
// byte address a is stored at a ^ (((a >> 7) & m) << 4), m = 7 for the 128B swizzle, 3 for 64B, 1 for 32B (the
// patterns repeat every 1024/512/256 bytes). The destination must be 128-byte aligned (1024 for the 128B swizzle).
// When the copy has written all its bytes it performs complete-tx of the box's size (out-of-bounds zeros included) on
// the mbarrier: a thread must have announced them with arrive.expect_tx, usually the issuing thread just before.
// The copy is in the async proxy: what it writes is visible to the threads that observed the phase complete, and to
// wgmma (also async proxy) with no proxy fence. Shared memory a consumer read with ordinary loads may be overwritten
// by the next TMA after the consumer's arrive on the "empty" barrier and the producer's wait on it.
// The tensor map is passed as a `const __grid_constant__ CUtensorMap` kernel parameter and used by its address.
// prefetch.tensormap [map] (tma_prefetch_map) brings the map into the cache ahead of the first copy: a hint.
//
// The emulator (mod.rs says what is exact and what is approximate): mbarriers live in a table of the block keyed by
// their shared address, exactly as above (errors for an uninitialised barrier, more arrivals than expected, a
// count out of range); a copy is checked when issued (the map's format, the destination's alignment and range, the
// barrier) and lands, reading global memory then, when a thread polls the barrier it completes on (try_wait), so a
// kernel reading a stage before waiting sees the poison (0xFF bytes, NaN). try_wait and mbarrier_wait are
// scheduling points: a waiting thread sleeps until the barrier changes (a lone try_wait answers false once the whole
// block waits), and a block whose live threads all wait on something that cannot come is a deadlock error naming
// threads, lines and the barriers' state. The emulator's tensor map is its own
// 128-byte format (tensor_map.rs encodes it), not the driver's.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "ptx_tma.cuh: mbarrier try_wait, cp.async.bulk.tensor and fence.proxy.async need sm_90 or later"
#endif

// In the emulator each wrapper takes its caller's file and line as a defaulted last parameter (ptx.cuh's
// LONGCTX_PTX_CALLER, what std::source_location does), so that errors and deadlock reports name the kernel's line
// rather than this header's.

// The tensor map: 128 opaque bytes, 64-byte aligned (cuda.h's CUtensorMap; NVRTC has no cuda.h). Filled on the host
// (tensor_map.rs) and passed by value as a `const __grid_constant__ CUtensorMap` kernel parameter.
#ifndef CU_TENSOR_MAP_NUM_QWORDS
struct __align__(64) CUtensorMap {
    unsigned long long opaque[16];
};
#endif

// The shared-state address of `p` (a u32, what the PTX's shared::cta operands take).
__device__ __forceinline__ u32 tma_smem_addr(const void* p) {
#ifdef LONGCTX_EMU
    return ::emu::smem_window_addr(LONGCTX_EMU_SITE, p);
#else
    return static_cast<u32>(__cvta_generic_to_shared(p));
#endif
}

__device__ __forceinline__ void mbarrier_init(u64* bar, u32 count LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    ::emu::mbar_init(LONGCTX_PTX_SITE, bar, count);
#else
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(tma_smem_addr(bar)), "r"(count) : "memory");
#endif
}

// fence.mbarrier_init.release.cluster: the initialisations by this thread are visible to the other threads and to the
// async proxy after a following barrier. The emulator's table is visible at once: nothing to do.
__device__ __forceinline__ void mbarrier_fence_init() {
#ifndef LONGCTX_EMU
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// fence.proxy.async.shared::cta: this thread's earlier ordinary writes to shared memory become visible to the async
// proxy (a TMA store reading them, wgmma) after a following barrier. The emulator has one proxy.
__device__ __forceinline__ void tma_fence_proxy_async() {
#ifndef LONGCTX_EMU
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

__device__ __forceinline__ u64 mbarrier_arrive(u64* bar LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    return ::emu::mbar_arrive(LONGCTX_PTX_SITE, bar, 0);
#else
    u64 state;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n" : "=l"(state) : "r"(tma_smem_addr(bar)) : "memory");
    return state;
#endif
}

__device__ __forceinline__ u64 mbarrier_arrive_expect_tx(u64* bar, u32 tx_bytes LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    return ::emu::mbar_arrive(LONGCTX_PTX_SITE, bar, tx_bytes);
#else
    u64 state;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;\n"
                 : "=l"(state)
                 : "r"(tma_smem_addr(bar)), "r"(tx_bytes)
                 : "memory");
    return state;
#endif
}

// Whether the phase of parity `parity` (0 or 1) has completed; may suspend the thread a while first.
__device__ __forceinline__ bool mbarrier_try_wait(u64* bar, u32 parity LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    return ::emu::mbar_try_wait(LONGCTX_PTX_SITE, bar, parity, false);
#else
    u32 done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(tma_smem_addr(bar)), "r"(parity)
        : "memory");
    return done != 0;
#endif
}

// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(u64* bar, u32 parity LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    // One call that sleeps until the phase completes: the loop below, without waking at every stall of the block.
    ::emu::mbar_try_wait(LONGCTX_PTX_SITE, bar, parity, true);
#else
    while (!mbarrier_try_wait(bar, parity)) {
    }
#endif
}

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
#ifndef LONGCTX_EMU
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
#else
    (void)map;
#endif
}

// The loads: the box at coordinates (c0 innermost, ...) of `map`'s tensor into `dst` (shared memory), completing
// the box's bytes on `bar`. Issued by one thread.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, u64* bar, i32 c0,
                                            i32 c1 LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    const int c[5] = {c0, c1, 0, 0, 0};
    ::emu::tma_load(LONGCTX_PTX_SITE, dst, map, bar, 2, c);
#else
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::
            "r"(tma_smem_addr(dst)),
        "l"(reinterpret_cast<u64>(map)), "r"(tma_smem_addr(bar)), "r"(c0), "r"(c1)
        : "memory");
#endif
}

__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, u64* bar, i32 c0, i32 c1,
                                            i32 c2 LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    const int c[5] = {c0, c1, c2, 0, 0};
    ::emu::tma_load(LONGCTX_PTX_SITE, dst, map, bar, 3, c);
#else
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
        "[%2];\n" ::"r"(tma_smem_addr(dst)),
        "l"(reinterpret_cast<u64>(map)), "r"(tma_smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
#endif
}

__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, u64* bar, i32 c0, i32 c1, i32 c2,
                                            i32 c3 LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    const int c[5] = {c0, c1, c2, c3, 0};
    ::emu::tma_load(LONGCTX_PTX_SITE, dst, map, bar, 4, c);
#else
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
        "[%2];\n" ::"r"(tma_smem_addr(dst)),
        "l"(reinterpret_cast<u64>(map)), "r"(tma_smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
#endif
}

// The stores (cp.async.bulk.tensor.{2,3,4}d.global.shared::cta.bulk_group, tma_store_*d): the box at coordinates
// (c0 innermost, ...) of `map`'s tensor written from `src` (shared memory, laid out and aligned as a load's
// destination, the swizzle applied to its address); elements out of bounds are not written. Issued by one thread,
// asynchronous: tma_store_commit (cp.async.bulk.commit_group) closes the thread's stores since the last commit into a
// bulk async-group; tma_store_wait_read<N> (cp.async.bulk.wait_group.read N) waits until at most N of its groups
// still read their shared memory (which may then be reused), tma_store_wait<N> (cp.async.bulk.wait_group N) until at
// most N are incomplete (their global writes done). Shared memory written by ordinary stores must be made visible to
// the async proxy first (tma_fence_proxy_async, then a barrier among the writers). The emulator performs a store
// (reading shared memory then) at the wait that covers its group, or when its thread exits.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, i32 c0,
                                             i32 c1 LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    const int c[5] = {c0, c1, 0, 0, 0};
    ::emu::tma_store(LONGCTX_PTX_SITE, src, map, 2, c);
#else
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                     reinterpret_cast<u64>(map)),
                 "r"(tma_smem_addr(src)), "r"(c0), "r"(c1)
                 : "memory");
#endif
}

__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, i32 c0, i32 c1,
                                             i32 c2 LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    const int c[5] = {c0, c1, c2, 0, 0};
    ::emu::tma_store(LONGCTX_PTX_SITE, src, map, 3, c);
#else
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                     reinterpret_cast<u64>(map)),
                 "r"(tma_smem_addr(src)), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
#endif
}

__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* src, i32 c0, i32 c1, i32 c2,
                                             i32 c3 LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    const int c[5] = {c0, c1, c2, c3, 0};
    ::emu::tma_store(LONGCTX_PTX_SITE, src, map, 4, c);
#else
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                     reinterpret_cast<u64>(map)),
                 "r"(tma_smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
#endif
}

// The bulk reduce-add (cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32, bulk_reduce_add_f32): adds the
// `bytes` / 4 floats at `src` (shared memory) to those at `dst` (global memory), element by element, each addition
// atomic (others may add to the same floats at once), asynchronously, in the thread's bulk async-group like a TMA
// store: committed by tma_store_commit, its source free for reuse after tma_store_wait_read, its additions done after
// tma_store_wait. Both addresses 16-byte aligned, `bytes` a positive multiple of 16. The source, written by ordinary
// stores, must be made visible to the async proxy first (tma_fence_proxy_async by its writers, then a barrier among
// them). The emulator performs it, reading shared memory then, at the wait that covers it (or when its thread exits).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const void* src, u32 bytes LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    ::emu::bulk_reduce_add_f32(LONGCTX_PTX_SITE, dst, src, bytes);
#else
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
                 "r"(tma_smem_addr(src)), "r"(bytes)
                 : "memory");
#endif
}

__device__ __forceinline__ void tma_store_commit() {
#ifdef LONGCTX_EMU
    ::emu::tma_store_commit();
#else
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
    static_assert(N >= 0 && N <= 7, "cp.async.bulk.wait_group.read N: 0..7");
#ifdef LONGCTX_EMU
    ::emu::tma_store_wait(N);
#else
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}

template <int N>
__device__ __forceinline__ void tma_store_wait() {
    static_assert(N >= 0 && N <= 7, "cp.async.bulk.wait_group N: 0..7");
#ifdef LONGCTX_EMU
    ::emu::tma_store_wait(N);
#else
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// The swizzled shared-memory offset of byte `off` of a box that starts on its swizzle pattern's boundary (what the
// consumer of a swizzled box reads): swizzle 0 none, 1 32B, 2 64B, 3 128B (the map's order, tensor_map.rs).
__device__ __forceinline__ u32 tma_swizzle(u32 off, u32 swizzle) {
    const u32 m = swizzle == 3 ? 7u : (swizzle == 2 ? 3u : (swizzle == 1 ? 1u : 0u));
    return off ^ (((off >> 7) & m) << 4);
}
