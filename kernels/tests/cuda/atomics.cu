// Emulator test: atomics from every thread of many blocks, run on several OS threads at once.
extern "C" __global__ void atomics(int* i_sum, unsigned* u_sum, u64* ull_sum, float* f_sum, double* d_sum, int* i_max,
                                   int* i_min, int* cas, int* exch, unsigned* bits) {
    const int g = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    atomicAdd(i_sum, 1);
    atomicAdd(u_sum, 2u);
    atomicAdd(ull_sum, static_cast<u64>(g));
    atomicAdd(f_sum, 1.0f);
    atomicAdd(d_sum, 0.5);
    atomicMax(i_max, (g * 7919) % 10007 - 5000);
    atomicMin(i_min, (g * 7919) % 10007 - 5000);
    int cur = atomicAdd(cas, 0);
    for (;;) {
        const int prev = atomicCAS(cas, cur, cur + 3);
        if (prev == cur) break;
        cur = prev;
    }
    atomicExch(exch, g);
    atomicOr(&bits[g / 32], 1u << (g % 32));
}
