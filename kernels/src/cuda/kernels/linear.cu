// What a linear layer needs besides cuBLASLt's products: the bias gradient, dbias[o] (+)= Σ_t dy[t, o].
//
// One thread per output column sums its column over the rows in row order, in f32 (reads are coalesced across
// the threads of a block: a warp reads 32 consecutive columns of one row), starting from dbias under
// GradMode::Accumulate. Deterministic: one thread per element, a fixed order.

template <typename T, typename G>
__device__ __forceinline__ void bias_grad(G* __restrict__ dbias, const T* __restrict__ dy, u64 rows, u32 cols,
                                          int accumulate) {
    for (u32 o = blockIdx.x * blockDim.x + threadIdx.x; o < cols; o += gridDim.x * blockDim.x) {
        float acc = accumulate ? to_f32(dbias[o]) : 0.0f;
        for (u64 t = 0; t < rows; ++t) acc += to_f32(dy[t * cols + o]);
        dbias[o] = from_f32<G>(acc);
    }
}

#define BIAS_GRAD(tn, tt, gn, gt)                                                                               \
    extern "C" __global__ void bias_grad_##tn##_##gn(gt* dbias, const tt* dy, u64 rows, u32 cols, int accumulate) { \
        bias_grad<tt, gt>(dbias, dy, rows, cols, accumulate);                                                   \
    }
BIAS_GRAD(f32, float, f32, float)
BIAS_GRAD(bf16, bf16, f32, float)
BIAS_GRAD(f16, f16, f32, float)
BIAS_GRAD(f32, float, bf16, bf16)
BIAS_GRAD(bf16, bf16, bf16, bf16)
BIAS_GRAD(f16, f16, bf16, bf16)
BIAS_GRAD(f32, float, f16, f16)
BIAS_GRAD(bf16, bf16, f16, f16)
BIAS_GRAD(f16, f16, f16, f16)
