// GEMMs on weights kept in a GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
// or in MXFP4 (gpt-oss's experts: 4-bit codes through a table), as llama.cpp does them:
// out[M, N] = x[M, K] @ w[N, K]^T (+ bias), with each row of x quantized per block of 32 to int8
// and one fp32 scale, and each block's product an exact integer dot product.
//
// The arithmetic (kernels/quant.py's reference_gemm writes the same in torch): per output element,
// the blocks in order from k = 0; per scale group (32 elements, 16 for Q6_K) the integer
// i = sum (u - offset) * q, then
//     acc = acc + (scale * dx) * float(i);   acc = acc + min * sx     (Q4_1, Q5_1, Q4_K, Q5_K)
// with sx = dx * float(sum of the block's q); then acc + bias rounded once. The integer part is
// exact at every level (VNNI vpdpbusd, AVX2 vpmaddubsw, plain C++) and the fp32 operations are
// the same ones in the same order, so every level gives the same bits as the reference, whatever
// M is and whichever rows share the call.
//
// Weights are packed at load (quant.py pack_weight): per group of 16 output columns and block of
// 32 elements, the quants as one vpdpbusd step reads them (64 bytes: 16 columns x 4 elements;
// eight steps a block, 4-bit formats holding step j in the low nibbles and j + 4 in the high
// ones; the 5-bit formats take a byte an element, as Q8_0 and Q6_K), then fp32 scales [groups
// in the block][16], then fp32 mins [16]; the K types keep the file's scale codes and one d (and
// dmin) per super-block instead (Traits::compact).
//
// Measured on a 2-core Zen 5 EPYC (benchmarks/quant/gemm_shapes.py, dot_peak.cpp), SmolLM2's
// shapes against the bf16 GEMM at the same level: a lone row 1.2-2.7x (fewer bytes to stream);
// 64 rows 1.15-1.36x on Q4_1 and 1.29-1.44x on Q8_0, one thread. At many rows the fp32 fold of
// each block's integer (and Q4_1's min term) is the cost: its multiplies share the pipes with
// vpdpbusd. Q4_1 runs at 273-283 GMAC/s a core, 330 without the min term, 390 without the fold
// (vpdpbusd's peak: ~460); fused multiply-adds measured no faster (the same pipes). Restructuring
// the register blocks (weights step by step against R x C chains) measured the same too.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>
#include <vector>

#include "bf16.h"
#include "isa.h"

#define NS_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16")))
#define NS_QAVX2 __attribute__((target("avx2,fma")))

namespace {

constexpr int kCols = 16;
constexpr int kBlock = 32;
constexpr int64_t kParallelMacs = int64_t(1) << 22;
constexpr int64_t kParallelWeights = int64_t(1) << 18;
constexpr int64_t kRowChunk = 64;
constexpr int64_t kParallelQuantize = int64_t(1) << 13;  // elements of x quantized by all threads
constexpr int64_t kWeightGroupBytes = int64_t(1) << 20;
constexpr int64_t kExpandRows = 8;  // rows from which a planes packing is expanded for the byte kernels

// Format codes: the order of gguf_formats.py's FORMATS (new ones appended; kFormats counts them).
enum Format : int {
    kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ6_K = 4, kQ5_0 = 5, kQ5_1 = 6, kQ5_K = 7,
    kF8_E4M3 = 8,  // FP8 weights: gemm_fp8.cpp (no integer kernels)
    kMxfp4 = 9,    // MXFP4: 4-bit E2M1 codes, u = kMxfp4Table[code] (12 + 2 x the value)
    kQ5_KPlanes = 10, kQ6_KPlanes = 11,  // Q5_K / Q6_K in nibbles and bit planes (AVX2, portable)
    kFormats = 12
};

// MXFP4's codes as the integers the dot products take: 12 + 2 x E2M1 (0, .5, 1, 1.5, 2, 3, 4, 6,
// then their negatives), so weight = scale x (u - 12) with scale 2^(exponent - 128) exactly.
// quant.py's MXFP4_U is the same table. One vpshufb (a 16-byte table per 128-bit lane) decodes
// a register of codes.
constexpr uint8_t kMxfp4Table[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// The planes formats (kQ5_KPlanes, kQ6_KPlanes) are Q5_K and Q6_K with each element's low four
// bits as the 4-bit formats' nibbles (256 bytes a block) and its high bits in planes after them:
// byte lane i (16 columns x 4 elements of a step) of a one-bit plane holds step s's fifth bit in
// bit s; Q6_K's two planes hold steps 0-3 and 4-7, step s's two high bits in bits 2 (s % 4) and
// 2 (s % 4) + 1. 5.75 and 6.6 bits a weight where a byte an element is 8.75 and 8.6.
template <int F>
struct Traits {
    static constexpr int base = F == kQ5_KPlanes ? kQ5_K : F == kQ6_KPlanes ? kQ6_K : F;  // the GGUF type
    static constexpr int plane_bits = F == kQ5_KPlanes ? 1 : F == kQ6_KPlanes ? 2 : 0;
    static constexpr bool nibbles = F == kQ4_0 || F == kQ4_1 || F == kQ4_K || F == kMxfp4;
    static constexpr bool table = F == kMxfp4;  // codes decoded through kMxfp4Table
    static constexpr int group = base == kQ6_K ? 16 : 32;  // elements per scale
    static constexpr int offset = F == kQ8_0 ? 128 : F == kQ4_0 ? 8 : F == kQ5_0 ? 16 : base == kQ6_K ? 32
                                  : F == kMxfp4 ? 12 : 0;
    static constexpr bool has_min = F == kQ4_1 || F == kQ4_K || F == kQ5_1 || base == kQ5_K;
    static constexpr bool super_blocks = F == kQ4_K || base == kQ5_K || base == kQ6_K;  // K a multiple of 256
    static constexpr int quant_bytes = nibbles ? 256 : plane_bits ? 256 + 64 * plane_bits : 512;
    static constexpr int scale_bytes = 4 * kCols * (kBlock / group);
    // The K types keep their scales as the file does (compact): per block, each scale group's
    // 6-bit (Q6_K: int8) code and the 6-bit min code, a byte a column; per super-block of 8 blocks,
    // fp32 d and dmin a column. The kernels form scale = d * code and min = -(dmin * code), the
    // fp32 operations quant.py's dequantization does, so the products keep their bits; the packing
    // is 4.75 bits a weight for Q4_K (6 with fp32 scales and mins a block), 8.6 for Q6_K (10).
    // Layout of a super-block: [8 x quants][8 x kGroups x 16 scale codes][8 x 16 min codes]
    // [16 d][16 dmin].
    static constexpr bool compact = super_blocks;
    static constexpr int code_bytes = kCols * (kBlock / group);  // a block's scale codes
    static constexpr int min_codes_at = 8 * quant_bytes + 8 * code_bytes;
    static constexpr int d_at = min_codes_at + (has_min ? 8 * kCols : 0);
    static constexpr int dmin_at = d_at + 4 * kCols;
    static constexpr int super_bytes = dmin_at + (has_min ? 4 * kCols : 0);
    static constexpr int bytes = compact ? super_bytes / 8 : quant_bytes + scale_bytes + (has_min ? 4 * kCols : 0);
    static_assert(!compact || super_bytes % 8 == 0, "a super-block is 8 blocks' bytes");
};

// Where block b's quants start in a group of 16 columns' packing.
template <int F>
inline const uint8_t* quants_at(const uint8_t* group, int64_t b) {
    using T = Traits<F>;
    if constexpr (T::compact) return group + (b / 8) * T::super_bytes + (b % 8) * T::quant_bytes;
    return group + b * T::bytes;
}

// A compact format's codes of block b: its scale group g's (16 columns) or its mins'.
template <int F>
inline const uint8_t* scale_codes_at(const uint8_t* group, int64_t b, int g) {
    using T = Traits<F>;
    return group + (b / 8) * T::super_bytes + 8 * T::quant_bytes + ((b % 8) * (kBlock / T::group) + g) * kCols;
}

template <int F>
inline const uint8_t* min_codes_at(const uint8_t* group, int64_t b) {
    using T = Traits<F>;
    return group + (b / 8) * T::super_bytes + T::min_codes_at + (b % 8) * kCols;
}

template <int F>
inline const float* super_floats(const uint8_t* group, int64_t b, int at) {  // d (at = d_at) or dmin
    return reinterpret_cast<const float*>(group + (b / 8) * Traits<F>::super_bytes + at);
}

// Block b's fp32 scales of group g (or mins), column col, as the portable level reads them.
template <int F>
inline float scale_of(const uint8_t* group, int64_t b, int g, int col) {
    using T = Traits<F>;
    if constexpr (T::compact) {
        const uint8_t code = scale_codes_at<F>(group, b, g)[col];
        const float value = T::base == kQ6_K ? static_cast<float>(static_cast<int8_t>(code)) : static_cast<float>(code);
        return super_floats<F>(group, b, T::d_at)[col] * value;
    }
    float scale;
    std::memcpy(&scale, group + b * T::bytes + T::quant_bytes + 4 * (g * kCols + col), sizeof(scale));
    return scale;
}

template <int F>
inline float min_of(const uint8_t* group, int64_t b, int col) {
    using T = Traits<F>;
    if constexpr (T::compact)
        return -(super_floats<F>(group, b, T::dmin_at)[col] * static_cast<float>(min_codes_at<F>(group, b)[col]));
    float value;
    std::memcpy(&value, group + b * T::bytes + T::quant_bytes + T::scale_bytes + 4 * col, sizeof(value));
    return value;
}

// The activations, quantized once per call: per row and block of 32, int8 q, dx, sx and the
// offset corrections offset * (sum of q) of each scale group (two per block: halves for Q6_K, the
// whole block then zero for the others).
struct Activations {
    int8_t* q;
    float* dx;
    float* sx;
    int32_t* corr;
    int64_t k;   // q's row stride
    int64_t nb;  // blocks a row
};

// One register block: R rows against C groups of 16 columns.
struct Block {
    float* sums;  // [R][C * 16]
    const Activations* a;
    int64_t row;
    const uint8_t* w;  // first group's packed blocks
    int64_t group_stride;
};

inline float load_x(const void* x, int dtype, int64_t index) {
    return dtype == 1 ? ns_bf16::to_float(static_cast<const uint16_t*>(x)[index]) : static_cast<const float*>(x)[index];
}

// A block's 32 values of x as fp32 (exact for bf16).
NS_VNNI inline void load_block_avx512(const void* x, int dtype, int64_t at, __m512& v0, __m512& v1) {
    if (dtype == 1) {
        const auto* p = static_cast<const uint16_t*>(x) + at;
        v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
        v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))), 16));
    } else {
        v0 = _mm512_loadu_ps(static_cast<const float*>(x) + at);
        v1 = _mm512_loadu_ps(static_cast<const float*>(x) + at + 16);
    }
}

// Every lane the maximum (the sum) of v's 16: four in-register swaps, no trip through memory.
NS_VNNI inline __m512 all_lanes_max(__m512 v) {
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_max_ps(v, _mm512_permute_ps(v, 0x4E));
    return _mm512_max_ps(v, _mm512_permute_ps(v, 0xB1));
}

NS_VNNI inline __m512i all_lanes_sum(__m512i v) {
    v = _mm512_add_epi32(v, _mm512_shuffle_i32x4(v, v, 0x4E));
    v = _mm512_add_epi32(v, _mm512_shuffle_i32x4(v, v, 0xB1));
    v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, static_cast<_MM_PERM_ENUM>(0x4E)));
    return _mm512_add_epi32(v, _mm512_shuffle_epi32(v, static_cast<_MM_PERM_ENUM>(0xB1)));
}

// quantize_row's arithmetic on AVX-512 (vcvtps2dq rounds to nearest even, as nearbyint does; vdivps
// rounds as the scalar division). Two passes over a row's blocks, 16 at a time: each block's
// amax into lane i of one register; d = amax / 127 and 1 / d for the 16 in two vector divisions
// (a scalar division a block was a third of the time); then q and its sums, lane i of dx, sx and
// the sums gathered in registers and stored once. Nothing is stored and read back: a vector load
// of 16 scalar stores (or a scalar load of a vector store) waits for the stores to retire, and
// those waits were two thirds of this function's time on a Zen 4 EPYC.
NS_VNNI void quantize_row_avx512(const void* x, int dtype, int64_t row, int64_t ldx, int64_t k, int offset, bool halves,
                                 int8_t* q, float* dx, float* sx, int32_t* corr) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    const int64_t nb = k / kBlock;
    for (int64_t first = 0; first < nb; first += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, nb - first));
        const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
        __m512 m = _mm512_setzero_ps();
        for (int i = 0; i < n; ++i) {
            __m512 v0, v1;
            load_block_avx512(x, dtype, row * ldx + (first + i) * kBlock, v0, v1);
            const __m512 block_max = all_lanes_max(_mm512_max_ps(_mm512_and_ps(v0, magnitude), _mm512_and_ps(v1, magnitude)));
            m = _mm512_mask_mov_ps(m, static_cast<__mmask16>(1u << i), block_max);
        }
        const __m512 d = _mm512_div_ps(m, _mm512_set1_ps(127.0f));
        const __mmask16 nonzero = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0x1p-100f), _CMP_GE_OQ);
        const __m512 inverse = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0f), d);
        __m512i sums0 = _mm512_setzero_si512(), sums1 = _mm512_setzero_si512();
        for (int i = 0; i < n; ++i) {
            const int64_t b = first + i;
            __m512 v0, v1;
            load_block_avx512(x, dtype, row * ldx + b * kBlock, v0, v1);
            const __m512 scale = _mm512_permutexvar_ps(_mm512_set1_epi32(i), inverse);
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, scale));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, scale));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtepi32_epi8(q1));
            const __mmask16 lane = static_cast<__mmask16>(1u << i);
            if (halves) {
                sums0 = _mm512_mask_mov_epi32(sums0, lane, all_lanes_sum(q0));
                sums1 = _mm512_mask_mov_epi32(sums1, lane, all_lanes_sum(q1));
            } else {
                sums0 = _mm512_mask_mov_epi32(sums0, lane, all_lanes_sum(_mm512_add_epi32(q0, q1)));
            }
        }
        _mm512_mask_storeu_ps(dx + first, lanes, d);
        _mm512_mask_storeu_ps(sx + first, lanes, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(sums0, sums1))));
        // corr[2 b] = offset * sum0, corr[2 b + 1] = offset * sum1 (0 unless halves), interleaved.
        const __m512i c0 = _mm512_mullo_epi32(sums0, _mm512_set1_epi32(offset));
        const __m512i c1 = _mm512_mullo_epi32(sums1, _mm512_set1_epi32(offset));
        const __m512i low = _mm512_permutex2var_epi32(c0, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), c1);
        const __m512i high = _mm512_permutex2var_epi32(c0, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31), c1);
        const uint64_t all = (uint64_t(1) << (2 * n)) - 1;  // 2 n lanes of corr (n <= 16)
        _mm512_mask_storeu_epi32(corr + 2 * first, static_cast<__mmask16>(all & 0xFFFF), low);
        _mm512_mask_storeu_epi32(corr + 2 * first + 16, static_cast<__mmask16>((all >> 16) & 0xFFFF), high);
    }
}

NS_QAVX2 inline int32_t hsum8_avx2(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
    return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 1)));
}

// The same on AVX2 (vcvtps2dq rounds to nearest even too).
NS_QAVX2 void quantize_row_avx2(const void* x, int dtype, int64_t row, int64_t ldx, int64_t k, int offset, bool halves,
                                int8_t* q, float* dx, float* sx, int32_t* corr) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < k / kBlock; ++b) {
        __m256 v[4];
        const int64_t at = row * ldx + b * kBlock;
        for (int i = 0; i < 4; ++i) {
            v[i] = dtype == 1 ? ns_bf16::to_float_x8(static_cast<const uint16_t*>(x) + at + 8 * i)
                              : _mm256_loadu_ps(static_cast<const float*>(x) + at + 8 * i);
        }
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.0f;
        const __m256 inverse = _mm256_set1_ps(amax >= 0x1p-100f ? 1.0f / d : 0.0f);
        __m256i values[4];
        for (int i = 0; i < 4; ++i) values[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
        // |values| <= 127: the saturating packs are exact; they interleave 4-element pieces per
        // 128-bit lane, which one permute puts back in order.
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(values[0], values[1]), _mm256_packs_epi32(values[2], values[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const int32_t sum[2] = {hsum8_avx2(_mm256_add_epi32(values[0], values[1])),
                                hsum8_avx2(_mm256_add_epi32(values[2], values[3]))};
        dx[b] = d;
        sx[b] = d * static_cast<float>(sum[0] + sum[1]);
        corr[2 * b] = offset * (halves ? sum[0] : sum[0] + sum[1]);
        corr[2 * b + 1] = halves ? offset * sum[1] : 0;
    }
}

// dx = amax / 127, q = nearest-even(x * (1 / dx)), as quant.py's quantize_activations.
void quantize_row(const void* x, int dtype, int64_t row, int64_t ldx, int64_t k, int offset, bool halves,
                  int8_t* q, float* dx, float* sx, int32_t* corr) {
    for (int64_t b = 0; b < k / kBlock; ++b) {
        float v[kBlock];
        float amax = 0.0f;
        for (int i = 0; i < kBlock; ++i) {
            v[i] = load_x(x, dtype, row * ldx + b * kBlock + i);
            amax = std::max(amax, std::fabs(v[i]));
        }
        const float d = amax / 127.0f;
        const float inverse = amax >= 0x1p-100f ? 1.0f / d : 0.0f;
        int32_t sum[2] = {0, 0};
        for (int i = 0; i < kBlock; ++i) {
            const int32_t value = static_cast<int32_t>(std::nearbyint(v[i] * inverse));
            q[b * kBlock + i] = static_cast<int8_t>(value);
            sum[i / 16] += value;
        }
        dx[b] = d;
        sx[b] = d * static_cast<float>(sum[0] + sum[1]);
        corr[2 * b] = offset * (halves ? sum[0] : sum[0] + sum[1]);
        corr[2 * b + 1] = halves ? offset * sum[1] : 0;
    }
}

// ---- AVX-512 VNNI (the avx512bf16 and amx levels) --------------------------------------------

template <int F, int C>
NS_VNNI inline void load_weights(__m512i (&w)[C][8], const uint8_t* base, int64_t stride, int64_t b) {
    for (int c = 0; c < C; ++c) {
        const uint8_t* p = quants_at<F>(base + c * stride, b);
        if constexpr (Traits<F>::nibbles) {
            const __m512i low = _mm512_set1_epi8(0x0F);
            for (int j = 0; j < 4; ++j) {
                const __m512i v = _mm512_loadu_si512(p + 64 * j);
                w[c][j] = _mm512_and_si512(v, low);
                w[c][j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            if constexpr (Traits<F>::table) {
                const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Table)));
                for (int j = 0; j < 8; ++j) w[c][j] = _mm512_shuffle_epi8(table, w[c][j]);
            }
        } else {
            for (int j = 0; j < 8; ++j) w[c][j] = _mm512_loadu_si512(p + 64 * j);
        }
    }
}

// Block b's 16 fp32 scales of group g (or its mins) for one group of columns.
template <int F>
NS_VNNI inline __m512 scales_avx512(const uint8_t* group, int64_t b, int g) {
    using T = Traits<F>;
    if constexpr (T::compact) {
        const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scale_codes_at<F>(group, b, g)));
        const __m512i ints = F == kQ6_K ? _mm512_cvtepi8_epi32(codes) : _mm512_cvtepu8_epi32(codes);
        return _mm512_mul_ps(_mm512_loadu_ps(super_floats<F>(group, b, T::d_at)), _mm512_cvtepi32_ps(ints));
    }
    return _mm512_loadu_ps(reinterpret_cast<const float*>(group + b * T::bytes + T::quant_bytes) + g * kCols);
}

template <int F>
NS_VNNI inline __m512 mins_avx512(const uint8_t* group, int64_t b) {
    using T = Traits<F>;
    if constexpr (T::compact) {
        const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(min_codes_at<F>(group, b)));
        const __m512 product = _mm512_mul_ps(_mm512_loadu_ps(super_floats<F>(group, b, T::dmin_at)),
                                             _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)));
        return _mm512_xor_ps(product, _mm512_set1_ps(-0.0f));  // -(dmin * code), exactly
    }
    return _mm512_loadu_ps(reinterpret_cast<const float*>(group + b * T::bytes + T::quant_bytes + T::scale_bytes));
}

template <int F, int R, int C>
NS_VNNI void block_vnni(const Block& blk) {
    using T = Traits<F>;
    const Activations& a = *blk.a;
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    constexpr int kGroups = kBlock / T::group;
    for (int64_t b = 0; b < a.nb; ++b) {
        // A lone row's Q4_K / Q5_K weights: the hardware prefetchers fall behind the compact
        // blocks' decoding from memory (15 GB/s of ~25 on an Intel Xeon, 2 threads); the next
        // 16 blocks' bytes asked for ahead, one line at a time (measured: 1.3-1.6x; the other
        // formats, and Q6_K's larger blocks, no faster or slower with it).
        if constexpr (R == 1 && T::compact && F != kQ6_K) {
            for (int c = 0; c < C; ++c) {
                const char* ahead = reinterpret_cast<const char*>(blk.w + c * blk.group_stride + (b + 16) * T::bytes);
                for (int line = 0; line < T::bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
            }
        }
        __m512i w[C][8];
        load_weights<F, C>(w, blk.w, blk.group_stride, b);
        // A compact format's fp32 scales (and mins) of the block, formed once for all R rows.
        alignas(64) float scales[C][kGroups][kCols], mins[C][kCols];
        if constexpr (T::compact) {
            for (int c = 0; c < C; ++c) {
                for (int g = 0; g < kGroups; ++g) _mm512_store_ps(scales[c][g], scales_avx512<F>(blk.w + c * blk.group_stride, b, g));
                if constexpr (T::has_min) _mm512_store_ps(mins[c], mins_avx512<F>(blk.w + c * blk.group_stride, b));
            }
        }
        for (int r = 0; r < R; ++r) {
            const int64_t row = blk.row + r;
            const int8_t* q = a.q + row * a.k + b * kBlock;
            // Each group's integer starts at -offset * (its sum of q): no subtraction after. Two
            // chains of vpdpbusd a group (steps 0, 2, .. and 1, 3, ..), added at the end: half the
            // dependent latency, and integer sums are exact in any order.
            __m512i dot[C][kGroups], odd[C][kGroups];
            for (int g = 0; g < kGroups; ++g) {
                const __m512i start = T::offset != 0 ? _mm512_set1_epi32(-a.corr[(row * a.nb + b) * 2 + g])
                                                     : _mm512_setzero_si512();
                for (int c = 0; c < C; ++c) {
                    dot[c][g] = start;
                    odd[c][g] = _mm512_setzero_si512();
                }
            }
            for (int j = 0; j < 8; ++j) {
                const __m512i xq = _mm512_broadcastd_epi32(_mm_loadu_si32(q + 4 * j));
                const int g = j * kGroups / 8;
                for (int c = 0; c < C; ++c) {
                    if (j % 2 == 0) dot[c][g] = _mm512_dpbusd_epi32(dot[c][g], w[c][j], xq);
                    else odd[c][g] = _mm512_dpbusd_epi32(odd[c][g], w[c][j], xq);
                }
            }
            for (int c = 0; c < C; ++c)
                for (int g = 0; g < kGroups; ++g) dot[c][g] = _mm512_add_epi32(dot[c][g], odd[c][g]);
            const __m512 dx = _mm512_set1_ps(a.dx[row * a.nb + b]);
            for (int c = 0; c < C; ++c) {
                const uint8_t* group = blk.w + c * blk.group_stride;
                for (int g = 0; g < kGroups; ++g) {
                    const __m512i i = dot[c][g];
                    const __m512 scale = T::compact ? _mm512_load_ps(scales[c][g]) : scales_avx512<F>(group, b, g);
                    acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_mul_ps(_mm512_mul_ps(scale, dx), _mm512_cvtepi32_ps(i)));
                }
                if constexpr (T::has_min) {
                    const __m512 block_mins = T::compact ? _mm512_load_ps(mins[c]) : mins_avx512<F>(group, b);
                    acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_mul_ps(block_mins, _mm512_set1_ps(a.sx[row * a.nb + b])));
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(blk.sums + r * C * kCols + c * kCols, acc[r][c]);
}

// ---- AVX2 (vpmaddubsw; Q8_0's signed weights by llama.cpp's sign trick) -----------------------

// One step's products summed in pairs, int16: u q + u' q' (no saturation: u <= 63 for Q6_K, 31 for
// the 5-bit formats, 15 for the 4-bit ones; Q8_0 as |q| times the sign-moved activation, <= 128 * 127).
template <int F>
NS_QAVX2 inline __m256i pair_products_avx2(__m256i w, __m256i xq) {
    if constexpr (F == kQ8_0) {  // u = q + 128: back to signed, |q| into the unsigned operand
        const __m256i signed_w = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
        return _mm256_maddubs_epi16(_mm256_sign_epi8(signed_w, signed_w), _mm256_sign_epi8(xq, signed_w));
    } else {
        return _mm256_maddubs_epi16(w, xq);
    }
}

// Steps whose pair sums add up in int16 before one vpmaddwd widens them: while the bound of a pair
// (2 * max u * 128) times the steps stays under 32768, exactly: 8 for the 4-bit formats (30,720),
// 4 for the 5-bit ones and MXFP4 (u <= 24: 24,576), 2 for Q6_K, 1 for Q8_0. Fewer widening
// multiplies: vpmaddwd shares its pipes with vpmaddubsw.
template <int F>
constexpr int kInt16StepsOf = Traits<F>::table ? 4 : Traits<F>::nibbles ? 8 : F == kQ8_0 ? 1 : Traits<F>::base == kQ6_K ? 2 : 4;

// A 4-bit format's steps j and j + 4 for one half (8 columns) of a group, from one load: the low
// nibbles and the high ones (MXFP4's through its table).
template <int F>
NS_QAVX2 inline void load_step_pair_avx2(const uint8_t* p, int j, int h, __m256i& first, __m256i& second) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32 * h));
    const __m256i low = _mm256_set1_epi8(0x0F);
    first = _mm256_and_si256(v, low);
    second = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if constexpr (Traits<F>::table) {
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Table)));
        first = _mm256_shuffle_epi8(table, first);
        second = _mm256_shuffle_epi8(table, second);
    }
}

// A planes format's steps j and j + 4 for one half of a group: the nibbles as load_step_pair_avx2
// reads them, each with its high bits from the planes (`planes`: the half's 32 bytes of each
// plane, loaded once a block) moved to bit 4 (and 5). The 16-bit shifts carry bits across bytes
// only into places the mask clears.
template <int bits, int from, int to>
NS_QAVX2 inline __m256i move_bits(__m256i v) {
    const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << bits) - 1) << to));
    if constexpr (from < to) return _mm256_and_si256(_mm256_slli_epi16(v, to - from), mask);
    else if constexpr (from > to) return _mm256_and_si256(_mm256_srli_epi16(v, from - to), mask);
    else return _mm256_and_si256(v, mask);
}

template <int F, int j>
NS_QAVX2 inline void load_planes_step_pair_avx2(const uint8_t* p, int h, const __m256i (&planes)[2], __m256i& first,
                                                __m256i& second) {
    constexpr int bits = Traits<F>::plane_bits;
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32 * h));
    const __m256i low = _mm256_set1_epi8(0x0F);
    if constexpr (bits == 1) {
        first = _mm256_or_si256(_mm256_and_si256(v, low), move_bits<1, j, 4>(planes[0]));
        second = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), move_bits<1, j + 4, 4>(planes[0]));
    } else {
        first = _mm256_or_si256(_mm256_and_si256(v, low), move_bits<2, 2 * j, 4>(planes[0]));
        second = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), move_bits<2, 2 * j, 4>(planes[1]));
    }
}

// A planes format's column group (`supers` super-blocks) in its byte-an-element format (the
// codes and d after each super-block's quants are laid out alike): prompt GEMMs expand each group
// once a call and run the byte kernels on it, instead of unpacking the planes for every 4 rows.
template <int F, int j>
NS_QAVX2 inline void expand_step_pair_avx2(const uint8_t* p, const __m256i (&planes)[2][2], uint8_t* out) {
    for (int h = 0; h < 2; ++h) {
        __m256i first, second;
        load_planes_step_pair_avx2<F, j>(p, h, planes[h], first, second);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * j + 32 * h), first);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * (j + 4) + 32 * h), second);
    }
}

template <int F>
NS_QAVX2 void expand_planes_avx2(const uint8_t* src, uint8_t* dst, int64_t supers) {
    using T = Traits<F>;
    using B = Traits<T::base>;
    static_assert(T::super_bytes - 8 * T::quant_bytes == B::super_bytes - 8 * B::quant_bytes, "same tails");
    for (int64_t super = 0; super < supers; ++super) {
        const uint8_t* from = src + super * T::super_bytes;
        uint8_t* to = dst + super * B::super_bytes;
        for (int block = 0; block < 8; ++block) {
            const uint8_t* p = from + block * T::quant_bytes;
            uint8_t* out = to + block * B::quant_bytes;
            __m256i planes[2][2];
            for (int h = 0; h < 2; ++h)
                for (int plane = 0; plane < 2; ++plane)
                    planes[h][plane] = plane < T::plane_bits
                        ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256 + 64 * plane + 32 * h))
                        : _mm256_setzero_si256();
            expand_step_pair_avx2<F, 0>(p, planes, out);
            expand_step_pair_avx2<F, 1>(p, planes, out);
            expand_step_pair_avx2<F, 2>(p, planes, out);
            expand_step_pair_avx2<F, 3>(p, planes, out);
        }
        std::memcpy(to + 8 * B::quant_bytes, from + 8 * T::quant_bytes, T::super_bytes - 8 * T::quant_bytes);
    }
}

// A planes format's integer phase for one group of columns and block: steps j and j + 4 from one
// load, two values of j a run of int16 sums (4 steps of 5-bit values in one group; 2 steps of a
// 6-bit group, steps j in group 0 and j + 4 in group 1), then one vpmaddwd.
template <int F, int R, int j>
NS_QAVX2 inline void planes_steps_avx2(const Block& blk, const uint8_t* p, int64_t b, const __m256i (&planes)[2][2],
                                       __m256i (&pairs)[R][2][2], __m256i (&dot)[R][2][2]) {
    using T = Traits<F>;
    const Activations& a = *blk.a;
    __m256i w[2][2];
    for (int h = 0; h < 2; ++h) load_planes_step_pair_avx2<F, j>(p, h, planes[h], w[h][0], w[h][1]);
    for (int r = 0; r < R; ++r) {
        const int8_t* q = a.q + (blk.row + r) * a.k + b * kBlock;
        const __m256i x0 = _mm256_broadcastd_epi32(_mm_loadu_si32(q + 4 * j));
        const __m256i x1 = _mm256_broadcastd_epi32(_mm_loadu_si32(q + 4 * (j + 4)));
        for (int h = 0; h < 2; ++h) {
            const __m256i s0 = _mm256_maddubs_epi16(w[h][0], x0), s1 = _mm256_maddubs_epi16(w[h][1], x1);
            if constexpr (T::group == 32) {
                const __m256i s = _mm256_add_epi16(s0, s1);
                pairs[r][h][0] = j % 2 == 0 ? s : _mm256_add_epi16(pairs[r][h][0], s);
            } else {
                pairs[r][h][0] = j % 2 == 0 ? s0 : _mm256_add_epi16(pairs[r][h][0], s0);
                pairs[r][h][1] = j % 2 == 0 ? s1 : _mm256_add_epi16(pairs[r][h][1], s1);
            }
            if constexpr (j % 2 == 1) {
                for (int g = 0; g < kBlock / T::group; ++g) {
                    const __m256i wide = _mm256_madd_epi16(pairs[r][h][g], _mm256_set1_epi16(1));
                    dot[r][h][g] = j == 1 ? wide : _mm256_add_epi32(dot[r][h][g], wide);
                }
            }
        }
    }
}

// R rows against C groups of 16 columns. Per block and group: the integer phase runs the block's
// steps for all R rows with the weights in registers (a loaded step serves every row), pair sums
// kept in int16 over kInt16Steps steps, then one vpmaddwd; then the fp32 fold, in the reference's
// order. The integer phase's live values fit the 16 registers at R = 4 (int16 sums of 4 rows x 2
// halves, a step pair's weights, two broadcast activations); the fp32 accumulators, touched once a
// block, may live in memory. (The previous order, a half's eight unpacked steps held across the
// rows, spilled everything at 2 x 2 and ran 1.3-1.6x slower at 64 rows, same bits.)
// Block b's 8 fp32 scales of group g for half h (8 columns) of a group of columns, or its mins.
template <int F>
NS_QAVX2 inline __m256 scales_avx2(const uint8_t* group, int64_t b, int g, int h) {
    using T = Traits<F>;
    if constexpr (T::compact) {
        const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scale_codes_at<F>(group, b, g) + 8 * h));
        const __m256i ints = T::base == kQ6_K ? _mm256_cvtepi8_epi32(codes) : _mm256_cvtepu8_epi32(codes);
        return _mm256_mul_ps(_mm256_loadu_ps(super_floats<F>(group, b, T::d_at) + 8 * h), _mm256_cvtepi32_ps(ints));
    }
    return _mm256_loadu_ps(reinterpret_cast<const float*>(group + b * T::bytes + T::quant_bytes) + g * kCols + 8 * h);
}

template <int F>
NS_QAVX2 inline __m256 mins_avx2(const uint8_t* group, int64_t b, int h) {
    using T = Traits<F>;
    if constexpr (T::compact) {
        const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(min_codes_at<F>(group, b) + 8 * h));
        const __m256 product = _mm256_mul_ps(_mm256_loadu_ps(super_floats<F>(group, b, T::dmin_at) + 8 * h),
                                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)));
        return _mm256_xor_ps(product, _mm256_set1_ps(-0.0f));
    }
    return _mm256_loadu_ps(reinterpret_cast<const float*>(group + b * T::bytes + T::quant_bytes + T::scale_bytes) + 8 * h);
}

template <int F, int R, int C>
NS_QAVX2 void block_avx2(const Block& blk) {
    using T = Traits<F>;
    constexpr int kGroups = kBlock / T::group;
    constexpr int kInt16Steps = kInt16StepsOf<F>;
    static_assert(8 / kGroups % kInt16Steps == 0, "a group's steps split into whole int16 runs");
    const Activations& a = *blk.a;
    __m256 acc[R][C][2];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.nb; ++b) {
        if constexpr (R == 1) {  // as block_vnni's
            for (int c = 0; c < C; ++c) {
                const char* ahead = reinterpret_cast<const char*>(blk.w + c * blk.group_stride + (b + 16) * T::bytes);
                for (int line = 0; line < T::bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
            }
        }
        for (int c = 0; c < C; ++c) {
            const uint8_t* group = blk.w + c * blk.group_stride;
            const uint8_t* p = quants_at<F>(group, b);
            __m256i dot[R][2][kGroups];  // each group's int32 dot products, 8 columns a half
            if constexpr (T::plane_bits > 0) {
                static_assert(2 * (2 / kGroups) <= kInt16Steps, "two values of j fit one int16 run");
                __m256i planes[2][2];  // [half][plane]
                for (int h = 0; h < 2; ++h)
                    for (int plane = 0; plane < T::plane_bits; ++plane)
                        planes[h][plane] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256 + 64 * plane + 32 * h));
                if constexpr (T::plane_bits == 1) planes[0][1] = planes[1][1] = _mm256_setzero_si256();
                __m256i pairs[R][2][2], dots[R][2][2];
                planes_steps_avx2<F, R, 0>(blk, p, b, planes, pairs, dots);
                planes_steps_avx2<F, R, 1>(blk, p, b, planes, pairs, dots);
                planes_steps_avx2<F, R, 2>(blk, p, b, planes, pairs, dots);
                planes_steps_avx2<F, R, 3>(blk, p, b, planes, pairs, dots);
                for (int r = 0; r < R; ++r)
                    for (int h = 0; h < 2; ++h)
                        for (int g = 0; g < kGroups; ++g) dot[r][h][g] = dots[r][h][g];
            } else if constexpr (T::nibbles) {  // one group, kInt16Steps steps in int16: steps j and j + 4 together
                constexpr int kRun = kInt16Steps / 2;  // values of j a run of int16 sums takes
                __m256i pairs[R][2];
                for (int j = 0; j < 4; ++j) {
                    __m256i w[2][2];
                    for (int h = 0; h < 2; ++h) load_step_pair_avx2<F>(p, j, h, w[h][0], w[h][1]);
                    for (int r = 0; r < R; ++r) {
                        const int8_t* q = a.q + (blk.row + r) * a.k + b * kBlock;
                        const __m256i x0 = _mm256_broadcastd_epi32(_mm_loadu_si32(q + 4 * j));
                        const __m256i x1 = _mm256_broadcastd_epi32(_mm_loadu_si32(q + 4 * (j + 4)));
                        for (int h = 0; h < 2; ++h) {
                            const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(w[h][0], x0), _mm256_maddubs_epi16(w[h][1], x1));
                            pairs[r][h] = j % kRun == 0 ? s : _mm256_add_epi16(pairs[r][h], s);
                            if (j % kRun == kRun - 1) {
                                const __m256i wide = _mm256_madd_epi16(pairs[r][h], _mm256_set1_epi16(1));
                                dot[r][h][0] = j == kRun - 1 ? wide : _mm256_add_epi32(dot[r][h][0], wide);
                            }
                        }
                    }
                }
            } else {
                for (int r = 0; r < R; ++r)
                    for (int h = 0; h < 2; ++h)
                        for (int g = 0; g < kGroups; ++g) dot[r][h][g] = _mm256_setzero_si256();
                __m256i pairs[R][2];
#pragma GCC unroll 8  // unrolled, the int16 sums stay in registers (Q5_0 at 64 rows: 1.45x)
                for (int j = 0; j < 8; ++j) {
                    __m256i w[2];
                    for (int h = 0; h < 2; ++h) w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32 * h));
                    for (int r = 0; r < R; ++r) {
                        const int8_t* q = a.q + (blk.row + r) * a.k + b * kBlock;
                        const __m256i xq = _mm256_broadcastd_epi32(_mm_loadu_si32(q + 4 * j));
                        for (int h = 0; h < 2; ++h) {
                            const __m256i step = pair_products_avx2<F>(w[h], xq);
                            pairs[r][h] = j % kInt16Steps == 0 ? step : _mm256_add_epi16(pairs[r][h], step);
                            if (j % kInt16Steps == kInt16Steps - 1) {
                                const int g = j * kGroups / 8;
                                dot[r][h][g] = _mm256_add_epi32(dot[r][h][g], _mm256_madd_epi16(pairs[r][h], _mm256_set1_epi16(1)));
                            }
                        }
                    }
                }
            }
            alignas(32) float scales[2][kGroups][8], mins[2][8];  // a compact format's, once for all R rows
            if constexpr (T::compact) {
                for (int h = 0; h < 2; ++h) {
                    for (int g = 0; g < kGroups; ++g) _mm256_store_ps(scales[h][g], scales_avx2<F>(group, b, g, h));
                    if constexpr (T::has_min) _mm256_store_ps(mins[h], mins_avx2<F>(group, b, h));
                }
            }
            for (int r = 0; r < R; ++r) {
                const int64_t row = blk.row + r;
                const __m256 dx = _mm256_set1_ps(a.dx[row * a.nb + b]);
                for (int h = 0; h < 2; ++h) {
                    for (int g = 0; g < kGroups; ++g) {
                        __m256i i = dot[r][h][g];
                        if constexpr (T::offset != 0 && F != kQ8_0)  // Q8_0's dot is already signed
                            i = _mm256_sub_epi32(i, _mm256_set1_epi32(a.corr[(row * a.nb + b) * 2 + g]));
                        const __m256 scale = T::compact ? _mm256_load_ps(scales[h][g]) : scales_avx2<F>(group, b, g, h);
                        acc[r][c][h] = _mm256_add_ps(acc[r][c][h], _mm256_mul_ps(_mm256_mul_ps(scale, dx), _mm256_cvtepi32_ps(i)));
                    }
                    if constexpr (T::has_min) {
                        const __m256 block_mins = T::compact ? _mm256_load_ps(mins[h]) : mins_avx2<F>(group, b, h);
                        acc[r][c][h] = _mm256_add_ps(acc[r][c][h], _mm256_mul_ps(block_mins, _mm256_set1_ps(a.sx[row * a.nb + b])));
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
            for (int h = 0; h < 2; ++h) _mm256_storeu_ps(blk.sums + r * C * kCols + c * kCols + 8 * h, acc[r][c][h]);
}

// ---- portable -------------------------------------------------------------------------------

template <int F>
inline int unpack(const uint8_t* quants, int k, int col) {  // element k of a block, one column
    const int step = k / 4, lane = col * 4 + k % 4;
    if constexpr (Traits<F>::plane_bits > 0) {
        constexpr int bits = Traits<F>::plane_bits, per_plane = 8 / bits;
        const int low = step < 4 ? quants[64 * step + lane] & 0x0F : quants[64 * (step - 4) + lane] >> 4;
        const int high = (quants[256 + 64 * (step / per_plane) + lane] >> (bits * (step % per_plane))) & ((1 << bits) - 1);
        return low | (high << 4);
    }
    if constexpr (Traits<F>::nibbles) {
        const int code = step < 4 ? quants[64 * step + lane] & 0x0F : quants[64 * (step - 4) + lane] >> 4;
        return Traits<F>::table ? kMxfp4Table[code] : code;
    }
    return quants[64 * step + lane];
}

template <int F, int R, int C>
void block_portable(const Block& blk) {
    using T = Traits<F>;
    const Activations& a = *blk.a;
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
            for (int col = 0; col < kCols; ++col) {
                const int64_t row = blk.row + r;
                float acc = 0.0f;
                for (int64_t b = 0; b < a.nb; ++b) {
                    const uint8_t* group = blk.w + c * blk.group_stride;
                    const uint8_t* p = quants_at<F>(group, b);
                    const int8_t* q = a.q + row * a.k + b * kBlock;
                    const float dx = a.dx[row * a.nb + b];
                    for (int g = 0; g < kBlock / T::group; ++g) {
                        int32_t i = 0;
                        for (int e = g * T::group; e < (g + 1) * T::group; ++e) i += unpack<F>(p, e, col) * q[e];
                        i -= a.corr[(row * a.nb + b) * 2 + g];
                        const float scale = scale_of<F>(group, b, g, col);
                        acc = acc + (scale * dx) * static_cast<float>(i);
                    }
                    if constexpr (T::has_min) {
                        acc = acc + min_of<F>(group, b, col) * a.sx[row * a.nb + b];
                    }
                }
                blk.sums[r * C * kCols + c * kCols + col] = acc;
            }
}

// ---- the loop nest, shared by the levels ------------------------------------------------------

using BlockFn = void (*)(const Block&);
constexpr int kMaxR = 4, kMaxC = 4;

struct Kernels {
    BlockFn fn[kMaxR][kMaxC];
};

// `planes`: whether the level has kernels for the planes formats (the VNNI level runs AVX2's).
template <int F, int R, int C> struct Vnni {
    static constexpr bool planes = false;
    static void run(const Block& b) { block_vnni<F, R, C>(b); }
};
template <int F, int R, int C> struct Avx2 {
    static constexpr bool planes = true;
    static void run(const Block& b) { block_avx2<F, R, C>(b); }
};
template <int F, int R, int C> struct Portable {
    static constexpr bool planes = true;
    static void run(const Block& b) { block_portable<F, R, C>(b); }
};

template <template <int, int, int> class K, int F, int R, int C>
void fill(Kernels& table) {
    table.fn[R - 1][C - 1] = &K<F, R, C>::run;
    if constexpr (C < kMaxC) fill<K, F, R, C + 1>(table);
    else if constexpr (R < kMaxR) fill<K, F, R + 1, 1>(table);
}

template <template <int, int, int> class K>
struct LevelKernels {
    Kernels formats[kFormats];
    LevelKernels() {
        fill<K, kQ8_0, 1, 1>(formats[kQ8_0]);
        fill<K, kQ4_0, 1, 1>(formats[kQ4_0]);
        fill<K, kQ4_1, 1, 1>(formats[kQ4_1]);
        fill<K, kQ4_K, 1, 1>(formats[kQ4_K]);
        fill<K, kQ6_K, 1, 1>(formats[kQ6_K]);
        fill<K, kQ5_0, 1, 1>(formats[kQ5_0]);
        fill<K, kQ5_1, 1, 1>(formats[kQ5_1]);
        fill<K, kQ5_K, 1, 1>(formats[kQ5_K]);
        fill<K, kMxfp4, 1, 1>(formats[kMxfp4]);  // (kF8_E4M3's entry stays empty: gemm_fp8.cpp)
        if constexpr (K<kQ5_KPlanes, 1, 1>::planes) {
            fill<K, kQ5_KPlanes, 1, 1>(formats[kQ5_KPlanes]);
            fill<K, kQ6_KPlanes, 1, 1>(formats[kQ6_KPlanes]);
        }
    }
};

struct Shape {
    int rows, cols;
};

using ExpandFn = void (*)(const uint8_t*, uint8_t*, int64_t);

struct Call {
    void* out;
    int64_t ldo;
    int dtype;  // of x, bias and out: 0 fp32, 1 bf16
    const uint8_t* packed;
    const void* bias;
    int64_t M, N;
    int block_bytes;      // of the packing the kernels read
    ExpandFn expand;      // a planes packing expanded a column group at a time (else nullptr)
    int packed_block_bytes;  // of `packed` itself
};

// Adds the bias and writes rows x cols of out from sums [rows][cols].
void store(const Call& call, const float* sums, int64_t row, int rows, int64_t col, int cols) {
    for (int r = 0; r < rows; ++r)
        for (int j = 0; j < cols; ++j) {
            float v = sums[r * cols + j];
            if (call.bias != nullptr) v = v + load_x(call.bias, call.dtype, col + j);
            const int64_t at = (row + r) * call.ldo + col + j;
            if (call.dtype == 1) static_cast<uint16_t*>(call.out)[at] = ns_bf16::from_float(v);
            else static_cast<float*>(call.out)[at] = v;
        }
}

// store() on AVX-512: 16 columns at a time (vcvtneps2bf16 rounds to nearest even, as from_float).
NS_VNNI void store_avx512(const Call& call, const float* sums, int64_t row, int rows, int64_t col, int cols) {
    for (int r = 0; r < rows; ++r)
        for (int j = 0; j < cols; j += kCols) {
            __m512 v = _mm512_loadu_ps(sums + r * cols + j);
            if (call.bias != nullptr) {
                __m512 bias;
                if (call.dtype == 1) {
                    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(call.bias) + col + j));
                    bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
                } else {
                    bias = _mm512_loadu_ps(static_cast<const float*>(call.bias) + col + j);
                }
                v = _mm512_add_ps(v, bias);
            }
            const int64_t at = (row + r) * call.ldo + col + j;
            if (call.dtype == 1)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(call.out) + at),
                                    reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
            else
                _mm512_storeu_ps(static_cast<float*>(call.out) + at, v);
        }
}

// store() on AVX2: 8 columns at a time, the same bits.
NS_QAVX2 void store_avx2(const Call& call, const float* sums, int64_t row, int rows, int64_t col, int cols) {
    for (int r = 0; r < rows; ++r)
        for (int j = 0; j < cols; j += 8) {
            __m256 v = _mm256_loadu_ps(sums + r * cols + j);
            if (call.bias != nullptr)
                v = _mm256_add_ps(v, call.dtype == 1 ? ns_bf16::to_float_x8(static_cast<const uint16_t*>(call.bias) + col + j)
                                                     : _mm256_loadu_ps(static_cast<const float*>(call.bias) + col + j));
            const int64_t at = (row + r) * call.ldo + col + j;
            if (call.dtype == 1)
                _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(call.out) + at), ns_bf16::from_float_x8(v));
            else
                _mm256_storeu_ps(static_cast<float*>(call.out) + at, v);
        }
}

using StoreFn = void (*)(const Call&, const float*, int64_t, int, int64_t, int);
using QuantizeFn = void (*)(const void*, int, int64_t, int64_t, int64_t, int, bool, int8_t*, float*, float*, int32_t*);

// How one level runs: its register blocks, how it quantizes a row of x and stores sums.
struct Level {
    const Kernels* kernels;
    QuantizeFn quantize;
    StoreFn store;
    Shape shape;
};

// Quantizes x's rows into `a`, then multiplies. Many rows are quantized by all the threads in the
// GEMM's own parallel region (one fork); a few by the calling thread first (no barrier to wait at:
// decode's GEMMs are a few microseconds each).
void run(const Level& level, const Call& call, const Activations& a, const void* x, int64_t ldx, int offset,
         bool halves) {
    const Kernels& kernels = *level.kernels;
    const Shape shape = level.shape;
    const int64_t col_groups = call.N / kCols;
    const int64_t group_stride = a.nb * call.block_bytes;
    const bool few_rows = call.M * a.k < kParallelQuantize;
    auto quantize = [&](int64_t row) {
        level.quantize(x, call.dtype, row, ldx, a.k, offset, halves, a.q + row * a.k, a.dx + row * a.nb,
                       a.sx + row * a.nb, a.corr + row * a.nb * 2);
    };
    if (few_rows)
        for (int64_t row = 0; row < call.M; ++row) quantize(row);
#pragma omp parallel if (call.M * call.N * a.k >= kParallelMacs || call.N * a.k >= kParallelWeights)
    {
        if (!few_rows) {
#pragma omp for schedule(static)
            for (int64_t row = 0; row < call.M; ++row) quantize(row);
        }
        // Threads split the groups evenly (SmolLM2's 36 groups of 576 columns: 18 each, where
        // units of 4 would give 16 and 20); a thread's last register block may be narrower.
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = col_groups * thread / threads;
        const int64_t last = col_groups * (thread + 1) / threads;
        const int64_t group = std::max<int64_t>(shape.cols, kWeightGroupBytes / std::max<int64_t>(1, group_stride) / shape.cols * shape.cols);
        alignas(64) float sums[kMaxR * kMaxC * kCols];
        thread_local std::vector<uint8_t> expanded;
        for (int64_t group_start = first; group_start < last; group_start += group) {
            const int64_t group_end = std::min(group_start + group, last);
            const uint8_t* weights = call.packed + group_start * group_stride;  // column group group_start's
            if (call.expand != nullptr) {
                expanded.resize((group_end - group_start) * group_stride);
                const int64_t packed_stride = a.nb * call.packed_block_bytes;
                for (int64_t cg = group_start; cg < group_end; ++cg)
                    call.expand(call.packed + cg * packed_stride, expanded.data() + (cg - group_start) * group_stride, a.nb / 8);
                weights = expanded.data();
            }
            for (int64_t chunk = 0; chunk < call.M; chunk += kRowChunk) {
                const int64_t chunk_end = std::min(chunk + kRowChunk, call.M);
                for (int64_t cg = group_start; cg < group_end; cg += shape.cols) {
                    const int cols = static_cast<int>(std::min<int64_t>(shape.cols, group_end - cg));
                    for (int64_t row = chunk; row < chunk_end; row += shape.rows) {
                        const int rows = static_cast<int>(std::min<int64_t>(shape.rows, chunk_end - row));
                        const Block b{sums, &a, row, weights + (cg - group_start) * group_stride, group_stride};
                        kernels.fn[rows - 1][cols - 1](b);
                        level.store(call, sums, row, rows, cg * kCols, cols * kCols);
                    }
                }
            }
        }
    }
}

bool vnni_level(int level) {
    static const bool has_vnni = __builtin_cpu_supports("avx512vnni");
    return level >= ns_isa::kAvx512Bf16 && has_vnni;
}

const Kernels& level_kernels(int level, int format) {
    static const LevelKernels<Vnni> vnni;
    static const LevelKernels<Avx2> avx2;
    static const LevelKernels<Portable> portable;
    const bool planes = format == kQ5_KPlanes || format == kQ6_KPlanes;
    if (vnni_level(level) && !planes) return vnni.formats[format];
    if (level >= ns_isa::kAvx2) return avx2.formats[format];
    return portable.formats[format];
}

// A format's Traits read at run time: (packed block bytes, integer offset, K in 256-blocks).
struct FormatInfo {
    int bytes, offset;
    bool super_blocks;
};

template <int F>
constexpr FormatInfo info() { return {Traits<F>::bytes, Traits<F>::offset, Traits<F>::super_blocks}; }

FormatInfo format_info(int format) {
    switch (format) {
        case kQ8_0: return info<kQ8_0>();
        case kQ4_0: return info<kQ4_0>();
        case kQ4_1: return info<kQ4_1>();
        case kQ4_K: return info<kQ4_K>();
        case kQ6_K: return info<kQ6_K>();
        case kQ5_0: return info<kQ5_0>();
        case kQ5_1: return info<kQ5_1>();
        case kMxfp4: return info<kMxfp4>();
        case kQ5_KPlanes: return info<kQ5_KPlanes>();
        case kQ6_KPlanes: return info<kQ6_KPlanes>();
        default: return info<kQ5_K>();
    }
}

}  // namespace

extern "C" {

int ns_gemm_fp8(void* out, int64_t ldo, const void* x, int64_t ldx, int dtype, const void* packed, const void* bias,
                int64_t M, int64_t N, int64_t K);

// out [M, N] (row stride ldo) = x [M, K] (row stride ldx) @ w^T (+ bias [N]), x, bias and out of
// one dtype (0 fp32, 1 bf16), w packed by quant.py's pack_weight (N a multiple of 16 there).
// Format kF8_E4M3 (FP8 weights, not integers) goes to gemm_fp8.cpp.
// 0 done; 2 a shape, dtype or format it does not take.
int ns_gemm_quant(int format, void* out, int64_t ldo, const void* x, int64_t ldx, int dtype, const void* packed,
                  const void* bias, int64_t M, int64_t N, int64_t K) {
    if (format == kF8_E4M3) return ns_gemm_fp8(out, ldo, x, ldx, dtype, packed, bias, M, N, K);
    if (format < 0 || format >= kFormats || (dtype != 0 && dtype != 1)) return 2;
    const FormatInfo format_traits = format_info(format);
    if (format_traits.super_blocks && K % 256 != 0) return 2;
    if (K % kBlock != 0 || N % kCols != 0 || M < 0) return 2;
    if (M == 0) return 0;
    const int64_t nb = K / kBlock;
    thread_local std::vector<int8_t> q;
    thread_local std::vector<float> dx, sx;
    thread_local std::vector<int32_t> corr;
    q.resize(M * K);
    dx.resize(M * nb);
    sx.resize(M * nb);
    corr.resize(M * nb * 2);
    // This thread's buffers, by pointer: inside the parallel region the names would be each
    // worker's own thread_local vectors.
    const Activations a{q.data(), dx.data(), sx.data(), corr.data(), K, nb};
    Call call{out, ldo, dtype, static_cast<const uint8_t*>(packed), bias, M, N, format_traits.bytes, nullptr,
              format_traits.bytes};
    const int isa = ns_isa::current();
    // A planes packing's prompt rows: each column group expanded once to its byte format (the
    // same values), then the byte kernels, whose unpacking is a load (measured on a Zen 3 EPYC:
    // unpacking the planes for every 4 rows made 64-512-row GEMMs 13-20% slower).
    if ((format == kQ5_KPlanes || format == kQ6_KPlanes) && M >= kExpandRows && isa >= ns_isa::kAvx2) {
        const bool q5 = format == kQ5_KPlanes;
        call.expand = q5 ? expand_planes_avx2<kQ5_KPlanes> : expand_planes_avx2<kQ6_KPlanes>;
        format = q5 ? kQ5_K : kQ6_K;
        call.block_bytes = format_info(format).bytes;
    }
    // Register blocks by measurement on a Zen 5 EPYC (one thread, M = 64, SmolLM2's shapes): 4 x 2,
    // 6 x 2 and 4 x 3 within noise of each other (the per-block fp32 fold, not the weights' reuse,
    // bounds it), 3 x 3 and 2 x 4 slower; a lone row takes 4 groups to keep several weight
    // streams going. AVX2 on a Zen 3 EPYC (one thread, M = 64): 4 x 1 to 8 x 1 within noise,
    // 4 x 2 5%, 2 x 1 25% and 2 x 2 45% slower.
    Level level{&level_kernels(isa, format), quantize_row, store, Shape{1, 1}};
    if (vnni_level(isa)) level = {level.kernels, quantize_row_avx512, store_avx512, M == 1 ? Shape{1, 4} : Shape{4, 2}};
    else if (isa >= ns_isa::kAvx2) level = {level.kernels, quantize_row_avx2, store_avx2, M == 1 ? Shape{1, 2} : Shape{4, 1}};
    run(level, call, a, x, ldx, format_traits.offset, format == kQ6_K || format == kQ6_KPlanes);
    return 0;
}

// Several GEMMs of one K and x dtype in one call (a MoE layer's experts, each on its own rows):
// `items` holds, per GEMM, (format, packed, x, out, M, N, bias or 0), x's rows of stride K and
// out's of stride N (a multiple of 16). One call instead of one a GEMM: at batch 1 the experts'
// GEMMs take microseconds each, and Python's per-call cost was a third of a MoE layer's time.
// 0 done; else the first GEMM's failing code (the ones before it are done).
// Whether the quantized GEMMs run at a VNNI level (kernels/quant.py packs Q5_K and Q6_K in bit
// planes below it).
int ns_gemm_quant_vnni() { return vnni_level(ns_isa::current()) ? 1 : 0; }

int ns_gemm_quant_many(int count, const int64_t* items, int64_t K, int dtype) {
    for (int i = 0; i < count; ++i) {
        const int64_t* item = items + 7 * i;
        const int code = ns_gemm_quant(static_cast<int>(item[0]), reinterpret_cast<void*>(item[3]), item[5],
                                       reinterpret_cast<const void*>(item[2]), K, dtype,
                                       reinterpret_cast<const void*>(item[1]), reinterpret_cast<const void*>(item[6]),
                                       item[4], item[5], K);
        if (code != 0) return code;
    }
    return 0;
}

}  // extern "C"
