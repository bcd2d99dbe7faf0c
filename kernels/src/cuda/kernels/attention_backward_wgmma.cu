// Attention backward on Hopper's warpgroup MMA (wgmma, ptx_hopper.cuh; sm_90a only): bf16 or f16 Q, K, V, dO (T),
// head dim 64 or 128, f32 accumulation; attention_backward_tc.cu's two kernels with their products on wgmma, and
// their semantics exactly (it stays the reference on the GPU). Deterministic: no atomics; every gradient element is
// accumulated by one thread in a fixed order (dQ by its own kernel, as there). Δ = rowsum(dO∘O) comes first from
// attention_backward.cu's attn_bwd_delta.
//
// Warps. The TMA-fed kernels (dkdv, fused and dq: attn_bwd_wgmma_{dkdv,fused,dq}_tma_*) are warp-specialised as
// FlashAttention-3's backward (and this library's forward): a block is 128·(1 + NWG) threads, a producer warpgroup
// and NWG consumer warpgroups: 2 in every one (BWD_DKDV_WGS_D<D>, BWD_DQ_WGS, BWD_FUSED_WGS_D<D>).
// - Warpgroup 0 (threads 0..127) is the producer: after the block's one __syncthreads (the barriers' initialisation)
//   it lowers its registers to BWD_PRODUCER_REGS (setmaxnreg.dec, ptx_hopper.cuh), its thread 0 issues every TMA copy
//   (bwd_dkdv_produce, bwd_dq_produce) and the other 127 threads leave.
// - Warpgroups 1..NWG (consumer thread ct = threadIdx.x − 128, of consumer warpgroup g = ct / 128, its warp w =
//   (ct / 32) % 4 owning rows 16w..16w+15 of the warpgroup's 64, the accumulator fragment's rows) are the consumers:
//   they raise their registers to BWD_CONSUMER_REGS_1 or _2 (setmaxnreg.inc) and only compute (and make the rare
//   sanitised tiles, and, in dkdv, write the pairs' LSE and Δ to shared memory). They synchronise with each other by
//   named barrier BWD_BAR_CONSUMERS (id 1, 128·NWG threads; bwd_consumer_sync), never __syncthreads, which would wait
//   for the producer warpgroup (gone, or waiting on an empty barrier) and deadlock.
// - Two consumer warpgroups in dkdv and fused: a block is 128 keys, key tile kt0 + g of the block's kt0 = 2·blockIdx.x
//   being warpgroup g's (its own K, V, dK and dV), as FlashAttention-3's backward: both read the same Q and dO stage
//   of each pair, so each pair's tiles are loaded once for 128 keys rather than 64, and while one warpgroup works
//   out Pᵀ and dSᵀ the other's products can run. The pairs are those the mask does not hide for one of the block's
//   tiles at least (bwd_next_pair); a warpgroup whose own tile the pair hides (or that has none: the last block of
//   an odd number of key tiles) computes nothing for it but keeps every barrier: it waits on the stage, arrives on
//   its empty barrier and on the consumers' named barriers. The shared tiles are sanitised (the non-finite rows below)
//   when the pair is partial for either warpgroup's tile; each warpgroup's correction adds back what the zeroed
//   elements contribute to its visible pairs, whatever its own tile's class. The sums of every dK and dV element
//   are those of one consumer warpgroup, in the same order: the results are bit for bit those of the cp.async kernel.
// - Two consumer warpgroups in dq, the same way round: a block is 128 queries, query tile qt0 + g of the block's
//   qt0 = 2·blockIdx.x being warpgroup g's (its own Q, dO, LSE, Δ and dQ), both reading the same K and V stage of
//   each key tile, which is loaded once for 128 queries. The key tiles are those the mask does not hide from one of
//   the block's query tiles at least (bwd_next_key_tile); a warpgroup whose own tile the key tile hides computes
//   nothing for it but waits on the stage and arrives on its empty barrier; the shared K tile is sanitised when
//   the key tile is partial for either query tile (both warpgroups then meet at the consumers' named barrier), and
//   each warpgroup adds back what the zeroed elements contribute to its visible pairs. Every dQ element is summed
//   as with one warpgroup, in the same order.
//   Checked on the emulator (which models the TMA, the mbarriers, the named barriers and their deadlocks, not the
//   register file, the proxies nor timing) and by ptxas; not yet run on a GPU.
//   The register split: 128·32 + 256·240 of the 64K registers (all of them; FlashAttention-3's split; with one
//   consumer warpgroup, which the template allows and no kernel now uses, 128·32 + 128·256). The kernel's cap at
//   entry, which ptxas reports, is 168 (384 threads, __launch_bounds__(384, 1)); setmaxnreg.inc raises the consumers
//   to 240 and ptxas holds their code to that. At
//   D = 128 the body keeps dK and dV's accumulators (128 registers) beside Sᵀ and dPᵀ's fragments (64) through the
//   elementwise phase: it fits 240 because the mask is worked out before the products (wg_hidden_bits), while only
//   the accumulators are live; with the general masks' position and document arithmetic done per element beside the
//   fragments it spilled 692 bytes at 232 and 384 at 240 (BENCHMARKS.md has the figures). The dq body takes 221 at
//   D = 128 (its cp.async kernel), 64 of them Q's and dO's A fragments (below).
// The cp.async kernels (the fallback where the device refuses a tensor map) are one warpgroup: 128 threads that all
// load and compute, as Loads (below) says.
//
// dkdv: a block for a tile of 64 key rows of one (batch, key/value head) per consumer warpgroup, dK and dV accumulators
// in registers; K and V stay in shared memory. For every query head of the group and every query tile of 64 rows that
// the mask does not hide: Q, dO (and their LSE, Δ) go global → shared; then
//   Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (64×64 each: wgmma with both operands K-major in shared memory; K's and V's A
//   fragments kept in registers, as dq keeps Q's and dO's, would take 64 more registers at D = 128 beside dK and dV's
//   128 accumulators, over the 240 a consumer has),
//   Pᵀ = exp(Sᵀ·scale − LSE), dSᵀ = Pᵀ∘(dPᵀ − Δ) on the accumulator fragments (hidden pairs selected to 0),
//   dV += Pᵀ·dO and dK += dSᵀ·Q (wgmma with A from registers: Pᵀ and dSᵀ packed to T in the A fragment; dO and Q
//   read N-major from the same tiles).
// At the end dK·scale and dV are written (or added, GradMode::Accumulate).
//
// dq: a block for a tile of 64 query rows of one (batch, query head) per consumer warpgroup; Q and dO land in shared
// memory once, and each warp reads its rows of them into A fragments (wg_load_a_frags, by ldmatrix; D/8 registers
// each) kept for the block; dQ's accumulator in registers. For every key tile the mask does not hide: K and V go
// global → shared; S = Q·Kᵀ, dP = dO·Vᵀ (A from those registers, K and V K-major from shared memory: half the
// shared-memory bytes of a product with both operands there, which at 64×64 would read as much a cycle as the SM
// delivers), P and dS as above, dQ += dS·K (dS from registers, K N-major). At the end dQ·scale is written (or added).
//
// Loads. Each kernel keeps a pair of 64-row tiles per consumer warpgroup (K and V in dkdv, Q and dO in dq) and
// streams another (Q and dO of each visible (query head, query tile) pair in dkdv, K and V of each visible key tile
// in dq). The walk skips what the mask hides (bwd_next_pair, bwd_next_key_tile): a hidden tile is never loaded.
// - dkdv and fused fed by the TMA (what the host launches where the device takes the tensor maps; ptx_tma.cuh): the
//   producer thread loads K and V once (the tiles of every consumer warpgroup's key tile within the keys), on kvbar =
//   bars[0] (1 arrival: its arrive.expect_tx of all those tiles' bytes, plus the bytes; the consumers wait with parity
//   0), then walks the visible pairs in the consumers' order, the n-th pair's Q and dO into stage n % BWD_STAGES of a
//   ring of BWD_STAGES (3) stages (read BWD_FUSED_STAGES_D<D> for BWD_STAGES in fused: 2 at D = 128, where a third
//   would not fit shared memory beside its two warpgroups' sanitized K). full[s] = bars[1 + s]: 1 arrival (the producer's arrive.expect_tx of the stage's
//   2·64·D·2 bytes, zero-filled rows included) plus the bytes; the consumers wait on it with parity
//   (n / BWD_STAGES) % 2 (the stage's (n / BWD_STAGES)-th fill).
//   empty[s] = bars[1 + BWD_STAGES + s]: 128·NWG arrivals, one per consumer thread once its last wgmma reading the
//   stage (dV += Pᵀ·dO and dK += dSᵀ·Q of the pair) has been waited for (at once where its warpgroup's tile is hidden);
//   before filling stage s for the n-th pair the producer waits on it with parity ((n / BWD_STAGES) % 2) ^ 1, so a
//   stage's first fill passes at once (the phase before an mbarrier's first counts as complete) and each later fill
//   waits for the release of the fill before.
//   The producer so runs up to BWD_STAGES pairs ahead of the pair being computed, bounded only by the releases.
//   When the mask hides every pair of the block nothing is loaded (K and V neither) and the consumers wait on
//   nothing: they write zero gradients. LSE and Δ stay ordinary loads by the consumers: consumer thread ct loads
//   the next pair's LSE (ct < 64) or Δ (ct ≥ 64) of row ct % 64 into a register before waiting on the current
//   pair's full barrier, and stores it into slot (n + 1) % 2 beside the scratch after the consumers' barrier that
//   opens iteration n (every consumer is past iteration n − 1, the slot's last reader); the barrier opening
//   iteration n + 1 publishes it. That barrier also orders the correction scratch (fused's dSᵀ exchange) from one
//   pair to the next, so no barrier ends an iteration.
// - dq fed by the TMA: the same ring with K and V in place of Q and dO. The producer loads every consumer
//   warpgroup's Q and dO once on bars[0] (nothing at all when the mask hides every key tile of the block), then the
//   visible key tiles' K and V (bwd_next_key_tile, the consumers' walk), the n-th into stage n % BWD_STAGES, with
//   full and empty barriers (128·NWG arrivals), waits and
//   parities as above; the consumers release a stage once dQ += dS·K, the last wgmma reading it, has been waited
//   for. LSE and Δ: each consumer thread keeps its two rows' in registers. The consumers' only barrier is the one
//   after the rare sanitising of a K tile (the correction's scratch is per warp).
// - cp.async (the same names without _tma_; the host's fallback where the device refuses a tensor map, and the
//   tests'): one warpgroup, every thread takes its share of each tile's 16-byte copies (wg_load_tile: rows past the
//   head's length zero-filled) into two buffers: the loop's n-th streamed tile pair is in buffer n % 2, and at the
//   top of iteration n the loads of the (n + 1)-th go into the other buffer, which every thread is done with (the
//   __syncthreads ending iteration n − 1, after its wgmmas were waited for), so they land while iteration n
//   computes; cp.async groups in place of the barriers. cp.async writes through the generic proxy, so every tile is
//   followed by fence.proxy.async and a barrier before a wgmma reads it.
// The TMA tiles: the host passes tensor maps of Q, K, V and dO (ops/attention.rs: bwd_tma_maps), each a 3-D tensor,
// innermost first (D, rows of a head, batch·heads), strides 2D and 2D·len bytes, a box 64 elements (128 bytes, the
// 128B swizzle's span) × 64 rows × 1 head, landing as 64 128-byte rows with the 128B swizzle on the address:
// exactly one 64-element block of the tile layout (attention_wgmma.cuh), so a tile at D = 128 is two boxes
// (bwd_tma_pair). Rows past the head's length lie outside the map's second dimension: the TMA writes them as zeros
// (never the next head's rows). The TMA writes through the async proxy, which wgmma reads: no proxy fence between
// a load's wait and the wgmma reading the tile.
// Either way, what the threads write to a tile or hand to wgmma through shared memory with ordinary stores (the
// non-finite sanitising below, the sanitized copy of K in fused, which the consumers' cp.async makes in every kind)
// is generic-proxy traffic: fence.proxy.async and a barrier follow it before a wgmma reads it (and before a TMA
// overwrites the tile: in the ring, the writers' fence comes before their arrival on the stage's empty barrier,
// which the producer waits for before refilling it; in the two-buffer kernels the barrier ending each iteration).
//
// Shared memory (dynamic, aligned up to 1024 bytes of the shared window: the 128B swizzle is on the address), in
// TB = 64·D·2-byte tiles: dkdv: K and V of each consumer warpgroup, Q of each stage, dO of each stage (2·NWG +
// 2·BWD_STAGES TB with the TMA ring, 10 with two consumer warpgroups; 6 TB with cp.async's two buffers; fused adds K
// sanitized, per consumer warpgroup), LSE and Δ of slots 0 and 1 (1 KiB), the correction scratch (per consumer warp
// 16 × 64 f32 for Pᵀ and for dSᵀ: 32 KiB a warpgroup), the TMA kernels' 1 + 2·BWD_STAGES barriers (56 bytes;
// ops/attention.rs: bwd_dkdv_smem); dq: Q and dO of each consumer warpgroup, K and V of each stage (10 TB with the
// ring and two consumer warpgroups, 6 with cp.async), the scratch (per consumer warp 16 × 64 f32 for dS: 16 KiB a
// warpgroup), the TMA kernel's barriers (56 bytes; bwd_dq_smem). At D = 128: dkdv 225 KiB with the TMA ring and two
// consumer warpgroups (129 KiB with cp.async), fused 225 KiB with two stages (145), dq 192 KiB (112); at D = 64:
// 145 (81), 161 (89) and 112 (64) KiB; each + the barriers + the 1024 bytes of alignment slack the host adds. The
// largest, dkdv and fused at D = 128, are within the 227 KiB an sm_90 block may opt into, by 968 and 984 bytes (a
// compile-time check in ops/attention.rs); fused there with a third stage would take 257 KiB.
//
// fused: the non-deterministic variant (WgmmaBackward::Atomic, chosen explicitly only:
// CudaBackend::with_wgmma_backward; the trainer keeps the kernels above). dkdv's kernel body instantiated with
// ATOMIC: each visible tile pair also adds its dQ contribution, dS·K, to an f32 workspace, so S and dP are computed
// once per pair (5 products where dkdv and dq take 7). The additions are bulk reduce-adds (cp.reduce.async.bulk
// .add.f32, ptx_tma.cuh; FlashAttention-3's): each warp writes its 16 rows of a 64-column chunk to its Pᵀ scratch
// (free by then: the correction read it before) in the workspace's own order (bwd_dq_ws_offset: the accumulator
// fragment's, 4 KiB contiguous a warp, written without bank conflicts), fences them for the async proxy, and its
// lane 0 adds the 4 KiB with one instruction, waiting for the read before the scratch is used again. Each addition
// is atomic; their order varies from run to run on a GPU: dQ is not bit-reproducible (dK and dV are, as in dkdv).
// attn_bwd_dq_convert then writes dq = workspace·scale in its type (or adds it, GradMode::Accumulate), reading the
// workspace's order.
// dS (queries × keys, the A operand of dQ += dS·K) is dSᵀ's fragment transposed: every warp writes its dSᵀ rows to
// the correction scratch (f32), a barrier of both consumer warpgroups, and each thread reads its rows of dS as the A
// fragment. The product runs in chunks of 64 columns of D (a 32-float accumulator, added to the workspace after
// each), K read N-major, over the keys of the block's tiles the pair does not hide: chunk c of the loop's n-th pair
// is consumer warpgroup (c + n) % NWG's, which reads every tile's dSᵀ from the scratch (at D = 128 each warpgroup
// has a chunk, at D = 64 they take the pairs in turn). So each dQ element takes one addition a block (128 keys), as
// FlashAttention-2 and -3's backward, not one a key tile: half the reduction traffic of a warpgroup adding its own
// tile's 64 × D. When a K tile holds non-finite rows (k_bad), a sanitized copy of it serves the partial pairs'
// dQ products (as dq's sanitizing), each visible pair adding back, from global memory, what the zeroed elements
// contribute.
//
// ordered: the fused kernel with its dQ additions in a fixed order (WgmmaBackward::Ordered, chosen explicitly:
// CudaBackend::with_wgmma_backward; deterministic, 5 products a pair; FlashAttention-3's deterministic backward does
// the same with a semaphore per query tile). Each (batch, query head, query tile, chunk of 64 columns of D) has a
// turn flag in global memory (u32); a block adds its share of a chunk only when the flag holds its own index, and
// then hands the turn on. The order: the blocks take the key blocks from the last (order index o = blockIdx.x is
// key block nb − 1 − o, kt0 = (nb − 1 − o)·NWG), and each query tile's turns go in order index among the blocks that
// visit it (bwd_block_visits: the walk's test, bwd_next_pair's). So a block waits only for blocks of lower linear
// index, which the GPU dispatched before it (ptx.cuh's flags: progress), and under a causal mask, where key block kb
// reaches query tile qt after qt − kb pairs of its walk, the blocks reach each query tile in their turns' order:
// higher key blocks first, each before the next needs the turn. With no mask every block reaches query tile 0 at
// once and the k-th block of a head waits k turns there (then each stays that far behind the one before).
// Before the kernel, attn_bwd_dq_turns_w<NWG> finds each query tile's first and last visiting block (scans from
// either end; the first is where every flag of the tile starts, the last ends the chain). In the kernel, per pair and
// chunk, the owning warpgroup (the fused kernel's) computes its chunk of dQ (the wait comes after the products: the
// turn is often there by then; waiting before them, ptxas spilled 100 bytes at D = 128), then its thread 0 waits for
// the turn (flag_wait_eq(flag, blockIdx.x): ld.acquire.gpu), the warpgroup's barrier (bwd_warpgroup_sync: named
// barrier BWD_BAR_WG + g, 128 threads), each warp's bulk reduce-add as above, waited for until its additions are done
// (cp.async.bulk.wait_group 0, not only its read), __threadfence, the barrier again, and thread 0 stores the next
// visiting block's index (bwd_next_turn, found at once where the visiting blocks are consecutive; BWD_NO_TURN after the last)
// with st.release.gpu. Each dQ element is so the sum, in f32, of its key blocks' shares from the last key block down,
// the same bits every run; the cp.async kernel (64 keys a block) sums other shares than the TMA one (128).

// Non-finite values behind the mask: as attention_backward_tc.cu. On a partial tile pair whose tiles hold non-finite
// rows, the non-finite elements of the operand a hidden 0 multiplies are set to 0 in shared memory first (Q and dO in
// dkdv, K in dq), and each visible pair then adds back, from global memory, what those elements contribute.

// The tensor maps of the TMA-fed kernels (the header's Loads; null in the cp.async ones): the kernels' parameters.
struct BwdMaps {
    const CUtensorMap* q;
    const CUtensorMap* k;
    const CUtensorMap* v;
    const CUtensorMap* dout;
};

// Issues the TMA loads of rows [row0, row0 + 64) of head `head` (of batch·heads) of the tensor `m` into the tile at
// `t`, completing on `bar` (whose expected bytes the caller has announced): D/64 boxes, box c (elements 64c..64c+63
// of every row) at t + c·64·128, attention_wgmma.cuh's tile layout. One thread.
template <int D>
__device__ __forceinline__ void bwd_tma_tile(unsigned char* t, const CUtensorMap* m, u64* bar, u32 row0, u32 head) {
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
        tma_load_3d(t + c * (WG_BC * 128), m, bar, c * 64, static_cast<i32>(row0), static_cast<i32>(head));
}

// Issues the TMA loads of rows [row0, row0 + 64) of head `head` (of batch·heads) of the tensors `ma` and `mb`
// describe into the tiles at `a` and `b`, completing on `bar`, after announcing both tiles' bytes on it (rows past
// the head's length included: the TMA writes them as zeros and counts them). One thread.
template <int D>
__device__ __forceinline__ void bwd_tma_pair(unsigned char* a, const CUtensorMap* ma, unsigned char* b,
                                             const CUtensorMap* mb, u64* bar, u32 row0, u32 head) {
    mbarrier_arrive_expect_tx(bar, 2 * WG_BC * D * 2);
    bwd_tma_tile<D>(a, ma, bar, row0, head);
    bwd_tma_tile<D>(b, mb, bar, row0, head);
}

// The warp-specialised kernels (the TMA-fed ones; the header's Warps): the ring's depth, the register split of the
// producer and consumer warpgroups, and the consumers' named barrier (id 1: 0 is __syncthreads', which would wait
// for the producer) with its 128 threads. The host reads BWD_STAGES for the shared-memory sizes (ops/attention.rs).
#define BWD_STAGES 3
#define BWD_PRODUCER_REGS 32
#define BWD_CONSUMER_REGS_1 256
#define BWD_CONSUMER_REGS_2 240
#define BWD_BAR_CONSUMERS 1
// Consumer warpgroups of the TMA-fed dK/dV and fused kernels at each head dim (the header's Warps: two, 128 keys a
// block). The host reads them.
#define BWD_DKDV_WGS_D64 2
#define BWD_DKDV_WGS_D128 2
#define BWD_FUSED_WGS_D64 2
#define BWD_FUSED_WGS_D128 2
// The fused kernel's ring at each head dim: BWD_STAGES, but two stages at D = 128, where its two consumer warpgroups'
// K, V and sanitized K, three stages and the correction scratch would need 257 KiB of shared memory (the header's
// Shared memory). The host reads them.
#define BWD_FUSED_STAGES_D64 3
#define BWD_FUSED_STAGES_D128 2
// Consumer warpgroups of the TMA-fed dQ kernel, at both head dims: a query tile each, 128 queries a block, sharing
// every K/V stage. The host reads it.
#define BWD_DQ_WGS 2

// Whether a dK/dV block of key tiles kt0..kt0 + tiles − 1 visits query tile qt: the mask does not hide it for one of
// the block's tiles at least (the walk's test, bwd_next_pair's, and ORDERED's turns', bwd_block_visits').
__device__ __forceinline__ bool bwd_visits(const AttnProblem& p, u32 qt, u32 kt0, u32 tiles) {
    for (u32 t = 0; t < tiles; ++t)
        if (classify(p, qt, kt0 + t) != TILE_HIDDEN) return true;
    return false;
}

// The first (query head of the group, query tile) pair at or after x that the mask does not hide for every one of
// key tiles kt0..kt0 + tiles − 1, a dK/dV block's (pair x: head hk·group + x / q_tiles, tile x % q_tiles; `pairs`:
// none). Producer and consumers walk the same.
__device__ __forceinline__ u32 bwd_next_pair(const AttnProblem& p, u32 x, u32 pairs, u32 q_tiles, u32 kt0,
                                             u32 tiles) {
    while (x < pairs && !bwd_visits(p, x % q_tiles, kt0, tiles)) ++x;
    return x;
}

// Whether the key block of order index o (ORDERED's, the header's "ordered": key tiles (nb − 1 − o)·NWG.. of the
// nb = ⌈k_tiles / NWG⌉ blocks, fewer at the end of the keys) visits query tile qt.
template <u32 NWG>
__device__ __forceinline__ bool bwd_block_visits(const AttnProblem& p, u32 qt, u32 o) {
    const u32 k_tiles = (p.kv_len + WG_BC - 1) / WG_BC;
    const u32 kt0 = ((k_tiles + NWG - 1) / NWG - 1 - o) * NWG;
    return bwd_visits(p, qt, kt0, k_tiles - kt0 < NWG ? k_tiles - kt0 : NWG);
}

// The order index of the block after block o that visits query tile qt (the turn block o hands on), or BWD_NO_TURN
// when o is the last (`last`, attn_bwd_dq_turns'). Found at once where the visiting blocks are consecutive (causal,
// windows, documents in order); scanned past the others.
#define BWD_NO_TURN 0xffffffffu
template <u32 NWG>
__device__ __forceinline__ u32 bwd_next_turn(const AttnProblem& p, u32 qt, u32 o, u32 last) {
    if (o >= last) return BWD_NO_TURN;
    u32 n = o + 1;
    while (n < last && !bwd_block_visits<NWG>(p, qt, n)) ++n;
    return n;
}

// Two 64×64 products over the head dim, issued as one group and waited for: x = a·bᵀ and y = c·dᵀ, each operand a
// 64-row tile in shared memory read K-major (dkdv: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ; dq: S = Q·Kᵀ and dP = dO·Vᵀ).
template <int D, typename T>
__device__ __forceinline__ void bwd_score_pair(float (&x)[32], float (&y)[32], const unsigned char* a,
                                               const unsigned char* b, const unsigned char* c, const unsigned char* d) {
#pragma unroll
    for (u32 i = 0; i < 32; ++i) x[i] = y[i] = 0.0f;
    wgmma_fence();
#pragma unroll
    for (u32 ks = 0; ks < D / 16; ++ks) {
        wg_mma_qk<T, WG_BC>(x, wg_desc_kmajor<WG_BC>(a, ks), wg_desc_kmajor<WG_BC>(b, ks), ks > 0);
        wg_mma_qk<T, WG_BC>(y, wg_desc_kmajor<WG_BC>(c, ks), wg_desc_kmajor<WG_BC>(d, ks), ks > 0);
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();
}

// bwd_score_pair with the A operands in registers (dq: Q's and dO's fragments, wg_load_a_frags, kept for the block):
// x = a·bᵀ and y = c·dᵀ, b and d 64-row tiles in shared memory read K-major. With both operands in shared memory a
// 64×64 product reads as many bytes a cycle as the SM's shared memory delivers at the tensor cores' rate (the
// forward's header); with A in registers, half.
template <int D, typename T>
__device__ __forceinline__ void bwd_score_pair_rs(float (&x)[32], float (&y)[32], const u32 (&a)[D / 16][4],
                                                  const unsigned char* b, const u32 (&c)[D / 16][4],
                                                  const unsigned char* d) {
#pragma unroll
    for (u32 i = 0; i < 32; ++i) x[i] = y[i] = 0.0f;
    wgmma_fence();
#pragma unroll
    for (u32 ks = 0; ks < D / 16; ++ks) {
        wg_mma_qk_rs<T>(x, a[ks], wg_desc_kmajor<WG_BC>(b, ks), ks > 0);
        wg_mma_qk_rs<T>(y, c[ks], wg_desc_kmajor<WG_BC>(d, ks), ks > 0);
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();
}

// The start of a kernel's roles (the header's Warps), with NWG consumer warpgroups. With the TMA: thread 0
// initialises the barriers (bars[0], the kept tiles, 1 arrival; full[st] = bars[1 + st], 1 arrival; empty[st] =
// bars[1 + S + st], one per consumer thread, 128·NWG), then after the block's only __syncthreads the producer
// warpgroup lowers its registers, its thread 0 runs `produce` (every copy), and all 128 leave (false); the consumer
// warpgroups raise theirs (true). Without the TMA every thread is a consumer and nothing happens here.
template <bool TMA, u32 S, u32 NWG, typename Produce>
__device__ __forceinline__ bool bwd_roles(u64* bars, Produce produce) {
    if constexpr (TMA) {
        if (threadIdx.x == 0) {
            mbarrier_init(&bars[0], 1);
            for (u32 st = 0; st < S; ++st) {
                mbarrier_init(&bars[1 + st], 1);
                mbarrier_init(&bars[1 + S + st], 128 * NWG);
            }
            mbarrier_fence_init();
        }
        __syncthreads();  // the last barrier of the whole block: the producer leaves after it
        if (threadIdx.x < 128) {
            setmaxnreg_dec<BWD_PRODUCER_REGS>();
            if (threadIdx.x == 0) produce();
            return false;
        }
        setmaxnreg_inc<(NWG == 1 ? BWD_CONSUMER_REGS_1 : BWD_CONSUMER_REGS_2)>();
    }
    return true;
}

// The consumers' barrier in the kernel bodies: named barrier BWD_BAR_CONSUMERS of the NWG consumer warpgroups'
// 128·NWG threads in the TMA kernels (the producer warpgroup has left or waits on an "empty" barrier: __syncthreads
// would deadlock); __syncthreads in the cp.async ones, whose 128 threads are all consumers.
template <bool TMA, u32 NWG = 1>
__device__ __forceinline__ void bwd_consumer_sync() {
    if constexpr (TMA)
        named_barrier_sync(BWD_BAR_CONSUMERS, 128 * NWG);
    else
        __syncthreads();
}

// One consumer warpgroup's barrier (g's): named barrier BWD_BAR_WG + g (ids 2 and 3) of its 128 threads with two
// consumer warpgroups; otherwise the consumers' (the one warpgroup's). Each id a constant: with the id in a register
// ptxas reserves all 16 barriers and, in the ordered kernel at D = 128, spilled a register.
#define BWD_BAR_WG 2
template <bool TMA, u32 NWG>
__device__ __forceinline__ void bwd_warpgroup_sync(u32 g) {
    if constexpr (NWG == 2) {
        if (g == 0)
            named_barrier_sync(BWD_BAR_WG, 128);
        else
            named_barrier_sync(BWD_BAR_WG + 1, 128);
    } else {
        bwd_consumer_sync<TMA, NWG>();
    }
}

// The dK/dV producer (thread 0 of warpgroup 0 in the TMA-fed dkdv and fused kernels), for the block's `tiles` key
// tiles from kt0 (NWG, fewer at the end of the keys): nothing when the mask hides every pair; else their K and V
// once on kvbar (tile g's at smem + g·TB and smem + (NWG + g)·TB), then the visible pairs' Q and dO in the
// consumers' order, the n-th into stage n % STAGES (the ring's depth: BWD_STAGES, or the fused kernel's
// BWD_FUSED_STAGES_D<D>) once the consumers have released it (its empty barrier's phase before the (n / STAGES)-th:
// the first use of a stage passes at once). Runs up to STAGES pairs ahead of the pair the consumers compute.
template <int D, u32 NWG, u32 STAGES>
__device__ __forceinline__ void bwd_dkdv_produce(const AttnProblem& p, BwdMaps maps, unsigned char* smem, u64* kvbar,
                                                 u64* full, u64* empty, u32 kt0, u32 tiles, u32 hk, u32 b) {
    constexpr u32 TB = WG_BC * D * 2;
    const u32 group = p.q_heads / p.kv_heads;
    const u32 q_tiles = (p.q_len + WG_BC - 1) / WG_BC;
    const u32 pairs = group * q_tiles;
    u32 x = bwd_next_pair(p, 0, pairs, q_tiles, kt0, tiles);
    if (x >= pairs) return;  // every pair hidden: nothing to load
    mbarrier_arrive_expect_tx(kvbar, tiles * 2 * TB);
    for (u32 g = 0; g < tiles; ++g) {
        bwd_tma_tile<D>(smem + g * TB, maps.k, kvbar, (kt0 + g) * WG_BC, b * p.kv_heads + hk);
        bwd_tma_tile<D>(smem + (NWG + g) * TB, maps.v, kvbar, (kt0 + g) * WG_BC, b * p.kv_heads + hk);
    }
    unsigned char* qs = smem + 2 * NWG * TB;  // stage st's Q at qs + st·TB, its dO at qs + (STAGES + st)·TB
    for (u32 n = 0; x < pairs; ++n, x = bwd_next_pair(p, x + 1, pairs, q_tiles, kt0, tiles)) {
        const u32 st = n % STAGES, use = n / STAGES;
        mbarrier_wait(&empty[st], (use & 1u) ^ 1u);
        bwd_tma_pair<D>(qs + st * TB, maps.q, qs + (STAGES + st) * TB, maps.dout, &full[st],
                        (x % q_tiles) * WG_BC, b * p.q_heads + hk * group + x / q_tiles);
    }
}

// The f32 dQ workspace of the one-kernel variants, in the order their warps add to it: for each (batch·query head bh,
// query tile qt, 64 columns c of D), 4 warps × 1024 floats, warp w's holding rows 16w..16w+15 of the tile as its
// accumulator fragment lies, word (n·2 + hf)·64 + lane·2 + e holding the fragment's element 4n + 2hf + e (row gid +
// 8hf, column 8n + 2tig + e): each 4 KiB contiguous, so a warp adds its share with one bulk reduce-add, written to
// shared memory without bank conflicts. Rows past the queries are there too (attn_bwd_dq_convert skips them). The
// offset of warp w's 1024 floats:
template <int D>
__device__ __forceinline__ u64 bwd_dq_ws_offset(u32 bh, u32 q_tiles, u32 qt, u32 c, u32 w) {
    return ((((u64)bh * q_tiles + qt) * (D / 64) + c) * 4 + w) * 1024;
}

// dkdv, and with ATOMIC the non-deterministic variant's fused kernel (the header's "fused"): one body, so that the
// two cannot drift apart; ATOMIC adds the sanitized copy of K, the dSᵀ scratch written every pair, and dQ's atomics.
// With TMA the block is the producer warpgroup and NWG consumer warpgroups, each with a key tile of its own (the
// header's Warps); without, one warpgroup that loads and computes (NWG = 1).
template <int D, typename T, typename G, bool ATOMIC, bool TMA, u32 NWG, u32 STAGES = BWD_STAGES, bool ORDERED = false>
__device__ __forceinline__ void attn_bwd_wgmma_dkdv(const AttnProblem& p, BwdMaps maps, G* __restrict__ dk,
                                                    G* __restrict__ dv,
                                                    float* __restrict__ dq_ws, const T* __restrict__ q,
                                                    const T* __restrict__ k, const T* __restrict__ v,
                                                    const T* __restrict__ dout, const float* __restrict__ lse,
                                                    const float* __restrict__ delta,
                                                    const unsigned long long* __restrict__ q_bad,
                                                    const unsigned long long* __restrict__ do_bad,
                                                    const unsigned long long* __restrict__ k_bad, int accumulate,
                                                    u32* __restrict__ dq_turn = nullptr,
                                                    const u32* __restrict__ dq_last = nullptr) {
    static_assert(NWG == 1 || (TMA && NWG == 2), "two consumer warpgroups need the producer's TMA loads");
    static_assert(ATOMIC || !ORDERED, "the ordered dQ additions are the fused kernel's");
    unsigned char* smem = wg_smem();
    constexpr u32 TB = WG_BC * D * 2;
    constexpr u32 NC = 128 * NWG;  // consumer threads
    // Stages of Q and dO: the TMA ring's STAGES, cp.async's two buffers.
    constexpr u32 S = TMA ? STAGES : 2;
    // Consumer warpgroup g's K at smem + g·TB, its V at smem + (NWG + g)·TB; Q's stage st at smem + (2·NWG + st)·TB,
    // dO's at smem + (2·NWG + S + st)·TB; with ATOMIC, g's K sanitized at (2·NWG + 2S + g)·TB. Then the LSE (base 2)
    // and Δ of slot c (the n-th pair's in slot n % 2, whatever the stages) at lsd + 128c and lsd + 128c + 64
    // (computed: an array indexed at run time would live in local memory).
    unsigned char* qs0 = smem + 2 * NWG * TB;
    float* lsd = reinterpret_cast<float*>(smem + (2 * NWG + 2 * S + (ATOMIC ? NWG : 0)) * TB);
    float* scr = lsd + 4 * WG_BC;  // [4·NWG warps][2][16][64]: Pᵀ (for the correction) and dSᵀ (correction; dQ)
    // TMA: [0] K and V landed; full[st] = bars[1 + st]: stage st's Q and dO landed; empty[st] = bars[1 + S + st]:
    // every consumer thread is done with stage st.
    u64* bars = reinterpret_cast<u64*>(scr + NWG * 4 * 2 * 16 * 64);
    u64* full = bars + 1;
    u64* empty = bars + 1 + S;

    const u32 hk = blockIdx.y, b = blockIdx.z;
    const u32 k_tiles = (p.kv_len + WG_BC - 1) / WG_BC;
    // The block's first key tile: ORDERED walks the key blocks from the last (the header's "ordered").
    const u32 kt0 = (ORDERED ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * NWG;
    const u32 tiles = k_tiles - kt0 < NWG ? k_tiles - kt0 : NWG;  // its key tiles (fewer at the end of the keys)
    if (!bwd_roles<TMA, S, NWG>(bars, [&] {
            bwd_dkdv_produce<D, NWG, S>(p, maps, smem, &bars[0], full, empty, kt0, tiles, hk, b);
        }))
        return;
    // The consumers (every thread without TMA): thread ct of 128·NWG; warpgroup g = ct / 128 computes key tile kt0 + g
    // (none when g ≥ tiles: it keeps the barriers' counts and writes nothing), its warp w rows 16w..16w+15 of it.
    // (With one, written so that nothing is left to compute: ct < 128 and the block's one tile is within the keys.)
    const u32 ct = TMA ? threadIdx.x - 128 : threadIdx.x;
    const u32 g = NWG == 1 ? 0 : ct >> 7;
    const u32 lane = ct & 31, warp = NWG == 1 ? ct >> 5 : (ct >> 5) & 3;
    const u32 gid = lane >> 2, tig = lane & 3;
    const u32 kt = kt0 + g;
    const bool own = NWG == 1 || g < tiles;
    unsigned char* ks_ = smem + g * TB;
    unsigned char* vs_ = smem + (NWG + g) * TB;
    unsigned char* kc_ = smem + (2 * NWG + 2 * S + g) * TB;
    const u32 group = p.q_heads / p.kv_heads;
    const u64 k_head = ((u64)b * p.kv_heads + hk) * p.kv_len;
    const u32 q_tiles = (p.q_len + WG_BC - 1) / WG_BC;
    const u32 j_lo = kt * WG_BC + warp * 16 + gid;  // this thread's keys: j_lo and j_lo + 8
    const float scale2 = p.scale * 1.4426950408889634f;
    // Key tile t's non-finite rows (ATOMIC only; read again where needed, so that no register holds them through the
    // loop).
    auto kbad = [&](u32 t) {
        return (ATOMIC && k_bad && t < k_tiles) ? k_bad[((u64)b * p.kv_heads + hk) * k_tiles + t] : 0ull;
    };

    if (!TMA) {
        wg_load_tile<D, WG_BC, T>(ks_, k + k_head * D, kt * WG_BC, p.kv_len, threadIdx.x, blockDim.x);
        wg_load_tile<D, WG_BC, T>(vs_, v + k_head * D, kt * WG_BC, p.kv_len, threadIdx.x, blockDim.x);
    }
    bool any_kbad = false;
#pragma unroll
    for (u32 t = 0; t < NWG; ++t) any_kbad |= kbad(kt0 + t) != 0;
    if (ATOMIC && any_kbad) {
        // The sanitized copy of each K tile with non-finite rows for dQ's products, made before the loop by its
        // warpgroup's cp.async whatever feeds the other tiles (its copies waited for at once: only tiles with a
        // non-finite K row pay for it); the barriers are every consumer's.
        const u32 wct = ct & 127;
        if (kbad(kt)) wg_load_tile<D, WG_BC, T>(kc_, k + k_head * D, kt * WG_BC, p.kv_len, wct, 128);
        cp_async_wait_all();
        bwd_consumer_sync<TMA, NWG>();
        if (kbad(kt)) wg_sanitize<D, T>(kc_, kbad(kt), wct, 128);
        wgmma_fence_proxy_async();
        bwd_consumer_sync<TMA, NWG>();
    }
    if (!TMA) cp_async_commit();  // K and V's copies (waited for with the first pair's)

    float dka[D / 2], dva[D / 2];
#pragma unroll
    for (u32 i = 0; i < D / 2; ++i) dka[i] = dva[i] = 0.0f;

    // The (query head of the group, query tile) pairs the mask does not hide for every tile of the block, in order
    // (the producer's walk).
    const u32 pairs = group * q_tiles;
    // The share of pair x's LSE and Δ of consumer thread ct < 128 (the LSE of row ct for ct < 64, else the Δ of row
    // ct − 64; LSE in base 2, for P = 2^(S·scale·log2 e − LSE·log2 e) by one ex2.approx), stored at slot + ct.
    auto stat = [&](u32 x) {
        const u32 i = (x % q_tiles) * WG_BC + (ct & (WG_BC - 1));
        const u64 qh = (u64)(b * p.q_heads + hk * group + x / q_tiles) * p.q_len;
        if (i >= p.q_len || (NWG > 1 && ct >= 2 * WG_BC)) return 0.0f;
        return ct < WG_BC ? lse[qh + i] * 1.4426950408889634f : delta[qh + i];
    };
    // cp.async only: every thread's share of pair x's Q and dO into buffer c.
    auto load_pair = [&](u32 x, u32 c) {
        const u32 i0 = (x % q_tiles) * WG_BC;
        const u64 qh = (u64)(b * p.q_heads + hk * group + x / q_tiles) * p.q_len;
        wg_load_tile<D, WG_BC, T>(qs0 + c * TB, q + qh * D, i0, p.q_len, threadIdx.x, blockDim.x);
        wg_load_tile<D, WG_BC, T>(qs0 + (S + c) * TB, dout + qh * D, i0, p.q_len, threadIdx.x, blockDim.x);
    };
    u32 x = bwd_next_pair(p, 0, pairs, q_tiles, kt0, tiles);
    if (x < pairs) {
        if (NWG == 1 || ct < 2 * WG_BC) lsd[ct] = stat(x);  // slot 0, published by the first iteration's barrier
        if (!TMA) load_pair(x, 0);
        if (TMA) mbarrier_wait(&bars[0], 0);  // K and V (loaded only when a pair is visible)
    }
    if (!TMA) cp_async_commit();
    for (u32 n = 0; x < pairs; ++n) {
        // Pair x is the loop's n-th: in stage stg = n % S (that stage's (n / S)-th fill), its LSE and Δ in slot n % 2.
        const u32 stg = n % S;
        const u32 xn = bwd_next_pair(p, x + 1, pairs, q_tiles, kt0, tiles);
        // The next pair's LSE or Δ, loaded now and stored after the barrier below (its latency under the wait).
        const float stat_next = xn < pairs ? stat(xn) : 0.0f;
        if (TMA) {
            // The TMA wrote through the async proxy, which wgmma reads: no proxy fence.
            mbarrier_wait(&full[stg], (n / S) & 1u);
        } else {
            // The next pair's loads go into the other buffer (every thread is done with it: the barrier ending the
            // iteration before). K and V (the first time), this pair's Q and dO: cp.async wrote them through the
            // generic proxy, so a proxy fence (and the barrier below) before wgmma reads them.
            if (xn < pairs) load_pair(xn, stg ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
            wgmma_fence_proxy_async();
        }
        // This pair's LSE and Δ (slot n % 2), written by every consumer thread before it (with cp.async, its tiles
        // too); and every consumer is past the iteration before: its reads of slot (n + 1) % 2 and of the scratch
        // are done.
        bwd_consumer_sync<TMA, NWG>();
        if (xn < pairs && (NWG == 1 || ct < 2 * WG_BC)) lsd[((n + 1) & 1u) * 2 * WG_BC + ct] = stat_next;
        {
            const u32 qt = x % q_tiles;
            const u32 h = hk * group + x / q_tiles;
            const u64 q_head = ((u64)b * p.q_heads + h) * p.q_len;
            const T* qg = q + q_head * D;
            const T* dog = dout + q_head * D;
            // Each of the block's tiles against the pair (key tile kt0 + t's class in bits 2t..2t + 1 of classes;
            // hidden where the block has none: one register, where an array of them left ptxas a register short in
            // the ordered kernel at D = 128), this warpgroup's (cls; hidden: it computes nothing, and only keeps the
            // barriers), and whether any is partial (the sanitising of the shared Q and dO tiles is everyone's).
            // (With one warpgroup the walk visits no pair its tile hides.)
            u32 classes = 0;
#pragma unroll
            for (u32 t = 0; t < NWG; ++t)
                classes |= static_cast<u32>(t < tiles ? classify(p, qt, kt0 + t) : TILE_HIDDEN) << (2 * t);
            auto class_of = [&](u32 t) { return static_cast<int>((classes >> (2 * t)) & 3u); };
            const int cls = class_of(g);
            bool partial = false;
#pragma unroll
            for (u32 t = 0; t < NWG; ++t) partial |= class_of(t) == TILE_PARTIAL;
            const bool mine = NWG == 1 || cls != TILE_HIDDEN;
            const u32 i0 = qt * WG_BC;
            unsigned char* qs = qs0 + stg * TB;
            unsigned char* dos = qs0 + (S + stg) * TB;
            const float* ls = lsd + (n & 1u) * 2 * WG_BC;
            const float* dls = ls + WG_BC;
            const bool masked = cls == TILE_PARTIAL || i0 + WG_BC > p.q_len || (kt + 1) * WG_BC > p.kv_len;
            unsigned long long qb = 0, db = 0;
            if (partial && q_bad) {
                qb = q_bad[((u64)b * p.q_heads + h) * q_tiles + qt];
                db = do_bad[((u64)b * p.q_heads + h) * q_tiles + qt];
                if (qb | db) {
                    wg_sanitize<D, T>(qs, qb, ct, NC);
                    wg_sanitize<D, T>(dos, db, ct, NC);
                    wgmma_fence_proxy_async();
                    bwd_consumer_sync<TMA, NWG>();
                }
            }
            // This warp's Pᵀ and dSᵀ scratch (16 × 64 each; warpgroup g's four warps at scr + g·8192).
            float* ps = scr + (g * 4 + warp) * 2 * 16 * 64;
            float* ss = ps + 16 * 64;
            if (mine) {
                // The pair's hidden elements of this thread (wg_hidden_bits: 32 of them), worked out before the
                // products while only dK and dV's accumulators are live.
                const u32 hid = masked ? static_cast<u32>(wg_hidden_bits<WG_BC, true>(p, j_lo, i0, tig)) : 0u;
                // Sᵀ and dPᵀ: 64 keys × 64 queries; st[4n + e]: key j_lo + 8·(e / 2), query i0 + 8n + 2·tig + (e % 2).
                float st[32], dpt[32];
                bwd_score_pair<D, T>(st, dpt, ks_, qs, vs_, dos);
                // Pᵀ and dSᵀ.
#pragma unroll
                for (u32 n = 0; n < 8; ++n) {
#pragma unroll
                    for (u32 e = 0; e < 4; ++e) {
                        u32 il = n * 8 + 2 * tig + (e & 1);
                        bool hidden = (hid >> (4 * n + e)) & 1u;
                        float pv = hidden ? 0.0f : ex2_approx(st[4 * n + e] * scale2 - ls[il]);
                        float dsv = hidden ? 0.0f : pv * (dpt[4 * n + e] - dls[il]);
                        st[4 * n + e] = pv;
                        dpt[4 * n + e] = dsv;
                    }
                }
                // This warp's Pᵀ and dSᵀ go to shared memory for the correction (so that no register array is
                // indexed at run time) and, with ATOMIC, dSᵀ always (dQ's A operand, transposed). Both variants write
                // them before the products, so that the fragments are dead during them (kept live through the
                // products for the rare correction, they left the warp-specialised dkdv kernel at ptxas's cap with a
                // spill; and ptxas then had to insert a warpgroup.arrive to let the wgmmas use their registers).
                auto keep_fragments = [&](bool p_too) {
#pragma unroll
                    for (u32 n = 0; n < 8; ++n)
#pragma unroll
                        for (u32 e = 0; e < 4; ++e) {
                            u32 at = (gid + 8 * (e >> 1)) * 64 + n * 8 + 2 * tig + (e & 1);
                            if (p_too) ps[at] = st[4 * n + e];
                            ss[at] = dpt[4 * n + e];
                        }
                };
                if (ATOMIC)
                    keep_fragments((qb | db) != 0);
                else if (qb | db)
                    keep_fragments(true);
                // dV += Pᵀ·dO and dK += dSᵀ·Q over the tile's 64 queries (4 k-steps of 16).
                u32 pa[4][4], sa[4][4];
#pragma unroll
                for (u32 t = 0; t < 4; ++t) {
#pragma unroll
                    for (u32 r = 0; r < 4; ++r) {
                        pa[t][r] = pack2<T>(st[8 * t + 2 * r], st[8 * t + 2 * r + 1]);
                        sa[t][r] = pack2<T>(dpt[8 * t + 2 * r], dpt[8 * t + 2 * r + 1]);
                    }
                }
                wgmma_fence();
#pragma unroll
                for (u32 t = 0; t < 4; ++t) {
                    wg_mma_pv<T, D>(dva, pa[t], wg_desc_nmajor(dos, t));
                    wg_mma_pv<T, D>(dka, sa[t], wg_desc_nmajor(qs, t));
                }
                wgmma_commit_group();
                wgmma_wait_group<0>();
            }
            // Every wgmma of this thread reading this stage has been waited for (the dQ products read K): release it
            // to the producer.
            if (TMA) mbarrier_arrive(&empty[stg]);
            if (mine && (qb | db)) {
                // Add back what the zeroed elements contribute to visible pairs (see the header).
                __syncwarp();
                for (u32 il = 0; il < WG_BC; ++il) {
                    bool qf = (qb >> il) & 1ull, df = (db >> il) & 1ull;
                    if (!(qf || df)) continue;
                    u32 i = i0 + il;
#pragma unroll
                    for (u32 hf = 0; hf < 2; ++hf) {
                        float pv = ps[(gid + 8 * hf) * 64 + il];
                        float dsv = ss[(gid + 8 * hf) * 64 + il];
                        u32 j = j_lo + 8 * hf;
                        bool seen = i < p.q_len && j < p.kv_len && visible(p, i, j);
#pragma unroll
                        for (u32 n = 0; n < D / 8; ++n) {
#pragma unroll
                            for (u32 e = 0; e < 2; ++e) {
                                u32 d = n * 8 + 2 * tig + e;
                                float qx = seen ? to_f32(qg[(u64)i * D + d]) : 0.0f;
                                float dx = seen ? to_f32(dog[(u64)i * D + d]) : 0.0f;
                                if (seen && qf && !isfinite(qx)) dka[4 * n + 2 * hf + e] += dsv * qx;
                                if (seen && df && !isfinite(dx)) dva[4 * n + 2 * hf + e] += pv * dx;
                            }
                        }
                    }
                }
                __syncwarp();
            }
            if (ATOMIC) {
                bwd_consumer_sync<TMA, NWG>();  // every warp's dSᵀ is in the scratch
                // dQ += dS·K over the block's keys (every tile the pair does not hide), by chunks of 64 columns of D:
                // chunk c of the loop's n-th pair is warpgroup (c + n) % NWG's (at D = 128 a chunk each, at D = 64
                // the pairs alternate), so that each dQ element takes one addition a block, not one a key tile.
                // This thread's rows of dS (queries il = 16·warp + gid + 8·(r % 2)), keys 16s + 8·(r / 2) + 2·tig and
                // the next of tile t, are read from tile t's warps' dSᵀ rows (key jl at sg[(jl / 16)·2048 + 1024 +
                // (jl % 16)·64 + il]).
#pragma unroll
                for (u32 c = 0; c < D / 64; ++c) {
                    if ((c + n) % NWG != g) continue;
                    float dqc[32];
#pragma unroll
                    for (u32 i = 0; i < 32; ++i) dqc[i] = 0.0f;
                    bool added = false;
#pragma unroll
                    for (u32 t = 0; t < NWG; ++t) {
                        const int cls_t = class_of(t);
                        if (cls_t == TILE_HIDDEN) continue;
                        const float* sg = scr + t * 4 * 2048;
                        u32 sa[4][4];
#pragma unroll
                        for (u32 s4 = 0; s4 < 4; ++s4) {
#pragma unroll
                            for (u32 r = 0; r < 4; ++r) {
                                u32 il = warp * 16 + gid + 8 * (r & 1);
                                u32 jl = 16 * s4 + 8 * (r >> 1) + 2 * tig;
                                const float* col = sg + (jl >> 4) * 2048 + 1024 + (jl & 15) * 64 + il;
                                sa[s4][r] = pack2<T>(col[0], col[64]);
                            }
                        }
                        // Tile t's K, or its sanitized copy where the pair is partial and K has non-finite rows.
                        const unsigned long long kb = cls_t == TILE_PARTIAL ? kbad(kt0 + t) : 0ull;
                        const unsigned char* kq = smem + (kb ? 2 * NWG + 2 * S + t : t) * TB;
                        wgmma_fence();
#pragma unroll
                        for (u32 s4 = 0; s4 < 4; ++s4)
                            wg_mma_pv<T, 64>(dqc, sa[s4], wg_desc_nmajor(kq + c * WG_BC * 128, s4));
                        wgmma_commit_group();
                        wgmma_wait_group<0>();
                        added = true;
                        for (u32 jl = 0; kb && jl < WG_BC; ++jl) {
                            if (!((kb >> jl) & 1ull)) continue;
                            u32 j = (kt0 + t) * WG_BC + jl;
#pragma unroll
                            for (u32 hf = 0; hf < 2; ++hf) {
                                u32 il = warp * 16 + gid + 8 * hf;
                                float dsv = sg[(jl >> 4) * 2048 + 1024 + (jl & 15) * 64 + il];
                                u32 i = i0 + il;
                                bool seen = i < p.q_len && j < p.kv_len && visible(p, i, j);
#pragma unroll
                                for (u32 nn = 0; nn < 8; ++nn) {
#pragma unroll
                                    for (u32 e = 0; e < 2; ++e) {
                                        float kx = seen ? to_f32(k[(k_head + j) * D + c * 64 + nn * 8 + 2 * tig + e])
                                                        : 0.0f;
                                        if (seen && !isfinite(kx)) dqc[4 * nn + 2 * hf + e] += dsv * kx;
                                    }
                                }
                            }
                        }
                    }
                    if (!ORDERED && !added) continue;
                    // ORDERED: the chunk's turn (the header's "ordered"): its flag holds this block's index once
                    // every block before it in the order has added its share. (The flag's address is worked out where
                    // it is used.)
                    auto turn = [&] { return dq_turn + ((u64)(b * p.q_heads + h) * q_tiles + qt) * (D / 64) + c; };
                    if (ORDERED) {
                        if ((ct & 127) == 0) flag_wait_eq(turn(), blockIdx.x);
                        bwd_warpgroup_sync<TMA, NWG>(g);
                    }
                    if (added) {
                        // The warp's 16 rows of the chunk go to its Pᵀ scratch (free here: the correction read it
                        // before) in the workspace's order (bwd_dq_ws_offset), then one bulk reduce-add of its 4 KiB.
#pragma unroll
                        for (u32 nn = 0; nn < 8; ++nn)
#pragma unroll
                            for (u32 hf = 0; hf < 2; ++hf)
#pragma unroll
                                for (u32 e = 0; e < 2; ++e)
                                    ps[(nn * 2 + hf) * 64 + lane * 2 + e] = dqc[4 * nn + 2 * hf + e];
                        tma_fence_proxy_async();
                        __syncwarp();
                        if (lane == 0) {
                            bulk_reduce_add_f32(dq_ws + bwd_dq_ws_offset<D>(b * p.q_heads + h, q_tiles, qt, c, warp),
                                                ps, 16 * 64 * 4);
                            tma_store_commit();
                            // ORDERED: the additions done before the turn passes on; else the scratch free again.
                            if (ORDERED)
                                tma_store_wait<0>();
                            else
                                tma_store_wait_read<0>();
                        }
                        __syncwarp();
                    }
                    if (ORDERED) {
                        // Every warp's additions reach the device's memory before the turn passes on.
                        __threadfence();
                        bwd_warpgroup_sync<TMA, NWG>(g);
                        if ((ct & 127) == 0)
                            flag_release(turn(), bwd_next_turn<NWG>(p, qt, blockIdx.x, dq_last[qt]));
                    }
                }
            }
        }
        // cp.async: every thread is done with this buffer before the next iteration's loads into it. (The TMA ring
        // needs no such barrier: the empty barrier releases the stage, and the next iteration's barrier orders the
        // LSE/Δ slot and the scratch.)
        if (!TMA) __syncthreads();
        x = xn;
    }
    if (!TMA) cp_async_wait_all();

#pragma unroll
    for (u32 hf = 0; hf < 2; ++hf) {
        u32 j = j_lo + 8 * hf;
        if (!own || j >= p.kv_len) continue;
#pragma unroll
        for (u32 n = 0; n < D / 8; ++n) {
#pragma unroll
            for (u32 e = 0; e < 2; ++e) {
                u64 at = (k_head + j) * D + n * 8 + 2 * tig + e;
                store_grad(dk + at, dka[4 * n + 2 * hf + e] * p.scale, accumulate != 0);
                store_grad(dv + at, dva[4 * n + 2 * hf + e], accumulate != 0);
            }
        }
    }
}

// The first key tile at or after kt that the mask does not hide for one of query tiles qt0..qt0 + tiles − 1, a dQ
// block's (k_tiles: none). Producer and consumers walk the same.
__device__ __forceinline__ u32 bwd_next_key_tile(const AttnProblem& p, u32 qt0, u32 tiles, u32 kt, u32 k_tiles) {
    for (; kt < k_tiles; ++kt)
        for (u32 t = 0; t < tiles; ++t)
            if (classify(p, qt0 + t, kt) != TILE_HIDDEN) return kt;
    return kt;
}

// The dQ producer (thread 0 of warpgroup 0 in the TMA kernel), for the block's `tiles` query tiles from qt0 (NWG,
// fewer at the end of the queries): nothing when the mask hides every key tile from all of them; else their Q and
// dO once on qbar (tile g's at smem + g·TB and smem + (NWG + g)·TB), then the key tiles that one of them sees, in
// the consumers' order (bwd_next_key_tile), K and V of the n-th into stage n % BWD_STAGES once the consumers have
// released it (as bwd_dkdv_produce).
template <int D, u32 NWG>
__device__ __forceinline__ void bwd_dq_produce(const AttnProblem& p, BwdMaps maps, unsigned char* smem, u64* qbar,
                                               u64* full, u64* empty, u32 qt0, u32 tiles, u32 h, u32 b) {
    constexpr u32 TB = WG_BC * D * 2;
    const u32 k_tiles = (p.kv_len + WG_BC - 1) / WG_BC;
    const u32 kv_head = b * p.kv_heads + h / (p.q_heads / p.kv_heads);
    u32 kt = bwd_next_key_tile(p, qt0, tiles, 0, k_tiles);
    if (kt >= k_tiles) return;  // every key tile hidden: nothing to load
    mbarrier_arrive_expect_tx(qbar, tiles * 2 * TB);
    for (u32 g = 0; g < tiles; ++g) {
        bwd_tma_tile<D>(smem + g * TB, maps.q, qbar, (qt0 + g) * WG_BC, b * p.q_heads + h);
        bwd_tma_tile<D>(smem + (NWG + g) * TB, maps.dout, qbar, (qt0 + g) * WG_BC, b * p.q_heads + h);
    }
    unsigned char* ks = smem + 2 * NWG * TB;  // stage st's K at ks + st·TB, its V at ks + (BWD_STAGES + st)·TB
    for (u32 n = 0; kt < k_tiles; ++n, kt = bwd_next_key_tile(p, qt0, tiles, kt + 1, k_tiles)) {
        const u32 st = n % BWD_STAGES, use = n / BWD_STAGES;
        mbarrier_wait(&empty[st], (use & 1u) ^ 1u);
        bwd_tma_pair<D>(ks + st * TB, maps.k, ks + (BWD_STAGES + st) * TB, maps.v, &full[st], kt * WG_BC, kv_head);
    }
}

// dq: with TMA the block is the producer warpgroup and NWG consumer warpgroups, each with a query tile of its own
// (the header's Warps); without, one warpgroup that loads and computes (NWG = 1).
template <int D, typename T, typename G, bool TMA, u32 NWG>
__device__ __forceinline__ void attn_bwd_wgmma_dq(const AttnProblem& p, BwdMaps maps, G* __restrict__ dq,
                                                  const T* __restrict__ q,
                                                  const T* __restrict__ k, const T* __restrict__ v,
                                                  const T* __restrict__ dout, const float* __restrict__ lse,
                                                  const float* __restrict__ delta,
                                                  const unsigned long long* __restrict__ k_bad, int accumulate) {
    static_assert(NWG == 1 || (TMA && NWG == 2), "two consumer warpgroups need the producer's TMA loads");
    unsigned char* smem = wg_smem();
    constexpr u32 TB = WG_BC * D * 2;
    constexpr u32 NC = 128 * NWG;  // consumer threads
    // Stages of K and V: the TMA ring's BWD_STAGES, cp.async's two buffers.
    constexpr u32 S = TMA ? BWD_STAGES : 2;
    // Consumer warpgroup g's Q at smem + g·TB, its dO at smem + (NWG + g)·TB; K's stage st at smem + (2·NWG + st)·TB,
    // V's at smem + (2·NWG + S + st)·TB (computed: an array indexed at run time would live in local memory).
    unsigned char* ks0 = smem + 2 * NWG * TB;
    float* scr = reinterpret_cast<float*>(smem + (2 * NWG + 2 * S) * TB);  // [4·NWG warps][16][64]: dS (correction)
    // TMA: [0] Q and dO landed; full[st] = bars[1 + st]: stage st's K and V landed; empty[st] = bars[1 + S + st]:
    // every consumer thread is done with stage st.
    u64* bars = reinterpret_cast<u64*>(scr + NWG * 4 * 16 * 64);
    u64* full = bars + 1;
    u64* empty = bars + 1 + S;

    const u32 h = blockIdx.y, b = blockIdx.z;
    const u32 q_tiles = (p.q_len + WG_BC - 1) / WG_BC;
    const u32 qt0 = blockIdx.x * NWG;  // the block's first query tile
    const u32 tiles = q_tiles - qt0 < NWG ? q_tiles - qt0 : NWG;  // its query tiles (fewer at the end)
    if (!bwd_roles<TMA, S, NWG>(bars, [&] {
            bwd_dq_produce<D, NWG>(p, maps, smem, &bars[0], full, empty, qt0, tiles, h, b);
        }))
        return;
    // The consumers (every thread without TMA): thread ct of 128·NWG; warpgroup g = ct / 128 computes query tile
    // qt0 + g (none when g ≥ tiles: it keeps the barriers' counts and writes nothing), its warp w rows 16w..16w+15.
    const u32 ct = TMA ? threadIdx.x - 128 : threadIdx.x;
    const u32 g = NWG == 1 ? 0 : ct >> 7;
    const u32 lane = ct & 31, warp = NWG == 1 ? ct >> 5 : (ct >> 5) & 3;
    const u32 gid = lane >> 2, tig = lane & 3;
    const u32 qt = qt0 + g;
    const bool own = NWG == 1 || g < tiles;
    unsigned char* qs = smem + g * TB;
    unsigned char* dos = smem + (NWG + g) * TB;
    const u32 hk = h / (p.q_heads / p.kv_heads);
    const u64 q_head = ((u64)b * p.q_heads + h) * p.q_len;
    const u64 k_head = ((u64)b * p.kv_heads + hk) * p.kv_len;
    const T* kg = k + k_head * D;
    const u32 k_tiles = (p.kv_len + WG_BC - 1) / WG_BC;
    const u32 i_lo = qt * WG_BC + warp * 16 + gid;  // this thread's rows: i_lo and i_lo + 8
    const float scale2 = p.scale * 1.4426950408889634f;

    if (!TMA) {
        wg_load_tile<D, WG_BC, T>(qs, q + q_head * D, qt * WG_BC, p.q_len, threadIdx.x, blockDim.x);
        wg_load_tile<D, WG_BC, T>(dos, dout + q_head * D, qt * WG_BC, p.q_len, threadIdx.x, blockDim.x);
        cp_async_commit();
    }
    float lr[2], dl[2];
#pragma unroll
    for (u32 hf = 0; hf < 2; ++hf) {
        u32 i = i_lo + 8 * hf;
        lr[hf] = i < p.q_len ? lse[q_head + i] * 1.4426950408889634f : 0.0f;
        dl[hf] = i < p.q_len ? delta[q_head + i] : 0.0f;
    }

    float dqa[D / 2];
#pragma unroll
    for (u32 i = 0; i < D / 2; ++i) dqa[i] = 0.0f;
    // Q's and dO's A fragments for this warp's rows, read from the tiles once they have landed (the first
    // iteration), kept for the block: S and dP then read only K and V from shared memory.
    u32 qf[D / 16][4], df[D / 16][4];

    // Key tiles that the mask does not hide for one of the block's query tiles (the producer's walk). cp.async
    // only: every thread's share of key tile `t`'s K and V into buffer c.
    auto load_kv = [&](u32 t, u32 c) {
        wg_load_tile<D, WG_BC, T>(ks0 + c * TB, kg, t * WG_BC, p.kv_len, threadIdx.x, blockDim.x);
        wg_load_tile<D, WG_BC, T>(ks0 + (S + c) * TB, v + k_head * D, t * WG_BC, p.kv_len, threadIdx.x,
                                  blockDim.x);
    };
    u32 kt = bwd_next_key_tile(p, qt0, tiles, 0, k_tiles);
    if (kt < k_tiles) {
        if (TMA)
            mbarrier_wait(&bars[0], 0);  // Q and dO (loaded only when a key tile is visible)
        else
            load_kv(kt, 0);
    }
    if (!TMA) cp_async_commit();
    for (u32 n = 0; kt < k_tiles; ++n) {
        // Tile kt is the loop's n-th: in stage stg = n % S, that stage's (n / S)-th fill.
        const u32 stg = n % S;
        const u32 next = bwd_next_key_tile(p, qt0, tiles, kt + 1, k_tiles);
        if (TMA) {
            // The TMA wrote through the async proxy, which wgmma reads: no proxy fence, and no barrier (each thread
            // has waited itself).
            mbarrier_wait(&full[stg], (n / S) & 1u);
        } else {
            // The next tile's loads go into the other buffer (every thread is done with it: the barrier ending the
            // iteration before). Q and dO (the first time), this tile's K and V: cp.async wrote them through the
            // generic proxy, so a proxy fence and a barrier before wgmma reads them.
            if (next < k_tiles) load_kv(next, stg ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
            wgmma_fence_proxy_async();
            __syncthreads();
        }
        unsigned char* ks_ = ks0 + stg * TB;
        unsigned char* vs_ = ks0 + (S + stg) * TB;
        const u32 j0 = kt * WG_BC;
        if (n == 0 && own) {
            // Q and dO landed with the first tile (cp.async: in the groups waited for above; the TMA: on bars[0],
            // waited for before the loop, whose async-proxy writes ordinary loads then see).
            wg_load_a_frags<D>(qf, qs, warp, lane);
            wg_load_a_frags<D>(df, dos, warp, lane);
        }
        // This warpgroup's tile against the key tile (hidden: it computes nothing, and only keeps the barriers), and
        // whether any of the block's is partial (the sanitising of the shared K tile is everyone's). (With one
        // warpgroup the walk visits no key tile its query tile does not see.)
        const int cls = own ? classify(p, qt, kt) : TILE_HIDDEN;
        bool partial = cls == TILE_PARTIAL;
#pragma unroll
        for (u32 t = 0; t < NWG; ++t) partial |= t != g && t < tiles && classify(p, qt0 + t, kt) == TILE_PARTIAL;
        const bool mine = NWG == 1 || cls != TILE_HIDDEN;
        const bool masked = cls == TILE_PARTIAL || j0 + WG_BC > p.kv_len || (qt + 1) * WG_BC > p.q_len;
        const unsigned long long kb = (partial && k_bad) ? k_bad[((u64)b * p.kv_heads + hk) * k_tiles + kt] : 0ull;
        if (kb) {
            wg_sanitize<D, T>(ks_, kb, ct, NC);
            wgmma_fence_proxy_async();
            bwd_consumer_sync<TMA, NWG>();
        }
        float s[32], dp[32];
        if (mine) {
            // The hidden elements of this thread's S fragment, worked out before the products (wg_hidden_bits).
            const u32 hid = masked ? static_cast<u32>(wg_hidden_bits<WG_BC, false>(p, i_lo, j0, tig)) : 0u;
            // S and dP: 64 queries × 64 keys; s[4n + e]: row i_lo + 8·(e / 2), key j0 + 8n + 2·tig + (e % 2).
            bwd_score_pair_rs<D, T>(s, dp, qf, ks_, df, vs_);
#pragma unroll
            for (u32 n = 0; n < 8; ++n) {
#pragma unroll
                for (u32 e = 0; e < 4; ++e) {
                    u32 hf = e >> 1;
                    bool hidden = (hid >> (4 * n + e)) & 1u;
                    float pv = hidden ? 0.0f : ex2_approx(s[4 * n + e] * scale2 - lr[hf]);
                    dp[4 * n + e] = hidden ? 0.0f : pv * (dp[4 * n + e] - dl[hf]);
                }
            }
            // dQ += dS·K over the tile's 64 keys.
            u32 sa[4][4];
#pragma unroll
            for (u32 t = 0; t < 4; ++t)
#pragma unroll
                for (u32 r = 0; r < 4; ++r) sa[t][r] = pack2<T>(dp[8 * t + 2 * r], dp[8 * t + 2 * r + 1]);
            wgmma_fence();
#pragma unroll
            for (u32 t = 0; t < 4; ++t) wg_mma_pv<T, D>(dqa, sa[t], wg_desc_nmajor(ks_, t));
            wgmma_commit_group();
            wgmma_wait_group<0>();
        }
        // Every wgmma of this thread reading this stage has been waited for (at once where its tile is hidden):
        // release it to the producer.
        if (TMA) mbarrier_arrive(&empty[stg]);
        if (mine && kb) {
            // Add back what the zeroed elements contribute to visible pairs (see the header), whatever this
            // warpgroup's own tile's class: K was sanitised for the block.
            float* ss = scr + (g * 4 + warp) * 16 * 64;
#pragma unroll
            for (u32 n = 0; n < 8; ++n)
#pragma unroll
                for (u32 e = 0; e < 4; ++e) ss[(gid + 8 * (e >> 1)) * 64 + n * 8 + 2 * tig + (e & 1)] = dp[4 * n + e];
            __syncwarp();
            for (u32 jl = 0; jl < WG_BC; ++jl) {
                if (!((kb >> jl) & 1ull)) continue;
                u32 j = j0 + jl;
#pragma unroll
                for (u32 hf = 0; hf < 2; ++hf) {
                    float dsv = ss[(gid + 8 * hf) * 64 + jl];
                    u32 i = i_lo + 8 * hf;
                    bool seen = i < p.q_len && j < p.kv_len && visible(p, i, j);
#pragma unroll
                    for (u32 n = 0; n < D / 8; ++n) {
#pragma unroll
                        for (u32 e = 0; e < 2; ++e) {
                            float x = seen ? to_f32(kg[(u64)j * D + n * 8 + 2 * tig + e]) : 0.0f;
                            if (seen && !isfinite(x)) dqa[4 * n + 2 * hf + e] += dsv * x;
                        }
                    }
                }
            }
            __syncwarp();
        }
        // cp.async: every warp is done with this buffer before the next iteration's loads into it. (The TMA ring
        // needs no such barrier: the empty barrier releases the stage, and the correction's scratch is per warp.)
        // With two warpgroups, a sanitising of the next key tile's K waits behind the barrier above it, which every
        // consumer reaches only after its products on this one.
        if (!TMA) __syncthreads();
        kt = next;
    }
    if (!TMA) cp_async_wait_all();

#pragma unroll
    for (u32 hf = 0; hf < 2; ++hf) {
        u32 i = i_lo + 8 * hf;
        if (!own || i >= p.q_len) continue;
#pragma unroll
        for (u32 n = 0; n < D / 8; ++n) {
#pragma unroll
            for (u32 e = 0; e < 2; ++e) {
                store_grad(dq + (q_head + i) * D + n * 8 + 2 * tig + e, dqa[4 * n + 2 * hf + e] * p.scale,
                           accumulate != 0);
            }
        }
    }
}

// ---- The non-deterministic variant's dQ (the header's "fused").

// dq = ws·scale in G (or added, accumulate), `n` elements, grid-stride.
template <typename G, int D>
__device__ __forceinline__ void attn_bwd_dq_convert(G* __restrict__ dq, const float* __restrict__ ws, u64 n,
                                                    u32 q_len, float scale, int accumulate) {
    const u32 q_tiles = (q_len + WG_BC - 1) / WG_BC;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        // dQ's element i: (bh, row, d); its place in the workspace (bwd_dq_ws_offset's order).
        const u32 d = static_cast<u32>(i % D);
        const u64 rows = i / D;
        const u32 row = static_cast<u32>(rows % q_len);
        const u32 bh = static_cast<u32>(rows / q_len);
        const u32 r = row % WG_BC, x = d % 64;
        const u32 lane = (r % 8) * 4 + (x % 8) / 2, hf = (r % 16) / 8;
        const u64 at = bwd_dq_ws_offset<D>(bh, q_tiles, row / WG_BC, d / 64, r / 16) + ((x / 8) * 2 + hf) * 64 +
                       lane * 2 + x % 2;
        store_grad(dq + i, ws[at] * scale, accumulate != 0);
    }
}

// ORDERED's turns (the header's "ordered"), before its kernel: for every query tile, the first and the last key block
// (by order index, of ⌈k_tiles / NWG⌉) that visits it (the mask does not hide it for every tile of the block); the
// flag of each of its 64-column chunks, in every (batch, query head), starts at the first, and dq_last[qt] holds the
// last (BWD_NO_TURN for both when no block visits it). One thread a query tile: the scans stop at the first visiting
// block from either end.
template <u32 NWG>
__device__ __forceinline__ void attn_bwd_dq_turns(const AttnProblem& p, u32* __restrict__ dq_turn,
                                                  u32* __restrict__ dq_last, u32 chunks) {
    const u32 q_tiles = (p.q_len + WG_BC - 1) / WG_BC;
    const u32 nb = ((p.kv_len + WG_BC - 1) / WG_BC + NWG - 1) / NWG;
    for (u32 qt = blockIdx.x * blockDim.x + threadIdx.x; qt < q_tiles; qt += gridDim.x * blockDim.x) {
        u32 first = 0;
        while (first < nb && !bwd_block_visits<NWG>(p, qt, first)) ++first;
        u32 last = BWD_NO_TURN;
        if (first < nb) {
            last = nb - 1;
            while (!bwd_block_visits<NWG>(p, qt, last)) --last;
        } else {
            first = BWD_NO_TURN;
        }
        dq_last[qt] = last;
        for (u32 bh = 0; bh < p.batch * p.q_heads; ++bh)
            for (u32 c = 0; c < chunks; ++c) dq_turn[((u64)bh * q_tiles + qt) * chunks + c] = first;
    }
}
// ---- End of the non-deterministic variant.

// attn_bwd_wgmma_{dkdv,dq,fused}_<inputs>_d<D>_<gradients>: the cp.async kernels (dkdv and dq with the arguments of
// attention_backward_tc.cu's kernels); attn_bwd_wgmma_{dkdv,dq,fused}_tma_..: the TMA-fed ones, the same arguments
// after the problem's tensor maps of Q, K, V and dO (the header's Loads; the pointers stay: the non-finite
// corrections read global memory).
#define BWD_TMA_MAPS                                                                                               \
    const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,                          \
        const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map
#define BWD_WGMMA(tn, tt, dd, gn, gt)                                                                               \
    extern "C" __global__ void __launch_bounds__(128, 1) attn_bwd_wgmma_dkdv_##tn##_d##dd##_##gn(                  \
        AttnProblem p, gt* dk, gt* dv, const tt* q, const tt* k, const tt* v, const tt* dout, const float* lse,      \
        const float* delta, const unsigned long long* q_bad, const unsigned long long* do_bad, int accumulate) {     \
        attn_bwd_wgmma_dkdv<dd, tt, gt, false, false, 1>(p, BwdMaps{}, dk, dv, nullptr, q, k, v, dout, lse, delta, \
                                                         q_bad, do_bad, nullptr, accumulate);                       \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128, 1) attn_bwd_wgmma_dq_##tn##_d##dd##_##gn(                    \
        AttnProblem p, gt* dq, const tt* q, const tt* k, const tt* v, const tt* dout, const float* lse,              \
        const float* delta, const unsigned long long* k_bad, int accumulate) {                                      \
        attn_bwd_wgmma_dq<dd, tt, gt, false, 1>(p, BwdMaps{}, dq, q, k, v, dout, lse, delta, k_bad, accumulate);    \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128, 1) attn_bwd_wgmma_fused_##tn##_d##dd##_##gn(                 \
        AttnProblem p, gt* dk, gt* dv, float* dq_ws, const tt* q, const tt* k, const tt* v, const tt* dout,          \
        const float* lse, const float* delta, const unsigned long long* q_bad, const unsigned long long* do_bad,     \
        const unsigned long long* k_bad, int accumulate) {                                                          \
        attn_bwd_wgmma_dkdv<dd, tt, gt, true, false, 1>(p, BwdMaps{}, dk, dv, dq_ws, q, k, v, dout, lse, delta,     \
                                                        q_bad, do_bad, k_bad, accumulate);                          \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128 * (1 + BWD_DKDV_WGS_D##dd), 1)                              \
        attn_bwd_wgmma_dkdv_tma_##tn##_d##dd##_##gn(AttnProblem p, BWD_TMA_MAPS, gt* dk, gt* dv, const tt* q,         \
                                                    const tt* k, const tt* v, const tt* dout, const float* lse,       \
                                                    const float* delta, const unsigned long long* q_bad,              \
                                                    const unsigned long long* do_bad, int accumulate) {               \
        attn_bwd_wgmma_dkdv<dd, tt, gt, false, true, BWD_DKDV_WGS_D##dd>(p, BwdMaps{&q_map, &k_map, &v_map, &do_map}, \
                                                                         dk, dv, nullptr, q, k, v, dout, lse, delta, \
                                                                         q_bad, do_bad, nullptr, accumulate);         \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128 * (1 + BWD_DQ_WGS), 1)                                       \
        attn_bwd_wgmma_dq_tma_##tn##_d##dd##_##gn(AttnProblem p, BWD_TMA_MAPS, gt* dq, const tt* q, const tt* k,     \
                                                  const tt* v, const tt* dout, const float* lse, const float* delta, \
                                                  const unsigned long long* k_bad, int accumulate) {                \
        attn_bwd_wgmma_dq<dd, tt, gt, true, BWD_DQ_WGS>(p, BwdMaps{&q_map, &k_map, &v_map, &do_map}, dq, q, k, v,    \
                                                        dout, lse, delta, k_bad, accumulate);                       \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128 * (1 + BWD_FUSED_WGS_D##dd), 1)                             \
        attn_bwd_wgmma_fused_tma_##tn##_d##dd##_##gn(                                                               \
            AttnProblem p, BWD_TMA_MAPS, gt* dk, gt* dv, float* dq_ws, const tt* q, const tt* k, const tt* v,        \
            const tt* dout, const float* lse, const float* delta, const unsigned long long* q_bad,                   \
            const unsigned long long* do_bad, const unsigned long long* k_bad, int accumulate) {                    \
        attn_bwd_wgmma_dkdv<dd, tt, gt, true, true, BWD_FUSED_WGS_D##dd, BWD_FUSED_STAGES_D##dd>(                    \
            p, BwdMaps{&q_map, &k_map, &v_map, &do_map}, dk, dv, dq_ws, q, k, v, dout, lse, delta, q_bad, do_bad,     \
            k_bad, accumulate);                                                                                     \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128, 1) attn_bwd_wgmma_ordered_##tn##_d##dd##_##gn(               \
        AttnProblem p, gt* dk, gt* dv, float* dq_ws, const tt* q, const tt* k, const tt* v, const tt* dout,          \
        const float* lse, const float* delta, const unsigned long long* q_bad, const unsigned long long* do_bad,     \
        const unsigned long long* k_bad, int accumulate, u32* dq_turn, const u32* dq_last) {                       \
        attn_bwd_wgmma_dkdv<dd, tt, gt, true, false, 1, BWD_STAGES, true>(p, BwdMaps{}, dk, dv, dq_ws, q, k, v,      \
                                                                          dout, lse, delta, q_bad, do_bad, k_bad,   \
                                                                          accumulate, dq_turn, dq_last);            \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128 * (1 + BWD_FUSED_WGS_D##dd), 1)                             \
        attn_bwd_wgmma_ordered_tma_##tn##_d##dd##_##gn(                                                             \
            AttnProblem p, BWD_TMA_MAPS, gt* dk, gt* dv, float* dq_ws, const tt* q, const tt* k, const tt* v,        \
            const tt* dout, const float* lse, const float* delta, const unsigned long long* q_bad,                   \
            const unsigned long long* do_bad, const unsigned long long* k_bad, int accumulate, u32* dq_turn,          \
            const u32* dq_last) {                                                                                   \
        attn_bwd_wgmma_dkdv<dd, tt, gt, true, true, BWD_FUSED_WGS_D##dd, BWD_FUSED_STAGES_D##dd, true>(              \
            p, BwdMaps{&q_map, &k_map, &v_map, &do_map}, dk, dv, dq_ws, q, k, v, dout, lse, delta, q_bad, do_bad,     \
            k_bad, accumulate, dq_turn, dq_last);                                                                   \
    }
#define BWD_WGMMA_TYPES(tn, tt)                                                                                    \
    BWD_WGMMA(tn, tt, 64, tn, tt) BWD_WGMMA(tn, tt, 64, f32, float) BWD_WGMMA(tn, tt, 128, tn, tt)                  \
    BWD_WGMMA(tn, tt, 128, f32, float)
BWD_WGMMA_TYPES(bf16, bf16)
BWD_WGMMA_TYPES(f16, f16)
// attn_bwd_dq_convert_d<D>_<gradients>: the one-kernel variants' dQ from their f32 workspace.
#define BWD_DQ_CONVERT(dd, gn, gt)                                                                                 \
    extern "C" __global__ void attn_bwd_dq_convert_d##dd##_##gn(gt* dq, const float* ws, u64 n, u32 q_len,         \
                                                                float scale, int accumulate) {                      \
        attn_bwd_dq_convert<gt, dd>(dq, ws, n, q_len, scale, accumulate);                                           \
    }
BWD_DQ_CONVERT(64, bf16, bf16)
BWD_DQ_CONVERT(64, f16, f16)
BWD_DQ_CONVERT(64, f32, float)
BWD_DQ_CONVERT(128, bf16, bf16)
BWD_DQ_CONVERT(128, f16, f16)
BWD_DQ_CONVERT(128, f32, float)
// attn_bwd_dq_turns_w<NWG>: the ordered kernels' turns (NWG: 1 for the cp.async kernel, BWD_FUSED_WGS_D<D> for the
// TMA-fed ones).
#define BWD_DQ_TURNS(nwg)                                                                                          \
    extern "C" __global__ void attn_bwd_dq_turns_w##nwg(AttnProblem p, u32* dq_turn, u32* dq_last, u32 chunks) {   \
        attn_bwd_dq_turns<nwg>(p, dq_turn, dq_last, chunks);                                                        \
    }
BWD_DQ_TURNS(1)
BWD_DQ_TURNS(2)
