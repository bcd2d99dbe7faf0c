// Rotary position embedding in place over x[B, H, S, D] (the formulas are in ops/rope.rs).
//
// Pipeline: `rope_angles` builds this call's table once, cos and sin of pos[s]·inv_freq[i] for every position
// and frequency ([S, R/2] each), computed in f64 and multiplied by the attention factor before rounding to f32,
// exactly as the CPU's table; `rope_apply_*` then rotates, one thread per (row, pair): row = (b, h, s), pair
// (i, i + R/2) for i < R/2, dims R..D untouched (partial rotary). `sign` is +1 for the forward and -1 for the
// backward (the transposed rotation).

extern "C" __global__ void rope_angles(float* cos_t, float* sin_t, const i64* pos, const double* inv_freq, u32 s,
                                       u32 half, double attention_factor) {
    u64 n = (u64)s * half;
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (u64)gridDim.x * blockDim.x) {
        u64 si = j / half, i = j % half;
        double theta = (double)pos[si] * inv_freq[i];
        double sn, cs;
        sincos(theta, &sn, &cs);
        cos_t[j] = (float)(cs * attention_factor);
        sin_t[j] = (float)(sn * attention_factor);
    }
}

template <typename T>
__device__ __forceinline__ void rope_apply(T* __restrict__ x, const float* __restrict__ cos_t,
                                           const float* __restrict__ sin_t, u64 rows, u32 s, u32 d, u32 half,
                                           float sign) {
    u64 n = rows * half;
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (u64)gridDim.x * blockDim.x) {
        u64 row = j / half, i = j % half;
        u64 si = row % s;
        float c = cos_t[si * half + i], sn = sign * sin_t[si * half + i];
        T* xr = x + row * d;
        float x1 = to_f32(xr[i]), x2 = to_f32(xr[i + half]);
        xr[i] = from_f32<T>(x1 * c - x2 * sn);
        xr[i + half] = from_f32<T>(x2 * c + x1 * sn);
    }
}

#define ROPE(tn, tt)                                                                                         \
    extern "C" __global__ void rope_apply_##tn(tt* x, const float* cos_t, const float* sin_t, u64 rows, u32 s, \
                                               u32 d, u32 half, float sign) {                               \
        rope_apply<tt>(x, cos_t, sin_t, rows, s, d, half, sign);                                            \
    }
ROPE(f32, float)
ROPE(bf16, bf16)
ROPE(f16, f16)
