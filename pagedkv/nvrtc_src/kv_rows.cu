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
// pagedkv_kv_write_layers writes the same tokens' rows of many layers in one launch (a
// prefill), each layer's geometry, pools and rows read from a device table of KvLayer.

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
#define MAX_ROTATED_DIM 512
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

__device__ void pack_codes(const u32* c, int bits, u8* out) {
    if (bits == 4) {
        for (int j = 0; j < 8; j++) out[j] = (u8)(c[2 * j] | (c[2 * j + 1] << 4));
    } else if (bits == 2) {
        for (int j = 0; j < 4; j++) out[j] = (u8)(c[4 * j] | (c[4 * j + 1] << 2) | (c[4 * j + 2] << 4) | (c[4 * j + 3] << 6));
    } else {
        for (int r = 0; r < 2; r++) {
            u32 word = 0;
            for (int k = 0; k < 8; k++) word |= c[8 * r + k] << (3 * k);
            for (int b = 0; b < 3; b++) out[3 * r + b] = (u8)((word >> (8 * b)) & 0xFFu);
        }
    }
}

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

// Encode group x of a grouped format: data bytes at `data`, scale bytes at `scale`.
__device__ void encode_group(int fmt, const float* x, u8* data, u8* scale) {
    float amax = 0.0f;
    for (int i = 0; i < GROUP; i++) { const float a = fabsf(x[i]); if (a > amax) amax = a; }
    if (fmt == FMT_TURBO8) {
        float s = amax / 448.0f;
        if (s < 1e-12f) s = 1e-12f;
        for (int i = 0; i < GROUP; i++) data[i] = (u8)e4m3_encode(x[i] / s);
        const u32 sb = bf16_encode(s);
        scale[0] = (u8)(sb & 0xFFu);
        scale[1] = (u8)(sb >> 8);
        return;
    }
    u32 codes[GROUP];
    if (fmt == FMT_NVFP4) {
        const u32 sb = e4m3_encode(amax / 6.0f);
        const float d = e4m3_decode(sb);
        for (int i = 0; i < GROUP; i++) {
            const u32 magnitude = d == 0.0f ? 0u : e2m1_magnitude(fabsf(x[i]) / d);
            codes[i] = magnitude | ((__float_as_uint(x[i]) >> 31) << 3);
        }
        scale[0] = (u8)sb;
        pack_codes(codes, 4, data);
        return;
    }
    const float* levels;
    const float* bounds;
    const int count = turbo_levels(fmt, &levels, &bounds);
    const bool tiny = amax <= 1e-12f;
    const float ratio = tiny ? 1.0f : levels[count - 1] / amax;
    float x_ssq = 0.0f, level_ssq = 0.0f;
    for (int i = 0; i < GROUP; i++) {
        const float u = tiny ? x[i] : x[i] * ratio;
        u32 c = 0;
        for (int b = 0; b < count - 1; b++) c += bounds[b] <= u;
        codes[i] = c;
        const float xx = x[i] * x[i];
        x_ssq = x_ssq + xx;
        const float ll = levels[c] * levels[c];
        level_ssq = level_ssq + ll;
    }
    float s = sqrtf(x_ssq) / sqrtf(level_ssq);
    if (s > 448.0f) s = 448.0f;
    scale[0] = (u8)e4m3_encode(s);
    pack_codes(codes, format_bits(fmt), data);
}

// Decode group of a grouped format into out[16].
__device__ void decode_group(int fmt, const u8* data, const u8* scale, float* out) {
    if (fmt == FMT_TURBO8) {
        const float s = bf16_decode((u32)scale[0] | ((u32)scale[1] << 8));
        for (int i = 0; i < GROUP; i++) out[i] = e4m3_decode(data[i]) * s;
        return;
    }
    u32 codes[GROUP];
    unpack_codes(data, format_bits(fmt), codes);
    const float d = e4m3_decode(scale[0]);
    if (fmt == FMT_NVFP4) {
        for (int i = 0; i < GROUP; i++) {
            const float m = E2M1_MAGNITUDES[codes[i] & 7u];
            out[i] = (codes[i] & 8u ? -m : m) * d;
        }
        return;
    }
    const float* levels;
    const float* bounds;
    turbo_levels(fmt, &levels, &bounds);
    for (int i = 0; i < GROUP; i++) out[i] = levels[codes[i]] * d;
}

// ---- rows ----------------------------------------------------------------------------------

__device__ __forceinline__ float load_value(u64 src, int bf16, i64 index) {
    if (bf16) return bf16_decode(((const u16*)src)[index]);
    return ((const float*)src)[index];
}

__device__ __forceinline__ void store_value(u64 dst, int bf16, i64 index, float x) {
    if (bf16) ((u16*)dst)[index] = (u16)bf16_encode(x);
    else ((float*)dst)[index] = x;
}

__device__ __forceinline__ float sign_at(int table, int d) {
    return (WHT_SIGNS[table + (d >> 5)] >> (d & 31)) & 1u ? -1.0f : 1.0f;
}

// buf[0..n) = ((H_n (first * buf)) * inv_sqrt_n) * last, by the CTA, `first` and `last`
// being WHT_SIGNS word offsets; ends after a barrier.
__device__ void rotate_shared(float* buf, int n, int first, int last, float inv_sqrt_n) {
    for (int d = threadIdx.x; d < n; d += blockDim.x) buf[d] = buf[d] * sign_at(first, d);
    __syncthreads();
    for (int h = 1; h < n; h <<= 1) {
        for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
            const int i = (p / h) * 2 * h + (p % h);
            const float a = buf[i], b = buf[i + h];
            buf[i] = a + b;
            buf[i + h] = a - b;
        }
        __syncthreads();
    }
    for (int d = threadIdx.x; d < n; d += blockDim.x) buf[d] = (buf[d] * inv_sqrt_n) * sign_at(last, d);
    __syncthreads();
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

__shared__ float kv_buf[MAX_ROTATED_DIM];

// Encode token `token`'s row of one side (format `fmt`, rows at `src` `row_stride` elements
// apart, BF16 when `bf16`) into `slot` of the pool at `pool`; by the CTA. The number of
// NaN/inf inputs this thread read.
__device__ u32 write_row(int fmt, u64 pool, i64 block_stride, u64 src, i64 row_stride, int bf16, float scale,
                         int first, int last, int heads, int head_dim, float inv_sqrt_n, int block_size,
                         i64 slot, int token) {
    const int n = heads * head_dim;
    u32 bad = 0;
    const i64 row = (i64)token * row_stride;
    const SideGeometry g = geometry(fmt, n, block_size);
    const i64 block = slot / block_size, offset = slot - block * block_size;
    u8* base = (u8*)(pool + block * block_stride);
    u8* data = base + offset * g.row_bytes;
    u8* scales = base + g.data_section + offset * g.scale_row_bytes;
    if (fmt == FMT_BF16 || fmt == FMT_FP8) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float x = load_value(src, bf16, row + i);
            bad += is_nonfinite(x);
            if (fmt == FMT_BF16) ((u16*)data)[i] = (u16)bf16_encode(x);
            else data[i] = (u8)e4m3_encode(x / scale);
        }
        return bad;
    }
    const int group_bytes = GROUP * format_bits(fmt) / 8, ssize = scale_size(fmt);
    if (first < 0) {
        for (int gi = threadIdx.x; gi < n / GROUP; gi += blockDim.x) {
            float x[GROUP];
            for (int i = 0; i < GROUP; i++) {
                x[i] = load_value(src, bf16, row + gi * GROUP + i);
                bad += is_nonfinite(x[i]);
            }
            encode_group(fmt, x, data + gi * group_bytes, scales + gi * ssize);
        }
        return bad;
    }
    for (int h = 0; h < heads; h++) {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            const float x = load_value(src, bf16, row + h * head_dim + d);
            bad += is_nonfinite(x);
            kv_buf[d] = x;
        }
        __syncthreads();
        rotate_shared(kv_buf, head_dim, first, last, inv_sqrt_n);
        for (int gi = threadIdx.x; gi < head_dim / GROUP; gi += blockDim.x) {
            const int group = h * (head_dim / GROUP) + gi;
            encode_group(fmt, kv_buf + gi * GROUP, data + group * group_bytes, scales + group * ssize);
        }
        __syncthreads();
    }
    return bad;
}

extern "C" __global__ void __launch_bounds__(KV_THREADS) pagedkv_kv_write(
    const i64* __restrict__ slots, int num_tokens, int heads, int head_dim, int block_size, i64 limit,
    float inv_sqrt_n, unsigned long long* nonfinite,
    int k_fmt, u64 k_pool, i64 k_block_stride, u64 k_src, i64 k_row_stride, int k_bf16, float k_scale,
    int k_first, int k_last,
    int v_fmt, u64 v_pool, i64 v_block_stride, u64 v_src, i64 v_row_stride, int v_bf16, float v_scale,
    int v_first, int v_last)
{
    const i64 items = 2 * (i64)num_tokens;
    u32 bad = 0;
    for (i64 item = blockIdx.x; item < items; item += gridDim.x) {
        const int token = (int)(item >> 1), side = (int)(item & 1);
        const int fmt = side ? v_fmt : k_fmt;
        const i64 slot = slots[token];
        if (fmt < 0 || slot < 0 || slot >= limit) continue;
        bad += side ? write_row(fmt, v_pool, v_block_stride, v_src, v_row_stride, v_bf16, v_scale, v_first, v_last,
                                heads, head_dim, inv_sqrt_n, block_size, slot, token)
                    : write_row(fmt, k_pool, k_block_stride, k_src, k_row_stride, k_bf16, k_scale, k_first, k_last,
                                heads, head_dim, inv_sqrt_n, block_size, slot, token);
    }
    if (bad && nonfinite) atomicAdd(nonfinite, (unsigned long long)bad);
}

// One side of one layer of pagedkv_kv_write_layers (KvLayerSide in driver/kv_kernels.py).
struct KvLayerSide {
    u64 pool;
    i64 block_stride;
    u64 rows;
    i64 row_stride;
    int fmt, bf16;
    float scale;
    int first, last, pad;
};

// One layer of pagedkv_kv_write_layers (KvLayer in driver/kv_kernels.py).
struct KvLayer {
    int heads, head_dim;
    float inv_sqrt_n;
    int pad;
    KvLayerSide side[2];
};

// The same tokens' rows of `num_layers` layers (a prefill) in one launch: item
// (layer, token, side) as pagedkv_kv_write does for one layer, with each layer's
// geometry, pools and rows read from the device table `layers`.
extern "C" __global__ void __launch_bounds__(KV_THREADS) pagedkv_kv_write_layers(
    const KvLayer* __restrict__ layers, int num_layers, const i64* __restrict__ slots, int num_tokens,
    int block_size, i64 limit, unsigned long long* nonfinite)
{
    const i64 per_layer = 2 * (i64)num_tokens, items = per_layer * num_layers;
    u32 bad = 0;
    for (i64 item = blockIdx.x; item < items; item += gridDim.x) {
        const int layer = (int)(item / per_layer);
        const i64 rest = item - layer * per_layer;
        const int token = (int)(rest >> 1), side = (int)(rest & 1);
        const KvLayer& L = layers[layer];
        const KvLayerSide& S = L.side[side];
        const i64 slot = slots[token];
        if (S.fmt < 0 || slot < 0 || slot >= limit) continue;
        bad += write_row(S.fmt, S.pool, S.block_stride, S.rows, S.row_stride, S.bf16, S.scale, S.first, S.last,
                         L.heads, L.head_dim, L.inv_sqrt_n, block_size, slot, token);
    }
    if (bad && nonfinite) atomicAdd(nonfinite, (unsigned long long)bad);
}

extern "C" __global__ void __launch_bounds__(KV_THREADS) pagedkv_kv_read(
    const i64* __restrict__ slots, int num_tokens, int heads, int head_dim, int block_size, i64 limit,
    float inv_sqrt_n,
    int k_fmt, u64 k_pool, i64 k_block_stride, u64 k_out, i64 k_row_stride, int k_bf16, float k_scale,
    int k_first, int k_last,
    int v_fmt, u64 v_pool, i64 v_block_stride, u64 v_out, i64 v_row_stride, int v_bf16, float v_scale,
    int v_first, int v_last)
{
    const int n = heads * head_dim;
    const i64 items = 2 * (i64)num_tokens;
    for (i64 item = blockIdx.x; item < items; item += gridDim.x) {
        const int token = (int)(item >> 1), side = (int)(item & 1);
        const int fmt = side ? v_fmt : k_fmt;
        if (fmt < 0) continue;
        const i64 slot = slots[token];
        const u64 out = side ? v_out : k_out;
        const int bf16 = side ? v_bf16 : k_bf16;
        const i64 row = (i64)token * (side ? v_row_stride : k_row_stride);
        if (slot < 0 || slot >= limit) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) store_value(out, bf16, row + i, 0.0f);
            continue;
        }
        const int first = side ? v_first : k_first;
        const int last = side ? v_last : k_last;
        const SideGeometry g = geometry(fmt, n, block_size);
        const i64 block = slot / block_size, offset = slot - block * block_size;
        const u8* base = (const u8*)((side ? v_pool : k_pool) + block * (side ? v_block_stride : k_block_stride));
        const u8* data = base + offset * g.row_bytes;
        const u8* scales = base + g.data_section + offset * g.scale_row_bytes;
        if (fmt == FMT_BF16 || fmt == FMT_FP8) {
            const float scale = side ? v_scale : k_scale;
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const float x = fmt == FMT_BF16 ? bf16_decode(((const u16*)data)[i]) : e4m3_decode(data[i]) * scale;
                store_value(out, bf16, row + i, x);
            }
            continue;
        }
        const int group_bytes = GROUP * format_bits(fmt) / 8, ssize = scale_size(fmt);
        if (first < 0) {
            for (int gi = threadIdx.x; gi < n / GROUP; gi += blockDim.x) {
                float x[GROUP];
                decode_group(fmt, data + gi * group_bytes, scales + gi * ssize, x);
                for (int i = 0; i < GROUP; i++) store_value(out, bf16, row + gi * GROUP + i, x[i]);
            }
            continue;
        }
        for (int h = 0; h < heads; h++) {
            for (int gi = threadIdx.x; gi < head_dim / GROUP; gi += blockDim.x) {
                const int group = h * (head_dim / GROUP) + gi;
                decode_group(fmt, data + group * group_bytes, scales + group * ssize, kv_buf + gi * GROUP);
            }
            __syncthreads();
            rotate_shared(kv_buf, head_dim, first, last, inv_sqrt_n);
            for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
                store_value(out, bf16, row + h * head_dim + d, kv_buf[d]);
            __syncthreads();
        }
    }
}

// ---- exact checksums of stored values (pagedkv_kv_checksum_partial / _final) --------------
//
// Sum, sum of |x| and sum of squares of every stored value of the listed blocks of one pool,
// decoded by the read path's decoders above without unrotation (fp8 as its E4M3 values,
// without the per-tensor scale). Decoded values are float32: each finite one is
// m * 2^(s - 149) (m < 2^24, 0 <= s <= 253), so each thread adds integers in units 2^-149
// (values) and 2^-298 (squares) into carry-save accumulators of 32-bit digits held in int64
// words; integer addition is exact and associative, so every grid, CTA order and thread count
// gives the same words, which pagedkv/exact_sum.py (stats_from_f32_words) rounds once to
// float64. Non-finite values only set flag bits. Pass 1: each CTA writes CS_RESULT_WORDS
// words; pass 2: one CTA adds the partials. CHECKSUM_THREADS, F32_SUM_DIGITS and
// F32_SSQ_DIGITS come from Python as -D options (pagedkv.driver.nvrtc.source_defines).

#if !defined(CHECKSUM_THREADS) || !defined(F32_SUM_DIGITS) || !defined(F32_SSQ_DIGITS)
#error "compile with -DCHECKSUM_THREADS=... -DF32_SUM_DIGITS=... -DF32_SSQ_DIGITS=... (pagedkv.driver.nvrtc.source_defines)"
#endif

#define CS_SUM_AT 0
#define CS_SABS_AT F32_SUM_DIGITS
#define CS_SSQ_AT (2 * F32_SUM_DIGITS)
#define CS_FLAGS_AT (2 * F32_SUM_DIGITS + F32_SSQ_DIGITS)
#define CS_RESULT_WORDS (CS_FLAGS_AT + 1)
#define CS_NORMALIZE_EVERY (1 << 29)  // each add puts < 2^33 into a digit: 2^29 adds cannot overflow
#define CS_WORDS_PER_ROUND 19         // words of the shared tree per round: CS_RESULT_WORDS (37) in two

#define CS_FLAG_NAN 1u
#define CS_FLAG_POS_INF 2u
#define CS_FLAG_NEG_INF 4u

struct ExactAcc {
    i64 d[CS_FLAGS_AT];
    u32 flags;
    u32 pending;  // values added since the last normalize
};

__device__ __forceinline__ void exact_init(ExactAcc& a) {
#pragma unroll
    for (int i = 0; i < CS_FLAGS_AT; i++) a.d[i] = 0;
    a.flags = 0;
    a.pending = 0;
}

// Propagate the carries of digits d[0, n): every digit but the top ends in [0, 2^32).
__device__ __forceinline__ void exact_carry(i64* d, int n) {
    for (int i = 0; i + 1 < n; i++) {
        const i64 c = d[i] >> 32;  // arithmetic shift: floor division by 2^32
        d[i] -= c * 4294967296LL;
        d[i + 1] += c;
    }
}

__device__ __forceinline__ void exact_normalize(ExactAcc& a) {
    exact_carry(a.d + CS_SUM_AT, F32_SUM_DIGITS);
    exact_carry(a.d + CS_SABS_AT, F32_SUM_DIGITS);
    exact_carry(a.d + CS_SSQ_AT, F32_SSQ_DIGITS);
    a.pending = 0;
}

__device__ __forceinline__ void exact_add(ExactAcc& a, float x) {
    const u32 bits = __float_as_uint(x);
    const u32 e = (bits >> 23) & 0xFFu;
    const u32 f = bits & 0x7FFFFFu;
    if (e == 0xFFu) {
        a.flags |= f ? CS_FLAG_NAN : ((bits >> 31) ? CS_FLAG_NEG_INF : CS_FLAG_POS_INF);
        return;
    }
    const u32 m = e ? (f | 0x800000u) : f;
    if (m == 0) return;
    const u32 s = e ? e - 1 : 0;
    const u64 v = (u64)m << (s & 31);  // < 2^55
    const int dv = (int)(s >> 5);
    const i64 lo = (i64)(v & 0xFFFFFFFFull), hi = (i64)(v >> 32);
    if (bits >> 31) {
        a.d[CS_SUM_AT + dv] -= lo;
        a.d[CS_SUM_AT + dv + 1] -= hi;
    } else {
        a.d[CS_SUM_AT + dv] += lo;
        a.d[CS_SUM_AT + dv + 1] += hi;
    }
    a.d[CS_SABS_AT + dv] += lo;
    a.d[CS_SABS_AT + dv + 1] += hi;
    const u64 mm = (u64)m * m;  // < 2^48
    const u32 r = (2 * s) & 31;
    const int dq = (int)((2 * s) >> 5);
    const u64 q_lo = (mm & 0xFFFFFFFFull) << r;  // < 2^63
    const u64 q_hi = (mm >> 32) << r;            // < 2^47
    a.d[CS_SSQ_AT + dq] += (i64)(q_lo & 0xFFFFFFFFull);
    a.d[CS_SSQ_AT + dq + 1] += (i64)(q_lo >> 32) + (i64)(q_hi & 0xFFFFFFFFull);
    a.d[CS_SSQ_AT + dq + 2] += (i64)(q_hi >> 32);
    if (++a.pending == CS_NORMALIZE_EVERY) exact_normalize(a);
}

// Sum every thread's words over the CTA (flags OR-ed); thread 0 writes them to `out`. The
// caller normalised each thread's digits (< 2^32 but the signed top), so the CTA's sums stay
// far inside int64.
__device__ void exact_cta_write(const ExactAcc& a, i64* __restrict__ out) {
    __shared__ i64 cs_sh[CS_WORDS_PER_ROUND][CHECKSUM_THREADS];
    for (int first = 0; first < CS_RESULT_WORDS; first += CS_WORDS_PER_ROUND) {
#pragma unroll
        for (int j = 0; j < CS_WORDS_PER_ROUND; j++)
            cs_sh[j][threadIdx.x] = first + j < CS_FLAGS_AT ? a.d[first + j] : (i64)a.flags;
        __syncthreads();
        for (int half = CHECKSUM_THREADS / 2; half > 0; half >>= 1) {
            if (threadIdx.x < half) {
#pragma unroll
                for (int j = 0; j < CS_WORDS_PER_ROUND; j++) {
                    if (first + j < CS_FLAGS_AT) cs_sh[j][threadIdx.x] += cs_sh[j][threadIdx.x + half];
                    else cs_sh[j][threadIdx.x] |= cs_sh[j][threadIdx.x + half];
                }
            }
            __syncthreads();
        }
        if (threadIdx.x == 0)
            for (int j = 0; j < CS_WORDS_PER_ROUND && first + j < CS_RESULT_WORDS; j++) out[first + j] = cs_sh[j][0];
        __syncthreads();
    }
}

// Launch with CHECKSUM_THREADS threads; `partials` holds CS_RESULT_WORDS int64 words per CTA.
// Block b of the pool is at pool + b * block_stride, laid out as FORMATS.md says for `fmt`
// with `row_elements` values a token and `block_size` tokens; a BF16 pool is 2-byte aligned
// (checked in Python).
extern "C" __global__ void __launch_bounds__(CHECKSUM_THREADS) pagedkv_kv_checksum_partial(
    u64 pool, i64 block_stride, const int* __restrict__ blocks, int num_blocks,
    int fmt, int row_elements, int block_size, i64* __restrict__ partials)
{
    if (blockDim.x != CHECKSUM_THREADS) __trap();
    ExactAcc a;
    exact_init(a);
    const SideGeometry g = geometry(fmt, row_elements, block_size);
    const i64 values = (i64)row_elements * block_size;
    const i64 groups = values / GROUP;
    const int group_bytes = GROUP * format_bits(fmt) / 8, ssize = scale_size(fmt);
    for (int k = blockIdx.x; k < num_blocks; k += gridDim.x) {
        const u8* base = (const u8*)(pool + (i64)blocks[k] * block_stride);
        if (fmt == FMT_BF16) {
            for (i64 i = threadIdx.x; i < values; i += CHECKSUM_THREADS) exact_add(a, bf16_decode(((const u16*)base)[i]));
        } else if (fmt == FMT_FP8) {
            for (i64 i = threadIdx.x; i < values; i += CHECKSUM_THREADS) exact_add(a, e4m3_decode(base[i]));
        } else {
            // group G of the block: data rows are contiguous, so its bytes are at G * group_bytes
            // and its scale at data_section + G * ssize, whatever token it belongs to
            for (i64 gi = threadIdx.x; gi < groups; gi += CHECKSUM_THREADS) {
                float x[GROUP];
                decode_group(fmt, base + gi * group_bytes, base + g.data_section + gi * ssize, x);
                for (int i = 0; i < GROUP; i++) exact_add(a, x[i]);
            }
        }
    }
    exact_normalize(a);
    exact_cta_write(a, partials + (i64)CS_RESULT_WORDS * blockIdx.x);
}

// Launch one CTA of CHECKSUM_THREADS threads: adds `num_partials` partial results into `out`.
extern "C" __global__ void __launch_bounds__(CHECKSUM_THREADS) pagedkv_kv_checksum_final(
    const i64* __restrict__ partials, int num_partials, i64* __restrict__ out)
{
    if (blockDim.x != CHECKSUM_THREADS) __trap();
    ExactAcc a;
    exact_init(a);
    for (int p = threadIdx.x; p < num_partials; p += CHECKSUM_THREADS) {
        const i64* part = partials + (i64)CS_RESULT_WORDS * p;
        for (int j = 0; j < CS_FLAGS_AT; j++) a.d[j] += part[j];
        a.flags |= (u32)part[CS_FLAGS_AT];
        exact_normalize(a);  // a partial's digits are < 2^41: normalising after each keeps a far from overflow
    }
    exact_cta_write(a, out);
}
