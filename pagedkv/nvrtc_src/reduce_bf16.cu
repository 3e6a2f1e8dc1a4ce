// Deterministic BF16 reductions (sum, sum of squares, sum of |x|) over listed blocks of one
// region, accumulated in float64. Pass 1: every CTA reduces a fixed share of the work to
// three partials (a fixed-shape tree in shared memory). Pass 2: one CTA sums the partials
// in a fixed order. No atomics: the same data and grid give bit-identical results.
// BF16 is a 16-bit pattern whose float32 is `bits << 16`; no CUDA headers are needed.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define REDUCE_THREADS 256

struct Sums { double sum, ssq, sabs; };

__device__ __forceinline__ void add_bits(Sums& s, u32 bits16) {
    const double x = (double)__uint_as_float(bits16 << 16);
    s.sum += x;
    s.ssq += x * x;
    s.sabs += fabs(x);
}

__device__ __forceinline__ void add_word(Sums& s, u32 w) {
    add_bits(s, w & 0xFFFFu);
    add_bits(s, w >> 16);
}

// Sum `s` over the CTA in a fixed tree; thread 0 gets the total.
__device__ Sums cta_reduce(Sums s) {
    __shared__ double sh[3][REDUCE_THREADS];
    sh[0][threadIdx.x] = s.sum;
    sh[1][threadIdx.x] = s.ssq;
    sh[2][threadIdx.x] = s.sabs;
    __syncthreads();
    for (int half = REDUCE_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            sh[0][threadIdx.x] += sh[0][threadIdx.x + half];
            sh[1][threadIdx.x] += sh[1][threadIdx.x + half];
            sh[2][threadIdx.x] += sh[2][threadIdx.x + half];
        }
        __syncthreads();
    }
    Sums out;
    out.sum = sh[0][0];
    out.ssq = sh[1][0];
    out.sabs = sh[2][0];
    return out;
}

// Launch with REDUCE_THREADS threads. `partials` holds 3 doubles per CTA (sum, ssq, sabs).
extern "C" __global__ void pagedkv_reduce_bf16_partial(
    long long base, long long stride, long long nbytes,
    const int* __restrict__ blocks, int num_blocks, double* __restrict__ partials)
{
    Sums s = {0.0, 0.0, 0.0};
    const i64 nvalues = nbytes >> 1;
    for (int k = blockIdx.x; k < num_blocks; k += gridDim.x) {
        const char* start = (const char*)(base + (i64)blocks[k] * stride);
        i64 head = 0;
        if (((u64)start & 15u) == 0) {
            const uint4* words = (const uint4*)start;
            const i64 nwords = nbytes >> 4;
#pragma unroll 4
            for (i64 w = threadIdx.x; w < nwords; w += REDUCE_THREADS) {
                const uint4 v = __ldcs(words + w);
                add_word(s, v.x);
                add_word(s, v.y);
                add_word(s, v.z);
                add_word(s, v.w);
            }
            head = nwords << 3;
        }
        const u16* values = (const u16*)start;
        for (i64 i = head + threadIdx.x; i < nvalues; i += REDUCE_THREADS) add_bits(s, values[i]);
    }
    const Sums total = cta_reduce(s);
    if (threadIdx.x == 0) {
        partials[3 * blockIdx.x + 0] = total.sum;
        partials[3 * blockIdx.x + 1] = total.ssq;
        partials[3 * blockIdx.x + 2] = total.sabs;
    }
}

// Launch one CTA of REDUCE_THREADS threads: sums `num_partials` partial triples into `out`.
extern "C" __global__ void pagedkv_reduce_bf16_final(
    const double* __restrict__ partials, int num_partials, double* __restrict__ out)
{
    Sums s = {0.0, 0.0, 0.0};
    for (int p = threadIdx.x; p < num_partials; p += REDUCE_THREADS) {
        s.sum += partials[3 * p + 0];
        s.ssq += partials[3 * p + 1];
        s.sabs += partials[3 * p + 2];
    }
    const Sums total = cta_reduce(s);
    if (threadIdx.x == 0) {
        out[0] = total.sum;
        out[1] = total.ssq;
        out[2] = total.sabs;
    }
}
