// The CUDA device dialect pagedkv's kernels use, for host C++20 (g++ -include cuda_shim.h).
//
// Force-included in front of an unchanged pagedkv/nvrtc_src/*.cu file so the kernel runs
// on the CPU under the kernel harness (tests/kernel_harness/README.md says what it models
// and what it does not). Every CUDA thread of a CTA is a fiber of runtime.cc; the
// built-in index variables below are rewritten by the scheduler before each fiber runs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// ---- qualifiers ------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __noinline__ __attribute__((noinline))
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
// Constant memory lives in its own section, so the traffic model (model.inc) can tell a
// constant access from a global one.
#define __constant__ static const __attribute__((section("pkv_constant")))
// Static shared memory lives in one section per kernel library; runtime.cc fills the
// whole section with 0xFF before every CTA (CTAs run one at a time).
#define __shared__ static __attribute__((section("pkv_shared"), aligned(16)))

// ---- vector types with the GPU's sizes and alignments ---------------------------------
#define PKV_VEC2(name, T, align) struct __attribute__((aligned(align))) name { T x, y; };
#define PKV_VEC3(name, T) struct name { T x, y, z; };
#define PKV_VEC4(name, T, align) struct __attribute__((aligned(align))) name { T x, y, z, w; };
PKV_VEC2(char2, signed char, 2) PKV_VEC2(uchar2, unsigned char, 2)
PKV_VEC4(char4, signed char, 4) PKV_VEC4(uchar4, unsigned char, 4)
PKV_VEC2(short2, short, 4) PKV_VEC2(ushort2, unsigned short, 4)
PKV_VEC4(short4, short, 8) PKV_VEC4(ushort4, unsigned short, 8)
PKV_VEC2(int2, int, 8) PKV_VEC2(uint2, unsigned int, 8)
PKV_VEC3(int3, int) PKV_VEC3(uint3, unsigned int) PKV_VEC3(float3, float)
PKV_VEC4(int4, int, 16) PKV_VEC4(uint4, unsigned int, 16)
PKV_VEC2(float2, float, 8) PKV_VEC4(float4, float, 16)
PKV_VEC2(longlong2, long long, 16) PKV_VEC2(ulonglong2, unsigned long long, 16)
PKV_VEC2(double2, double, 16)
#undef PKV_VEC2
#undef PKV_VEC3
#undef PKV_VEC4
static_assert(sizeof(uint4) == 16 && alignof(uint4) == 16 && alignof(uint2) == 8 && alignof(uint3) == 4);

struct dim3 {
    unsigned int x, y, z;
};

// ---- built-in variables: the running fiber's, set by the scheduler ---------------------
extern "C" {
extern uint3 pkv_threadIdx, pkv_blockIdx;
extern dim3 pkv_blockDim, pkv_gridDim;
}
#define threadIdx pkv_threadIdx
#define blockIdx pkv_blockIdx
#define blockDim pkv_blockDim
#define gridDim pkv_gridDim
#define warpSize 32

// ---- synchronisation and faults (runtime.cc) -------------------------------------------
extern "C" {
void pkv_syncthreads(const char* file, int line);
void pkv_syncwarp(unsigned mask, const char* file, int line);
[[noreturn]] void pkv_trap(const char* file, int line);
uint64_t pkv_warp_exchange(unsigned mask, uint64_t value, int mode, int arg, int width, const char* file, int line);
void pkv_check_alignment(const void* p, unsigned alignment, const char* what, const char* file, int line);
}
#define __syncthreads() pkv_syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) pkv_syncwarp(pkv_mask_or_full(__VA_ARGS__), __FILE__, __LINE__)
#define __trap() pkv_trap(__FILE__, __LINE__)
static inline unsigned pkv_mask_or_full(unsigned mask = 0xFFFFFFFFu) { return mask; }

// ---- bit casts -------------------------------------------------------------------------
template <class To, class From>
static inline To pkv_bits(From v) {
    static_assert(sizeof(To) == sizeof(From));
    To out;
    std::memcpy(&out, &v, sizeof(To));
    return out;
}
static inline float __uint_as_float(unsigned int v) { return pkv_bits<float>(v); }
static inline float __int_as_float(int v) { return pkv_bits<float>(v); }
static inline unsigned int __float_as_uint(float v) { return pkv_bits<unsigned int>(v); }
static inline int __float_as_int(float v) { return pkv_bits<int>(v); }
static inline double __longlong_as_double(long long v) { return pkv_bits<double>(v); }
static inline long long __double_as_longlong(double v) { return pkv_bits<long long>(v); }

// ---- arithmetic with the GPU's IEEE semantics ------------------------------------------
// Built with -ffp-contract=off and SSE2 math, so + - * / and sqrt are single correctly
// rounded IEEE operations, as NVRTC's --fmad=false code is.
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return std::sqrt(a); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline float __saturatef(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
using std::fabs;
using std::sqrt;

// BF16 as its bit pattern, with round-to-nearest-even conversion (NaN stays a quiet NaN).
struct __nv_bfloat16 {
    unsigned short bits;
};
static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    const unsigned int u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return {(unsigned short)((u >> 16) | 0x40u)};
    const unsigned int rounded = u + 0x7FFFu + ((u >> 16) & 1u);
    return {(unsigned short)(rounded >> 16)};
}
static inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float((unsigned int)h.bits << 16); }
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return {bits}; }

// ---- integer intrinsics ----------------------------------------------------------------
static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned int __brev(unsigned int x) {
    x = (x >> 1 & 0x55555555u) | (x & 0x55555555u) << 1;
    x = (x >> 2 & 0x33333333u) | (x & 0x33333333u) << 2;
    x = (x >> 4 & 0x0F0F0F0Fu) | (x & 0x0F0F0F0Fu) << 4;
    return __builtin_bswap32(x);
}
static inline unsigned int __umulhi(unsigned int a, unsigned int b) { return (unsigned int)((unsigned long long)a * b >> 32); }
static inline int __mulhi(int a, int b) { return (int)((long long)a * b >> 32); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)((unsigned __int128)a * b >> 64);
}
static inline long long __mul64hi(long long a, long long b) { return (long long)((__int128)a * b >> 64); }
static inline unsigned int __funnelshift_l(unsigned int lo, unsigned int hi, unsigned int s) {
    const unsigned long long v = (unsigned long long)hi << 32 | lo;
    return (unsigned int)((v << (s & 31u)) >> 32);
}
static inline unsigned int __funnelshift_r(unsigned int lo, unsigned int hi, unsigned int s) {
    const unsigned long long v = (unsigned long long)hi << 32 | lo;
    return (unsigned int)(v >> (s & 31u));
}
static inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const unsigned long long v = (unsigned long long)y << 32 | x;
    unsigned int out = 0;
    for (int i = 0; i < 4; i++) out |= (unsigned int)(v >> (8 * ((s >> (4 * i)) & 7u)) & 0xFFu) << (8 * i);
    return out;
}
template <class T>
static inline T min(T a, T b) { return b < a ? b : a; }
template <class T>
static inline T max(T a, T b) { return a < b ? b : a; }

// ---- atomics: plain read-modify-writes, exact because nothing runs concurrently --------
// Atomics and memory intrinsics are always inlined: the traffic model attributes their
// accesses to the kernel line that calls them. In a model build an atomic is one traced
// read-modify-write (pkv_model_atomic), its own read and write not instrumented.
#define PKV_INLINE static inline __attribute__((always_inline))
#ifdef PKV_MODEL
extern "C" void pkv_model_atomic(void* p, unsigned size);
extern "C" void pkv_model_copy(void* dst, const void* src, unsigned size);
template <class T>
PKV_INLINE T pkv_atomic_read(T* p) {
    pkv_model_atomic(p, sizeof(T));
    T v;
    pkv_model_copy(&v, p, sizeof(T));
    return v;
}
template <class T>
PKV_INLINE void pkv_atomic_write(T* p, T v) { pkv_model_copy(p, &v, sizeof(T)); }
#else
template <class T>
PKV_INLINE T pkv_atomic_read(T* p) { return *p; }
template <class T>
PKV_INLINE void pkv_atomic_write(T* p, T v) { *p = v; }
#endif
template <class T>
PKV_INLINE T atomicAdd(T* p, T v) { T old = pkv_atomic_read(p); pkv_atomic_write(p, (T)(old + v)); return old; }
template <class T>
PKV_INLINE T atomicSub(T* p, T v) { T old = pkv_atomic_read(p); pkv_atomic_write(p, (T)(old - v)); return old; }
template <class T>
PKV_INLINE T atomicExch(T* p, T v) { T old = pkv_atomic_read(p); pkv_atomic_write(p, v); return old; }
template <class T>
PKV_INLINE T atomicMin(T* p, T v) { T old = pkv_atomic_read(p); pkv_atomic_write(p, v < old ? v : old); return old; }
template <class T>
PKV_INLINE T atomicMax(T* p, T v) { T old = pkv_atomic_read(p); pkv_atomic_write(p, old < v ? v : old); return old; }
template <class T>
PKV_INLINE T atomicOr(T* p, T v) { T old = pkv_atomic_read(p); pkv_atomic_write(p, (T)(old | v)); return old; }
template <class T>
PKV_INLINE T atomicAnd(T* p, T v) { T old = pkv_atomic_read(p); pkv_atomic_write(p, (T)(old & v)); return old; }
template <class T>
PKV_INLINE T atomicCAS(T* p, T expected, T v) {
    T old = pkv_atomic_read(p);
    if (old == expected) pkv_atomic_write(p, v);
    return old;
}
static inline void __threadfence() {}
static inline void __threadfence_block() {}

// ---- memory intrinsics: alignment checked like every other access ---------------------
#define PKV_LOAD(name)                                                                         \
    template <class T>                                                                         \
    PKV_INLINE T name(const T* p) {                                                         \
        pkv_check_alignment(p, alignof(T), #name, __FILE__, __LINE__);                         \
        return *p;                                                                             \
    }
#define PKV_STORE(name)                                                                        \
    template <class T>                                                                         \
    PKV_INLINE void name(T* p, T v) {                                                       \
        pkv_check_alignment(p, alignof(T), #name, __FILE__, __LINE__);                         \
        *p = v;                                                                                \
    }
PKV_LOAD(__ldg) PKV_LOAD(__ldcg) PKV_LOAD(__ldca) PKV_LOAD(__ldcs) PKV_LOAD(__ldlu) PKV_LOAD(__ldcv)
PKV_STORE(__stwb) PKV_STORE(__stcg) PKV_STORE(__stcs) PKV_STORE(__stwt)
#undef PKV_LOAD
#undef PKV_STORE

// ---- warp intrinsics: a per-warp exchange between two warp barriers --------------------
enum { PKV_SHFL_IDX = 0, PKV_SHFL_XOR = 1, PKV_SHFL_UP = 2, PKV_SHFL_DOWN = 3, PKV_BALLOT = 4 };
#define PKV_SHFL(name, mode)                                                                   \
    template <class T>                                                                         \
    static inline T pkv_##name(unsigned mask, T v, int arg, int width, const char* f, int l) { \
        static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);                      \
        uint64_t bits = 0;                                                                     \
        std::memcpy(&bits, &v, sizeof(T));                                                     \
        bits = pkv_warp_exchange(mask, bits, mode, arg, width, f, l);                          \
        T out;                                                                                 \
        std::memcpy(&out, &bits, sizeof(T));                                                   \
        return out;                                                                            \
    }
PKV_SHFL(shfl_sync, PKV_SHFL_IDX)
PKV_SHFL(shfl_xor_sync, PKV_SHFL_XOR)
PKV_SHFL(shfl_up_sync, PKV_SHFL_UP)
PKV_SHFL(shfl_down_sync, PKV_SHFL_DOWN)
#undef PKV_SHFL
static inline int pkv_width(int width = 32) { return width; }
#define __shfl_sync(mask, v, lane, ...) pkv_shfl_sync(mask, v, lane, pkv_width(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_xor_sync(mask, v, m, ...) pkv_shfl_xor_sync(mask, v, m, pkv_width(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_up_sync(mask, v, d, ...) pkv_shfl_up_sync(mask, v, d, pkv_width(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_down_sync(mask, v, d, ...) pkv_shfl_down_sync(mask, v, d, pkv_width(__VA_ARGS__), __FILE__, __LINE__)
#define __ballot_sync(mask, pred) \
    ((unsigned)pkv_warp_exchange(mask, (pred) ? 1u : 0u, PKV_BALLOT, 0, 32, __FILE__, __LINE__))
#define __any_sync(mask, pred) (__ballot_sync(mask, pred) != 0u)
#define __all_sync(mask, pred) (__ballot_sync(mask, pred) == (unsigned)(mask))
