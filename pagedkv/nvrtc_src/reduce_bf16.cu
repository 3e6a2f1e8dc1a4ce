// Exact BF16 reductions (sum, sum of |x|, sum of squares) over listed blocks of one region.
// Every finite BF16 value is m * 2^(s - 133) (m < 2^8, 0 <= s <= 253), so each thread adds
// integers into carry-save accumulators: 32-bit digits held in int64 words, carries deferred
// and propagated every NORMALIZE_EVERY values and at the end. Integer addition is exact and
// associative, so the result is the same for every grid, CTA order and thread count;
// pagedkv/exact_sum.py rounds it once to float64. Non-finite values only set flag bits.
// Pass 1: each CTA writes RESULT_WORDS words; pass 2: one CTA adds the partials.
// REDUCE_THREADS, SUM_DIGITS and SSQ_DIGITS come from Python as -D options
// (pagedkv.driver.nvrtc.source_defines); a launch with another blockDim.x traps.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#if !defined(REDUCE_THREADS) || !defined(SUM_DIGITS) || !defined(SSQ_DIGITS)
#error "compile with -DREDUCE_THREADS=... -DSUM_DIGITS=... -DSSQ_DIGITS=... (pagedkv.driver.nvrtc.source_defines)"
#endif

#define SUM_AT 0
#define SABS_AT SUM_DIGITS
#define SSQ_AT (2 * SUM_DIGITS)
#define FLAGS_AT (2 * SUM_DIGITS + SSQ_DIGITS)
#define RESULT_WORDS (FLAGS_AT + 1)
#define NORMALIZE_EVERY (1 << 30)  // each add puts < 2^32 into a digit: 2^30 adds cannot overflow

#define FLAG_NAN 1u
#define FLAG_POS_INF 2u
#define FLAG_NEG_INF 4u

struct Acc {
    i64 d[FLAGS_AT];
    u32 flags;
    u32 pending;  // values added since the last normalize
};

__device__ __forceinline__ void acc_init(Acc& a) {
#pragma unroll
    for (int i = 0; i < FLAGS_AT; i++) a.d[i] = 0;
    a.flags = 0;
    a.pending = 0;
}

// Propagate the carries of digits [at, at + n): every digit but the top ends in [0, 2^32).
__device__ __forceinline__ void carry(i64* d, int n) {
    for (int i = 0; i + 1 < n; i++) {
        const i64 c = d[i] >> 32;  // arithmetic shift: floor division by 2^32
        d[i] -= c * 4294967296LL;
        d[i + 1] += c;
    }
}

__device__ __forceinline__ void normalize(Acc& a) {
    carry(a.d + SUM_AT, SUM_DIGITS);
    carry(a.d + SABS_AT, SUM_DIGITS);
    carry(a.d + SSQ_AT, SSQ_DIGITS);
    a.pending = 0;
}

__device__ __forceinline__ void add_bits(Acc& a, u32 bits) {
    const u32 e = (bits >> 7) & 0xFFu;
    const u32 f = bits & 0x7Fu;
    if (e == 0xFFu) {
        a.flags |= f ? FLAG_NAN : ((bits & 0x8000u) ? FLAG_NEG_INF : FLAG_POS_INF);
        return;
    }
    const u32 m = e ? (f | 0x80u) : f;
    if (m == 0) return;
    const u32 s = e ? e - 1 : 0;
    const u64 v = (u64)m << (s & 31);  // < 2^39
    const int dv = (int)(s >> 5);
    const i64 lo = (i64)(v & 0xFFFFFFFFull), hi = (i64)(v >> 32);
    if (bits & 0x8000u) {
        a.d[SUM_AT + dv] -= lo;
        a.d[SUM_AT + dv + 1] -= hi;
    } else {
        a.d[SUM_AT + dv] += lo;
        a.d[SUM_AT + dv + 1] += hi;
    }
    a.d[SABS_AT + dv] += lo;
    a.d[SABS_AT + dv + 1] += hi;
    const u32 s2 = 2 * s;
    const u64 q = (u64)(m * m) << (s2 & 31);  // < 2^47
    const int dq = (int)(s2 >> 5);
    a.d[SSQ_AT + dq] += (i64)(q & 0xFFFFFFFFull);
    a.d[SSQ_AT + dq + 1] += (i64)(q >> 32);
    if (++a.pending == NORMALIZE_EVERY) normalize(a);
}

__device__ __forceinline__ void add_word(Acc& a, u32 w) {
    add_bits(a, w & 0xFFFFu);
    add_bits(a, w >> 16);
}

#define WORDS_PER_ROUND 12  // RESULT_WORDS (36) in three rounds of a shared tree
#if RESULT_WORDS % WORDS_PER_ROUND
#error "RESULT_WORDS must be a multiple of WORDS_PER_ROUND"
#endif

// Sum every thread's words over the CTA (flags OR-ed); thread 0 writes them to `out`.
// The caller normalised each thread's digits (< 2^32 but the signed top), so the CTA's
// sums stay far inside int64.
__device__ void cta_write(const Acc& a, i64* __restrict__ out) {
    __shared__ i64 sh[WORDS_PER_ROUND][REDUCE_THREADS];
    for (int first = 0; first < RESULT_WORDS; first += WORDS_PER_ROUND) {
#pragma unroll
        for (int j = 0; j < WORDS_PER_ROUND; j++)
            sh[j][threadIdx.x] = first + j < FLAGS_AT ? a.d[first + j] : (i64)a.flags;
        __syncthreads();
        for (int half = REDUCE_THREADS / 2; half > 0; half >>= 1) {
            if (threadIdx.x < half) {
#pragma unroll
                for (int j = 0; j < WORDS_PER_ROUND; j++) {
                    if (first + j < FLAGS_AT) sh[j][threadIdx.x] += sh[j][threadIdx.x + half];
                    else sh[j][threadIdx.x] |= sh[j][threadIdx.x + half];
                }
            }
            __syncthreads();
        }
        if (threadIdx.x == 0)
            for (int j = 0; j < WORDS_PER_ROUND; j++) out[first + j] = sh[j][0];
        __syncthreads();
    }
}

// Launch with REDUCE_THREADS threads; `partials` holds RESULT_WORDS int64 words per CTA.
// `base` and `stride` are even (checked in Python), so every value is 2-byte aligned.
extern "C" __global__ void __launch_bounds__(REDUCE_THREADS) pagedkv_reduce_bf16_partial(
    long long base, long long stride, long long nbytes,
    const int* __restrict__ blocks, int num_blocks, long long* __restrict__ partials)
{
    if (blockDim.x != REDUCE_THREADS) __trap();
    Acc a;
    acc_init(a);
    const i64 nvalues = nbytes >> 1;
    for (int k = blockIdx.x; k < num_blocks; k += gridDim.x) {
        const u16* values = (const u16*)(base + (i64)blocks[k] * stride);
        // head: values up to the first 16-byte boundary; body: 16-byte words; then the tail
        i64 head = (i64)(((16u - ((u32)(u64)values & 15u)) & 15u) >> 1);
        if (head > nvalues) head = nvalues;
        const i64 nwords = (nvalues - head) >> 3;
        const i64 tail = head + (nwords << 3);
        if (threadIdx.x < head) add_bits(a, values[threadIdx.x]);
        const uint4* words = (const uint4*)(values + head);
#pragma unroll 4
        for (i64 w = threadIdx.x; w < nwords; w += REDUCE_THREADS) {
            const uint4 v = __ldcs(words + w);
            add_word(a, v.x);
            add_word(a, v.y);
            add_word(a, v.z);
            add_word(a, v.w);
        }
        for (i64 i = tail + threadIdx.x; i < nvalues; i += REDUCE_THREADS) add_bits(a, values[i]);
    }
    normalize(a);
    cta_write(a, partials + (i64)RESULT_WORDS * blockIdx.x);
}

// Launch one CTA of REDUCE_THREADS threads: adds `num_partials` partial results into `out`.
extern "C" __global__ void __launch_bounds__(REDUCE_THREADS) pagedkv_reduce_bf16_final(
    const long long* __restrict__ partials, int num_partials, long long* __restrict__ out)
{
    if (blockDim.x != REDUCE_THREADS) __trap();
    Acc a;
    acc_init(a);
    for (int p = threadIdx.x; p < num_partials; p += REDUCE_THREADS) {
        const i64* part = partials + (i64)RESULT_WORDS * p;
        for (int j = 0; j < FLAGS_AT; j++) a.d[j] += part[j];
        a.flags |= (u32)part[FLAGS_AT];
        normalize(a);  // a partial's digits are < 2^41: normalising after each keeps a far from overflow
    }
    cta_write(a, out);
}
