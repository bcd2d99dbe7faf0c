// Emulator test: named barriers (bar.sync / bar.arrive, ptx.cuh).

// Two groups of 64 threads take `rounds` turns each, alternating, as the wgmma forward's two consumer warpgroups do
// (attention_forward_wgmma.cu): group g waits for its turn on barrier 1 + g (bar.sync, 128 threads: its own 64 and the
// other's 64 arrivals) and passes the turn by arriving on the other's barrier (bar.arrive). Group 0 goes first: group
// 1 gives it its first turn by an arrival at the start, and does not arrive after its own last turn (no turn of group 0
// is left to take it), so both barriers' counts balance. Group 1 is threads 0..63, which the emulator runs first: the
// order in `log` (g · 1000 + round, one entry a turn, by the group's first thread) is the barriers' doing. Warp 4
// (threads 128..159) takes no part and exits at once: a named barrier counts only the threads it names. With
// `first_turn` 0 group 0 is never given its first turn: a deadlock.
extern "C" __global__ void ping_pong(int* log, int rounds, int first_turn) {
    __shared__ int next;
    if (threadIdx.x == 0) next = 0;
    __syncthreads();
    if (threadIdx.x >= 128) return;
    const u32 g = threadIdx.x < 64 ? 1 : 0;
    const bool leader = threadIdx.x % 64 == 0;
    if (g == 1 && first_turn) named_barrier_arrive(1, 128);
    for (int r = 0; r < rounds; ++r) {
        named_barrier_sync(1 + g, 128);
        if (leader) log[next++] = static_cast<int>(g) * 1000 + r;
        if (g == 0 || r + 1 < rounds) named_barrier_arrive(1 + (g ^ 1), 128);
    }
}

// A producer warp and a consumer warp (0 and 1) hand a buffer back and forth for two rounds: the producer writes it
// and arrives on barrier 3 without waiting; the consumer syncs on 3, reads it into `out` and arrives on barrier 4,
// on which the producer syncs before writing the next round (so that it does not overwrite what is being read).
extern "C" __global__ void hand_over(int* out) {
    __shared__ int buf[32];
    const u32 lane = threadIdx.x % 32;
    for (int r = 0; r < 2; ++r) {
        if (threadIdx.x < 32) {
            if (r > 0) named_barrier_sync(4, 64);
            buf[lane] = static_cast<int>(lane) * 3 + 100 * r;
            named_barrier_arrive(3, 64);
        } else {
            named_barrier_sync(3, 64);
            out[r * 32 + lane] = buf[(lane + 1) % 32];
            if (r == 0) named_barrier_arrive(4, 64);
        }
    }
}
