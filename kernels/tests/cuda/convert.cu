// Emulator test: f32 → bf16/f16 (from_f32: round to nearest even) and back (to_f32), a grid-stride loop.
extern "C" __global__ void narrow(const float* x, int n, u16* bf, u16* hf, float* bf_back, float* hf_back) {
    for (int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); i < n;
         i += static_cast<int>(gridDim.x * blockDim.x)) {
        const bf16 b = from_f32<bf16>(x[i]);
        const f16 h = from_f32<f16>(x[i]);
        bf[i] = __bfloat16_as_ushort(b);
        hf[i] = __half_as_ushort(h);
        bf_back[i] = to_f32(b);
        hf_back[i] = to_f32(h);
    }
}

// Every 16-bit pattern widened as bf16 and as f16.
extern "C" __global__ void widen(float* bf, float* hf) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    bf[i] = to_f32(__ushort_as_bfloat16(static_cast<u16>(i)));
    hf[i] = to_f32(__ushort_as_half(static_cast<u16>(i)));
}
