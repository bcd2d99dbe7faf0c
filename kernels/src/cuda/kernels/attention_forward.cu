// Attention forward, the general path: any head dim (32..256 in steps of 8), any element types, exact masking.
//
// Pipeline: block (x = query tile of ROWS rows, y = query head, z = batch) of 4 warps; each warp owns ROWS / 4
// query rows, lane l holding elements l, l + 32, ... of each row's q and output accumulator (at most 8). Key
// tiles of KEYS rows stream through shared memory as f32 (K and V, widened once per block); a tile pair the
// summaries classify as hidden is skipped by the whole block. For each visible (row, key) pair the warp forms
// the score with a shuffle reduction and updates the row's online softmax (running max m, sum l, output o);
// a pair the mask hides is skipped, never multiplied by 0, so a non-finite value behind the mask cannot reach
// the row. At the end O = o / l and LSE = m + ln l; a row that saw no key gets O = 0 and LSE = −inf.
//
// This path is what f32 (and bf16 with an unusual head dim) runs, and the reference the tensor-core kernels are
// compared with; it is not fast.

#define FWD_ROWS 16
#define FWD_KEYS 16
#define FWD_PER_LANE 8

extern "C" __global__ void attn_fwd_general(AttnProblem p, const void* q, const void* k, const void* v, void* o,
                                            float* lse, u32 qkv_dtype, u32 o_dtype) {
    DYNAMIC_SMEM(float, smem);
    const u32 D = p.head_dim;
    float* ks = smem;                // [FWD_KEYS][D]
    float* vs = smem + FWD_KEYS * D;  // [FWD_KEYS][D]
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const u32 hk = h / (p.q_heads / p.kv_heads);
    const u64 q_base = ((u64)b * p.q_heads + h) * p.q_len;
    const u64 k_base = ((u64)b * p.kv_heads + hk) * p.kv_len;
    const u32 rows_per_warp = FWD_ROWS / 4;

    float qr[FWD_ROWS / 4][FWD_PER_LANE], acc[FWD_ROWS / 4][FWD_PER_LANE], m[FWD_ROWS / 4], l[FWD_ROWS / 4];
    for (u32 r = 0; r < rows_per_warp; ++r) {
        u32 i = qt * FWD_ROWS + warp * rows_per_warp + r;
        m[r] = NEG_INF;
        l[r] = 0.0f;
        for (u32 e = 0; e < FWD_PER_LANE; ++e) {
            u32 d = lane + 32 * e;
            qr[r][e] = (i < p.q_len && d < D) ? load_any(q, (q_base + i) * D + d, qkv_dtype) : 0.0f;
            acc[r][e] = 0.0f;
        }
    }

    const u32 k_tiles = (p.kv_len + FWD_KEYS - 1) / FWD_KEYS;
    for (u32 kt = 0; kt < k_tiles; ++kt) {
        int cls = classify(p, qt, kt);
        if (cls == TILE_HIDDEN) continue;
        const u32 j0 = kt * FWD_KEYS;
        __syncthreads();
        for (u32 x = threadIdx.x; x < FWD_KEYS * D; x += blockDim.x) {
            u32 jj = x / D, d = x % D, j = j0 + jj;
            bool in = j < p.kv_len;
            ks[x] = in ? load_any(k, (k_base + j) * D + d, qkv_dtype) : 0.0f;
            vs[x] = in ? load_any(v, (k_base + j) * D + d, qkv_dtype) : 0.0f;
        }
        __syncthreads();
        for (u32 r = 0; r < rows_per_warp; ++r) {
            u32 i = qt * FWD_ROWS + warp * rows_per_warp + r;
            if (i >= p.q_len) continue;
            for (u32 jj = 0; jj < FWD_KEYS; ++jj) {
                u32 j = j0 + jj;
                if (j >= p.kv_len) break;
                if (cls == TILE_PARTIAL && !visible(p, i, j)) continue;
                float dot = 0.0f;
                for (u32 e = 0; e < FWD_PER_LANE; ++e) {
                    u32 d = lane + 32 * e;
                    if (d < D) dot += qr[r][e] * ks[jj * D + d];
                }
                float s = warp_sum(dot) * p.scale;
                float m_new = fmaxf(m[r], s);
                float alpha = m[r] == m_new ? 1.0f : expf(m[r] - m_new);
                float pj = s == NEG_INF ? 0.0f : expf(s - m_new);
                l[r] = l[r] * alpha + pj;
                for (u32 e = 0; e < FWD_PER_LANE; ++e) {
                    u32 d = lane + 32 * e;
                    if (d < D) acc[r][e] = acc[r][e] * alpha + pj * vs[jj * D + d];
                }
                m[r] = m_new;
            }
        }
    }

    for (u32 r = 0; r < rows_per_warp; ++r) {
        u32 i = qt * FWD_ROWS + warp * rows_per_warp + r;
        if (i >= p.q_len) continue;
        bool none = l[r] == 0.0f;
        for (u32 e = 0; e < FWD_PER_LANE; ++e) {
            u32 d = lane + 32 * e;
            if (d < D) store_any(o, (q_base + i) * D + d, o_dtype, none ? 0.0f : acc[r][e] / l[r], false);
        }
        if (lane == 0) lse[q_base + i] = none ? NEG_INF : m[r] + logf(l[r]);
    }
}
