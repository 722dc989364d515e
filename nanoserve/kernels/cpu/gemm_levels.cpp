// The bf16 GEMM of every CPU step at each ISA level below AMX, and the entry point that picks the
// level: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), fp32 accumulation, one bf16 rounding.
//
// All levels read the weights in the one layout packed at load (cpu_ops.pack_gemm_weight): per
// block of 16 output columns, K/2 k-pairs of [16 columns][2 k] (64 bytes each), one after the
// other. That is AMX's tile layout (gemm.cpp) and also what one VDPBF16PS takes: a 64-byte load
// is one k-pair of 16 columns. So the levels differ in their inner loop only:
//   AVX-512 BF16  acc[16 cols] = vdpbf16ps(acc, broadcast(x[k], x[k + 1]), w[k-pair]); or the same
//                 sums on fp32 FMAs where VDPBF16PS is measured slow (block_avx512_fma)
//   AVX2 + FMA    the pair widened to fp32: acc = fma(w[k], x[k], acc); acc = fma(w[k+1], x[k+1], acc)
//   portable      the AVX2 level's order in plain C++
// Row invariance, as on AMX: every output element is one accumulator that runs over the k-pairs
// in order from zero, whatever M is, whichever rows share the call and however many rows and
// column blocks a register block holds (those choose which elements are computed side by side,
// never the order inside one). So prompt rows need no padding, and a decode row gives the same
// bits in a batch of 1 or 64.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>
#include <vector>

#include "bf16.h"
#include "isa.h"

#define NS_GEMM_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define NS_GEMM_AVX2 __attribute__((target("avx2,fma")))

extern "C" int ns_gemm_bf16_amx(void* out, int64_t ldo, const void* x, int64_t ldx, const void* packed,
                                const void* bias, int64_t M, int64_t N, int64_t K);
extern "C" int ns_amx_available();

namespace {

constexpr int kCols = 16;  // columns of a packed block
// Same thresholds as gemm.cpp: below them one thread; a lone row still uses both cores to pull
// the weights from memory.
constexpr int64_t kParallelMacs = int64_t(1) << 22;
constexpr int64_t kParallelWeights = int64_t(1) << 18;
constexpr int64_t kRowChunk = 64;                       // rows of x that pass over a group of weights
constexpr int64_t kWeightGroupBytes = int64_t(1) << 20;  // packed weights kept in L2 meanwhile

// One register block: R rows of x against C column blocks.
struct Block {
    uint16_t* out;
    int64_t ldo;
    const uint16_t* x;
    int64_t ldx;
    const uint16_t* w;  // the first column block's packed weights; the next ones follow
    int64_t k_pairs;
    const uint16_t* bias;  // at the first column, or null
    const float* xf;       // the AVX2 level: x widened to fp32 once a call (rows of K), else null
};

inline int32_t pair_at(const uint16_t* row, int64_t k_pair) {
    int32_t pair;
    std::memcpy(&pair, row + 2 * k_pair, sizeof(pair));
    return pair;
}

// Rounds R x (C * 16) fp32 sums (+ bias) to bf16 rows of out.
template <int R, int C>
inline void store_sums(const Block& b, const float (&sums)[R][C * kCols]) {
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < C * kCols; ++j) {
            const float bias = b.bias != nullptr ? ns_bf16::to_float(b.bias[j]) : 0.0f;
            b.out[r * b.ldo + j] = ns_bf16::from_float(sums[r][j] + bias);
        }
}

// ---- AVX-512 BF16 ---------------------------------------------------------------------------

template <int R, int C>
NS_GEMM_AVX512 inline void store_avx512(const Block& b, __m512 (&acc)[R][C]);

template <int R, int C>
NS_GEMM_AVX512 void block_avx512(const Block& b) {
    const int64_t stride = b.k_pairs * 2 * kCols;  // elements between two column blocks
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < b.k_pairs; ++kp) {
        __m512i w[C];
        for (int c = 0; c < C; ++c)
            w[c] = _mm512_loadu_si512(b.w + c * stride + kp * 2 * kCols);
        for (int r = 0; r < R; ++r) {
            const __m512i a = _mm512_set1_epi32(pair_at(b.x + r * b.ldx, kp));
            for (int c = 0; c < C; ++c)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(w[c]));
        }
    }
    store_avx512<R, C>(b, acc);
}

// (+ bias) rounded to bf16 as store_sums does (VCVTNEPS2BF16 rounds to nearest even too).
template <int R, int C>
NS_GEMM_AVX512 inline void store_avx512(const Block& b, __m512 (&acc)[R][C]) {
    for (int c = 0; c < C; ++c) {
        __m512 bias = _mm512_setzero_ps();
        if (b.bias != nullptr) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.bias + c * kCols));
            bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        }
        for (int r = 0; r < R; ++r) {
            const __m512 v = b.bias != nullptr ? _mm512_add_ps(acc[r][c], bias) : acc[r][c];
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.out + r * b.ldo + c * kCols),
                                reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
        }
    }
}

#define NS_UNROLL _Pragma("GCC unroll 16")

// The same sums on the FMA pipes: x widened to fp32 once a call (as the AVX2 level), each k-pair
// of w widened in registers, and per element acc = acc + w[k + 1] x[k + 1], then + w[k] x[k], as
// VDPBF16PS adds them (odd element first; a product of two bf16 values is exact in fp32, so a
// fused and an unfused add round alike; only below 1e-38, where VDPBF16PS flushes denormals to
// zero, can the two differ). For CPUs where VDPBF16PS multiply-adds at half
// the 512-bit FMA's rate (a 2-core Xeon, family 6 model 207, whose hypervisor hides AMX: 41
// against 82 GMAC/s a core): there this runs 1.2-1.6x faster from 3 rows up.
template <int R, int C>
NS_GEMM_AVX512 void block_avx512_fma(const Block& b) {
    const int64_t stride = b.k_pairs * 2 * kCols;
    const int64_t K = 2 * b.k_pairs;
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
    __m512 acc[R][C];
    NS_UNROLL for (int r = 0; r < R; ++r)
        NS_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    const float* x = b.xf;
    const uint16_t* w = b.w;
    for (int64_t kp = 0; kp < b.k_pairs; ++kp, x += 2, w += 2 * kCols) {
        NS_UNROLL for (int c = 0; c < C; ++c) {
            const __m512i v = _mm512_loadu_si512(w + c * stride);
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, high));
            NS_UNROLL for (int r = 0; r < R; ++r)
                acc[r][c] = _mm512_fmadd_ps(even, _mm512_set1_ps(x[r * K]),
                                            _mm512_fmadd_ps(odd, _mm512_set1_ps(x[r * K + 1]), acc[r][c]));
        }
    }
    store_avx512<R, C>(b, acc);
}

// ---- AVX2 + FMA -----------------------------------------------------------------------------

// x comes widened to fp32 (ns_gemm_bf16 does it once a call): a broadcast from memory is a load
// alone, where widening a bf16 pair took a shift and a mask a row and step; the unrolled loops keep
// every accumulator in a register. 1.3-1.6x the former kernel at 64 rows on a Zen 3 EPYC (2 threads).
template <int R, int C>
NS_GEMM_AVX2 void block_avx2(const Block& b) {
    const int64_t stride = b.k_pairs * 2 * kCols;
    const int64_t K = 2 * b.k_pairs;
    const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
    __m256 acc[R][C][2];  // columns 0-7 and 8-15 of each block
    NS_UNROLL for (int r = 0; r < R; ++r)
        NS_UNROLL for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    const float* x = b.xf;
    const uint16_t* w = b.w;
    for (int64_t kp = 0; kp < b.k_pairs; ++kp, x += 2, w += 2 * kCols) {
        NS_UNROLL for (int c = 0; c < C; ++c)
            NS_UNROLL for (int h = 0; h < 2; ++h) {  // w[k] and w[k + 1] of 8 columns, as fp32
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * stride + h * kCols));
                const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                NS_UNROLL for (int r = 0; r < R; ++r)
                    acc[r][c][h] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(x + r * K + 1),
                                                   _mm256_fmadd_ps(even, _mm256_broadcast_ss(x + r * K), acc[r][c][h]));
            }
    }
    alignas(32) float sums[R][C * kCols];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
            for (int h = 0; h < 2; ++h) _mm256_store_ps(&sums[r][c * kCols + h * 8], acc[r][c][h]);
    store_sums<R, C>(b, sums);
}

// x [M, K] bf16 (row stride ldx) widened into xf [M, K] fp32: exact.
NS_GEMM_AVX2 void widen_rows(float* xf, const uint16_t* x, int64_t ldx, int64_t M, int64_t K) {
#pragma omp parallel for if (M * K >= (int64_t(1) << 16))
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(xf + m * K + k, ns_bf16::to_float_x8(x + m * ldx + k));
}

// x widened by widen_rows into this thread's buffer, kept between calls (as gemm_quant.cpp's
// activation buffers): the AVX2 level's GEMM and the AVX-512 BF16 level's FMA kernel read it.
const float* widened(const uint16_t* x, int64_t ldx, int64_t M, int64_t K) {
    thread_local std::vector<float> xf;
    xf.resize(static_cast<size_t>(M * K));
    widen_rows(xf.data(), x, ldx, M, K);
    return xf.data();
}

// ---- portable -------------------------------------------------------------------------------

template <int R, int C>
void block_portable(const Block& b) {
    const int64_t stride = b.k_pairs * 2 * kCols;
    float sums[R][C * kCols] = {};
    for (int64_t kp = 0; kp < b.k_pairs; ++kp)
        for (int r = 0; r < R; ++r) {
            const float a0 = ns_bf16::to_float(b.x[r * b.ldx + 2 * kp]);
            const float a1 = ns_bf16::to_float(b.x[r * b.ldx + 2 * kp + 1]);
            for (int c = 0; c < C; ++c) {
                const uint16_t* w = b.w + c * stride + kp * 2 * kCols;
                for (int j = 0; j < kCols; ++j) {
                    float s = sums[r][c * kCols + j];
                    s = s + ns_bf16::to_float(w[2 * j]) * a0;  // the AVX2 level's order, unfused
                    s = s + ns_bf16::to_float(w[2 * j + 1]) * a1;
                    sums[r][c * kCols + j] = s;
                }
            }
        }
    store_sums<R, C>(b, sums);
}

// ---- the loop nest, shared by the three levels ---------------------------------------------

using BlockFn = void (*)(const Block&);

// kernels[r - 1][c - 1]: the register block of r rows and c column blocks, r <= kMaxR, c <= kMaxC.
template <int kMaxR, int kMaxC>
struct Kernels {
    BlockFn fn[kMaxR][kMaxC];
};

template <template <int, int> class K, int R, int C, int kMaxR, int kMaxC>
constexpr void fill(Kernels<kMaxR, kMaxC>& table) {
    table.fn[R - 1][C - 1] = &K<R, C>::run;
    if constexpr (C < kMaxC) fill<K, R, C + 1, kMaxR, kMaxC>(table);
    else if constexpr (R < kMaxR) fill<K, R + 1, 1, kMaxR, kMaxC>(table);
}

template <int R, int C> struct Avx512 { static void run(const Block& b) { block_avx512<R, C>(b); } };
template <int R, int C> struct Avx512Fma { static void run(const Block& b) { block_avx512_fma<R, C>(b); } };
template <int R, int C> struct Avx2 { static void run(const Block& b) { block_avx2<R, C>(b); } };
template <int R, int C> struct Portable { static void run(const Block& b) { block_portable<R, C>(b); } };

template <template <int, int> class K, int kMaxR, int kMaxC>
Kernels<kMaxR, kMaxC> make_kernels() {
    Kernels<kMaxR, kMaxC> table{};
    fill<K, 1, 1, kMaxR, kMaxC>(table);
    return table;
}

// Register blocks per level, by measurement on a Zen 5 EPYC (2 cores): at few rows every column
// block is its own weight stream from memory, so a lone row takes several; at many rows the
// blocks are sized for the register file (AVX-512: 8 x 3 = 24 of 32 zmm; AVX2: 2 x 2 x 2 = 8 of
// 16 ymm, the widened weights take the rest).
struct Shape {
    int rows, cols;
};

template <int kMaxR, int kMaxC>
void gemm(const Kernels<kMaxR, kMaxC>& kernels, Shape shape, uint16_t* out, int64_t ldo, const uint16_t* x,
          int64_t ldx, const uint16_t* packed, const uint16_t* bias, int64_t M, int64_t N, int64_t K,
          const float* xf = nullptr) {
    const int64_t k_pairs = K / 2;
    const int64_t col_blocks = N / kCols;
    const int64_t units = (col_blocks + shape.cols - 1) / shape.cols;  // units of shape.cols blocks
#pragma omp parallel if (M * N * K >= kParallelMacs || N * K >= kParallelWeights)
    {
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = units * thread / threads * shape.cols;
        const int64_t last = std::min(col_blocks, units * (thread + 1) / threads * shape.cols);
        const int64_t group = std::max<int64_t>(shape.cols, kWeightGroupBytes / (kCols * K * 2) / shape.cols * shape.cols);
        for (int64_t group_start = first; group_start < last; group_start += group) {
            const int64_t group_end = std::min(group_start + group, last);
            for (int64_t chunk = 0; chunk < M; chunk += kRowChunk) {
                const int64_t chunk_end = std::min(chunk + kRowChunk, M);
                for (int64_t cb = group_start; cb < group_end; cb += shape.cols) {
                    const int cols = static_cast<int>(std::min<int64_t>(shape.cols, group_end - cb));
                    for (int64_t row = chunk; row < chunk_end; row += shape.rows) {
                        const int rows = static_cast<int>(std::min<int64_t>(shape.rows, chunk_end - row));
                        const Block b{out + row * ldo + cb * kCols, ldo, x + row * ldx, ldx,
                                      packed + cb * K * kCols, k_pairs, bias != nullptr ? bias + cb * kCols : nullptr,
                                      xf != nullptr ? xf + row * K : nullptr};
                        kernels.fn[rows - 1][cols - 1](b);
                    }
                }
            }
        }
    }
}

const Kernels<8, 4>& avx512_kernels() {
    static const Kernels<8, 4> table = make_kernels<Avx512, 8, 4>();
    return table;
}

const Kernels<6, 4>& avx512_fma_kernels() {
    static const Kernels<6, 4> table = make_kernels<Avx512Fma, 6, 4>();
    return table;
}

const Kernels<2, 4>& avx2_kernels() {
    static const Kernels<2, 4> table = make_kernels<Avx2, 2, 4>();
    return table;
}

const Kernels<4, 2>& portable_kernels() {
    static const Kernels<4, 2> table = make_kernels<Portable, 4, 2>();
    return table;
}

bool cpu_has(int level) {
    switch (level) {
        case ns_isa::kPortable:
            return true;
        case ns_isa::kAvx2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        case ns_isa::kAvx512Bf16:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                   __builtin_cpu_supports("avx512bf16");
        case ns_isa::kAmx:
            return ns_amx_available() != 0;
        default:
            return false;
    }
}

// The AVX-512 BF16 level's two inner kernels give the same bits; which one runs is a matter of
// speed. VDPBF16PS does 32 multiply-adds an instruction, a 512-bit FMA 16 (and block_avx512_fma
// spends a fifth of its instructions widening w). On a Zen 4/5 EPYC the two instructions issue at
// about the same rate, so VDPBF16PS wins ~2x; on a Xeon (family 6 model 207) whose hypervisor
// hides AMX VDPBF16PS issues at a quarter of the FMA's rate (1.3 against 5.1 G/s a core) and the
// FMA kernel is 1.2-1.6x faster at 3 to 512 rows. So: time both instructions once, on 12
// independent chains each (~0.3 ms), and take the FMA kernel where the FMA issues over 2.5x as
// often (seen: ~4x on that Xeon; ~1x on Zen 5: far from the line on both).
NS_GEMM_AVX512 double issue_rate(bool dot) {
    constexpr int kIterations = 8192;
    __m512 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
    __m512 a = _mm512_set1_ps(1.0f);
    double best = 0.0;
    for (int attempt = 0; attempt < 3; ++attempt) {
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < kIterations; ++i) {
            for (int j = 0; j < 12; ++j)
                acc[j] = dot ? _mm512_dpbf16_ps(acc[j], reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(a))
                             : _mm512_fmadd_ps(a, a, acc[j]);
            asm volatile("" : "+v"(a));
        }
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        best = std::max(best, 12.0 * kIterations / std::max(seconds, 1e-9));
    }
    float sink = 0.0f;
    for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(acc[i]);
    asm volatile("" : : "r"(sink));
    return best;
}

std::atomic<int> bf16_variant{-1};  // 0 VDPBF16PS, 1 FMA, forced (ns_bf16_dot_variant); -1 measured

bool fma_variant() {
    const int forced = bf16_variant.load(std::memory_order_relaxed);
    if (forced >= 0) return forced == 1;
    // VDPBF16PS first: its ~0.25 ms warm the 512-bit units, which a cold FMA loop would
    // otherwise time at ~70% of its rate (seen: ratio 3.0 cold, 4.0-4.5 warm on that Xeon).
    static const bool measured = [] {
        const double dot = issue_rate(true);
        const double fma = issue_rate(false);
        return fma > 2.5 * dot;
    }();
    return measured;
}

}  // namespace

extern "C" {

// 1 when this CPU (and OS) can run the kernels of ISA level `level` (isa.h), else 0.
int ns_isa_supported(int level) { return cpu_has(level) ? 1 : 0; }

// Sets the level every kernel runs at; 1 (and nothing changes) when this CPU can't run it.
int ns_set_isa(int level) {
    if (!cpu_has(level)) return 1;
    ns_isa::level.store(level);
    return 0;
}

int ns_current_isa() { return ns_isa::current(); }

// How the AVX-512 BF16 level multiplies bf16 in its GEMM (M > 2) and its prompt attention
// (attention_amx.cpp), the same bits either way: 0 VDPBF16PS, 1 fp32 FMAs, 2 back to the measured
// choice (fma_variant); -1 asks only. Returns the variant in force after.
int ns_bf16_dot_variant(int variant) {
    if (variant == 0 || variant == 1) bf16_variant.store(variant);
    else if (variant == 2) bf16_variant.store(-1);
    if (!cpu_has(ns_isa::kAvx512Bf16)) return 0;
    return fma_variant() ? 1 : 0;
}

// The GEMM at the current level, on weights from cpu_ops.pack_gemm_weight. 0 done; 2 a shape it
// does not take (K a multiple of 32 and N of 16, as AMX needs, so that one packing serves all).
int ns_gemm_bf16(void* out, int64_t ldo, const void* x, int64_t ldx, const void* packed, const void* bias,
                 int64_t M, int64_t N, int64_t K) {
    if (K % 32 != 0 || N % kCols != 0 || M < 0) return 2;
    if (M == 0) return 0;
    auto* o = static_cast<uint16_t*>(out);
    const auto* a = static_cast<const uint16_t*>(x);
    const auto* w = static_cast<const uint16_t*>(packed);
    const auto* b = static_cast<const uint16_t*>(bias);
    switch (ns_isa::current()) {
        case ns_isa::kAmx:
            return ns_gemm_bf16_amx(out, ldo, x, ldx, packed, bias, M, N, K);
        case ns_isa::kAvx512Bf16:
            if (M > 2 && fma_variant()) {  // a lone row or two stream the weights: VDPBF16PS keeps up
                gemm(avx512_fma_kernels(), M <= 64 ? Shape{4, 4} : Shape{6, 4}, o, ldo, a, ldx, w, b, M, N, K,
                     widened(a, ldx, M, K));
                return 0;
            }
            gemm(avx512_kernels(), M <= 2 ? Shape{static_cast<int>(M), 4} : Shape{8, 3}, o, ldo, a, ldx, w, b, M, N, K);
            return 0;
        case ns_isa::kAvx2:
            gemm(avx2_kernels(), M == 1 ? Shape{1, 4} : Shape{2, 2}, o, ldo, a, ldx, w, b, M, N, K, widened(a, ldx, M, K));
            return 0;
        default:
            gemm(portable_kernels(), Shape{4, 2}, o, ldo, a, ldx, w, b, M, N, K);
            return 0;
    }
}

}  // extern "C"
