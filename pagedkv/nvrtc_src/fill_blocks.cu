// Batched fill: set every byte of every listed block in every region to one byte value.
// Work item i = (row, k) covers block blocks[k] of region row `row` (row-major, so
// consecutive CTAs sweep one region's blocks). Each CTA takes items in a grid-stride loop;
// a block's bytes up to its first 16-byte boundary (the head) and after its last (the
// tail) are written singly, the body between as 16-byte words, wherever the block starts.
// Streaming stores (__stcs): filled blocks are not read back soon, so they should not
// evict other data from L2.

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

struct Region { i64 base; i64 stride; i64 nbytes; };

extern "C" __global__ void pagedkv_fill_blocks(
    const Region* __restrict__ table, int num_rows,
    const int* __restrict__ blocks, int num_blocks, u32 value)
{
    const u32 byte = value & 0xFFu;
    const u32 word = byte * 0x01010101u;
    uint4 vec;
    vec.x = word; vec.y = word; vec.z = word; vec.w = word;
    const i64 items = (i64)num_rows * num_blocks;
    for (i64 item = blockIdx.x; item < items; item += gridDim.x) {
        const int row = (int)(item / num_blocks);
        const int k = (int)(item - (i64)row * num_blocks);
        const Region r = table[row];
        u8* start = (u8*)(r.base + (i64)blocks[k] * r.stride);
        i64 head = (i64)((16u - ((u32)(u64)start & 15u)) & 15u);
        if (head > r.nbytes) head = r.nbytes;
        const i64 nwords = (r.nbytes - head) >> 4;
        const i64 tail = head + (nwords << 4);
        if (threadIdx.x < head) start[threadIdx.x] = (u8)byte;
        uint4* words = (uint4*)(start + head);
        for (i64 w = threadIdx.x; w < nwords; w += blockDim.x) __stcs(words + w, vec);
        for (i64 b = tail + threadIdx.x; b < r.nbytes; b += blockDim.x) start[b] = (u8)byte;
    }
}
