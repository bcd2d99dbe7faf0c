// Mixture-of-experts routing, dispatch and combine (the formulas are in the CPU backend's ops/moe.rs).
//
// - router_fwd: one thread per token (E is small): the softmax of its logits in f32 as the CPU computes it
//   (max, exp, sum, divide), its top-k by repeated selection (strictly greater wins, so ties go to the lower
//   index), the weights renormalised; the choices are written for the host, which builds the dispatch order.
// - router_prob_sum: one thread per expert sums its probabilities over tokens in token order in f64 (the CPU's
//   order).
// - router_bwd: one thread per token.
// - gather: one thread per element of the dispatched rows.
// - sum_rows (gather's backward, and combine): one thread per output element sums the token's dispatched rows in
//   ascending row order (so ascending expert order), each times its routing weight (or 1).
// - combine_bwd: one warp per dispatched row: dye = w·dout[token] element-wise, and the dot ⟨dout[token], ye⟩
//   reduced across the warp in a fixed order, written to the row's routing slot.

template <typename T>
__device__ __forceinline__ void router_fwd(float* __restrict__ probs, float* __restrict__ weights,
                                           u32* __restrict__ choice, const T* __restrict__ logits, u32 l, u32 e,
                                           u32 k) {
    for (u32 t = blockIdx.x * blockDim.x + threadIdx.x; t < l; t += gridDim.x * blockDim.x) {
        const T* x = logits + (u64)t * e;
        float* p = probs + (u64)t * e;
        float mx = NEG_INF;
        for (u32 i = 0; i < e; ++i) mx = fmaxf(mx, to_f32(x[i]));
        float sum = 0.0f;
        for (u32 i = 0; i < e; ++i) {
            p[i] = expf(to_f32(x[i]) - mx);
            sum += p[i];
        }
        for (u32 i = 0; i < e; ++i) p[i] /= sum;
        u32* c = choice + (u64)t * k;
        float* w = weights + (u64)t * k;
        float total = 0.0f;
        for (u32 j = 0; j < k; ++j) {
            int best = -1;
            for (u32 i = 0; i < e; ++i) {
                bool taken = false;
                for (u32 m = 0; m < j; ++m) taken = taken || c[m] == i;
                if (taken) continue;
                if (best < 0 || p[i] > p[best]) best = (int)i;
            }
            if (best < 0) best = 0;
            c[j] = (u32)best;
            w[j] = p[best];
            total += p[best];
        }
        for (u32 j = 0; j < k; ++j) w[j] /= total;
    }
}

extern "C" __global__ void router_prob_sum(double* out, const float* probs, u32 l, u32 e) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < e; i += gridDim.x * blockDim.x) {
        double s = 0.0;
        for (u32 t = 0; t < l; ++t) s += (double)probs[(u64)t * e + i];
        out[i] = s;
    }
}

template <typename T>
__device__ __forceinline__ void router_bwd(T* __restrict__ dlogits, const float* __restrict__ dweights,
                                           const float* __restrict__ aux, const float* __restrict__ probs,
                                           const float* __restrict__ weights, const u32* __restrict__ choice,
                                           float* __restrict__ dp_scratch, u32 l, u32 e, u32 k) {
    for (u32 t = blockIdx.x * blockDim.x + threadIdx.x; t < l; t += gridDim.x * blockDim.x) {
        const float* p = probs + (u64)t * e;
        const float* w = weights + (u64)t * k;
        const float* dw = dweights + (u64)t * k;
        const u32* c = choice + (u64)t * k;
        float* dp = dp_scratch + (u64)t * e;
        for (u32 i = 0; i < e; ++i) dp[i] = aux ? aux[i] : 0.0f;
        float total = 0.0f, g = 0.0f;
        for (u32 j = 0; j < k; ++j) total += p[c[j]];
        for (u32 j = 0; j < k; ++j) g += dw[j] * w[j];
        for (u32 j = 0; j < k; ++j) dp[c[j]] += (dw[j] - g) / total;
        float dot = 0.0f;
        for (u32 i = 0; i < e; ++i) dot += p[i] * dp[i];
        for (u32 i = 0; i < e; ++i) dlogits[(u64)t * e + i] = from_f32<T>(p[i] * (dp[i] - dot));
    }
}

template <typename T>
__device__ __forceinline__ void gather(T* __restrict__ xe, const T* __restrict__ x, const u32* __restrict__ rows,
                                       u64 n, u32 c) {
    u64 total = n * c;
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < total; j += (u64)gridDim.x * blockDim.x) {
        u64 r = j / c, i = j % c;
        xe[j] = x[(u64)rows[r] * c + i];
    }
}

// out[t, :] = Σ_j w(n)·ye[n, :] over the token's rows n = inv[t·K + j] (ascending); w = weights[slots[n]] or 1.
template <typename T>
__device__ __forceinline__ void sum_rows(T* __restrict__ out, const T* __restrict__ ye, const float* __restrict__ weights,
                                         const u32* __restrict__ inv, const u32* __restrict__ slots, u32 l, u32 k,
                                         u32 c) {
    u64 total = (u64)l * c;
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < total; j += (u64)gridDim.x * blockDim.x) {
        u64 t = j / c, i = j % c;
        float acc = 0.0f;
        for (u32 m = 0; m < k; ++m) {
            u32 n = inv[t * k + m];
            float w = weights ? weights[slots[n]] : 1.0f;
            acc += w * to_f32(ye[(u64)n * c + i]);
        }
        out[j] = from_f32<T>(acc);
    }
}

template <typename T>
__device__ __forceinline__ void combine_bwd(T* __restrict__ dye, float* __restrict__ dweights,
                                            const T* __restrict__ dout, const T* __restrict__ ye,
                                            const float* __restrict__ weights, const u32* __restrict__ rows,
                                            const u32* __restrict__ slots, u64 n, u32 c) {
    u32 lane = threadIdx.x & 31;
    u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 r = warp; r < n; r += warps) {
        u64 t = rows[r];
        float w = weights[slots[r]];
        float dot = 0.0f;
        for (u32 i = lane; i < c; i += 32) {
            float g = to_f32(dout[t * c + i]);
            dye[r * c + i] = from_f32<T>(w * g);
            dot += g * to_f32(ye[r * c + i]);
        }
        dot = warp_sum(dot);
        if (lane == 0) dweights[slots[r]] = dot;
    }
}

#define MOE(tn, tt)                                                                                                   \
    extern "C" __global__ void router_fwd_##tn(float* probs, float* weights, u32* choice, const tt* logits, u32 l,   \
                                               u32 e, u32 k) {                                                        \
        router_fwd<tt>(probs, weights, choice, logits, l, e, k);                                                      \
    }                                                                                                                 \
    extern "C" __global__ void router_bwd_##tn(tt* dlogits, const float* dweights, const float* aux,                 \
                                               const float* probs, const float* weights, const u32* choice,          \
                                               float* dp_scratch, u32 l, u32 e, u32 k) {                              \
        router_bwd<tt>(dlogits, dweights, aux, probs, weights, choice, dp_scratch, l, e, k);                          \
    }                                                                                                                 \
    extern "C" __global__ void moe_gather_##tn(tt* xe, const tt* x, const u32* rows, u64 n, u32 c) {                 \
        gather<tt>(xe, x, rows, n, c);                                                                                \
    }                                                                                                                 \
    extern "C" __global__ void moe_sum_rows_##tn(tt* out, const tt* ye, const float* weights, const u32* inv,       \
                                                 const u32* slots, u32 l, u32 k, u32 c) {                             \
        sum_rows<tt>(out, ye, weights, inv, slots, l, k, c);                                                          \
    }                                                                                                                 \
    extern "C" __global__ void moe_combine_bwd_##tn(tt* dye, float* dweights, const tt* dout, const tt* ye,          \
                                                    const float* weights, const u32* rows, const u32* slots, u64 n,   \
                                                    u32 c) {                                                          \
        combine_bwd<tt>(dye, dweights, dout, ye, weights, rows, slots, n, c);                                         \
    }
MOE(f32, float)
MOE(bf16, bf16)
MOE(f16, f16)
