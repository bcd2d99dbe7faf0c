// Inline-PTX wrappers for Hopper's warpgroup MMA (wgmma) and register reallocation (setmaxnreg), sm_90a only:
// prepended (after common.cuh, ptx.cuh and ptx_tma.cuh when listed) to the sources that list it among their
// includes, which are compiled for sm_90a alone (sources.rs, nvrtc.rs). As in
// ptx.cuh, every wrapper has its GPU side (inline PTX) and its emulator side (LONGCTX_EMU: runtime.cpp's warpgroup
// collective), with the same semantics and layouts. Sources: NVIDIA's PTX ISA, "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate Instructions" (9.7.15): "Register Fragments" (9.7.15.5.1.1), "Shared Memory Matrix Layout"
// (9.7.15.5.1.2), "Major-ness supported by Strides" and "Canonical Layouts" (9.7.15.5.1.2.1), "Matrix Descriptor
// Format" (9.7.15.5.1.2.2); CUTLASS's cute/arch/mma_sm90_desc.hpp states the same canonical layouts.
//
// The instructions:
// - wgmma.fence.sync.aligned (wgmma_fence): orders this thread's earlier accesses to registers (the accumulators)
//   before the wgmma.mma_async that follow (shared memory needs the proxy fence below instead). Required before the
//   first wgmma.mma_async, and again whenever the accumulators were read or written by other instructions since
//   (wgmma.mma_async of the same shape accumulating into the same registers are ordered without one). The emulator
//   is stricter: it requires one since the thread's last wgmma_wait_group (a missing fence is an error there), as
//   CUTLASS and FlashAttention-3 fence before every batch anyway.
// - wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}.{bf16,f16} (wgmma_m64nNk16_*): D = A·B (+ D when scale_d),
//   A 64×16 and B 16×N from shared memory through descriptors (below), D 64×N f32 in the accumulator registers of
//   the 128 threads of one warpgroup (4 consecutive warps whose first is a multiple of 4, all converged: every
//   thread executes the same instruction with the same descriptors). Asynchronous: the operation is only issued;
//   its shared memory and accumulators must not be touched until a wgmma_wait_group covers it. imm-scale-a/b are 1
//   (no negation); TRANS_A / TRANS_B are the transpose immediates: 0 = K-major, 1 = MN-major (M-major A, N-major B).
// - wgmma.commit_group.sync.aligned (wgmma_commit_group): closes the executing threads' wgmma.mma_async issued since
//   the last commit into one wgmma-group.
// - wgmma.wait_group.sync.aligned N (wgmma_wait_group<N>): waits until at most the N most recent wgmma-groups are
//   pending, i.e. every earlier committed group is complete and its accumulators may be read.
// Shared memory written by ordinary stores (st.shared, the generic proxy) must be made visible to wgmma (the async
// proxy) before it reads it: `fence.proxy.async.shared::cta` (wgmma_fence_proxy_async) by the writing threads, then
// a barrier, then the wgmma. (cp.async.bulk/TMA writes are async-proxy already.)
//
// Accumulator fragment (PTX ISA "wgmma register fragments", the D matrix of wgmma .m64nNk16): warp w of the
// warpgroup (w = (threadIdx / 32) % 4) holds rows 16w..16w+15; within it, as for mma.m16n8: lane, gid = lane >> 2,
// tig = lane % 4, and for i in 0..N/8:
//   d[4i+0], d[4i+1] = (row 16w + gid,     cols 8i + 2·tig, 8i + 2·tig + 1)
//   d[4i+2], d[4i+3] = (row 16w + gid + 8, the same cols)
//
// Shared memory operands: a 64-bit matrix descriptor (wgmma_desc) per operand:
//   bits  0-13: start address >> 4 (of the shared-state window: wgmma_smem_addr, not a generic pointer)
//   bits 16-29: leading-dimension byte offset (LBO) >> 4
//   bits 32-45: stride-dimension byte offset (SBO) >> 4
//   bits 49-51: base offset (0 here: every swizzled tile starts on its pattern's boundary, 1024 bytes for 128B)
//   bits 62-63: swizzle mode: 0 none, 1 128B, 2 64B, 3 32B
// A is the 64×16 (M×K) matrix, B the N×16 (N×K) matrix of the instruction. Each is made of "core matrices" of
// 8 rows × 16 bytes (8 × 8 16-bit elements). With element (mn, k) of the operand (mn < 64 for A, < N for B; k < 16)
// and 2-byte elements, the canonical layouts users must lay out (byte offsets from the start address, before the
// swizzle):
//   K-major (TRANS = 0), no swizzle ((8,m),(T,2k)):((1T,SBO),(1,LBO)), T = 8 elements = 16 bytes:
//       (mn % 8)·16 + (mn / 8)·SBO + (k % 8)·2 + (k / 8)·LBO
//     a core matrix is 128 contiguous bytes (8 rows of 16); LBO = from the core matrix of k 0-7 to that of k 8-15,
//     SBO = from one group of 8 rows (M/N) to the next.
//   K-major, 128B swizzle ((8,m),(T,2k)):((8T,SBO),(1,T)):
//       (mn % 8)·128 + (mn / 8)·SBO + k·2, then swizzled
//     rows of 128 bytes (64 elements along K), 8 rows = one 1024-byte atom; SBO = from one 8-row group to the next
//     (1024 when the atoms are stacked); LBO is not used ("assumed 1": pass 1). The instruction's 16 k are 32 bytes of
//     a row: the k-th step of 16 within a 64-wide atom starts 32·k bytes further (the swizzle applies to the
//     address, so the start address may be advanced by 32, 64, 96 within the atom).
//   MN-major (TRANS = 1), no swizzle ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)):
//       (mn % 8)·2 + (mn / 8)·SBO + (k % 8)·16 + (k / 8)·LBO
//     a core matrix is 8 k-rows of 8 contiguous mn (16 bytes each); SBO = from one group of 8 mn to the next,
//     LBO = from the core matrices of k 0-7 to those of k 8-15.
//   MN-major, 128B swizzle ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)):
//       (mn % 64)·2 + (mn / 64)·LBO + (k % 8)·128 + (k / 8)·SBO, then swizzled
//     rows of 128 bytes (64 elements along MN), one row per k; 8 k-rows = one 1024-byte atom; LBO = from one 64-wide
//     MN chunk to the next, SBO = from k 0-7 to k 8-15 (1024 when the atoms are stacked along K).
//   Note that LBO and SBO swap their roles between K-major and swizzled MN-major (the ISA's tables).
// The 128B swizzle (Swizzle<3,4,3>) permutes the 16-byte chunks of each 128-byte row: byte address a is stored at
// a ^ (((a >> 7) & 7) << 4), on the shared-memory address itself, so a swizzled tile must start on a 1024-byte
// boundary of the shared window (align with wgmma_smem_addr) for base offset 0. 64B and 32B swizzles and non-zero
// base offsets are not used by our kernels, and the emulator refuses them.

// setmaxnreg.{inc,dec}.sync.aligned.u32 N (setmaxnreg_inc<N>, setmaxnreg_dec<N>; PTX ISA 9.7.17.1, "setmaxnreg"):
// asks for the executing warpgroup's per-thread register count to be raised (inc: waits until the registers are free)
// or lowered (dec: releases them) to N, a multiple of 8 in 24..256. Every thread of the warpgroup executes the same
// instruction (.sync.aligned); it takes effect only in a kernel with a register cap at entry (__launch_bounds__ with
// a minimum of 1 block, or -maxrregcount), else ptxas ignores it with warning C7508. Warp-specialised kernels lower
// the producer warpgroup's count and raise the consumers'. The emulator has no register file: it checks that a whole
// warpgroup executes it converged, and does nothing else.
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg: a multiple of 8 in 24..256");
#ifdef LONGCTX_EMU
    ::emu::setmaxnreg(LONGCTX_EMU_SITE, true, N);
#else
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg: a multiple of 8 in 24..256");
#ifdef LONGCTX_EMU
    ::emu::setmaxnreg(LONGCTX_EMU_SITE, false, N);
#else
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

#define WGMMA_SWIZZLE_NONE 0
#define WGMMA_SWIZZLE_128B 1
#define WGMMA_SWIZZLE_64B 2
#define WGMMA_SWIZZLE_32B 3

// The address of `p` (in shared memory) in the shared-state window: what descriptors hold and what swizzling and
// alignment are computed on. The emulator's window puts dynamic shared memory at an address 16 bytes past a
// 1024-byte boundary (CUDA promises 16-byte alignment and no more), so a kernel must align its tiles itself.
__device__ __forceinline__ u32 wgmma_smem_addr(const void* p) {
#ifdef LONGCTX_EMU
    return ::emu::smem_window_addr(LONGCTX_EMU_SITE, p);
#else
    return static_cast<u32>(__cvta_generic_to_shared(p));
#endif
}

// The descriptor of an operand starting at `smem` with the given LBO, SBO (bytes, multiples of 16, below 256 KiB)
// and swizzle mode (WGMMA_SWIZZLE_*); base offset 0. Per thread.
__device__ __forceinline__ u64 wgmma_desc(const void* smem, u32 lbo_bytes, u32 sbo_bytes, u32 swizzle) {
    const u64 enc_addr = (wgmma_smem_addr(smem) & 0x3FFFFu) >> 4;
    const u64 enc_lbo = (lbo_bytes & 0x3FFFFu) >> 4;
    const u64 enc_sbo = (sbo_bytes & 0x3FFFFu) >> 4;
    return enc_addr | (enc_lbo << 16) | (enc_sbo << 32) | (static_cast<u64>(swizzle & 3u) << 62);
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef LONGCTX_EMU
    ::emu::wgmma_fence(LONGCTX_EMU_SITE);
#else
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit_group() {
#ifdef LONGCTX_EMU
    ::emu::wgmma_commit_group(LONGCTX_EMU_SITE);
#else
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group N: 0..7");
#ifdef LONGCTX_EMU
    ::emu::wgmma_wait_group(LONGCTX_EMU_SITE, N);
#else
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// fence.proxy.async.shared::cta: this thread's earlier generic-proxy writes to shared memory become visible to the
// async proxy (wgmma's operand reads) after a following barrier. The emulator has one proxy: nothing to do.
__device__ __forceinline__ void wgmma_fence_proxy_async() {
#ifndef LONGCTX_EMU
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// The MMAs (see the top of this file). N = 64: float d[32]; N = 128: float d[64]. In the emulator the accumulators
// are NaN from the issue until a wgmma_wait_group covers it.
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_bf16(float (&d)[32], u64 desc_a, u64 desc_b, bool scale_d) {
    static_assert((TRANS_A == 0 || TRANS_A == 1) && (TRANS_B == 0 || TRANS_B == 1), "transpose: 0 or 1");
#ifdef LONGCTX_EMU
    ::emu::wgmma_mma_async(LONGCTX_EMU_SITE, ::emu::kMmaBf16, 64, TRANS_A, TRANS_B, d, desc_a, desc_b, scale_d);
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<u32>(scale_d)), "n"(TRANS_A), "n"(TRANS_B)
        : "memory");
#endif
}

template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_f16(float (&d)[32], u64 desc_a, u64 desc_b, bool scale_d) {
    static_assert((TRANS_A == 0 || TRANS_A == 1) && (TRANS_B == 0 || TRANS_B == 1), "transpose: 0 or 1");
#ifdef LONGCTX_EMU
    ::emu::wgmma_mma_async(LONGCTX_EMU_SITE, ::emu::kMmaF16, 64, TRANS_A, TRANS_B, d, desc_a, desc_b, scale_d);
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<u32>(scale_d)), "n"(TRANS_A), "n"(TRANS_B)
        : "memory");
#endif
}

template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], u64 desc_a, u64 desc_b, bool scale_d) {
    static_assert((TRANS_A == 0 || TRANS_A == 1) && (TRANS_B == 0 || TRANS_B == 1), "transpose: 0 or 1");
#ifdef LONGCTX_EMU
    ::emu::wgmma_mma_async(LONGCTX_EMU_SITE, ::emu::kMmaBf16, 128, TRANS_A, TRANS_B, d, desc_a, desc_b, scale_d);
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<u32>(scale_d)), "n"(TRANS_A), "n"(TRANS_B)
        : "memory");
#endif
}

template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16_f16(float (&d)[64], u64 desc_a, u64 desc_b, bool scale_d) {
    static_assert((TRANS_A == 0 || TRANS_A == 1) && (TRANS_B == 0 || TRANS_B == 1), "transpose: 0 or 1");
#ifdef LONGCTX_EMU
    ::emu::wgmma_mma_async(LONGCTX_EMU_SITE, ::emu::kMmaF16, 128, TRANS_A, TRANS_B, d, desc_a, desc_b, scale_d);
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<u32>(scale_d)), "n"(TRANS_A), "n"(TRANS_B)
        : "memory");
#endif
}


// ---------------------------------------------------------------------------------------------------------------------
// wgmma with A from registers (the "RS" form): wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}.{bf16,f16}
// {d...}, {a0, a1, a2, a3}, b-desc, scale-d, 1, 1, imm-trans-b. D = A·B (+ D when scale_d) as above, B 16×N from
// shared memory through its descriptor (any canonical layout above; TRANS_B 0 = K-major, 1 = N-major), A 64×16
// from the four 32-bit registers of each of the warpgroup's 128 threads (two 16-bit elements each, the lower column
// in the low half). There is no transpose for A: registers hold it as this fragment.
//
// A fragment (PTX ISA 9.7.15.5.1.1, "Register fragments", wgmma .m64nNk16 with .f16/.bf16 A): warp w of the
// warpgroup holds rows 16w..16w+15, laid out as mma.m16n8k16's A within the warp (lane, gid = lane >> 2,
// tig = lane % 4):
//   a0 = (row 16w + gid,     cols 2·tig, 2·tig + 1)      a2 = (row 16w + gid,     cols 2·tig + 8, 2·tig + 9)
//   a1 = (row 16w + gid + 8, cols 2·tig, 2·tig + 1)      a3 = (row 16w + gid + 8, cols 2·tig + 8, 2·tig + 9)
// So an accumulator fragment of a previous wgmma (D, 64×N f32, layout above) becomes the A of the next with no data
// movement: for the k-step of columns 16t..16t+15, a0 = pack(d[8t+0], d[8t+1]), a1 = pack(d[8t+2], d[8t+3]),
// a2 = pack(d[8t+4], d[8t+5]), a3 = pack(d[8t+6], d[8t+7]) (flash attention's P of P·V).
// The registers are read asynchronously like the shared-memory operands: they must not be written until a
// wgmma_wait_group covers the op (the emulator copies them at issue, and checks at the wait that the kernel's
// registers still hold what was issued).

template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_bf16_rs(float (&d)[32], const u32 (&a)[4], u64 desc_b,
                                                        bool scale_d) {
    static_assert(TRANS_B == 0 || TRANS_B == 1, "transpose: 0 or 1");
#ifdef LONGCTX_EMU
    ::emu::wgmma_mma_async_rs(LONGCTX_EMU_SITE, ::emu::kMmaBf16, 64, TRANS_B, d, a, desc_b, scale_d);
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<u32>(scale_d)), "n"(TRANS_B)
        : "memory");
#endif
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_f16_rs(float (&d)[32], const u32 (&a)[4], u64 desc_b,
                                                        bool scale_d) {
    static_assert(TRANS_B == 0 || TRANS_B == 1, "transpose: 0 or 1");
#ifdef LONGCTX_EMU
    ::emu::wgmma_mma_async_rs(LONGCTX_EMU_SITE, ::emu::kMmaF16, 64, TRANS_B, d, a, desc_b, scale_d);
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<u32>(scale_d)), "n"(TRANS_B)
        : "memory");
#endif
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16_bf16_rs(float (&d)[64], const u32 (&a)[4], u64 desc_b,
                                                        bool scale_d) {
    static_assert(TRANS_B == 0 || TRANS_B == 1, "transpose: 0 or 1");
#ifdef LONGCTX_EMU
    ::emu::wgmma_mma_async_rs(LONGCTX_EMU_SITE, ::emu::kMmaBf16, 128, TRANS_B, d, a, desc_b, scale_d);
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<u32>(scale_d)), "n"(TRANS_B)
        : "memory");
#endif
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16_f16_rs(float (&d)[64], const u32 (&a)[4], u64 desc_b,
                                                        bool scale_d) {
    static_assert(TRANS_B == 0 || TRANS_B == 1, "transpose: 0 or 1");
#ifdef LONGCTX_EMU
    ::emu::wgmma_mma_async_rs(LONGCTX_EMU_SITE, ::emu::kMmaF16, 128, TRANS_B, d, a, desc_b, scale_d);
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<u32>(scale_d)), "n"(TRANS_B)
        : "memory");
#endif
}
