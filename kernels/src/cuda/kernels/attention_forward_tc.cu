// Attention forward on tensor cores: bf16 or f16 Q, K, V (T), head dim 64 or 128, mma.sync m16n8k16 with f32
// accumulation
// (FlashAttention-2's structure).
//
// Pipeline. Block = 4 warps for a tile of BR = 64·MT query rows of one (batch, head); warp w owns MT tiles of 16
// rows (rows 16·MT·w .. 16·MT·w + 16·MT − 1). MT = 1 keeps Q's fragments in registers; MT = 2 reads them from
// shared memory at each use but loads each K and V fragment once for two row tiles, halving the shared-memory
// traffic per product (the choice is the launcher's; both are built at D = 64; at D = 128, MT = 2's accumulators and
// scores do not fit in 255 registers, and ptxas spills, so only MT = 1 is built).
// 1. Q's tile goes global → shared (cp.async, 16 bytes per copy, rows past Sq zero-filled); with MT = 1 into
//    registers as mma A fragments (ldmatrix.x4), where it stays.
// 2. Key tiles of BC = 64 rows, in order, skipping those the mask's tile summaries classify as hidden: K and V go
//    global → shared by cp.async into one of two buffers while the tile before computes (double buffering; one
//    commit group per tile).
// 3. Per tile: S = Q·Kᵀ (mma, B fragments by ldmatrix from K rows), scaled; on a partial tile, or the last one past
//    Sk, every hidden pair's score is selected to −inf (never multiplied); the online softmax per row (running max
//    m and sum l, reduced across the four lanes of a quad by shuffles; scores in base 2, so that each exponential is
//    one ex2.approx); P = exp(S − m) rounded to T becomes the A fragments of O += P·V (B fragments by
//    ldmatrix.trans from V rows), O rescaled by exp(m_old − m) first.
// 4. O / l is written (T or f32), and LSE = m + ln l (−inf and O = 0 for a row that saw no key).
//
// Shared memory: rows of D 16-bit elements in 16-byte chunks, chunk c of row r stored at chunk c ^ (r % 8) (an XOR swizzle),
// so the eight rows an ldmatrix reads at one column fall in different banks. Q: BR×D; K and V: two buffers of
// 64×D each; 16·MT KiB for P on the rare tile that needs a correction (96 KiB at D = 128, MT = 1).
//
// Every loop over a register array (fragments, accumulators) is unrolled with constant bounds: an array indexed at
// run time is placed in local memory.
//
// Non-finite values behind the mask. A masked score is selected away, but P·V multiplies each hidden pair's P = 0
// by V[j], and 0·NaN is NaN: a NaN in V would reach rows the mask hides it from. So on a partial tile that holds a
// non-finite V row (the host's per-tile row masks, attention_flags.cu), the non-finite elements of V are set to 0 in
// shared memory before the product (for the rows that do not see them nothing changes: their P is 0 either way),
// and each row that sees such a key then adds P·V[j, d] for those elements from global memory, so it gets the NaN
// or infinity the exact sum would have given it.

#define TC_BC 64
#define TC_WARPS 4

// Byte offset of chunk `c` (16 bytes) of row `r` in a swizzled tile of rows of D 16-bit elements.
template <int D>
__device__ __forceinline__ u32 swz(u32 r, u32 c) {
    return r * (D * 2) + ((c ^ (r & 7)) << 4);
}

// Starts copying rows [row0, row0 + ROWS) of one head (`src` points at the head's row 0, `len` rows) into the
// swizzled tile at `dst`; rows past `len` become zeros.
template <int D, int ROWS, typename T>
__device__ __forceinline__ void load_tile(unsigned char* dst, const T* src, u32 row0, u32 len) {
    constexpr u32 CHUNKS = D / 8;
    for (u32 x = threadIdx.x; x < ROWS * CHUNKS; x += TC_WARPS * 32) {
        u32 r = x / CHUNKS, c = x % CHUNKS;
        u32 row = row0 + r;
        bool valid = row < len;
        const T* g = src + (u64)(valid ? row : 0) * D + c * 8;
        cp_async_16_zfill(dst + swz<D>(r, c), g, valid);
    }
}

template <int D, int MT, typename T, typename OT>
__device__ __forceinline__ void attn_fwd_tc(const AttnProblem& p, const T* __restrict__ q, const T* __restrict__ k,
                                            const T* __restrict__ v, OT* __restrict__ o, float* __restrict__ lse,
                                            const unsigned long long* __restrict__ v_bad) {
    constexpr u32 BR = 64 * MT;
    constexpr bool Q_IN_REGS = MT == 1;
    DYNAMIC_SMEM(unsigned char, smem);
    constexpr u32 TILE_BYTES = TC_BC * D * 2;
    constexpr u32 Q_BYTES = BR * D * 2;
    unsigned char* qs = smem;
    // K's buffer b at smem + Q_BYTES + b·TILE_BYTES, V's at smem + Q_BYTES + (2 + b)·TILE_BYTES (computed, not an
    // array: an array indexed at run time would live in local memory).
    unsigned char* kv = smem + Q_BYTES;
    float* pscr = reinterpret_cast<float*>(kv + 4 * TILE_BYTES);  // [4 warps][16·MT][64]: P, for the correction

    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 gid = lane >> 2, tig = lane & 3;
    const u32 qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const u32 hk = h / (p.q_heads / p.kv_heads);
    const u64 q_head = ((u64)b * p.q_heads + h) * p.q_len;
    const u64 k_head = ((u64)b * p.kv_heads + hk) * p.kv_len;
    const T* qg = q + q_head * D;
    const T* kg = k + k_head * D;
    const T* vg = v + k_head * D;
    const u32 k_tiles = (p.kv_len + TC_BC - 1) / TC_BC;
    // Scores are kept in base-2 units (scale·log2 e folded into one multiply), so each exponential is one
    // ex2.approx; m is in those units too.
    const float scale2 = p.scale * 1.4426950408889634f;
    const u32 warp_row0 = warp * 16 * MT;  // the warp's first row in the tile

    // 1. Q.
    load_tile<D, BR, T>(qs, qg, qt * BR, p.q_len);
    cp_async_commit();

    // The first key tile that is not hidden.
    u32 kt = 0;
    while (kt < k_tiles && classify(p, qt, kt) == TILE_HIDDEN) ++kt;
    if (kt < k_tiles) {
        load_tile<D, TC_BC, T>(kv, kg, kt * TC_BC, p.kv_len);
        load_tile<D, TC_BC, T>(kv + 2 * TILE_BYTES, vg, kt * TC_BC, p.kv_len);
    }
    cp_async_commit();

    cp_async_wait<1>();
    __syncthreads();
    u32 qf[Q_IN_REGS ? D / 16 : 1][4];
    if (Q_IN_REGS) {
#pragma unroll
        for (u32 ks = 0; ks < D / 16; ++ks) {
            u32 r = warp_row0 + (lane & 15);
            u32 c = 2 * ks + (lane >> 4);
            ldmatrix_x4(qf[Q_IN_REGS ? ks : 0], qs + swz<D>(r, c));
        }
    }

    float acc[MT][D / 8][4];
#pragma unroll
    for (u32 mt = 0; mt < MT; ++mt)
#pragma unroll
        for (u32 n = 0; n < D / 8; ++n)
#pragma unroll
            for (u32 e = 0; e < 4; ++e) acc[mt][n][e] = 0.0f;
    float m[MT][2], l[MT][2];
#pragma unroll
    for (u32 mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = NEG_INF;
        l[mt][0] = l[mt][1] = 0.0f;
    }
    // This thread's rows: row_lo(mt) and row_lo(mt) + 8.
    const u32 row_base = qt * BR + warp_row0 + gid;

    u32 buf = 0;
    while (kt < k_tiles) {
        int cls = classify(p, qt, kt);
        // Prefetch the next tile that is not hidden into the other buffer.
        u32 next = kt + 1;
        while (next < k_tiles && classify(p, qt, next) == TILE_HIDDEN) ++next;
        if (next < k_tiles) {
            load_tile<D, TC_BC, T>(kv + (1 - buf) * TILE_BYTES, kg, next * TC_BC, p.kv_len);
            load_tile<D, TC_BC, T>(kv + (3 - buf) * TILE_BYTES, vg, next * TC_BC, p.kv_len);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        const u32 j0 = kt * TC_BC;
        const bool tail = j0 + TC_BC > p.kv_len;
        const bool masked = cls == TILE_PARTIAL || tail;
        unsigned long long vb = (cls == TILE_PARTIAL && v_bad) ? v_bad[((u64)b * p.kv_heads + hk) * k_tiles + kt] : 0ull;
        unsigned char* ks_ = kv + buf * TILE_BYTES;
        unsigned char* vs_ = kv + (2 + buf) * TILE_BYTES;
        if (vb) {
            // Zero V's non-finite elements in the rows flagged (see the header).
            for (u32 x = threadIdx.x; x < TC_BC * D; x += TC_WARPS * 32) {
                u32 r = x / D, d = x % D;
                if (!((vb >> r) & 1ull)) continue;
                T* e = reinterpret_cast<T*>(vs_ + swz<D>(r, d / 8)) + (d % 8);
                if (!isfinite(to_f32(*e))) *e = from_f32<T>(0.0f);
            }
            __syncthreads();
        }

        // S = Q·Kᵀ for this warp's rows and the tile's 64 keys; each K fragment is loaded once for the MT row tiles.
        float s[MT][TC_BC / 8][4];
#pragma unroll
        for (u32 mt = 0; mt < MT; ++mt)
#pragma unroll
            for (u32 n = 0; n < TC_BC / 8; ++n)
#pragma unroll
                for (u32 e = 0; e < 4; ++e) s[mt][n][e] = 0.0f;
#pragma unroll
        for (u32 ks = 0; ks < D / 16; ks += 2) {
            u32 qa[MT][2][4];
#pragma unroll
            for (u32 mt = 0; mt < MT; ++mt)
#pragma unroll
                for (u32 kk = 0; kk < 2; ++kk) {
                    if (Q_IN_REGS) {
#pragma unroll
                        for (u32 e = 0; e < 4; ++e) qa[mt][kk][e] = qf[Q_IN_REGS ? ks + kk : 0][e];
                    } else {
                        u32 r = warp_row0 + mt * 16 + (lane & 15);
                        ldmatrix_x4(qa[mt][kk], qs + swz<D>(r, 2 * (ks + kk) + (lane >> 4)));
                    }
                }
#pragma unroll
            for (u32 n = 0; n < TC_BC / 8; ++n) {
                u32 bfr[4];
                ldmatrix_x4(bfr, ks_ + swz<D>(n * 8 + (lane & 7), 2 * ks + (lane >> 3)));
                const u32 b0[2] = {bfr[0], bfr[1]}, b1[2] = {bfr[2], bfr[3]};
#pragma unroll
                for (u32 mt = 0; mt < MT; ++mt) {
                    mma_16816<T>(s[mt][n], qa[mt][0], b0, s[mt][n]);
                    mma_16816<T>(s[mt][n], qa[mt][1], b1, s[mt][n]);
                }
            }
        }

        // Scale, mask, and the online softmax of each of the thread's rows (per row tile: half 0 row_lo, 1 +8).
#pragma unroll
        for (u32 mt = 0; mt < MT; ++mt) {
            float alpha[2];
#pragma unroll
            for (u32 hf = 0; hf < 2; ++hf) {
                u32 i = row_base + mt * 16 + 8 * hf;
                float mx = m[mt][hf];
#pragma unroll
                for (u32 n = 0; n < TC_BC / 8; ++n) {
#pragma unroll
                    for (u32 e = 0; e < 2; ++e) {
                        u32 j = j0 + n * 8 + 2 * tig + e;
                        float x = s[mt][n][2 * hf + e] * scale2;
                        if (masked && (j >= p.kv_len || i >= p.q_len || !visible(p, i, j))) x = NEG_INF;
                        s[mt][n][2 * hf + e] = x;
                        mx = fmaxf(mx, x);
                    }
                }
                mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
                // A row that has seen no key yet keeps m = −inf: exponents are taken against 0 then, giving 0.
                float base = mx == NEG_INF ? 0.0f : mx;
                alpha[hf] = m[mt][hf] == mx ? 1.0f : ex2_approx(m[mt][hf] - base);
                float sum = 0.0f;
#pragma unroll
                for (u32 n = 0; n < TC_BC / 8; ++n) {
#pragma unroll
                    for (u32 e = 0; e < 2; ++e) {
                        float x = s[mt][n][2 * hf + e];
                        float pv = x == NEG_INF ? 0.0f : ex2_approx(x - base);
                        s[mt][n][2 * hf + e] = pv;
                        sum += pv;
                    }
                }
                sum += __shfl_xor_sync(FULL_MASK, sum, 1);
                sum += __shfl_xor_sync(FULL_MASK, sum, 2);
                l[mt][hf] = l[mt][hf] * alpha[hf] + sum;
                m[mt][hf] = mx;
            }
#pragma unroll
            for (u32 n = 0; n < D / 8; ++n) {
                acc[mt][n][0] *= alpha[0];
                acc[mt][n][1] *= alpha[0];
                acc[mt][n][2] *= alpha[1];
                acc[mt][n][3] *= alpha[1];
            }
        }

        // O += P·V: P's C fragments become A fragments (keys 16t..16t+15 are S tiles 2t and 2t+1); each V fragment is
        // loaded once for the MT row tiles.
#pragma unroll
        for (u32 t = 0; t < TC_BC / 16; ++t) {
            u32 pa[MT][4];
#pragma unroll
            for (u32 mt = 0; mt < MT; ++mt) {
                pa[mt][0] = pack2<T>(s[mt][2 * t][0], s[mt][2 * t][1]);
                pa[mt][1] = pack2<T>(s[mt][2 * t][2], s[mt][2 * t][3]);
                pa[mt][2] = pack2<T>(s[mt][2 * t + 1][0], s[mt][2 * t + 1][1]);
                pa[mt][3] = pack2<T>(s[mt][2 * t + 1][2], s[mt][2 * t + 1][3]);
            }
#pragma unroll
            for (u32 n = 0; n < D / 8; n += 2) {
                u32 bfr[4];
                u32 r = 16 * t + (lane & 7) + 8 * ((lane >> 3) & 1);
                ldmatrix_x4_trans(bfr, vs_ + swz<D>(r, n + (lane >> 4)));
                const u32 b0[2] = {bfr[0], bfr[1]}, b1[2] = {bfr[2], bfr[3]};
#pragma unroll
                for (u32 mt = 0; mt < MT; ++mt) {
                    mma_16816<T>(acc[mt][n], pa[mt], b0, acc[mt][n]);
                    mma_16816<T>(acc[mt][n + 1], pa[mt], b1, acc[mt][n + 1]);
                }
            }
        }

        if (vb) {
            // Each row that sees a flagged key adds what the zeroed elements held, times its P. P goes through
            // shared memory (this warp's 16·MT × 64), so that no register array is indexed at run time.
            float* ps = pscr + warp * 16 * MT * TC_BC;
#pragma unroll
            for (u32 mt = 0; mt < MT; ++mt)
#pragma unroll
                for (u32 n = 0; n < TC_BC / 8; ++n)
#pragma unroll
                    for (u32 e = 0; e < 4; ++e)
                        ps[(mt * 16 + gid + 8 * (e >> 1)) * TC_BC + n * 8 + 2 * tig + (e & 1)] = s[mt][n][e];
            __syncwarp();
            for (u32 jj = 0; jj < TC_BC; ++jj) {
                if (!((vb >> jj) & 1ull)) continue;
                u32 j = j0 + jj;
#pragma unroll
                for (u32 mt = 0; mt < MT; ++mt) {
#pragma unroll
                    for (u32 hf = 0; hf < 2; ++hf) {
                        u32 i = row_base + mt * 16 + 8 * hf;
                        float pv = ps[(mt * 16 + gid + 8 * hf) * TC_BC + jj];
                        bool seen = i < p.q_len && j < p.kv_len && visible(p, i, j);
#pragma unroll
                        for (u32 n = 0; n < D / 8; ++n) {
#pragma unroll
                            for (u32 e = 0; e < 2; ++e) {
                                float x = seen ? to_f32(vg[(u64)j * D + n * 8 + 2 * tig + e]) : 0.0f;
                                if (seen && !isfinite(x)) acc[mt][n][2 * hf + e] += pv * x;
                            }
                        }
                    }
                }
            }
            __syncwarp();
        }

        __syncthreads();  // every warp is done with this buffer before the next prefetch overwrites it
        buf ^= 1;
        kt = next;
    }
    cp_async_wait_all();

    // 4. O / l and LSE.
#pragma unroll
    for (u32 mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (u32 hf = 0; hf < 2; ++hf) {
            u32 i = row_base + mt * 16 + 8 * hf;
            if (i >= p.q_len) continue;
            bool none = l[mt][hf] == 0.0f;
            float inv = none ? 0.0f : 1.0f / l[mt][hf];
#pragma unroll
            for (u32 n = 0; n < D / 8; ++n) {
                u32 d = n * 8 + 2 * tig;
                OT* out = o + (q_head + i) * D + d;
                out[0] = from_f32<OT>(none ? 0.0f : acc[mt][n][2 * hf] * inv);
                out[1] = from_f32<OT>(none ? 0.0f : acc[mt][n][2 * hf + 1] * inv);
            }
            if (tig == 0) lse[q_head + i] = none ? NEG_INF : m[mt][hf] * 0.6931471805599453f + logf(l[mt][hf]);
        }
    }
}

// attn_fwd_tc_<inputs>_d<D>_m<MT>_<output>.
#define FWD_TC(tn, tt, dd, mt, on, ot)                                                                          \
    extern "C" __global__ void __launch_bounds__(128, 1) attn_fwd_tc_##tn##_d##dd##_m##mt##_##on(              \
        AttnProblem p, const tt* q, const tt* k, const tt* v, ot* o, float* lse, const unsigned long long* v_bad) { \
        attn_fwd_tc<dd, mt, tt, ot>(p, q, k, v, o, lse, v_bad);                                                \
    }
#define FWD_TC_TYPES(tn, tt)                                                                                  \
    FWD_TC(tn, tt, 64, 1, tn, tt) FWD_TC(tn, tt, 64, 1, f32, float) FWD_TC(tn, tt, 128, 1, tn, tt)            \
    FWD_TC(tn, tt, 128, 1, f32, float) FWD_TC(tn, tt, 64, 2, tn, tt) FWD_TC(tn, tt, 64, 2, f32, float)
FWD_TC_TYPES(bf16, bf16)
FWD_TC_TYPES(f16, f16)
