// Attention backward on tensor cores: bf16 or f16 Q, K, V, dO (T), head dim 64 or 128, mma.sync m16n8k16 with f32
// accumulation. Deterministic: no atomics; every gradient element is accumulated by one thread in a fixed order.
// (Δ = rowsum(dO∘O) comes first from attention_backward.cu's attn_bwd_delta.)
//
// Two kernels, as FlashAttention-2's backward without its atomic dQ:
//
// dkdv: block = 4 warps for a tile of 64 key rows of one (batch, key/value head); warp w owns keys 16w..16w+15,
// with their dK and dV accumulators in registers. K and V stay in shared memory. For every query head of the
// group and every query tile of 64 rows that the mask does not hide: Q, dO (and their LSE, Δ) go global → shared
// (cp.async); then, per half of 32 queries,
//   Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (A fragments from K and V rows, B fragments by ldmatrix from Q and dO rows),
//   Pᵀ = exp(Sᵀ·scale − LSE), dSᵀ = Pᵀ∘(dPᵀ − Δ) (hidden pairs selected to 0, never multiplied),
//   dV += Pᵀ·dO and dK += dSᵀ·Q (Pᵀ and dSᵀ as bf16 A fragments, dO and Q by ldmatrix.trans).
// At the end dK·scale and dV are written (or added, GradMode::Accumulate).
//
// dq: block = 4 warps for a tile of 64 query rows of one (batch, query head); warp w owns rows 16w..16w+15, with Q
// and dO as A fragments and dQ's accumulator in registers. For every key tile the mask does not hide: K and V go
// global → shared; per half of 32 keys, S = Q·Kᵀ, dP = dO·Vᵀ, P and dS as above, dQ += dS·K (K by ldmatrix.trans).
// At the end dQ·scale is written (or added).
//
// Shared memory tiles are swizzled as in attention_forward_tc.cu (chunk c of row r at c ^ (r % 8)); every loop over
// a register array is unrolled with constant bounds (an array indexed at run time is placed in local memory).
//
// Non-finite values behind the mask: a hidden pair's P and dS are selected to 0, but a product multiplies that 0
// by the other operand's row, and 0·NaN is NaN. So on a partial tile pair whose tiles hold non-finite rows (the
// per-tile row masks of attention_flags.cu), the non-finite elements of the operand a hidden 0 multiplies are set
// to 0 in shared memory first — Q and dO in dkdv (for dK = dSᵀ·Q and dV = Pᵀ·dO), K in dq (for dQ = dS·K) — and each
// visible pair then adds back, from global memory, what those elements contribute. Rows and keys the mask keeps
// apart from the value are bit-identical to a run without it.

#define BT_TILE 64
#define BT_WARPS 4

template <int D>
__device__ __forceinline__ u32 bswz(u32 r, u32 c) {
    return r * (D * 2) + ((c ^ (r & 7)) << 4);
}

template <int D, typename T>
__device__ __forceinline__ void bload_tile(unsigned char* dst, const T* src, u32 row0, u32 len) {
    constexpr u32 CHUNKS = D / 8;
    for (u32 x = threadIdx.x; x < BT_TILE * CHUNKS; x += BT_WARPS * 32) {
        u32 r = x / CHUNKS, c = x % CHUNKS;
        u32 row = row0 + r;
        bool valid = row < len;
        cp_async_16_zfill(dst + bswz<D>(r, c), src + (u64)(valid ? row : 0) * D + c * 8, valid);
    }
}

// Sets the non-finite elements of the rows of `tile` flagged in `bad` to 0.
template <int D, typename T>
__device__ __forceinline__ void sanitize(unsigned char* tile, unsigned long long bad) {
    for (u32 x = threadIdx.x; x < BT_TILE * D; x += BT_WARPS * 32) {
        u32 r = x / D, d = x % D;
        if (!((bad >> r) & 1ull)) continue;
        T* e = reinterpret_cast<T*>(tile + bswz<D>(r, d / 8)) + (d % 8);
        if (!isfinite(to_f32(*e))) *e = from_f32<T>(0.0f);
    }
}

template <int D, typename T, typename G>
__device__ __forceinline__ void attn_bwd_tc_dkdv(const AttnProblem& p, G* __restrict__ dk, G* __restrict__ dv,
                                                 const T* __restrict__ q, const T* __restrict__ k,
                                                 const T* __restrict__ v, const T* __restrict__ dout,
                                                 const float* __restrict__ lse, const float* __restrict__ delta,
                                                 const unsigned long long* __restrict__ q_bad,
                                                 const unsigned long long* __restrict__ do_bad, int accumulate) {
    DYNAMIC_SMEM(unsigned char, smem);
    constexpr u32 TB = BT_TILE * D * 2;
    unsigned char* ks_ = smem;
    unsigned char* vs_ = smem + TB;
    unsigned char* qs = smem + 2 * TB;
    unsigned char* dos = smem + 3 * TB;
    float* ls = reinterpret_cast<float*>(smem + 4 * TB);
    float* dls = ls + BT_TILE;
    float* scr = dls + BT_TILE;  // [4 warps][2][16][32]: Pᵀ and dSᵀ, for the correction

    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 gid = lane >> 2, tig = lane & 3;
    const u32 kt = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const u32 group = p.q_heads / p.kv_heads;
    const u64 k_head = ((u64)b * p.kv_heads + hk) * p.kv_len;
    const u32 q_tiles = (p.q_len + BT_TILE - 1) / BT_TILE;
    const u32 j_lo = kt * BT_TILE + warp * 16 + gid;  // this thread's keys: j_lo and j_lo + 8
    const float scale2 = p.scale * 1.4426950408889634f;

    bload_tile<D, T>(ks_, k + k_head * D, kt * BT_TILE, p.kv_len);
    bload_tile<D, T>(vs_, v + k_head * D, kt * BT_TILE, p.kv_len);
    cp_async_commit();

    float dka[D / 8][4], dva[D / 8][4];
    #pragma unroll
    for (u32 n = 0; n < D / 8; ++n)
        #pragma unroll
        for (u32 e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.0f;

    for (u32 g = 0; g < group; ++g) {
        const u32 h = hk * group + g;
        const u64 q_head = ((u64)b * p.q_heads + h) * p.q_len;
        const T* qg = q + q_head * D;
        const T* dog = dout + q_head * D;
        for (u32 qt = 0; qt < q_tiles; ++qt) {
            int cls = classify(p, qt, kt);
            if (cls == TILE_HIDDEN) continue;
            const u32 i0 = qt * BT_TILE;
            __syncthreads();  // every warp is done with the previous Q and dO
            bload_tile<D, T>(qs, qg, i0, p.q_len);
            bload_tile<D, T>(dos, dog, i0, p.q_len);
            cp_async_commit();
            for (u32 x = threadIdx.x; x < BT_TILE; x += BT_WARPS * 32) {
                u32 i = i0 + x;
                // LSE in base 2, for P = 2^(S·scale·log2 e − LSE·log2 e) by one ex2.approx.
                ls[x] = i < p.q_len ? lse[q_head + i] * 1.4426950408889634f : 0.0f;
                dls[x] = i < p.q_len ? delta[q_head + i] : 0.0f;
            }
            cp_async_wait_all();
            __syncthreads();
            const bool masked = cls == TILE_PARTIAL || i0 + BT_TILE > p.q_len || (kt + 1) * BT_TILE > p.kv_len;
            unsigned long long qb = 0, db = 0;
            if (cls == TILE_PARTIAL && q_bad) {
                qb = q_bad[((u64)b * p.q_heads + h) * q_tiles + qt];
                db = do_bad[((u64)b * p.q_heads + h) * q_tiles + qt];
                if (qb | db) {
                    sanitize<D, T>(qs, qb);
                    sanitize<D, T>(dos, db);
                    __syncthreads();
                }
            }

            #pragma unroll
            for (u32 half = 0; half < 2; ++half) {
                // Sᵀ and dPᵀ: 16 keys × 32 queries.
                float st[4][4], dpt[4][4];
                #pragma unroll
                for (u32 n = 0; n < 4; ++n)
                    #pragma unroll
                    for (u32 e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.0f;
                #pragma unroll
                for (u32 ks = 0; ks < D / 16; ++ks) {
                    u32 ka[4], va[4];
                    u32 r = warp * 16 + (lane & 15), c = 2 * ks + (lane >> 4);
                    ldmatrix_x4(ka, ks_ + bswz<D>(r, c));
                    ldmatrix_x4(va, vs_ + bswz<D>(r, c));
                    #pragma unroll
                    for (u32 n = 0; n < 4; ++n) {
                        u32 qb2[2], db2[2];
                        u32 row = half * 32 + n * 8 + (lane & 7), ch = 2 * ks + ((lane >> 3) & 1);
                        ldmatrix_x2(qb2, qs + bswz<D>(row, ch));
                        ldmatrix_x2(db2, dos + bswz<D>(row, ch));
                        mma_16816<T>(st[n], ka, qb2, st[n]);
                        mma_16816<T>(dpt[n], va, db2, dpt[n]);
                    }
                }
                // Pᵀ and dSᵀ.
                #pragma unroll
                for (u32 n = 0; n < 4; ++n) {
                    #pragma unroll
                    for (u32 e = 0; e < 4; ++e) {
                        u32 jl = (e < 2) ? 0 : 8;
                        u32 j = j_lo + jl;
                        u32 il = half * 32 + n * 8 + 2 * tig + (e & 1);
                        u32 i = i0 + il;
                        bool hidden = masked && (i >= p.q_len || j >= p.kv_len || !visible(p, i, j));
                        float pv = hidden ? 0.0f : ex2_approx(st[n][e] * scale2 - ls[il]);
                        float dsv = hidden ? 0.0f : pv * (dpt[n][e] - dls[il]);
                        st[n][e] = pv;
                        dpt[n][e] = dsv;
                    }
                }
                // dV += Pᵀ·dO and dK += dSᵀ·Q over the half's 32 queries (2 k-steps of 16).
                #pragma unroll
                for (u32 t = 0; t < 2; ++t) {
                    u32 pa[4], sa[4];
                    pa[0] = pack2<T>(st[2 * t][0], st[2 * t][1]);
                    pa[1] = pack2<T>(st[2 * t][2], st[2 * t][3]);
                    pa[2] = pack2<T>(st[2 * t + 1][0], st[2 * t + 1][1]);
                    pa[3] = pack2<T>(st[2 * t + 1][2], st[2 * t + 1][3]);
                    sa[0] = pack2<T>(dpt[2 * t][0], dpt[2 * t][1]);
                    sa[1] = pack2<T>(dpt[2 * t][2], dpt[2 * t][3]);
                    sa[2] = pack2<T>(dpt[2 * t + 1][0], dpt[2 * t + 1][1]);
                    sa[3] = pack2<T>(dpt[2 * t + 1][2], dpt[2 * t + 1][3]);
                    #pragma unroll
                    for (u32 n = 0; n < D / 8; n += 2) {
                        u32 r = half * 32 + 16 * t + (lane & 7) + 8 * ((lane >> 3) & 1);
                        u32 c = n + (lane >> 4);
                        u32 ob[4], qbf[4];
                        ldmatrix_x4_trans(ob, dos + bswz<D>(r, c));
                        ldmatrix_x4_trans(qbf, qs + bswz<D>(r, c));
                        const u32 o0[2] = {ob[0], ob[1]}, o1[2] = {ob[2], ob[3]};
                        const u32 q0[2] = {qbf[0], qbf[1]}, q1[2] = {qbf[2], qbf[3]};
                        mma_16816<T>(dva[n], pa, o0, dva[n]);
                        mma_16816<T>(dva[n + 1], pa, o1, dva[n + 1]);
                        mma_16816<T>(dka[n], sa, q0, dka[n]);
                        mma_16816<T>(dka[n + 1], sa, q1, dka[n + 1]);
                    }
                }
                if (qb | db) {
                    // Add back what the zeroed elements contribute to visible pairs (see the header). Pᵀ and dSᵀ go
                    // through shared memory (this warp's 16 × 32 each), so that no register array is indexed at run
                    // time.
                    float* ps = scr + warp * 2 * 16 * 32;
                    float* ss = ps + 16 * 32;
#pragma unroll
                    for (u32 n = 0; n < 4; ++n)
#pragma unroll
                        for (u32 e = 0; e < 4; ++e) {
                            u32 at = (gid + 8 * (e >> 1)) * 32 + n * 8 + 2 * tig + (e & 1);
                            ps[at] = st[n][e];
                            ss[at] = dpt[n][e];
                        }
                    __syncwarp();
                    for (u32 col = 0; col < 32; ++col) {
                        u32 il = half * 32 + col;
                        bool qf = (qb >> il) & 1ull, df = (db >> il) & 1ull;
                        if (!(qf || df)) continue;
                        u32 i = i0 + il;
#pragma unroll
                        for (u32 hf = 0; hf < 2; ++hf) {
                            float pv = ps[(gid + 8 * hf) * 32 + col];
                            float dsv = ss[(gid + 8 * hf) * 32 + col];
                            u32 j = j_lo + 8 * hf;
                            bool seen = i < p.q_len && j < p.kv_len && visible(p, i, j);
#pragma unroll
                            for (u32 n = 0; n < D / 8; ++n) {
#pragma unroll
                                for (u32 e = 0; e < 2; ++e) {
                                    u32 d = n * 8 + 2 * tig + e;
                                    float qx = seen ? to_f32(qg[(u64)i * D + d]) : 0.0f;
                                    float dx = seen ? to_f32(dog[(u64)i * D + d]) : 0.0f;
                                    if (seen && qf && !isfinite(qx)) dka[n][2 * hf + e] += dsv * qx;
                                    if (seen && df && !isfinite(dx)) dva[n][2 * hf + e] += pv * dx;
                                }
                            }
                        }
                    }
                    __syncwarp();
                }
            }
        }
    }
    cp_async_wait_all();

    #pragma unroll
    for (u32 hf = 0; hf < 2; ++hf) {
        u32 j = j_lo + 8 * hf;
        if (j >= p.kv_len) continue;
        #pragma unroll
        for (u32 n = 0; n < D / 8; ++n) {
            #pragma unroll
            for (u32 e = 0; e < 2; ++e) {
                u64 at = (k_head + j) * D + n * 8 + 2 * tig + e;
                store_grad(dk + at, dka[n][2 * hf + e] * p.scale, accumulate != 0);
                store_grad(dv + at, dva[n][2 * hf + e], accumulate != 0);
            }
        }
    }
}

template <int D, typename T, typename G>
__device__ __forceinline__ void attn_bwd_tc_dq(const AttnProblem& p, G* __restrict__ dq, const T* __restrict__ q,
                                               const T* __restrict__ k, const T* __restrict__ v,
                                               const T* __restrict__ dout, const float* __restrict__ lse,
                                               const float* __restrict__ delta,
                                               const unsigned long long* __restrict__ k_bad, int accumulate) {
    DYNAMIC_SMEM(unsigned char, smem);
    constexpr u32 TB = BT_TILE * D * 2;
    unsigned char* qs = smem;
    unsigned char* dos = smem + TB;
    unsigned char* ks_ = smem + 2 * TB;
    unsigned char* vs_ = smem + 3 * TB;
    float* scr = reinterpret_cast<float*>(smem + 4 * TB);  // [4 warps][16][32]: dS, for the correction

    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 gid = lane >> 2, tig = lane & 3;
    const u32 qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const u32 hk = h / (p.q_heads / p.kv_heads);
    const u64 q_head = ((u64)b * p.q_heads + h) * p.q_len;
    const u64 k_head = ((u64)b * p.kv_heads + hk) * p.kv_len;
    const T* kg = k + k_head * D;
    const u32 k_tiles = (p.kv_len + BT_TILE - 1) / BT_TILE;
    const u32 i_lo = qt * BT_TILE + warp * 16 + gid;  // this thread's rows: i_lo and i_lo + 8
    const float scale2 = p.scale * 1.4426950408889634f;

    bload_tile<D, T>(qs, q + q_head * D, qt * BT_TILE, p.q_len);
    bload_tile<D, T>(dos, dout + q_head * D, qt * BT_TILE, p.q_len);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    u32 qf[D / 16][4], df[D / 16][4];
    #pragma unroll
    for (u32 ks = 0; ks < D / 16; ++ks) {
        u32 r = warp * 16 + (lane & 15), c = 2 * ks + (lane >> 4);
        ldmatrix_x4(qf[ks], qs + bswz<D>(r, c));
        ldmatrix_x4(df[ks], dos + bswz<D>(r, c));
    }
    float lr[2], dl[2];
    #pragma unroll
    for (u32 hf = 0; hf < 2; ++hf) {
        u32 i = i_lo + 8 * hf;
        lr[hf] = i < p.q_len ? lse[q_head + i] * 1.4426950408889634f : 0.0f;
        dl[hf] = i < p.q_len ? delta[q_head + i] : 0.0f;
    }

    float dqa[D / 8][4];
    #pragma unroll
    for (u32 n = 0; n < D / 8; ++n)
        #pragma unroll
        for (u32 e = 0; e < 4; ++e) dqa[n][e] = 0.0f;

    for (u32 kt = 0; kt < k_tiles; ++kt) {
        int cls = classify(p, qt, kt);
        if (cls == TILE_HIDDEN) continue;
        const u32 j0 = kt * BT_TILE;
        __syncthreads();  // every warp is done with the previous K and V
        bload_tile<D, T>(ks_, kg, j0, p.kv_len);
        bload_tile<D, T>(vs_, v + k_head * D, j0, p.kv_len);
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
        const bool masked = cls == TILE_PARTIAL || j0 + BT_TILE > p.kv_len || (qt + 1) * BT_TILE > p.q_len;
        unsigned long long kb = (cls == TILE_PARTIAL && k_bad) ? k_bad[((u64)b * p.kv_heads + hk) * k_tiles + kt] : 0ull;
        if (kb) {
            sanitize<D, T>(ks_, kb);
            __syncthreads();
        }
        #pragma unroll
        for (u32 half = 0; half < 2; ++half) {
            float s[4][4], dp[4][4];
            #pragma unroll
            for (u32 n = 0; n < 4; ++n)
                #pragma unroll
                for (u32 e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
            #pragma unroll
            for (u32 n = 0; n < 4; ++n) {
                #pragma unroll
                for (u32 ks = 0; ks < D / 16; ks += 2) {
                    u32 kb4[4], vb4[4];
                    u32 row = half * 32 + n * 8 + (lane & 7), ch = 2 * ks + (lane >> 3);
                    ldmatrix_x4(kb4, ks_ + bswz<D>(row, ch));
                    ldmatrix_x4(vb4, vs_ + bswz<D>(row, ch));
                    const u32 k0[2] = {kb4[0], kb4[1]}, k1[2] = {kb4[2], kb4[3]};
                    const u32 v0[2] = {vb4[0], vb4[1]}, v1[2] = {vb4[2], vb4[3]};
                    mma_16816<T>(s[n], qf[ks], k0, s[n]);
                    mma_16816<T>(s[n], qf[ks + 1], k1, s[n]);
                    mma_16816<T>(dp[n], df[ks], v0, dp[n]);
                    mma_16816<T>(dp[n], df[ks + 1], v1, dp[n]);
                }
            }
            #pragma unroll
            for (u32 n = 0; n < 4; ++n) {
                #pragma unroll
                for (u32 e = 0; e < 4; ++e) {
                    u32 hf = e >> 1;
                    u32 i = i_lo + 8 * hf;
                    u32 jl = half * 32 + n * 8 + 2 * tig + (e & 1);
                    u32 j = j0 + jl;
                    bool hidden = masked && (i >= p.q_len || j >= p.kv_len || !visible(p, i, j));
                    float pv = hidden ? 0.0f : ex2_approx(s[n][e] * scale2 - lr[hf]);
                    dp[n][e] = hidden ? 0.0f : pv * (dp[n][e] - dl[hf]);
                }
            }
            // dQ += dS·K over the half's 32 keys.
            #pragma unroll
            for (u32 t = 0; t < 2; ++t) {
                u32 sa[4];
                sa[0] = pack2<T>(dp[2 * t][0], dp[2 * t][1]);
                sa[1] = pack2<T>(dp[2 * t][2], dp[2 * t][3]);
                sa[2] = pack2<T>(dp[2 * t + 1][0], dp[2 * t + 1][1]);
                sa[3] = pack2<T>(dp[2 * t + 1][2], dp[2 * t + 1][3]);
                #pragma unroll
                for (u32 n = 0; n < D / 8; n += 2) {
                    u32 r = half * 32 + 16 * t + (lane & 7) + 8 * ((lane >> 3) & 1);
                    u32 kbt[4];
                    ldmatrix_x4_trans(kbt, ks_ + bswz<D>(r, n + (lane >> 4)));
                    const u32 b0[2] = {kbt[0], kbt[1]}, b1[2] = {kbt[2], kbt[3]};
                    mma_16816<T>(dqa[n], sa, b0, dqa[n]);
                    mma_16816<T>(dqa[n + 1], sa, b1, dqa[n + 1]);
                }
            }
            if (kb) {
                float* ss = scr + warp * 16 * 32;
#pragma unroll
                for (u32 n = 0; n < 4; ++n)
#pragma unroll
                    for (u32 e = 0; e < 4; ++e) ss[(gid + 8 * (e >> 1)) * 32 + n * 8 + 2 * tig + (e & 1)] = dp[n][e];
                __syncwarp();
                for (u32 col = 0; col < 32; ++col) {
                    u32 jl = half * 32 + col;
                    if (!((kb >> jl) & 1ull)) continue;
                    u32 j = j0 + jl;
#pragma unroll
                    for (u32 hf = 0; hf < 2; ++hf) {
                        float dsv = ss[(gid + 8 * hf) * 32 + col];
                        u32 i = i_lo + 8 * hf;
                        bool seen = i < p.q_len && j < p.kv_len && visible(p, i, j);
#pragma unroll
                        for (u32 n = 0; n < D / 8; ++n) {
#pragma unroll
                            for (u32 e = 0; e < 2; ++e) {
                                float x = seen ? to_f32(kg[(u64)j * D + n * 8 + 2 * tig + e]) : 0.0f;
                                if (seen && !isfinite(x)) dqa[n][2 * hf + e] += dsv * x;
                            }
                        }
                    }
                }
                __syncwarp();
            }
        }
    }

    #pragma unroll
    for (u32 hf = 0; hf < 2; ++hf) {
        u32 i = i_lo + 8 * hf;
        if (i >= p.q_len) continue;
        #pragma unroll
        for (u32 n = 0; n < D / 8; ++n) {
            #pragma unroll
            for (u32 e = 0; e < 2; ++e) {
                store_grad(dq + (q_head + i) * D + n * 8 + 2 * tig + e, dqa[n][2 * hf + e] * p.scale, accumulate != 0);
            }
        }
    }
}

// attn_bwd_tc_{dkdv,dq}_<inputs>_d<D>_<gradients>.
#define BWD_TC(tn, tt, dd, gn, gt)                                                                                  \
    extern "C" __global__ void __launch_bounds__(128, 1) attn_bwd_tc_dkdv_##tn##_d##dd##_##gn(                     \
        AttnProblem p, gt* dk, gt* dv, const tt* q, const tt* k, const tt* v, const tt* dout, const float* lse,      \
        const float* delta, const unsigned long long* q_bad, const unsigned long long* do_bad, int accumulate) {     \
        attn_bwd_tc_dkdv<dd, tt, gt>(p, dk, dv, q, k, v, dout, lse, delta, q_bad, do_bad, accumulate);              \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128, 1) attn_bwd_tc_dq_##tn##_d##dd##_##gn(                       \
        AttnProblem p, gt* dq, const tt* q, const tt* k, const tt* v, const tt* dout, const float* lse,              \
        const float* delta, const unsigned long long* k_bad, int accumulate) {                                      \
        attn_bwd_tc_dq<dd, tt, gt>(p, dq, q, k, v, dout, lse, delta, k_bad, accumulate);                            \
    }
#define BWD_TC_TYPES(tn, tt)                                                                                       \
    BWD_TC(tn, tt, 64, tn, tt) BWD_TC(tn, tt, 64, f32, float) BWD_TC(tn, tt, 128, tn, tt)                           \
    BWD_TC(tn, tt, 128, f32, float)
BWD_TC_TYPES(bf16, bf16)
BWD_TC_TYPES(f16, f16)
