// Emulator tests: mma.m16n8k16 with fragments from ldmatrix (A: x4; B: x4.trans and x2.trans from a k-major tile, x2
// from an n-major one) and with fragments assembled by hand from the documented layout; ldmatrix's layouts alone.
// One warp per launch. Matrices: A [16][16] row-major, B as [16 k][16 n] (b_kn) and as [16 n][16 k] (b_nk), C and
// D [16][16] f32 row-major (two n-tiles of 8).

// Stores an m16n8 D fragment of n-tile `nt` into d [16][16] (the C/D layout).
__device__ __forceinline__ void store_d(float* d, int nt, const float (&f)[4]) {
    const u32 lane = threadIdx.x & 31u, gid = lane >> 2, tig = lane & 3u;
    const u32 col = nt * 8 + 2 * tig;
    d[gid * 16 + col] = f[0];
    d[gid * 16 + col + 1] = f[1];
    d[(gid + 8) * 16 + col] = f[2];
    d[(gid + 8) * 16 + col + 1] = f[3];
}

__device__ __forceinline__ void load_c(const float* c, int nt, float (&f)[4]) {
    const u32 lane = threadIdx.x & 31u, gid = lane >> 2, tig = lane & 3u;
    const u32 col = nt * 8 + 2 * tig;
    f[0] = c[gid * 16 + col];
    f[1] = c[gid * 16 + col + 1];
    f[2] = c[(gid + 8) * 16 + col];
    f[3] = c[(gid + 8) * 16 + col + 1];
}

template <bool F16>
__device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2], const float (&c)[4]) {
    if (F16)
        mma_16816_f16(d, a, b, c);
    else
        mma_16816_bf16(d, a, b, c);
}

// d_x4t, d_x2t, d_x2: D = A·B + C with B's fragments from ldmatrix x4.trans, x2.trans (b_kn) and x2 (b_nk).
template <class T, bool F16>
__device__ __forceinline__ void mma_ldmatrix(const T* a, const T* b_kn, const T* b_nk, const float* c, float* d_x4t,
                                             float* d_x2t, float* d_x2) {
    __shared__ __align__(16) T sa[256];
    __shared__ __align__(16) T skn[256];
    __shared__ __align__(16) T snk[256];
    const u32 lane = threadIdx.x & 31u;
    // 512 bytes each: one 16-byte chunk per lane.
    reinterpret_cast<uint4*>(sa)[lane] = reinterpret_cast<const uint4*>(a)[lane];
    reinterpret_cast<uint4*>(skn)[lane] = reinterpret_cast<const uint4*>(b_kn)[lane];
    reinterpret_cast<uint4*>(snk)[lane] = reinterpret_cast<const uint4*>(b_nk)[lane];
    __syncwarp();
    // Lane l addresses row l % 16, columns 8·(l / 16): matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15),
    // (8-15, 8-15).
    u32 af[4];
    ldmatrix_x4(af, sa + (lane % 16) * 16 + (lane / 16) * 8);
    // The same addressing of the k-major B gives (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15),
    // transposed: n-tile 0 is {r0, r1}, n-tile 1 {r2, r3}.
    u32 b4[4];
    ldmatrix_x4_trans(b4, skn + (lane % 16) * 16 + (lane / 16) * 8);
    for (int nt = 0; nt < 2; nt++) {
        float cf[4], df[4];
        load_c(c, nt, cf);
        const u32 b[2] = {b4[2 * nt], b4[2 * nt + 1]};
        mma<F16>(df, af, b, cf);
        store_d(d_x4t, nt, df);

        u32 bt[2];
        ldmatrix_x2_trans(bt, skn + (lane % 16) * 16 + nt * 8);
        mma<F16>(df, af, bt, cf);
        store_d(d_x2t, nt, df);

        // n-major: rows n = 8·nt + l % 8, k 0-7 for lanes 0-7 and k 8-15 for lanes 8-15 (lanes 16-31 ignored).
        u32 bn[2];
        ldmatrix_x2(bn, snk + (nt * 8 + lane % 8) * 16 + ((lane / 8) % 2) * 8);
        mma<F16>(df, af, bn, cf);
        store_d(d_x2, nt, df);
    }
}

extern "C" __global__ void mma_ldmatrix_bf16(const bf16* a, const bf16* b_kn, const bf16* b_nk, const float* c,
                                             float* d_x4t, float* d_x2t, float* d_x2) {
    mma_ldmatrix<bf16, false>(a, b_kn, b_nk, c, d_x4t, d_x2t, d_x2);
}
extern "C" __global__ void mma_ldmatrix_f16(const f16* a, const f16* b_kn, const f16* b_nk, const float* c,
                                            float* d_x4t, float* d_x2t, float* d_x2) {
    mma_ldmatrix<f16, true>(a, b_kn, b_nk, c, d_x4t, d_x2t, d_x2);
}

// The fragments assembled from f32 matrices by the PTX ISA's formulas, packed with pack_{bf16,f16}x2 (which rounds).
template <bool F16>
__device__ __forceinline__ u32 pack(float lo, float hi) {
    return F16 ? pack_f16x2(lo, hi) : pack_bf16x2(lo, hi);
}
template <bool F16>
__device__ __forceinline__ void mma_by_hand(const float* a, const float* b_kn, const float* c, float* d) {
    const u32 lane = threadIdx.x & 31u, gid = lane >> 2, tig = lane & 3u;
    u32 af[4];
    for (u32 r = 0; r < 4; r++) {
        const u32 row = gid + 8 * (r & 1), col = 2 * tig + 8 * (r >> 1);
        af[r] = pack<F16>(a[row * 16 + col], a[row * 16 + col + 1]);
    }
    for (int nt = 0; nt < 2; nt++) {
        u32 bf[2];
        for (u32 r = 0; r < 2; r++) {
            const u32 k = 2 * tig + 8 * r, n = nt * 8 + gid;
            bf[r] = pack<F16>(b_kn[k * 16 + n], b_kn[(k + 1) * 16 + n]);
        }
        float cf[4], df[4];
        load_c(c, nt, cf);
        mma<F16>(df, af, bf, cf);
        store_d(d, nt, df);
    }
}
extern "C" __global__ void mma_by_hand_bf16(const float* a, const float* b_kn, const float* c, float* d) {
    mma_by_hand<false>(a, b_kn, c, d);
}
extern "C" __global__ void mma_by_hand_f16(const float* a, const float* b_kn, const float* c, float* d) {
    mma_by_hand<true>(a, b_kn, c, d);
}

// ldmatrix alone: four 8×8 matrices of u16 (m[j][r][c] = j·64 + r·8 + c), each lane addressing row 7 - l % 8 of
// matrix l / 8 (rows need not be in order, nor contiguous); per lane 13 registers: x1, x2, x4, x2.trans, x4.trans.
extern "C" __global__ void ldmatrix_layout(u32* out) {
    __shared__ __align__(16) u16 m[4 * 8 * 8];
    const u32 lane = threadIdx.x & 31u;
    for (u32 i = lane; i < 256; i += 32) m[i] = static_cast<u16>(i);
    __syncwarp();
    const u16* row = m + (lane / 8) * 64 + (7 - lane % 8) * 8;
    u32* o = out + lane * 13;
    u32 r1, r2[2], r4[4], t2[2], t4[4];
    ldmatrix_x1(r1, row);
    ldmatrix_x2(r2, row);
    ldmatrix_x4(r4, row);
    ldmatrix_x2_trans(t2, row);
    ldmatrix_x4_trans(t4, row);
    o[0] = r1;
    o[1] = r2[0];
    o[2] = r2[1];
    for (int j = 0; j < 4; j++) o[3 + j] = r4[j];
    o[7] = t2[0];
    o[8] = t2[1];
    for (int j = 0; j < 4; j++) o[9 + j] = t4[j];
}
