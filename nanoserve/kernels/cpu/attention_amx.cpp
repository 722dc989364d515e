// Decode attention (one new row per sequence) on AMX tiles, for bf16 pools of 16-token blocks
// and head_dim 64 or 128: the engine's CPU decode step. Same two passes as ops.cpp's AVX-512
// decode kernel (scores of every key, one max, one exp per score, then P @ V with no rescaling),
// with both matrix products on the tiles, so a block costs a few tile instructions for all the
// query heads of its KV head instead of a dot product per head and key:
//   S^T[16 keys][16 heads] = K[16 keys][dims] . Q^T  (Q^T in pair-interleaved tiles, built once
//                                                     per sequence and KV head; heads past the
//                                                     group are zero columns)
//   O[16 heads][dims]     += P[16 heads][16 keys] . V (V's rows interleaved by key pairs per block)
// O stays in tile registers across all blocks (the probabilities are final when P @ V runs).
// Every row's arithmetic depends on its own sequence and KV head alone: the same bits whatever
// else is in the batch and whatever the thread count.
//
// Prompt rows (prefill_attention) work the same way per tile of 16 query rows of one head, on
// tiles at the AMX level or with VDPBF16PS at the AVX-512 BF16 level (same packing, same steps;
// or, where VDPBF16PS is measured slow, on fp32 FMAs with VDPBF16PS's bits: gemm_levels.cpp):
//   S[16 rows][16 keys] = Q . K^T  (K^T pair-interleaved, built once per sequence and KV head)
//   P = softmax over each row's own keys (0..its position), O += P . V
// A row's scores, max, exps and sum run over its own keys only, in key order; the blocks a tile
// visits past a row's position add exact zeros to its O. So a prompt row gets the same bits
// whether the prompt is computed whole, in chunks of any size, behind a cached prefix, or next to
// other prompts: prefix caching and chunked prefill can't change an answer through attention.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>
#include <vector>

#include "isa.h"
#include "simd.h"

#define NS_AMX_ATTN __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

extern "C" int ns_amx_available();  // gemm.cpp: AMX present and the OS lets us use it
extern "C" int ns_bf16_dot_variant(int variant);  // gemm_levels.cpp: -1 asks; 1 = fp32 FMAs

namespace {

constexpr int kBlock = 16;     // tokens per KV block
constexpr int kRows = 16;      // query heads per tile (a group is padded to 16)
constexpr float kLog2e = 1.4426950408889634f;

struct alignas(64) AttnTileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles 0-3: S^T (pass 1, tile 0) and O's four 16-column blocks (pass 2); 4: P (16 heads x 16
// keys); 5: one V column block (8 key pairs x 16 columns); 6: K (16 keys x 32 dims); 7: Q^T.
NS_AMX_ATTN void release_tiles() { _tile_release(); }

NS_AMX_ATTN void configure_attention_tiles() {
    AttnTileConfig config{};
    config.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    config.colsb[4] = 32;
    config.rows[5] = 8;
    _tile_loadconfig(&config);
}

using ns_simd::exp2x16;

// Indexes for _mm512_permutex2var_epi16 that interleave two rows of 32 bf16 (a, b) into
// (a[j], b[j]) pairs: `lo` for j < 16, `hi` for the others.
NS_AVX512_BF16 inline void pair_indexes(__m512i* lo, __m512i* hi) {
    alignas(64) uint16_t lo_index[32], hi_index[32];
    for (int j = 0; j < 16; ++j) {
        lo_index[2 * j] = static_cast<uint16_t>(j);
        lo_index[2 * j + 1] = static_cast<uint16_t>(32 + j);
        hi_index[2 * j] = static_cast<uint16_t>(16 + j);
        hi_index[2 * j + 1] = static_cast<uint16_t>(48 + j);
    }
    *lo = _mm512_load_si512(lo_index);
    *hi = _mm512_load_si512(hi_index);
}

// One block's V (rows of head_dim bf16, `valid` of them real) as the P . V tiles take it, for its
// 32-dim chunks [0, chunks) of vb: out[column block][8 key pairs][32]. Keys past the end are zero
// rows: their P is 0, but 0 x NaN is NaN.
NS_AVX512_BF16 inline void pair_value_rows(uint16_t* out, const uint16_t* vb, int head_dim, int valid, int chunks,
                                        __m512i lo_idx, __m512i hi_idx) {
    for (int t = 0; t < 8; ++t)
        for (int c = 0; c < chunks; ++c) {
            const __m512i r0 = 2 * t < valid ? _mm512_loadu_si512(vb + static_cast<int64_t>(2 * t) * head_dim + 32 * c)
                                             : _mm512_setzero_si512();
            const __m512i r1 = 2 * t + 1 < valid ? _mm512_loadu_si512(vb + static_cast<int64_t>(2 * t + 1) * head_dim + 32 * c)
                                                 : _mm512_setzero_si512();
            _mm512_storeu_si512(out + (2 * c) * 256 + 32 * t, _mm512_permutex2var_epi16(r0, lo_idx, r1));
            _mm512_storeu_si512(out + (2 * c + 1) * 256 + 32 * t, _mm512_permutex2var_epi16(r0, hi_idx, r1));
        }
}

// O[16 rows][D] (fp32, into obuf) = P[16 rows][padded keys] (bf16) . V, V as pair_value_rows
// wrote it for each of the num_blocks blocks (D / 16 column blocks a block). O accumulates in
// tiles 0-3 over every block, four column blocks at a time.
template <int D>
NS_AMX_ATTN void multiply_probs_values(float* obuf, const uint16_t* probs, int padded, const uint16_t* vv, int num_blocks) {
    constexpr int kColBlocks = D / 16;
    for (int half = 0; half < kColBlocks / 4; ++half) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int b = 0; b < num_blocks; ++b) {
            const uint16_t* vb = vv + (static_cast<int64_t>(b) * kColBlocks + 4 * half) * 256;
            _tile_loadd(4, probs + b * kBlock, padded * 2);
            _tile_loadd(5, vb, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(5, vb + 256, 64);
            _tile_dpbf16ps(1, 4, 5);
            _tile_loadd(5, vb + 512, 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(5, vb + 768, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, obuf + 64 * half, D * 4);
        _tile_stored(1, obuf + 64 * half + 16, D * 4);
        _tile_stored(2, obuf + 64 * half + 32, D * 4);
        _tile_stored(3, obuf + 64 * half + 48, D * 4);
    }
}

// dst[0, head_dim) = row / sum, rounded to bf16.
NS_AVX512_BF16 inline void store_normalized(uint16_t* dst, const float* row, float sum, int head_dim) {
    const __m512 inv = _mm512_set1_ps(1.0f / sum);
    for (int c = 0; c < head_dim; c += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                            ns_simd::to_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(row + c), inv)));
}

template <int D>
NS_AMX_ATTN void decode_attention_amx(uint16_t* out, const uint16_t* query, int64_t q_stride_token,
                                      int64_t q_stride_head, const uint16_t* key_cache, const uint16_t* value_cache,
                                      int num_kv_heads, const int32_t* block_table, int64_t block_table_stride,
                                      const int32_t* seq_lens, int num_seqs, int num_heads, float scale) {
    constexpr int kChunks = D / 32;        // 32-dim chunks: K tiles and Q^T tiles per block
    constexpr int kColBlocks = D / 16;     // O's 16-column blocks
    const int group = num_heads / num_kv_heads;
    const float scale_log2 = scale * kLog2e;
    // Work items: whole sequences (their KV heads one after the other) when there are enough to
    // share among the threads, else (sequence, KV head) pairs, so that a batch of one still splits.
    // A whole sequence lets the first head fetch each block of every head ahead (the heads of a
    // block lie side by side): 64 sequences x 128-256 keys x 30 layers, pool in memory, 13-18%
    // faster than pairs that fetch their own head's next block only. Same bits either way.
    const bool whole_sequences = num_seqs >= 2 * omp_get_max_threads();
    const int heads_per_item = whole_sequences ? num_kv_heads : 1;
    const int64_t num_items = static_cast<int64_t>(num_seqs) * num_kv_heads / heads_per_item;
    int64_t keys = 0;
    for (int s = 0; s < num_seqs; ++s) keys += seq_lens[s];
    const bool parallel_work = num_items > 1 && keys * num_kv_heads >= 4096;
#pragma omp parallel if (parallel_work)
    {
        configure_attention_tiles();
        alignas(64) uint32_t qt[kChunks][16 * 16];     // Q^T tiles: [dim pair][head]
        alignas(64) float sbuf[kBlock * 16];           // one block's S^T
        std::vector<uint16_t> values;                  // V paired for the tiles, all blocks
        alignas(64) float obuf[kRows * D];             // O out of the tiles
        std::memset(qt, 0, sizeof(qt));                // heads past the group stay zero
        std::vector<float> scores;                     // [group][padded keys]
        std::vector<uint16_t> probs;                   // [16][padded keys] bf16; rows >= group unused
        std::vector<float> row_sum(group);
        const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                  _mm512_set1_epi32(16));
        __m512i lo_idx, hi_idx;
        pair_indexes(&lo_idx, &hi_idx);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item)
        for (int item_head = 0; item_head < heads_per_item; ++item_head) {
            const int64_t pair = item * heads_per_item + item_head;
            const int s = static_cast<int>(pair / num_kv_heads), h = static_cast<int>(pair % num_kv_heads);
            const int seq_len = seq_lens[s];
            const int num_blocks = (seq_len + kBlock - 1) / kBlock;
            const int padded = num_blocks * kBlock;
            if (scores.size() < static_cast<size_t>(group) * padded) scores.resize(static_cast<size_t>(group) * padded);
            if (probs.size() < static_cast<size_t>(kRows) * padded) probs.resize(static_cast<size_t>(kRows) * padded);
            const int32_t* table = block_table + static_cast<int64_t>(s) * block_table_stride;
            constexpr int64_t head_elems = static_cast<int64_t>(kBlock) * D;
            auto base = [&](int b) { return (static_cast<int64_t>(table[b]) * num_kv_heads + h) * head_elems; };

            // Q^T: word r (dims 2r, 2r+1 of the chunk) of head g goes to row r, column g.
            for (int g = 0; g < group; ++g) {
                const uint16_t* qv = query + static_cast<int64_t>(s) * q_stride_token +
                                     static_cast<int64_t>(h * group + g) * q_stride_head;
                for (int c = 0; c < kChunks; ++c)
                    _mm512_i32scatter_epi32(qt[c] + g, column, _mm512_loadu_si512(qv + 32 * c), 4);
            }

            // Pass 1: scores.
            for (int b = 0; b < num_blocks; ++b) {
                const uint16_t* kb = key_cache + base(b);
                if (b + 1 < num_blocks) {
                    const char* next = reinterpret_cast<const char*>(key_cache + base(b + 1));
                    for (int line = 0; line < head_elems * 2; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
                }
                if (whole_sequences && h == 0 && b + 2 < num_blocks) {  // every head's K, into L2
                    const char* ahead = reinterpret_cast<const char*>(
                        key_cache + static_cast<int64_t>(table[b + 2]) * num_kv_heads * head_elems);
                    for (int line = 0; line < num_kv_heads * head_elems * 2; line += 64)
                        _mm_prefetch(ahead + line, _MM_HINT_T1);
                }
                _tile_zero(0);
                for (int c = 0; c < kChunks; ++c) {
                    _tile_loadd(6, kb + 32 * c, D * 2);
                    _tile_loadd(7, qt[c], 64);
                    _tile_dpbf16ps(0, 6, 7);
                }
                _tile_stored(0, sbuf, 64);
                const int valid = seq_len - b * kBlock < kBlock ? seq_len - b * kBlock : kBlock;
                const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1u);
                for (int g = 0; g < group; ++g) {
                    const __m512 sc = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(g)), sbuf, 4);
                    _mm512_storeu_ps(&scores[static_cast<size_t>(g) * padded + b * kBlock],
                                     _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep,
                                                        _mm512_mul_ps(sc, _mm512_set1_ps(scale_log2))));
                }
            }

            // Softmax: probabilities rounded to bf16 for P @ V, their fp32 sum unrounded.
            const __mmask16 last_keep = static_cast<__mmask16>((1u << (seq_len - (num_blocks - 1) * kBlock)) - 1u);
            for (int g = 0; g < group; ++g)
                row_sum[g] = ns_simd::softmax_bf16(&probs[static_cast<size_t>(g) * padded],
                                                   &scores[static_cast<size_t>(g) * padded], num_blocks, last_keep);

            // Pass 2: V paired once per block, then O = P . V.
            if (values.size() < static_cast<size_t>(num_blocks) * kColBlocks * 256)
                values.resize(static_cast<size_t>(num_blocks) * kColBlocks * 256);
            for (int b = 0; b < num_blocks; ++b) {
                if (b + 1 < num_blocks) {
                    const char* next = reinterpret_cast<const char*>(value_cache + base(b + 1));
                    for (int line = 0; line < head_elems * 2; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
                }
                const int valid = seq_len - b * kBlock < kBlock ? seq_len - b * kBlock : kBlock;
                pair_value_rows(values.data() + static_cast<int64_t>(b) * kColBlocks * 256, value_cache + base(b), D,
                                valid, kChunks, lo_idx, hi_idx);
            }
            multiply_probs_values<D>(obuf, probs.data(), padded, values.data(), num_blocks);
            for (int g = 0; g < group; ++g)
                store_normalized(out + (static_cast<int64_t>(s) * num_heads + h * group + g) * D, obuf + g * D,
                                 row_sum[g], D);
        }
        _tile_release();
    }
}

struct Span {  // one prompt's rows in this step, as cpu_attention.PrefillSpan
    int32_t seq, row_start, q_len, seq_len;
};

// K^T and V of one sequence and KV head in the tiles' layouts, for all its blocks:
// kt[block][chunk]: [16 dim pairs][16 keys] words; vv[block][column block]: [8 key pairs][16 columns][2].
template <int D>
NS_AVX512_BF16 void pack_keys_values(uint32_t* kt, uint16_t* vv, const uint16_t* key_cache, const uint16_t* value_cache,
                                  const int32_t* table, int num_kv_heads, int h, int seq_len, __m512i lo_idx,
                                  __m512i hi_idx) {
    constexpr int kChunks = D / 32;
    constexpr int kColBlocks = D / 16;
    constexpr int64_t head_elems = static_cast<int64_t>(kBlock) * D;
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    const int num_blocks = (seq_len + kBlock - 1) / kBlock;
    for (int b = 0; b < num_blocks; ++b) {
        const int64_t base = (static_cast<int64_t>(table[b]) * num_kv_heads + h) * head_elems;
        const uint16_t* kb = key_cache + base;
        const uint16_t* vb = value_cache + base;
        const int valid = seq_len - b * kBlock < kBlock ? seq_len - b * kBlock : kBlock;
        uint32_t* ktb = kt + static_cast<int64_t>(b) * kChunks * 256;
        for (int n = 0; n < kBlock; ++n)  // keys past the end: zero columns
            for (int c = 0; c < kChunks; ++c)
                _mm512_i32scatter_epi32(ktb + c * 256 + n, column,
                                        n < valid ? _mm512_loadu_si512(kb + static_cast<int64_t>(n) * D + 32 * c)
                                                  : _mm512_setzero_si512(), 4);
        pair_value_rows(vv + static_cast<int64_t>(b) * kColBlocks * 256, vb, D, valid, kChunks, lo_idx, hi_idx);
    }
}

// Pass 1 of a 16-row tile of one head: raw scores S[r][b * 16 + key] = Q[r] . K[key] for every
// block b < num_blocks, rows [0, rows) of q (stride q_stride elements; with tiles, q holds 16
// rows, zero past `rows`).
template <int D>
NS_AMX_ATTN void tile_scores_amx(float* scores, int padded, const uint16_t* q, int64_t q_stride, int /*rows*/,
                                 const uint32_t* kt, int num_blocks) {
    constexpr int kChunks = D / 32;
    for (int b = 0; b < num_blocks; ++b) {
        _tile_zero(0);
        for (int c = 0; c < kChunks; ++c) {
            _tile_loadd(7, q + 32 * c, q_stride * 2);
            _tile_loadd(6, kt + (static_cast<int64_t>(b) * kChunks + c) * 256, 64);
            _tile_dpbf16ps(0, 7, 6);
        }
        _tile_stored(0, scores + b * kBlock, padded * 4);
    }
}

// The same with VDPBF16PS, eight rows at a time sharing each K^T load: a score is one
// accumulator over the dim pairs in order, whichever rows share the pass.
template <int D, int R>
NS_AVX512_BF16 void row_scores_dpbf16(float* scores, int padded, const uint16_t* q, int64_t q_stride,
                                      const uint32_t* kt, int num_blocks) {
    for (int b = 0; b < num_blocks; ++b) {
        const uint32_t* ktb = kt + static_cast<int64_t>(b) * (D / 2) * kBlock;
        __m512 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
        for (int p = 0; p < D / 2; ++p) {
            const __m512bh k = reinterpret_cast<__m512bh>(_mm512_loadu_si512(ktb + p * kBlock));
            for (int r = 0; r < R; ++r) {
                int32_t pair;
                std::memcpy(&pair, q + r * q_stride + 2 * p, sizeof(pair));
                acc[r] = _mm512_dpbf16_ps(acc[r], reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair)), k);
            }
        }
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(scores + r * padded + b * kBlock, acc[r]);
    }
}

template <int D>
NS_AVX512_BF16 void tile_scores_dpbf16(float* scores, int padded, const uint16_t* q, int64_t q_stride, int rows,
                                       const uint32_t* kt, int num_blocks) {
    int r = 0;
    for (; r + 8 <= rows; r += 8) row_scores_dpbf16<D, 8>(scores + r * padded, padded, q + r * q_stride, q_stride, kt, num_blocks);
    for (; r + 4 <= rows; r += 4) row_scores_dpbf16<D, 4>(scores + r * padded, padded, q + r * q_stride, q_stride, kt, num_blocks);
    for (; r < rows; ++r) row_scores_dpbf16<D, 1>(scores + r * padded, padded, q + r * q_stride, q_stride, kt, num_blocks);
}

// Pass 2 with VDPBF16PS: O[r][D] = P[r] . V over every block's key pairs in order, four rows and
// four 16-column blocks at a time sharing the V and P loads.
template <int D, int R>
NS_AVX512_BF16 void row_values_dpbf16(float* obuf, const uint16_t* probs, int padded, const uint16_t* vv, int num_blocks) {
    constexpr int kColBlocks = D / 16;
    for (int quarter = 0; quarter < kColBlocks; quarter += 4) {
        __m512 acc[R][4];
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
        for (int b = 0; b < num_blocks; ++b) {
            const uint16_t* vb = vv + (static_cast<int64_t>(b) * kColBlocks + quarter) * 256;
            for (int t = 0; t < kBlock / 2; ++t) {
                __m512bh v[4];
                for (int c = 0; c < 4; ++c) v[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vb + c * 256 + 32 * t));
                for (int r = 0; r < R; ++r) {
                    int32_t pair;
                    std::memcpy(&pair, probs + r * padded + b * kBlock + 2 * t, sizeof(pair));
                    const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
                    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, v[c]);
                }
            }
        }
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < 4; ++c) _mm512_storeu_ps(obuf + r * D + (quarter + c) * 16, acc[r][c]);
    }
}

template <int D>
NS_AVX512_BF16 void tile_values_dpbf16(float* obuf, const uint16_t* probs, int padded, const uint16_t* vv,
                                       int num_blocks, int rows) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) row_values_dpbf16<D, 4>(obuf + r * D, probs + r * padded, padded, vv, num_blocks);
    for (; r < rows; ++r) row_values_dpbf16<D, 1>(obuf + r * D, probs + r * padded, padded, vv, num_blocks);
}

// ---- the same two passes on fp32 FMAs (where VDPBF16PS is slow: gemm_levels.cpp's probe) -----
// A bf16 product is exact in fp32, so adding each pair's odd product and then its even one, as
// VDPBF16PS does, gives its bits (but below 1e-38, where VDPBF16PS flushes denormals). K^T and V
// are widened once per (span, KV head) from pack_keys_values' layout: kf[block][dim pair][even,
// odd][16 keys], vf[block][column block][key pair][even key, odd key][16 columns]; the query rows
// and the probabilities as fp32 too, so that every operand of the inner loops is a load.
//
// A function, not a lambda: a lambda does not inherit its caller's target attribute, and on a CPU
// without AVX-512 (-march=native lacking it) the intrinsics could not be inlined into it.
NS_AVX512_BF16 inline void widen_pairs(float* dst, const void* src) {  // 16 bf16 pairs: evens, then odds
    const __m512i pairs = _mm512_loadu_si512(src);
    _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)));
    _mm512_storeu_ps(dst + 16, _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u)))));
}

template <int D>
NS_AVX512_BF16 void widen_keys_values(float* kf, float* vf, const uint32_t* kt, const uint16_t* vv, int num_blocks) {
    for (int64_t i = 0; i < static_cast<int64_t>(num_blocks) * (D / 2); ++i) widen_pairs(kf + 32 * i, kt + 16 * i);
    for (int64_t i = 0; i < static_cast<int64_t>(num_blocks) * (D / 16) * 8; ++i) widen_pairs(vf + 32 * i, vv + 32 * i);
}

// Pass 1 as row_scores_dpbf16, q's rows widened (qf, D floats a row); up to 16 rows share each
// widened K load (K^T comes from L2 on a long prompt).
template <int D, int R>
NS_AVX512_BF16 void row_scores_fma(float* scores, int padded, const float* qf, const float* kf, int num_blocks) {
    for (int b = 0; b < num_blocks; ++b) {
        const float* kb = kf + static_cast<int64_t>(b) * (D / 2) * 32;
        __m512 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
        for (int p = 0; p < D / 2; ++p) {
            const __m512 even = _mm512_loadu_ps(kb + 32 * p), odd = _mm512_loadu_ps(kb + 32 * p + 16);
            for (int r = 0; r < R; ++r)
                acc[r] = _mm512_fmadd_ps(even, _mm512_set1_ps(qf[r * D + 2 * p]),
                                         _mm512_fmadd_ps(odd, _mm512_set1_ps(qf[r * D + 2 * p + 1]), acc[r]));
        }
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(scores + r * padded + b * kBlock, acc[r]);
    }
}

template <int D>
NS_AVX512_BF16 void tile_scores_fma(float* scores, int padded, const float* qf, int rows, const float* kf,
                                    int num_blocks) {
    int r = 0;
    for (; r + 16 <= rows; r += 16) row_scores_fma<D, 16>(scores + r * padded, padded, qf + r * D, kf, num_blocks);
    for (; r + 8 <= rows; r += 8) row_scores_fma<D, 8>(scores + r * padded, padded, qf + r * D, kf, num_blocks);
    for (; r + 4 <= rows; r += 4) row_scores_fma<D, 4>(scores + r * padded, padded, qf + r * D, kf, num_blocks);
    for (; r < rows; ++r) row_scores_fma<D, 1>(scores + r * padded, padded, qf + r * D, kf, num_blocks);
}

// Pass 2 as row_values_dpbf16, the probabilities as fp32 (pf: the bf16-rounded values); two
// 16-column blocks at a time for up to 8 rows, so that each widened V load feeds 8 FMAs (V comes
// from L2 on a long prompt: with four column blocks and four rows this ran at half the speed).
template <int D, int R>
NS_AVX512_BF16 void row_values_fma(float* obuf, const float* pf, int padded, const float* vf, int num_blocks) {
    constexpr int kColBlocks = D / 16;
    for (int pair = 0; pair < kColBlocks; pair += 2) {
        __m512 acc[R][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int b = 0; b < num_blocks; ++b) {
            const float* vb = vf + (static_cast<int64_t>(b) * kColBlocks + pair) * 8 * 32;
            for (int t = 0; t < kBlock / 2; ++t) {
                const __m512 even0 = _mm512_loadu_ps(vb + t * 32), odd0 = _mm512_loadu_ps(vb + t * 32 + 16);
                const __m512 even1 = _mm512_loadu_ps(vb + (8 + t) * 32), odd1 = _mm512_loadu_ps(vb + (8 + t) * 32 + 16);
                for (int r = 0; r < R; ++r) {
                    const float* pr = pf + r * padded + b * kBlock + 2 * t;
                    const __m512 pe = _mm512_set1_ps(pr[0]), po = _mm512_set1_ps(pr[1]);
                    acc[r][0] = _mm512_fmadd_ps(even0, pe, _mm512_fmadd_ps(odd0, po, acc[r][0]));
                    acc[r][1] = _mm512_fmadd_ps(even1, pe, _mm512_fmadd_ps(odd1, po, acc[r][1]));
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            _mm512_storeu_ps(obuf + r * D + pair * 16, acc[r][0]);
            _mm512_storeu_ps(obuf + r * D + (pair + 1) * 16, acc[r][1]);
        }
    }
}

template <int D>
NS_AVX512_BF16 void tile_values_fma(float* obuf, const float* pf, int padded, const float* vf, int num_blocks, int rows) {
    int r = 0;
    for (; r + 8 <= rows; r += 8) row_values_fma<D, 8>(obuf + r * D, pf + r * padded, padded, vf, num_blocks);
    for (; r + 4 <= rows; r += 4) row_values_fma<D, 4>(obuf + r * D, pf + r * padded, padded, vf, num_blocks);
    for (; r < rows; ++r) row_values_fma<D, 1>(obuf + r * D, pf + r * padded, padded, vf, num_blocks);
}

// How prompt rows multiply: AMX tiles, VDPBF16PS, or fp32 FMAs (the last two the same bits).
enum class Mode { kTiles, kDot, kFma };

// Prompt rows of every span on AMX tiles, with VDPBF16PS or on fp32 FMAs (Mode): K^T and V packed
// once per (span, KV head), then per (span, head, 16-row tile) the scores of every block the tile
// sees, each row's softmax over its own keys, and O = P . V.
template <int D, Mode kMode>
NS_AVX512_BF16 void prefill_attention(uint16_t* out, const uint16_t* query, int64_t q_stride_token, int64_t q_stride_head,
                                       const uint16_t* key_cache, const uint16_t* value_cache, int num_kv_heads,
                                       const int32_t* block_table, int64_t block_table_stride, const Span* spans,
                                       int num_spans, int num_heads, float scale) {
    constexpr int kChunks = D / 32;
    constexpr int kColBlocks = D / 16;
    const int group = num_heads / num_kv_heads;
    const float scale_log2 = scale * kLog2e;
    // Packed K^T / V of every (span, KV head), then the work items: (span, head, 16-row tile).
    std::vector<int64_t> packed_offset(static_cast<size_t>(num_spans) * num_kv_heads + 1, 0);
    std::vector<int32_t> items;  // span, head, first row
    int64_t work = 0;
    for (int i = 0; i < num_spans; ++i) {
        const int blocks = (spans[i].seq_len + kBlock - 1) / kBlock;
        for (int h = 0; h < num_kv_heads; ++h) {
            const size_t k = static_cast<size_t>(i) * num_kv_heads + h;
            packed_offset[k + 1] = packed_offset[k] + static_cast<int64_t>(blocks) * (kChunks + kColBlocks) * 256;
        }
        for (int h = 0; h < num_heads; ++h)
            for (int r = 0; r < spans[i].q_len; r += kRows) {
                items.push_back(i);
                items.push_back(h);
                items.push_back(r);
            }
        work += static_cast<int64_t>(spans[i].q_len) * spans[i].seq_len;
    }
    // 32-bit words: K^T (kChunks x 256 words a block) then V (kColBlocks x 256 words a block).
    std::vector<uint32_t> packed(static_cast<size_t>(packed_offset.back()));
    // kFma: the same widened to fp32 (widen_keys_values), 32 D floats a block, at the same offsets
    // counted in blocks.
    constexpr int64_t kPackedWords = (kChunks + kColBlocks) * 256;  // a block's words in `packed`
    std::vector<float> widened(kMode == Mode::kFma ? static_cast<size_t>(packed_offset.back() / kPackedWords) * 32 * D : 0);
    auto widened_at = [&](size_t k) { return widened.data() + packed_offset[k] / kPackedWords * 32 * D; };
    const int64_t num_items = static_cast<int64_t>(items.size() / 3);
    const bool parallel_work = work * num_heads >= 16384;
#pragma omp parallel if (parallel_work)
    {
        __m512i lo_idx, hi_idx;
        pair_indexes(&lo_idx, &hi_idx);
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < static_cast<int64_t>(num_spans) * num_kv_heads; ++k) {
            const Span& span = spans[k / num_kv_heads];
            const int h = static_cast<int>(k % num_kv_heads);
            const int blocks = (span.seq_len + kBlock - 1) / kBlock;
            uint32_t* kt = packed.data() + packed_offset[k];
            uint16_t* vv = reinterpret_cast<uint16_t*>(kt + static_cast<int64_t>(blocks) * kChunks * 256);
            pack_keys_values<D>(kt, vv, key_cache, value_cache, block_table + static_cast<int64_t>(span.seq) * block_table_stride,
                                num_kv_heads, h, span.seq_len, lo_idx, hi_idx);
            if constexpr (kMode == Mode::kFma) {
                float* kf = widened_at(k);
                widen_keys_values<D>(kf, kf + static_cast<int64_t>(blocks) * 16 * D, kt, vv, blocks);
            }
        }
        if constexpr (kMode == Mode::kTiles) configure_attention_tiles();
        std::vector<float> scores;     // [16 rows][padded keys]
        std::vector<uint16_t> probs;   // [16 rows][padded keys] bf16
        std::vector<float> probs_f;    // kFma: the same as fp32
        alignas(64) float qf[kMode == Mode::kFma ? kRows * D : 1];  // kFma: the tile's rows as fp32
        alignas(64) uint16_t qbuf[kRows * D];  // a short last tile's rows, zero-padded
        alignas(64) float obuf[kRows * D];
        float row_sum[kRows];
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            const Span& span = spans[items[3 * item]];
            const int head = items[3 * item + 1], first = items[3 * item + 2];
            const int kv = head / group;
            const int rows = span.q_len - first < kRows ? span.q_len - first : kRows;
            const int context = span.seq_len - span.q_len;
            const int last_position = context + first + rows - 1;
            const int num_blocks = last_position / kBlock + 1;  // blocks this tile's rows can see
            const int padded = num_blocks * kBlock;
            if (scores.size() < static_cast<size_t>(kRows) * padded) {
                scores.resize(static_cast<size_t>(kRows) * padded);
                if constexpr (kMode == Mode::kFma) probs_f.resize(static_cast<size_t>(kRows) * padded);
                else probs.resize(static_cast<size_t>(kRows) * padded);
            }
            const int all_blocks = (span.seq_len + kBlock - 1) / kBlock;
            const uint32_t* kt = packed.data() + packed_offset[static_cast<size_t>(items[3 * item]) * num_kv_heads + kv];
            const uint16_t* vv = reinterpret_cast<const uint16_t*>(kt + static_cast<int64_t>(all_blocks) * kChunks * 256);
            const uint16_t* q = query + static_cast<int64_t>(span.row_start + first) * q_stride_token +
                                static_cast<int64_t>(head) * q_stride_head;
            int64_t q_stride = q_stride_token;
            if (kMode == Mode::kTiles && rows < kRows) {  // a tile load reads 16 rows
                std::memset(qbuf, 0, sizeof(qbuf));
                for (int r = 0; r < rows; ++r) std::memcpy(qbuf + r * D, q + r * q_stride_token, D * 2);
                q = qbuf;
                q_stride = D;
            }
            // Pass 1: S for every block the tile can see.
            const float* kf = nullptr;
            if constexpr (kMode == Mode::kFma) {
                kf = widened_at(static_cast<size_t>(items[3 * item]) * num_kv_heads + kv);
                for (int r = 0; r < rows; ++r)
                    for (int d = 0; d < D; d += 16) _mm512_storeu_ps(qf + r * D + d, ns_simd::load_bf16x16(q + r * q_stride + d));
            }
            if constexpr (kMode == Mode::kTiles) tile_scores_amx<D>(scores.data(), padded, q, q_stride, rows, kt, num_blocks);
            else if constexpr (kMode == Mode::kDot) tile_scores_dpbf16<D>(scores.data(), padded, q, q_stride, rows, kt, num_blocks);
            else tile_scores_fma<D>(scores.data(), padded, qf, rows, kf, num_blocks);
            // Softmax of each row over its own keys 0..position; later keys get P = 0. kFma keeps
            // the bf16-rounded probabilities as fp32 (probs_f), for its broadcasts. Only a tile load
            // reads the rows past `rows` (zero there).
            for (int r = 0; r < (kMode == Mode::kTiles ? kRows : rows); ++r) {
                const float* sr = scores.data() + static_cast<int64_t>(r) * padded;
                uint16_t* pr = kMode == Mode::kFma ? nullptr : probs.data() + static_cast<int64_t>(r) * padded;
                float* pf = kMode == Mode::kFma ? probs_f.data() + static_cast<int64_t>(r) * padded : nullptr;
                if (r >= rows) {
                    std::memset(pr, 0, padded * 2);
                    continue;
                }
                const int position = context + first + r;
                const int own_blocks = position / kBlock + 1;
                const __mmask16 last_keep = static_cast<__mmask16>((2u << (position % kBlock)) - 1u);
                __m512 m = _mm512_set1_ps(-INFINITY);
                for (int b = 0; b < own_blocks; ++b) {
                    const __m512 x = _mm512_loadu_ps(sr + b * kBlock);
                    m = b == own_blocks - 1 ? _mm512_mask_max_ps(m, last_keep, m, x) : _mm512_max_ps(m, x);
                }
                const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(m) * scale_log2);
                const __m512 scale_v = _mm512_set1_ps(scale_log2);
                __m512 sum = _mm512_setzero_ps();
                for (int b = 0; b < own_blocks; ++b) {
                    __m512 p = exp2x16(_mm512_fmsub_ps(_mm512_loadu_ps(sr + b * kBlock), scale_v, row_max));
                    if (b == own_blocks - 1) p = _mm512_maskz_mov_ps(last_keep, p);
                    sum = _mm512_add_ps(sum, p);
                    if constexpr (kMode == Mode::kFma) _mm512_storeu_ps(pf + b * kBlock, ns_simd::round_bf16x16(p));
                    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + b * kBlock), ns_simd::to_bf16x16(p));
                }
                row_sum[r] = _mm512_reduce_add_ps(sum);
                if (own_blocks < num_blocks) {
                    if constexpr (kMode == Mode::kFma) std::memset(pf + own_blocks * kBlock, 0, (num_blocks - own_blocks) * kBlock * 4);
                    else std::memset(pr + own_blocks * kBlock, 0, (num_blocks - own_blocks) * kBlock * 2);
                }
            }
            // Pass 2: O = P . V.
            if constexpr (kMode == Mode::kTiles) multiply_probs_values<D>(obuf, probs.data(), padded, vv, num_blocks);
            else if constexpr (kMode == Mode::kDot) tile_values_dpbf16<D>(obuf, probs.data(), padded, vv, num_blocks, rows);
            else tile_values_fma<D>(obuf, probs_f.data(), padded, kf + static_cast<int64_t>(all_blocks) * 16 * D, num_blocks, rows);
            for (int r = 0; r < rows; ++r)
                store_normalized(out + (static_cast<int64_t>(span.row_start + first + r) * num_heads + head) * D,
                                 obuf + r * D, row_sum[r], D);
        }
        if constexpr (kMode == Mode::kTiles) release_tiles();
    }
}

}  // namespace

extern "C" {
// Decodes only (cu_seqlens_q = 0, 1, ..., num_seqs: query row s is sequence s's), bf16, 16-token blocks, head-major pool
// ([blocks, kv_heads, 16, head_dim] underneath), out [num_seqs, num_heads, head_dim] contiguous.
// 0 done; 1 not taken here (no AMX, head_dim not 64 or 128, a group wider than 16).
int ns_decode_attention_amx(void* out, const void* query, int64_t q_stride_token, int64_t q_stride_head,
                            const void* key_cache, const void* value_cache, int num_kv_heads, int head_dim,
                            const int32_t* block_table, int64_t block_table_stride, const int32_t* cu_seqlens_q,
                            const int32_t* seq_lens, int num_seqs, int num_heads, float scale) {
    if (!ns_amx_available() || num_kv_heads <= 0 || num_heads % num_kv_heads || num_heads / num_kv_heads > kRows)
        return 1;
    for (int s = 0; s < num_seqs; ++s)
        if (seq_lens[s] <= 0 || cu_seqlens_q[s + 1] != s + 1) return 1;
    auto run = head_dim == 64 ? decode_attention_amx<64> : head_dim == 128 ? decode_attention_amx<128> : nullptr;
    if (run == nullptr) return 1;
    run(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(query), q_stride_token, q_stride_head,
        static_cast<const uint16_t*>(key_cache), static_cast<const uint16_t*>(value_cache), num_kv_heads,
        block_table, block_table_stride, seq_lens, num_seqs, num_heads, scale);
    return 0;
}
// Prompt rows: spans [num_spans][4] = (sequence index into block_table, first row in query/out,
// rows, seq_len with these rows); their K/V already in the pool. Rows outside the spans are left
// alone. At the AMX level on tiles, at the AVX-512 BF16 level with VDPBF16PS (each its own
// summation order, fixed whatever the tile's other rows). 0 done; 1 not taken here (a lower
// level, head_dim not 64 or 128).
int ns_prefill_attention(void* out, const void* query, int64_t q_stride_token, int64_t q_stride_head,
                         const void* key_cache, const void* value_cache, int num_kv_heads, int head_dim,
                         const int32_t* block_table, int64_t block_table_stride, const int32_t* spans,
                         int num_spans, int num_heads, float scale) {
    const int level = ns_isa::current();
    if (level < ns_isa::kAvx512Bf16 || num_kv_heads <= 0 || num_heads % num_kv_heads)
        return 1;
    const bool tiles = level == ns_isa::kAmx && ns_amx_available();
    const Mode mode = tiles ? Mode::kTiles : ns_bf16_dot_variant(-1) == 1 ? Mode::kFma : Mode::kDot;
    const Span* span_list = reinterpret_cast<const Span*>(spans);
    for (int i = 0; i < num_spans; ++i)
        if (span_list[i].q_len <= 0 || span_list[i].seq_len < span_list[i].q_len) return 1;
    auto pick = [mode](auto tiles_kernel, auto dot_kernel, auto fma_kernel) {
        return mode == Mode::kTiles ? tiles_kernel : mode == Mode::kDot ? dot_kernel : fma_kernel;
    };
    auto run = head_dim == 64 ? pick(prefill_attention<64, Mode::kTiles>, prefill_attention<64, Mode::kDot>,
                                     prefill_attention<64, Mode::kFma>)
             : head_dim == 128 ? pick(prefill_attention<128, Mode::kTiles>, prefill_attention<128, Mode::kDot>,
                                      prefill_attention<128, Mode::kFma>)
             : nullptr;
    if (run == nullptr) return 1;
    run(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(query), q_stride_token, q_stride_head,
        static_cast<const uint16_t*>(key_cache), static_cast<const uint16_t*>(value_cache), num_kv_heads,
        block_table, block_table_stride, span_list, num_spans, num_heads, scale);
    return 0;
}
}  // extern "C"
