// Exact BF16 reductions (sum, sum of |x|, sum of squares) over listed blocks of one region.
// Every finite BF16 value is m * 2^(s - 133) (m < 2^8, 0 <= s <= 253). Each CTA counts its
// values into per-exponent bins in shared memory (32-bit integers: the sum of m of the
// positive and of the negative values of shift s, and the sum of m * m), one shared
// atomic per bin and value; every FLUSH_AFTER values the bins are added once each into the
// CTA's wide fixed-point digits (32-bit digits held in int64 words, units 2^-133 and
// 2^-266) and cleared. Integer addition is exact and associative, so the result is the same
// for every grid, CTA order and thread count; pagedkv/exact_sum.py rounds it once to
// float64. Non-finite values only set flag bits. Pass 1: each CTA writes RESULT_WORDS
// words; pass 2: one CTA adds the partials. Any block size works (loops stride by
// blockDim.x); REDUCE_THREADS (the launch's) bounds it. REDUCE_THREADS, SUM_DIGITS and
// SSQ_DIGITS come from Python as -D options (pagedkv.driver.nvrtc.source_defines).

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

#define FLAG_NAN 1u
#define FLAG_POS_INF 2u
#define FLAG_NEG_INF 4u

#define BINS 256              // shifts 0..253
#define LOADS 2               // 16-byte loads a thread issues before binning them
#define FLUSH_AFTER (1 << 15) // values: a round adds < 2^15 more, so a square bin stays < 2^32

__shared__ u32 bin_pos[BINS], bin_neg[BINS], bin_sq[BINS];
__shared__ i64 cta_digits[FLAGS_AT];
__shared__ u32 cta_flags;

// digits[0, n) += sign * v * 2^shift (v < 2^63) with shared atomics; the top digit takes
// what lies above it (a carry-save top digit is signed and unbounded).
__device__ __forceinline__ void wide_add(i64* digits, int n, u64 v, u32 shift, bool negative) {
    const int k = (int)(shift >> 5);
    const u32 r = shift & 31u;
    const u64 lo = (v & 0xFFFFFFFFull) << r, hi = (v >> 32) << r;
    u64 piece[3] = {lo & 0xFFFFFFFFull, (lo >> 32) + (hi & 0xFFFFFFFFull), hi >> 32};
#pragma unroll
    for (int i = 0; i < 3; i++) {
        if (!piece[i]) continue;
        int at = k + i;
        u64 p = piece[i];
        if (at >= n) {  // only the top piece reaches past the top digit, and by one digit
            at = n - 1;
            p <<= 32;
        }
        atomicAdd((u64*)&digits[at], negative ? (u64)(-(i64)p) : p);
    }
}

// Propagate the carries of digits d[0, n): every digit but the top ends in [0, 2^32).
__device__ __forceinline__ void carry(i64* d, int n) {
    for (int i = 0; i + 1 < n; i++) {
        const i64 c = d[i] >> 32;  // arithmetic shift: floor division by 2^32
        d[i] -= c * 4294967296LL;
        d[i + 1] += c;
    }
}

__device__ void init_cta() {
    for (int i = threadIdx.x; i < BINS; i += blockDim.x) bin_pos[i] = bin_neg[i] = bin_sq[i] = 0;
    for (int i = threadIdx.x; i < FLAGS_AT; i += blockDim.x) cta_digits[i] = 0;
    if (threadIdx.x == 0) cta_flags = 0;
    __syncthreads();
}

// Add every bin into the CTA's digits (once per bin), clear the bins, propagate carries.
__device__ void flush_bins() {
    __syncthreads();
    for (int s = threadIdx.x; s < BINS; s += blockDim.x) {
        const u64 p = bin_pos[s], n = bin_neg[s], q = bin_sq[s];
        if (p != n) wide_add(cta_digits + SUM_AT, SUM_DIGITS, p > n ? p - n : n - p, (u32)s, n > p);
        if (p | n) wide_add(cta_digits + SABS_AT, SUM_DIGITS, p + n, (u32)s, false);
        if (q) wide_add(cta_digits + SSQ_AT, SSQ_DIGITS, q, 2u * (u32)s, false);
        bin_pos[s] = bin_neg[s] = bin_sq[s] = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        carry(cta_digits + SUM_AT, SUM_DIGITS);
        carry(cta_digits + SABS_AT, SUM_DIGITS);
        carry(cta_digits + SSQ_AT, SSQ_DIGITS);
    }
    __syncthreads();
}

__device__ __forceinline__ void bin_value(u32 bits) {
    const u32 e = (bits >> 7) & 0xFFu, f = bits & 0x7Fu;
    if (e == 0xFFu) {
        atomicOr(&cta_flags, f ? FLAG_NAN : ((bits & 0x8000u) ? FLAG_NEG_INF : FLAG_POS_INF));
        return;
    }
    const u32 m = e ? (f | 0x80u) : f;
    if (m == 0) return;
    const u32 s = e ? e - 1 : 0;
    atomicAdd((bits & 0x8000u) ? &bin_neg[s] : &bin_pos[s], m);
    atomicAdd(&bin_sq[s], m * m);
}

__device__ __forceinline__ void bin_word(u32 w) {
    bin_value(w & 0xFFFFu);
    bin_value(w >> 16);
}

// The CTA's words (flushed) to `out`: digits, then the flags word.
__device__ void write_cta(i64* __restrict__ out) {
    for (int j = threadIdx.x; j < RESULT_WORDS; j += blockDim.x) out[j] = j < FLAGS_AT ? cta_digits[j] : (i64)cta_flags;
}

// `partials` holds RESULT_WORDS int64 words per CTA. `base` and `stride` are even (checked
// in Python), so every value is 2-byte aligned.
extern "C" __global__ void __launch_bounds__(REDUCE_THREADS) pagedkv_reduce_bf16_partial(
    long long base, long long stride, long long nbytes,
    const int* __restrict__ blocks, int num_blocks, long long* __restrict__ partials)
{
    init_cta();
    const i64 nvalues = nbytes >> 1;
    const i64 step = (i64)blockDim.x * LOADS;  // 16-byte words a round of the CTA
    i64 pending = 0;                            // values binned since the last flush (uniform)
    for (int k = blockIdx.x; k < num_blocks; k += gridDim.x) {
        const u16* values = (const u16*)(base + (i64)blocks[k] * stride);
        // head: values up to the first 16-byte boundary; body: 16-byte words; then the tail
        i64 head = (i64)(((16u - ((u32)(u64)values & 15u)) & 15u) >> 1);
        if (head > nvalues) head = nvalues;
        const i64 nwords = (nvalues - head) >> 3;
        const i64 tail = head + (nwords << 3);
        if (threadIdx.x < head) bin_value(values[threadIdx.x]);
        for (i64 i = tail + threadIdx.x; i < nvalues; i += blockDim.x) bin_value(values[i]);
        pending += nvalues - (nwords << 3);
        const uint4* words = (const uint4*)(values + head);
        for (i64 w0 = 0; w0 < nwords; w0 += step) {
            uint4 v[LOADS];
            bool have[LOADS];
#pragma unroll
            for (int u = 0; u < LOADS; u++) {
                const i64 w = w0 + threadIdx.x + (i64)u * blockDim.x;
                have[u] = w < nwords;
                if (have[u]) v[u] = __ldcs(words + w);
            }
#pragma unroll
            for (int u = 0; u < LOADS; u++) {
                if (!have[u]) continue;
                bin_word(v[u].x);
                bin_word(v[u].y);
                bin_word(v[u].z);
                bin_word(v[u].w);
            }
            pending += 8 * (nwords - w0 < step ? nwords - w0 : step);
            if (pending >= FLUSH_AFTER) {
                flush_bins();
                pending = 0;
            }
        }
        if (pending >= FLUSH_AFTER) {  // the heads and tails of many blocks
            flush_bins();
            pending = 0;
        }
    }
    flush_bins();
    write_cta(partials + (i64)RESULT_WORDS * blockIdx.x);
}

// One CTA: adds `num_partials` partial results into `out`, thread j summing word j of
// every partial (their digits are < 2^32 but the signed top, so sums stay far inside int64).
extern "C" __global__ void __launch_bounds__(REDUCE_THREADS) pagedkv_reduce_bf16_final(
    const long long* __restrict__ partials, int num_partials, long long* __restrict__ out)
{
    for (int j = threadIdx.x; j < RESULT_WORDS; j += blockDim.x) {
        i64 acc = 0;
        for (int p = 0; p < num_partials; p++) {
            const i64 w = partials[(i64)RESULT_WORDS * p + j];
            acc = j < FLAGS_AT ? acc + w : (acc | w);
        }
        out[j] = acc;
    }
}
