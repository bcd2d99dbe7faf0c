// The exact merge of a partial attention result over a disjoint key set into an accumulator (both f32): the
// derivation is in the CPU backend's cpu/attention/merge.rs. One warp per row: lane 0's weights are every lane's
// (each lane computes the same f32 values from the two LSEs); the row's elements are split over the lanes.
// A side with no weight (LSE = −inf, or far below the other) has its term dropped, not multiplied by 0, so a
// non-finite O there stays out; a row where neither side saw a key is left as it is (O = 0, LSE = −inf).

extern "C" __global__ void attn_merge(float* o1, float* lse1, const float* o2, const float* lse2, u64 rows, u32 d) {
    const u32 lane = threadIdx.x & 31;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 r = warp; r < rows; r += warps) {
        float a = lse1[r], b = lse2[r];
        float m = fmaxf(a, b);
        if (m == NEG_INF) continue;
        float w1 = expf(a - m), w2 = expf(b - m);
        float z = w1 + w2;
        float c1 = w1 / z, c2 = w2 / z;
        float* x = o1 + r * d;
        const float* y = o2 + r * d;
        for (u32 e = lane; e < d; e += 32) {
            float t1 = c1 * x[e], t2 = c2 * y[e];
            if (w1 == 0.0f && !isfinite(t1)) {
                x[e] = t2;
            } else if (w2 == 0.0f && !isfinite(t2)) {
                x[e] = t1;
            } else {
                x[e] = t1 + t2;
            }
        }
        __syncwarp();
        if (lane == 0) lse1[r] = m + logf(z);
    }
}
