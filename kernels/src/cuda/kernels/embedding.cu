// Token embedding, forward and backward (the formulas are in the CPU backend's ops/embedding.rs).
//
// Forward: one thread per output element, out[t, c] = table[ids[t], c].
//
// Backward, deterministic: the host sorts the tokens by id (a counting sort, stable in token order) and uploads
// the sorted token list, each distinct id's run of it and the ids. One block per distinct id (blocks stride over
// them), threads over the columns: each column of the id's row sums its tokens' gradients in token order, in
// f32, starting from the row's value (GradMode::Accumulate; rows of ids no token has are zeroed by the host
// before, under GradMode::Overwrite). The CPU sums in the same order, so the two agree bit for bit.

template <typename T>
__device__ __forceinline__ void embedding_fwd(T* __restrict__ out, const u32* __restrict__ ids,
                                              const T* __restrict__ table, u64 tokens, u32 c) {
    u64 n = tokens * c;
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (u64)gridDim.x * blockDim.x) {
        u64 t = j / c, k = j % c;
        out[j] = table[(u64)ids[t] * c + k];
    }
}

template <typename T, typename G>
__device__ __forceinline__ void embedding_bwd(G* __restrict__ dtable, const T* __restrict__ dout,
                                              const u32* __restrict__ order, const u32* __restrict__ starts,
                                              const u32* __restrict__ uniq, u32 distinct, u32 c, int accumulate) {
    for (u32 u = blockIdx.x; u < distinct; u += gridDim.x) {
        G* row = dtable + (u64)uniq[u] * c;
        for (u32 k = threadIdx.x; k < c; k += blockDim.x) {
            float acc = accumulate ? to_f32(row[k]) : 0.0f;
            for (u32 j = starts[u]; j < starts[u + 1]; ++j) acc += to_f32(dout[(u64)order[j] * c + k]);
            row[k] = from_f32<G>(acc);
        }
    }
}

#define EMB_FWD(tn, tt)                                                                                   \
    extern "C" __global__ void embedding_fwd_##tn(tt* out, const u32* ids, const tt* table, u64 tokens, u32 c) { \
        embedding_fwd<tt>(out, ids, table, tokens, c);                                                     \
    }
EMB_FWD(f32, float)
EMB_FWD(bf16, bf16)
EMB_FWD(f16, f16)

#define EMB_BWD(tn, tt, gn, gt)                                                                                  \
    extern "C" __global__ void embedding_bwd_##tn##_##gn(gt* dtable, const tt* dout, const u32* order,          \
                                                         const u32* starts, const u32* uniq, u32 distinct, u32 c, \
                                                         int accumulate) {                                       \
        embedding_bwd<tt, gt>(dtable, dout, order, starts, uniq, distinct, c, accumulate);                       \
    }
EMB_BWD(f32, float, f32, float)
EMB_BWD(bf16, bf16, f32, float)
EMB_BWD(f16, f16, f32, float)
EMB_BWD(f32, float, bf16, bf16)
EMB_BWD(bf16, bf16, bf16, bf16)
EMB_BWD(f16, f16, bf16, bf16)
EMB_BWD(f32, float, f16, f16)
EMB_BWD(bf16, bf16, f16, f16)
EMB_BWD(f16, f16, f16, f16)
