// GEMM on FP8 (E4M3) weights with float activations: out[M, N] = x[M, K] @ w[N, K]^T (+ bias),
// w = fp8 value * scale, one fp32 scale per output column and block of 32 inputs (any per-tensor,
// per-channel or 128 x 128 block scale of a checkpoint repeated per block; kernels/quant.py's
// "fp8_e4m3" format). The weights stay one byte each and are widened in registers; the
// activations stay bf16 / fp32 (W8A16, what vLLM's CPU backend and its Marlin path do on hardware
// without FP8 arithmetic). Called by gemm_quant.cpp's ns_gemm_quant for that format, so the
// modules, the fused decode step (decode_layers.cpp) and tensor parallelism take it as any other.
//
// The widening is exact and needs no table: an E4M3 byte s eeee mmm, sign-extended to 16 bits and
// shifted left by 7, then masked to s 0 eeee mmm 0000000, is the FP16 number of its value times
// 2^-8 (FP16's exponent bias is 8 above E4M3's, and both formats' subnormals line up), which
// VCVTPH2PS widens to fp32. The 2^-8 goes back in once, when an output is stored.
//
// The arithmetic, the same at every level (AVX-512, AVX2, plain C++), hence the same bits:
// per output element, with x widened to fp32 (exact for bf16) and w' = value * 2^-8,
//     for each block of 32 inputs from k = 0:  b = 0;  b = fma(w'[k], x[k], b) for k in order;
//                                             acc = fma(b, scale, acc)
//     out = acc * 256 (+ bias), rounded once to x's dtype.
// Each output is summed in that one order whatever M is and whichever rows share the call.
// (Scaling each widened weight instead, one accumulator, measured 5-15% slower at one row: the
// widening's vector operations, not the bytes, bound a lone row, and the multiply is one more.)
//
// Layout (quant.py pack_weight): per group of 16 output columns and block of 32 inputs, 512 bytes of
// E4M3 [32 inputs][16 columns] then 64 bytes of fp32 scales [16 columns]. Few rows (a decode
// step) widen each input's 16 bytes in registers as they go; more rows widen 4 column groups x
// 64 inputs at a time into an fp32 scratch that stays in L1, which register blocks of 4 rows x 4
// groups read for every row of a chunk of 64, their running sums in L1 too.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>
#include <vector>

#include "bf16.h"
#include "isa.h"

#define NS_F8_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c,fma")))
#define NS_F8_AVX2 __attribute__((target("avx2,fma,f16c")))
#define NS_UNROLL_F8 _Pragma("GCC unroll 8")

namespace {

constexpr int kCols = 16;
constexpr int kBlock = 32;
constexpr int kQuantBytes = kBlock * kCols;                 // 512
constexpr int kBlockBytes = kQuantBytes + 4 * kCols;        // + 16 fp32 scales
constexpr int64_t kParallelMacs = int64_t(1) << 22;
constexpr int64_t kParallelWeights = int64_t(1) << 18;
constexpr int64_t kRowChunk = 64;
constexpr int kRegisterRows = 3;  // up to this many rows widen the weights in registers
constexpr int kWideGroups = 4;    // more rows: groups of 16 columns multiplied together
constexpr int kSliceK = 64;       // and inputs widened into fp32 at a time (16 KiB: stays in L1)
constexpr int kSliceRows = 4;     // rows of a register block over a slice (x 4 groups)

struct Call {
    void* out;
    int64_t ldo;
    int dtype;               // x, bias and out: 0 fp32, 1 bf16
    const uint8_t* packed;
    const void* bias;
    int64_t M, N, K;
    const float* x;          // x widened to fp32, [M][K]
};

// E4M3 byte -> its value * 2^-8 in fp32 (the plain C++ level; the vector levels compute the same
// numbers through FP16).
struct Fp8Table {
    float value[256];
    Fp8Table() {
        for (int b = 0; b < 256; ++b) {
            const int exponent = (b >> 3) & 0xF, mantissa = b & 7;
            const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9 - 8)
                                                  : std::ldexp(static_cast<float>(8 + mantissa), exponent - 7 - 3 - 8);
            value[b] = (b & 0x80) ? -magnitude : magnitude;
        }
    }
};

const Fp8Table& table() {
    static const Fp8Table t;
    return t;
}

inline float bias_at(const Call& call, int64_t col) {
    if (call.bias == nullptr) return 0.0f;
    return call.dtype == 1 ? ns_bf16::to_float(static_cast<const uint16_t*>(call.bias)[col])
                           : static_cast<const float*>(call.bias)[col];
}

// acc [rows][cols] -> out, * 256 (+ bias), rounded to the dtype.
void store(const Call& call, const float* acc, int64_t row, int rows, int64_t col, int cols) {
    for (int r = 0; r < rows; ++r)
        for (int j = 0; j < cols; ++j) {
            float v = acc[r * cols + j] * 256.0f;
            if (call.bias != nullptr) v = v + bias_at(call, col + j);
            const int64_t at = (row + r) * call.ldo + col + j;
            if (call.dtype == 1) static_cast<uint16_t*>(call.out)[at] = ns_bf16::from_float(v);
            else static_cast<float*>(call.out)[at] = v;
        }
}

inline const uint8_t* group_at(const Call& call, int64_t group) {
    return call.packed + group * (call.K / kBlock) * kBlockBytes;
}

// ---- plain C++ ------------------------------------------------------------------------------

void block_portable(const Call& call, int64_t row, int rows, int64_t group) {
    const float* lut = table().value;
    const int64_t nb = call.K / kBlock;
    const uint8_t* w = group_at(call, group);
    float acc[4 * kCols];
    for (int r = 0; r < rows; ++r) {
        const float* x = call.x + (row + r) * call.K;
        for (int c = 0; c < kCols; ++c) {
            float total = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* quants = w + b * kBlockBytes;
                float scale;
                std::memcpy(&scale, quants + kQuantBytes + 4 * c, sizeof(scale));
                float sum = 0.0f;
                for (int i = 0; i < kBlock; ++i) sum = std::fma(lut[quants[i * kCols + c]], x[b * kBlock + i], sum);
                total = std::fma(sum, scale, total);
            }
            acc[r * kCols + c] = total;
        }
    }
    store(call, acc, row, rows, group * kCols, kCols);
}

// ---- AVX2 + F16C ----------------------------------------------------------------------------

// 8 E4M3 bytes -> 8 fp32 values * 2^-8.
NS_F8_AVX2 inline __m256 widen8_avx2(const uint8_t* p) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i half = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
    return _mm256_cvtph_ps(half);
}

template <int R>
NS_F8_AVX2 void block_avx2(const Call& call, int64_t row, int64_t group) {
    const int64_t nb = call.K / kBlock;
    const uint8_t* w = group_at(call, group);
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* x = call.x + row * call.K;
    for (int64_t b = 0; b < nb; ++b, w += kBlockBytes, x += kBlock) {
        __m256 sum[R][2];
        for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_ps();
        NS_UNROLL_F8 for (int i = 0; i < kBlock; ++i) {
            const __m256 w0 = widen8_avx2(w + i * kCols), w1 = widen8_avx2(w + i * kCols + 8);
            for (int r = 0; r < R; ++r) {
                const __m256 xv = _mm256_broadcast_ss(x + r * call.K + i);
                sum[r][0] = _mm256_fmadd_ps(w0, xv, sum[r][0]);
                sum[r][1] = _mm256_fmadd_ps(w1, xv, sum[r][1]);
            }
        }
        const __m256 s0 = _mm256_loadu_ps(reinterpret_cast<const float*>(w + kQuantBytes));
        const __m256 s1 = _mm256_loadu_ps(reinterpret_cast<const float*>(w + kQuantBytes) + 8);
        for (int r = 0; r < R; ++r) {
            acc[r][0] = _mm256_fmadd_ps(sum[r][0], s0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(sum[r][1], s1, acc[r][1]);
        }
    }
    alignas(32) float out[R * kCols];
    for (int r = 0; r < R; ++r) {
        _mm256_store_ps(out + r * kCols, acc[r][0]);
        _mm256_store_ps(out + r * kCols + 8, acc[r][1]);
    }
    store(call, out, row, R, group * kCols, kCols);
}

// ---- AVX-512 --------------------------------------------------------------------------------

// 32 E4M3 bytes (two inputs of 16 columns) -> two x 16 fp32 values * 2^-8.
NS_F8_AVX512 inline void widen32(const uint8_t* p, __m512& first, __m512& second) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i half = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(bytes), 7),
                                          _mm512_set1_epi16(static_cast<short>(0xBF80)));
    first = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
    second = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
}

NS_F8_AVX512 void store_avx512(const Call& call, __m512 v, int64_t row, int64_t col) {
    v = _mm512_mul_ps(v, _mm512_set1_ps(256.0f));
    const int64_t at = row * call.ldo + col;
    if (call.dtype == 1) {
        if (call.bias != nullptr) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(call.bias) + col));
            v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
        }
        alignas(64) float values[kCols];
        _mm512_store_ps(values, v);
        uint16_t* out = static_cast<uint16_t*>(call.out) + at;
        for (int j = 0; j < kCols; ++j) out[j] = ns_bf16::from_float(values[j]);
    } else {
        if (call.bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(static_cast<const float*>(call.bias) + col));
        _mm512_storeu_ps(static_cast<float*>(call.out) + at, v);
    }
}

// R rows x C groups, each input's weights widened in registers (few rows).
template <int R, int C>
NS_F8_AVX512 void block_registers(const Call& call, int64_t row, int64_t group) {
    const int64_t nb = call.K / kBlock;
    const int64_t stride = nb * kBlockBytes;
    const uint8_t* w = group_at(call, group);
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    const float* x = call.x + row * call.K;
    for (int64_t b = 0; b < nb; ++b, w += kBlockBytes, x += kBlock) {
        __m512 sum[R][C];
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_ps();
        NS_UNROLL_F8 for (int i = 0; i < kBlock; i += 2) {
            for (int c = 0; c < C; ++c) {
                __m512 w0, w1;
                widen32(w + c * stride + i * kCols, w0, w1);
                for (int r = 0; r < R; ++r)
                    sum[r][c] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[r * call.K + i]), sum[r][c]);
                for (int r = 0; r < R; ++r)
                    sum[r][c] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[r * call.K + i + 1]), sum[r][c]);
            }
        }
        for (int c = 0; c < C; ++c) {
            const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(w + c * stride + kQuantBytes));
            for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(sum[r][c], scale, acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) store_avx512(call, acc[r][c], row + r, (group + c) * kCols);
}

// Inputs [k0, k0 + kn) of groups [group, group + groups) widened into fp32: wide[c][k - k0][16],
// and their blocks' scales: scales[c][block of the slice][16]. kn a multiple of 32.
NS_F8_AVX512 void widen_slice(const Call& call, int64_t group, int groups, int64_t k0, int kn, float* wide,
                              float* scales) {
    for (int c = 0; c < groups; ++c) {
        const uint8_t* w = group_at(call, group + c) + (k0 / kBlock) * kBlockBytes;
        float* out = wide + c * kSliceK * kCols;
        for (int b = 0; b < kn / kBlock; ++b, w += kBlockBytes) {
            std::memcpy(scales + (c * (kSliceK / kBlock) + b) * kCols, w + kQuantBytes, 4 * kCols);
            for (int i = 0; i < kBlock; i += 2) {
                __m512 w0, w1;
                widen32(w + i * kCols, w0, w1);
                _mm512_storeu_ps(out + (b * kBlock + i) * kCols, w0);
                _mm512_storeu_ps(out + (b * kBlock + i + 1) * kCols, w1);
            }
        }
    }
}

// R rows x C groups (from group c0 of the slice) over one slice of inputs: each block's sums in
// registers, folded into the running sums in acc (rows of kWideGroups * 16 floats, in L1) at the
// block's end; x points at the rows' first input of the slice.
template <int R, int C>
NS_F8_AVX512 void block_slice(const float* x, int64_t ldx, const float* wide, const float* scales, int c0, int kn,
                              float* acc) {
    constexpr int kAccRow = kWideGroups * kCols;
    for (int b = 0; b < kn / kBlock; ++b) {
        __m512 sum[R][C];
        NS_UNROLL_F8 for (int r = 0; r < R; ++r)
            NS_UNROLL_F8 for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_ps();
        for (int i = 0; i < kBlock; ++i) {
            const int k = b * kBlock + i;
            NS_UNROLL_F8 for (int c = 0; c < C; ++c) {
                const __m512 wv = _mm512_loadu_ps(wide + ((c0 + c) * kSliceK + k) * kCols);
                NS_UNROLL_F8 for (int r = 0; r < R; ++r)
                    sum[r][c] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[r * ldx + k]), sum[r][c]);
            }
        }
        NS_UNROLL_F8 for (int c = 0; c < C; ++c) {
            const __m512 scale = _mm512_loadu_ps(scales + ((c0 + c) * (kSliceK / kBlock) + b) * kCols);
            NS_UNROLL_F8 for (int r = 0; r < R; ++r) {
                float* total = acc + r * kAccRow + (c0 + c) * kCols;
                _mm512_storeu_ps(total, _mm512_fmadd_ps(sum[r][c], scale, _mm512_loadu_ps(total)));
            }
        }
    }
}

template <int R>
NS_F8_AVX512 void groups_slice(const float* x, int64_t ldx, const float* wide, const float* scales, int groups,
                               int kn, float* acc) {
    switch (groups) {
        case 4: block_slice<R, 4>(x, ldx, wide, scales, 0, kn, acc); break;
        case 3: block_slice<R, 3>(x, ldx, wide, scales, 0, kn, acc); break;
        case 2: block_slice<R, 2>(x, ldx, wide, scales, 0, kn, acc); break;
        default: block_slice<R, 1>(x, ldx, wide, scales, 0, kn, acc); break;
    }
}

NS_F8_AVX512 void rows_slice(const Call& call, int64_t row, int64_t end, int64_t k0, const float* wide,
                             const float* scales, int groups, int kn, float* acc) {
    constexpr int kAccRow = kWideGroups * kCols;
    const float* x = call.x + row * call.K + k0;
    for (; row + kSliceRows <= end; row += kSliceRows, x += kSliceRows * call.K, acc += kSliceRows * kAccRow)
        groups_slice<kSliceRows>(x, call.K, wide, scales, groups, kn, acc);
    switch (end - row) {
        case 3: groups_slice<3>(x, call.K, wide, scales, groups, kn, acc); break;
        case 2: groups_slice<2>(x, call.K, wide, scales, groups, kn, acc); break;
        case 1: groups_slice<1>(x, call.K, wide, scales, groups, kn, acc); break;
        default: break;
    }
}

// Rows [row, end) (at most kRowChunk) against groups [group, group + groups) (at most
// kWideGroups): the inputs a slice at a time, each slice's weights widened once into a scratch
// that stays in L1 (an fp32 copy of all K would be read from L2, twice the bf16 GEMM's bytes),
// the running sums kept in acc between slices; each output still summed in the one order.
NS_F8_AVX512 void rows_widened(const Call& call, int64_t row, int64_t end, int64_t group, int groups, float* wide,
                               float* scales, float* acc) {
    constexpr int kAccRow = kWideGroups * kCols;
    std::fill(acc, acc + (end - row) * kAccRow, 0.0f);
    for (int64_t k0 = 0; k0 < call.K; k0 += kSliceK) {
        const int kn = static_cast<int>(std::min<int64_t>(kSliceK, call.K - k0));
        widen_slice(call, group, groups, k0, kn, wide, scales);
        rows_slice(call, row, end, k0, wide, scales, groups, kn, acc);
    }
    for (int64_t r = row; r < end; ++r)
        for (int c = 0; c < groups; ++c)
            store_avx512(call, _mm512_loadu_ps(acc + (r - row) * kAccRow + c * kCols), r, (group + c) * kCols);
}

template <int C>
NS_F8_AVX512 void rows_registers(const Call& call, int64_t group) {
    switch (call.M) {
        case 3: block_registers<3, C>(call, 0, group); break;
        case 2: block_registers<2, C>(call, 0, group); break;
        default: block_registers<1, C>(call, 0, group); break;
    }
}

void x_to_float(const void* x, int64_t ldx, int dtype, int64_t M, int64_t K, float* out) {
    for (int64_t r = 0; r < M; ++r)
        for (int64_t k = 0; k < K; ++k)
            out[r * K + k] = dtype == 1 ? ns_bf16::to_float(static_cast<const uint16_t*>(x)[r * ldx + k])
                                        : static_cast<const float*>(x)[r * ldx + k];
}

void run(const Call& call, int level) {
    const int64_t groups = call.N / kCols;
    const int64_t pairs = (groups + 1) / 2;
#pragma omp parallel if (call.M * call.N * call.K >= kParallelMacs || call.N * call.K >= kParallelWeights)
    {
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        if (level >= ns_isa::kAvx512Bf16 && call.M > kRegisterRows) {
            // This thread's groups, kWideGroups at a time widened once per chunk of rows.
            const int64_t first = groups * thread / threads, last = groups * (thread + 1) / threads;
            alignas(64) float wide[kWideGroups * kSliceK * kCols];
            alignas(64) float scales[kWideGroups * (kSliceK / kBlock) * kCols];
            thread_local std::vector<float> acc;
            acc.resize(kRowChunk * kWideGroups * kCols);
            for (int64_t chunk = 0; chunk < call.M; chunk += kRowChunk) {
                const int64_t chunk_end = std::min(chunk + kRowChunk, call.M);
                for (int64_t group = first; group < last; group += kWideGroups) {
                    const int count = static_cast<int>(std::min<int64_t>(kWideGroups, last - group));
                    rows_widened(call, chunk, chunk_end, group, count, wide, scales, acc.data());
                }
            }
        } else {
            const int64_t first = pairs * thread / threads, last = pairs * (thread + 1) / threads;
            for (int64_t pair = first; pair < last; ++pair) {
                const bool two = 2 * pair + 1 < groups;
                if (level >= ns_isa::kAvx512Bf16) {
                    if (two) rows_registers<2>(call, 2 * pair);
                    else rows_registers<1>(call, 2 * pair);
                    continue;
                }
                for (int64_t group = 2 * pair; group < 2 * pair + (two ? 2 : 1); ++group) {
                    if (level == ns_isa::kAvx2) {
                        int64_t row = 0;
                        for (; row + 2 <= call.M; row += 2) block_avx2<2>(call, row, group);
                        if (row < call.M) block_avx2<1>(call, row, group);
                    } else {
                        for (int64_t row = 0; row < call.M; row += 4)
                            block_portable(call, row, static_cast<int>(std::min<int64_t>(4, call.M - row)), group);
                    }
                }
            }
        }
    }
}

}  // namespace

extern "C" {

// out [M, N] (row stride ldo) = x [M, K] (row stride ldx) @ w^T (+ bias [N]), x, bias and out of
// one dtype (0 fp32, 1 bf16), w packed by quant.py's pack_weight (N a multiple of 16 there).
// 0 done; 2 a shape or dtype it does not take.
int ns_gemm_fp8(void* out, int64_t ldo, const void* x, int64_t ldx, int dtype, const void* packed, const void* bias,
                int64_t M, int64_t N, int64_t K) {
    if ((dtype != 0 && dtype != 1) || K % kBlock != 0 || N % kCols != 0 || M < 0) return 2;
    if (M == 0) return 0;
    thread_local std::vector<float> xf;
    xf.resize(M * K);
    x_to_float(x, ldx, dtype, M, K, xf.data());
    const Call call{out, ldo, dtype, static_cast<const uint8_t*>(packed), bias, M, N, K, xf.data()};
    run(call, ns_isa::current());
    return 0;
}

}  // extern "C"
