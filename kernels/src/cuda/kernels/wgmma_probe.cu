// A probe of wgmma (ptx_hopper.cuh), sm_90a only: one warpgroup (a block of 128 threads) computes D = A·Bᵀ for A
// 64×K and B N×K (both row-major in global memory, K contiguous), K a multiple of 64, through shared memory laid out
// in one of the PTX ISA's canonical layouts: A and B each K-major or MN-major, both with no swizzle or both with the
// 128B swizzle (applied by this kernel's own stores). K/16 wgmma steps accumulate into registers that start at 1000
// (so a first step that added them, ignoring scale-d = 0, shows), in one group and one wait, or `pipelined`: one
// group per step with wgmma.wait_group 1 after each; then D (64×N f32, row-major) is stored from the accumulator
// fragment. Its tests run it on the emulator and on an sm_90 GPU against an f64
// reference: the GPU run is what confirms that the emulator's reading of the layouts is the hardware's.
//
// Dynamic shared memory: 64·K·2 + N·K·2 bytes, plus 1024 for the alignment of the tiles.

// Byte offset of element (mn, k) in an operand tile of `rows` (M or N) × `kdim`, in the layout the descriptors of
// probe_desc describe (ptx_hopper.cuh gives the canonical forms):
//   K-major, none:  core matrices (8 rows × 16 bytes) K-adjacent:       LBO = 128,        SBO = kdim·16
//   K-major, 128B:  128-byte rows of 64 k, row-adjacent; 64-wide K atoms one after another (rows·128 bytes each):
//                   SBO = 1024, LBO unused (16)
//   MN-major, none: core matrices (8 k-rows × 8 mn) MN-adjacent:         LBO = rows·16,    SBO = 128
//   MN-major, 128B: 128-byte rows of 64 mn, one per k, k-adjacent; 64-wide MN chunks one after another (kdim·128
//                   bytes each): LBO = kdim·128, SBO = 1024
__device__ __forceinline__ u32 probe_offset(u32 mn, u32 k, bool mn_major, bool swizzle, u32 rows, u32 kdim) {
    u32 off;
    if (!mn_major && !swizzle) off = (mn / 8) * (kdim * 16) + (k / 8) * 128 + (mn % 8) * 16 + (k % 8) * 2;
    else if (!mn_major) off = (k / 64) * (rows * 128) + mn * 128 + (k % 64) * 2;
    else if (!swizzle) off = (k / 8) * (rows * 16) + (mn / 8) * 128 + (k % 8) * 16 + (mn % 8) * 2;
    else off = (mn / 64) * (kdim * 128) + k * 128 + (mn % 64) * 2;
    // The 128B swizzle on the address: the tile starts on a 1024-byte boundary, so its offset's bits are the address's.
    return swizzle ? off ^ (((off >> 7) & 7) << 4) : off;
}

// The descriptor of k-step s (k = 16s..16s+15) of a tile laid out by probe_offset.
__device__ __forceinline__ u64 probe_desc(const unsigned char* tile, u32 s, bool mn_major, bool swizzle, u32 rows,
                                          u32 kdim) {
    const u32 k0 = 16 * s;
    if (!mn_major && !swizzle) return wgmma_desc(tile + (k0 / 8) * 128, 128, kdim * 16, WGMMA_SWIZZLE_NONE);
    if (!mn_major) return wgmma_desc(tile + (k0 / 64) * (rows * 128) + (k0 % 64) * 2, 16, 1024, WGMMA_SWIZZLE_128B);
    if (!swizzle) return wgmma_desc(tile + (k0 / 8) * (rows * 16), rows * 16, 128, WGMMA_SWIZZLE_NONE);
    return wgmma_desc(tile + k0 * 128, kdim * 128, 1024, WGMMA_SWIZZLE_128B);
}

template <class T, int N>
__device__ __forceinline__ void probe_mma(float (&acc)[N / 2], u64 da, u64 db, bool scale_d, bool ta, bool tb);

#define LONGCTX_PROBE_MMA(T, N, NAME)                                                                                  \
    template <>                                                                                                        \
    __device__ __forceinline__ void probe_mma<T, N>(float (&acc)[N / 2], u64 da, u64 db, bool scale_d, bool ta,       \
                                                    bool tb) {                                                         \
        if (!ta && !tb) NAME<0, 0>(acc, da, db, scale_d);                                                              \
        else if (!ta) NAME<0, 1>(acc, da, db, scale_d);                                                                \
        else if (!tb) NAME<1, 0>(acc, da, db, scale_d);                                                                \
        else NAME<1, 1>(acc, da, db, scale_d);                                                                         \
    }
LONGCTX_PROBE_MMA(bf16, 64, wgmma_m64n64k16_bf16)
LONGCTX_PROBE_MMA(bf16, 128, wgmma_m64n128k16_bf16)
LONGCTX_PROBE_MMA(f16, 64, wgmma_m64n64k16_f16)
LONGCTX_PROBE_MMA(f16, 128, wgmma_m64n128k16_f16)
#undef LONGCTX_PROBE_MMA

// The block's dynamic shared memory (one DYNAMIC_SMEM for the unit: NVRTC warns about a second declaration).
__device__ __forceinline__ unsigned char* probe_smem() {
    DYNAMIC_SMEM(unsigned char, raw);
    return raw;
}

template <class T, int N>
__device__ __forceinline__ void probe(const T* a, const T* b, float* d, int kdim, int a_mn_major, int b_mn_major,
                                      int swizzle, int pipelined) {
    unsigned char* raw = probe_smem();
    const u32 pad = (1024u - (wgmma_smem_addr(raw) & 1023u)) & 1023u;
    unsigned char* sa = raw + pad;
    unsigned char* sb = sa + 64 * kdim * 2;
    const u32 tid = threadIdx.x, k = static_cast<u32>(kdim);
    const bool ta = a_mn_major != 0, tb = b_mn_major != 0, sw = swizzle != 0;
    for (u32 i = tid; i < 64 * k; i += 128)
        *reinterpret_cast<T*>(sa + probe_offset(i / k, i % k, ta, sw, 64, k)) = a[i];
    for (u32 i = tid; i < N * k; i += 128)
        *reinterpret_cast<T*>(sb + probe_offset(i / k, i % k, tb, sw, N, k)) = b[i];
    wgmma_fence_proxy_async();
    __syncthreads();

    float acc[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; i++) acc[i] = 1000.0f;
    wgmma_fence();
    for (u32 s = 0; s < k / 16; s++) {
        // Pipelined: each step its own group, at most one in flight (the next step accumulates into the registers of
        // a group still in flight, which needs no fence between the two; the fence after a wait is good practice).
        if (pipelined && s > 0) wgmma_fence();
        probe_mma<T, N>(acc, probe_desc(sa, s, ta, sw, 64, k), probe_desc(sb, s, tb, sw, N, k), s > 0, ta, tb);
        if (pipelined) {
            wgmma_commit_group();
            wgmma_wait_group<1>();
        }
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();

    const u32 w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        const u32 row = 16 * w + gid + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * tig + (i & 1);
        d[row * N + col] = acc[i];
    }
}

#define LONGCTX_PROBE_KERNEL(T, N, NAME)                                                                               \
    extern "C" __global__ void __launch_bounds__(128) NAME(const T* a, const T* b, float* d, int k, int a_mn_major, \
                                                           int b_mn_major, int swizzle, int pipelined) {               \
        probe<T, N>(a, b, d, k, a_mn_major, b_mn_major, swizzle, pipelined);                                           \
    }
LONGCTX_PROBE_KERNEL(bf16, 64, longctx_wgmma_probe_bf16_n64)
LONGCTX_PROBE_KERNEL(bf16, 128, longctx_wgmma_probe_bf16_n128)
LONGCTX_PROBE_KERNEL(f16, 64, longctx_wgmma_probe_f16_n64)
LONGCTX_PROBE_KERNEL(f16, 128, longctx_wgmma_probe_f16_n128)
#undef LONGCTX_PROBE_KERNEL

// The RS form (A from registers, ptx_hopper.cuh's second part): the same product with A read from global memory
// straight into each thread's A fragment for each k-step (warp w, rows 16w..16w+15), B staged in shared memory as
// above (only B's layout and swizzle vary), then D stored as above.
template <class T, int N>
__device__ __forceinline__ void probe_mma_rs(float (&acc)[N / 2], const u32 (&a)[4], u64 db, bool scale_d, bool tb);

#define LONGCTX_PROBE_MMA_RS(T, N, NAME)                                                                               \
    template <>                                                                                                        \
    __device__ __forceinline__ void probe_mma_rs<T, N>(float (&acc)[N / 2], const u32 (&a)[4], u64 db, bool scale_d, \
                                                       bool tb) {                                                      \
        if (!tb) NAME<0>(acc, a, db, scale_d);                                                                         \
        else NAME<1>(acc, a, db, scale_d);                                                                             \
    }
LONGCTX_PROBE_MMA_RS(bf16, 64, wgmma_m64n64k16_bf16_rs)
LONGCTX_PROBE_MMA_RS(bf16, 128, wgmma_m64n128k16_bf16_rs)
LONGCTX_PROBE_MMA_RS(f16, 64, wgmma_m64n64k16_f16_rs)
LONGCTX_PROBE_MMA_RS(f16, 128, wgmma_m64n128k16_f16_rs)
#undef LONGCTX_PROBE_MMA_RS

// Two 16-bit elements as one register, `lo` in the low half (the fragment's lower column).
template <class T>
__device__ __forceinline__ u32 probe_pair(const T* lo) {
    const unsigned short* h = reinterpret_cast<const unsigned short*>(lo);
    return static_cast<u32>(h[0]) | (static_cast<u32>(h[1]) << 16);
}

template <class T, int N>
__device__ __forceinline__ void probe_rs(const T* a, const T* b, float* d, int kdim, int b_mn_major, int swizzle,
                                         int pipelined) {
    unsigned char* raw = probe_smem();
    const u32 pad = (1024u - (wgmma_smem_addr(raw) & 1023u)) & 1023u;
    unsigned char* sb = raw + pad;
    const u32 tid = threadIdx.x, k = static_cast<u32>(kdim);
    const bool tb = b_mn_major != 0, sw = swizzle != 0;
    for (u32 i = tid; i < N * k; i += 128)
        *reinterpret_cast<T*>(sb + probe_offset(i / k, i % k, tb, sw, N, k)) = b[i];
    wgmma_fence_proxy_async();
    __syncthreads();

    const u32 w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
    float acc[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; i++) acc[i] = 1000.0f;
    // One fragment per k-step, all loaded before the first issue: registers an op in flight reads stay untouched.
    u32 frag[8][4];
    for (u32 s = 0; s < k / 16 && s < 8; s++) {
        const T* r0 = a + (16 * w + gid) * k + 16 * s + 2 * tig;
        const T* r1 = r0 + 8 * k;
        frag[s][0] = probe_pair(r0);
        frag[s][1] = probe_pair(r1);
        frag[s][2] = probe_pair(r0 + 8);
        frag[s][3] = probe_pair(r1 + 8);
    }
    wgmma_fence();
    for (u32 s = 0; s < k / 16 && s < 8; s++) {
        if (pipelined && s > 0) wgmma_fence();
        probe_mma_rs<T, N>(acc, frag[s], probe_desc(sb, s, tb, sw, N, k), s > 0, tb);
        if (pipelined) {
            wgmma_commit_group();
            wgmma_wait_group<1>();
        }
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();

#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        const u32 row = 16 * w + gid + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * tig + (i & 1);
        d[row * N + col] = acc[i];
    }
}

// K at most 128 (eight k-steps of registers).
#define LONGCTX_PROBE_RS_KERNEL(T, N, NAME)                                                                            \
    extern "C" __global__ void __launch_bounds__(128) NAME(const T* a, const T* b, float* d, int k, int b_mn_major,  \
                                                           int swizzle, int pipelined) {                               \
        probe_rs<T, N>(a, b, d, k, b_mn_major, swizzle, pipelined);                                                    \
    }
LONGCTX_PROBE_RS_KERNEL(bf16, 64, longctx_wgmma_probe_rs_bf16_n64)
LONGCTX_PROBE_RS_KERNEL(bf16, 128, longctx_wgmma_probe_rs_bf16_n128)
LONGCTX_PROBE_RS_KERNEL(f16, 64, longctx_wgmma_probe_rs_f16_n64)
LONGCTX_PROBE_RS_KERNEL(f16, 128, longctx_wgmma_probe_rs_f16_n128)
#undef LONGCTX_PROBE_RS_KERNEL

// The mistakes the emulator must catch (its tests only; they never run on a GPU): reading the accumulators before
// the wait (`mode` 0: NaN is stored), no wgmma.fence before the first wgmma (1), exiting with the wgmma in flight (2),
// overwriting an operand before the wait (3), overwriting the A registers of the RS form before the wait (4). A
// 64×64×16 bf16 product, K-major, no swizzle.
extern "C" __global__ void __launch_bounds__(128) longctx_wgmma_probe_mistakes(const bf16* a, const bf16* b,
                                                                               float* d, int mode) {
    unsigned char* raw = probe_smem();
    const u32 pad = (1024u - (wgmma_smem_addr(raw) & 1023u)) & 1023u;
    unsigned char* sa = raw + pad;
    unsigned char* sb = sa + 64 * 16 * 2;
    const u32 tid = threadIdx.x;
    for (u32 i = tid; i < 64 * 16; i += 128) {
        *reinterpret_cast<bf16*>(sa + probe_offset(i / 16, i % 16, false, false, 64, 16)) = a[i];
        *reinterpret_cast<bf16*>(sb + probe_offset(i / 16, i % 16, false, false, 64, 16)) = b[i];
    }
    wgmma_fence_proxy_async();
    __syncthreads();
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; i++) acc[i] = 0.0f;
    u32 frag[4] = {tid, tid + 1, tid + 2, tid + 3};
    if (mode != 1) wgmma_fence();
    if (mode == 4) {
        wgmma_m64n64k16_bf16_rs<0>(acc, frag, probe_desc(sb, 0, false, false, 64, 16), false);
        wgmma_commit_group();
        frag[0] = 0;
        wgmma_wait_group<0>();
        d[tid] = acc[0] + static_cast<float>(frag[0]);
        return;
    }
    wgmma_m64n64k16_bf16<0, 0>(acc, probe_desc(sa, 0, false, false, 64, 16), probe_desc(sb, 0, false, false, 64, 16),
                               false);
    wgmma_commit_group();
    if (mode == 2) return;
    if (mode == 3) {
        __syncthreads();
        if (tid == 0) *reinterpret_cast<bf16*>(sa) = from_f32<bf16>(2.0f);
        __syncthreads();
    }
    if (mode == 0) d[tid] = acc[0];
    wgmma_wait_group<0>();
    if (mode != 0) d[tid] = acc[0];
}
