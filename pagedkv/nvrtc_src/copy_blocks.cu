// Batched block copy: block src[k] -> block dst[k] in every region (copy-on-write).
// Work item i = (row, k), grid-stride over items; 16-byte words when both the source and
// the destination block start on a 16-byte boundary, bytes elsewhere. The caller
// guarantees no destination repeats or is also a source, so items never race.

typedef unsigned char u8;
typedef unsigned long long u64;
typedef long long i64;

struct Region { i64 base; i64 stride; i64 nbytes; };

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
        i64 head = 0;
        if ((((u64)from | (u64)to) & 15u) == 0) {
            const uint4* in = (const uint4*)from;
            uint4* out = (uint4*)to;
            const i64 nwords = r.nbytes >> 4;
#pragma unroll 4
            for (i64 w = threadIdx.x; w < nwords; w += blockDim.x) __stcs(out + w, __ldcs(in + w));
            head = nwords << 4;
        }
        for (i64 b = head + threadIdx.x; b < r.nbytes; b += blockDim.x) to[b] = from[b];
    }
}
