// Emulator tests: kernels that are wrong, each in one way the emulator must report (and never hang on).

extern "C" __global__ void divergent_barrier(int* out) {
    if (threadIdx.x % 2) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1;
}

// Lanes 0-15 of each warp shuffle while lanes 16-31 wait at the barrier: neither can complete.
extern "C" __global__ void collective_never_reached(int* out) {
    int v = static_cast<int>(threadIdx.x);
    if ((threadIdx.x & 31u) < 16) v = __shfl_xor_sync(FULL_MASK, v, 1);
    __syncthreads();
    out[threadIdx.x] = v;
}

extern "C" __global__ void lane_exits_early(float* out) {
    if (threadIdx.x == 3) return;
    out[threadIdx.x] = warp_sum(static_cast<float>(threadIdx.x));
}

extern "C" __global__ void partial_mask(int* out) {
    out[threadIdx.x] = __shfl_sync(0x0000ffffu, static_cast<int>(threadIdx.x), 0);
}

// Off by one: writes out[n].
extern "C" __global__ void write_past_end(float* out, int n) {
    const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if (i <= n) out[i] = 1.0f;
}

extern "C" __global__ void takes_double(double* out, double v) {
    if (threadIdx.x == 0) out[0] = v;
}

extern "C" __global__ void traps(int* out) {
    if (blockIdx.x == 1 && threadIdx.x == 5) __trap();
    out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

extern "C" __global__ void asserts(const int* x, int limit) {
    assert(x[threadIdx.x] < limit);
}

// Block 0's threads 0-15 write shared memory; every thread reads its element after the barrier. The rest (and every
// later block, which may run on the same OS thread after block 0) read the emulator's poison: NaN.
extern "C" __global__ void stale_shared(float* out) {
    __shared__ float s[32];
    if (blockIdx.x == 0 && threadIdx.x < 16) s[threadIdx.x] = 1.0f;
    __syncthreads();
    out[blockIdx.x * 32 + threadIdx.x] = s[threadIdx.x];
}

extern "C" __global__ void dynamic_smem_overflow(int past) {
    DYNAMIC_SMEM(int, s);
    if (threadIdx.x == 0) s[blockDim.x + past] = 1;
}

extern "C" __global__ void ldmatrix_from_global(const u16* g, u32* out) {
    u32 r;
    ldmatrix_x1(r, g + (threadIdx.x % 8) * 8);
    out[threadIdx.x] = r;
}

// Two warps of four wait on named barrier 1 for 96 threads: only they ever arrive, the other two exit.
extern "C" __global__ void named_barrier_never_completes(int* out) {
    if (threadIdx.x < 64) named_barrier_sync(1, 96);
    out[threadIdx.x] = 1;
}

// Warp 0 arrives on named barrier 2 counting 64 threads, warp 1 syncs on it counting 96.
extern "C" __global__ void named_barrier_count_mismatch(int* out) {
    if (threadIdx.x < 32) named_barrier_arrive(2, 64);
    else named_barrier_sync(2, 96);
    out[threadIdx.x] = 1;
}

// Warp 0 arrives on named barrier 3 and nothing syncs on it: the phase is still open when the block ends.
extern "C" __global__ void named_barrier_left_open(int* out) {
    if (threadIdx.x < 32) named_barrier_arrive(3, 64);
    out[threadIdx.x] = 1;
}

// Barrier 0 is __syncthreads'.
extern "C" __global__ void named_barrier_zero(int* out) {
    named_barrier_sync(0, 64);
    out[threadIdx.x] = 1;
}
