// The CUDA emulator's device-side header: what a kernel translation unit sees instead of NVRTC's built-ins when it is
// compiled for the host (`-DLONGCTX_EMU`). It is prepended to every unit, before common.cuh and ptx.cuh, and to the
// runtime (runtime.cpp), which holds everything that is not a one-line wrapper.
//
// The execution model (see mod.rs for the whole picture): every CUDA thread of a block is a fiber with its own stack
// in a 256 KiB region aligned to its size, whose first bytes are the fiber's header (`emu::Fiber`); the block runs on
// one OS thread. Device code finds its own fiber by rounding its stack pointer down to the region (`emu::self`), so
// the built-in variables (`threadIdx`, ...) cost a mask and a load, and this module needs no thread-local storage of
// its own: its PT_TLS segment holds only the kernels' `__shared__` variables (plus one anchor byte), which the runtime
// poisons at the start of each block.
//
// Everything here is either inline or declared and defined in runtime.cpp: each unit becomes its own shared library
// (unit + runtime), so two units may define the same names, as two NVRTC modules may.
#ifndef LONGCTX_EMU
#error "emu.h is the CUDA emulator's device header: compile with -DLONGCTX_EMU"
#endif
#ifndef LONGCTX_EMU_H
#define LONGCTX_EMU_H

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <math.h>
#include <type_traits>
#include <ctime>
#include <utility>
#if !defined(__x86_64__) || defined(LONGCTX_EMU_UCONTEXT)
#include <ucontext.h>
#endif

// ---------------------------------------------------------------------------------------------------------------------
// Qualifiers. Kernels are ordinary functions; `__shared__` variables are thread-local statics: a block runs on one OS
// thread at a time and its fibers never migrate, so the OS thread's copy is the block's copy. The runtime poisons them
// (0xFF bytes) before each block, as CUDA leaves shared memory undefined. `extern __shared__` arrays do not compile
// here: use DYNAMIC_SMEM (common.cuh).
#define __global__
#define __device__
#define __host__
#define __constant__
#define __shared__ static thread_local
#define __forceinline__ inline __attribute__((always_inline))
#define __inline__ inline
#define __noinline__ __attribute__((noinline))
#define __grid_constant__
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))

// ---------------------------------------------------------------------------------------------------------------------
// Vector types, with CUDA's sizes and alignments (a float4 load is one 16-byte access there; code may rely on the
// alignment).
struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};
#define LONGCTX_EMU_VEC(T, name, a2, a4)                                                                               \
    struct __attribute__((aligned(a2))) name##2 { T x, y; };                                                           \
    struct name##3 { T x, y, z; };                                                                                     \
    struct __attribute__((aligned(a4))) name##4 { T x, y, z, w; };                                                     \
    inline name##2 make_##name##2(T x, T y) { return name##2{x, y}; }                                                  \
    inline name##3 make_##name##3(T x, T y, T z) { return name##3{x, y, z}; }                                         \
    inline name##4 make_##name##4(T x, T y, T z, T w) { return name##4{x, y, z, w}; }
LONGCTX_EMU_VEC(signed char, char, 2, 4)
LONGCTX_EMU_VEC(unsigned char, uchar, 2, 4)
LONGCTX_EMU_VEC(short, short, 4, 8)
LONGCTX_EMU_VEC(unsigned short, ushort, 4, 8)
LONGCTX_EMU_VEC(int, int, 8, 16)
LONGCTX_EMU_VEC(float, float, 8, 16)
LONGCTX_EMU_VEC(long long, longlong, 16, 16)
LONGCTX_EMU_VEC(unsigned long long, ulonglong, 16, 16)
LONGCTX_EMU_VEC(double, double, 16, 16)
#undef LONGCTX_EMU_VEC
struct __attribute__((aligned(8))) uint2 {
    unsigned int x, y;
};
struct __attribute__((aligned(16))) uint4 {
    unsigned int x, y, z, w;
};
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return uint3{x, y, z}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return uint4{x, y, z, w}; }

constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------------------------------
// 16-bit floats: the storage types of cuda_bf16.h / cuda_fp16.h and their conversions, exact (round to nearest even,
// NaN kept a NaN with its sign and top payload bits, as the `half` crate the CPU backend uses does). Deliberately no
// implicit conversions and no arithmetic operators: kernels convert with to_f32/from_f32 (common.cuh), which mean the
// same on both sides; code that leans on cuda_bf16.h's operators fails to compile here rather than behaving
// differently.
struct __attribute__((aligned(2))) __nv_bfloat16 {
    unsigned short __x;
};
struct __attribute__((aligned(2))) __half {
    unsigned short __x;
};
struct __attribute__((aligned(4))) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
struct __attribute__((aligned(4))) __half2 {
    __half x, y;
};

namespace emu {
inline unsigned int f32_bits(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float bits_f32(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned short f32_to_bf16_bits(float f) {
    unsigned int u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<unsigned short>(u >> 16);
}
inline unsigned short f32_to_f16_bits(float f) {
    const unsigned int u = f32_bits(f);
    const unsigned int sign = (u >> 16) & 0x8000u;
    const unsigned int a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return static_cast<unsigned short>(sign | 0x7e00u | (a >> 13));  // NaN, quieted
    if (a >= 0x477ff000u) return static_cast<unsigned short>(sign | 0x7c00u);          // rounds to infinity
    if (a >= 0x38800000u) {                                                             // a normal half
        unsigned int r = a - 0x38000000u;                                               // exponent rebiased
        r += 0x0fffu + ((r >> 13) & 1u);
        return static_cast<unsigned short>(sign | (r >> 13));
    }
    const unsigned int e = a >> 23;
    if (e < 102) return static_cast<unsigned short>(sign);  // below half the smallest subnormal: zero
    // A subnormal half counts units of 2^-24: the float's 24-bit significand shifted right by 126 - e, rounded.
    const unsigned int m = (a & 0x7fffffu) | 0x800000u;
    const unsigned int shift = 126 - e;
    unsigned int k = m >> shift;
    const unsigned int rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (k & 1u))) k += 1;
    return static_cast<unsigned short>(sign | k);
}
inline float f16_bits_to_f32(unsigned short h) {
    const unsigned int sign = (static_cast<unsigned int>(h) & 0x8000u) << 16;
    const unsigned int e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        const float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // m · 2^-24, exact
        return bits_f32(f32_bits(v) | sign);
    }
    if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}
}  // namespace emu

inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{emu::f32_to_bf16_bits(f)}; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return emu::bits_f32(static_cast<unsigned int>(h.__x) << 16); }
inline __half __float2half_rn(float f) { return __half{emu::f32_to_f16_bits(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline float __half2float(__half h) { return emu::f16_bits_to_f32(h.__x); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    return __nv_bfloat162{__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return float2{__bfloat162float(v.x), __bfloat162float(v.y)}; }
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2{__float2half_rn(lo), __float2half_rn(hi)}; }
inline __half2 __float22half2_rn(float2 v) { return __floats2half2_rn(v.x, v.y); }
inline float2 __half22float2(__half2 v) { return float2{__half2float(v.x), __half2float(v.y)}; }

// ---------------------------------------------------------------------------------------------------------------------
// Math. <math.h> gives expf, logf, sqrtf, fmaxf, isinf, ... for float and double; these are CUDA's additions. The fast
// intrinsics (__expf, ...) are computed exactly here: the GPU's are approximate (a few ulp), so tests compare with
// tolerances anyway.
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { sincosf(x, s, c); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }  // NaN → 0, as CUDA's
inline float __int_as_float(int i) { return emu::bits_f32(static_cast<unsigned int>(i)); }
inline int __float_as_int(float f) { return static_cast<int>(emu::f32_bits(f)); }
inline float __uint_as_float(unsigned int u) { return emu::bits_f32(u); }
inline unsigned int __float_as_uint(float f) { return emu::f32_bits(f); }
inline double __longlong_as_double(long long i) {
    double d;
    std::memcpy(&d, &i, 8);
    return d;
}
inline long long __double_as_longlong(double d) {
    long long i;
    std::memcpy(&i, &d, 8);
    return i;
}
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(floorf(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(ceilf(x)); }
inline unsigned int __float2uint_rn(float x) { return static_cast<unsigned int>(nearbyintf(x)); }
inline float __int2float_rn(int i) { return static_cast<float>(i); }
inline float __uint2float_rn(unsigned int u) { return static_cast<float>(u); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned int>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }
inline int __mul24(int a, int b) { return (a << 8 >> 8) * (b << 8 >> 8); }

// CUDA's min/max overloads (its math headers define them for every integer pairing and for float/double).
#define LONGCTX_EMU_MINMAX(R, A, B)                                                                                    \
    inline R min(A a, B b) { return static_cast<R>(a) < static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); }  \
    inline R max(A a, B b) { return static_cast<R>(a) > static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); }
LONGCTX_EMU_MINMAX(int, int, int)
LONGCTX_EMU_MINMAX(unsigned int, unsigned int, unsigned int)
LONGCTX_EMU_MINMAX(unsigned int, int, unsigned int)
LONGCTX_EMU_MINMAX(unsigned int, unsigned int, int)
LONGCTX_EMU_MINMAX(long, long, long)
LONGCTX_EMU_MINMAX(unsigned long, unsigned long, unsigned long)
LONGCTX_EMU_MINMAX(long long, long long, long long)
LONGCTX_EMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
LONGCTX_EMU_MINMAX(unsigned long long, long long, unsigned long long)
LONGCTX_EMU_MINMAX(unsigned long long, unsigned long long, long long)
#undef LONGCTX_EMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

template <class T>
inline T __ldg(const T* p) {
    return *p;
}
// A cycle counter where there is one (rdtsc), else nanoseconds: only differences mean anything, as on the GPU.
inline long long clock64() {
#if defined(__x86_64__)
    return static_cast<long long>(__builtin_ia32_rdtsc());
#else
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return static_cast<long long>(t.tv_sec) * 1000000000ll + t.tv_nsec;
#endif
}
// Not a scheduling point: a fiber spinning on another thread of its block still never lets it run (see mod.rs).
inline void __nanosleep(unsigned int) {}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// ---------------------------------------------------------------------------------------------------------------------
// Atomics on global or shared memory. Blocks run in parallel on several OS threads, so these are real atomics
// (sequentially consistent, stronger than CUDA's relaxed ones); floating-point adds are compare-and-swap loops.
namespace emu {
template <class T, class Bits, class F>
inline T atomic_update(T* p, F f) {
    static_assert(sizeof(T) == sizeof(Bits), "atomic_update: T and Bits differ in size");
    Bits* bp = reinterpret_cast<Bits*>(p);
    Bits old_bits = __atomic_load_n(bp, __ATOMIC_SEQ_CST);
    for (;;) {
        T old;
        std::memcpy(&old, &old_bits, sizeof(T));
        const T next = f(old);
        Bits next_bits;
        std::memcpy(&next_bits, &next, sizeof(T));
        if (__atomic_compare_exchange_n(bp, &old_bits, next_bits, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return old;
    }
}
}  // namespace emu
#define LONGCTX_EMU_ATOMIC_INT(T)                                                                                      \
    inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }                              \
    inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); }                              \
    inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }                              \
    inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }                                \
    inline T atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST); }                              \
    inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }                            \
    inline T atomicCAS(T* p, T cmp, T v) {                                                                             \
        __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                            \
        return cmp;                                                                                                    \
    }                                                                                                                  \
    inline T atomicMax(T* p, T v) { return emu::atomic_update<T, T>(p, [v](T o) { return o > v ? o : v; }); }         \
    inline T atomicMin(T* p, T v) { return emu::atomic_update<T, T>(p, [v](T o) { return o < v ? o : v; }); }
LONGCTX_EMU_ATOMIC_INT(int)
LONGCTX_EMU_ATOMIC_INT(unsigned int)
LONGCTX_EMU_ATOMIC_INT(long long)
LONGCTX_EMU_ATOMIC_INT(unsigned long long)
#undef LONGCTX_EMU_ATOMIC_INT
inline float atomicAdd(float* p, float v) {
    return emu::atomic_update<float, unsigned int>(p, [v](float o) { return o + v; });
}
inline double atomicAdd(double* p, double v) {
    return emu::atomic_update<double, unsigned long long>(p, [v](double o) { return o + v; });
}
inline float atomicExch(float* p, float v) {
    return emu::atomic_update<float, unsigned int>(p, [v](float) { return v; });
}
// sm_90's float max/min: NaN-ignoring, as fmaxf.
inline float atomicMax(float* p, float v) {
    return emu::atomic_update<float, unsigned int>(p, [v](float o) { return fmaxf(o, v); });
}
inline float atomicMin(float* p, float v) {
    return emu::atomic_update<float, unsigned int>(p, [v](float o) { return fminf(o, v); });
}

// ---------------------------------------------------------------------------------------------------------------------
// The runtime's state, shared with runtime.cpp. The layout is private to one build (both sides are compiled from the
// same text), except the constants Rust checks through longctx_emu_abi().
namespace emu {

// Each fiber's region: the header (Fiber) at the bottom, then a guard page (Rust maps it PROT_NONE), then the stack,
// growing down from the top. A power of two, so that a stack address rounded down gives the header.
constexpr std::size_t kFiberRegionBytes = 256 * 1024;
constexpr std::size_t kFiberHeaderBytes = 16 * 1024;
// cp.async copies one thread may have in flight (issued, not yet waited for): a multi-stage pipeline of 128 threads
// loading 64 × 128 bf16 K and V tiles has 48.
constexpr int kMaxCpAsync = 256;

struct Site {
    const char* file;
    int line;
};

struct Block;

enum FiberState { kRunnable, kWaitBlock, kWaitWarp, kWaitMbar, kWaitNamed, kDone };

struct CpAsync {
    void* dst;
    const void* src;
    unsigned int group;
    bool valid;
};

// Saved machine state of a switched-out fiber (or of the scheduler): its stack pointer, the callee-saved registers
// being on that stack (x86-64); a ucontext elsewhere.
struct Context {
    void* sp;
#if !defined(__x86_64__) || defined(LONGCTX_EMU_UCONTEXT)
    ucontext_t uc;
#endif
};

struct Fiber {
    uint3 thread_idx;
    Block* block;
    unsigned int linear;  // threadIdx.x + blockDim.x · (threadIdx.y + blockDim.y · threadIdx.z)
    unsigned int lane;
    unsigned int warp;
    int state;
    // What a waiting fiber waits at, for the deadlock report.
    const char* wait_what;
    Site wait_site;
    unsigned int cp_committed;  // cp.async groups committed so far
    unsigned int cp_count;      // copies in flight
    unsigned int wg_committed;  // wgmma groups committed so far
    bool wg_fenced;             // a wgmma.fence since the last wgmma.wait_group
    bool mbar_poll;             // waits in a single mbarrier.try_wait (not the mbarrier_wait loop)
    unsigned int bulk_committed;  // TMA store (bulk async) groups committed so far
    Context ctx;
    CpAsync cp[kMaxCpAsync];
};

// A fiber's header: in the first 16 KiB of its region, at a per-region offset of 0..63 cache lines (its "colour"):
// were every header at the start of its 256 KiB-aligned region, all of a block's headers would fall into the same
// few cache sets and evict each other at every switch (it costs about a quarter of a barrier's time).
__attribute__((always_inline)) inline Fiber* fiber_at(std::uintptr_t region) {
    return reinterpret_cast<Fiber*>(region + ((region / kFiberRegionBytes) % 64) * 64);
}
static_assert(sizeof(Fiber) + 63 * 64 <= kFiberHeaderBytes, "emu::Fiber must fit in the fiber region's header");

// The fiber running this code: its stack is in its region, whose start is the stack address rounded down.
__attribute__((always_inline)) inline Fiber* self() {
    const std::uintptr_t sp = reinterpret_cast<std::uintptr_t>(__builtin_frame_address(0));
    return fiber_at(sp & ~static_cast<std::uintptr_t>(kFiberRegionBytes - 1));
}

// Defined in runtime.cpp (the slow paths: every one may switch fibers).
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
unsigned char* dynamic_smem();
void syncthreads(Site site);
int syncthreads_reduce(Site site, int op, int pred);
void syncwarp(Site site, unsigned int mask);
unsigned long long shfl(Site site, int mode, unsigned int mask, unsigned long long bits, int arg, int width);
unsigned int vote(Site site, int op, unsigned int mask, int pred);
unsigned long long warp_reduce(Site site, int op, unsigned int mask, unsigned long long bits);
void mma_m16n8k16(Site site, int type, float* d, const unsigned int* a, const unsigned int* b, const float* c);
void ldmatrix(Site site, int num, bool trans, unsigned int* r, const void* smem);
void cp_async_16(Site site, void* smem, const void* gmem, bool valid);
void cp_async_commit();
void cp_async_wait(Site site, int pending);
float ex2_approx_ftz(float x);
unsigned int smem_window_addr(Site site, const void* p);
void wgmma_fence(Site site);
void wgmma_commit_group(Site site);
void wgmma_wait_group(Site site, int pending);
void wgmma_mma_async(Site site, int type, int n, int trans_a, int trans_b, float* d, unsigned long long desc_a,
                     unsigned long long desc_b, bool scale_d);
void wgmma_mma_async_rs(Site site, int type, int n, int trans_b, float* d, const unsigned int* a,
                        unsigned long long desc_b, bool scale_d);
void setmaxnreg(Site site, bool inc, unsigned int regs);
void mbar_init(Site site, void* bar, unsigned int count);
unsigned long long mbar_arrive(Site site, void* bar, unsigned int tx_bytes);
bool mbar_try_wait(Site site, void* bar, unsigned int parity, bool wait);
void tma_load(Site site, void* dst, const void* map, void* bar, int rank, const int* coords);
void tma_store(Site site, const void* src, const void* map, int rank, const int* coords);
// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 (ptx_tma.cuh: bulk_reduce_add_f32).
void bulk_reduce_add_f32(Site site, float* dst, const void* src, unsigned int bytes);
void tma_store_commit();
void tma_store_wait(int pending);
void named_barrier(Site site, unsigned int id, unsigned int count, bool wait);
// Waits until the u32 at `flag` (global memory, another block's to set) holds `v` (ptx.cuh: flag_wait_eq).
void flag_wait_eq(Site site, const unsigned int* flag, unsigned int v);
[[noreturn]] void trap(Site site, const char* what);
[[noreturn]] void assert_fail(const char* expr, Site site, const char* func);

enum ShflMode { kShflIdx, kShflUp, kShflDown, kShflXor };
enum VoteOp { kVoteBallot, kVoteAny, kVoteAll };
enum SyncOp { kSyncCount, kSyncAnd, kSyncOr };
enum ReduceOp { kReduceAddU, kReduceMinU, kReduceMaxU, kReduceMinI, kReduceMaxI, kReduceAnd, kReduceOr, kReduceXor };
enum MmaType { kMmaBf16, kMmaF16 };

template <class T>
inline T shfl_as(Site site, int mode, unsigned int mask, T var, int arg, int width) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "__shfl_*_sync: a value of 1-8 bytes");
    unsigned long long bits = 0;
    std::memcpy(&bits, &var, sizeof(T));
    bits = shfl(site, mode, mask, bits, arg, width);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
template <class T>
inline T shfl_idx(Site s, unsigned int mask, T var, int src, int width = 32) {
    return shfl_as(s, kShflIdx, mask, var, src, width);
}
template <class T>
inline T shfl_up(Site s, unsigned int mask, T var, unsigned int delta, int width = 32) {
    return shfl_as(s, kShflUp, mask, var, static_cast<int>(delta), width);
}
template <class T>
inline T shfl_down(Site s, unsigned int mask, T var, unsigned int delta, int width = 32) {
    return shfl_as(s, kShflDown, mask, var, static_cast<int>(delta), width);
}
template <class T>
inline T shfl_xor(Site s, unsigned int mask, T var, int lane_mask, int width = 32) {
    return shfl_as(s, kShflXor, mask, var, lane_mask, width);
}
template <class T>
inline T reduce_sync(Site s, int op, unsigned int mask, T v) {
    static_assert(sizeof(T) == 4, "__reduce_*_sync: a 32-bit integer");
    unsigned int u;
    std::memcpy(&u, &v, 4);
    const unsigned long long r = warp_reduce(s, op, mask, u);
    const unsigned int r32 = static_cast<unsigned int>(r);
    T out;
    std::memcpy(&out, &r32, 4);
    return out;
}

}  // namespace emu

// ---------------------------------------------------------------------------------------------------------------------
// The kernel registry: the generated tail of each unit lists its kernels (KernelSource::kernels) as
// `KernelThunk<decltype(&k), &k>::entry("k")`. A thunk unpacks cuLaunchKernel-style `void** args` (one pointer per
// parameter, each to the parameter's bytes) into the kernel's parameter types; the sizes and type names let the Rust
// side refuse a launch whose arguments do not match, naming the parameter.
namespace emu {
struct KernelEntry {
    const char* name;
    void (*launch)(void**);
    unsigned int nparams;
    const unsigned long* sizes;
    const char* const* types;  // __PRETTY_FUNCTION__ of type_name<P>, "... [with T = float*]"
};
template <class T>
const char* type_name() {
    return __PRETTY_FUNCTION__;
}
template <class F, F K>
struct KernelThunk;
template <class... P, void (*K)(P...)>
struct KernelThunk<void (*)(P...), K> {
    template <std::size_t... I>
    static void call(void** args, std::index_sequence<I...>) {
        K(*static_cast<typename std::remove_cv<P>::type*>(args[I])...);
    }
    static void launch(void** args) { call(args, std::index_sequence_for<P...>{}); }
    static inline const unsigned long sizes[sizeof...(P) + 1] = {sizeof(P)..., 0};
    static inline const char* const types[sizeof...(P) + 1] = {type_name<P>()..., nullptr};
    static KernelEntry entry(const char* name) {
        return KernelEntry{name, &launch, static_cast<unsigned int>(sizeof...(P)), sizes, types};
    }
};
}  // namespace emu

#define LONGCTX_EMU_SITE (::emu::Site{__FILE__, __LINE__})

// Built-in variables: the current fiber's (threadIdx) and its block's.
#define threadIdx (static_cast<const uint3&>(::emu::self()->thread_idx))
#define blockIdx (::emu::block_idx())
#define blockDim (::emu::block_dim())
#define gridDim (::emu::grid_dim())

// Barriers and warp collectives. Every one takes its call site, for the messages of divergence and deadlock errors.
#define __syncthreads() ::emu::syncthreads(LONGCTX_EMU_SITE)
#define __syncthreads_count(p) ::emu::syncthreads_reduce(LONGCTX_EMU_SITE, ::emu::kSyncCount, (p))
#define __syncthreads_and(p) ::emu::syncthreads_reduce(LONGCTX_EMU_SITE, ::emu::kSyncAnd, (p))
#define __syncthreads_or(p) ::emu::syncthreads_reduce(LONGCTX_EMU_SITE, ::emu::kSyncOr, (p))
#define __syncwarp(...) ::emu::syncwarp(LONGCTX_EMU_SITE, ::emu::full_mask_default(__VA_ARGS__))
#define __shfl_sync(...) ::emu::shfl_idx(LONGCTX_EMU_SITE, __VA_ARGS__)
#define __shfl_up_sync(...) ::emu::shfl_up(LONGCTX_EMU_SITE, __VA_ARGS__)
#define __shfl_down_sync(...) ::emu::shfl_down(LONGCTX_EMU_SITE, __VA_ARGS__)
#define __shfl_xor_sync(...) ::emu::shfl_xor(LONGCTX_EMU_SITE, __VA_ARGS__)
#define __ballot_sync(mask, p) ::emu::vote(LONGCTX_EMU_SITE, ::emu::kVoteBallot, (mask), (p))
#define __any_sync(mask, p) static_cast<int>(::emu::vote(LONGCTX_EMU_SITE, ::emu::kVoteAny, (mask), (p)))
#define __all_sync(mask, p) static_cast<int>(::emu::vote(LONGCTX_EMU_SITE, ::emu::kVoteAll, (mask), (p)))
#define __reduce_add_sync(mask, v) ::emu::reduce_sync(LONGCTX_EMU_SITE, ::emu::kReduceAddU, (mask), (v))
#define __reduce_min_sync(mask, v)                                                                                     \
    ::emu::reduce_sync(LONGCTX_EMU_SITE,                                                                               \
                       std::is_signed<decltype(v)>::value ? ::emu::kReduceMinI : ::emu::kReduceMinU, (mask), (v))
#define __reduce_max_sync(mask, v)                                                                                     \
    ::emu::reduce_sync(LONGCTX_EMU_SITE,                                                                               \
                       std::is_signed<decltype(v)>::value ? ::emu::kReduceMaxI : ::emu::kReduceMaxU, (mask), (v))
#define __reduce_and_sync(mask, v) ::emu::reduce_sync(LONGCTX_EMU_SITE, ::emu::kReduceAnd, (mask), (v))
#define __reduce_or_sync(mask, v) ::emu::reduce_sync(LONGCTX_EMU_SITE, ::emu::kReduceOr, (mask), (v))
#define __reduce_xor_sync(mask, v) ::emu::reduce_sync(LONGCTX_EMU_SITE, ::emu::kReduceXor, (mask), (v))
namespace emu {
inline unsigned int full_mask_default() { return 0xffffffffu; }
inline unsigned int full_mask_default(unsigned int mask) { return mask; }
}  // namespace emu

// A trap or a failed assert ends the launch with an error naming the block, the thread and the site (the GPU would
// end the context; the emulator reports and goes on).
#define __trap() ::emu::trap(LONGCTX_EMU_SITE, "__trap()")
#define __brkpt() ::emu::trap(LONGCTX_EMU_SITE, "__brkpt()")
#undef assert
#define assert(e) ((e) ? static_cast<void>(0) : ::emu::assert_fail(#e, LONGCTX_EMU_SITE, __func__))

#endif  // LONGCTX_EMU_H
