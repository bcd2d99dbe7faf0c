// Which rows of an attention input hold a non-finite value, as one 64-bit mask per tile of 64 rows of one head:
// what the tensor-core kernels read to keep a NaN or an infinity behind the mask (see attention_forward_tc.cu).
//
// Pipeline: one warp per row (warps stride over rows); the lanes test the row's elements (bf16: exponent bits all
// ones), and lane 0 sets the row's bit with an atomic OR. The masks must be zeroed before (the host does).

template <typename T>
__device__ __forceinline__ bool finite_el(T x);
template <>
__device__ __forceinline__ bool finite_el<float>(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}
template <>
__device__ __forceinline__ bool finite_el<bf16>(bf16 x) {
    return isfinite(to_f32(x));
}
template <>
__device__ __forceinline__ bool finite_el<f16>(f16 x) {
    return isfinite(to_f32(x));
}

// x is [heads, len, d] (batch and heads flattened); masks is [heads, ceil(len / 64)].
template <typename T>
__device__ __forceinline__ void nonfinite_rows(unsigned long long* masks, const T* x, u64 heads, u32 len, u32 d) {
    const u32 lane = threadIdx.x & 31;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 rows = heads * len;
    const u64 tiles = (len + 63) / 64;
    for (u64 r = warp; r < rows; r += warps) {
        bool bad = false;
        for (u32 e = lane; e < d; e += 32) bad = bad || !finite_el(x[r * d + e]);
        bool any = __any_sync(FULL_MASK, bad);
        if (lane == 0 && any) {
            u64 h = r / len, s = r % len;
            atomicOr(&masks[h * tiles + s / 64], 1ull << (s % 64));
        }
    }
}

extern "C" __global__ void nonfinite_rows_f32(unsigned long long* masks, const float* x, u64 heads, u32 len, u32 d) {
    nonfinite_rows<float>(masks, x, heads, len, d);
}
extern "C" __global__ void nonfinite_rows_bf16(unsigned long long* masks, const bf16* x, u64 heads, u32 len, u32 d) {
    nonfinite_rows<bf16>(masks, x, heads, len, d);
}
extern "C" __global__ void nonfinite_rows_f16(unsigned long long* masks, const f16* x, u64 heads, u32 len, u32 d) {
    nonfinite_rows<f16>(masks, x, heads, len, d);
}
