// Emulator cost figures (the emulator_figures test): barriers and tensor-core products in a loop.
// 2 · iters barriers.
extern "C" __global__ void many_barriers(int iters, int* out) {
    __shared__ int s[1024];
    int acc = 0;
    for (int i = 0; i < iters; i++) {
        s[threadIdx.x] = i + static_cast<int>(threadIdx.x);
        __syncthreads();
        acc += s[(threadIdx.x + 1) % blockDim.x];
        __syncthreads();
    }
    out[threadIdx.x] = acc;
}

extern "C" __global__ void many_mma(int iters, float* out) {
    const u32 lane = threadIdx.x & 31u;
    const u32 a[4] = {pack_bf16x2(0.5f, lane), pack_bf16x2(1.0f, 2.0f), pack_bf16x2(-1.0f, 0.25f),
                      pack_bf16x2(3.0f, 1.0f)};
    const u32 b[2] = {pack_bf16x2(0.125f, 1.0f), pack_bf16x2(lane, -2.0f)};
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = 0; i < iters; i++) mma_16816_bf16(acc, a, b, acc);
    for (int i = 0; i < 4; i++) out[threadIdx.x * 4 + i] = acc[i];
}
