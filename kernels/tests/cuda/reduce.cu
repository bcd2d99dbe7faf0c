// Emulator tests: block and warp reductions (common.cuh), shuffles and votes, shared memory across barriers.

// Per block, one row of `n` values: the block's sum, max and f64 sum (block_sum/block_max), each warp's sum of its
// lanes' partials (warp_sum), and whether every thread got the same bits of the block sum (__syncthreads_and).
extern "C" __global__ void reduce_rows(const float* x, int n, float* sums, float* maxs, double* dsums, float* wsums,
                                       int* same) {
    __shared__ float scratch[32];
    __shared__ double dscratch[32];
    __shared__ float first;
    const float* row = x + static_cast<u64>(blockIdx.x) * n;
    const u32 nthreads = blockDim.x * blockDim.y * blockDim.z, t = linear_thread();
    float s = 0.0f, m = NEG_INF;
    double ds = 0.0;
    for (u32 i = t; i < static_cast<u32>(n); i += nthreads) {
        s += row[i];
        m = fmaxf(m, row[i]);
        ds += row[i];
    }
    const float w = warp_sum(s);
    if ((t & 31u) == 0) wsums[blockIdx.x * (nthreads / 32) + t / 32] = w;
    const float total = block_sum(s, scratch);
    const float mx = block_max(m, scratch);
    const double dtotal = block_sum(ds, dscratch);
    if (t == 0) first = total;
    __syncthreads();
    const int all_same = __syncthreads_and(__float_as_uint(first) == __float_as_uint(total));
    if (t == 0) {
        sums[blockIdx.x] = total;
        maxs[blockIdx.x] = mx;
        dsums[blockIdx.x] = dtotal;
        same[blockIdx.x] = all_same;
    }
}

// Every shuffle and vote, 16 results per thread (see the test for what each must be).
extern "C" __global__ void shuffles(int* out, double* dout) {
    const u32 t = threadIdx.x, lane = t & 31u;
    const int v = static_cast<int>(lane * 10 + (t / 32) * 1000);
    int* o = out + t * 16;
    o[0] = __shfl_sync(FULL_MASK, v, static_cast<int>((lane * 7) % 32));
    o[1] = __shfl_up_sync(FULL_MASK, v, 3);
    o[2] = __shfl_down_sync(FULL_MASK, v, 5);
    o[3] = __shfl_xor_sync(FULL_MASK, v, 9);
    o[4] = __shfl_sync(FULL_MASK, v, 3, 8);
    o[5] = __shfl_up_sync(FULL_MASK, v, 2, 8);
    o[6] = __shfl_down_sync(FULL_MASK, v, 3, 16);
    o[7] = __shfl_xor_sync(FULL_MASK, v, 6, 4);
    o[8] = static_cast<int>(__ballot_sync(FULL_MASK, lane & 1u));
    o[9] = __any_sync(FULL_MASK, lane == 5);
    o[10] = __all_sync(FULL_MASK, lane < 31);
    o[11] = static_cast<int>(__reduce_add_sync(FULL_MASK, lane));
    o[12] = __reduce_max_sync(FULL_MASK, static_cast<int>(lane) - 16);
    o[13] = __reduce_min_sync(FULL_MASK, static_cast<int>(lane) - 16);
    o[14] = __syncthreads_count(t % 3 == 0);
    o[15] = __syncthreads_or(t == 40);
    dout[t] = __shfl_xor_sync(FULL_MASK, static_cast<double>(v) + 0.25, 1);
    __syncwarp();
}

// Shared memory written by one thread and read by all after a barrier, three times: each thread must see the last
// write (123), whatever the compiler keeps in registers across a barrier.
extern "C" __global__ void barrier_visibility(int* out) {
    __shared__ int s;
    const u32 t = threadIdx.x;
    if (t == 0) s = 1;
    __syncthreads();
    const int a = s;
    __syncthreads();
    if (t == 1) s = 2;
    __syncthreads();
    const int b = s;
    __syncthreads();
    if (t == 0) s = 3;
    __syncthreads();
    out[t] = a * 100 + b * 10 + s;
}

// Threads that exit early do not hold up a barrier (sm_70 and later).
extern "C" __global__ void early_exit(int n, int* out) {
    __shared__ int count;
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    if (static_cast<int>(threadIdx.x) >= n) return;
    atomicAdd(&count, 1);
    __syncthreads();
    out[threadIdx.x] = count;
}

// The built-in variables of a 3-D grid of 3-D blocks: 12 values per thread.
extern "C" __global__ void built_ins(u32* out) {
    const u32 block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const u32 nthreads = blockDim.x * blockDim.y * blockDim.z;
    u32* o = out + (block * nthreads + linear_thread()) * 12;
    const u32 v[12] = {threadIdx.x, threadIdx.y, threadIdx.z, blockIdx.x, blockIdx.y, blockIdx.z,
                       blockDim.x,  blockDim.y,  blockDim.z,  gridDim.x,  gridDim.y,  gridDim.z};
    for (int i = 0; i < 12; i++) o[i] = v[i];
}
