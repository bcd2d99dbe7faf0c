// Element types, conversions and reductions shared by every kernel (see sources.rs).
//
// This text is prepended to every kernel source and compiled twice: by NVRTC for the GPU, and by the host C++ compiler
// for the emulator, where LONGCTX_EMU is defined and the emulator's emu.h (which provides the CUDA built-ins, the
// 16-bit float types and their conversions) comes first. So: no `#pragma once` and no `#include` of our own files (the
// unit is one text), no C++ standard library (NVRTC has none), and only names that mean the same on both sides.
// Everything is `__forceinline__` or a template, since the same text is in every unit.

typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;
typedef unsigned short u16;
typedef unsigned char u8;

#ifndef LONGCTX_EMU
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

// The 16-bit element types: storage plus the conversions below. Convert explicitly (to_f32, from_f32) rather than
// leaning on cuda_bf16.h's operators: the emulator's types have none, and per-operation rounding in bf16 is rarely
// what a kernel means.
typedef __nv_bfloat16 bf16;
typedef __half f16;

// Infinities as f32, for device code (the bit patterns: no host-only builtins on either side).
#define NEG_INF (__uint_as_float(0xff800000u))
#define POS_INF (__uint_as_float(0x7f800000u))

// Full warp, for the *_sync collectives.
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(f16 x) { return __half2float(x); }

// from_f32<T>(x): x rounded to T (to nearest, ties to even; NaN stays NaN).
template <class T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
    return x;
}
template <>
__device__ __forceinline__ bf16 from_f32<bf16>(float x) {
    return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ f16 from_f32<f16>(float x) {
    return __float2half_rn(x);
}

// Warp reductions: every lane of the (whole, converged) warp calls them and gets the total. The butterfly order is the
// same in every lane, so all lanes get the same bits. warp_max uses fmax semantics: a NaN lane is ignored.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ double warp_max(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// The thread's index within its block, x fastest: the order warps are made of.
__device__ __forceinline__ u32 linear_thread() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

// Block reductions. Contract: every thread of the block calls it (it has two __syncthreads), with the same `scratch`:
// a `__shared__` array of 32 elements that nothing else uses during the call; the block is whole warps (its size a
// multiple of 32, at most 1024). Every thread gets the total, with the same bits (each warp sums the per-warp partials
// in the same order). The second barrier lets the caller reuse `scratch` at once.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const u32 tid = linear_thread(), lane = tid & 31u, warp = tid >> 5;
    const u32 nwarps = (blockDim.x * blockDim.y * blockDim.z) >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = warp_sum(lane < nwarps ? scratch[lane] : 0.0f);
    __syncthreads();
    return v;
}
__device__ __forceinline__ double block_sum(double v, double* scratch) {
    const u32 tid = linear_thread(), lane = tid & 31u, warp = tid >> 5;
    const u32 nwarps = (blockDim.x * blockDim.y * blockDim.z) >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = warp_sum(lane < nwarps ? scratch[lane] : 0.0);
    __syncthreads();
    return v;
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const u32 tid = linear_thread(), lane = tid & 31u, warp = tid >> 5;
    const u32 nwarps = (blockDim.x * blockDim.y * blockDim.z) >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = warp_max(lane < nwarps ? scratch[lane] : NEG_INF);
    __syncthreads();
    return v;
}
__device__ __forceinline__ double block_max(double v, double* scratch) {
    const u32 tid = linear_thread(), lane = tid & 31u, warp = tid >> 5;
    const u32 nwarps = (blockDim.x * blockDim.y * blockDim.z) >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = warp_max(lane < nwarps ? scratch[lane] : static_cast<double>(NEG_INF));
    __syncthreads();
    return v;
}

// DYNAMIC_SMEM(T, name): `T* name` pointing at the block's dynamic shared memory (the launch's shared_bytes), 16-byte
// aligned (and no more: do not assume 128). In the emulator it is a per-block buffer, poisoned (0xFF bytes) at the
// start of each block and with guard bytes checked after it.
#ifdef LONGCTX_EMU
#define DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(::emu::dynamic_smem())
#else
#define DYNAMIC_SMEM(T, name)                                                                                          \
    extern __shared__ __align__(16) unsigned char longctx_dynamic_smem[];                                             \
    T* name = reinterpret_cast<T*>(longctx_dynamic_smem)
#endif
