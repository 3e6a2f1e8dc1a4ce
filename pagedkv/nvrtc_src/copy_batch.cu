// Batched range copy (a host tier's swaps when the driver has no cuMemcpyBatchAsync):
// range r copies sizes[r] bytes from srcs[r] to dsts[r], device addresses (device memory,
// or mapped pinned host memory through its device pointer). The descriptor is read where
// it lies (mapped pinned memory, so no upload precedes the launch): four u64 arrays,
// dsts[count], srcs[count], sizes[count], first[count + 1], where first[r] is the first
// chunk of range r and first[count] the number of chunks. Work item = one chunk of `chunk`
// bytes (a multiple of 16) of one range, grid-stride over the chunks. The caller
// guarantees destinations overlap neither each other nor any source (hence __restrict__).
// A chunk is copied in the widest words both ends allow: the bytes up to the first word
// boundary (the head) and after the last (the tail) singly, the body in words; each
// thread loads COPY_UNROLL words before storing them, so several loads are in flight
// (the scheme of copy_blocks.cu; kernels use no headers, so it is repeated here).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define COPY_UNROLL 4

template <typename W>
__device__ void copy_span(const u8* __restrict__ from, u8* __restrict__ to, i64 nbytes) {
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
            if (w < nwords) v[u] = in[w];
        }
#pragma unroll
        for (int u = 0; u < COPY_UNROLL; u++) {
            const i64 w = w0 + (i64)u * blockDim.x;
            if (w < nwords) out[w] = v[u];
        }
    }
    for (i64 b = tail + threadIdx.x; b < nbytes; b += blockDim.x) to[b] = from[b];
}

// The range whose chunks include `item`: the last r with first[r] <= item (binary search).
__device__ i64 range_of(const u64* __restrict__ first, i64 count, u64 item) {
    i64 lo = 0, hi = count - 1;
    while (lo < hi) {
        const i64 mid = (lo + hi + 1) / 2;
        if (first[mid] <= item) lo = mid; else hi = mid - 1;
    }
    return lo;
}

__device__ void copy_chunk(const u8* from, u8* to, i64 nbytes) {
    // the widest word size both ends can be aligned to at once
    const u32 skew = (u32)((u64)from ^ (u64)to) & 15u;
    if (skew == 0) copy_span<uint4>(from, to, nbytes);
    else if ((skew & 7u) == 0) copy_span<u64>(from, to, nbytes);
    else if ((skew & 3u) == 0) copy_span<u32>(from, to, nbytes);
    else if ((skew & 1u) == 0) copy_span<u16>(from, to, nbytes);
    else copy_span<u8>(from, to, nbytes);
}

extern "C" __global__ void pagedkv_copy_batch(const u64* __restrict__ ranges, i64 count, i64 chunk)
{
    const u64* dsts = ranges;
    const u64* srcs = ranges + count;
    const u64* sizes = ranges + 2 * count;
    const u64* first = ranges + 3 * count;
    const u64 chunks = first[count];
    for (u64 item = blockIdx.x; item < chunks; item += gridDim.x) {
        const i64 r = range_of(first, count, item);
        const u64 offset = (item - first[r]) * (u64)chunk;
        const u64 left = sizes[r] - offset;
        const i64 nbytes = (i64)(left < (u64)chunk ? left : (u64)chunk);
        copy_chunk((const u8*)(srcs[r] + offset), (u8*)(dsts[r] + offset), nbytes);
    }
}
