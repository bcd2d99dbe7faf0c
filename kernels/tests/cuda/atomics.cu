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

// Emulator test: blocks taking turns through a flag (ptx.cuh: flag_wait_eq, flag_release): block b waits for the flag
// to hold b, records how many blocks went before it, and hands the turn to b + 1. A block `fail_block` traps instead:
// the blocks after it wait for a turn that never comes and must end with the launch's error, not hang.
extern "C" __global__ void flags_in_order(u32* flag, u32* order, u32* counter, int fail_block) {
    if (threadIdx.x != 0) return;
    if (static_cast<int>(blockIdx.x) == fail_block) __trap();
    flag_wait_eq(flag, blockIdx.x);
    order[blockIdx.x] = atomicAdd(counter, 1u);
    flag_release(flag, blockIdx.x + 1);
}
