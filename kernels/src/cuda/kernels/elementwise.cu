// Element-wise ops and reductions over flat buffers: copy with conversion, fill, add, scale, the sum of
// squares, the middle-dims transpose, SwiGLU and squared ReLU with their backward, and the AdamW step.
//
// Pipeline: one thread per element in a grid-stride loop (each thread visits i, i + stride, ...), so any grid
// covers any length; the host picks the grid from the length alone. Every element is computed and stored by
// one thread in f32 and rounded to its storage type on store (round to nearest even), as the CPU does.
//
// The sum of squares is deterministic: a fixed number of blocks (chosen from the length, not the device),
// each thread summing its grid-stride elements in order in f64, a fixed-order tree within the block, one f64
// partial per block; a second one-block pass sums the partials in block order.
//
// Kernel names end in the storage types of their pointer arguments, outputs first: `copy_bf16_f32` writes
// bf16 from f32.

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

template <typename D, typename S>
__device__ __forceinline__ void copy_impl(D* __restrict__ dst, const S* __restrict__ src, u64 n) {
    GRID_STRIDE(i, n) { dst[i] = from_f32<D>(to_f32(src[i])); }
}

template <typename D>
__device__ __forceinline__ void fill_impl(D* __restrict__ dst, float value, u64 n) {
    D v = from_f32<D>(value);
    GRID_STRIDE(i, n) { dst[i] = v; }
}

template <typename D, typename S>
__device__ __forceinline__ void add_impl(D* __restrict__ dst, const S* __restrict__ src, u64 n) {
    GRID_STRIDE(i, n) { dst[i] = from_f32<D>(to_f32(dst[i]) + to_f32(src[i])); }
}

template <typename D>
__device__ __forceinline__ void scale_impl(D* __restrict__ x, float a, u64 n) {
    GRID_STRIDE(i, n) { x[i] = from_f32<D>(to_f32(x[i]) * a); }
}

// One f64 partial per block: the squares of the block's grid-stride elements.
template <typename S>
__device__ __forceinline__ void sum_squares_impl(double* __restrict__ partials, const S* __restrict__ x, u64 n) {
    __shared__ double warp_sums[32];
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        double v = (double)to_f32(x[i]);
        acc += v * v;
    }
    acc = warp_sum(acc);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        int warps = (blockDim.x + 31) >> 5;
        double v = lane < warps ? warp_sums[lane] : 0.0;
        v = warp_sum(v);
        if (lane == 0) partials[blockIdx.x] = v;
    }
}

// dst[a, c, b, d] = src[a, b, c, d]: one thread per destination element.
template <typename D, typename S>
__device__ __forceinline__ void transpose12_impl(D* __restrict__ dst, const S* __restrict__ src, u64 A, u64 B, u64 C,
                                                 u64 Dd) {
    u64 n = A * B * C * Dd;
    GRID_STRIDE(i, n) {
        u64 d = i % Dd;
        u64 r = i / Dd;  // destination row (a, c, b)
        u64 b = r % B;
        u64 ac = r / B;
        u64 c = ac % C;
        u64 a = ac / C;
        dst[i] = from_f32<D>(to_f32(src[((a * B + b) * C + c) * Dd + d]));
    }
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

template <typename T>
__device__ __forceinline__ void swiglu_fwd_impl(T* __restrict__ out, const T* __restrict__ gate, const T* __restrict__ up,
                                                u64 n) {
    GRID_STRIDE(i, n) { out[i] = from_f32<T>(silu(to_f32(gate[i])) * to_f32(up[i])); }
}

// d/dg [silu(g)·u] = u·s·(1 + g·(1 − s)) with s = sigmoid(g); d/du = silu(g).
template <typename T>
__device__ __forceinline__ void swiglu_bwd_impl(T* __restrict__ dgate, T* __restrict__ dup, const T* __restrict__ dout,
                                                const T* __restrict__ gate, const T* __restrict__ up, u64 n) {
    GRID_STRIDE(i, n) {
        float g = to_f32(gate[i]), u = to_f32(up[i]), dy = to_f32(dout[i]);
        float s = 1.0f / (1.0f + expf(-g));
        dgate[i] = from_f32<T>(dy * u * s * (1.0f + g * (1.0f - s)));
        dup[i] = from_f32<T>(dy * g * s);
    }
}

template <typename T>
__device__ __forceinline__ void squared_relu_fwd_impl(T* __restrict__ out, const T* __restrict__ x, u64 n) {
    GRID_STRIDE(i, n) {
        float v = fmaxf(to_f32(x[i]), 0.0f);
        out[i] = from_f32<T>(v * v);
    }
}

template <typename T>
__device__ __forceinline__ void squared_relu_bwd_impl(T* __restrict__ dx, const T* __restrict__ dout,
                                                      const T* __restrict__ x, u64 n) {
    GRID_STRIDE(i, n) {
        float v = fmaxf(to_f32(x[i]), 0.0f);
        dx[i] = from_f32<T>(2.0f * v * to_f32(dout[i]));
    }
}

// AdamW (PyTorch's): m = b1·m + (1−b1)·g; v = b2·v + (1−b2)·g²; p −= lr·(m/bc1 / (√(v/bc2) + eps) + wd·p), with
// the bias corrections bc1 = 1 − b1ᵗ, bc2 = 1 − b2ᵗ computed on the host in f64 and passed as f32.
template <typename G, typename P>
__device__ __forceinline__ void adamw_impl(float* __restrict__ master, P* __restrict__ copy_to, const G* __restrict__ grads,
                                           float* __restrict__ m, float* __restrict__ v, float lr, float beta1,
                                           float beta2, float eps, float wd, float bc1, float bc2, u64 n) {
    GRID_STRIDE(i, n) {
        float g = to_f32(grads[i]);
        float mi = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float p = master[i];
        float mh = mi / bc1, vh = vi / bc2;
        p -= lr * (mh / (sqrtf(vh) + eps) + wd * p);
        master[i] = p;
        if (copy_to) copy_to[i] = from_f32<P>(p);
    }
}

// Every (output, input) pair of element types, and every element type.
#define TWO_TYPES(X)                                                                                         \
    X(f32, float, f32, float) X(f32, float, bf16, bf16) X(f32, float, f16, f16) X(bf16, bf16, f32, float)     \
    X(bf16, bf16, bf16, bf16) X(bf16, bf16, f16, f16) X(f16, f16, f32, float) X(f16, f16, bf16, bf16)         \
    X(f16, f16, f16, f16)
#define ONE_TYPE(X) X(f32, float) X(bf16, bf16) X(f16, f16)

#define COPY(dn, dt, sn, st) \
    extern "C" __global__ void copy_##dn##_##sn(dt* dst, const st* src, u64 n) { copy_impl(dst, src, n); }
TWO_TYPES(COPY)

#define ADD(dn, dt, sn, st) \
    extern "C" __global__ void add_##dn##_##sn(dt* dst, const st* src, u64 n) { add_impl(dst, src, n); }
TWO_TYPES(ADD)

#define TRANSPOSE12(dn, dt, sn, st)                                                                           \
    extern "C" __global__ void transpose12_##dn##_##sn(dt* dst, const st* src, u64 a, u64 b, u64 c, u64 d) { \
        transpose12_impl(dst, src, a, b, c, d);                                                               \
    }
TWO_TYPES(TRANSPOSE12)

#define FILL(tn, tt) \
    extern "C" __global__ void fill_##tn(tt* dst, float value, u64 n) { fill_impl(dst, value, n); }
ONE_TYPE(FILL)

#define SCALE(tn, tt) \
    extern "C" __global__ void scale_##tn(tt* x, float a, u64 n) { scale_impl(x, a, n); }
ONE_TYPE(SCALE)

#define SUM_SQUARES(tn, tt)                                                                  \
    extern "C" __global__ void sum_squares_##tn(double* partials, const tt* x, u64 n) {   \
        sum_squares_impl(partials, x, n);                                                    \
    }
ONE_TYPE(SUM_SQUARES)

// The partials of `sum_squares_*`, summed in block order by one thread (their count is small).
extern "C" __global__ void sum_partials_f64(double* out, const double* partials, u32 count) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        double s = 0.0;
        for (u32 i = 0; i < count; ++i) s += partials[i];
        out[0] = s;
    }
}

#define ACTIVATIONS(tn, tt)                                                                                     \
    extern "C" __global__ void swiglu_fwd_##tn(tt* out, const tt* gate, const tt* up, u64 n) {                 \
        swiglu_fwd_impl(out, gate, up, n);                                                                      \
    }                                                                                                           \
    extern "C" __global__ void swiglu_bwd_##tn(tt* dgate, tt* dup, const tt* dout, const tt* gate, const tt* up, \
                                               u64 n) {                                                         \
        swiglu_bwd_impl(dgate, dup, dout, gate, up, n);                                                         \
    }                                                                                                           \
    extern "C" __global__ void squared_relu_fwd_##tn(tt* out, const tt* x, u64 n) {                            \
        squared_relu_fwd_impl(out, x, n);                                                                       \
    }                                                                                                           \
    extern "C" __global__ void squared_relu_bwd_##tn(tt* dx, const tt* dout, const tt* x, u64 n) {            \
        squared_relu_bwd_impl(dx, dout, x, n);                                                                  \
    }
ONE_TYPE(ACTIVATIONS)

#define ADAMW(gn, gt, pn, pt)                                                                                      \
    extern "C" __global__ void adamw_##gn##_##pn(float* master, pt* copy_to, const gt* grads, float* m, float* v, \
                                                 float lr, float beta1, float beta2, float eps, float wd,         \
                                                 float bc1, float bc2, u64 n) {                                    \
        adamw_impl(master, copy_to, grads, m, v, lr, beta1, beta2, eps, wd, bc1, bc2, n);                         \
    }
TWO_TYPES(ADAMW)
