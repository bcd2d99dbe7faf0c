// A probe of the TMA and mbarrier wrappers (ptx_tma.cuh) in the warp-specialised pipeline a FlashAttention-3-style
// kernel is built on, sm_90a only (setmaxnreg, ptx_hopper.cuh). A block of 384 threads: warpgroup 0 is the producer
// (its registers lowered with setmaxnreg.dec; one thread issues every copy, the others exit), warpgroups 1-2 are the
// consumers (registers raised with setmaxnreg.inc). The producer loads boxes (tiles) of a bf16 tensor of rank 2-4
// through the tensor map into a ring of `stages` shared-memory buffers, each guarded by a "full" mbarrier (1 arrival,
// the producer's arrive.expect_tx, plus the copy's bytes) and an "empty" one (256 arrivals, one per consumer thread).
// The consumers wait on "full", read the tile (undoing the map's swizzle) and write it as f32 into `out`, the tensor
// padded up to whole boxes (so the zeros the TMA writes out of bounds land there too), then arrive on "empty"; or,
// with `store`, one consumer thread writes the tile back through `store_map` (a TMA store, which writes nothing out
// of bounds), so that store_map's tensor becomes a copy of map's.
// Tiles are dealt round-robin to the blocks of the grid. Its tests run it on the emulator and on an sm_90 GPU against
// a host reference: the GPU run is what confirms that the emulator's TMA (layout, swizzle, zero fill) is the
// hardware's.
//
// Dynamic shared memory: stages · stage_bytes + 1024 (stage_bytes: the box's bytes rounded up to 1024; the 1024 for
// the alignment of the ring).
//
// `mode` (the emulator tests of the mistakes it must report; 0 everywhere else): 1 the producer waits on "empty" with
// the wrong parity (a deadlock), 2 the producer announces 16 bytes more than the box (the phase never completes:
// a deadlock), 3 the consumers read a stage before waiting on it (the emulator's poison, NaN, shows), 4 the copy's
// destination is 16 bytes past the stage (misaligned: an error), 5 (with `store`) the stage is released without
// waiting for the store to have read it (the emulator's store reads it at the final wait: the copy is wrong).

#define TMA_PROBE_MAX_STAGES 4

// The block's dynamic shared memory (one DYNAMIC_SMEM for the unit).
__device__ __forceinline__ unsigned char* tma_probe_smem() {
    DYNAMIC_SMEM(unsigned char, raw);
    return raw;
}

// The coordinates of tile t's first element (tiles numbered innermost dimension fastest).
__device__ __forceinline__ void tma_probe_coords(u32 t, int rank, const int* nt, const int* bx, int* c) {
    for (int d = 0; d < rank; d++) {
        c[d] = static_cast<int>(t % static_cast<u32>(nt[d])) * bx[d];
        t /= static_cast<u32>(nt[d]);
    }
}

extern "C" __global__ void __launch_bounds__(384, 1)
    longctx_tma_probe(const __grid_constant__ CUtensorMap map, const __grid_constant__ CUtensorMap store_map,
                      float* out, int rank, int4 box, int4 tiles, int swizzle, int stages, int store, int mode) {
    __shared__ __align__(8) u64 full[TMA_PROBE_MAX_STAGES];
    __shared__ __align__(8) u64 empty[TMA_PROBE_MAX_STAGES];
    const u32 tid = threadIdx.x;
    const int bx[4] = {box.x, box.y, box.z, box.w};
    const int nt[4] = {tiles.x, tiles.y, tiles.z, tiles.w};
    u32 box_elems = 1, ntiles = 1;
    for (int d = 0; d < rank; d++) {
        box_elems *= static_cast<u32>(bx[d]);
        ntiles *= static_cast<u32>(nt[d]);
    }
    const u32 box_bytes = box_elems * 2;
    const u32 stage_bytes = (box_bytes + 1023u) & ~1023u;
    unsigned char* raw = tma_probe_smem();
    unsigned char* ring = raw + ((1024u - (tma_smem_addr(raw) & 1023u)) & 1023u);

    if (tid == 0) {
        for (int s = 0; s < stages; s++) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], 256);
        }
        mbarrier_fence_init();
    }
    __syncthreads();

    if (tid < 128) {
        // The producer warpgroup: one thread issues, the others leave once the warpgroup has lowered its registers.
        setmaxnreg_dec<40>();
        if (tid != 0) return;
        tma_prefetch_map(&map);
        u32 k = 0;
        for (u32 t = blockIdx.x; t < ntiles; t += gridDim.x, k++) {
            const u32 s = k % static_cast<u32>(stages), use = k / static_cast<u32>(stages);
            // The first use of a stage waits for parity 1, the phase "before" the first: it passes at once.
            mbarrier_wait(&empty[s], mode == 1 ? (use & 1) : ((use & 1) ^ 1));
            mbarrier_arrive_expect_tx(&full[s], box_bytes + (mode == 2 ? 16u : 0u));
            int c[4] = {0, 0, 0, 0};
            tma_probe_coords(t, rank, nt, bx, c);
            unsigned char* dst = ring + s * stage_bytes + (mode == 4 ? 16 : 0);
            if (rank == 2) tma_load_2d(dst, &map, &full[s], c[0], c[1]);
            else if (rank == 3) tma_load_3d(dst, &map, &full[s], c[0], c[1], c[2]);
            else tma_load_4d(dst, &map, &full[s], c[0], c[1], c[2], c[3]);
        }
        return;
    }

    // The consumers: 256 threads, each a share of every tile's elements.
    setmaxnreg_inc<232>();
    const u32 ct = tid - 128;
    u32 padded[4] = {1, 1, 1, 1};
    for (int d = 0; d < rank; d++) padded[d] = static_cast<u32>(nt[d] * bx[d]);
    u32 k = 0;
    for (u32 t = blockIdx.x; t < ntiles; t += gridDim.x, k++) {
        const u32 s = k % static_cast<u32>(stages), use = k / static_cast<u32>(stages);
        if (mode != 3) mbarrier_wait(&full[s], use & 1);
        const unsigned char* stage = ring + s * stage_bytes;
        if (store) {
            // The tile back to global memory through the TMA, from the stage as it landed (swizzle and all); the
            // stage is released only once the store has read it.
            if (ct == 0) {
                int c[4] = {0, 0, 0, 0};
                tma_probe_coords(t, rank, nt, bx, c);
                if (rank == 2) tma_store_2d(&store_map, stage, c[0], c[1]);
                else if (rank == 3) tma_store_3d(&store_map, stage, c[0], c[1], c[2]);
                else tma_store_4d(&store_map, stage, c[0], c[1], c[2], c[3]);
                tma_store_commit();
                if (mode != 5) tma_store_wait_read<0>();
            }
            mbarrier_arrive(&empty[s]);
            continue;
        }
        for (u32 e = ct; e < box_elems; e += 256) {
            // Element e of the box (innermost fastest) and its place in the padded output.
            u32 rest_e = e, rest_t = t, o = 0, scale = 1;
            for (int d = 0; d < rank; d++) {
                const u32 i = rest_e % static_cast<u32>(bx[d]);
                rest_e /= static_cast<u32>(bx[d]);
                const u32 g = (rest_t % static_cast<u32>(nt[d])) * static_cast<u32>(bx[d]) + i;
                rest_t /= static_cast<u32>(nt[d]);
                o += g * scale;
                scale *= padded[d];
            }
            const bf16 v = *reinterpret_cast<const bf16*>(stage + tma_swizzle(e * 2, static_cast<u32>(swizzle)));
            out[o] = to_f32(v);
        }
        if (mode == 3) mbarrier_wait(&full[s], use & 1);
        mbarrier_arrive(&empty[s]);
    }
    if (store && ct == 0) tma_store_wait<0>();
}

// mbarrier.try_wait on its own (the emulator's tests): one block of 32 threads, an mbarrier expecting 2 arrivals
// (threads 0 and 1). Thread 0 stores try_wait(parity 0) before its arrival (0: the phase is not complete), after
// waiting for the phase (1), and try_wait(parity 1) then (0: the phase after it is not complete; nothing will change
// the barrier, so the emulator answers once the whole block waits). `mode` 1: thread 0 loops on try_wait for a phase
// nobody arrives at (a deadlock); 2: threads 0-2 arrive, thread 0 announcing 16 bytes that never come, so the third
// arrival is one more than the phase expects (an error); 3: an arrive on a barrier nobody initialised (an error).
extern "C" __global__ void longctx_tma_probe_try_wait(int* out, int mode) {
    __shared__ __align__(8) u64 bar;
    __shared__ __align__(8) u64 never;
    const u32 tid = threadIdx.x;
    if (tid == 0) {
        mbarrier_init(&bar, 2);
        mbarrier_fence_init();
    }
    __syncthreads();
    if (mode == 2) {
        if (tid == 0) mbarrier_arrive_expect_tx(&bar, 16);
        if (tid == 1 || tid == 2) mbarrier_arrive(&bar);
        return;
    }
    if (mode == 3) {
        if (tid == 0) mbarrier_arrive(&never);
        return;
    }
    if (mode == 1) {
        if (tid == 0)
            while (!mbarrier_try_wait(&bar, 0)) {
            }
        return;
    }
    if (tid == 1) mbarrier_arrive(&bar);
    if (tid != 0) return;
    out[0] = mbarrier_try_wait(&bar, 0) ? 1 : 0;
    mbarrier_arrive(&bar);
    mbarrier_wait(&bar, 0);
    out[1] = mbarrier_try_wait(&bar, 0) ? 1 : 0;
    out[2] = mbarrier_try_wait(&bar, 1) ? 1 : 0;
}

// wgmma on tiles the TMA loaded (the pattern of a FlashAttention-3 consumer): D (64×64 f32, row-major) = A·Bᵀ for A
// and B 64×64 bf16, row-major in global memory (K contiguous), each loaded as one 64 × 64 box with the 128B swizzle.
// A box row (64 k, 128 bytes) lands as one 128-byte row, rows one after another, swizzled on the address: wgmma's
// K-major 128B canonical layout (ptx_hopper.cuh) with SBO = 1024, the k-step s starting 32·s bytes in. No proxy fence
// between the two: the TMA writes through the async proxy, which wgmma reads. One warpgroup; dynamic shared memory
// 2 · 8192 + 1024 bytes.
extern "C" __global__ void __launch_bounds__(128, 1)
    longctx_tma_probe_wgmma(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                            float* d) {
    __shared__ __align__(8) u64 full;
    unsigned char* raw = tma_probe_smem();
    unsigned char* sa = raw + ((1024u - (tma_smem_addr(raw) & 1023u)) & 1023u);
    unsigned char* sb = sa + 64 * 64 * 2;
    const u32 tid = threadIdx.x;
    if (tid == 0) {
        mbarrier_init(&full, 1);
        mbarrier_fence_init();
    }
    __syncthreads();
    if (tid == 0) {
        mbarrier_arrive_expect_tx(&full, 2 * 64 * 64 * 2);
        tma_load_2d(sa, &map_a, &full, 0, 0);
        tma_load_2d(sb, &map_b, &full, 0, 0);
    }
    mbarrier_wait(&full, 0);

    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; i++) acc[i] = 0.0f;
    wgmma_fence();
#pragma unroll
    for (u32 s = 0; s < 4; s++)
        wgmma_m64n64k16_bf16<0, 0>(acc, wgmma_desc(sa + 32 * s, 16, 1024, WGMMA_SWIZZLE_128B),
                                   wgmma_desc(sb + 32 * s, 16, 1024, WGMMA_SWIZZLE_128B), s > 0);
    wgmma_commit_group();
    wgmma_wait_group<0>();

    const u32 w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int i = 0; i < 32; i++) {
        const u32 row = 16 * w + gid + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * tig + (i & 1);
        d[row * 64 + col] = acc[i];
    }
}

// The bulk reduce-add (bulk_reduce_add_f32, ptx_tma.cuh: cp.reduce.async.bulk .add.f32), as the wgmma backward's
// one-kernel variants add their dQ shares: every block's four warps each write 1024 floats to their own 4 KiB of
// shared memory (thread t of warp w, its 32 floats at words 32·i + lane: word k of warp w holding (block + 1)·(k % 7 +
// 1)), fence them for the async proxy, and lane 0 adds them to dst[1024·w..] with one bulk reduce-add, waiting for
// its read before the block ends. All blocks add to the same 4096 floats, so dst[1024·w + k] = (k % 7 + 1)·Σ (b + 1),
// exact in f32 whatever the order. `mode` 1: a size that is not a multiple of 16 (an error on the emulator).
extern "C" __global__ void __launch_bounds__(128, 1) longctx_tma_probe_reduce(float* dst, int mode) {
    __shared__ __align__(128) float stage[4][1024];
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (u32 i = 0; i < 32; i++) {
        const u32 k = 32 * i + lane;
        stage[warp][k] = static_cast<float>((blockIdx.x + 1) * (k % 7 + 1));
    }
    tma_fence_proxy_async();
    __syncwarp();
    if (lane == 0) {
        bulk_reduce_add_f32(dst + 1024 * warp, stage[warp], mode == 1 ? 4092 : 4096);
        tma_store_commit();
        tma_store_wait_read<0>();
    }
    __syncwarp();
}
