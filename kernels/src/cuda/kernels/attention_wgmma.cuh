// What the wgmma attention kernels share (attention_forward_wgmma.cu, attention_backward_wgmma.cu; sm_90a, after
// attention.cuh and ptx_hopper.cuh): their shared-memory tile layout, its loads, and their two products.
//
// Tiles: rows of D 16-bit elements stored as D/64 blocks of ROWS × 128 bytes (64 elements of each row per block, the
// block of elements 64c..64c+63 after the one of 64(c−1)..), the 16-byte chunk x of row r of a block stored at chunk
// x ^ (r % 8) (Swizzle<3,4,3>: the 128B swizzle of wgmma's canonical layouts, ptx_hopper.cuh), each tile starting
// on a 1024-byte boundary of the shared window (the swizzle is on the address). Read by a wgmma as:
// - a K-major operand (A or B with K = the row's elements: Q·Kᵀ's Q and K): 128-byte rows of 64 k; k-step ks
//   (k = 16ks..16ks+15) starts at block ks / 4, 32·(ks % 4) bytes into the rows; LBO unused (16), SBO = 1024 from
//   one group of 8 rows to the next (wg_desc_kmajor);
// - an N-major B (N = the row's elements, K = the rows: P·V's V, where B is Vᵀ viewed as N×K = D×keys): 128-byte
//   rows of 64 n, one per k; k-step t (rows 16t..16t+15) starts 16t rows in; SBO = 1024 from rows 0-7 to rows
//   8-15, LBO = ROWS·128 from one 64-wide block of n to the next (wg_desc_nmajor).

#define WG_BC 64

// Byte offset of the 16-byte chunk `x` (elements 8x..8x+7) of row `r` in a tile of ROWS rows.
template <int ROWS>
__device__ __forceinline__ u32 wg_swz(u32 r, u32 x) {
    return (x / 8) * (ROWS * 128) + r * 128 + (((x % 8) ^ (r % 8)) << 4);
}

// Starts copying rows [row0, row0 + ROWS) of one head (`src` points at the head's row 0, `len` rows) into the tile at
// `dst`; rows past `len` become zeros. Thread t of the n that share the copies (the block's, or the consumer
// warpgroups' alone in a warp-specialised kernel, whose producer has left) takes its share, one cp.async of 16
// bytes each.
template <int D, int ROWS, typename T>
__device__ __forceinline__ void wg_load_tile(unsigned char* dst, const T* src, u32 row0, u32 len, u32 t, u32 n) {
    constexpr u32 CHUNKS = D / 8;
    for (u32 x = t; x < ROWS * CHUNKS; x += n) {
        u32 r = x / CHUNKS, c = x % CHUNKS;
        u32 row = row0 + r;
        bool valid = row < len;
        const T* g = src + (u64)(valid ? row : 0) * D + c * 8;
        cp_async_16_zfill(dst + wg_swz<ROWS>(r, c), g, valid);
    }
}

// The wgmma of T: 64×N S += Q·Kᵀ over N keys (64, the backward's tiles; 128, the forward's), both in shared memory,
// K-major, and 64×D O += P·V (P in registers as the A fragment, V an N-major B).
template <typename T, int N>
__device__ __forceinline__ void wg_mma_qk(float (&s)[N / 2], u64 dq, u64 dk, bool scale_d);
template <>
__device__ __forceinline__ void wg_mma_qk<bf16, 64>(float (&s)[32], u64 dq, u64 dk, bool scale_d) {
    wgmma_m64n64k16_bf16<0, 0>(s, dq, dk, scale_d);
}
template <>
__device__ __forceinline__ void wg_mma_qk<f16, 64>(float (&s)[32], u64 dq, u64 dk, bool scale_d) {
    wgmma_m64n64k16_f16<0, 0>(s, dq, dk, scale_d);
}
template <>
__device__ __forceinline__ void wg_mma_qk<bf16, 128>(float (&s)[64], u64 dq, u64 dk, bool scale_d) {
    wgmma_m64n128k16_bf16<0, 0>(s, dq, dk, scale_d);
}
template <>
__device__ __forceinline__ void wg_mma_qk<f16, 128>(float (&s)[64], u64 dq, u64 dk, bool scale_d) {
    wgmma_m64n128k16_f16<0, 0>(s, dq, dk, scale_d);
}

// The same 64×64 score product with A in registers (the backward's dQ kernel keeps Q's and dO's fragments for the
// block: only B is read from shared memory, half the bytes a product of wg_mma_qk<T, 64> reads).
template <typename T>
__device__ __forceinline__ void wg_mma_qk_rs(float (&s)[32], const u32 (&a)[4], u64 dk, bool scale_d);
template <>
__device__ __forceinline__ void wg_mma_qk_rs<bf16>(float (&s)[32], const u32 (&a)[4], u64 dk, bool scale_d) {
    wgmma_m64n64k16_bf16_rs<0>(s, a, dk, scale_d);
}
template <>
__device__ __forceinline__ void wg_mma_qk_rs<f16>(float (&s)[32], const u32 (&a)[4], u64 dk, bool scale_d) {
    wgmma_m64n64k16_f16_rs<0>(s, a, dk, scale_d);
}

// Warp `warp`'s A fragments of a 64-row tile (rows 16·warp..16·warp + 15) for its D/16 k-steps, by ldmatrix from the
// tile layout: lane l addresses row 16·warp + l % 16, chunk 2·ks + l / 16, so the four matrices are the fragment's
// a0..a3 (the accumulator fragment's layout, ptx_hopper.cuh). Warp-collective.
template <int D>
__device__ __forceinline__ void wg_load_a_frags(u32 (&f)[D / 16][4], const unsigned char* tile, u32 warp, u32 lane) {
#pragma unroll
    for (u32 ks = 0; ks < D / 16; ++ks)
        ldmatrix_x4(f[ks], tile + wg_swz<WG_BC>(warp * 16 + (lane & 15), 2 * ks + (lane >> 4)));
}

template <typename T, int D>
__device__ __forceinline__ void wg_mma_pv(float (&o)[D / 2], const u32 (&a)[4], u64 dv);
template <>
__device__ __forceinline__ void wg_mma_pv<bf16, 64>(float (&o)[32], const u32 (&a)[4], u64 dv) {
    wgmma_m64n64k16_bf16_rs<1>(o, a, dv, true);
}
template <>
__device__ __forceinline__ void wg_mma_pv<bf16, 128>(float (&o)[64], const u32 (&a)[4], u64 dv) {
    wgmma_m64n128k16_bf16_rs<1>(o, a, dv, true);
}
template <>
__device__ __forceinline__ void wg_mma_pv<f16, 64>(float (&o)[32], const u32 (&a)[4], u64 dv) {
    wgmma_m64n64k16_f16_rs<1>(o, a, dv, true);
}
template <>
__device__ __forceinline__ void wg_mma_pv<f16, 128>(float (&o)[64], const u32 (&a)[4], u64 dv) {
    wgmma_m64n128k16_f16_rs<1>(o, a, dv, true);
}

// The block's dynamic shared memory, aligned up to 1024 bytes of the shared window (the host adds 1024 to the size).
__device__ __forceinline__ unsigned char* wg_smem() {
    DYNAMIC_SMEM(unsigned char, raw);
    return raw + ((1024u - (wgmma_smem_addr(raw) & 1023u)) & 1023u);
}

// Sets the non-finite elements of the rows of a ROWS-row tile (64 or 128) flagged in `bad` (rows 0..63) and
// `bad_hi` (rows 64..127) to 0, thread t of the n sharing the work (as wg_load_tile's); a wgmma_fence_proxy_async
// and a barrier of those threads must follow before a wgmma reads the tile.
template <int D, typename T, int ROWS = WG_BC>
__device__ __forceinline__ void wg_sanitize(unsigned char* tile, unsigned long long bad, u32 t, u32 n,
                                            unsigned long long bad_hi = 0) {
    static_assert(ROWS == 64 || ROWS == 128, "tiles of 64 or 128 rows");
    for (u32 x = t; x < ROWS * D; x += n) {
        u32 r = x / D, d = x % D;
        if (!(((r < 64 ? bad : bad_hi) >> (r & 63)) & 1ull)) continue;
        T* e = reinterpret_cast<T*>(tile + wg_swz<ROWS>(r, d / 8)) + (d % 8);
        if (!isfinite(to_f32(*e))) *e = from_f32<T>(0.0f);
    }
}

// The descriptor of k-step `ks` of a tile of ROWS rows read K-major, from its row 0 (`tile` may be advanced by
// whole 8-row groups: a warpgroup's 64 rows of a taller tile).
template <int ROWS>
__device__ __forceinline__ u64 wg_desc_kmajor(const unsigned char* tile, u32 ks) {
    return wgmma_desc(tile + (ks / 4) * (ROWS * 128) + (ks % 4) * 32, 16, 1024, WGMMA_SWIZZLE_128B);
}

// The descriptor of k-step `t` (rows 16t..16t+15) of a ROWS-row tile read as an N-major B.
template <int ROWS = WG_BC>
__device__ __forceinline__ u64 wg_desc_nmajor(const unsigned char* tile, u32 t) {
    return wgmma_desc(tile + t * 16 * 128, ROWS * 128, 1024, WGMMA_SWIZZLE_128B);
}

// The elements of a thread's score fragment over COLS columns (64 or 128) that the mask hides, or that lie past the
// queries or keys, as bits: bit 4n + 2h + e for the fragment's element [4n + 2h + e], at row row_lo + 8h and column
// col0 + 8n + 2·tig + e (the accumulator fragment's layout; rows are keys in the backward's Sᵀ, KEY_ROWS, else
// queries). The kernels work them out before their products, while only their accumulators are live: per element,
// between the products and the softmax or the packing, the general masks' position and document arithmetic sat
// beside the score fragments, and ptxas spilled at D = 128. A loop, not unrolled: the bits stay in registers.
template <int COLS, bool KEY_ROWS>
__device__ __forceinline__ unsigned long long wg_hidden_bits(const AttnProblem& p, u32 row_lo, u32 col0, u32 tig) {
    static_assert(COLS == 64 || COLS == 128, "fragments of 64 or 128 columns");
    unsigned long long bits = 0;
#pragma unroll 1
    for (u32 x = 0; x < COLS / 2; ++x) {
        const u32 row = row_lo + 8 * ((x >> 1) & 1u);
        const u32 col = col0 + (x >> 2) * 8 + 2 * tig + (x & 1u);
        const u32 i = KEY_ROWS ? col : row, j = KEY_ROWS ? row : col;
        if (i >= p.q_len || j >= p.kv_len || !visible(p, i, j)) bits |= 1ull << x;
    }
    return bits;
}

// The first key tile at or after `kt` that the mask does not hide for query tile `qt` (k_tiles: none).
__device__ __forceinline__ u32 next_tile(const AttnProblem& p, u32 qt, u32 kt, u32 k_tiles) {
    while (kt < k_tiles && classify(p, qt, kt) == TILE_HIDDEN) ++kt;
    return kt;
}
