// Attention forward on Hopper's warpgroup MMA (wgmma, ptx_hopper.cuh; sm_90a only): bf16 or f16 Q, K, V (T), head
// dim 64 or 128, f32 accumulation, with exactly the semantics of attention_forward_tc.cu (its mma.sync sibling and
// reference on the GPU): GQA by head index, masks by global positions through the same tile summaries, tails,
// LSE, output in T or f32, and the same confinement of non-finite values behind the mask.
//
// Warps (FlashAttention-3's warp specialisation). A block is 128·(NWG + 1) threads (NWG = 1 or 2) for a tile of
// BR = 64·NWG query rows of one (batch, head):
// - warpgroup 0 is the producer: it lowers its registers to FWD_PRODUCER_REGS (setmaxnreg.dec, ptx_hopper.cuh),
//   then its thread 0 issues every copy by the TMA (cp.async.bulk.tensor, ptx_tma.cuh; fwd_produce, fwd_tma_tile)
//   and the other 127 threads leave;
// - warpgroups 1..NWG are the consumers: they raise their registers (setmaxnreg.inc, to FWD_CONSUMER_REGS_1 or _2:
//   O's D/2 accumulators, two score fragments, two sets of P's A fragments) and only compute; consumer warpgroup g
//   (warps 4(g + 1)..4(g + 1) + 3) owns rows 64g..64g+63 of the tile, and its warp w rows 16w..16w+15 of those (the
//   accumulator fragment's rows). With NWG = 2 the two take turns at issuing their products (Ping-pong, below).
//   The register split fits the 64K registers: 128·40 + 128·256 (NWG = 1) and 128·40 + 256·232 (NWG = 2);
//   setmaxnreg takes effect because the kernel has a cap at entry (__launch_bounds__(threads, 1)): ptxas reports
//   that cap (168 registers at NWG = 2, 255 at NWG = 1) and no spill or stack frame (nvrtc.rs's tests) with key
//   tiles of 128 because the mask is worked out before each tile's product (wg_hidden_bits; per element in the
//   softmax it spilled up to 128 bytes at D = 128). At
//   NWG = 2 it also reports 16 named barriers: the turns' ids are in registers (FWD_BAR_TURN + g), so ptxas reserves
//   them all; harmless at one block per SM, which the shared memory imposes anyway.
//   Checked on the emulator (which models the TMA, the mbarriers, the named barriers and their deadlocks, not the
//   register file, the proxies nor timing) and by ptxas; not yet run on a GPU.
//
// Tensor maps (built by the host, ops/attention.rs: fwd_tma_maps): Q, K and V each as a 3-D tensor, innermost
// first (D, rows of a head, batch·heads), strides 2D and 2D·len bytes; a box is 64 elements (128 bytes, the 128B
// swizzle's span) × ROWS rows × 1 head, landing as ROWS 128-byte rows with the 128B swizzle on the address, which is
// exactly one 64-element block of the tile layout below (wg_swz, attention_wgmma.cuh): a tile at D = 128 is two
// boxes, at element columns 0 and 64. Rows past the head's length (Sq or Sk) lie outside the map's second
// dimension, so the TMA writes them as zeros (never the next head's rows).
//
// Stages and barriers (mbarriers in dynamic shared memory after the scratch): K/V tiles go through a ring of
// STAGES stages (fwd_stages<D>: FWD_STAGES_D64 = 3, FWD_STAGES_D128 = 2; K and V of FWD_BC = 128 rows each).
// full[st]: 1 arrival (the producer's arrive.expect_tx of the stage's bytes, out-of-bounds zeros included) plus the
// copies' bytes; empty[st]: 128·NWG arrivals, one per consumer
// thread, each after its last wgmma on the stage (P·V of the tile) has been waited for. The producer's n-th tile
// goes into stage n % STAGES: it waits on empty with parity ((n / STAGES) & 1) ^ 1 (the first use passes at
// once), the consumers on full with parity (n / STAGES) & 1. qbar: Q's box, once. csync (128·NWG arrivals):
// the consumers' own barrier (a __syncthreads would wait for the producer, which has left or waits on "empty"),
// used after the rare non-finite sanitising of a V tile (below). Producer and consumers walk the same key tiles in
// the same order (next_tile over the mask's tile summaries), so a hidden tile is never loaded, and nothing is
// loaded (Q included) when every tile is hidden. Named barriers (ptx.cuh; NWG = 2 only): FWD_BAR_TURN + g (ids 1
// and 2; 0 is __syncthreads') is consumer warpgroup g's turn at the tensor cores, a phase of FWD_TURN_THREADS (256)
// arrivals: g's 128 threads in bar.sync and the other warpgroup's 128 in bar.arrive.
//
// Ping-pong (NWG = 2; FlashAttention-3's warp scheduler barriers). The two consumer warpgroups take turns at issuing
// their products, so that one's softmax (exponentials, shuffles) runs while the other's products run on the tensor
// cores, rather than both warpgroups issuing, and then waiting on, their products at the same moments. A turn is the
// issue of one batch of wgmma: the first tile's S, then per tile S of the next tile (if any) with O += P·V of this
// one. Before issuing, warpgroup g waits on barrier FWD_BAR_TURN + g (bar.sync); once its batch is committed it
// arrives on the other's (bar.arrive) and goes on to its waits and softmax (fwd_turn_wait, fwd_turn_pass). Warpgroup
// 1 gives warpgroup 0 its first turn with one arrival before either starts (fwd_turn_first): the turns go 0, 1, 0,
// 1, ... Balance: both warpgroups walk the block's tiles (next_tile over the summaries of the block's BR rows, the
// same for both), so each takes T = 1 + (tiles not hidden) turns. Barrier 1 (warpgroup 0's) gets warpgroup 0's T
// syncs and warpgroup 1's T arrivals: the first-turn one and one after each of its turns but the last (an arrival
// after it would open a phase that warpgroup 0, with no turn left, never completes); barrier 2 gets warpgroup 1's T
// syncs and warpgroup 0's T arrivals. Every phase completes with 128 + 128 threads and none is left open at exit (the
// emulator reports an open phase as an error, and a phase that cannot complete as a deadlock). No phase can take an
// arrival meant for the next one: the turns strictly alternate, and a warpgroup arrives on the other's barrier for
// the other's turn k+1 only after its own turn that came after the other's turn k (after that phase completed, for
// all 128 threads of both). When every tile is hidden neither warpgroup takes a turn nor gives the first one. The
// consumers' csync (after the rare sanitising of a V tile) comes before the turn's wait of the same iteration in both
// warpgroups, so it cannot cross the turns' order. The turns change when products are issued, not what a warpgroup
// computes nor in what order: the result is bit for bit the one without them.
//
// Pipeline, per block:
// 1. Q's tile goes global → shared by the TMA (rows past Sq zero-filled); it stays in shared memory as wgmma's A
//    operand.
// 2. Key tiles of FWD_BC = 128 rows (the host's key tile summaries are of 128 keys too), in order, skipping those
//    the mask's tile summaries classify as hidden: K and V go
//    global → shared by the TMA into the ring while the consumers compute on the tiles before; the consumers wait
//    on the stage's full barrier before the tensor cores read it (the TMA writes through the async proxy, which
//    wgmma reads: no proxy fence).
// 3. Per tile, per warpgroup: S = Q·Kᵀ (64×128, D/16 wgmma m64n128k16 with both operands in shared memory: with
//    64 keys, m64n64k16 reads as many bytes of shared memory per product as the SM delivers, 128 a cycle, so the
//    tensor cores would wait on it; 128 keys read a quarter less per product, as FlashAttention-3's tiles); scaled
//    to base 2; on a partial tile, or the last one past Sk, every hidden pair's score is selected to −inf (never
//    multiplied; which are hidden was worked out before the product, wg_hidden_bits); the online softmax per row on the accumulator fragment (wg_softmax: running max m and sum l,
//    reduced across the four lanes of a quad by shuffles; each exponential one ex2.approx); O rescaled by
//    exp(m_old − m); P = exp(S − m) rounded to T, packed in registers straight into wgmma's A fragment (the
//    accumulator fragment's layout is the A fragment's, ptx_hopper.cuh); O += P·V (8 wgmma m64nDk16 with A from
//    registers, V from shared memory N-major).
//    The products of consecutive tiles overlap the softmax (FlashAttention-3's intra-warpgroup pipelining): with
//    tile i's P in registers, the warpgroup issues S(i+1) = Q·K(i+1)ᵀ and O += P(i)·V(i) as two commit groups,
//    waits for the first (wgmma.wait_group 1), runs the softmax of tile i+1 (into a second set of P registers:
//    those of P(i) are the product's operand until it completes) while the tensor cores compute P(i)·V(i), then
//    waits for that and rescales O. The result is the same arithmetic in the same order as one tile at a time.
//    With two warpgroups each issues its batches in its turn (Ping-pong, above): while one runs the softmax of tile
//    i+1, the other's S(i+1) and P(i)·V(i) run on the tensor cores. The ring's STAGES stages let the TMA
//    run STAGES − 1 tiles (of 128 keys) ahead of the tile being multiplied.
//    Against the mma.sync kernel (64-key tiles) the result differs by P's rounding to 16 bits, taken against other
//    running maxima; the sums are otherwise the same.
// 4. O / l is written (T or f32), and LSE = m + ln l (−inf and O = 0 for a row that saw no key).
//
// Shared memory (dynamic, aligned here to 1024 bytes: the 128B swizzle is on the address): every tile is rows of
// D 16-bit elements stored as D/64 blocks of ROWS × 128 bytes (64 elements of each row per block, the block of
// elements 64c..64c+63 after the one of 64(c−1)..), the 16-byte chunk x of a row r of a block stored at chunk
// x ^ (r % 8) (Swizzle<3,4,3>: the 128B swizzle of wgmma's canonical layouts). For Q and K this is the K-major
// 128B layout (rows = M or N, 64 elements of K per row: LBO unused, SBO = 1024 from one 8-row group to the next);
// for V, read as the B of P·V (B = V's transpose viewed as N×K = D×keys), it is the N-major 128B layout (128-byte
// rows of 64 n = d, one per k = key: SBO = 1024 from keys 0-7 to keys 8-15, LBO = 64·128 from one 64-wide d block
// to the next). Q: BR×D; K and V: STAGES stages of FWD_BC×D each; then 32 KiB per warpgroup for P on the
// rare tile that needs a non-finite correction (below); then the barriers (8·(2 + 2·STAGES) bytes). 224 KiB at
// D = 128, NWG = 2, with two stages (of the 227 KiB an sm_90 block may opt into: the host asks for it, and the driver
// wrapper raises the kernel's limit; a third stage would need 288 KiB), 176 KiB at D = 64 with three.
//
// Non-finite values behind the mask: as attention_forward_tc.cu. On a partial tile that holds a non-finite V row
// (the host's masks, one word per 64 rows: two a tile), V's non-finite elements are set to 0 in shared memory by the consumers before
// the product (then fence.proxy.async and csync), and each row that sees such a key then adds P·V[j, d] for those
// elements from global memory.
//
// Every loop over a register array (fragments, accumulators) is unrolled with constant bounds: an array indexed at
// run time is placed in local memory.

// The key tile and the ring's depth at each head dim (the host reads these lines for its tile summaries, tensor maps
// and shared-memory size: ops/attention.rs), and the register split of the producer and consumer warpgroups (the
// header's Warps). Three stages at D = 64 (176 KiB with two consumer warpgroups): a tile's products take half the
// time they take at D = 128, for the same number of loads in flight; at D = 128 a third would need 288 KiB.
#define FWD_BC 128
#define FWD_STAGES_D64 3
#define FWD_STAGES_D128 2
#define FWD_PRODUCER_REGS 40
#define FWD_CONSUMER_REGS_1 256
#define FWD_CONSUMER_REGS_2 232
// The consumer warpgroups' turns at the tensor cores (NWG = 2; the header's Ping-pong): warpgroup g waits for its turn
// on named barrier FWD_BAR_TURN + g and passes it by arriving on the other's, each phase counting both warpgroups'
// 256 threads. Ids 1 and 2: 0 is __syncthreads'.
#define FWD_BAR_TURN 1
#define FWD_TURN_THREADS 256

// The ring's depth at head dim D.
template <int D>
__device__ __forceinline__ constexpr u32 fwd_stages() {
    return D == 64 ? FWD_STAGES_D64 : FWD_STAGES_D128;
}

// The online softmax of one key tile (keys j0..j0+63) on its score fragment `s` (s[4n + e]: row row_base + 8·(e / 2),
// key j0 + 8n + 2·tig + (e % 2)): scaled to base 2; hidden pairs (when `masked`: a partial tile, or the last one past
// Sk) selected to −inf; the running max m and sum l of the thread's two rows updated (across the quad by
// shuffles); alpha = exp(m_old − m), by which the caller rescales O; P = exp(S − m) left in `s` (f32) and packed to
// T in `pa` as the A fragments of P·V's four k-steps.
template <typename T>
__device__ __forceinline__ void wg_softmax(float (&s)[FWD_BC / 2], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                           u32 (&pa)[FWD_BC / 16][4], unsigned long long hid, float scale2) {
#pragma unroll
    for (u32 hf = 0; hf < 2; ++hf) {
        float mx = m[hf];
#pragma unroll
        for (u32 n = 0; n < FWD_BC / 8; ++n) {
#pragma unroll
            for (u32 e = 0; e < 2; ++e) {
                float x = s[4 * n + 2 * hf + e] * scale2;
                if ((hid >> (4 * n + 2 * hf + e)) & 1ull) x = NEG_INF;
                s[4 * n + 2 * hf + e] = x;
                mx = fmaxf(mx, x);
            }
        }
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
        // A row that has seen no key yet keeps m = −inf: exponents are taken against 0 then, giving 0.
        float base = mx == NEG_INF ? 0.0f : mx;
        alpha[hf] = m[hf] == mx ? 1.0f : ex2_approx(m[hf] - base);
        float sum = 0.0f;
#pragma unroll
        for (u32 n = 0; n < FWD_BC / 8; ++n) {
#pragma unroll
            for (u32 e = 0; e < 2; ++e) {
                float x = s[4 * n + 2 * hf + e];
                float pv = x == NEG_INF ? 0.0f : ex2_approx(x - base);
                s[4 * n + 2 * hf + e] = pv;
                sum += pv;
            }
        }
        sum += __shfl_xor_sync(FULL_MASK, sum, 1);
        sum += __shfl_xor_sync(FULL_MASK, sum, 2);
        l[hf] = l[hf] * alpha[hf] + sum;
        m[hf] = mx;
    }
    // The accumulator fragment of S is the A fragment of P·V: keys 16t..16t+15 are s[8t..8t+7].
#pragma unroll
    for (u32 t = 0; t < FWD_BC / 16; ++t)
#pragma unroll
        for (u32 r = 0; r < 4; ++r) pa[t][r] = pack2<T>(s[8 * t + 2 * r], s[8 * t + 2 * r + 1]);
}

// Issues the TMA copies of rows [row0, row0 + ROWS) of head `head` (of batch·heads) of the tensor `map` describes
// into the tile at `dst`, completing on `bar`: D/64 boxes of 64 elements × ROWS rows, box c (elements 64c..64c+63)
// at dst + c·ROWS·128 (the tile layout of the header). The caller announces the bytes (ROWS·D·2) on `bar`.
template <int D, int ROWS>
__device__ __forceinline__ void fwd_tma_tile(unsigned char* dst, const CUtensorMap* map, u64* bar, u32 row0,
                                             u32 head) {
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
        tma_load_3d(dst + c * (ROWS * 128), map, bar, c * 64, static_cast<i32>(row0), static_cast<i32>(head));
}

// The consumers' barrier (every consumer thread, on the mbarrier `bar` of as many arrivals; `parity` is the
// thread's count of its uses, mod 2): a barrier that does not wait for the producer warpgroup, which has left.
__device__ __forceinline__ void fwd_consumer_sync(u64* bar, u32& parity) {
    mbarrier_arrive(bar);
    mbarrier_wait(bar, parity);
    parity ^= 1u;
}

// The consumers' turns (NWG = 2; nothing with one warpgroup). fwd_turn_first: warpgroup 1 gives warpgroup 0 its
// first turn, once, before either takes one. fwd_turn_wait: waits for warpgroup wg's turn (the other warpgroup's
// arrival, with this one's 128 threads: a phase of 256). fwd_turn_pass: after warpgroup wg has issued its GEMMs of the
// turn, gives the turn to the other; not after warpgroup 1's last turn (`last`), which warpgroup 0, having no turn
// left, would never take: every phase of both barriers then completes (the header's Ping-pong).
template <int NWG>
__device__ __forceinline__ void fwd_turn_first(u32 wg) {
    if constexpr (NWG == 2) {
        if (wg == 1) named_barrier_arrive(FWD_BAR_TURN, FWD_TURN_THREADS);
    }
}
template <int NWG>
__device__ __forceinline__ void fwd_turn_wait(u32 wg) {
    if constexpr (NWG == 2) named_barrier_sync(FWD_BAR_TURN + wg, FWD_TURN_THREADS);
}
template <int NWG>
__device__ __forceinline__ void fwd_turn_pass(u32 wg, bool last) {
    if constexpr (NWG == 2) {
        if (wg == 0 || !last) named_barrier_arrive(FWD_BAR_TURN + (wg ^ 1u), FWD_TURN_THREADS);
    }
}

// The producer (thread 0 of warpgroup 0): Q once on `qbar`, then the key tiles that are not hidden, in the consumers'
// order (next_tile), the n-th into stage n % STAGES once the consumers have released it (its empty barrier's
// phase before the (n / STAGES)-th: the first use of a stage passes at once).
template <int D, int BR>
__device__ __forceinline__ void fwd_produce(const AttnProblem& p, const CUtensorMap* qmap, const CUtensorMap* kmap,
                                            const CUtensorMap* vmap, unsigned char* qs, unsigned char* kv, u64* qbar,
                                            u64* full, u64* empty, u32 qt, u32 q_head, u32 kv_head, u32 k_tiles) {
    constexpr u32 TILE_BYTES = FWD_BC * D * 2;
    constexpr u32 STAGES = fwd_stages<D>();
    u32 kt = next_tile(p, qt, 0, k_tiles);
    if (kt >= k_tiles) return;  // every key tile hidden: nothing to load
    mbarrier_arrive_expect_tx(qbar, BR * D * 2);
    fwd_tma_tile<D, BR>(qs, qmap, qbar, qt * BR, q_head);
    for (u32 n = 0; kt < k_tiles; ++n, kt = next_tile(p, qt, kt + 1, k_tiles)) {
        const u32 st = n % STAGES, use = n / STAGES;
        mbarrier_wait(&empty[st], (use & 1u) ^ 1u);
        mbarrier_arrive_expect_tx(&full[st], 2 * TILE_BYTES);
        fwd_tma_tile<D, FWD_BC>(kv + st * TILE_BYTES, kmap, &full[st], kt * FWD_BC, kv_head);
        fwd_tma_tile<D, FWD_BC>(kv + (STAGES + st) * TILE_BYTES, vmap, &full[st], kt * FWD_BC, kv_head);
    }
}

template <int D, int NWG, typename T, typename OT>
__device__ __forceinline__ void attn_fwd_wgmma(const AttnProblem& p, const CUtensorMap* qmap, const CUtensorMap* kmap,
                                               const CUtensorMap* vmap, const T* __restrict__ v, OT* __restrict__ o,
                                               float* __restrict__ lse,
                                               const unsigned long long* __restrict__ v_bad) {
    constexpr u32 BR = 64 * NWG;
    constexpr u32 TILE_BYTES = FWD_BC * D * 2;
    constexpr u32 Q_BYTES = BR * D * 2;
    unsigned char* smem = wg_smem();
    unsigned char* qs = smem;
    constexpr u32 CONSUMERS = 128 * NWG;
    constexpr u32 STAGES = fwd_stages<D>();
    // K of stage st at smem + Q_BYTES + st·TILE_BYTES, V's at smem + Q_BYTES + (STAGES + st)·TILE_BYTES
    // (computed, not an array: an array indexed at run time would live in local memory).
    unsigned char* kv = smem + Q_BYTES;
    float* pscr = reinterpret_cast<float*>(kv + 2 * STAGES * TILE_BYTES);  // [4·NWG warps][16][FWD_BC]: P
    u64* qbar = reinterpret_cast<u64*>(pscr + 4 * NWG * 16 * FWD_BC);           // Q landed
    u64* full = qbar + 1;                                                         // [STAGES]: the stage landed
    u64* empty = full + STAGES;                                               // [STAGES]: the stage is free
    u64* csync = empty + STAGES;                                              // the consumers' barrier

    const u32 qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const u32 hk = h / (p.q_heads / p.kv_heads);
    const u32 kv_head = b * p.kv_heads + hk;  // the maps' third coordinate
    const u32 k_tiles = (p.kv_len + FWD_BC - 1) / FWD_BC;
    if (threadIdx.x == 0) {
        mbarrier_init(qbar, 1);
        for (u32 st = 0; st < STAGES; ++st) {
            mbarrier_init(&full[st], 1);
            mbarrier_init(&empty[st], CONSUMERS);
        }
        mbarrier_init(csync, CONSUMERS);
        mbarrier_fence_init();
    }
    __syncthreads();
    if (threadIdx.x < 128) {
        // The producer warpgroup: its registers lowered, one thread issues every copy, the others leave.
        setmaxnreg_dec<FWD_PRODUCER_REGS>();
        if (threadIdx.x == 0)
            fwd_produce<D, BR>(p, qmap, kmap, vmap, qs, kv, qbar, full, empty, qt, b * p.q_heads + h, kv_head,
                               k_tiles);
        return;
    }
    setmaxnreg_inc<(NWG == 1 ? FWD_CONSUMER_REGS_1 : FWD_CONSUMER_REGS_2)>();
    // The consumers: thread ct of 128·NWG.
    const u32 ct = threadIdx.x - 128;
    const u32 lane = ct & 31, warp = ct >> 5;
    const u32 wg = warp / 4, wwarp = warp % 4;
    const u32 gid = lane >> 2, tig = lane & 3;
    const u64 q_head = ((u64)b * p.q_heads + h) * p.q_len;
    const u64 k_head = ((u64)b * p.kv_heads + hk) * p.kv_len;
    const T* vg = v + k_head * D;
    // Scores are kept in base-2 units (scale·log2 e folded into one multiply), so each exponential is one
    // ex2.approx; m is in those units too.
    const float scale2 = p.scale * 1.4426950408889634f;
    // This thread's rows: row_base and row_base + 8.
    const u32 row_base = qt * BR + wg * 64 + wwarp * 16 + gid;

    u32 cpar = 0;  // the parity of the consumers' next barrier

    // 1. The first key tile that is not hidden (the producer's tile 0, in stage 0), and Q.
    u32 kt = next_tile(p, qt, 0, k_tiles);

    float acc[D / 2];
#pragma unroll
    for (u32 i = 0; i < D / 2; ++i) acc[i] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    if (kt < k_tiles) {
        // (Every key tile hidden: O = 0 and LSE = −inf below.)
        // This warpgroup's 64 rows of Q (a multiple of 1024 bytes into each block of the tile).
        const unsigned char* q_wg = qs + wg * 64 * 128;
        // V's non-finite rows come as one word per 64 rows of the head (the host's masks): words 2kt and 2kt + 1
        // for key tile kt (read only for partial tiles).
        const u32 k_words = (p.kv_len + 63) / 64;
        const u64 bad_base = ((u64)b * p.kv_heads + hk) * k_words;
        auto vbad = [&](u32 t, u32 half) {
            return (v_bad && 2 * t + half < k_words) ? v_bad[bad_base + 2 * t + half] : 0ull;
        };
        // Both warpgroups walk the same tiles (the block's, by next_tile), so they take as many turns each: one for
        // the first S, one per tile after.
        fwd_turn_first<NWG>(wg);
        mbarrier_wait(qbar, 0);
        mbarrier_wait(&full[0], 0);
        u32 next = next_tile(p, qt, kt + 1, k_tiles);
        int cls = classify(p, qt, kt);
        // A tile's hidden scores (wg_hidden_bits; none unless the tile is partial or the last one past Sk), worked
        // out before its product, while S's registers are free.
        auto hidden_scores = [&](u32 t, int c) {
            return c == TILE_PARTIAL || (t + 1) * FWD_BC > p.kv_len
                       ? wg_hidden_bits<FWD_BC, false>(p, row_base, t * FWD_BC, tig)
                       : 0ull;
        };
        unsigned long long hid = hidden_scores(kt, cls);
        unsigned long long vb = cls == TILE_PARTIAL ? vbad(kt, 0) : 0ull;
        unsigned long long vb_hi = cls == TILE_PARTIAL ? vbad(kt, 1) : 0ull;
        if (vb | vb_hi) {
            // Zero V's non-finite elements in the rows flagged (see the header).
            wg_sanitize<D, T, FWD_BC>(kv + STAGES * TILE_BYTES, vb, ct, CONSUMERS, vb_hi);
            wgmma_fence_proxy_async();
            fwd_consumer_sync(csync, cpar);
        }

        // S of the first tile, its softmax, its P in the A fragment.
        float s[FWD_BC / 2];
#pragma unroll
        for (u32 i = 0; i < FWD_BC / 2; ++i) s[i] = 0.0f;
        fwd_turn_wait<NWG>(wg);
        wgmma_fence();
#pragma unroll
        for (u32 ks = 0; ks < D / 16; ++ks)
            wg_mma_qk<T, FWD_BC>(s, wg_desc_kmajor<BR>(q_wg, ks), wg_desc_kmajor<FWD_BC>(kv, ks), ks > 0);
        wgmma_commit_group();
        fwd_turn_pass<NWG>(wg, false);  // (not the last turn: one per tile follows)
        wgmma_wait_group<0>();
        float alpha[2];
        u32 pa[FWD_BC / 16][4];
        wg_softmax<T>(s, m, l, alpha, pa, hid, scale2);

        u32 n = 0;  // tile kt is the producer's n-th: in stage n % STAGES, its (n / STAGES)-th fill
        while (kt < k_tiles) {
            // Tile kt is in stage st, its P in pa (its alpha applied: O holds the tiles before it); tile `next` is
            // the producer's (n + 1)-th.
            const u32 st = n % STAGES, st_next = (n + 1) % STAGES;
            const bool has_next = next < k_tiles;
            unsigned long long vb_next = 0, vb_next_hi = 0;
            int cls_next = TILE_HIDDEN;
            unsigned char* kn = kv + st_next * TILE_BYTES;
            if (has_next) {
                mbarrier_wait(&full[st_next], ((n + 1) / STAGES) & 1u);
                cls_next = classify(p, qt, next);
                hid = hidden_scores(next, cls_next);
                vb_next = cls_next == TILE_PARTIAL ? vbad(next, 0) : 0ull;
                vb_next_hi = cls_next == TILE_PARTIAL ? vbad(next, 1) : 0ull;
                if (vb_next | vb_next_hi) {
                    wg_sanitize<D, T, FWD_BC>(kn + STAGES * TILE_BYTES, vb_next, ct, CONSUMERS, vb_next_hi);
                    wgmma_fence_proxy_async();
                    fwd_consumer_sync(csync, cpar);
                }
            }
            // This warp's P of tile kt for the correction, before S of the next tile takes its registers.
            float* ps = pscr + warp * 16 * FWD_BC;
            if (vb | vb_hi) {
#pragma unroll
                for (u32 n = 0; n < FWD_BC / 8; ++n)
#pragma unroll
                    for (u32 e = 0; e < 4; ++e)
                        ps[(gid + 8 * (e >> 1)) * FWD_BC + n * 8 + 2 * tig + (e & 1)] = s[4 * n + e];
                __syncwarp();
            }

            // Two groups: S of the next tile, then O += P·V of this one; the softmax of the next tile runs while
            // the tensor cores do P·V. Every register a wgmma reads or writes is written before the fence (the PTX
            // ISA requires one between an ordinary access and the wgmma; the emulator cannot check this order).
#pragma unroll
            for (u32 i = 0; i < FWD_BC / 2; ++i) s[i] = 0.0f;
            fwd_turn_wait<NWG>(wg);
            wgmma_fence();
            if (has_next) {
#pragma unroll
                for (u32 ks = 0; ks < D / 16; ++ks)
                    wg_mma_qk<T, FWD_BC>(s, wg_desc_kmajor<BR>(q_wg, ks), wg_desc_kmajor<FWD_BC>(kn, ks), ks > 0);
                wgmma_commit_group();
            }
            unsigned char* vs_ = kv + (STAGES + st) * TILE_BYTES;
#pragma unroll
            for (u32 t = 0; t < FWD_BC / 16; ++t) wg_mma_pv<T, D>(acc, pa[t], wg_desc_nmajor<FWD_BC>(vs_, t));
            wgmma_commit_group();
            // Issued: the other warpgroup's GEMMs go next, while this one runs the softmax below.
            fwd_turn_pass<NWG>(wg, !has_next);
            u32 pa_next[FWD_BC / 16][4];
            if (has_next) {
                wgmma_wait_group<1>();  // S of the next tile (the older group)
                wg_softmax<T>(s, m, l, alpha, pa_next, hid, scale2);
            }
            wgmma_wait_group<0>();  // O += P·V of this tile
            // Every wgmma on stage st has been waited for (S of tile kt at the iteration before): release it.
            mbarrier_arrive(&empty[st]);

            if (vb | vb_hi) {
                // Each row that sees a flagged key adds what the zeroed elements held, times its P (from shared
                // memory, so that no register array is indexed at run time).
                const u32 j0 = kt * FWD_BC;
                for (u32 jj = 0; jj < FWD_BC; ++jj) {
                    if (!(((jj < 64 ? vb : vb_hi) >> (jj & 63)) & 1ull)) continue;
                    u32 j = j0 + jj;
#pragma unroll
                    for (u32 hf = 0; hf < 2; ++hf) {
                        u32 i = row_base + 8 * hf;
                        float pv = ps[(gid + 8 * hf) * FWD_BC + jj];
                        bool seen = i < p.q_len && j < p.kv_len && visible(p, i, j);
#pragma unroll
                        for (u32 n = 0; n < D / 8; ++n) {
#pragma unroll
                            for (u32 e = 0; e < 2; ++e) {
                                float x = seen ? to_f32(vg[(u64)j * D + n * 8 + 2 * tig + e]) : 0.0f;
                                if (seen && !isfinite(x)) acc[4 * n + 2 * hf + e] += pv * x;
                            }
                        }
                    }
                }
                __syncwarp();
            }
            if (has_next) {
#pragma unroll
                for (u32 n = 0; n < D / 8; ++n) {
                    acc[4 * n + 0] *= alpha[0];
                    acc[4 * n + 1] *= alpha[0];
                    acc[4 * n + 2] *= alpha[1];
                    acc[4 * n + 3] *= alpha[1];
                }
#pragma unroll
                for (u32 t = 0; t < FWD_BC / 16; ++t)
#pragma unroll
                    for (u32 r = 0; r < 4; ++r) pa[t][r] = pa_next[t][r];
            }

            ++n;
            kt = next;
            next = has_next ? next_tile(p, qt, next + 1, k_tiles) : k_tiles;
            vb = vb_next;
            vb_hi = vb_next_hi;
        }
    }

    // 4. O / l and LSE.
#pragma unroll
    for (u32 hf = 0; hf < 2; ++hf) {
        u32 i = row_base + 8 * hf;
        if (i >= p.q_len) continue;
        bool none = l[hf] == 0.0f;
        float inv = none ? 0.0f : 1.0f / l[hf];
#pragma unroll
        for (u32 n = 0; n < D / 8; ++n) {
            u32 d = n * 8 + 2 * tig;
            OT* out = o + (q_head + i) * D + d;
            out[0] = from_f32<OT>(none ? 0.0f : acc[4 * n + 2 * hf] * inv);
            out[1] = from_f32<OT>(none ? 0.0f : acc[4 * n + 2 * hf + 1] * inv);
        }
        if (tig == 0) lse[q_head + i] = none ? NEG_INF : m[hf] * 0.6931471805599453f + logf(l[hf]);
    }
}

// attn_fwd_wgmma_<inputs>_d<D>_w<NWG>_<output>: 128·(NWG + 1) threads. q_map, k_map, v_map: the header's tensor maps;
// v: V itself (the non-finite correction reads it from global memory).
#define FWD_WGMMA(tn, tt, dd, nwg, on, ot)                                                                          \
    extern "C" __global__ void __launch_bounds__(128 * (nwg + 1), 1) attn_fwd_wgmma_##tn##_d##dd##_w##nwg##_##on(      \
        AttnProblem p, const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,       \
        const __grid_constant__ CUtensorMap v_map, const tt* v, ot* o, float* lse,                                 \
        const unsigned long long* v_bad) {                                                                          \
        attn_fwd_wgmma<dd, nwg, tt, ot>(p, &q_map, &k_map, &v_map, v, o, lse, v_bad);                             \
    }
#define FWD_WGMMA_TYPES(tn, tt)                                                                                     \
    FWD_WGMMA(tn, tt, 64, 1, tn, tt) FWD_WGMMA(tn, tt, 64, 1, f32, float) FWD_WGMMA(tn, tt, 64, 2, tn, tt)          \
    FWD_WGMMA(tn, tt, 64, 2, f32, float) FWD_WGMMA(tn, tt, 128, 1, tn, tt) FWD_WGMMA(tn, tt, 128, 1, f32, float)    \
    FWD_WGMMA(tn, tt, 128, 2, tn, tt) FWD_WGMMA(tn, tt, 128, 2, f32, float)
FWD_WGMMA_TYPES(bf16, bf16)
FWD_WGMMA_TYPES(f16, f16)
