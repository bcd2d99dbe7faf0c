// The softmax cross-entropy of one chunk of logits rows, replacing each row by its gradient (the formulas are in
// the CPU backend's ops/cross_entropy.rs; the products around it are cuBLASLt's).
//
// Pipeline: one block per row (blocks stride over rows). The row's max (block max), then e_j = exp(z_j − max)
// written back and summed in f64 over j ≠ y (block sum in f64), then the loss ln(S/e_y) = ln1p(O/e_y) (or
// ln S − d when the target's logit is far below the max) and the gradient (softmax − onehot)·scale, the target
// entry computed as −O/S·scale so that a confident prediction keeps its precision. A row whose target is
// ignored becomes zeros and loses 0.

__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    v = warp_sum(v);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    double t = 0.0;
    for (int i = 0; i < warps; ++i) t += scratch[i];
    return t;
}

__device__ __forceinline__ float block_max_f32(float v, float* scratch) {
    v = warp_max(v);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    float t = NEG_INF;
    for (int i = 0; i < warps; ++i) t = fmaxf(t, scratch[i]);
    return t;
}

extern "C" __global__ void softmax_xent_rows(float* z, double* losses, const i64* targets, u32 rows, u32 v,
                                             i64 ignore_index, float scale) {
    __shared__ double dscratch[32];
    __shared__ float fscratch[32];
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        float* row = z + (u64)r * v;
        i64 y = targets[r];
        if (y == ignore_index) {
            for (u32 j = threadIdx.x; j < v; j += blockDim.x) row[j] = 0.0f;
            if (threadIdx.x == 0) losses[r] = 0.0;
            continue;
        }
        float zy = row[y];
        float mx = NEG_INF;
        for (u32 j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, row[j]);
        mx = block_max_f32(mx, fscratch);
        double other = 0.0;
        for (u32 j = threadIdx.x; j < v; j += blockDim.x) {
            float e = expf(row[j] - mx);
            row[j] = e;
            if (j != (u32)y) other += (double)e;
        }
        other = block_sum_f64(other, dscratch);
        float d = zy - mx;
        float ey = expf(d);
        double sum = other + (double)ey;
        double loss = d > -1.0f ? log1p(other / (double)ey) : log(sum) - (double)d;
        float k = (float)((double)scale / sum);
        for (u32 j = threadIdx.x; j < v; j += blockDim.x) row[j] *= k;
        __syncthreads();
        if (threadIdx.x == 0) {
            row[y] = (float)(-other * (double)scale / sum);
            losses[r] = loss;
        }
        __syncthreads();
    }
}
