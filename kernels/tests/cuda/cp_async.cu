// Emulator test: cp.async into dynamic shared memory, two commit groups (the second zero-filled past `valid`), the
// waits, then shared memory read back (another thread's chunk, after the barrier). `early` records what the
// emulator's deferred copies show before the waits (poison); a GPU may show the data already.
extern "C" __global__ void cp_async_copy(const float4* src, int valid, float4* dst, int* early) {
    DYNAMIC_SMEM(float4, smem);
    const u32 t = threadIdx.x, n = blockDim.x;
    cp_async_16(&smem[t], &src[t]);
    cp_async_commit();
    const u32 c = n + t;
    const bool ok = c < static_cast<u32>(valid);
    cp_async_16_zfill(&smem[c], &src[ok ? c : 0], ok);
    cp_async_commit();
    early[t] = __float_as_uint(smem[t].x) == 0xffffffffu;
    cp_async_wait<1>();
    early[n + t] = __float_as_uint(smem[c].x) == 0xffffffffu;
    const float4 mine = smem[t];
    cp_async_wait_all();
    __syncthreads();
    dst[t] = smem[(t + 1) % n];
    dst[n + t] = smem[c];
    dst[2 * n + t] = mine;
}
