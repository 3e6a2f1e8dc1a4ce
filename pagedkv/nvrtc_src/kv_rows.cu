// KV rows on the device: encode token rows of K and V into their slots (pagedkv_kv_write)
// and decode slots back to rows (pagedkv_kv_read), byte-exact with pagedkv.codecs.
//
// Work item i = (token i / 2, side i % 2: 0 = K, 1 = V); each CTA takes items in a
// grid-stride loop. A side is described by its format code (FMT_*, -1: side not touched),
// its pool (base, bytes between blocks) and its source/destination rows (element stride
// between tokens; [heads, head_dim] contiguous within a token). Block geometry follows
// docs/FORMATS.md: data rows of n * bits / 8 bytes, then scale rows of n / 16 scales.
//
// The arithmetic is the contract's order of operations in float32, every operation
// rounded on its own (compiled with --fmad=false): element-order sums of squares, the
// butterfly of the Walsh-Hadamard rotation with strides 1, 2, ..., n/2, one multiply by
// 1/sqrt(n). E4M3, BF16 and E2M1 rounding are integer and exact float operations written
// here, so the host harness and the GPU produce the same bits. A slot outside 0..limit-1
// (-1 included) is skipped by the write; the read gives a row of zeros for it.
// NaN and inf inputs are counted into *nonfinite (when given) and encoded as the IEEE
// rules make them; the host codec refuses them instead.
// With a device table of KvLayer, one launch writes (or reads) the same tokens' rows of many
// layers (a prefill, a decode step), each layer's geometry, pools and rows read from it.
// A side may hold HND blocks (docs/LAYOUTS.md; its `hnd` flag): see kv_side_blocks.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define FMT_BF16 0
#define FMT_FP8 1
#define FMT_NVFP4 2
#define FMT_TURBO4 3
#define FMT_TURBO3 4
#define FMT_TURBO2 5
#define FMT_TURBO8 6

#define KV_THREADS 128
#define KV_READ16_CTAS 8   // the bf16/fp8 read is built for 8 resident CTAs an SM (64 registers),
#define KV_WRITE16_CTAS 7  // the write for 7 (73: one more encode spills at 64)
#define GROUP 16

__constant__ float TURBO4_LEVELS[16] = {
    -2.7326f, -2.0690f, -1.6180f, -1.2562f, -0.9423f, -0.6568f, -0.3880f, -0.1284f,
    0.1284f, 0.3880f, 0.6568f, 0.9423f, 1.2562f, 1.6180f, 2.0690f, 2.7326f};
__constant__ float TURBO4_BOUNDS[15] = {
    -2.4008f, -1.8435f, -1.4371f, -1.0993f, -0.7996f, -0.5224f, -0.2582f, 0.0f,
    0.2582f, 0.5224f, 0.7996f, 1.0993f, 1.4371f, 1.8435f, 2.4008f};
__constant__ float TURBO3_LEVELS[8] = {-2.1520f, -1.3440f, -0.7560f, -0.2451f, 0.2451f, 0.7560f, 1.3440f, 2.1520f};
__constant__ float TURBO3_BOUNDS[7] = {-1.748f, -1.050f, -0.501f, 0.0f, 0.501f, 1.050f, 1.748f};
__constant__ float TURBO2_LEVELS[4] = {-1.5104f, -0.4528f, 0.4528f, 1.5104f};
__constant__ float TURBO2_BOUNDS[3] = {-0.9816f, 0.0f, 0.9816f};
__constant__ float E2M1_MAGNITUDES[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// Walsh-Hadamard sign tables of formats/wht_signs.json as bit masks (bit d of the table
// set: sign -1 at element d), 32 elements a word: signs1 then signs2 of head_dim 128, 256,
// 512 at word offsets 0, 4 | 8, 16 | 24, 40 (tests/test_kv_sign_tables.py checks them).
__constant__ u32 WHT_SIGNS[56] = {
    0xE46A0359u, 0x42F85949u, 0xA4C63BBBu, 0x49F250A9u, 0x16ACEE90u, 0x3F628FDCu,
    0xB7A5357Au, 0xBEA56562u, 0xC028BDDDu, 0xFE5483E8u, 0x00B54509u, 0x9A94A018u,
    0x57DE2FF8u, 0xDBBF19A3u, 0x3AFE2DC7u, 0xEBDA4034u, 0xE85431D9u, 0x7682761Du,
    0xA7532CC2u, 0x8A4336C9u, 0xE40C84FDu, 0x65C15681u, 0x555AACC1u, 0x4B75DB54u,
    0xC028BDDDu, 0xFE5483E8u, 0x00B54509u, 0x9A94A018u, 0x57DE2FF8u, 0xDBBF19A3u,
    0x3AFE2DC7u, 0xEBDA4034u, 0xE85431D9u, 0x7682761Du, 0xA7532CC2u, 0x8A4336C9u,
    0xE40C84FDu, 0x65C15681u, 0x555AACC1u, 0x4B75DB54u, 0x56746A09u, 0x5B0E0565u,
    0x71316A21u, 0x33754D84u, 0x7363B6E8u, 0x49119608u, 0x9DFA1143u, 0x74E09D96u,
    0xFD26399Eu, 0xD49B9E8Du, 0x2BF53DB5u, 0x3E65CA56u, 0x7F01D99Cu, 0xAD67A2B6u,
    0x00803A7Bu, 0x3A6CBE98u,
};

// ---- scalar codes ------------------------------------------------------------------------

__device__ __forceinline__ bool is_nonfinite(float x) {
    return (__float_as_uint(x) & 0x7F800000u) == 0x7F800000u;
}

// E4M3 byte of x: clamped to +-448, rounded to nearest even (signed zero kept).
__device__ __forceinline__ u32 e4m3_encode(float x) {
    const u32 sign = (__float_as_uint(x) >> 24) & 0x80u;
    if (is_nonfinite(x) && (__float_as_uint(x) & 0x007FFFFFu)) return sign | 0x7Fu;  // NaN
    float a = fabsf(x);
    if (a > 448.0f) a = 448.0f;
    const u32 t = __float_as_uint(a);
    if (t < 0x3C800000u) {  // below 2^-6: subnormal steps of 2^-9, rounded by the 2^23 trick
        const float q = (a * 512.0f + 8388608.0f) - 8388608.0f;
        return sign | (u32)q;
    }
    const u32 r = (t + 0x7FFFFu + ((t >> 20) & 1u)) >> 20;
    return sign | (r - (120u << 3));
}

__device__ __forceinline__ float e4m3_decode(u32 b) {
    const u32 e = (b >> 3) & 15u, m = b & 7u;
    u32 bits;
    if ((b & 0x7Fu) == 0x7Fu) bits = 0x7FC00000u;
    else if (e == 0) bits = __float_as_uint((float)m * 0.001953125f);
    else bits = ((e + 120u) << 23) | (m << 20);
    return __uint_as_float(bits | ((b & 0x80u) << 24));
}

// BF16 bits of x, rounded to nearest even (NaN kept a quiet NaN).
__device__ __forceinline__ u32 bf16_encode(float x) {
    const u32 t = __float_as_uint(x);
    if ((t & 0x7F800000u) == 0x7F800000u && (t & 0x007FFFFFu)) return (t >> 16) | 0x40u;
    return (t + 0x7FFFu + ((t >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ float bf16_decode(u32 bits) { return __uint_as_float(bits << 16); }

// E2M1 magnitude index of a >= 0: nearest even, saturating at 6.
__device__ __forceinline__ u32 e2m1_magnitude(float a) {
    u32 c = 0;
    c += a > 0.25f; c += a > 1.25f; c += a > 2.5f; c += a > 5.0f;
    c += a >= 0.75f; c += a >= 1.75f; c += a >= 3.5f;
    return c;
}

__device__ __forceinline__ int format_bits(int fmt) {
    switch (fmt) {
    case FMT_BF16: return 16;
    case FMT_FP8: case FMT_TURBO8: return 8;
    case FMT_TURBO3: return 3;
    case FMT_TURBO2: return 2;
    default: return 4;
    }
}

__device__ __forceinline__ int scale_size(int fmt) {
    return fmt == FMT_TURBO8 ? 2 : (fmt >= FMT_NVFP4 ? 1 : 0);
}

__device__ __forceinline__ int turbo_levels(int fmt, const float** levels, const float** bounds) {
    if (fmt == FMT_TURBO4) { *levels = TURBO4_LEVELS; *bounds = TURBO4_BOUNDS; return 16; }
    if (fmt == FMT_TURBO3) { *levels = TURBO3_LEVELS; *bounds = TURBO3_BOUNDS; return 8; }
    *levels = TURBO2_LEVELS; *bounds = TURBO2_BOUNDS; return 4;
}

// ---- one 16-element group ------------------------------------------------------------------

__device__ void unpack_codes(const u8* in, int bits, u32* c) {
    if (bits == 4) {
        for (int j = 0; j < 8; j++) { c[2 * j] = in[j] & 15u; c[2 * j + 1] = in[j] >> 4; }
    } else if (bits == 2) {
        for (int j = 0; j < 4; j++)
            for (int s = 0; s < 4; s++) c[4 * j + s] = (in[j] >> (2 * s)) & 3u;
    } else {
        for (int r = 0; r < 2; r++) {
            const u32 word = (u32)in[3 * r] | ((u32)in[3 * r + 1] << 8) | ((u32)in[3 * r + 2] << 16);
            for (int k = 0; k < 8; k++) c[8 * r + k] = (word >> (3 * k)) & 7u;
        }
    }
}

// ---- rows ----------------------------------------------------------------------------------
//
// Work is cut into warp units, numbered across the sides of a launch (K then V, layer after
// layer) and dealt to the warps of the grid round robin; a warp walks the sides in order,
// so each side's format is switched on once, outside its loop. An HND side runs as one
// one-head side per head chunk (see kv_launch). Per side, one of:
// - bf16 / fp8, 16-byte aligned rows and pool rows of n elements: a unit is 512 elements,
//   lane L the pieces at 8 * L and 256 + 8 * L, of one token's row (n a multiple of 512:
//   span_unit) or of 512 / n tokens' rows (n dividing 512: tokens_unit), so every warp
//   request is whole sectors; otherwise a lane takes 16 consecutive elements of a row (32
//   consecutive lanes, one unit; chunk_unit), 16-byte loads and stores when the chunk is
//   whole, element by element otherwise.
// - grouped formats without rotation: a lane takes one 16-element group (all lanes busy,
//   whatever the row size); with whole sets of 8 groups a row and 8-byte aligned blocks,
//   each set of 8 lanes writes its data and scale bytes as 8-byte words (nvfp4/turbo4: a
//   word a lane; turbo8: 16 bytes a lane; turbo3/turbo2 and the scales gathered by warp
//   shuffles), else byte by byte.
// - turbo formats with rotation (head_dim 128, 256, 512): a warp takes one head, lane L the
//   E = head_dim / 32 consecutive elements from E * L; the Walsh-Hadamard butterfly runs in
//   registers for strides below E and by warp shuffles above; each group's amax and sums of
//   squares across its 16 / E lanes by shuffles (the sums in element order, exact); the
//   packed codes and scales gathered by shuffles into 8-byte words.
// Kernels: pagedkv_kv_write / _read take every format (their paths' registers: the most of
// any); _write16 / _read16 bf16 and fp8 sides only; the one-path kernels (_nvfp4, _turbo_h128,
// _turbo8_h128) one kind of side on one path, a warp loading a batch of its units before
// computing any (more bytes in flight a lane). The driver picks the kernel from the sides.
// Codebooks and sign tables are copied to shared memory once per CTA, so a lookup indexed
// by a code or a lane is a conflict-free shared read, not a serialised constant read.

__device__ __forceinline__ float load_value(u64 src, int bf16, i64 index) {
    if (bf16) return bf16_decode(((const u16*)src)[index]);
    return ((const float*)src)[index];
}

__device__ __forceinline__ void store_value(u64 dst, int bf16, i64 index, float x) {
    if (bf16) ((u16*)dst)[index] = (u16)bf16_encode(x);
    else ((float*)dst)[index] = x;
}

struct SideGeometry {
    i64 row_bytes, scale_row_bytes, data_section;
};

__device__ __forceinline__ SideGeometry geometry(int fmt, int n, int block_size) {
    SideGeometry g;
    g.row_bytes = (i64)n * format_bits(fmt) / 8;
    g.scale_row_bytes = (i64)(n / GROUP) * scale_size(fmt);
    g.data_section = g.row_bytes * block_size;
    return g;
}

#define KV_WARPS (KV_THREADS / 32)
#define FULL_MASK 0xFFFFFFFFu

struct KvTables {
    float t4_levels[16], t4_bounds[16], t3_levels[8], t3_bounds[8], t2_levels[4], t2_bounds[4], e2m1[8];
    u32 signs[56];
};
__shared__ KvTables kv_tables;

__device__ void kv_load_tables() {
    for (int i = threadIdx.x; i < 56; i += blockDim.x) {
        if (i < 16) kv_tables.t4_levels[i] = TURBO4_LEVELS[i];
        if (i < 15) kv_tables.t4_bounds[i] = TURBO4_BOUNDS[i];
        if (i < 8) kv_tables.t3_levels[i] = TURBO3_LEVELS[i];
        if (i < 7) kv_tables.t3_bounds[i] = TURBO3_BOUNDS[i];
        if (i < 4) kv_tables.t2_levels[i] = TURBO2_LEVELS[i];
        if (i < 3) kv_tables.t2_bounds[i] = TURBO2_BOUNDS[i];
        if (i < 8) kv_tables.e2m1[i] = E2M1_MAGNITUDES[i];
        kv_tables.signs[i] = WHT_SIGNS[i];
    }
    __syncthreads();
}

__device__ __forceinline__ u32 lane_id() { return threadIdx.x & 31u; }

__device__ __forceinline__ u64 shfl_u64(u64 v, int src, int width) {
    return __shfl_sync(FULL_MASK, v, src, width);
}

// A turbo codebook at run time: turbo4, turbo3 and turbo2 share one compiled path.
struct Book {
    int bits, count;
    const float* levels;
    const float* bounds;
};

__device__ __forceinline__ Book book_of(int fmt) {
    Book b;
    if (fmt == FMT_TURBO3) { b.bits = 3; b.count = 8; b.levels = kv_tables.t3_levels; b.bounds = kv_tables.t3_bounds; }
    else if (fmt == FMT_TURBO2) { b.bits = 2; b.count = 4; b.levels = kv_tables.t2_levels; b.bounds = kv_tables.t2_bounds; }
    else { b.bits = 4; b.count = 16; b.levels = kv_tables.t4_levels; b.bounds = kv_tables.t4_bounds; }
    return b;
}

// The code of u: the number of the codebook's decision bounds at or below it (comparisons,
// no search loop).
__device__ __forceinline__ u32 book_code(const Book& b, float u) {
    u32 c = 0;
#pragma unroll
    for (int i = 0; i < 15; i++) c += i < b.count - 1 && b.bounds[i] <= u;
    return c;
}

// Word w (64 bits) of a bit stream whose i-th F-bit field (bits [F*i, F*i + F), F <= 64) is
// `field` of lane i * STRIDE of this lane's segment of WIDTH lanes (fields past `count`
// absent); MAXS bounds the fields one word meets (64 / F_min + 1). Every lane of the warp
// calls it (with its own w).
template <int MAXS, int STRIDE, int WIDTH>
__device__ __forceinline__ u64 gather_word(u64 field, int F, int w, int count) {
    u64 word = 0;
    const int first = (64 * w) / F;
#pragma unroll
    for (int o = 0; o < MAXS; o++) {
        const int i = first + o;
        const int src = i < count ? i * STRIDE : 0;
        const u64 f = shfl_u64(field, src, WIDTH);
        const int at = i * F - 64 * w;  // where field i's lowest bit lands in the word
        if (i < count && at < 64 && at + F > 0) word |= at >= 0 ? f << at : f >> -at;
    }
    return word;
}

// Field i (F bits, F <= 64) of a bit stream whose 64-bit word j is `word` of lane j of this
// lane's segment of WIDTH lanes (words past `words` absent).
template <int WIDTH>
__device__ __forceinline__ u64 scatter_field(u64 word, int F, int i, int words) {
    const int bit = F * i, j = bit >> 6, r = bit & 63;
    const u64 lo = shfl_u64(word, j < words ? j : 0, WIDTH);
    const u64 hi = shfl_u64(word, j + 1 < words ? j + 1 : 0, WIDTH);
    u64 f = lo >> r;
    if (r && r + F > 64 && j + 1 < words) f |= hi << (64 - r);
    return F >= 64 ? f : f & ((1ull << F) - 1ull);
}

// N consecutive row elements from element e of the rows at `src` (BF16 or float32): vector
// loads when `vec` (16-byte aligned, N a multiple of 4 or 8), else the first `count` singly
// (the rest 0).
template <int N>
__device__ __forceinline__ void load_elems(u64 src, int bf16, i64 e, bool vec, int count, float (&x)[N]) {
    if (vec && bf16 && N % 8 == 0) {
        const uint4* p = (const uint4*)(src + 2 * e);
#pragma unroll
        for (int q = 0; q < N / 8; q++) {
            const uint4 v = p[q];
            const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 8; k++) x[8 * q + k] = bf16_decode((w[k >> 1] >> (16 * (k & 1))) & 0xFFFFu);
        }
    } else if (vec && bf16 && N == 4) {
        const uint2 v = *(const uint2*)(src + 2 * e);
        const u32 w[2] = {v.x, v.y};
#pragma unroll
        for (int k = 0; k < N; k++) x[k] = bf16_decode((w[k >> 1] >> (16 * (k & 1))) & 0xFFFFu);
    } else if (vec && !bf16 && N % 4 == 0) {
        const float4* p = (const float4*)(src + 4 * e);
#pragma unroll
        for (int q = 0; q < N / 4; q++) {
            const float4 v = p[q];
            x[4 * q] = v.x; x[4 * q + 1] = v.y; x[4 * q + 2] = v.z; x[4 * q + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int k = 0; k < N; k++) x[k] = k < count ? load_value(src, bf16, e + k) : 0.0f;
    }
}

// N row elements to element e of the rows at `dst` (BF16, rounded to nearest even, or
// float32): vector stores when `vec`, else the first `count` singly.
template <int N>
__device__ __forceinline__ void store_elems(u64 dst, int bf16, i64 e, bool vec, int count, const float (&x)[N]) {
    if (vec && bf16 && N % 8 == 0) {
        uint4* p = (uint4*)(dst + 2 * e);
#pragma unroll
        for (int q = 0; q < N / 8; q++) {
            u32 w[4];
#pragma unroll
            for (int k = 0; k < 4; k++) w[k] = bf16_encode(x[8 * q + 2 * k]) | (bf16_encode(x[8 * q + 2 * k + 1]) << 16);
            uint4 v;
            v.x = w[0]; v.y = w[1]; v.z = w[2]; v.w = w[3];
            p[q] = v;
        }
    } else if (vec && bf16 && N == 4) {
        uint2 v;
        v.x = bf16_encode(x[0]) | (bf16_encode(x[1]) << 16);
        v.y = bf16_encode(x[2]) | (bf16_encode(x[3]) << 16);
        *(uint2*)(dst + 2 * e) = v;
    } else if (vec && !bf16 && N % 4 == 0) {
        float4* p = (float4*)(dst + 4 * e);
#pragma unroll
        for (int q = 0; q < N / 4; q++) {
            float4 v;
            v.x = x[4 * q]; v.y = x[4 * q + 1]; v.z = x[4 * q + 2]; v.w = x[4 * q + 3];
            p[q] = v;
        }
    } else {
#pragma unroll
        for (int k = 0; k < N; k++)
            if (k < count) store_value(dst, bf16, e + k, x[k]);
    }
}

// `nbytes` bytes of the little-endian words w to p: 8-byte stores when `vec`, else bytes.
__device__ __forceinline__ void store_word(u8* p, u64 w, int nbytes, bool vec) {
    if (vec && nbytes == 8) {
        *(u64*)p = w;
        return;
    }
#pragma unroll
    for (int b = 0; b < 8; b++)
        if (b < nbytes) p[b] = (u8)(w >> (8 * b));
}

__device__ __forceinline__ u64 load_word(const u8* p, int nbytes, bool vec) {
    if (vec && nbytes == 8) return *(const u64*)p;
    u64 w = 0;
#pragma unroll
    for (int b = 0; b < 8; b++)
        if (b < nbytes) w |= (u64)p[b] << (8 * b);
    return w;
}

// Encode one group x (16 values, float32) of a grouped format of kind KIND (FMT_NVFP4,
// FMT_TURBO8, or FMT_TURBO4 for every codebook format, `fmt` naming it): the packed codes as
// a bit stream in d (first code in the lowest bits: 64, 48 or 32 bits; turbo8's 16 E4M3
// bytes in d[0] and d[1]), returns the scale bits (an E4M3 byte; turbo8: BF16 bits).
template <int KIND>
__device__ __forceinline__ u32 encode_group_bits(int fmt, const float (&x)[GROUP], u64 (&d)[2]) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < GROUP; i++) { const float a = fabsf(x[i]); if (a > amax) amax = a; }
    d[0] = d[1] = 0;
    if (KIND == FMT_TURBO8) {
        float s = amax / 448.0f;
        if (s < 1e-12f) s = 1e-12f;
#pragma unroll
        for (int i = 0; i < GROUP; i++) d[i >> 3] |= (u64)e4m3_encode(x[i] / s) << (8 * (i & 7));
        return bf16_encode(s);
    }
    if (KIND == FMT_NVFP4) {
        const u32 sb = e4m3_encode(amax / 6.0f);
        const float dq = e4m3_decode(sb);
#pragma unroll
        for (int i = 0; i < GROUP; i++) {
            const u32 magnitude = dq == 0.0f ? 0u : e2m1_magnitude(fabsf(x[i]) / dq);
            d[0] |= (u64)(magnitude | ((__float_as_uint(x[i]) >> 31) << 3)) << (4 * i);
        }
        return sb;
    }
    const Book book = book_of(fmt);
    const bool tiny = amax <= 1e-12f;
    const float ratio = tiny ? 1.0f : book.levels[book.count - 1] / amax;
    float x_ssq = 0.0f, level_ssq = 0.0f;
#pragma unroll
    for (int i = 0; i < GROUP; i++) {
        const u32 c = book_code(book, tiny ? x[i] : x[i] * ratio);
        d[0] |= (u64)c << (book.bits * i);
        const float xx = x[i] * x[i];
        x_ssq = x_ssq + xx;
        const float ll = book.levels[c] * book.levels[c];
        level_ssq = level_ssq + ll;
    }
    float s = sqrtf(x_ssq) / sqrtf(level_ssq);
    if (s > 448.0f) s = 448.0f;
    return e4m3_encode(s);
}

// Decode one group of kind KIND (as encode_group_bits) from its bit stream d and scale bits.
template <int KIND>
__device__ __forceinline__ void decode_group_bits(int fmt, const u64 (&d)[2], u32 scale, float (&out)[GROUP]) {
    if (KIND == FMT_TURBO8) {
        const float s = bf16_decode(scale);
#pragma unroll
        for (int i = 0; i < GROUP; i++) out[i] = e4m3_decode((u32)(d[i >> 3] >> (8 * (i & 7))) & 0xFFu) * s;
        return;
    }
    const float dq = e4m3_decode(scale);
    if (KIND == FMT_NVFP4) {
#pragma unroll
        for (int i = 0; i < GROUP; i++) {
            const u32 code = (u32)(d[0] >> (4 * i)) & 15u;
            const float m = kv_tables.e2m1[code & 7u];
            out[i] = (code & 8u ? -m : m) * dq;
        }
        return;
    }
    const Book book = book_of(fmt);
#pragma unroll
    for (int i = 0; i < GROUP; i++) out[i] = book.levels[(u32)(d[0] >> (book.bits * i)) & ((1u << book.bits) - 1u)] * dq;
}

struct KvSide {
    u64 pool;
    i64 block_stride;
    u64 rows;
    i64 row_stride;
    int fmt, bf16;
    float scale;
    int first, last;
    int heads, head_dim;
    float inv_sqrt_n;
};

// Work units (warps) of a side for `tokens` tokens.
__device__ __forceinline__ i64 side_units(const KvSide& S, int tokens) {
    if (S.fmt < 0) return 0;
    const i64 n = (i64)S.heads * S.head_dim;
    if (S.fmt == FMT_BF16 || S.fmt == FMT_FP8) return ((i64)tokens * ((n + 15) / 16) + 31) / 32;
    if (S.first >= 0) return (i64)tokens * S.heads;
    return ((i64)tokens * (n / GROUP) + 31) / 32;
}

// Where token slot `slot`'s rows of a side lie in its pool.
struct SlotRows {
    u8* data;    // the data row
    u8* scales;  // the scale row
};

__device__ __forceinline__ SlotRows slot_rows(const KvSide& S, const SideGeometry& g, int block_size, i64 slot) {
    const i64 block = slot / block_size, offset = slot - block * block_size;
    u8* base = (u8*)(S.pool + block * S.block_stride);
    return {base + offset * g.row_bytes, base + g.data_section + offset * g.scale_row_bytes};
}

__device__ __forceinline__ float sign_at(int table, int d) {
    return (kv_tables.signs[table + (d >> 5)] >> (d & 31)) & 1u ? -1.0f : 1.0f;
}

// y = ((H_n (first * x)) * inv_sqrt_n) * last over a warp, lane L holding elements
// [E * L, E * L + E) of the n = 32 * E (the butterfly's strides 1, 2, ..., n/2, each
// output one add or subtract of the same two inputs as the serial order: exact).
template <int E>
__device__ __forceinline__ void rotate_warp(float (&x)[E], int first, int last, float inv_sqrt_n) {
    const int lane = (int)lane_id();
#pragma unroll
    for (int j = 0; j < E; j++) x[j] = x[j] * sign_at(first, E * lane + j);
#pragma unroll
    for (int h = 1; h < E; h <<= 1) {
#pragma unroll
        for (int j = 0; j < E; j++) {
            if (j & h) continue;
            const float a = x[j], b = x[j + h];
            x[j] = a + b;
            x[j + h] = a - b;
        }
    }
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {  // stride E * m: partner lane L ^ m
        const bool upper = lane & m;
#pragma unroll
        for (int j = 0; j < E; j++) {
            const float other = __shfl_xor_sync(FULL_MASK, x[j], m);
            x[j] = upper ? other - x[j] : x[j] + other;
        }
    }
#pragma unroll
    for (int j = 0; j < E; j++) x[j] = (x[j] * inv_sqrt_n) * sign_at(last, E * lane + j);
}

__device__ __forceinline__ KvSide make_side(int fmt, u64 pool, i64 block_stride, u64 rows, i64 row_stride, int bf16,
                                            float scale, int first, int last, int heads, int head_dim, float inv_sqrt_n) {
    KvSide s;
    s.pool = pool; s.block_stride = block_stride; s.rows = rows; s.row_stride = row_stride;
    s.fmt = fmt; s.bf16 = bf16; s.scale = scale; s.first = first; s.last = last;
    s.heads = heads; s.head_dim = head_dim; s.inv_sqrt_n = inv_sqrt_n;
    return s;
}

// ---- the paths of one side (WRITE: encode rows into slots; else decode slots into rows) ----

// bf16 / fp8 rows of whole 512-element spans, every access aligned: unit u is one span of
// one token's row, lane L holding the 8-element pieces at 8 * L and 256 + 8 * L, so each
// warp request covers 512 contiguous bytes of BF16 (16-byte accesses, every sector whole).
// An fp8 pool row takes 16 contiguous bytes a lane: neighbouring lanes swap a piece first.
template <int FMT, bool WRITE>
__device__ __forceinline__ u32 span_unit(const KvSide& S, const SideGeometry& g, const i64* slots, int block_size,
                                         i64 limit, i64 u) {
    const i64 n = (i64)S.heads * S.head_dim, spans = n / 512;
    const int lane = (int)lane_id();
    const int token = (int)(u / spans);
    const i64 span = u - (i64)token * spans;
    const i64 slot = slots[token];
    const bool valid = slot >= 0 && slot < limit;  // uniform: the warp's span is one token's
    const i64 e = (i64)token * S.row_stride + 512 * span + 8 * lane;
    float x[2][8];
    const bool odd = lane & 1;
    if (WRITE) {
        if (!valid) return 0;
        load_elems<8>(S.rows, S.bf16, e, true, 8, x[0]);
        load_elems<8>(S.rows, S.bf16, e + 256, true, 8, x[1]);
        u32 bad = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) bad += is_nonfinite(x[0][k]) + is_nonfinite(x[1][k]);
        u8* row = slot_rows(S, g, block_size, slot).data;
        if (FMT == FMT_BF16) {
            store_elems<8>((u64)row, 1, 512 * span + 8 * lane, true, 8, x[0]);
            store_elems<8>((u64)row, 1, 512 * span + 256 + 8 * lane, true, 8, x[1]);
            return bad;
        }
        u64 piece[2] = {0, 0};
#pragma unroll
        for (int q = 0; q < 2; q++)
#pragma unroll
            for (int k = 0; k < 8; k++) piece[q] |= (u64)e4m3_encode(x[q][k] / S.scale) << (8 * k);
        // lane 2m stores elements [16m, 16m + 16) of the span, lane 2m + 1 [256 + 16m, 256 + 16m + 16)
        const u64 other = shfl_u64(odd ? piece[0] : piece[1], lane ^ 1, 32);
        const u64 lo = odd ? other : piece[0], hi = odd ? piece[1] : other;
        uint4 v;
        v.x = (u32)lo; v.y = (u32)(lo >> 32); v.z = (u32)hi; v.w = (u32)(hi >> 32);
        *(uint4*)(row + 512 * span + (odd ? 256 : 0) + 16 * (lane >> 1)) = v;
        return bad;
    }
    if (valid) {
        const u8* row = slot_rows(S, g, block_size, slot).data;
        if (FMT == FMT_BF16) {
            load_elems<8>((u64)row, 1, 512 * span + 8 * lane, true, 8, x[0]);
            load_elems<8>((u64)row, 1, 512 * span + 256 + 8 * lane, true, 8, x[1]);
        } else {
            const uint4 v = *(const uint4*)(row + 512 * span + (odd ? 256 : 0) + 16 * (lane >> 1));
            const u64 lo = (u64)v.x | ((u64)v.y << 32), hi = (u64)v.z | ((u64)v.w << 32);
            const u64 other = shfl_u64(odd ? lo : hi, lane ^ 1, 32);
            const u64 piece[2] = {odd ? other : lo, odd ? hi : other};
#pragma unroll
            for (int q = 0; q < 2; q++)
#pragma unroll
                for (int k = 0; k < 8; k++) x[q][k] = e4m3_decode((u32)(piece[q] >> (8 * k)) & 0xFFu) * S.scale;
        }
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) x[0][k] = x[1][k] = 0.0f;
    }
    store_elems<8>(S.rows, S.bf16, e, true, 8, x[0]);
    store_elems<8>(S.rows, S.bf16, e + 256, true, 8, x[1]);
    return 0;
}

// bf16 / fp8 rows of n elements, n a multiple of 16 dividing 512 (below 512: one head of an
// HND side, or a few NHD heads), every access aligned: unit u is the 512 / n tokens from
// u * 512 / n, their 512 elements dealt as span_unit deals a span (lane L: the 8-element
// pieces at 8 * L and 256 + 8 * L of the unit), so each warp request covers whole rows of
// 2n contiguous bytes of BF16 (16-byte accesses, every sector whole). A piece's token past
// the last or with a slot outside 0..limit-1 is masked lane by lane; every lane takes part
// in the fp8 shuffle (the 16 bytes lane 2m moves are of its own piece's token, lane 2m + 1's
// of its second piece's).
template <int FMT, bool WRITE>
__device__ __forceinline__ u32 tokens_unit(const KvSide& S, const SideGeometry& g, const i64* slots, int tokens,
                                           int block_size, i64 limit, i64 u) {
    const int n = S.heads * S.head_dim, per = 512 / n;
    const int lane = (int)lane_id();
    const bool odd = lane & 1;
    int token[2], off[2];
    i64 slot[2];
    bool valid[2];
    float x[2][8];
    const int t0 = (int)(u * per);
#pragma unroll
    for (int q = 0; q < 2; q++) {
        const int p = 256 * q + 8 * lane;
        token[q] = t0 + p / n;
        off[q] = p % n;
    }
    if (WRITE) {  // the rows first (they do not depend on the slots): one run of loads with the slots
#pragma unroll
        for (int q = 0; q < 2; q++) {
            if (token[q] < tokens) {
                load_elems<8>(S.rows, S.bf16, (i64)token[q] * S.row_stride + off[q], true, 8, x[q]);
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) x[q][k] = 0.0f;
            }
        }
    }
    // a piece's slot: the 16-byte pair of slots its token is in (the same for every lane of a
    // row: a broadcast), one slot alone at the tail or when the slots are not 16-byte aligned
    const bool pairs = (((u64)slots) & 15u) == 0;
#pragma unroll
    for (int q = 0; q < 2; q++) {
        const int t = token[q] & ~1;
        if (pairs && t + 1 < tokens) {
            const uint4 w = *(const uint4*)(slots + t);
            slot[q] = token[q] & 1 ? (i64)((u64)w.z | ((u64)w.w << 32)) : (i64)((u64)w.x | ((u64)w.y << 32));
        } else {
            slot[q] = token[q] < tokens ? slots[token[q]] : -1;
        }
        valid[q] = slot[q] >= 0 && slot[q] < limit;
    }
    // the 16 pool bytes of an fp8 lane: its first piece's (even lane) or its second's (odd)
    const i64 fslot = odd ? slot[1] : slot[0];
    const bool fvalid = odd ? valid[1] : valid[0];
    const int foff = odd ? off[1] - 8 : off[0];
    if (WRITE) {
        u32 bad = 0;
#pragma unroll
        for (int q = 0; q < 2; q++)
#pragma unroll
            for (int k = 0; k < 8; k++) bad += valid[q] && is_nonfinite(x[q][k]);
        if (FMT == FMT_BF16) {
#pragma unroll
            for (int q = 0; q < 2; q++)
                if (valid[q]) store_elems<8>((u64)slot_rows(S, g, block_size, slot[q]).data, 1, off[q], true, 8, x[q]);
            return bad;
        }
        u64 piece[2] = {0, 0};
#pragma unroll
        for (int q = 0; q < 2; q++)
#pragma unroll
            for (int k = 0; k < 8; k++) piece[q] |= (u64)e4m3_encode(x[q][k] / S.scale) << (8 * k);
        const u64 other = shfl_u64(odd ? piece[0] : piece[1], lane ^ 1, 32);
        const u64 lo = odd ? other : piece[0], hi = odd ? piece[1] : other;
        if (fvalid) {
            uint4 v;
            v.x = (u32)lo; v.y = (u32)(lo >> 32); v.z = (u32)hi; v.w = (u32)(hi >> 32);
            *(uint4*)(slot_rows(S, g, block_size, fslot).data + foff) = v;
        }
        return bad;
    }
    if (FMT == FMT_BF16) {
#pragma unroll
        for (int q = 0; q < 2; q++) {
            if (valid[q]) {
                load_elems<8>((u64)slot_rows(S, g, block_size, slot[q]).data, 1, off[q], true, 8, x[q]);
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) x[q][k] = 0.0f;
            }
        }
    } else {
        uint4 v;
        v.x = v.y = v.z = v.w = 0;
        if (fvalid) v = *(const uint4*)(slot_rows(S, g, block_size, fslot).data + foff);
        const u64 lo = (u64)v.x | ((u64)v.y << 32), hi = (u64)v.z | ((u64)v.w << 32);
        const u64 other = shfl_u64(odd ? lo : hi, lane ^ 1, 32);
        const u64 piece[2] = {odd ? other : lo, odd ? hi : other};
#pragma unroll
        for (int q = 0; q < 2; q++)
#pragma unroll
            for (int k = 0; k < 8; k++) x[q][k] = valid[q] ? e4m3_decode((u32)(piece[q] >> (8 * k)) & 0xFFu) * S.scale : 0.0f;
    }
#pragma unroll
    for (int q = 0; q < 2; q++)
        if (token[q] < tokens) store_elems<8>(S.rows, S.bf16, (i64)token[q] * S.row_stride + off[q], true, 8, x[q]);
    return 0;
}

// bf16 / fp8, any geometry: unit u's lanes take 16-element chunks of the flat (token, chunk) items.
template <int FMT, bool WRITE>
__device__ __forceinline__ u32 chunk_unit(const KvSide& S, const SideGeometry& g, const i64* slots, int tokens, int block_size,
                          i64 limit, i64 u, bool rows_vec, bool pool_vec) {
    const i64 n = (i64)S.heads * S.head_dim, chunks = (n + 15) / 16;
    const i64 item = u * 32 + lane_id();
    if (item >= (i64)tokens * chunks) return 0;
    const int token = (int)(item / chunks);
    const i64 c = item - (i64)token * chunks;
    const int count = (int)(n - 16 * c < 16 ? n - 16 * c : 16);
    const bool whole = count == 16;
    const i64 slot = slots[token];
    const i64 e = (i64)token * S.row_stride + 16 * c;
    const bool valid = slot >= 0 && slot < limit;
    float x[16];
    if (WRITE) {
        if (!valid) return 0;
        load_elems<16>(S.rows, S.bf16, e, rows_vec && whole, count, x);
        u32 bad = 0;
#pragma unroll
        for (int k = 0; k < 16; k++) bad += k < count && is_nonfinite(x[k]);
        u8* dst = slot_rows(S, g, block_size, slot).data + (FMT == FMT_BF16 ? 32 : 16) * c;
        if (FMT == FMT_BF16) {
            store_elems<16>((u64)dst, 1, 0, pool_vec && whole, count, x);
        } else {
            u32 w[4] = {0, 0, 0, 0};
#pragma unroll
            for (int k = 0; k < 16; k++) w[k >> 2] |= e4m3_encode(x[k] / S.scale) << (8 * (k & 3));
            if (pool_vec && whole) {
                uint4 v;
                v.x = w[0]; v.y = w[1]; v.z = w[2]; v.w = w[3];
                *(uint4*)dst = v;
            } else {
#pragma unroll
                for (int k = 0; k < 16; k++)
                    if (k < count) dst[k] = (u8)(w[k >> 2] >> (8 * (k & 3)));
            }
        }
        return bad;
    }
    if (valid) {
        const u8* src = slot_rows(S, g, block_size, slot).data + (FMT == FMT_BF16 ? 32 : 16) * c;
        if (FMT == FMT_BF16) {
            load_elems<16>((u64)src, 1, 0, pool_vec && whole, count, x);
        } else {
            u32 w[4];
            if (pool_vec && whole) {
                const uint4 v = *(const uint4*)src;
                w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
            } else {
#pragma unroll
                for (int q = 0; q < 4; q++) w[q] = 0;
#pragma unroll
                for (int k = 0; k < 16; k++)
                    if (k < count) w[k >> 2] |= (u32)src[k] << (8 * (k & 3));
            }
#pragma unroll
            for (int k = 0; k < 16; k++) x[k] = e4m3_decode((w[k >> 2] >> (8 * (k & 3))) & 0xFFu) * S.scale;
        }
    } else {
#pragma unroll
        for (int k = 0; k < 16; k++) x[k] = 0.0f;
    }
    store_elems<16>(S.rows, S.bf16, e, rows_vec && whole, count, x);
    return 0;
}

// What a unit's load phase leaves for its compute phase: the slot and the source rows of a
// write (ROW elements a lane) or the stored words of a read, loaded before any unit of the
// batch is computed, so a lane has all its batch's loads in flight at once.
template <int ROW>
struct UnitIn {
    i64 slot;
    float x[ROW];   // write: the lane's row elements
    u64 d[2];       // read: the lane's data words (or the raw word a shuffle spreads)
    u64 sword;      // read: the lane's scale word (or the raw word a shuffle spreads)
};

// Grouped formats without rotation: a group a lane (kind KIND as encode_group_bits).
// `sets`: whole sets of 8 groups a row and 8-byte aligned rows, so the 8 lanes of a set (one
// row) move 8-byte words. group_load issues the unit's global loads; group_unit the rest (FUSED:
// group_unit loads the unit itself, the rows of a write where it uses them, as a batch of 1 does).
template <int KIND>
__device__ __forceinline__ int group_data_bits(const KvSide& S) {
    return GROUP * (KIND == FMT_TURBO8 ? 8 : (KIND == FMT_NVFP4 ? 4 : book_of(S.fmt).bits));
}

// Unit u's lane: item u * 32 + lane of the tokens x (heads * head_dim / GROUP) groups, as
// (token, group index within the token's row); in_range false past the last group.
struct GroupItem {
    bool in_range;
    int token;
    i64 gi;
};

__device__ __forceinline__ GroupItem group_item(const KvSide& S, int tokens, i64 u) {
    const i64 groups = ((i64)S.heads * S.head_dim) / GROUP;
    const i64 item = u * 32 + lane_id();
    const bool in_range = item < (i64)tokens * groups;
    const int token = in_range ? (int)(item / groups) : 0;
    return {in_range, token, in_range ? item - (i64)token * groups : 0};
}

template <int KIND, bool WRITE>
__device__ __forceinline__ void group_load(const KvSide& S, const SideGeometry& g, const i64* slots, int tokens,
                                           int block_size, i64 limit, i64 u, bool rows_vec, bool sets,
                                           UnitIn<GROUP>& in) {
    const int F = group_data_bits<KIND>(S);  // data bits a group
    constexpr int SF = KIND == FMT_TURBO8 ? 16 : 8;
    const GroupItem it = group_item(S, tokens, u);
    const int token = it.token;
    const i64 gi = it.gi;
    in.slot = it.in_range ? slots[token] : -1;
    const bool valid = in.slot >= 0 && in.slot < limit;
    const int sub = (int)(lane_id() & 7u);
    if (WRITE) {
        if (valid) load_elems<GROUP>(S.rows, S.bf16, (i64)token * S.row_stride + GROUP * gi, rows_vec, GROUP, in.x);
        return;
    }
    in.d[0] = in.d[1] = in.sword = 0;
    if (!valid) return;
    const SlotRows at = slot_rows(S, g, block_size, in.slot);
    if (!sets) {
        const u8* data = at.data + gi * (F / 8);
        in.d[0] = load_word(data, F / 8 < 8 ? F / 8 : 8, false);
        if (F > 64) in.d[1] = load_word(data + 8, 8, false);
        in.sword = load_word(at.scales + gi * (SF / 8), SF / 8, false);
    } else if (F == 128) {
        const uint4 v = *(const uint4*)(at.data + gi * 16);
        in.d[0] = (u64)v.x | ((u64)v.y << 32);
        in.d[1] = (u64)v.z | ((u64)v.w << 32);
    } else if (F == 64) {
        in.d[0] = *(const u64*)(at.data + gi * 8);
    } else if (sub < F / 8) {
        in.d[0] = *(const u64*)(at.data + (gi - sub) * (F / 8) + 8 * sub);
    }
    if (sets && sub < SF / 8) in.sword = *(const u64*)(at.scales + (gi - sub) * (SF / 8) + 8 * sub);
}

template <int KIND, bool WRITE, bool FUSED>
__device__ __forceinline__ u32 group_unit(const KvSide& S, const SideGeometry& g, const i64* slots, int tokens,
                                          int block_size, i64 limit, i64 u, bool rows_vec, bool sets, UnitIn<GROUP>& in) {
    const int F = group_data_bits<KIND>(S);  // data bits a group
    constexpr int SF = KIND == FMT_TURBO8 ? 16 : 8;
    const GroupItem it = group_item(S, tokens, u);
    const int token = it.token;
    const i64 gi = it.gi;
    const i64 slot = FUSED ? (it.in_range ? slots[token] : -1) : in.slot;
    const bool valid = it.in_range && slot >= 0 && slot < limit;
    const i64 e = (i64)token * S.row_stride + GROUP * gi;
    const int sub = (int)(lane_id() & 7u);  // lane in its set of 8 (one row when `sets`)
    SlotRows at = {nullptr, nullptr};
    if (valid) at = slot_rows(S, g, block_size, slot);
    float (&x)[GROUP] = in.x;
    u64 d[2];
    if (WRITE) {
        u32 bad = 0, sb = 0;
        d[0] = d[1] = 0;
        if (valid) {
            if (FUSED) load_elems<GROUP>(S.rows, S.bf16, e, rows_vec, GROUP, x);
#pragma unroll
            for (int k = 0; k < GROUP; k++) bad += is_nonfinite(x[k]);
            sb = encode_group_bits<KIND>(S.fmt, x, d);
        }
        if (!sets) {
            if (valid) {
                u8* data = at.data + gi * (F / 8);
                store_word(data, d[0], F / 8 < 8 ? F / 8 : 8, false);
                if (F > 64) store_word(data + 8, d[1], 8, false);
                store_word(at.scales + gi * (SF / 8), sb, SF / 8, false);
            }
            return bad;
        }
        // whole sets: the set's lanes share a row and its validity
        if (F == 128) {
            if (valid) {
                uint4 v;
                v.x = (u32)d[0]; v.y = (u32)(d[0] >> 32); v.z = (u32)d[1]; v.w = (u32)(d[1] >> 32);
                *(uint4*)(at.data + gi * 16) = v;
            }
        } else if (F == 64) {
            if (valid) *(u64*)(at.data + gi * 8) = d[0];
        } else {
            const u64 word = gather_word<3, 1, 8>(d[0], F, sub, 8);
            if (valid && sub < F / 8) *(u64*)(at.data + (gi - sub) * (F / 8) + 8 * sub) = word;
        }
        const u64 sword = gather_word<SF == 8 ? 9 : 5, 1, 8>(sb, SF, sub, 8);
        if (valid && sub < SF / 8) *(u64*)(at.scales + (gi - sub) * (SF / 8) + 8 * sub) = sword;
        return bad;
    }
    if (FUSED) group_load<KIND, WRITE>(S, g, slots, tokens, block_size, limit, u, rows_vec, sets, in);
    u32 sb = (u32)in.sword;
    d[0] = in.d[0];
    d[1] = in.d[1];
    if (sets) {
        if (F < 64) d[0] = scatter_field<8>(in.d[0], F, sub, F / 8);
        sb = (u32)scatter_field<8>(in.sword, SF, sub, SF / 8);
    }
    if (!it.in_range) return 0;
    if (valid) {
        decode_group_bits<KIND>(S.fmt, d, sb, x);
    } else {
#pragma unroll
        for (int k = 0; k < GROUP; k++) x[k] = 0.0f;
    }
    store_elems<GROUP>(S.rows, S.bf16, e, rows_vec, GROUP, x);
    return 0;
}

// Rotated turbo formats (KIND: FMT_TURBO8, or FMT_TURBO4 for every codebook format): unit u
// is (token, head); lane L holds elements [E * L, E * L + E). head_load issues the unit's
// global loads (the rows of a write; the data and scale words of a read), head_unit the rest
// (FUSED: head_unit loads the unit itself, the rows of a write where it uses them, as a batch of 1 does).
template <int KIND, int E, bool WRITE>
__device__ __forceinline__ void head_load(const KvSide& S, const SideGeometry& g, const i64* slots, int block_size,
                                          i64 limit, i64 u, bool rows_vec, bool words_vec, UnitIn<E>& in) {
    constexpr int P = GROUP / E;                                  // lanes a group
    constexpr int SF = KIND == FMT_TURBO8 ? 16 : 8;
    constexpr int SCALE_BYTES = (32 / P) * SF / 8;                // a head's scale bytes
    const int bits = KIND == FMT_TURBO8 ? 8 : book_of(S.fmt).bits;
    const int F = E * bits;                                       // data bits a lane
    const int data_bytes = 4 * F;                                 // a head's: 32 lanes x F bits
    const int lane = (int)lane_id();
    const int token = (int)(u / S.heads), h = (int)(u - (i64)token * S.heads);
    in.slot = slots[token];
    const bool valid = in.slot >= 0 && in.slot < limit;  // uniform over the warp: one head of one token
    if (WRITE) {
        if (valid) load_elems<E>(S.rows, S.bf16, (i64)token * S.row_stride + (i64)h * S.head_dim + E * lane, rows_vec, E, in.x);
        return;
    }
    in.d[0] = in.d[1] = in.sword = 0;
    if (!valid) return;
    const SlotRows at = slot_rows(S, g, block_size, in.slot);
    const u8* data = at.data + (i64)h * data_bytes;
    const u8* scales = at.scales + (i64)h * SCALE_BYTES;
    if (F == 128) {
        if (words_vec) {
            const uint4 v = *(const uint4*)(data + 16 * lane);
            in.d[0] = (u64)v.x | ((u64)v.y << 32);
            in.d[1] = (u64)v.z | ((u64)v.w << 32);
        } else {
            in.d[0] = load_word(data + 16 * lane, 8, false);
            in.d[1] = load_word(data + 16 * lane + 8, 8, false);
        }
    } else if (F == 64) {
        in.d[0] = load_word(data + 8 * lane, 8, words_vec);
    } else if (lane < data_bytes / 8) {
        in.d[0] = load_word(data + 8 * lane, 8, words_vec);
    }
    if (lane < SCALE_BYTES / 8) in.sword = load_word(scales + 8 * lane, 8, words_vec);
}

template <int KIND, int E, bool WRITE, bool FUSED>
__device__ __forceinline__ u32 head_unit(const KvSide& S, const SideGeometry& g, const i64* slots, int block_size,
                                         i64 limit, i64 u, bool rows_vec, bool words_vec, UnitIn<E>& in) {
    constexpr int P = GROUP / E;                                  // lanes a group
    constexpr int SF = KIND == FMT_TURBO8 ? 16 : 8;
    constexpr int SCALE_BYTES = (32 / P) * SF / 8;                // a head's scale bytes
    constexpr int MAXS = 64 / (2 * E) + 1;                        // fields a word meets (turbo2's)
    const Book book = book_of(S.fmt);
    const int bits = KIND == FMT_TURBO8 ? 8 : book.bits;
    const int F = E * bits;                                       // data bits a lane
    const int data_bytes = 4 * F;                                 // a head's: 32 lanes x F bits
    const int lane = (int)lane_id();
    const int token = (int)(u / S.heads), h = (int)(u - (i64)token * S.heads);
    const i64 slot = FUSED ? slots[token] : in.slot;
    const bool valid = slot >= 0 && slot < limit;  // uniform over the warp: one head of one token
    const i64 e = (i64)token * S.row_stride + (i64)h * S.head_dim + E * lane;
    SlotRows at = {nullptr, nullptr};
    if (valid) at = slot_rows(S, g, block_size, slot);
    u8* data = valid ? at.data + (i64)h * data_bytes : nullptr;
    u8* scales = valid ? at.scales + (i64)h * SCALE_BYTES : nullptr;
    float (&x)[E] = in.x;
    if (WRITE) {
        if (!valid) return 0;
        if (FUSED) load_elems<E>(S.rows, S.bf16, e, rows_vec, E, x);
        u32 bad = 0;
#pragma unroll
        for (int j = 0; j < E; j++) bad += is_nonfinite(x[j]);
        rotate_warp<E>(x, S.first, S.last, S.inv_sqrt_n);
        // the group's amax over its P lanes (a maximum: any order gives the same)
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < E; j++) { const float a = fabsf(x[j]); if (a > amax) amax = a; }
#pragma unroll
        for (int m = 1; m < P; m <<= 1) { const float o = __shfl_xor_sync(FULL_MASK, amax, m); if (o > amax) amax = o; }
        u64 field = 0, hi = 0;  // this lane's codes as a bit stream (turbo8 at hd 512: 16 bytes)
        u32 sb;
        if (KIND == FMT_TURBO8) {
            float s = amax / 448.0f;
            if (s < 1e-12f) s = 1e-12f;
#pragma unroll
            for (int j = 0; j < E; j++) {
                const u64 b = (u64)e4m3_encode(x[j] / s);
                if (j < 8) field |= b << (8 * j);
                else hi |= b << (8 * (j - 8));
            }
            sb = bf16_encode(s);
        } else {
            const bool tiny = amax <= 1e-12f;
            const float ratio = tiny ? 1.0f : book.levels[book.count - 1] / amax;
            u32 c[E];
#pragma unroll
            for (int j = 0; j < E; j++) {
                c[j] = book_code(book, tiny ? x[j] : x[j] * ratio);
                field |= (u64)c[j] << (bits * j);
            }
            // the sums of squares in element order: lane k of the group continues lane k-1's sums
            float x_ssq = 0.0f, level_ssq = 0.0f;
            const int group_lane = lane & ~(P - 1);
#pragma unroll
            for (int k = 0; k < P; k++) {
                if ((lane & (P - 1)) == k) {
#pragma unroll
                    for (int j = 0; j < E; j++) {
                        const float xx = x[j] * x[j];
                        x_ssq = x_ssq + xx;
                        const float ll = book.levels[c[j]] * book.levels[c[j]];
                        level_ssq = level_ssq + ll;
                    }
                }
                x_ssq = __shfl_sync(FULL_MASK, x_ssq, group_lane + k);
                level_ssq = __shfl_sync(FULL_MASK, level_ssq, group_lane + k);
            }
            float s = sqrtf(x_ssq) / sqrtf(level_ssq);
            if (s > 448.0f) s = 448.0f;
            sb = e4m3_encode(s);
        }
        if (F == 128) {  // a lane's 16 bytes, stored as they are
            if (words_vec) {
                uint4 v;
                v.x = (u32)field; v.y = (u32)(field >> 32); v.z = (u32)hi; v.w = (u32)(hi >> 32);
                *(uint4*)(data + 16 * lane) = v;
            } else {
                store_word(data + 16 * lane, field, 8, false);
                store_word(data + 16 * lane + 8, hi, 8, false);
            }
        } else if (F == 64) {
            store_word(data + 8 * lane, field, 8, words_vec);
        } else {
            const u64 word = gather_word<MAXS, 1, 32>(field, F, lane, 32);
            if (lane < data_bytes / 8) store_word(data + 8 * lane, word, 8, words_vec);
        }
        const u64 sword = gather_word<64 / SF + 1, P, 32>(sb, SF, lane, 32 / P);
        if (lane < SCALE_BYTES / 8) store_word(scales + 8 * lane, sword, 8, words_vec);
        return bad;
    }
    if (valid) {
        if (FUSED) head_load<KIND, E, WRITE>(S, g, slots, block_size, limit, u, rows_vec, words_vec, in);
        u64 d[2] = {in.d[0], in.d[1]};
        if (F < 64) d[0] = scatter_field<32>(in.d[0], F, lane, data_bytes / 8);
        const u32 sb = (u32)scatter_field<32>(in.sword, SF, lane / P, SCALE_BYTES / 8);
        if (KIND == FMT_TURBO8) {
            const float s = bf16_decode(sb);
#pragma unroll
            for (int j = 0; j < E; j++) x[j] = e4m3_decode((u32)(d[j >> 3] >> (8 * (j & 7))) & 0xFFu) * s;
        } else {
            const float dq = e4m3_decode(sb);
#pragma unroll
            for (int j = 0; j < E; j++) x[j] = book.levels[(u32)(d[0] >> (bits * j)) & ((1u << bits) - 1u)] * dq;
        }
        rotate_warp<E>(x, S.first, S.last, S.inv_sqrt_n);
    } else {
#pragma unroll
        for (int j = 0; j < E; j++) x[j] = 0.0f;
    }
    store_elems<E>(S.rows, S.bf16, e, rows_vec, E, x);
    return 0;
}

// The loop over units [l0, count) step `stride` of one side on one path, the format (and
// the rotated head size E) fixed. Not inlined, the side passed as scalars: each path gets
// its own registers, so the kernel needs the most of any one path, not of all at once.
#define PKV_SIDE_PARAMS int fmt, u64 pool, i64 block_stride, u64 rows, i64 row_stride, int bf16, float scale, int first, \
    int last, int heads, int head_dim, float inv_sqrt_n, const i64* slots, int tokens, int block_size, i64 limit, \
    i64 l0, i64 count, i64 stride
#define PKV_SIDE_ARGS fmt, pool, block_stride, rows, row_stride, bf16, scale, first, last, heads, head_dim, inv_sqrt_n, \
    slots, tokens, block_size, limit, l0, count, stride

struct SideFlags {
    SideGeometry g;
    bool rows_vec, pool16, words_vec;
};

__device__ __forceinline__ SideFlags side_flags(const KvSide& S, int block_size) {
    SideFlags f;
    f.g = geometry(S.fmt, S.heads * S.head_dim, block_size);
    const int esize = S.bf16 ? 2 : 4;
    f.rows_vec = ((S.rows | (u64)(S.row_stride * esize)) & 15u) == 0;
    f.pool16 = ((S.pool | (u64)S.block_stride) & 15u) == 0;
    f.words_vec = f.pool16 && (f.g.data_section & 7) == 0;
    return f;
}

template <int FMT, bool WRITE, bool INLINE>
__device__ __forceinline__ u32 chunk_loop_body(PKV_SIDE_PARAMS) {
    const KvSide S = make_side(fmt, pool, block_stride, rows, row_stride, bf16, scale, first, last, heads, head_dim, inv_sqrt_n);
    const SideFlags f = side_flags(S, block_size);
    const bool pool_vec = f.pool16 && (f.g.row_bytes & 15) == 0;
    u32 bad = 0;
    if (f.rows_vec && pool_vec && (S.heads * S.head_dim) % 512 == 0) {  // a unit is a span: same count
        for (i64 l = l0; l < count; l += stride) bad += span_unit<FMT, WRITE>(S, f.g, slots, block_size, limit, l);
        return bad;
    }
    if (f.rows_vec && pool_vec && 512 % (S.heads * S.head_dim) == 0 && (S.heads * S.head_dim) % 16 == 0) {
        // a unit is 512 / n tokens: the same count (tokens x n / 16 chunks, 32 a unit)
        for (i64 l = l0; l < count; l += stride)
            bad += tokens_unit<FMT, WRITE>(S, f.g, slots, tokens, block_size, limit, l);
        return bad;
    }
    for (i64 l = l0; l < count; l += stride)
        bad += chunk_unit<FMT, WRITE>(S, f.g, slots, tokens, block_size, limit, l, f.rows_vec, pool_vec);
    return bad;
}

// BATCH: units a warp of the group / head paths takes at once (its units l, l + stride, ...):
// all their loads are issued before the first is computed, so a lane has the batch's bytes
// in flight; then one unit at a time, the batch shifted down after each (constant indices:
// registers). The every-format kernels take 1; the one-path kernels more. A batch of 1 is the
// plain loop, each unit loading its rows after its slot check (FUSED): the every-format kernels
// then need the registers of the plain paths (at most 168 on sm_90), not those of a load phase.
template <int FMT, bool WRITE, int GROUP_BATCH>
__device__ __noinline__ u32 group_loop(PKV_SIDE_PARAMS) {
    const KvSide S = make_side(fmt, pool, block_stride, rows, row_stride, bf16, scale, first, last, heads, head_dim, inv_sqrt_n);
    const SideFlags f = side_flags(S, block_size);
    const bool sets = f.words_vec && ((S.heads * S.head_dim) / GROUP) % 8 == 0;
    u32 bad = 0;
    for (i64 l = l0; l < count; l += GROUP_BATCH * stride) {  // the batch's units: l, l + stride, ...
        UnitIn<GROUP> in[GROUP_BATCH];
#pragma unroll
        for (int b = 0; b < GROUP_BATCH; b++)
            if (GROUP_BATCH > 1 && l + b * stride < count)
                group_load<FMT, WRITE>(S, f.g, slots, tokens, block_size, limit, l + b * stride, f.rows_vec, sets, in[b]);
        if constexpr (GROUP_BATCH == 1) {
            bad += group_unit<FMT, WRITE, true>(S, f.g, slots, tokens, block_size, limit, l, f.rows_vec, sets, in[0]);
        } else {
#pragma unroll 1
            for (int b = 0; b < GROUP_BATCH && l + b * stride < count; b++) {
                bad += group_unit<FMT, WRITE, false>(S, f.g, slots, tokens, block_size, limit, l + b * stride, f.rows_vec, sets,
                                                     in[0]);
#pragma unroll
                for (int c = 0; c + 1 < GROUP_BATCH; c++) in[c] = in[c + 1];
            }
        }
    }
    return bad;
}

template <int FMT, int E, bool WRITE, int B>
__device__ __noinline__ u32 head_loop(PKV_SIDE_PARAMS) {
    const KvSide S = make_side(fmt, pool, block_stride, rows, row_stride, bf16, scale, first, last, heads, head_dim, inv_sqrt_n);
    const SideFlags f = side_flags(S, block_size);
    u32 bad = 0;
    for (i64 l = l0; l < count; l += B * stride) {  // the batch's units: l, l + stride, ...
        UnitIn<E> in[B];
#pragma unroll
        for (int b = 0; b < B; b++)
            if (B > 1 && l + b * stride < count)
                head_load<FMT, E, WRITE>(S, f.g, slots, block_size, limit, l + b * stride, f.rows_vec, f.words_vec, in[b]);
        if constexpr (B == 1) {
            bad += head_unit<FMT, E, WRITE, true>(S, f.g, slots, block_size, limit, l, f.rows_vec, f.words_vec, in[0]);
        } else {
#pragma unroll 1
            for (int b = 0; b < B && l + b * stride < count; b++) {
                bad += head_unit<FMT, E, WRITE, false>(S, f.g, slots, block_size, limit, l + b * stride, f.rows_vec,
                                                       f.words_vec, in[0]);
#pragma unroll
                for (int c = 0; c + 1 < B; c++) in[c] = in[c + 1];
            }
        }
    }
    return bad;
}

template <int FMT, bool WRITE>
__device__ __noinline__ u32 chunk_loop(PKV_SIDE_PARAMS) { return chunk_loop_body<FMT, WRITE, false>(PKV_SIDE_ARGS); }

// The side's path: bf16/fp8 chunks, groups, or rotated heads of 128, 256 or 512; turbo4,
// turbo3 and turbo2 share their paths (kind FMT_TURBO4, the codebook chosen at run time).
#define PATH_ANY 0       // as the side's format and geometry say
#define PATH_GROUPS 1    // a group a lane (nvfp4; turbo formats unrotated)
#define PATH_HEADS128 2  // rotated turbo heads of 128

template <int FMT, bool WRITE, int PATH = PATH_ANY, int BATCH = 1>
__device__ __forceinline__ u32 side_loop(PKV_SIDE_PARAMS) {
    constexpr int KIND = FMT == FMT_TURBO3 || FMT == FMT_TURBO2 ? FMT_TURBO4 : FMT;
    if (FMT == FMT_BF16 || FMT == FMT_FP8) return chunk_loop<FMT, WRITE>(PKV_SIDE_ARGS);
    if (PATH == PATH_GROUPS || (PATH == PATH_ANY && (first < 0 || FMT == FMT_NVFP4)))
        return group_loop<KIND, WRITE, BATCH>(PKV_SIDE_ARGS);
    if (PATH == PATH_HEADS128 || head_dim == 128) return head_loop<KIND, 4, WRITE, BATCH>(PKV_SIDE_ARGS);
    if (PATH != PATH_ANY) return 0;
    if (head_dim == 256) return head_loop<KIND, 8, WRITE, 1>(PKV_SIDE_ARGS);
    return head_loop<KIND, 16, WRITE, 1>(PKV_SIDE_ARGS);
}

// This warp's share of one side whose units start at global unit `start`; advances `start`.
// Kernel families: ALL formats, or ROWS16 (bf16 and fp8 sides only: the chunk loop inlined,
// with its own small register count; Python launches it when every side is bf16 or fp8).
#define FAMILY_ALL 0
#define FAMILY_ROWS16 1
#define FAMILY_ONE 2  // sides of one kind on one path only (the template's ONE, PATH, BATCH), or skipped ones

template <bool WRITE, int FAMILY, int ONE = FMT_NVFP4, int PATH = PATH_ANY, int BATCH = 1>
__device__ u32 kv_side(const KvSide& S, const i64* slots, int tokens, int block_size, i64 limit, i64& start) {
    const i64 count = side_units(S, tokens);
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    const i64 me = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const i64 l0 = ((me - start) % warps + warps) % warps;
    start += count;
    if (l0 >= count) return 0;
#define PKV_SIDE_LOOP(F) side_loop<F, WRITE>(S.fmt, S.pool, S.block_stride, S.rows, S.row_stride, S.bf16, S.scale, S.first, \
                                        S.last, S.heads, S.head_dim, S.inv_sqrt_n, slots, tokens, block_size, limit, \
                                        l0, count, warps)
    if (FAMILY == FAMILY_ROWS16) {
#define PKV_ROWS16(F) chunk_loop_body<F, WRITE, true>(S.fmt, S.pool, S.block_stride, S.rows, S.row_stride, S.bf16, S.scale, \
        S.first, S.last, S.heads, S.head_dim, S.inv_sqrt_n, slots, tokens, block_size, limit, l0, count, warps)
        if (S.fmt == FMT_BF16) return PKV_ROWS16(FMT_BF16);
        if (S.fmt == FMT_FP8) return PKV_ROWS16(FMT_FP8);
        return 0;
#undef PKV_ROWS16
    }
    if (FAMILY == FAMILY_ONE) {  // sides of kind ONE (turbo3, turbo2: FMT_TURBO4) on path PATH only
        const int kind = S.fmt == FMT_TURBO3 || S.fmt == FMT_TURBO2 ? FMT_TURBO4 : S.fmt;
        if (kind != ONE || (PATH == PATH_HEADS128 && (S.first < 0 || S.head_dim != 128)) ||
            (PATH == PATH_GROUPS && ONE != FMT_NVFP4 && S.first >= 0))
            return 0;  // not this kernel's (the driver does not launch it for such sides)
        return side_loop<ONE, WRITE, PATH, BATCH>(S.fmt, S.pool, S.block_stride, S.rows, S.row_stride, S.bf16, S.scale,
            S.first, S.last, S.heads, S.head_dim, S.inv_sqrt_n, slots, tokens, block_size, limit, l0, count, warps);
    }
    switch (S.fmt) {  // uniform: once per side, outside the unit loop
    case FMT_BF16: return PKV_SIDE_LOOP(FMT_BF16);
    case FMT_FP8: return PKV_SIDE_LOOP(FMT_FP8);
    case FMT_NVFP4: return PKV_SIDE_LOOP(FMT_NVFP4);
    case FMT_TURBO4: return PKV_SIDE_LOOP(FMT_TURBO4);
    case FMT_TURBO3: return PKV_SIDE_LOOP(FMT_TURBO3);
    case FMT_TURBO2: return PKV_SIDE_LOOP(FMT_TURBO2);
    case FMT_TURBO8: return PKV_SIDE_LOOP(FMT_TURBO8);
    default: return 0;
    }
#undef PKV_SIDE_LOOP
}

// One side of one layer of the layer table of pagedkv_kv_write / _read (KvLayerSide in
// driver/kv_kernels.py); `rows` are the source rows of a write, the output rows of a read;
// `hnd` 1: the pool holds HND blocks (kv_side_blocks).
struct KvLayerSide {
    u64 pool;
    i64 block_stride;
    u64 rows;
    i64 row_stride;
    int fmt, bf16;
    float scale;
    int first, last, hnd;
};

// One layer of the layer table of pagedkv_kv_write / _read (KvLayer in driver/kv_kernels.py).
struct KvLayer {
    int heads, head_dim;
    float inv_sqrt_n;
    int pad;
    KvLayerSide side[2];
};

// Every side of a launch: the `num_layers` layers of the device table `layers`, or (when
// num_layers is 0) the one layer given inline as K and V, each side of NHD blocks or of HND
// blocks (its `hnd` flag).
//
// An HND side: head h's chunk of a block (its `block_size` tokens' data, then their scales)
// is byte for byte an NHD block of a one-head side (docs/LAYOUTS.md), so the side runs as
// `heads` one-head sides, the h-th with its pool moved to chunk h (pool + h * chunk bytes;
// the block stride unchanged) and its rows to head h (rows + h * head_dim elements; the row
// stride unchanged). Their units follow each other in the launch's unit numbering (`start`),
// so the warps share them as they share the sides of many layers, and every path is NHD's:
// a chunk's accesses are as wide as a one-head NHD block's (one (token, head) is contiguous
// in the pool and in the rows: bf16 head_dim 128, 256 bytes). One kv_side call site for
// every side, NHD ones a loop of one head chunk: the inline sides go through the loop the
// table's do.
// Side e of a launch (K then V, layer after layer), as the one-head side of its HND head
// chunk h (h < *chunks) or, NHD, as it is (*chunks 1). Built afresh for every chunk from the
// table or the kernel's parameters, so nothing of it is live across the paths' loops.
__device__ __forceinline__ KvSide side_chunk(const KvLayer* __restrict__ layers, int num_layers, int e, int h,
                                             int block_size, const KvSide& k, int k_hnd, const KvSide& v, int v_hnd,
                                             int* chunks) {
    KvSide S;
    int hnd;
    if (num_layers) {
        const KvLayer& L = layers[e >> 1];
        const KvLayerSide& T = L.side[e & 1];
        S = make_side(T.fmt, T.pool, T.block_stride, T.rows, T.row_stride, T.bf16, T.scale, T.first, T.last, L.heads,
                      L.head_dim, L.inv_sqrt_n);
        hnd = T.hnd;
    } else {
        S = e ? v : k;
        hnd = e ? v_hnd : k_hnd;
    }
    *chunks = hnd && S.fmt >= 0 ? S.heads : 1;
    if (*chunks > 1) {
        const SideGeometry g = geometry(S.fmt, S.head_dim, block_size);  // one head's: its chunk
        S.pool += (u64)(h * (g.data_section + g.scale_row_bytes * block_size));
        S.rows += (u64)(h * ((i64)S.head_dim * (S.bf16 ? 2 : 4)));
        S.heads = 1;
    }
    return S;
}

// Every side of a launch: the `num_layers` layers of the device table `layers`, or (when
// num_layers is 0) the one layer given inline as K and V, each side of NHD blocks or of HND
// blocks (its `hnd` flag).
//
// An HND side: head h's chunk of a block (its `block_size` tokens' data, then their scales)
// is byte for byte an NHD block of a one-head side (docs/LAYOUTS.md), so the side runs as
// `heads` one-head sides, the h-th with its pool moved to chunk h (pool + h * chunk bytes;
// the block stride unchanged) and its rows to head h (rows + h * head_dim elements; the row
// stride unchanged). Their units follow each other in the launch's unit numbering (`start`),
// so the warps share them as they share the sides of many layers, and every path is NHD's:
// a chunk's accesses are as wide as a one-head NHD block's (one (token, head) is contiguous
// in the pool and in the rows: bf16 head_dim 128, 256 bytes). One kv_side call site for
// every side (an NHD side is one chunk), the inline sides through the loop the table's take.
template <bool WRITE, int FAMILY, int ONE = FMT_NVFP4, int PATH = PATH_ANY, int BATCH = 1>
__device__ __forceinline__ u32 kv_launch(const KvLayer* __restrict__ layers, int num_layers, const i64* slots,
                                         int num_tokens, int block_size, i64 limit, const KvSide& k, int k_hnd,
                                         const KvSide& v, int v_hnd) {
    kv_load_tables();
    i64 start = 0;
    u32 bad = 0;
    // (side e, chunk h) as one counter e << 16 | h (the driver keeps heads < 2^16 and sides
    // < 2^15): the loop keeps one register across the paths' calls, as the table's (layer,
    // side) loop kept two, and a side's chunk count is reloaded rather than kept (this form
    // is the one whose registers are NHD's or fewer, without spills: ptxas sm_90 and sm_100)
    const int sides = num_layers ? 2 * num_layers : 2;
    for (int at = 0; (at >> 16) < sides;) {
        int chunks;
        const KvSide S = side_chunk(layers, num_layers, at >> 16, at & 0xFFFF, block_size, k, k_hnd, v, v_hnd, &chunks);
        bad += kv_side<WRITE, FAMILY, ONE, PATH, BATCH>(S, slots, num_tokens, block_size, limit, start);
        side_chunk(layers, num_layers, at >> 16, 0, block_size, k, k_hnd, v, v_hnd, &chunks);
        at = (at & 0xFFFF) + 1 < chunks ? at + 1 : ((at >> 16) + 1) << 16;
    }
    return bad;
}

#define PKV_KV_PARAMS(ROWS)                                                                                     \
    const i64 *__restrict__ slots, int num_tokens, int heads, int head_dim, int block_size, i64 limit,             \
    float inv_sqrt_n, unsigned long long *nonfinite, int k_fmt, u64 k_pool, i64 k_block_stride, u64 k_##ROWS,      \
    i64 k_row_stride, int k_bf16, float k_scale, int k_first, int k_last, int k_hnd, int v_fmt, u64 v_pool,        \
    i64 v_block_stride, u64 v_##ROWS, i64 v_row_stride, int v_bf16, float v_scale, int v_first, int v_last,        \
    int v_hnd, const KvLayer *__restrict__ layers, int num_layers

#define PKV_KV_LAUNCH(WRITE, FAMILY, ROWS, ...)                                                                 \
    kv_launch<WRITE, FAMILY, ##__VA_ARGS__>(layers, num_layers, slots, num_tokens, block_size, limit,                          \
                             make_side(k_fmt, k_pool, k_block_stride, k_##ROWS, k_row_stride, k_bf16, k_scale,   \
                                       k_first, k_last, heads, head_dim, inv_sqrt_n), k_hnd,                    \
                             make_side(v_fmt, v_pool, v_block_stride, v_##ROWS, v_row_stride, v_bf16, v_scale,   \
                                       v_first, v_last, heads, head_dim, inv_sqrt_n), v_hnd)

// Rows encoded into their slots, every format: one layer's K and V given inline, or (a
// prefill, or a decode step's new tokens of every layer) `num_layers` layers of the device
// table `layers`, the same tokens' slots for all. NaN/inf inputs add to *nonfinite.
extern "C" __global__ void __launch_bounds__(KV_THREADS) pagedkv_kv_write(PKV_KV_PARAMS(src)) {
    const u32 bad = PKV_KV_LAUNCH(true, FAMILY_ALL, src);
    if (bad && nonfinite) atomicAdd(nonfinite, (unsigned long long)bad);
}

// pagedkv_kv_write for bf16 and fp8 sides only (or skipped ones).
extern "C" __global__ void __launch_bounds__(KV_THREADS, KV_WRITE16_CTAS) pagedkv_kv_write16(PKV_KV_PARAMS(src)) {
    const u32 bad = PKV_KV_LAUNCH(true, FAMILY_ROWS16, src);
    if (bad && nonfinite) atomicAdd(nonfinite, (unsigned long long)bad);
}

// Slots decoded into rows (a slot outside 0..limit-1 gives zeros), every format: one layer
// inline, or `num_layers` layers of the table (whose sides name the outputs and the sign
// tables of the unrotation). `nonfinite` is unused.
extern "C" __global__ void __launch_bounds__(KV_THREADS) pagedkv_kv_read(PKV_KV_PARAMS(out)) {
    PKV_KV_LAUNCH(false, FAMILY_ALL, out);
}

// pagedkv_kv_read for bf16 and fp8 sides only (or skipped ones).
extern "C" __global__ void __launch_bounds__(KV_THREADS, KV_READ16_CTAS) pagedkv_kv_read16(PKV_KV_PARAMS(out)) {
    PKV_KV_LAUNCH(false, FAMILY_ROWS16, out);
}

// pagedkv_kv_write / _read for the sides of one kind on one path only (or skipped ones), each
// with only that path's registers and a batch of units a warp loads at once (BATCH of
// group_loop / head_loop): _nvfp4: nvfp4 sides; _turbo_h128: rotated turbo4, turbo3 and
// turbo2 sides of head_dim 128; _turbo8_h128: rotated turbo8 sides of head_dim 128. Each
// batch is the most units whose registers fit the CTAs an SM asked for without spills
// (sm_90), so a lane has batch x (slot + row) bytes in flight.
extern "C" __global__ void __launch_bounds__(KV_THREADS, 3) pagedkv_kv_write_nvfp4(PKV_KV_PARAMS(src)) {
    const u32 bad = PKV_KV_LAUNCH(true, FAMILY_ONE, src, FMT_NVFP4, PATH_GROUPS, 3);
    if (bad && nonfinite) atomicAdd(nonfinite, (unsigned long long)bad);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 4) pagedkv_kv_read_nvfp4(PKV_KV_PARAMS(out)) {
    PKV_KV_LAUNCH(false, FAMILY_ONE, out, FMT_NVFP4, PATH_GROUPS, 4);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 3) pagedkv_kv_write_turbo_h128(PKV_KV_PARAMS(src)) {
    const u32 bad = PKV_KV_LAUNCH(true, FAMILY_ONE, src, FMT_TURBO4, PATH_HEADS128, 12);
    if (bad && nonfinite) atomicAdd(nonfinite, (unsigned long long)bad);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 3) pagedkv_kv_read_turbo_h128(PKV_KV_PARAMS(out)) {
    PKV_KV_LAUNCH(false, FAMILY_ONE, out, FMT_TURBO4, PATH_HEADS128, 10);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 3) pagedkv_kv_write_turbo8_h128(PKV_KV_PARAMS(src)) {
    const u32 bad = PKV_KV_LAUNCH(true, FAMILY_ONE, src, FMT_TURBO8, PATH_HEADS128, 12);
    if (bad && nonfinite) atomicAdd(nonfinite, (unsigned long long)bad);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS, 3) pagedkv_kv_read_turbo8_h128(PKV_KV_PARAMS(out)) {
    PKV_KV_LAUNCH(false, FAMILY_ONE, out, FMT_TURBO8, PATH_HEADS128, 8);
}

// Debug check of a write's slots (launched before it when METRALE_KV_TRACE=1): a slot that
// two tokens name would make two CTAs write one row (a torn row: one token's codes with the
// other's scales). The smallest such slot is stored into *duplicate (all ones: none), which
// the host reads at its next sync point (take_nonfinite_inputs) and raises on. Token i is
// compared with every earlier one: quadratic, a debug tool.
extern "C" __global__ void __launch_bounds__(KV_THREADS) pagedkv_kv_check_slots(
    const i64* __restrict__ slots, int num_tokens, i64 limit, unsigned long long* duplicate)
{
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < num_tokens; i += (i64)gridDim.x * blockDim.x) {
        const i64 s = slots[i];
        if (s < 0 || s >= limit) continue;
        for (i64 j = 0; j < i; j++) {
            if (slots[j] == s) {
                atomicMin(duplicate, (unsigned long long)s);
                break;
            }
        }
    }
}

// ---- exact checksums of stored values (pagedkv_kv_checksum_partial / _final) --------------
//
// Sum, sum of |x| and sum of squares of every stored value of the listed blocks of one pool,
// decoded by the read path's decoders above without unrotation (fp8 as its E4M3 values,
// without the per-tensor scale). Decoded values are float32: each finite one is
// m * 2^(s - 149) (m < 2^24, 0 <= s <= 253). A CTA counts into bins in shared memory and
// adds each bin once into its wide fixed-point digits (32-bit digits held in int64 words,
// units 2^-149 and 2^-298) when it flushes:
// - fp8, nvfp4, turbo4/3/2: a histogram of codes, (scale byte, code) for the grouped
//   formats: a value's decoded float32 is fixed by its bin, decoded once per bin;
// - turbo8 (an E4M3 byte times a BF16 scale, rounded in float32): per-exponent bins of the
//   decoded float32, the sum of m of the positive and of the negative values of shift s and
//   the sum of m * m in two 24-bit halves.
// Integer addition is exact and associative, so every grid, CTA order and block size gives
// the same words, which pagedkv/exact_sum.py (stats_from_f32_words) rounds once to float64.
// Non-finite values only set flag bits. Pass 1: each CTA writes CS_RESULT_WORDS words; pass
// 2: one CTA adds the partials. CHECKSUM_THREADS, F32_SUM_DIGITS and F32_SSQ_DIGITS come
// from Python as -D options (pagedkv.driver.nvrtc.source_defines).

#if !defined(CHECKSUM_THREADS) || !defined(F32_SUM_DIGITS) || !defined(F32_SSQ_DIGITS)
#error "compile with -DCHECKSUM_THREADS=... -DF32_SUM_DIGITS=... -DF32_SSQ_DIGITS=... (pagedkv.driver.nvrtc.source_defines)"
#endif

#define CS_SUM_AT 0
#define CS_SABS_AT F32_SUM_DIGITS
#define CS_SSQ_AT (2 * F32_SUM_DIGITS)
#define CS_FLAGS_AT (2 * F32_SUM_DIGITS + F32_SSQ_DIGITS)
#define CS_RESULT_WORDS (CS_FLAGS_AT + 1)

#define CS_FLAG_NAN 1u
#define CS_FLAG_POS_INF 2u
#define CS_FLAG_NEG_INF 4u

#define CS_HIST 4096               // (scale byte, code) bins of the 16-code formats
#define CS_SHIFTS 256              // float32 shifts 0..253 (turbo8)
#define CS_FLUSH_AFTER (1u << 31)  // values between flushes: a count (u32) cannot overflow
#define CS_GROUPS 8                // groups a thread loads at once on the vector path
#define CS_CTAS 4                  // resident CTAs an SM the partial pass is built for (64 registers)

__shared__ u32 cs_hist[CS_HIST];
__shared__ u64 cs_exp[4][CS_SHIFTS];  // turbo8: sum m of positives, of negatives, m*m >> 24, m*m & 0xFFFFFF
__shared__ i64 cs_digits[CS_FLAGS_AT];
__shared__ u32 cs_flags;

// digits[0, n) += sign * v * 2^shift (v < 2^63) with shared atomics; the top digit takes
// what lies above it (a carry-save top digit is signed and unbounded).
__device__ __forceinline__ void cs_wide_add(i64* digits, int n, u64 v, u32 shift, bool negative) {
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

__device__ __forceinline__ void cs_carry(i64* d, int n) {
    for (int i = 0; i + 1 < n; i++) {
        const i64 c = d[i] >> 32;  // arithmetic shift: floor division by 2^32
        d[i] -= c * 4294967296LL;
        d[i + 1] += c;
    }
}

__device__ __forceinline__ void cs_flag(u32 bits) {
    atomicOr(&cs_flags, (bits & 0x007FFFFFu) ? CS_FLAG_NAN : ((bits >> 31) ? CS_FLAG_NEG_INF : CS_FLAG_POS_INF));
}

// `count` copies of float32 x into the CTA's digits.
__device__ void cs_add_copies(u64 count, float x) {
    const u32 bits = __float_as_uint(x);
    const u32 e = (bits >> 23) & 0xFFu, f = bits & 0x7FFFFFu;
    if (e == 0xFFu) {
        cs_flag(bits);
        return;
    }
    const u64 m = e ? (f | 0x800000u) : f;
    if (!m) return;
    const u32 s = e ? e - 1 : 0;
    cs_wide_add(cs_digits + CS_SUM_AT, F32_SUM_DIGITS, count * m, s, bits >> 31);
    cs_wide_add(cs_digits + CS_SABS_AT, F32_SUM_DIGITS, count * m, s, false);
    const u64 mm = m * m;  // < 2^48
    cs_wide_add(cs_digits + CS_SSQ_AT, F32_SSQ_DIGITS, count * (mm >> 24), 2 * s + 24, false);
    cs_wide_add(cs_digits + CS_SSQ_AT, F32_SSQ_DIGITS, count * (mm & 0xFFFFFFu), 2 * s, false);
}

// Codes per scale of a code-histogram format (fp8: its 256 bytes, one "scale").
__device__ __forceinline__ int cs_codes(int fmt) {
    return fmt == FMT_TURBO3 ? 8 : (fmt == FMT_TURBO2 ? 4 : 16);
}

// The decoded float32 of histogram bin b: what decode_group / e4m3_decode give.
__device__ float cs_bin_value(int fmt, int b) {
    if (fmt == FMT_FP8) return e4m3_decode((u32)b);
    const int codes = cs_codes(fmt);
    const u32 code = (u32)(b % codes);
    const float d = e4m3_decode((u32)(b / codes));
    if (fmt == FMT_NVFP4) {
        const float m = E2M1_MAGNITUDES[code & 7u];
        return (code & 8u ? -m : m) * d;
    }
    const float* levels;
    const float* bounds;
    turbo_levels(fmt, &levels, &bounds);
    return levels[code] * d;
}

__device__ void cs_init() {
    for (int i = threadIdx.x; i < CS_HIST; i += blockDim.x) cs_hist[i] = 0;
    for (int i = threadIdx.x; i < 4 * CS_SHIFTS; i += blockDim.x) cs_exp[i / CS_SHIFTS][i % CS_SHIFTS] = 0;
    for (int i = threadIdx.x; i < CS_FLAGS_AT; i += blockDim.x) cs_digits[i] = 0;
    if (threadIdx.x == 0) cs_flags = 0;
    __syncthreads();
}

// Add every bin into the CTA's digits (once per bin), clear the bins, propagate carries.
__device__ void cs_flush(int fmt) {
    __syncthreads();
    if (fmt == FMT_TURBO8) {
        for (int s = threadIdx.x; s < CS_SHIFTS; s += blockDim.x) {
            const u64 p = cs_exp[0][s], n = cs_exp[1][s], qh = cs_exp[2][s], ql = cs_exp[3][s];
            if (p != n) cs_wide_add(cs_digits + CS_SUM_AT, F32_SUM_DIGITS, p > n ? p - n : n - p, (u32)s, n > p);
            if (p | n) cs_wide_add(cs_digits + CS_SABS_AT, F32_SUM_DIGITS, p + n, (u32)s, false);
            if (qh) cs_wide_add(cs_digits + CS_SSQ_AT, F32_SSQ_DIGITS, qh, 2u * (u32)s + 24u, false);
            if (ql) cs_wide_add(cs_digits + CS_SSQ_AT, F32_SSQ_DIGITS, ql, 2u * (u32)s, false);
            cs_exp[0][s] = cs_exp[1][s] = cs_exp[2][s] = cs_exp[3][s] = 0;
        }
    } else {
        const int bins = fmt == FMT_FP8 ? 256 : 256 * cs_codes(fmt);
        for (int b = threadIdx.x; b < bins; b += blockDim.x) {
            const u32 count = cs_hist[b];
            if (!count) continue;
            cs_add_copies(count, cs_bin_value(fmt, b));
            cs_hist[b] = 0;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        cs_carry(cs_digits + CS_SUM_AT, F32_SUM_DIGITS);
        cs_carry(cs_digits + CS_SABS_AT, F32_SUM_DIGITS);
        cs_carry(cs_digits + CS_SSQ_AT, F32_SSQ_DIGITS);
    }
    __syncthreads();
}

// One decoded turbo8 value into the per-exponent bins.
__device__ __forceinline__ void cs_bin_float(float x) {
    const u32 bits = __float_as_uint(x);
    const u32 e = (bits >> 23) & 0xFFu, f = bits & 0x7FFFFFu;
    if (e == 0xFFu) {
        cs_flag(bits);
        return;
    }
    const u64 m = e ? (f | 0x800000u) : f;
    if (!m) return;
    const u32 s = e ? e - 1 : 0;
    atomicAdd(&cs_exp[bits >> 31][s], m);
    const u64 mm = m * m;
    atomicAdd(&cs_exp[2][s], mm >> 24);
    atomicAdd(&cs_exp[3][s], mm & 0xFFFFFFu);
}

// The 16 codes of group `g` of a row of `bits`-bit codes held in w (a bit stream, first code
// in the lowest bits, as FORMATS.md packs them), counted into the histogram of scale byte sb.
template <int BITS, int WORDS>
__device__ __forceinline__ void cs_count_group(const u32 (&w)[WORDS], int g, u32 sb) {
    u32* hist = cs_hist + sb * (1u << BITS);
#pragma unroll
    for (int i = 0; i < GROUP; i++) {
        const int bit = (g * GROUP + i) * BITS;
        const u64 pair = (u64)w[bit >> 5] | ((bit >> 5) + 1 < WORDS ? (u64)w[(bit >> 5) + 1] << 32 : 0ull);
        atomicAdd(&hist[(u32)(pair >> (bit & 31)) & ((1u << BITS) - 1u)], 1u);
    }
}

// Vector path of a grouped format with BITS-bit codes: each thread loads CS_GROUPS groups'
// data (16-byte loads) and their scale bytes (one 8-byte load) before counting any.
template <int BITS>
__device__ void cs_grouped_vector(const u8* base, i64 data_section, i64 groups, i64& pending, int fmt) {
    constexpr int DATA_WORDS = CS_GROUPS * GROUP * BITS / 32;  // u32 words of CS_GROUPS groups
    const i64 chunks = groups / CS_GROUPS;
    for (i64 c0 = 0; c0 < chunks; c0 += blockDim.x) {
        const i64 c = c0 + threadIdx.x;
        if (c < chunks) {
            u32 w[DATA_WORDS];
            const uint4* data = (const uint4*)(base + c * (DATA_WORDS * 4));
#pragma unroll
            for (int q = 0; q < DATA_WORDS / 4; q++) {
                const uint4 v = __ldcs(data + q);
                w[4 * q] = v.x; w[4 * q + 1] = v.y; w[4 * q + 2] = v.z; w[4 * q + 3] = v.w;
            }
            const u64 scales = __ldcs((const u64*)(base + data_section + c * CS_GROUPS));
#pragma unroll
            for (int g = 0; g < CS_GROUPS; g++) cs_count_group<BITS, DATA_WORDS>(w, g, (u32)(scales >> (8 * g)) & 0xFFu);
        }
        const i64 round = (chunks - c0 < (i64)blockDim.x ? chunks - c0 : (i64)blockDim.x) * CS_GROUPS * GROUP;
        pending += round;
        if (pending >= (i64)CS_FLUSH_AFTER - (i64)blockDim.x * CS_GROUPS * GROUP) {
            cs_flush(fmt);
            pending = 0;
        }
    }
}

// turbo8's vector path: CS_GROUPS groups of 16 E4M3 bytes and their BF16 scales a thread.
__device__ void cs_turbo8_vector(const u8* base, i64 data_section, i64 groups, i64& pending) {
    const i64 chunks = groups / CS_GROUPS;
    for (i64 c0 = 0; c0 < chunks; c0 += blockDim.x) {
        const i64 c = c0 + threadIdx.x;
        if (c < chunks) {
            uint4 v[CS_GROUPS];
            const uint4* data = (const uint4*)(base + c * (CS_GROUPS * GROUP));
#pragma unroll
            for (int g = 0; g < CS_GROUPS; g++) v[g] = __ldcs(data + g);
            const uint4 sc = __ldcs((const uint4*)(base + data_section + c * (CS_GROUPS * 2)));
            const u32 sw[4] = {sc.x, sc.y, sc.z, sc.w};
#pragma unroll
            for (int g = 0; g < CS_GROUPS; g++) {
                const float s = bf16_decode((sw[g >> 1] >> (16 * (g & 1))) & 0xFFFFu);
                const u32 words[4] = {v[g].x, v[g].y, v[g].z, v[g].w};
#pragma unroll
                for (int i = 0; i < GROUP; i++) cs_bin_float(e4m3_decode((words[i >> 2] >> (8 * (i & 3))) & 0xFFu) * s);
            }
        }
        pending += (chunks - c0 < (i64)blockDim.x ? chunks - c0 : (i64)blockDim.x) * CS_GROUPS * GROUP;
        if (pending >= (i64)CS_FLUSH_AFTER - (i64)blockDim.x * CS_GROUPS * GROUP) {
            cs_flush(FMT_TURBO8);
            pending = 0;
        }
    }
}

// Any geometry: a group a thread, byte loads.
__device__ void cs_grouped_scalar(int fmt, const u8* base, i64 data_section, i64 groups, i64& pending) {
    const int group_bytes = GROUP * format_bits(fmt) / 8, ssize = scale_size(fmt);
    for (i64 g0 = 0; g0 < groups; g0 += blockDim.x) {
        const i64 gi = g0 + threadIdx.x;
        if (gi < groups) {
            const u8* data = base + gi * group_bytes;
            const u8* scale = base + data_section + gi * ssize;
            if (fmt == FMT_TURBO8) {
                const float s = bf16_decode((u32)scale[0] | ((u32)scale[1] << 8));
                for (int i = 0; i < GROUP; i++) cs_bin_float(e4m3_decode(data[i]) * s);
            } else {
                u32 codes[GROUP];
                unpack_codes(data, format_bits(fmt), codes);
                u32* hist = cs_hist + (u32)scale[0] * cs_codes(fmt);
                for (int i = 0; i < GROUP; i++) atomicAdd(&hist[codes[i]], 1u);
            }
        }
        pending += (groups - g0 < (i64)blockDim.x ? groups - g0 : (i64)blockDim.x) * GROUP;
        if (pending >= (i64)CS_FLUSH_AFTER - (i64)blockDim.x * GROUP) {
            cs_flush(fmt);
            pending = 0;
        }
    }
}

// fp8: the block's bytes counted into the 256-bin histogram, 16-byte loads between a
// scalar head and tail.
__device__ void cs_fp8(const u8* base, i64 values, i64& pending) {
    i64 head = (i64)((16u - ((u32)(u64)base & 15u)) & 15u);
    if (head > values) head = values;
    const i64 nwords = (values - head) >> 4;
    const i64 tail = head + (nwords << 4);
    if (threadIdx.x < head) atomicAdd(&cs_hist[base[threadIdx.x]], 1u);
    for (i64 i = tail + threadIdx.x; i < values; i += blockDim.x) atomicAdd(&cs_hist[base[i]], 1u);
    const uint4* words = (const uint4*)(base + head);
    const i64 step = 2 * (i64)blockDim.x;
    for (i64 w0 = 0; w0 < nwords; w0 += step) {
        uint4 v[2];
        bool have[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const i64 w = w0 + threadIdx.x + (i64)u * blockDim.x;
            have[u] = w < nwords;
            if (have[u]) v[u] = __ldcs(words + w);
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (!have[u]) continue;
            const u32 q[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
            for (int i = 0; i < 16; i++) atomicAdd(&cs_hist[(q[i >> 2] >> (8 * (i & 3))) & 0xFFu], 1u);
        }
    }
    pending += values;
}

// `partials` holds CS_RESULT_WORDS int64 words per CTA. Block b of the pool is at pool + b *
// block_stride, laid out as FORMATS.md says for `fmt` with `row_elements` values a token and
// `block_size` tokens. Any block size works (loops stride by blockDim.x).
extern "C" __global__ void __launch_bounds__(CHECKSUM_THREADS, CS_CTAS) pagedkv_kv_checksum_partial(
    u64 pool, i64 block_stride, const int* __restrict__ blocks, int num_blocks,
    int fmt, int row_elements, int block_size, i64* __restrict__ partials)
{
    cs_init();
    const SideGeometry g = geometry(fmt, row_elements, block_size);
    const i64 values = (i64)row_elements * block_size;
    const i64 groups = values / GROUP;
    // the vector path needs 16-byte aligned blocks, whole chunks of CS_GROUPS groups and an
    // aligned scale section (8 scale bytes a load; turbo8's 16)
    const bool vector = ((pool | (u64)block_stride) & 15u) == 0 && groups % CS_GROUPS == 0 &&
                        (g.data_section & (fmt == FMT_TURBO8 ? 15 : 7)) == 0;
    i64 pending = 0;  // values binned since the last flush (uniform over the CTA)
    for (int k = blockIdx.x; k < num_blocks; k += gridDim.x) {
        const u8* base = (const u8*)(pool + (i64)blocks[k] * block_stride);
        if (pending + values > (i64)CS_FLUSH_AFTER) {
            cs_flush(fmt);
            pending = 0;
        }
        if (fmt == FMT_FP8) cs_fp8(base, values, pending);
        else if (!vector) cs_grouped_scalar(fmt, base, g.data_section, groups, pending);
        else if (fmt == FMT_TURBO8) cs_turbo8_vector(base, g.data_section, groups, pending);
        else if (fmt == FMT_TURBO3) cs_grouped_vector<3>(base, g.data_section, groups, pending, fmt);
        else if (fmt == FMT_TURBO2) cs_grouped_vector<2>(base, g.data_section, groups, pending, fmt);
        else cs_grouped_vector<4>(base, g.data_section, groups, pending, fmt);
    }
    cs_flush(fmt);
    i64* out = partials + (i64)CS_RESULT_WORDS * blockIdx.x;
    for (int j = threadIdx.x; j < CS_RESULT_WORDS; j += blockDim.x) out[j] = j < CS_FLAGS_AT ? cs_digits[j] : (i64)cs_flags;
}

// One CTA: adds `num_partials` partial results into `out`, thread j summing word j of every
// partial (their digits are < 2^32 but the signed top, so sums stay far inside int64).
extern "C" __global__ void __launch_bounds__(CHECKSUM_THREADS) pagedkv_kv_checksum_final(
    const i64* __restrict__ partials, int num_partials, i64* __restrict__ out)
{
    for (int j = threadIdx.x; j < CS_RESULT_WORDS; j += blockDim.x) {
        i64 acc = 0;
        for (int p = 0; p < num_partials; p++) {
            const i64 w = partials[(i64)CS_RESULT_WORDS * p + j];
            acc = j < CS_FLAGS_AT ? acc + w : (acc | w);
        }
        out[j] = acc;
    }
}
