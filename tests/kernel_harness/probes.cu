// Probe kernels for tests/driver/test_kernel_harness.py: each exercises one thing the harness
// models (built-in indices, CTA order, shared-memory poison, barriers, divergence,
// alignment faults, __trap, warp intrinsics, IEEE conversions). Not pagedkv kernels.

typedef unsigned int u32;
typedef unsigned char u8;

extern "C" __global__ void probe_indices(u32* out) {
    const u32 cta = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const u32 i = cta * (blockDim.x * blockDim.y * blockDim.z) + (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    out[4 * i + 0] = threadIdx.x | threadIdx.y << 8 | threadIdx.z << 16;
    out[4 * i + 1] = blockIdx.x | blockIdx.y << 8 | blockIdx.z << 16;
    out[4 * i + 2] = blockDim.x | blockDim.y << 8 | blockDim.z << 16;
    out[4 * i + 3] = gridDim.x | gridDim.y << 8 | gridDim.z << 16;
}

extern "C" __global__ void probe_cta_order(u32* log, u32* count) {
    if (threadIdx.x == 0) log[(*count)++] = blockIdx.x;
}

extern "C" __global__ void probe_shared_poison(u32* out) {
    __shared__ u32 s[64];
    out[blockIdx.x * 64 + threadIdx.x] = s[threadIdx.x];  // read before any write
    s[threadIdx.x] = blockIdx.x;
}

extern "C" __global__ void probe_barrier_exchange(u32* out) {
    __shared__ u32 s[256];
    s[threadIdx.x] = threadIdx.x * 7u + blockIdx.x;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}

extern "C" __global__ void probe_divergent_sites(u32* out) {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1;
}

extern "C" __global__ void probe_early_exit(u32* out) {
    if (threadIdx.x == 3) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}

extern "C" __global__ void probe_misaligned_store(u8* p, int offset) {
    *(u32*)(p + offset) = 0x01020304u;
}

extern "C" __global__ void probe_misaligned_ldcs(const u8* p, int offset, uint4* out) {
    *out = __ldcs((const uint4*)(p + offset));
}

extern "C" __global__ void probe_trap(u32* out) {
    if (blockIdx.x == 2 && threadIdx.x == 5) __trap();
    out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

extern "C" __global__ void probe_warp(const u32* in, u32* out) {
    const u32 t = threadIdx.x;
    const u32 v = in[t];
    out[6 * t + 0] = __shfl_xor_sync(0xFFFFFFFFu, v, 5);
    out[6 * t + 1] = __shfl_sync(0xFFFFFFFFu, v, 7);
    out[6 * t + 2] = __shfl_down_sync(0xFFFFFFFFu, v, 3);
    out[6 * t + 3] = __shfl_up_sync(0xFFFFFFFFu, v, 2, 16);
    out[6 * t + 4] = __ballot_sync(0xFFFFFFFFu, v & 1u);
    out[6 * t + 5] = (u32)__any_sync(0xFFFFFFFFu, v == 77u) | (u32)__all_sync(0xFFFFFFFFu, v < 1000u) << 1;
}

extern "C" __global__ void probe_warp_divergence(u32* out) {
    u32 v = threadIdx.x;
    if (threadIdx.x < 16) v = __shfl_xor_sync(0xFFFFFFFFu, v, 1);
    out[threadIdx.x] = v;
}

extern "C" __global__ void probe_float(const float* in, unsigned short* bf, float* madd, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        bf[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
        madd[i] = in[i] * 3.0f + 1.0f;  // two roundings: no contraction into an FMA
    }
}

extern "C" __global__ void probe_integer_intrinsics(const unsigned long long* in, unsigned long long* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const unsigned long long a = in[2 * i], b = in[2 * i + 1];
        const u32 x = (u32)a, y = (u32)b;
        unsigned long long* o = out + 10 * i;
        o[0] = (unsigned long long)__popc(x) | (unsigned long long)__popcll(a) << 32;
        o[1] = (unsigned long long)(u32)__clz((int)x) | (unsigned long long)(u32)__clzll((long long)a) << 32;
        o[2] = (unsigned long long)(u32)__ffs((int)x) | (unsigned long long)(u32)__ffsll((long long)a) << 32;
        o[3] = __brev(x);
        o[4] = __umulhi(x, y);
        o[5] = __umul64hi(a, b);
        o[6] = __funnelshift_l(x, y, (u32)(b >> 40)) | (unsigned long long)__funnelshift_r(x, y, (u32)(b >> 40)) << 32;
        o[7] = __byte_perm(x, y, (u32)(a >> 32) & 0x7777u);
        o[8] = min(a, b);
        o[9] = max(x, y);
    }
}

extern "C" __global__ void probe_atomics(u32* counters, unsigned long long* sum) {
    atomicAdd(&counters[0], 1u);
    atomicMax(&counters[1], blockIdx.x * blockDim.x + threadIdx.x);
    atomicMin(&counters[2], blockIdx.x * blockDim.x + threadIdx.x);
    atomicOr(&counters[3], 1u << (threadIdx.x % 32));
    atomicAdd(sum, (unsigned long long)threadIdx.x);
}

#define PROBE_BOUND 64
extern "C" __global__ void __launch_bounds__(PROBE_BOUND, 2) probe_bounded(u32* out) {
    out[threadIdx.x] = blockDim.x;
}

extern "C" __global__ void probe_mixed_warp_intrinsics(u32* out) {
    u32 v = threadIdx.x;
    if (threadIdx.x & 1u) v = __shfl_xor_sync(0xFFFFFFFFu, v, 1);
    else v = __ballot_sync(0xFFFFFFFFu, v);
    out[threadIdx.x] = v;
}
