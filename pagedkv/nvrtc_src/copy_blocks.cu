// Batched block copy: block src[k] -> block dst[k] in every region (copy-on-write).
// Work item i = (row, k), grid-stride over items. The caller guarantees no destination
// repeats or is also a source and blocks do not overlap (stride >= nbytes), so items never
// race and the source and destination of one item never alias (hence __restrict__).
// A block is copied in the widest words both ends allow: the bytes up to the first word
// boundary (the head) and after the last (the tail) singly, the body in words; each
// thread loads COPY_UNROLL words before storing them, so several loads are in flight.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define COPY_UNROLL 4

struct Region { i64 base; i64 stride; i64 nbytes; };

__device__ __forceinline__ uint4 load_word(const uint4* p) { return __ldcs(p); }
__device__ __forceinline__ void store_word(uint4* p, uint4 v) { __stcs(p, v); }
template <typename W> __device__ __forceinline__ W load_word(const W* p) { return *p; }
template <typename W> __device__ __forceinline__ void store_word(W* p, W v) { *p = v; }

template <typename W>
__device__ void copy_block(const u8* __restrict__ from, u8* __restrict__ to, i64 nbytes) {
    const u32 size = (u32)sizeof(W);
    i64 head = (i64)((size - ((u32)(u64)to & (size - 1))) & (size - 1));
    if (head > nbytes) head = nbytes;
    const i64 nwords = (nbytes - head) / size;
    const i64 tail = head + nwords * size;
    if (threadIdx.x < head) to[threadIdx.x] = from[threadIdx.x];
    const W* __restrict__ in = (const W*)(from + head);
    W* __restrict__ out = (W*)(to + head);
    const i64 step = (i64)blockDim.x * COPY_UNROLL;
    for (i64 w0 = threadIdx.x; w0 < nwords; w0 += step) {
        W v[COPY_UNROLL];
#pragma unroll
        for (int u = 0; u < COPY_UNROLL; u++) {
            const i64 w = w0 + (i64)u * blockDim.x;
            if (w < nwords) v[u] = load_word(in + w);
        }
#pragma unroll
        for (int u = 0; u < COPY_UNROLL; u++) {
            const i64 w = w0 + (i64)u * blockDim.x;
            if (w < nwords) store_word(out + w, v[u]);
        }
    }
    for (i64 b = tail + threadIdx.x; b < nbytes; b += blockDim.x) to[b] = from[b];
}

extern "C" __global__ void pagedkv_copy_blocks(
    const Region* __restrict__ table, int num_rows,
    const int* __restrict__ src, const int* __restrict__ dst, int num_pairs)
{
    const i64 items = (i64)num_rows * num_pairs;
    for (i64 item = blockIdx.x; item < items; item += gridDim.x) {
        const int row = (int)(item / num_pairs);
        const int k = (int)(item - (i64)row * num_pairs);
        const Region r = table[row];
        const u8* from = (const u8*)(r.base + (i64)src[k] * r.stride);
        u8* to = (u8*)(r.base + (i64)dst[k] * r.stride);
        // the widest word size both ends can be aligned to at once
        const u32 skew = (u32)((u64)from ^ (u64)to) & 15u;
        if (skew == 0) copy_block<uint4>(from, to, r.nbytes);
        else if ((skew & 7u) == 0) copy_block<u64>(from, to, r.nbytes);
        else if ((skew & 3u) == 0) copy_block<u32>(from, to, r.nbytes);
        else if ((skew & 1u) == 0) copy_block<u16>(from, to, r.nbytes);
        else copy_block<u8>(from, to, r.nbytes);
    }
}
