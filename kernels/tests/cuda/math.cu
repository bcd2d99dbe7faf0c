// Emulator test: the math built-ins and qualifiers kernels use, so that a name missing on one side (the emulator or
// NVRTC, which compiles this file too) shows here first. 32 results per element; see the test for each.
__host__ __device__ __forceinline__ float twice(float x) { return 2.0f * x; }

struct Scale {
    float by;
};
__device__ __inline__ float scaled(const Scale& s, float x) { return s.by * x; }

extern "C" __global__ void __launch_bounds__(256)
    math_builtins(const float* __restrict__ x, float* __restrict__ out, int n, const __grid_constant__ Scale scale) {
    const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    const float v = __ldg(&x[i]);
    const double d = v;
    const float a = fabsf(v) + 1.0f;
    float* o = out + i * 32;
    o[0] = expf(v);
    o[1] = exp2f(v);
    o[2] = logf(a);
    o[3] = log2f(a);
    o[4] = __expf(v);
    o[5] = __logf(a);
    o[6] = rsqrtf(a);
    o[7] = sqrtf(fabsf(v));
    o[8] = fmaxf(v, 0.25f);
    o[9] = fminf(v, 0.25f);
    o[10] = fmaf(v, v, 1.0f);
    o[11] = __fdividef(v, 3.0f);
    o[12] = tanhf(v);
    o[13] = sinf(v);
    o[14] = cosf(v);
    double s, c;
    sincos(d, &s, &c);
    o[15] = static_cast<float>(s);
    o[16] = static_cast<float>(c);
    o[17] = static_cast<float>(sin(d) + cos(d));
    o[18] = static_cast<float>(exp(d));
    o[19] = static_cast<float>(log(fabs(d) + 1.0));
    o[20] = isinf(v) ? 1.0f : 0.0f;
    o[21] = isnan(v) ? 1.0f : 0.0f;
    o[22] = isfinite(v) ? 1.0f : 0.0f;
    o[23] = __uint_as_float(__float_as_uint(v) ^ 0x80000000u);
    o[24] = __int_as_float(__float_as_int(v));
    o[25] = static_cast<float>(min(i, 7) + max(i, 7));
    o[26] = min(v, 0.5f);
    o[27] = max(v, 0.5f);
    o[28] = twice(scaled(scale, v));
    o[29] = ex2_approx(v);
    o[30] = __saturatef(v);
    o[31] = static_cast<float>(__popc(__float_as_uint(v)));
    const long long t0 = clock64();
    __nanosleep(1);
    if (i < 0 || clock64() < t0) printf("unreachable: %d\n", i);
}
