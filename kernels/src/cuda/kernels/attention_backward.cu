// Attention backward, the general path: any head dim, any element types, exact masking, deterministic (every
// output element is written by one warp, which sums in a fixed order; no atomics).
//
// Pipeline, three kernels:
// 1. attn_bwd_delta: Δ[i] = Σ_d dO[i, d]·O[i, d] (f32), one warp per query row.
// 2. attn_bwd_dq: block (query tile, query head, batch) as the forward's; key tiles (K and V as f32) stream
//    through shared memory; per visible (row i, key j): s = q·k·scale, P = exp(s − LSE[i]), dP = dO[i]·V[j],
//    dS = P·(dP − Δ[i]), dq += dS·K[j]; at the end dQ = dq·scale, written or added (GradMode).
// 3. attn_bwd_dkdv: block (key tile, key/value head, batch) of 4 warps, each owning key rows; the query tiles of
//    every query head of the group stream through shared memory (Q, dO as f32, with LSE and Δ); per visible
//    (i, j): the same P and dS, dv += P·dO[i], dk += dS·Q[i]; at the end dK = dk·scale and dV = dv.
// Hidden tile pairs are skipped; a pair the mask hides is never touched, so non-finite values stay confined.

#define BWD_ROWS 16
#define BWD_PER_LANE 8

extern "C" __global__ void attn_bwd_delta(float* delta, const void* o, const void* dout, u64 rows, u32 d,
                                          u32 o_dtype, u32 do_dtype) {
    const u32 lane = threadIdx.x & 31;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 r = warp; r < rows; r += warps) {
        float s = 0.0f;
        for (u32 e = lane; e < d; e += 32) s += load_any(o, r * d + e, o_dtype) * load_any(dout, r * d + e, do_dtype);
        s = warp_sum(s);
        if (lane == 0) delta[r] = s;
    }
}

extern "C" __global__ void attn_bwd_dq(AttnProblem p, void* dq, const void* q, const void* k, const void* v,
                                       const void* dout, const float* lse, const float* delta, u32 qkv_dtype,
                                       u32 do_dtype, u32 dq_dtype, int accumulate) {
    DYNAMIC_SMEM(float, smem);
    const u32 D = p.head_dim;
    float* ks = smem;                 // [BWD_ROWS][D]
    float* vs = smem + BWD_ROWS * D;  // [BWD_ROWS][D]
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const u32 hk = h / (p.q_heads / p.kv_heads);
    const u64 q_base = ((u64)b * p.q_heads + h) * p.q_len;
    const u64 k_base = ((u64)b * p.kv_heads + hk) * p.kv_len;
    const u32 rows_per_warp = BWD_ROWS / 4;

    float qr[BWD_ROWS / 4][BWD_PER_LANE], dor[BWD_ROWS / 4][BWD_PER_LANE], acc[BWD_ROWS / 4][BWD_PER_LANE];
    float lr[BWD_ROWS / 4], dl[BWD_ROWS / 4];
    for (u32 r = 0; r < rows_per_warp; ++r) {
        u32 i = qt * BWD_ROWS + warp * rows_per_warp + r;
        bool in = i < p.q_len;
        lr[r] = in ? lse[q_base + i] : 0.0f;
        dl[r] = in ? delta[q_base + i] : 0.0f;
        for (u32 e = 0; e < BWD_PER_LANE; ++e) {
            u32 d = lane + 32 * e;
            bool ok = in && d < D;
            qr[r][e] = ok ? load_any(q, (q_base + i) * D + d, qkv_dtype) : 0.0f;
            dor[r][e] = ok ? load_any(dout, (q_base + i) * D + d, do_dtype) : 0.0f;
            acc[r][e] = 0.0f;
        }
    }

    const u32 k_tiles = (p.kv_len + BWD_ROWS - 1) / BWD_ROWS;
    for (u32 kt = 0; kt < k_tiles; ++kt) {
        int cls = classify(p, qt, kt);
        if (cls == TILE_HIDDEN) continue;
        const u32 j0 = kt * BWD_ROWS;
        __syncthreads();
        for (u32 x = threadIdx.x; x < BWD_ROWS * D; x += blockDim.x) {
            u32 jj = x / D, d = x % D, j = j0 + jj;
            bool in = j < p.kv_len;
            ks[x] = in ? load_any(k, (k_base + j) * D + d, qkv_dtype) : 0.0f;
            vs[x] = in ? load_any(v, (k_base + j) * D + d, qkv_dtype) : 0.0f;
        }
        __syncthreads();
        for (u32 r = 0; r < rows_per_warp; ++r) {
            u32 i = qt * BWD_ROWS + warp * rows_per_warp + r;
            if (i >= p.q_len) continue;
            for (u32 jj = 0; jj < BWD_ROWS; ++jj) {
                u32 j = j0 + jj;
                if (j >= p.kv_len) break;
                if (cls == TILE_PARTIAL && !visible(p, i, j)) continue;
                float sd = 0.0f, pd = 0.0f;
                for (u32 e = 0; e < BWD_PER_LANE; ++e) {
                    u32 d = lane + 32 * e;
                    if (d < D) {
                        sd += qr[r][e] * ks[jj * D + d];
                        pd += dor[r][e] * vs[jj * D + d];
                    }
                }
                float s = warp_sum(sd) * p.scale;
                float dp = warp_sum(pd);
                float pij = expf(s - lr[r]);
                float ds = pij * (dp - dl[r]);
                for (u32 e = 0; e < BWD_PER_LANE; ++e) {
                    u32 d = lane + 32 * e;
                    if (d < D) acc[r][e] += ds * ks[jj * D + d];
                }
            }
        }
    }

    for (u32 r = 0; r < rows_per_warp; ++r) {
        u32 i = qt * BWD_ROWS + warp * rows_per_warp + r;
        if (i >= p.q_len) continue;
        for (u32 e = 0; e < BWD_PER_LANE; ++e) {
            u32 d = lane + 32 * e;
            if (d < D) store_any(dq, (q_base + i) * D + d, dq_dtype, acc[r][e] * p.scale, accumulate != 0);
        }
    }
}

extern "C" __global__ void attn_bwd_dkdv(AttnProblem p, void* dk, void* dv, const void* q, const void* k,
                                         const void* v, const void* dout, const float* lse, const float* delta,
                                         u32 qkv_dtype, u32 do_dtype, u32 dk_dtype, u32 dv_dtype, int accumulate) {
    DYNAMIC_SMEM(float, smem);
    const u32 D = p.head_dim;
    float* qs = smem;                         // [BWD_ROWS][D]
    float* dos = smem + BWD_ROWS * D;         // [BWD_ROWS][D]
    float* ls = smem + 2 * BWD_ROWS * D;      // [BWD_ROWS]
    float* ds_ = ls + BWD_ROWS;               // [BWD_ROWS] (Δ)
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 kt = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const u32 group = p.q_heads / p.kv_heads;
    const u64 k_base = ((u64)b * p.kv_heads + hk) * p.kv_len;
    const u32 rows_per_warp = BWD_ROWS / 4;

    float kr[BWD_ROWS / 4][BWD_PER_LANE], vr[BWD_ROWS / 4][BWD_PER_LANE];
    float dka[BWD_ROWS / 4][BWD_PER_LANE], dva[BWD_ROWS / 4][BWD_PER_LANE];
    for (u32 r = 0; r < rows_per_warp; ++r) {
        u32 j = kt * BWD_ROWS + warp * rows_per_warp + r;
        for (u32 e = 0; e < BWD_PER_LANE; ++e) {
            u32 d = lane + 32 * e;
            bool ok = j < p.kv_len && d < D;
            kr[r][e] = ok ? load_any(k, (k_base + j) * D + d, qkv_dtype) : 0.0f;
            vr[r][e] = ok ? load_any(v, (k_base + j) * D + d, qkv_dtype) : 0.0f;
            dka[r][e] = 0.0f;
            dva[r][e] = 0.0f;
        }
    }

    const u32 q_tiles = (p.q_len + BWD_ROWS - 1) / BWD_ROWS;
    for (u32 g = 0; g < group; ++g) {
        const u32 h = hk * group + g;
        const u64 q_base = ((u64)b * p.q_heads + h) * p.q_len;
        for (u32 qt = 0; qt < q_tiles; ++qt) {
            int cls = classify(p, qt, kt);
            if (cls == TILE_HIDDEN) continue;
            const u32 i0 = qt * BWD_ROWS;
            __syncthreads();
            for (u32 x = threadIdx.x; x < BWD_ROWS * D; x += blockDim.x) {
                u32 ii = x / D, d = x % D, i = i0 + ii;
                bool in = i < p.q_len;
                qs[x] = in ? load_any(q, (q_base + i) * D + d, qkv_dtype) : 0.0f;
                dos[x] = in ? load_any(dout, (q_base + i) * D + d, do_dtype) : 0.0f;
            }
            for (u32 ii = threadIdx.x; ii < BWD_ROWS; ii += blockDim.x) {
                u32 i = i0 + ii;
                ls[ii] = i < p.q_len ? lse[q_base + i] : 0.0f;
                ds_[ii] = i < p.q_len ? delta[q_base + i] : 0.0f;
            }
            __syncthreads();
            for (u32 r = 0; r < rows_per_warp; ++r) {
                u32 j = kt * BWD_ROWS + warp * rows_per_warp + r;
                if (j >= p.kv_len) continue;
                for (u32 ii = 0; ii < BWD_ROWS; ++ii) {
                    u32 i = i0 + ii;
                    if (i >= p.q_len) break;
                    if (cls == TILE_PARTIAL && !visible(p, i, j)) continue;
                    float sd = 0.0f, pd = 0.0f;
                    for (u32 e = 0; e < BWD_PER_LANE; ++e) {
                        u32 d = lane + 32 * e;
                        if (d < D) {
                            sd += qs[ii * D + d] * kr[r][e];
                            pd += dos[ii * D + d] * vr[r][e];
                        }
                    }
                    float s = warp_sum(sd) * p.scale;
                    float dp = warp_sum(pd);
                    float pij = expf(s - ls[ii]);
                    float dsv = pij * (dp - ds_[ii]);
                    for (u32 e = 0; e < BWD_PER_LANE; ++e) {
                        u32 d = lane + 32 * e;
                        if (d < D) {
                            dva[r][e] += pij * dos[ii * D + d];
                            dka[r][e] += dsv * qs[ii * D + d];
                        }
                    }
                }
            }
        }
    }

    for (u32 r = 0; r < rows_per_warp; ++r) {
        u32 j = kt * BWD_ROWS + warp * rows_per_warp + r;
        if (j >= p.kv_len) continue;
        for (u32 e = 0; e < BWD_PER_LANE; ++e) {
            u32 d = lane + 32 * e;
            if (d < D) {
                store_any(dk, (k_base + j) * D + d, dk_dtype, dka[r][e] * p.scale, accumulate != 0);
                store_any(dv, (k_base + j) * D + d, dv_dtype, dva[r][e], accumulate != 0);
            }
        }
    }
}
