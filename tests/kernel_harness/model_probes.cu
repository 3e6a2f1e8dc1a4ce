// Probe kernels for tests/driver/test_traffic_model.py: each has one access pattern whose
// warp-level figures are known (sectors, efficiency, bank conflicts, divergent constant
// reads, load batches). Not pagedkv kernels.

typedef unsigned int u32;

__constant__ u32 PROBE_TABLE[8] = {1, 2, 3, 4, 5, 6, 7, 8};

// 16-byte loads and stores, consecutive lanes on consecutive addresses: 16 sectors a request
extern "C" __global__ void probe_coalesced16(const uint4* in, uint4* out) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = in[i];
}

// 4-byte loads `stride` words apart; one 4-byte store per lane
extern "C" __global__ void probe_strided(const u32* in, u32* out, int stride) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = in[i * stride];
}

// every lane reads one word (a broadcast)
extern "C" __global__ void probe_uniform(const u32* in, u32* out) {
    out[threadIdx.x] = in[3];
}

// shared words `stride` apart: `stride`-way bank conflicts for even strides below 32
extern "C" __global__ void probe_bank(u32* out, int stride) {
    __shared__ u32 s[32 * 32];
    s[threadIdx.x * stride] = threadIdx.x;
    __syncwarp();
    out[threadIdx.x] = s[threadIdx.x * stride];
}

// constant reads at lane % ways: `ways` distinct addresses a request
extern "C" __global__ void probe_constant(u32* out, int ways) {
    out[threadIdx.x] = PROBE_TABLE[threadIdx.x % ways];
}

// shared atomics: every lane on one word (32 lanes in one bank); the index is a run-time
// value, since GCC does not instrument an access it proves in bounds (a constant index)
extern "C" __global__ void probe_shared_atomic(u32* out, int word) {
    __shared__ u32 c[4];
    if (threadIdx.x == 0) c[word] = 0;
    __syncwarp();
    atomicAdd(&c[word], 1u);
    __syncwarp();
    out[threadIdx.x] = c[word];
}

// four 16-byte loads before the first store: 64 bytes in flight per thread
extern "C" __global__ void probe_batched(const uint4* in, uint4* out, int n) {
    for (int base = 0; base < n; base += 4 * 32) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) v[u] = in[base + u * 32 + threadIdx.x];
#pragma unroll
        for (int u = 0; u < 4; u++) out[base + u * 32 + threadIdx.x] = v[u];
    }
}
