// Inline-PTX wrappers (see sources.rs): the one place kernels reach tensor cores, ldmatrix and cp.async. Each wrapper
// has its GPU side (inline PTX, sm_80 or later) and its emulator side (LONGCTX_EMU: the emulator's warp-collective
// implementation of the same instruction, with the same fragment layouts), so a kernel written against these runs
// the same on both.
//
// Notation for fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" and
// "ldmatrix"): lane = the thread's lane in its warp, gid = lane >> 2 (its group of four), tig = lane % 4 (its place in
// the group). A 32-bit register holding two 16-bit elements holds the lower column (or row) in its low half.
//
// Fragments are passed as array references (`u32 (&a)[4]`), so a wrong count is a compile error and a row of a
// fragment array (`u32 qf[8][4]` → `qf[k]`) binds directly. Every wrapper is warp-collective unless it says otherwise:
// all 32 lanes of the warp, converged, must execute it.

// ---------------------------------------------------------------------------------------------------------------------
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32: D = A·B + C, one warp, A 16×16 (row), B 16×8
// (col), C and D 16×8 in f32. `d` and `c` may be the same array (accumulate in place).
//   A (4 regs of 2): a[0] = (row gid,   cols 2·tig, 2·tig+1)     a[1] = (row gid+8, cols 2·tig, 2·tig+1)
//                    a[2] = (row gid,   cols 2·tig+8, 2·tig+9)   a[3] = (row gid+8, cols 2·tig+8, 2·tig+9)
//   B (2 regs of 2): b[0] = (rows k = 2·tig, 2·tig+1, col gid)  b[1] = (rows k = 2·tig+8, 2·tig+9, col gid)
//   C, D (4 floats): d[0], d[1] = (row gid, cols 2·tig, 2·tig+1)  d[2], d[3] = (row gid+8, the same cols)
// The emulator sums the exact products in double and rounds once; the tensor core's summation order and rounding are
// its own, so compare with a tolerance.
__device__ __forceinline__ void mma_16816_bf16(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2],
                                               const float (&c)[4]) {
#ifdef LONGCTX_EMU
    ::emu::mma_m16n8k16(LONGCTX_EMU_SITE, ::emu::kMmaBf16, d, a, b, c);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
#endif
}
__device__ __forceinline__ void mma_16816_f16(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2],
                                              const float (&c)[4]) {
#ifdef LONGCTX_EMU
    ::emu::mma_m16n8k16(LONGCTX_EMU_SITE, ::emu::kMmaF16, d, a, b, c);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
#endif
}

// ---------------------------------------------------------------------------------------------------------------------
// ldmatrix.sync.aligned.m8n8.x{1,2,4}{,.trans}.shared.b16: loads 1, 2 or 4 8×8 matrices of 16-bit elements from shared
// memory. Each lane passes one row address (`smem`: 16 bytes, 16-byte aligned, in shared memory): lanes 8j..8j+7 give
// rows 0..7 of matrix j (lanes 0-7 for .x1, 0-15 for .x2; the other lanes' addresses are ignored). Lane l receives in
// r[j] the elements (row l/4, cols 2·(l%4), 2·(l%4)+1) of matrix j; with .trans, those of its transpose, i.e. the
// elements (rows 2·(l%4), 2·(l%4)+1, col l/4) of the matrix as stored.
// So for mma: A (16×16 row-major tile) = ldmatrix_x4 with lane l addressing row (l % 16), column 8·(l / 16); B stored
// k-major ([k][n], row-major in k) = ldmatrix_x2_trans / x4_trans; B stored n-major ([n][k]) = ldmatrix_x2 / x4.
#ifndef LONGCTX_EMU
__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }
#endif

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem) {
#ifdef LONGCTX_EMU
    ::emu::ldmatrix(LONGCTX_EMU_SITE, 4, false, r, smem);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem)));
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem) {
#ifdef LONGCTX_EMU
    ::emu::ldmatrix(LONGCTX_EMU_SITE, 4, true, r, smem);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem)));
#endif
}
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], const void* smem) {
#ifdef LONGCTX_EMU
    ::emu::ldmatrix(LONGCTX_EMU_SITE, 2, false, r, smem);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(smem)));
#endif
}
__device__ __forceinline__ void ldmatrix_x2_trans(u32 (&r)[2], const void* smem) {
#ifdef LONGCTX_EMU
    ::emu::ldmatrix(LONGCTX_EMU_SITE, 2, true, r, smem);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(smem)));
#endif
}
__device__ __forceinline__ void ldmatrix_x1(u32& r, const void* smem) {
#ifdef LONGCTX_EMU
    ::emu::ldmatrix(LONGCTX_EMU_SITE, 1, false, &r, smem);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r) : "r"(smem_addr(smem)));
#endif
}

// ---------------------------------------------------------------------------------------------------------------------
// cp.async.cg.shared.global (per thread, not collective): starts copying 16 bytes from global memory `gmem` (16-byte
// aligned) to shared memory `smem` (16-byte aligned), bypassing L1. The copy belongs to the current group;
// cp_async_commit() closes the group, cp_async_wait<N>() waits until at most the N most recent committed groups are
// still in flight (cp.async.wait_group N), cp_async_wait_all() commits and waits for everything. Other threads see
// the data only after their own barrier: wait, then __syncthreads().
// The emulator makes each copy land at the wait that covers it (reading global memory then), so reading the
// destination too early shows the poison left in shared memory.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
#ifdef LONGCTX_EMU
    ::emu::cp_async_16(LONGCTX_EMU_SITE, smem, gmem, true);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
#endif
}
// The same, copying zeros instead when !valid (src-size 0: nothing is read from `gmem`, which may then point
// anywhere): the tail of a tile past the end of a sequence.
__device__ __forceinline__ void cp_async_16_zfill(void* smem, const void* gmem, bool valid) {
#ifdef LONGCTX_EMU
    ::emu::cp_async_16(LONGCTX_EMU_SITE, smem, gmem, valid);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                 "r"(valid ? 16 : 0)
                 : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef LONGCTX_EMU
    ::emu::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef LONGCTX_EMU
    ::emu::cp_async_wait(LONGCTX_EMU_SITE, N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#ifdef LONGCTX_EMU
    ::emu::cp_async_commit();
    ::emu::cp_async_wait(LONGCTX_EMU_SITE, 0);
#else
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------------------------------
// Packing two f32 into one 32-bit register of two 16-bit elements (an mma operand), `lo` in the low half, each
// rounded to nearest even (cvt.rn.{bf16x2,f16x2}.f32 d, hi, lo). Per thread.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
#ifdef LONGCTX_EMU
    return static_cast<u32>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
           (static_cast<u32>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
#else
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
#ifdef LONGCTX_EMU
    return static_cast<u32>(__half_as_ushort(__float2half_rn(lo))) |
           (static_cast<u32>(__half_as_ushort(__float2half_rn(hi))) << 16);
#else
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}

// ex2.approx.ftz.f32: 2^x, subnormal inputs and results flushed to zero (per thread). The GPU's is approximate (about
// 2 ulp); the emulator's is exp2f, so compare with a tolerance.
__device__ __forceinline__ float ex2_approx(float x) {
#ifdef LONGCTX_EMU
    return ::emu::ex2_approx_ftz(x);
#else
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
#endif
}

// ---------------------------------------------------------------------------------------------------------------------
// Named barriers (bar.sync / bar.arrive a, b; sm_70 and later; per warp, and every lane of the warp must execute the
// same one: bar is barrier.aligned). Barrier `id` (1..15: 0 is the one __syncthreads uses, with every thread of the
// block) completes a phase when `threads` threads (a multiple of 32) have arrived by either instruction; every
// arrival of a phase gives the same count. They let a subset of the block synchronise (the consumer warpgroups of a
// warp-specialised kernel, while the producer's warps wait elsewhere or have exited), or one subset signal another
// without waiting (producer/consumer, and turn-taking: see attention_forward_wgmma.cu's ping-pong). Memory: what a
// thread wrote before its arrive is visible to the threads that pass the sync of that phase.
// In the emulator each wrapper takes its caller's file and line (LONGCTX_PTX_CALLER, below; ptx_tma.cuh's wrappers
// too), so that a deadlock report names the kernel's line; a phase that can never complete is a deadlock error, a
// phase still open when the block ends an error too (arrivals no sync matched: counts that do not balance).
#ifdef LONGCTX_EMU
#define LONGCTX_PTX_CALLER , const char* caller_file = __builtin_FILE(), int caller_line = __builtin_LINE()
#define LONGCTX_PTX_SITE (::emu::Site{caller_file, caller_line})
#else
#define LONGCTX_PTX_CALLER
#endif

// bar.sync id, threads: arrives at barrier `id` and waits until its phase completes (`threads` arrivals).
__device__ __forceinline__ void named_barrier_sync(u32 id, u32 threads LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    ::emu::named_barrier(LONGCTX_PTX_SITE, id, threads, true);
#else
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
#endif
}

// bar.arrive id, threads: arrives at barrier `id` (of `threads` arrivals a phase) and goes on without waiting; the
// signalling half of a producer/consumer pair whose other half calls named_barrier_sync.
__device__ __forceinline__ void named_barrier_arrive(u32 id, u32 threads LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    ::emu::named_barrier(LONGCTX_PTX_SITE, id, threads, false);
#else
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
#endif
}

// ---------------------------------------------------------------------------------------------------------------------
// Flags between blocks of one grid (a block hands a turn to another through a u32 in global memory; one thread each).
// - flag_wait_eq: ld.acquire.gpu.global.u32 until the flag holds `v` (__nanosleep between reads, so the spinning
//   thread leaves its SM's issue slots to the others); what the thread that stored `v` wrote before its release is
//   visible to this thread after, and, through a barrier, to the threads of its block that pass it.
// - flag_release: st.release.gpu.global.u32 of `v`: this thread's earlier writes (and, cumulatively, those it
//   observed, such as its block's writes ordered before a barrier it passed and each writer's __threadfence) become
//   visible before the flag to a thread that acquires it.
// Progress: a block may wait only for blocks of the same grid with lower linear indices. The GPU dispatches a grid's
// blocks in the order of their linear index (what FlashAttention-3's deterministic backward and CUTLASS's stream-K
// rely on, not a documented guarantee), so the block waited for is resident or done, and the lowest waiting block
// always has what it waits for coming. The emulator's workers take blocks in that order too; its wait yields the OS
// thread between reads and ends the launch with an error after 60 seconds, or when another block has failed.
__device__ __forceinline__ void flag_wait_eq(const u32* flag, u32 v LONGCTX_PTX_CALLER) {
#ifdef LONGCTX_EMU
    ::emu::flag_wait_eq(LONGCTX_PTX_SITE, flag, v);
#else
    for (;;) {
        u32 x;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(x) : "l"(flag) : "memory");
        if (x == v) break;
        __nanosleep(32);
    }
#endif
}

__device__ __forceinline__ void flag_release(u32* flag, u32 v) {
#ifdef LONGCTX_EMU
    __atomic_store_n(flag, v, __ATOMIC_RELEASE);
#else
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flag), "r"(v) : "memory");
#endif
}
