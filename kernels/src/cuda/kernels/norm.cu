// RMSNorm and LayerNorm over the last dim, forward and backward (the formulas are in ops/rmsnorm and
// ops/layernorm of the CPU backend; this file computes the same in the same precision, f32).
//
// Forward pipeline: one block per row at a time (blocks stride over rows). The block loads its row's
// elements (each thread a strided set), reduces the sum (LayerNorm) and the sum of squares with block-wide
// tree reductions, writes mean/rstd and the normalised row.
//
// Backward pipeline: block `b` owns the fixed run of rows [b·R, b·R + R) (R from the host, from the shape
// alone). Per row, two block reductions (Σg and Σg·x̂) give dx; the row's contribution to dweight (and dbias)
// is added to the block's own f32 partial row, each element by the one thread that owns that column, so no
// two threads touch one element. `norm_reduce` then sums the partial rows in block order (one thread per
// column) into dweight/dbias, added to what they held under GradMode::Accumulate: the same order on every
// run and device, as the CPU's fixed blocks of rows.

template <typename T, bool LAYERNORM>
__device__ __forceinline__ void norm_fwd(T* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd,
                                         const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                         u64 n, u32 c, float eps) {
    __shared__ float scratch[32];
    for (u64 row = blockIdx.x; row < n; row += gridDim.x) {
        const T* xr = x + row * c;
        T* yr = y + row * c;
        float mu = 0.0f;
        if (LAYERNORM) {
            float s = 0.0f;
            for (u32 i = threadIdx.x; i < c; i += blockDim.x) s += to_f32(xr[i]);
            mu = block_sum(s, scratch) / (float)c;
        }
        float ss = 0.0f;
        for (u32 i = threadIdx.x; i < c; i += blockDim.x) {
            float v = to_f32(xr[i]) - mu;
            ss += v * v;
        }
        float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)c + eps);
        if (threadIdx.x == 0) {
            rstd[row] = inv;
            if (LAYERNORM) mean[row] = mu;
        }
        for (u32 i = threadIdx.x; i < c; i += blockDim.x) {
            float v = (to_f32(xr[i]) - mu) * inv * to_f32(w[i]);
            if (LAYERNORM) v += to_f32(b[i]);
            yr[i] = from_f32<T>(v);
        }
    }
}

template <typename T, bool LAYERNORM>
__device__ __forceinline__ void norm_bwd(T* __restrict__ dx, float* __restrict__ part_w, float* __restrict__ part_b,
                                         const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                                         const float* __restrict__ mean, const float* __restrict__ rstd, u64 n, u32 c,
                                         u32 rows_per_block) {
    __shared__ float scratch[32];
    float* pw = part_w + (u64)blockIdx.x * c;
    float* pb = LAYERNORM ? part_b + (u64)blockIdx.x * c : nullptr;
    for (u32 i = threadIdx.x; i < c; i += blockDim.x) {
        pw[i] = 0.0f;
        if (LAYERNORM) pb[i] = 0.0f;
    }
    u64 first = (u64)blockIdx.x * rows_per_block;
    u64 last = first + rows_per_block < n ? first + rows_per_block : n;
    for (u64 row = first; row < last; ++row) {
        const T* xr = x + row * c;
        const T* dyr = dy + row * c;
        float mu = LAYERNORM ? mean[row] : 0.0f;
        float r = rstd[row];
        float sg = 0.0f, sgx = 0.0f;
        for (u32 i = threadIdx.x; i < c; i += blockDim.x) {
            float d = to_f32(dyr[i]);
            float xh = (to_f32(xr[i]) - mu) * r;
            float g = d * to_f32(w[i]);
            pw[i] += d * xh;
            if (LAYERNORM) pb[i] += d;
            sg += g;
            sgx += g * xh;
        }
        float mg = LAYERNORM ? block_sum(sg, scratch) / (float)c : 0.0f;
        float mgx = block_sum(sgx, scratch) / (float)c;
        for (u32 i = threadIdx.x; i < c; i += blockDim.x) {
            float xh = (to_f32(xr[i]) - mu) * r;
            float g = to_f32(dyr[i]) * to_f32(w[i]);
            dx[row * c + i] = from_f32<T>(r * (g - mg - xh * mgx));
        }
    }
}

// dst[c] (+)= Σ_b partials[b, c], blocks in order.
template <typename G>
__device__ __forceinline__ void norm_reduce(G* __restrict__ dst, const float* __restrict__ partials, u32 blocks, u32 c,
                                            int accumulate) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < c; i += gridDim.x * blockDim.x) {
        float acc = accumulate ? to_f32(dst[i]) : 0.0f;
        for (u32 b = 0; b < blocks; ++b) acc += partials[(u64)b * c + i];
        dst[i] = from_f32<G>(acc);
    }
}

#define NORMS(tn, tt)                                                                                             \
    extern "C" __global__ void rmsnorm_fwd_##tn(tt* y, float* rstd, const tt* x, const tt* w, u64 n, u32 c,       \
                                                float eps) {                                                      \
        norm_fwd<tt, false>(y, nullptr, rstd, x, w, nullptr, n, c, eps);                                          \
    }                                                                                                             \
    extern "C" __global__ void layernorm_fwd_##tn(tt* y, float* mean, float* rstd, const tt* x, const tt* w,     \
                                                  const tt* b, u64 n, u32 c, float eps) {                         \
        norm_fwd<tt, true>(y, mean, rstd, x, w, b, n, c, eps);                                                    \
    }                                                                                                             \
    extern "C" __global__ void rmsnorm_bwd_##tn(tt* dx, float* part_w, const tt* dy, const tt* x, const tt* w,   \
                                                const float* rstd, u64 n, u32 c, u32 rows_per_block) {            \
        norm_bwd<tt, false>(dx, part_w, nullptr, dy, x, w, nullptr, rstd, n, c, rows_per_block);                  \
    }                                                                                                             \
    extern "C" __global__ void layernorm_bwd_##tn(tt* dx, float* part_w, float* part_b, const tt* dy, const tt* x, \
                                                  const tt* w, const float* mean, const float* rstd, u64 n, u32 c, \
                                                  u32 rows_per_block) {                                           \
        norm_bwd<tt, true>(dx, part_w, part_b, dy, x, w, mean, rstd, n, c, rows_per_block);                       \
    }                                                                                                             \
    extern "C" __global__ void norm_reduce_##tn(tt* dst, const float* partials, u32 blocks, u32 c, int accumulate) { \
        norm_reduce<tt>(dst, partials, blocks, c, accumulate);                                                    \
    }

NORMS(f32, float)
NORMS(bf16, bf16)
NORMS(f16, f16)
