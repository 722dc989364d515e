// Attention over an fp8 KV pool (--kv-cache-dtype fp8 / fp8_e5m2; fp8.h has the formats) through
// the bf16 / fp32 kernels unchanged: the sequences of a call go in chunks whose blocks fit in a
// core's L2 (or, with too few for every thread to take its own, in all of them); a chunk's K and V
// blocks are widened (exactly) into a scratch pool of the query's dtype laid out as the real one,
// and the kernel of this ISA level (AMX decode, ops.cpp's decode kernels, attention_amx.cpp's
// prompt kernel) runs the chunk over the scratch pool with a block table of its own. Every
// kernel's row depends on its own sequence alone, so chunking changes no bit: an fp8 pool gives,
// bit for bit, what a bf16 (fp32) pool holding the same values gives, at every level. Memory is
// read once, at half bf16's bytes, with the next block prefetched while one widens; the kernel
// then reads the copy from L2. Decode attention over 30 layers' pools from memory ran 1.08-1.11x
// the bf16 pool's speed on a Zen 4 EPYC (benchmarks/kv-fp8/attention.py; 0.65-0.75x with one
// chunk at a time for all threads and no prefetch).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>
#include <utility>
#include <vector>

#include "fp8.h"
#include "isa.h"

#define NS_FP8_AVX512 __attribute__((target("avx512f,avx512bw")))

extern "C" {
int ns_paged_attention(int dtype, void* out, const void* query, int64_t q_stride_token, int64_t q_stride_head,
                       const void* key_cache, const void* value_cache, int num_kv_heads, int block_size, int head_dim,
                       const int32_t* block_table, int64_t block_table_stride, const int32_t* cu_seqlens_q,
                       const int32_t* seq_lens, int num_seqs, int num_heads, float scale, int rows_per_item);
int ns_decode_attention_amx(void* out, const void* query, int64_t q_stride_token, int64_t q_stride_head,
                            const void* key_cache, const void* value_cache, int num_kv_heads, int head_dim,
                            const int32_t* block_table, int64_t block_table_stride, const int32_t* cu_seqlens_q,
                            const int32_t* seq_lens, int num_seqs, int num_heads, float scale);
int ns_prefill_attention(void* out, const void* query, int64_t q_stride_token, int64_t q_stride_head,
                         const void* key_cache, const void* value_cache, int num_kv_heads, int head_dim,
                         const int32_t* block_table, int64_t block_table_stride, const int32_t* spans,
                         int num_spans, int num_heads, float scale);
}

namespace {

// The widened K and V of a chunk that all threads share (1.5 MiB), and of one a thread takes alone
// (512 KiB, within a core's L2).
constexpr int64_t kChunkBytes = int64_t(3) << 19;
constexpr int64_t kThreadChunkBytes = int64_t(1) << 19;

// Every byte's value as bf16 bits and as fp32, per format (index format - 1).
struct Tables {
    alignas(64) uint16_t bf16[2][256];
    float f32[2][256];
    Tables() {
        for (int f = 0; f < 2; ++f)
            for (int b = 0; b < 256; ++b) {
                f32[f][b] = ns_fp8::to_float(static_cast<uint8_t>(b), f + 1);
                uint32_t u;
                std::memcpy(&u, &f32[f][b], sizeof(u));
                const bool nan = f32[f][b] != f32[f][b];
                bf16[f][b] = static_cast<uint16_t>(nan ? (u >> 16) | 0x40 : u >> 16);
            }
    }
};

const Tables& tables() {
    static const Tables t;
    return t;
}

// 32 bytes a step: the magnitude's bf16 from the 128-entry table in four registers (two 64-entry
// two-register permutes, picked by bit 6), the sign bit moved up.
// `next` (or null): the next block to widen, prefetched a line every two steps (its lines come in
// while this block converts; the pool's blocks lie anywhere, beyond the hardware prefetcher's reach).
NS_FP8_AVX512 void widen_bf16_avx512(const uint8_t* src, uint16_t* dst, int64_t n, const uint16_t* table,
                                     const uint8_t* next) {
    const __m512i t0 = _mm512_load_si512(table), t1 = _mm512_load_si512(table + 32);
    const __m512i t2 = _mm512_load_si512(table + 64), t3 = _mm512_load_si512(table + 96);
    const __m512i bit6 = _mm512_set1_epi16(0x40), sign = _mm512_set1_epi16(0x80);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        if (next != nullptr && (i & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
        const __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
        const __m512i low = _mm512_permutex2var_epi16(t0, idx, t1);
        const __m512i high = _mm512_permutex2var_epi16(t2, idx, t3);
        const __m512i magnitude = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(idx, bit6), low, high);
        const __m512i signs = _mm512_slli_epi16(_mm512_and_si512(idx, sign), 8);
        _mm512_storeu_si512(dst + i, _mm512_or_si512(magnitude, signs));
    }
    for (; i < n; ++i) dst[i] = table[src[i]];
}

void widen(const uint8_t* src, void* dst, int64_t n, int dtype, int format, const uint8_t* next = nullptr) {
    const Tables& t = tables();
    if (dtype == 1) {
        if (ns_isa::current() >= ns_isa::kAvx512Bf16) {
            widen_bf16_avx512(src, static_cast<uint16_t*>(dst), n, t.bf16[format - 1], next);
        } else {
            auto* d = static_cast<uint16_t*>(dst);
            for (int64_t i = 0; i < n; ++i) d[i] = t.bf16[format - 1][src[i]];
        }
    } else {
        auto* d = static_cast<float*>(dst);
        for (int64_t i = 0; i < n; ++i) d[i] = t.f32[format - 1][src[i]];
    }
}

// One chunk's scratch pool and block table: `blocks` [sequence][block] of the real pool become
// 0, 1, 2, ... of the scratch one.
struct Chunk {
    std::vector<uint8_t> storage;
    void* keys = nullptr;
    void* values = nullptr;
    std::vector<int32_t> table;
    int64_t table_stride = 0;

    // Widens the K/V of `count` sequences' first blocks[i] blocks (rows of block_table at
    // table_rows[i]) into the scratch pool.
    void fill(const uint8_t* key_cache, const uint8_t* value_cache, const int32_t* block_table, int64_t bt_stride,
              const std::vector<int>& table_rows, const std::vector<int>& blocks, int64_t block_elements, int dtype,
              int format) {
        const int count = static_cast<int>(table_rows.size());
        int total = 0, widest = 1;
        for (int b : blocks) {
            total += b;
            widest = std::max(widest, b);
        }
        const int64_t element = dtype == 1 ? 2 : 4;
        const int64_t pool_bytes = static_cast<int64_t>(total) * block_elements * element;
        if (static_cast<int64_t>(storage.size()) < 2 * pool_bytes + 128) storage.resize(2 * pool_bytes + 128);
        uint8_t* base = storage.data() + (-reinterpret_cast<uintptr_t>(storage.data()) & 63);
        keys = base;
        values = base + ((pool_bytes + 63) & ~int64_t(63));
        table_stride = widest;
        table.assign(static_cast<size_t>(count) * widest, 0);
        std::vector<int64_t> sources;  // real block of each scratch block
        sources.reserve(total);
        for (int i = 0; i < count; ++i)
            for (int b = 0; b < blocks[i]; ++b) {
                table[static_cast<size_t>(i) * widest + b] = static_cast<int32_t>(sources.size());
                sources.push_back(block_table[static_cast<int64_t>(table_rows[i]) * bt_stride + b]);
            }
        const int64_t n = static_cast<int64_t>(sources.size());
#pragma omp parallel for schedule(static) if (n * block_elements >= (int64_t(1) << 15))
        for (int64_t j = 0; j < 2 * n; ++j) {
            const int64_t block = j >> 1;
            const uint8_t* cache = j & 1 ? value_cache : key_cache;
            const uint8_t* next = block + 1 < n ? cache + sources[block + 1] * block_elements : nullptr;
            void* dst = static_cast<uint8_t*>(j & 1 ? values : keys) + block * block_elements * element;
            widen(cache + sources[block] * block_elements, dst, block_elements, dtype, format, next);
        }
    }
};

Chunk& scratch() {
    thread_local Chunk chunk;
    return chunk;
}

int blocks_of(int seq_len, int block_size) { return (seq_len + block_size - 1) / block_size; }

// [first, last) runs of the items 0..count, in order, each within `budget` blocks (an item over it
// alone is a run of its own); blocks(i): item i's.
template <typename Blocks>
std::vector<std::pair<int, int>> runs_within(int count, int64_t budget, Blocks blocks) {
    std::vector<std::pair<int, int>> runs;
    for (int first = 0, last = 0; first < count; first = last) {
        int64_t total = 0;
        for (last = first; last < count; ++last) {
            const int b = blocks(last);
            if (last > first && total + b > budget) break;
            total += b;
        }
        runs.emplace_back(first, last);
    }
    return runs;
}

}  // namespace

extern "C" {

// Bytes to values and back, for the tests (fp8.h's arithmetic, one value at a time).
int ns_fp8_from_float(int format, const float* x, uint8_t* out, int64_t n) {
    if (format != ns_fp8::kE4M3 && format != ns_fp8::kE5M2) return 1;
    for (int64_t i = 0; i < n; ++i) out[i] = ns_fp8::from_float(x[i], format);
    return 0;
}

int ns_fp8_widen(int format, int dtype, const uint8_t* x, void* out, int64_t n) {
    if ((format != ns_fp8::kE4M3 && format != ns_fp8::kE5M2) || (dtype != 0 && dtype != 1)) return 1;
    widen(x, out, n, dtype, format);
    return 0;
}

// ns_paged_attention's contract (plus ns_decode_attention_amx first where amx_decode says so and
// every sequence is one decode row) on fp8 pools of format kv_format.
int ns_paged_attention_fp8(int dtype, int kv_format, void* out, const void* query, int64_t q_stride_token,
                           int64_t q_stride_head, const void* key_cache, const void* value_cache, int num_kv_heads,
                           int block_size, int head_dim, const int32_t* block_table, int64_t block_table_stride,
                           const int32_t* cu_seqlens_q, const int32_t* seq_lens, int num_seqs, int num_heads,
                           float scale, int rows_per_item, int amx_decode) {
    if ((dtype != 0 && dtype != 1) || (kv_format != ns_fp8::kE4M3 && kv_format != ns_fp8::kE5M2)) return 1;
    const int64_t element = dtype == 1 ? 2 : 4;
    const int64_t block_elements = static_cast<int64_t>(num_kv_heads) * block_size * head_dim;
    const int64_t block_bytes = 2 * block_elements * element;  // K and V widened
    // A call with prompt rows stays whole: which kernel takes a bf16 decode row depends on whether
    // the call holds decodes only (ops.cpp's paged_attention), and chunks must not change that.
    bool decodes_only = true;
    for (int s = 0; s < num_seqs; ++s) decodes_only = decodes_only && cu_seqlens_q[s + 1] - cu_seqlens_q[s] == 1;
    auto split = [&](int64_t budget) {
        return runs_within(num_seqs, budget, [&](int s) { return blocks_of(seq_lens[s], block_size); });
    };
    // One chunk: widened into this thread's scratch pool, then the level's kernel on it.
    auto run = [&](int first, int last) -> int {
        Chunk& chunk = scratch();
        std::vector<int> rows, blocks;
        for (int s = first; s < last; ++s) {
            rows.push_back(s);
            blocks.push_back(blocks_of(seq_lens[s], block_size));
        }
        chunk.fill(static_cast<const uint8_t*>(key_cache), static_cast<const uint8_t*>(value_cache), block_table,
                   block_table_stride, rows, blocks, block_elements, dtype, kv_format);
        // The chunk's query rows from 0: its first row's offset moves the pointers.
        const int32_t row0 = cu_seqlens_q[first];
        std::vector<int32_t> cu(cu_seqlens_q + first, cu_seqlens_q + last + 1);
        for (int32_t& c : cu) c -= row0;
        const void* q = static_cast<const uint8_t*>(query) + row0 * q_stride_token * element;
        void* o = static_cast<uint8_t*>(out) + static_cast<int64_t>(row0) * num_heads * head_dim * element;
        const int n = last - first;
        if (amx_decode && decodes_only && dtype == 1 && block_size == 16 &&
            ns_decode_attention_amx(o, q, q_stride_token, q_stride_head, chunk.keys, chunk.values, num_kv_heads,
                                    head_dim, chunk.table.data(), chunk.table_stride, cu.data(), seq_lens + first, n,
                                    num_heads, scale) == 0)
            return 0;
        return ns_paged_attention(dtype, o, q, q_stride_token, q_stride_head, chunk.keys, chunk.values, num_kv_heads,
                                  block_size, head_dim, chunk.table.data(), chunk.table_stride, cu.data(),
                                  seq_lens + first, n, num_heads, scale, rows_per_item);
    };
    if (decodes_only) {
        // Enough work for every thread: each thread widens its own chunks into its own L2 and runs
        // the kernel on them alone (the kernels' parallel regions, nested, run on that one thread).
        const auto chunks = split(std::max<int64_t>(1, kThreadChunkBytes / block_bytes));
        if (static_cast<int>(chunks.size()) >= 2 * omp_get_max_threads()) {
            int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
            for (size_t c = 0; c < chunks.size(); ++c) failed |= run(chunks[c].first, chunks[c].second) != 0;
            return failed;
        }
    }
    // Else chunk after chunk, all threads on each (widening, then the kernel).
    const int64_t shared_budget = decodes_only ? std::max<int64_t>(1, kChunkBytes / block_bytes) : INT64_MAX;
    for (const auto& [first, last] : split(shared_budget)) {
        const int code = run(first, last);
        if (code != 0) return code;
    }
    return 0;
}

// ns_prefill_attention's contract on fp8 pools (bf16 queries, 16-token blocks): spans
// (sequence's block-table row, first row, q_len, seq_len) in chunks, each over its own scratch pool.
int ns_prefill_attention_fp8(int kv_format, void* out, const void* query, int64_t q_stride_token,
                             int64_t q_stride_head, const void* key_cache, const void* value_cache, int num_kv_heads,
                             int head_dim, const int32_t* block_table, int64_t block_table_stride, const int32_t* spans,
                             int num_spans, int num_heads, float scale) {
    if (kv_format != ns_fp8::kE4M3 && kv_format != ns_fp8::kE5M2) return 1;
    if (ns_isa::current() < ns_isa::kAvx512Bf16) return 1;  // ns_prefill_attention's own condition, asked first
    constexpr int BS = 16;
    const int64_t block_elements = static_cast<int64_t>(num_kv_heads) * BS * head_dim;
    const int64_t budget = std::max<int64_t>(1, kChunkBytes / (2 * block_elements * 2));
    Chunk& chunk = scratch();
    std::vector<int> rows, blocks;
    std::vector<int32_t> local;  // the chunk's spans, each on its own row of the chunk's block table
    const auto span_blocks = [&](int i) { return blocks_of(spans[4 * i + 3], BS); };
    for (const auto& [first, last] : runs_within(num_spans, budget, span_blocks)) {
        rows.clear();
        blocks.clear();
        local.clear();
        for (int i = first; i < last; ++i) {
            const int32_t* span = spans + 4 * static_cast<int64_t>(i);
            rows.push_back(span[0]);
            blocks.push_back(span_blocks(i));
            local.insert(local.end(), {static_cast<int32_t>(i - first), span[1], span[2], span[3]});
        }
        chunk.fill(static_cast<const uint8_t*>(key_cache), static_cast<const uint8_t*>(value_cache), block_table,
                   block_table_stride, rows, blocks, block_elements, 1, kv_format);
        const int code = ns_prefill_attention(out, query, q_stride_token, q_stride_head, chunk.keys, chunk.values,
                                              num_kv_heads, head_dim, chunk.table.data(), chunk.table_stride,
                                              local.data(), last - first, num_heads, scale);
        if (code != 0) return code;
    }
    return 0;
}

}  // extern "C"
