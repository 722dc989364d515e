// CPU kernels for nanoserve's CPU execution path, called through ctypes (kernels/cpu_ops.py).
// Plain C ABI, no torch headers: it compiles in about a second. OpenMP here resolves to the
// libgomp that torch already loaded (same soname), so these loops share torch's thread team.
//
// Storage types: 0 = float32, 1 = bfloat16. Math is float32. Each op rounds where the torch
// reference rounds, so that results match it to the last bit wherever the reference's own
// order of operations allows.
//
// Attention is the kernel that matters: it reads K/V where they lie in the paged pool (no
// gather), and every query row's arithmetic depends only on that row and its keys, visited
// block by block in key order. So a row gives the same bits whether it is computed in a
// prefill of any length or a chunk of a longer prompt, whatever else is in the batch. A batch
// of decodes only (one new row per sequence; the engine's only use of this kernel) takes a
// two-pass decode kernel in bf16: the same invariances, another summation order.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <immintrin.h>
#include <omp.h>
#include <vector>

// Hand-vectorized paths for AVX-512 with BF16 (Zen 4/5, Cooper Lake, Sapphire Rapids and later),
// taken at that ISA level and above (isa.h); an AVX2 + FMA decode kernel below them; the plain
// loops serve the rest (compiled for this machine, vectorized by the compiler) and float32.
#include "bf16.h"
#include "fp8.h"
#include "isa.h"
#include "simd.h"  // NS_AVX512_BF16, exp2x16, to_bf16x16, load_bf16x16, round_bf16x16

namespace {

struct F32 {
    using T = float;
    static inline float load(const float* p, int64_t i) { return p[i]; }
    static inline void store(float* p, int64_t i, float v) { p[i] = v; }
    static inline float round(float v) { return v; }
};

struct BF16 {
    using T = uint16_t;
    static inline float load(const uint16_t* p, int64_t i) { return ns_bf16::to_float(p[i]); }
    static inline void store(uint16_t* p, int64_t i, float v) { p[i] = ns_bf16::from_float(v); }
    static inline float round(float v) { return ns_bf16::to_float(ns_bf16::from_float(v)); }
};

// 2^x, relative error ~1e-7; 2^0 is exactly 1; below -126 it stays at 2^-126, from 128 up it is
// +inf (as expf overflows). Written so that the compiler vectorizes it (libm's expf would not
// be, without -ffast-math).
inline float exp2_clamped(float x) {
    const bool overflow = x >= 128.0f;
    x = x < -126.0f ? -126.0f : (overflow ? 0.0f : x);
    float n = std::floor(x + 0.5f);
    float f = x - n;  // [-0.5, 0.5]
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    int32_t e = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &e, sizeof(scale));
    return overflow ? INFINITY : p * scale;
}

constexpr float kLog2E = 1.4426950408889634f;

// Below this much work a parallel region costs more than it saves, and far more when the process
// shares its CPUs (each region ends in a barrier that waits for a descheduled thread).
constexpr int64_t kParallelElements = 1 << 15;

// One work item of paged attention: query rows [first_row, first_row + rows) of sequence `seq`
// (of its q_len new rows, which start at batch row q_start) against KV head `head`.
struct WorkItem {
    int seq, head, first_row, q_start, seq_len, context, rows;

    // KV blocks up to the block of the tile's last row's position.
    int num_blocks(int block_size) const { return (context + first_row + rows - 1) / block_size + 1; }
};

// Online-softmax state of the query vectors of one work item (rows x group heads).
struct SoftmaxRows {
    std::vector<float> acc, row_max, row_sum;

    SoftmaxRows(int max_vectors, int head_dim)
        : acc(static_cast<size_t>(max_vectors) * head_dim), row_max(max_vectors), row_sum(max_vectors) {}

    void reset(int vectors, int head_dim) {
        std::fill(acc.begin(), acc.begin() + static_cast<size_t>(vectors) * head_dim, 0.0f);
        std::fill(row_max.begin(), row_max.begin() + vectors, -INFINITY);
        std::fill(row_sum.begin(), row_sum.begin() + vectors, 0.0f);
    }
};

inline WorkItem work_item(const std::vector<int32_t>& items, int64_t index, const int32_t* cu_seqlens_q,
                          const int32_t* seq_lens, int rows_per_item) {
    WorkItem w;
    w.seq = items[3 * index];
    w.head = items[3 * index + 1];
    w.first_row = items[3 * index + 2];
    w.q_start = cu_seqlens_q[w.seq];
    const int q_len = cu_seqlens_q[w.seq + 1] - w.q_start;
    w.seq_len = seq_lens[w.seq];
    w.context = w.seq_len - q_len;
    w.rows = q_len - w.first_row < rows_per_item ? q_len - w.first_row : rows_per_item;
    return w;
}

// Keys to visit, summed over the work items: attention runs on one thread below a few thousand.
inline bool attention_worth_threads(const std::vector<int32_t>& items, const int32_t* seq_lens, int rows_per_item) {
    int64_t keys = 0;
    for (size_t i = 0; i < items.size(); i += 3) keys += static_cast<int64_t>(seq_lens[items[i]]) * rows_per_item;
    return items.size() > 3 && keys >= 4096;
}


// A batch of decodes (one work item a sequence and KV head): threads from a few thousand keys on.
inline bool decodes_worth_threads(const int32_t* seq_lens, int num_seqs, int num_kv_heads) {
    int64_t keys = 0;
    for (int s = 0; s < num_seqs; ++s) keys += seq_lens[s];
    return static_cast<int64_t>(num_seqs) * num_kv_heads > 1 && keys * num_kv_heads >= 4096;
}

// ---- AVX-512 BF16 fast paths -------------------------------------------------------------

// At the AVX-512 BF16 level and above (isa.h; cpu_ops sets a level only where the CPU has it).
bool use_avx512_bf16() { return ns_isa::current() >= ns_isa::kAvx512Bf16; }

using ns_simd::load_bf16x16;
using ns_simd::round_bf16x16;
using ns_simd::to_bf16x16;

using ns_simd::exp2x16;

// Lane j of the result is the sum of the 16 lanes of v[j].
NS_AVX512_BF16 inline __m512 transpose_sum16(const __m512* v) {
    __m512 quads[4];
    for (int q = 0; q < 4; ++q) {
        const __m512* w = v + 4 * q;
        const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
        const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
        const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
        // Per 128-bit chunk: the partial sums of keys 4q..4q+3.
        quads[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
    }
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                     _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

// One block's V (`valid` of its 16 keys written) with its keys paired for dpbf16: vp[(t * chunks
// + c) * 2 + half] holds (v[2t][d], v[2t + 1][d]) for the 16 d's that unpack{lo,hi}_epi16 take
// from chunk c of 32 d's. Keys past `valid` are never read.
NS_AVX512_BF16 inline void pair_values_dpbf16(__m512i* vp, const uint16_t* vb, int D, int chunks, int valid,
                                               const uint16_t* next = nullptr) {
    for (int t = 0; 2 * t < valid; ++t)
        for (int c = 0; c < chunks; ++c) {
            if (next != nullptr) {
                _mm_prefetch(reinterpret_cast<const char*>(next + static_cast<int64_t>(2 * t) * D + 32 * c), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(next + static_cast<int64_t>(2 * t + 1) * D + 32 * c), _MM_HINT_T0);
            }
            const __m512i r0 = _mm512_loadu_si512(vb + static_cast<int64_t>(2 * t) * D + 32 * c);
            const __m512i r1 = 2 * t + 1 < valid ? _mm512_loadu_si512(vb + static_cast<int64_t>(2 * t + 1) * D + 32 * c)
                                                 : _mm512_setzero_si512();
            vp[(t * chunks + c) * 2] = _mm512_unpacklo_epi16(r0, r1);
            vp[(t * chunks + c) * 2 + 1] = _mm512_unpackhi_epi16(r0, r1);
        }
}

// Scores of one block's 16 keys for G query heads of a group (scores [G] rows `scores_stride`
// apart, scaled by scale_log2, keys past `keep` -inf): each key's row loaded once for the G heads,
// G independent dpbf16 chains a key. Each head's sums are the same in the same order as one head
// at a time. `next` (or nullptr): a block to prefetch, a row per key, spread between the dot products.
template <int G>
NS_AVX512_BF16 inline void block_scores_dpbf16(float* scores, int64_t scores_stride, const uint16_t* query_head,
                                               int64_t q_stride_head, const uint16_t* kb, int D, int chunks,
                                               const uint16_t* next, __mmask16 keep, float scale_log2) {
    __m512i q[G][8];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < chunks; ++c) q[g][c] = _mm512_loadu_si512(query_head + g * q_stride_head + 32 * c);
    __m512 partial[G][16];
    for (int j = 0; j < 16; ++j) {
        const uint16_t* kj = kb + static_cast<int64_t>(j) * D;
        if (next != nullptr)
            for (int c = 0; c < chunks; ++c)
                _mm_prefetch(reinterpret_cast<const char*>(next + static_cast<int64_t>(j) * D + 32 * c), _MM_HINT_T0);
        __m512 dot[G];
        for (int g = 0; g < G; ++g) dot[g] = _mm512_setzero_ps();
        for (int c = 0; c < chunks; ++c) {
            const __m512bh k = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kj + 32 * c));
            for (int g = 0; g < G; ++g) dot[g] = _mm512_dpbf16_ps(dot[g], reinterpret_cast<__m512bh>(q[g][c]), k);
        }
        for (int g = 0; g < G; ++g) partial[g][j] = dot[g];
    }
    for (int g = 0; g < G; ++g) {
        // Keys past the end (unwritten slots, maybe NaN) become -inf.
        const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep,
                                             _mm512_mul_ps(transpose_sum16(partial[g]), _mm512_set1_ps(scale_log2)));
        _mm512_storeu_ps(scores + g * scores_stride, sc);
    }
}

// P @ V of one block for G query heads of a group (acc [G][D] fp32, probs [G] rows `probs_stride`
// apart, bf16 pairs, vp as pair_values_dpbf16 lays it out): a pair's V registers loaded once for
// the G heads, and 2 G independent chains of dpbf16 instead of 2 (one head at a time waited on
// the instruction's latency). Each accumulator's sum is the same in the same order.
template <int G>
NS_AVX512_BF16 inline void block_values_dpbf16(float* acc, int D, const uint32_t* probs, int64_t probs_stride,
                                               const __m512i* vp, int chunks, int num_pairs) {
    for (int c = 0; c < chunks; ++c) {
        __m512 lo[G], hi[G];
        for (int g = 0; g < G; ++g) {
            lo[g] = _mm512_loadu_ps(acc + static_cast<int64_t>(g) * D + 32 * c);
            hi[g] = _mm512_loadu_ps(acc + static_cast<int64_t>(g) * D + 32 * c + 16);
        }
        for (int t = 0; t < num_pairs; ++t) {
            const __m512bh v0 = reinterpret_cast<__m512bh>(vp[(t * chunks + c) * 2]);
            const __m512bh v1 = reinterpret_cast<__m512bh>(vp[(t * chunks + c) * 2 + 1]);
            for (int g = 0; g < G; ++g) {
                const __m512bh pb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(probs[g * probs_stride + t])));
                lo[g] = _mm512_dpbf16_ps(lo[g], pb, v0);
                hi[g] = _mm512_dpbf16_ps(hi[g], pb, v1);
            }
        }
        for (int g = 0; g < G; ++g) {
            _mm512_storeu_ps(acc + static_cast<int64_t>(g) * D + 32 * c, lo[g]);
            _mm512_storeu_ps(acc + static_cast<int64_t>(g) * D + 32 * c + 16, hi[g]);
        }
    }
}

// Paged attention for bf16 with 16-token blocks and head_dim a multiple of 32 (<= 256): the
// scores of a block's 16 keys come out in one register (bf16 dot products, fp32 sums).
NS_AVX512_BF16 void paged_attention_bf16_block16(
        uint16_t* out, const uint16_t* query, int64_t q_stride_token, int64_t q_stride_head,
        const uint16_t* key_cache, const uint16_t* value_cache, int num_kv_heads, int head_dim,
        const int32_t* block_table, int64_t block_table_stride, const int32_t* cu_seqlens_q,
        const int32_t* seq_lens, int num_heads, float scale, const std::vector<int32_t>& items,
        int rows_per_item) {
    constexpr int BS = 16;
    const int group = num_heads / num_kv_heads;
    const int D = head_dim;
    const int chunks = D / 32;   // bf16 pairs per register
    const int64_t num_items = static_cast<int64_t>(items.size() / 3);
    const float scale_log2 = scale * kLog2E;
    const int max_vectors = rows_per_item * group;
    const bool parallel_work = attention_worth_threads(items, seq_lens, rows_per_item);
#pragma omp parallel if (parallel_work)
    {
        std::vector<uint16_t> qb(static_cast<size_t>(max_vectors) * D);  // bf16 query rows
        SoftmaxRows state(max_vectors, D);
        // One block's V as pair_values_dpbf16 lays it out; the accumulators follow that order
        // and are put back in d order at the end.
        std::vector<__m512i> vp(static_cast<size_t>(BS / 2) * chunks * 2);
        __m512 partial[BS];
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            const WorkItem w = work_item(items, item, cu_seqlens_q, seq_lens, rows_per_item);
            const int s = w.seq, h = w.head, r0 = w.first_row, q_start = w.q_start, seq_len = w.seq_len;
            const int context = w.context, rows = w.rows;
            const int vectors = rows * group;
            for (int i = 0; i < rows; ++i)
                for (int g = 0; g < group; ++g) {
                    const uint16_t* src = query + static_cast<int64_t>(q_start + r0 + i) * q_stride_token +
                                          static_cast<int64_t>(h * group + g) * q_stride_head;
                    std::memcpy(&qb[static_cast<size_t>(i * group + g) * D], src, sizeof(uint16_t) * D);
                }
            state.reset(vectors, D);
            std::vector<float>& acc = state.acc;
            std::vector<float>& row_max = state.row_max;
            std::vector<float>& row_sum = state.row_sum;
            const int num_blocks = w.num_blocks(BS);
            const int32_t* table = block_table + static_cast<int64_t>(s) * block_table_stride;
            for (int b = 0; b < num_blocks; ++b) {
                const int64_t base = (static_cast<int64_t>(table[b]) * num_kv_heads + h) * BS * D;
                const uint16_t* kb = key_cache + base;
                const uint16_t* vb = value_cache + base;
                const int first_key = b * BS;
                const int valid_keys = seq_len - first_key < BS ? seq_len - first_key : BS;
                pair_values_dpbf16(vp.data(), vb, D, chunks, valid_keys);
                for (int i = 0; i < rows; ++i) {
                    const int position = context + r0 + i;
                    if (position < first_key) continue;  // this block is wholly in the row's future
                    const int allowed = position - first_key + 1 < BS ? position - first_key + 1 : BS;
                    const __mmask16 keep = static_cast<__mmask16>((1u << allowed) - 1u);
                    for (int g = 0; g < group; ++g) {
                        const int v = i * group + g;
                        const uint16_t* qv = &qb[static_cast<size_t>(v) * D];
                        for (int j = 0; j < BS; ++j) {
                            const uint16_t* kj = kb + static_cast<int64_t>(j) * D;
                            __m512 dot = _mm512_setzero_ps();
                            for (int c = 0; c < chunks; ++c) {
                                const __m512i k = _mm512_loadu_si512(reinterpret_cast<const void*>(kj + 32 * c));
                                const __m512i q = _mm512_loadu_si512(reinterpret_cast<const void*>(qv + 32 * c));
                                dot = _mm512_dpbf16_ps(dot, reinterpret_cast<__m512bh>(q), reinterpret_cast<__m512bh>(k));
                            }
                            partial[j] = dot;
                        }
                        const __m512 scores = _mm512_mul_ps(transpose_sum16(partial), _mm512_set1_ps(scale_log2));
                        const float block_max = _mm512_mask_reduce_max_ps(keep, scores);
                        const float new_max = block_max > row_max[v] ? block_max : row_max[v];
                        const float correction =
                            _mm512_cvtss_f32(exp2x16(_mm512_set1_ps(row_max[v] - new_max)));
                        const __m512 probs = _mm512_maskz_mov_ps(
                            keep, exp2x16(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
                        row_sum[v] = row_sum[v] * correction + _mm512_reduce_add_ps(probs);
                        row_max[v] = new_max;
                        // P @ V with probabilities rounded to bf16 (as torch's bf16 attention
                        // multiplies them), two keys per dpbf16.
                        alignas(32) uint32_t pairs[BS / 2];
                        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), to_bf16x16(probs));
                        const int num_pairs = (allowed + 1) / 2;
                        float* av = &acc[static_cast<size_t>(v) * D];
                        const __m512 corr = _mm512_set1_ps(correction);
                        for (int c = 0; c < chunks; ++c) {
                            __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(av + 32 * c), corr);
                            __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(av + 32 * c + 16), corr);
                            for (int t = 0; t < num_pairs; ++t) {
                                const __m512bh pb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pairs[t])));
                                lo = _mm512_dpbf16_ps(lo, pb, reinterpret_cast<__m512bh>(vp[(t * chunks + c) * 2]));
                                hi = _mm512_dpbf16_ps(hi, pb, reinterpret_cast<__m512bh>(vp[(t * chunks + c) * 2 + 1]));
                            }
                            _mm512_storeu_ps(av + 32 * c, lo);
                            _mm512_storeu_ps(av + 32 * c + 16, hi);
                        }
                    }
                }
            }
            for (int i = 0; i < rows; ++i)
                for (int g = 0; g < group; ++g) {
                    const int v = i * group + g;
                    const __m512 inv = _mm512_set1_ps(1.0f / row_sum[v]);
                    uint16_t* dst = out + (static_cast<int64_t>(q_start + r0 + i) * num_heads + h * group + g) * D;
                    const float* av = &acc[static_cast<size_t>(v) * D];
                    // unpacklo held d {0-3, 8-11, 16-19, 24-27} of each 32, unpackhi the others.
                    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
                    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
                    for (int c = 0; c < chunks; ++c) {
                        const __m512 lo = _mm512_loadu_ps(av + 32 * c), hi = _mm512_loadu_ps(av + 32 * c + 16);
                        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * c),
                                            to_bf16x16(_mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv)));
                        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * c + 16),
                                            to_bf16x16(_mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv)));
                    }
                }
        }
    }
}

// Decode rows (sequences with one new row) for bf16 with 16-token blocks: two passes over the
// context instead of an online softmax. Pass 1 reads each K block once for the group's query
// heads and keeps every score; then one max and one exp per score; pass 2 reads each V block once
// and accumulates P @ V with no per-block rescaling. A row's arithmetic depends on its own
// sequence alone (not on the batch, the thread count or the other rows), as the span kernel's.
template <int kChunks>  // head_dim / 32; 0: read it from head_dim
NS_AVX512_BF16 void decode_attention_bf16_block16(
        uint16_t* out, const uint16_t* query, int64_t q_stride_token, int64_t q_stride_head,
        const uint16_t* key_cache, const uint16_t* value_cache, int num_kv_heads, int head_dim,
        const int32_t* block_table, int64_t block_table_stride, const int32_t* cu_seqlens_q,
        const int32_t* seq_lens, int num_seqs, int num_heads, float scale) {
    constexpr int BS = 16;
    const int group = num_heads / num_kv_heads;
    const int D = head_dim;
    const int chunks = kChunks ? kChunks : D / 32;
    const float scale_log2 = scale * kLog2E;
    const int64_t num_items = static_cast<int64_t>(num_seqs) * num_kv_heads;
    const bool parallel_work = decodes_worth_threads(seq_lens, num_seqs, num_kv_heads);
#pragma omp parallel if (parallel_work)
    {
        std::vector<float> scores;     // [group][padded keys]
        std::vector<uint32_t> probs;   // [group][padded keys / 2]: bf16 pairs of probabilities
        std::vector<float> acc(static_cast<size_t>(group) * D);
        std::vector<float> row_sum(group);
        std::vector<__m512i> vp(static_cast<size_t>(BS / 2) * chunks * 2);  // as in the span kernel
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            const int s = static_cast<int>(item / num_kv_heads), h = static_cast<int>(item % num_kv_heads);
            const int row = cu_seqlens_q[s], seq_len = seq_lens[s];
            const int num_blocks = (seq_len + BS - 1) / BS;
            const int padded = num_blocks * BS;
            if (scores.size() < static_cast<size_t>(group) * padded) {
                scores.resize(static_cast<size_t>(group) * padded);
                probs.resize(static_cast<size_t>(group) * padded / 2);
            }
            const int32_t* table = block_table + static_cast<int64_t>(s) * block_table_stride;
            const int64_t head_stride = static_cast<int64_t>(BS) * D;  // elements of one block's head
            auto block_base = [&](int b) { return (static_cast<int64_t>(table[b]) * num_kv_heads + h) * head_stride; };
            // Pass 1: scores, K read once per block for every query head of the group.
            for (int b = 0; b < num_blocks; ++b) {
                const uint16_t* kb = key_cache + block_base(b);
                // The next block's K, or after the last one the first block's V, prefetched a row a
                // key between the dot products (and V's next block between pair_values' loads): 32
                // prefetches at once at a block's start stalled on the core's outstanding misses.
                const uint16_t* next_kb = b + 1 < num_blocks ? key_cache + block_base(b + 1) : value_cache + block_base(0);
                const int valid = seq_len - b * BS < BS ? seq_len - b * BS : BS;
                const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1u);
                for (int g = 0; g < group; g += 4) {
                    const uint16_t* qv = query + static_cast<int64_t>(row) * q_stride_token +
                                         static_cast<int64_t>(h * group + g) * q_stride_head;
                    float* sc = &scores[static_cast<size_t>(g) * padded + b * BS];
                    const uint16_t* next = g == 0 ? next_kb : nullptr;
                    switch (group - g < 4 ? group - g : 4) {
                        case 4: block_scores_dpbf16<4>(sc, padded, qv, q_stride_head, kb, D, chunks, next, keep, scale_log2); break;
                        case 3: block_scores_dpbf16<3>(sc, padded, qv, q_stride_head, kb, D, chunks, next, keep, scale_log2); break;
                        case 2: block_scores_dpbf16<2>(sc, padded, qv, q_stride_head, kb, D, chunks, next, keep, scale_log2); break;
                        default: block_scores_dpbf16<1>(sc, padded, qv, q_stride_head, kb, D, chunks, next, keep, scale_log2); break;
                    }
                }
            }
            // Softmax: one max and one exp per score; probabilities rounded to bf16 for P @ V
            // (as torch's bf16 attention multiplies them), their sum kept in fp32 unrounded.
            const __mmask16 last_keep = static_cast<__mmask16>((1u << (seq_len - (num_blocks - 1) * BS)) - 1u);
            for (int g = 0; g < group; ++g)
                row_sum[g] = ns_simd::softmax_bf16(reinterpret_cast<uint16_t*>(&probs[static_cast<size_t>(g) * padded / 2]),
                                                   &scores[static_cast<size_t>(g) * padded], num_blocks, last_keep);
            // Pass 2: P @ V, V read once per block, two keys per dpbf16.
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int b = 0; b < num_blocks; ++b) {
                const uint16_t* vb = value_cache + block_base(b);
                const int valid = seq_len - b * BS < BS ? seq_len - b * BS : BS;
                pair_values_dpbf16(vp.data(), vb, D, chunks, valid,
                                   b + 1 < num_blocks ? value_cache + block_base(b + 1) : nullptr);
                const int num_pairs = (valid + 1) / 2;
                const int64_t stride = padded / 2;
                for (int g = 0; g < group; g += 4) {
                    const uint32_t* pairs = &probs[static_cast<size_t>(g) * stride + b * BS / 2];
                    float* av = &acc[static_cast<size_t>(g) * D];
                    switch (group - g < 4 ? group - g : 4) {
                        case 4: block_values_dpbf16<4>(av, D, pairs, stride, vp.data(), chunks, num_pairs); break;
                        case 3: block_values_dpbf16<3>(av, D, pairs, stride, vp.data(), chunks, num_pairs); break;
                        case 2: block_values_dpbf16<2>(av, D, pairs, stride, vp.data(), chunks, num_pairs); break;
                        default: block_values_dpbf16<1>(av, D, pairs, stride, vp.data(), chunks, num_pairs); break;
                    }
                }
            }
            const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
            const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
            for (int g = 0; g < group; ++g) {
                const __m512 inv = _mm512_set1_ps(1.0f / row_sum[g]);
                uint16_t* dst = out + (static_cast<int64_t>(row) * num_heads + h * group + g) * D;
                const float* av = &acc[static_cast<size_t>(g) * D];
                for (int c = 0; c < chunks; ++c) {  // back to d order (see the span kernel)
                    const __m512 lo = _mm512_loadu_ps(av + 32 * c), hi = _mm512_loadu_ps(av + 32 * c + 16);
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * c),
                                        to_bf16x16(_mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv)));
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * c + 16),
                                        to_bf16x16(_mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv)));
                }
            }
        }
    }
}

// rms_norm for bf16 rows whose length is a multiple of 16: the generic loop below, in registers.
NS_AVX512_BF16 void rms_norm_bf16(uint16_t* out, uint16_t* new_residual, const uint16_t* x, const uint16_t* residual,
                                  const uint16_t* weight, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel if (rows * hidden >= kParallelElements)
    {
        std::vector<float> row(hidden);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const uint16_t* xr = x + r * hidden;
            __m512 squares = _mm512_setzero_ps();
            for (int64_t i = 0; i < hidden; i += 16) {
                __m512 v = load_bf16x16(xr + i);
                if (residual != nullptr) {
                    const __m256i sum = to_bf16x16(_mm512_add_ps(v, load_bf16x16(residual + r * hidden + i)));
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(new_residual + r * hidden + i), sum);
                    v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(sum), 16));
                }
                _mm512_storeu_ps(&row[i], v);
                squares = _mm512_fmadd_ps(v, v, squares);
            }
            const float square_sum = _mm512_reduce_add_ps(squares);
            const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(square_sum / static_cast<float>(hidden) + eps));
            uint16_t* o = out + r * hidden;
            for (int64_t i = 0; i < hidden; i += 16) {
                const __m512 normed = round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(&row[i]), inv));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), to_bf16x16(_mm512_mul_ps(normed, load_bf16x16(weight + i))));
            }
        }
    }
}

// argmax_rows for bf16 in two vector passes per row (the row stays in L2): its largest value,
// then the first index holding it. A row with a NaN takes the scalar loop (NaN wins, as in torch).
NS_AVX512_BF16 bool argmax_row_bf16(int64_t* out, const uint16_t* xr, int64_t cols) {
    const int64_t whole = cols / 16 * 16;
    __m512 best = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < whole; i += 16) {
        const __m512 v = load_bf16x16(xr + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_max_ps(best, v);
    }
    if (nan) return false;
    float top = _mm512_reduce_max_ps(best);
    for (int64_t i = whole; i < cols; ++i) {
        const float v = ns_bf16::to_float(xr[i]);
        if (v != v) return false;
        top = v > top ? v : top;
    }
    const __m512 target = _mm512_set1_ps(top);
    for (int64_t i = 0; i < whole; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(load_bf16x16(xr + i), target, _CMP_EQ_OQ);
        if (hit) {
            *out = i + __builtin_ctz(hit);
            return true;
        }
    }
    for (int64_t i = whole; i < cols; ++i)
        if (ns_bf16::to_float(xr[i]) == top) {
            *out = i;
            return true;
        }
    return false;  // all -inf with no tail hit cannot happen: -inf == -inf
}

NS_AVX512_BF16 void silu_and_mul_bf16(uint16_t* out, const uint16_t* gate_up, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* gate = gate_up + r * 2 * inter;
        const uint16_t* up = gate + inter;
        uint16_t* o = out + r * inter;
        int64_t i = 0;
        for (; i + 16 <= inter; i += 16) {
            const __m512 g = load_bf16x16(gate + i);
            const __m512 e = exp2x16(_mm512_mul_ps(g, _mm512_set1_ps(-kLog2E)));
            const __m512 silu = round_bf16x16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), to_bf16x16(_mm512_mul_ps(silu, load_bf16x16(up + i))));
        }
        for (; i < inter; ++i) {  // tail: same arithmetic, one lane at a time
            const __m512 g = _mm512_set1_ps(ns_bf16::to_float(gate[i]));
            const __m512 e = exp2x16(_mm512_mul_ps(g, _mm512_set1_ps(-kLog2E)));
            const float silu = _mm512_cvtss_f32(round_bf16x16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e))));
            o[i] = ns_bf16::from_float(silu * ns_bf16::to_float(up[i]));
        }
    }
}

// ---- AVX2 + FMA decode path ------------------------------------------------------------------
// The CPUs without AVX-512 (Zen 2/3, Haswell to Alder Lake): bf16 decodes take the two passes of
// the AVX-512 kernel above on fp32 FMAs, K and V widened 8 at a time. A score is q (pre-scaled by
// scale * log2 e, as the plain loops) times k: per lane, the D / 8 chunks in order, then a fixed
// tree over the 8 lanes; probabilities stay fp32; P @ V adds the keys in order. Each row's
// arithmetic depends on its own sequence alone, as everywhere here. (The plain loops, with a
// horizontal sum a key and an online rescale a block, were 1.9-2.5x slower on a Zen 3 EPYC, K/V
// from memory: benchmarks/ab_kernels.py levels.)

#define NS_AVX2_OPS __attribute__((target("avx2,fma")))

// 2^x for x <= 0 (a score minus its row's max), relative error ~1e-7, 2^0 exactly 1; below -126 it
// stays at 2^-126, as exp2_clamped. The same polynomial as exp2_clamped and exp2x16.
NS_AVX2_OPS inline __m256 exp2x8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5403530e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Lane j of the result is the sum of the 8 lanes of v[j] (a fixed tree: pairs, quads, halves).
NS_AVX2_OPS inline __m256 transpose_sum8(const __m256* v) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Pass 1 for GT query heads of a group (qf: their pre-scaled rows, D floats each) against the
// `valid` keys of one block from key j0 on (at most 8), each key widened once for the GT heads: 8
// scores a head into sc[t * stride], the keys past `valid` -inf (never read: they may never have
// been written).
template <int GT>
NS_AVX2_OPS void block_scores_avx2(float* sc, int64_t stride, const float* qf, int D, const uint16_t* kb, int j0, int valid,
                                   const uint16_t* next) {
    __m256 partial[GT][8];
    const int keys = valid - j0 < 0 ? 0 : valid - j0 < 8 ? valid - j0 : 8;
    for (int j = 0; j < keys; ++j) {
        const uint16_t* kj = kb + static_cast<int64_t>(j0 + j) * D;
        if (next != nullptr)  // a later block's row, spread between the multiply-adds
            for (int c = 0; c < D; c += 32) __builtin_prefetch(next + static_cast<int64_t>(j0 + j) * D + c, 0, 3);
        __m256 acc[GT];
        for (int t = 0; t < GT; ++t) acc[t] = _mm256_setzero_ps();
        for (int c = 0; c < D; c += 8) {
            const __m256 k = ns_bf16::to_float_x8(kj + c);
            for (int t = 0; t < GT; ++t) acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + t * D + c), k, acc[t]);
        }
        for (int t = 0; t < GT; ++t) partial[t][j] = acc[t];
    }
    for (int j = keys; j < 8; ++j)
        for (int t = 0; t < GT; ++t) partial[t][j] = _mm256_setzero_ps();
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 outside = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(keys)), _CMP_GE_OQ);
    for (int t = 0; t < GT; ++t)
        _mm256_storeu_ps(sc + t * stride, _mm256_blendv_ps(transpose_sum8(partial[t]), _mm256_set1_ps(-INFINITY), outside));
}

// Pass 2 for GT heads, one block's `valid` values, 16 columns from `col`: acc[t * D + col ..] +=
// p * v over the block's keys in order.
template <int GT>
NS_AVX2_OPS void block_values_avx2(float* acc, int D, const float* probs, int64_t stride, const uint16_t* vb, int valid,
                                   int col, const uint16_t* next) {
    __m256 lo[GT], hi[GT];
    for (int t = 0; t < GT; ++t) {
        lo[t] = _mm256_loadu_ps(acc + t * D + col);
        hi[t] = _mm256_loadu_ps(acc + t * D + col + 8);
    }
    for (int j = 0; j < valid; ++j) {
        if (next != nullptr)
            for (int c = 0; c < D; c += 32) __builtin_prefetch(next + static_cast<int64_t>(j) * D + c, 0, 3);
        const __m256 v0 = ns_bf16::to_float_x8(vb + static_cast<int64_t>(j) * D + col);
        const __m256 v1 = ns_bf16::to_float_x8(vb + static_cast<int64_t>(j) * D + col + 8);
        for (int t = 0; t < GT; ++t) {
            const __m256 p = _mm256_broadcast_ss(probs + t * stride + j);
            lo[t] = _mm256_fmadd_ps(p, v0, lo[t]);
            hi[t] = _mm256_fmadd_ps(p, v1, hi[t]);
        }
    }
    for (int t = 0; t < GT; ++t) {
        _mm256_storeu_ps(acc + t * D + col, lo[t]);
        _mm256_storeu_ps(acc + t * D + col + 8, hi[t]);
    }
}

// A block's head (16 bf16 rows of D) into the cache, ahead of its use. (__builtin_prefetch: GCC 12
// dropped _mm_prefetch from this helper once inlined into the target("avx2,fma") kernel.)
NS_AVX2_OPS inline void prefetch_block(const uint16_t* block, int D) {
    if (block == nullptr) return;
    const char* p = reinterpret_cast<const char*>(block);
    const int64_t bytes = static_cast<int64_t>(16) * D * static_cast<int64_t>(sizeof(uint16_t));
    for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(p + byte, 0, 3);
}

// Blocks prefetched ahead of the one being read: each K or V block of a head is one 2 KB run at
// head_dim 64, the pool's blocks lie anywhere, and a decode step reads its layer's from memory
// (1.25x on a Zen 3 EPYC; 2 and 4 ahead measured the same). The first ones at once, then a later
// block's rows one a key between the multiply-adds: a block's 32 prefetches at once waited on the
// core's outstanding misses (spread: 1.0-1.4x per layer from memory at this level on a Zen 4 EPYC).
constexpr int kPrefetchBlocks = 2;

// bf16 decode rows (every sequence one new row) with 16-token blocks and head_dim a multiple of 16.
NS_AVX2_OPS void decode_attention_avx2(uint16_t* out, const uint16_t* query, int64_t q_stride_token,
                                       int64_t q_stride_head, const uint16_t* key_cache, const uint16_t* value_cache,
                                       int num_kv_heads, int head_dim, const int32_t* block_table,
                                       int64_t block_table_stride, const int32_t* cu_seqlens_q, const int32_t* seq_lens,
                                       int num_seqs, int num_heads, float scale) {
    using T = uint16_t;
    constexpr int BS = 16;
    const int group = num_heads / num_kv_heads;
    const int D = head_dim;
    const float q_scale = scale * kLog2E;
    const int64_t num_items = static_cast<int64_t>(num_seqs) * num_kv_heads;
    const bool parallel_work = decodes_worth_threads(seq_lens, num_seqs, num_kv_heads);
#pragma omp parallel if (parallel_work)
    {
        std::vector<float> qf(static_cast<size_t>(group) * D), acc(static_cast<size_t>(group) * D);
        std::vector<float> scores;  // [group][padded keys]: scores, then probabilities in place
        std::vector<float> row_sum(group);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            const int s = static_cast<int>(item / num_kv_heads), h = static_cast<int>(item % num_kv_heads);
            const int row = cu_seqlens_q[s], seq_len = seq_lens[s];
            const int num_blocks = (seq_len + BS - 1) / BS;
            const int64_t padded = static_cast<int64_t>(num_blocks) * BS;
            if (scores.size() < static_cast<size_t>(group * padded)) scores.resize(static_cast<size_t>(group * padded));
            const int32_t* table = block_table + static_cast<int64_t>(s) * block_table_stride;
            auto block_of = [&](const T* cache, int b) {
                return b < num_blocks ? cache + (static_cast<int64_t>(table[b]) * num_kv_heads + h) * BS * D : nullptr;
            };
            for (int g = 0; g < group; ++g) {
                const T* src = query + static_cast<int64_t>(row) * q_stride_token + static_cast<int64_t>(h * group + g) * q_stride_head;
                for (int d = 0; d < D; ++d) qf[static_cast<size_t>(g) * D + d] = BF16::load(src, d) * q_scale;
            }
            // Pass 1: K block by block, up to 4 heads of the group at a time.
            for (int b = 0; b < kPrefetchBlocks; ++b) prefetch_block(block_of(key_cache, b), D);
            for (int b = 0; b < num_blocks; ++b) {
                const int valid = seq_len - b * BS < BS ? seq_len - b * BS : BS;
                const T* kb = block_of(key_cache, b);
                const T* ahead = block_of(key_cache, b + kPrefetchBlocks);
                for (int g = 0; g < group; g += 4) {
                    const int gt = group - g < 4 ? group - g : 4;
                    float* sc = scores.data() + g * padded + b * BS;
                    const float* q = qf.data() + static_cast<size_t>(g) * D;
                    const T* next = g == 0 ? ahead : nullptr;
                    for (int j0 = 0; j0 < BS; j0 += 8) {
                        switch (gt) {
                            case 4: block_scores_avx2<4>(sc + j0, padded, q, D, kb, j0, valid, next); break;
                            case 3: block_scores_avx2<3>(sc + j0, padded, q, D, kb, j0, valid, next); break;
                            case 2: block_scores_avx2<2>(sc + j0, padded, q, D, kb, j0, valid, next); break;
                            default: block_scores_avx2<1>(sc + j0, padded, q, D, kb, j0, valid, next); break;
                        }
                    }
                }
            }
            // Softmax: one max and one exp a score; masked keys (-inf) get probability 0.
            for (int b = 0; b < kPrefetchBlocks; ++b) prefetch_block(block_of(value_cache, b), D);
            for (int g = 0; g < group; ++g) {
                float* sc = scores.data() + g * padded;
                __m256 m = _mm256_set1_ps(-INFINITY);
                for (int64_t i = 0; i < padded; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sc + i));
                alignas(32) float lanes[8];
                _mm256_store_ps(lanes, m);
                float top = lanes[0];
                for (int i = 1; i < 8; ++i) top = lanes[i] > top ? lanes[i] : top;
                __m256 sum = _mm256_setzero_ps();
                for (int64_t i = 0; i < padded; i += 8) {
                    const __m256 x = _mm256_loadu_ps(sc + i);
                    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                    const __m256 p = _mm256_and_ps(exp2x8(_mm256_sub_ps(x, _mm256_set1_ps(top))), keep);
                    sum = _mm256_add_ps(sum, p);
                    _mm256_storeu_ps(sc + i, p);
                }
                _mm256_store_ps(lanes, sum);
                row_sum[g] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
            }
            // Pass 2: P @ V block by block, 16 columns of up to 3 heads at a time.
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int b = 0; b < num_blocks; ++b) {
                const int valid = seq_len - b * BS < BS ? seq_len - b * BS : BS;
                const T* vb = block_of(value_cache, b);
                const T* ahead = block_of(value_cache, b + kPrefetchBlocks);
                for (int g = 0; g < group; g += 3) {
                    const int gt = group - g < 3 ? group - g : 3;
                    const float* p = scores.data() + g * padded + b * BS;
                    float* a = acc.data() + static_cast<size_t>(g) * D;
                    for (int col = 0; col < D; col += 16) {
                        const T* next = g == 0 && col == 0 ? ahead : nullptr;
                        switch (gt) {
                            case 3: block_values_avx2<3>(a, D, p, padded, vb, valid, col, next); break;
                            case 2: block_values_avx2<2>(a, D, p, padded, vb, valid, col, next); break;
                            default: block_values_avx2<1>(a, D, p, padded, vb, valid, col, next); break;
                        }
                    }
                }
            }
            for (int g = 0; g < group; ++g) {
                const float inv = 1.0f / row_sum[g];
                T* dst = out + (static_cast<int64_t>(row) * num_heads + h * group + g) * D;
                const float* av = acc.data() + static_cast<size_t>(g) * D;
                for (int d = 0; d < D; ++d) BF16::store(dst, d, av[d] * inv);
            }
        }
    }
}

template <typename S>
void paged_attention(typename S::T* out, const typename S::T* query, int64_t q_stride_token,
                     int64_t q_stride_head, const typename S::T* key_cache,
                     const typename S::T* value_cache, int num_kv_heads, int block_size,
                     int head_dim, const int32_t* block_table, int64_t block_table_stride,
                     const int32_t* cu_seqlens_q, const int32_t* seq_lens, int num_seqs,
                     int num_heads, float scale, int rows_per_item) {
    using T = typename S::T;
    const int group = num_heads / num_kv_heads;
    const int D = head_dim;
    const int BS = block_size;
    bool all_decodes = true;
    for (int s = 0; s < num_seqs; ++s) all_decodes = all_decodes && cu_seqlens_q[s + 1] - cu_seqlens_q[s] == 1;
    if constexpr (std::is_same_v<T, uint16_t>) {
        // Every sequence has one new row: bf16 decodes, on a kernel of their own (fp32 keeps the
        // plain loops, whose decode rows have the bits of the same rows in a prompt span).
        if (all_decodes && BS == 16 && D % 32 == 0 && D <= 256 && use_avx512_bf16()) {
            auto decode = D == 64 ? decode_attention_bf16_block16<2>
                        : D == 128 ? decode_attention_bf16_block16<4> : decode_attention_bf16_block16<0>;
            decode(out, query, q_stride_token, q_stride_head, key_cache, value_cache, num_kv_heads, D, block_table,
                   block_table_stride, cu_seqlens_q, seq_lens, num_seqs, num_heads, scale);
            return;
        }
        if (all_decodes && BS == 16 && D % 16 == 0 && D <= 256 && ns_isa::current() >= ns_isa::kAvx2) {
            decode_attention_avx2(out, query, q_stride_token, q_stride_head, key_cache, value_cache, num_kv_heads, D,
                                  block_table, block_table_stride, cu_seqlens_q, seq_lens, num_seqs, num_heads, scale);
            return;
        }
    }
    // Work items: (sequence, KV head, first query row); a row tile shares each K/V block load.
    std::vector<int32_t> items;
    for (int s = 0; s < num_seqs; ++s) {
        int q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        for (int h = 0; h < num_kv_heads; ++h)
            for (int r = 0; r < q_len; r += rows_per_item) {
                items.push_back(s);
                items.push_back(h);
                items.push_back(r);
            }
    }
    if constexpr (std::is_same_v<T, uint16_t>) {
        if (BS == 16 && D % 32 == 0 && D <= 256 && use_avx512_bf16()) {
            paged_attention_bf16_block16(out, query, q_stride_token, q_stride_head, key_cache, value_cache,
                                         num_kv_heads, D, block_table, block_table_stride, cu_seqlens_q,
                                         seq_lens, num_heads, scale, items, rows_per_item);
            return;
        }
    }
    const int64_t num_items = static_cast<int64_t>(items.size() / 3);
    const float q_scale = scale * kLog2E;
    const int max_vectors = rows_per_item * group;
    const bool parallel_work = attention_worth_threads(items, seq_lens, rows_per_item);
#pragma omp parallel if (parallel_work)
    {
        std::vector<float> qf(static_cast<size_t>(max_vectors) * D);
        SoftmaxRows state(max_vectors, D);
        std::vector<float> scores(BS), probs(BS);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            const WorkItem w = work_item(items, item, cu_seqlens_q, seq_lens, rows_per_item);
            const int s = w.seq, h = w.head, r0 = w.first_row, q_start = w.q_start;
            const int context = w.context, rows = w.rows;
            const int vectors = rows * group;
            for (int i = 0; i < rows; ++i)
                for (int g = 0; g < group; ++g) {
                    const T* src = query + static_cast<int64_t>(q_start + r0 + i) * q_stride_token +
                                   static_cast<int64_t>(h * group + g) * q_stride_head;
                    float* dst = &qf[static_cast<size_t>(i * group + g) * D];
                    for (int d = 0; d < D; ++d) dst[d] = S::load(src, d) * q_scale;
                }
            state.reset(vectors, D);
            std::vector<float>& acc = state.acc;
            std::vector<float>& row_max = state.row_max;
            std::vector<float>& row_sum = state.row_sum;
            const int num_blocks = w.num_blocks(BS);
            const int32_t* table = block_table + static_cast<int64_t>(s) * block_table_stride;
            for (int b = 0; b < num_blocks; ++b) {
                const int64_t base = (static_cast<int64_t>(table[b]) * num_kv_heads + h) * BS * D;
                const T* kb = key_cache + base;
                const T* vb = value_cache + base;
                const int first_key = b * BS;
                for (int i = 0; i < rows; ++i) {
                    const int position = context + r0 + i;
                    if (position < first_key) continue;  // this block is wholly in the row's future
                    // Keys this row may see in this block; never-written slots are never read.
                    const int allowed = position - first_key + 1 < BS ? position - first_key + 1 : BS;
                    for (int g = 0; g < group; ++g) {
                        const int v = i * group + g;
                        const float* qv = &qf[static_cast<size_t>(v) * D];
                        float block_max = -INFINITY;
                        for (int j = 0; j < allowed; ++j) {
                            const T* kj = kb + static_cast<int64_t>(j) * D;
                            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                            for (int d = 0; d < D; ++d) dot += qv[d] * S::load(kj, d);
                            scores[j] = dot;
                            block_max = dot > block_max ? dot : block_max;
                        }
                        const float new_max = block_max > row_max[v] ? block_max : row_max[v];
                        const float correction = exp2_clamped(row_max[v] - new_max);
#pragma omp simd
                        for (int j = 0; j < BS; ++j) probs[j] = exp2_clamped(scores[j] - new_max);
                        float block_sum = 0.0f;
                        for (int j = 0; j < allowed; ++j) block_sum += probs[j];
                        row_sum[v] = row_sum[v] * correction + block_sum;
                        row_max[v] = new_max;
                        float* av = &acc[static_cast<size_t>(v) * D];
#pragma omp simd
                        for (int d = 0; d < D; ++d) av[d] *= correction;
                        for (int j = 0; j < allowed; ++j) {
                            const float pj = probs[j];
                            const T* vj = vb + static_cast<int64_t>(j) * D;
#pragma omp simd
                            for (int d = 0; d < D; ++d) av[d] += pj * S::load(vj, d);
                        }
                    }
                }
            }
            for (int i = 0; i < rows; ++i)
                for (int g = 0; g < group; ++g) {
                    const int v = i * group + g;
                    const float inv = 1.0f / row_sum[v];
                    T* dst = out + (static_cast<int64_t>(q_start + r0 + i) * num_heads + h * group + g) * D;
                    const float* av = &acc[static_cast<size_t>(v) * D];
                    for (int d = 0; d < D; ++d) S::store(dst, d, av[d] * inv);
                }
        }
    }
}

// out = rms_norm(x (+ residual)) * weight; with a residual, new_residual = x + residual.
// Rounding as the reference: the sum rounds to the storage type, the normalized row rounds
// before the weight multiplies it.
template <typename S>
void rms_norm(typename S::T* out, typename S::T* new_residual, const typename S::T* x,
              const typename S::T* residual, const typename S::T* weight, int64_t rows,
              int64_t hidden, float eps) {
    using T = typename S::T;
#pragma omp parallel if (rows * hidden >= kParallelElements)
    {
        std::vector<float> row(hidden);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const T* xr = x + r * hidden;
            if (residual != nullptr) {
                const T* rr = residual + r * hidden;
                T* nr = new_residual + r * hidden;
                for (int64_t i = 0; i < hidden; ++i) {
                    float sum = S::round(S::load(xr, i) + S::load(rr, i));
                    row[i] = sum;
                    S::store(nr, i, sum);
                }
            } else {
                for (int64_t i = 0; i < hidden; ++i) row[i] = S::load(xr, i);
            }
            float square_sum = 0.0f;  // in SIMD lanes: a serial sum is a 4-cycle chain per element
#pragma omp simd reduction(+ : square_sum)
            for (int64_t i = 0; i < hidden; ++i) square_sum += row[i] * row[i];
            const float inv = 1.0f / std::sqrt(square_sum / static_cast<float>(hidden) + eps);
            T* o = out + r * hidden;
            for (int64_t i = 0; i < hidden; ++i)
                S::store(o, i, S::round(row[i] * inv) * S::load(weight, i));
        }
    }
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i], silu rounded first, as torch.
template <typename S>
void silu_and_mul(typename S::T* out, const typename S::T* gate_up, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
        const typename S::T* gate = gate_up + r * 2 * inter;
        const typename S::T* up = gate + inter;
        typename S::T* o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) {
            const float g = S::load(gate, i);
            const float silu = S::round(g / (1.0f + exp2_clamped(-g * kLog2E)));
            S::store(o, i, silu * S::load(up, i));
        }
    }
}

// Index of the largest value of each row (the first one on ties, as torch.argmax).
template <typename S>
void argmax_rows(int64_t* out, const typename S::T* x, int64_t rows, int64_t cols, int64_t row_stride) {
#pragma omp parallel for schedule(static) if (rows * cols >= 4 * kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
        const typename S::T* xr = x + r * row_stride;
        if constexpr (std::is_same_v<S, BF16>) {
            if (use_avx512_bf16() && argmax_row_bf16(out + r, xr, cols)) continue;
        }
        float best = -INFINITY;
        int64_t best_index = 0;
        bool found = false;
        for (int64_t i = 0; i < cols; ++i) {
            const float v = S::load(xr, i);
            if (v != v) {  // NaN wins, as in torch
                best_index = i;
                found = true;
                break;
            }
            if (!found || v > best) {
                best = v;
                best_index = i;
                found = true;
            }
        }
        out[r] = best_index;
    }
}

// Rotary (rotate-half) on the query and key heads of each row of the fused QKV output, in
// place, then the rotated keys and the values written to the head-major pool at their slots
// (slot < 0: padding, skipped). Math as the reference: fp32, products rounded separately. An fp8
// pool (kv_format, fp8.h) takes each value saturated and rounded to nearest even.
template <typename S>
void rotary_store(typename S::T* qkv, int64_t row_stride, int64_t num_tokens, int num_heads,
                  int num_kv_heads, int head_dim, const int64_t* positions, const float* cos_sin,
                  int64_t cos_sin_stride, void* key_cache, void* value_cache,
                  int block_size, const int64_t* slots, int kv_format) {
    using T = typename S::T;
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) if (num_tokens >= 32)
    for (int64_t t = 0; t < num_tokens; ++t) {
        T* row = qkv + t * row_stride;
        const float* cos = cos_sin + positions[t] * cos_sin_stride;
        const float* sin = cos + half;
        for (int head = 0; head < num_heads + num_kv_heads; ++head) {
            T* x = row + static_cast<int64_t>(head) * head_dim;
            for (int i = 0; i < half; ++i) {
                const float x1 = S::load(x, i), x2 = S::load(x, i + half);
                const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], d = x1 * sin[i];
                S::store(x, i, a - b);
                S::store(x, i + half, c + d);
            }
        }
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t block = slot / block_size, offset = slot % block_size;
        for (int kv = 0; kv < num_kv_heads; ++kv) {
            const int64_t dst = ((block * num_kv_heads + kv) * block_size + offset) * head_dim;
            const T* k = row + static_cast<int64_t>(num_heads + kv) * head_dim;
            const T* v = row + static_cast<int64_t>(num_heads + num_kv_heads + kv) * head_dim;
            if (kv_format == ns_fp8::kNone) {
                std::memcpy(static_cast<T*>(key_cache) + dst, k, sizeof(T) * head_dim);
                std::memcpy(static_cast<T*>(value_cache) + dst, v, sizeof(T) * head_dim);
                continue;
            }
            uint8_t* kc = static_cast<uint8_t*>(key_cache) + dst;
            uint8_t* vc = static_cast<uint8_t*>(value_cache) + dst;
            if (kv_format == ns_fp8::kE4M3) {
                for (int d = 0; d < head_dim; ++d) {
                    kc[d] = ns_fp8::from_float<ns_fp8::kE4M3>(S::load(k, d));
                    vc[d] = ns_fp8::from_float<ns_fp8::kE4M3>(S::load(v, d));
                }
            } else {
                for (int d = 0; d < head_dim; ++d) {
                    kc[d] = ns_fp8::from_float<ns_fp8::kE5M2>(S::load(k, d));
                    vc[d] = ns_fp8::from_float<ns_fp8::kE5M2>(S::load(v, d));
                }
            }
        }
    }
}

}  // namespace

extern "C" {

int ns_paged_attention(int dtype, void* out, const void* query, int64_t q_stride_token,
                       int64_t q_stride_head, const void* key_cache, const void* value_cache,
                       int num_kv_heads, int block_size, int head_dim, const int32_t* block_table,
                       int64_t block_table_stride, const int32_t* cu_seqlens_q,
                       const int32_t* seq_lens, int num_seqs, int num_heads, float scale,
                       int rows_per_item) {
    if (dtype == 0)
        paged_attention<F32>(static_cast<float*>(out), static_cast<const float*>(query), q_stride_token,
                             q_stride_head, static_cast<const float*>(key_cache),
                             static_cast<const float*>(value_cache), num_kv_heads, block_size, head_dim,
                             block_table, block_table_stride, cu_seqlens_q, seq_lens, num_seqs,
                             num_heads, scale, rows_per_item);
    else if (dtype == 1)
        paged_attention<BF16>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(query),
                              q_stride_token, q_stride_head, static_cast<const uint16_t*>(key_cache),
                              static_cast<const uint16_t*>(value_cache), num_kv_heads, block_size,
                              head_dim, block_table, block_table_stride, cu_seqlens_q, seq_lens,
                              num_seqs, num_heads, scale, rows_per_item);
    else
        return 1;
    return 0;
}

int ns_rms_norm(int dtype, void* out, void* new_residual, const void* x, const void* residual,
                const void* weight, int64_t rows, int64_t hidden, float eps) {
    if (dtype == 0)
        rms_norm<F32>(static_cast<float*>(out), static_cast<float*>(new_residual),
                      static_cast<const float*>(x), static_cast<const float*>(residual),
                      static_cast<const float*>(weight), rows, hidden, eps);
    else if (dtype == 1 && use_avx512_bf16() && hidden % 16 == 0)
        rms_norm_bf16(static_cast<uint16_t*>(out), static_cast<uint16_t*>(new_residual),
                      static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(residual),
                      static_cast<const uint16_t*>(weight), rows, hidden, eps);
    else if (dtype == 1)
        rms_norm<BF16>(static_cast<uint16_t*>(out), static_cast<uint16_t*>(new_residual),
                       static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(residual),
                       static_cast<const uint16_t*>(weight), rows, hidden, eps);
    else
        return 1;
    return 0;
}

int ns_silu_and_mul(int dtype, void* out, const void* gate_up, int64_t rows, int64_t inter) {
    if (dtype == 0)
        silu_and_mul<F32>(static_cast<float*>(out), static_cast<const float*>(gate_up), rows, inter);
    else if (dtype == 1 && use_avx512_bf16())
        silu_and_mul_bf16(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(gate_up), rows, inter);
    else if (dtype == 1)
        silu_and_mul<BF16>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(gate_up), rows, inter);
    else
        return 1;
    return 0;
}

int ns_argmax_rows(int dtype, int64_t* out, const void* x, int64_t rows, int64_t cols, int64_t row_stride) {
    if (dtype == 0)
        argmax_rows<F32>(out, static_cast<const float*>(x), rows, cols, row_stride);
    else if (dtype == 1)
        argmax_rows<BF16>(out, static_cast<const uint16_t*>(x), rows, cols, row_stride);
    else
        return 1;
    return 0;
}

int ns_rotary_store(int dtype, void* qkv, int64_t row_stride, int64_t num_tokens, int num_heads,
                    int num_kv_heads, int head_dim, const int64_t* positions, const float* cos_sin,
                    int64_t cos_sin_stride, void* key_cache, void* value_cache, int block_size,
                    const int64_t* slots, int kv_format) {
    if (kv_format != ns_fp8::kNone && kv_format != ns_fp8::kE4M3 && kv_format != ns_fp8::kE5M2)
        return 1;
    if (dtype == 0)
        rotary_store<F32>(static_cast<float*>(qkv), row_stride, num_tokens, num_heads, num_kv_heads, head_dim,
                          positions, cos_sin, cos_sin_stride, key_cache, value_cache, block_size, slots, kv_format);
    else if (dtype == 1)
        rotary_store<BF16>(static_cast<uint16_t*>(qkv), row_stride, num_tokens, num_heads, num_kv_heads, head_dim,
                           positions, cos_sin, cos_sin_stride, key_cache, value_cache, block_size, slots, kv_format);
    else
        return 1;
    return 0;
}

}  // extern "C"
