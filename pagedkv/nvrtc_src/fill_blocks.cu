// Batched fill: set every byte of every listed block in every region to one byte value.
// Work item i = (row, k) covers block blocks[k] of region row `row` (row-major, so
// consecutive CTAs sweep one region's blocks). Each CTA takes items in a grid-stride loop;
// its threads write 16-byte words where the block start is 16-byte aligned, bytes elsewhere.
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
        i64 head = 0;
        if (((u64)start & 15u) == 0) {
            uint4* words = (uint4*)start;
            const i64 nwords = r.nbytes >> 4;
            for (i64 w = threadIdx.x; w < nwords; w += blockDim.x) __stcs(words + w, vec);
            head = nwords << 4;
        }
        for (i64 b = head + threadIdx.x; b < r.nbytes; b += blockDim.x) start[b] = (u8)byte;
    }
}
