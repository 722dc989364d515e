// bf16 GEMM on AMX tiles for the prompt rows of a CPU step: out[M, N] = x[M, K] @ w[N, K]^T (+ bias).
//
// Why our own: oneDNN picks its kernel and K blocking from M, so a row's bits depend on how many
// rows share its GEMM (measured: M = 128 and M = 512 disagree on most of SmolLM2's shapes).
// Before this, prompt rows were padded to GEMMs of exactly 512 rows, which made a 128-token
// prompt pay for 512. Here every output element is accumulated in one order, K block by K block,
// one TDPBF16PS per block, whatever M is and whichever rows share the call: a row gives the same
// bits in a prompt of any length, in any chunk, next to any other request's rows.
//
// Weights are packed once at load into AMX's pair-interleaved layout: for each 16-column block of
// w, its K/32 tiles of [16 k-pairs][16 columns][2 k], 1 KiB each, one after the other
// (cpu_ops.pack_amx_weight).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <vector>

#define NS_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

namespace {

constexpr int kTileRows = 16;     // rows of an A or C tile
constexpr int kTileK = 32;        // bf16 elements of K in an A tile row
constexpr int kTileCols = 16;     // fp32 columns of a C tile
constexpr int kTileElements = kTileRows * kTileK;  // bf16 elements of a packed B tile (1 KiB)
// Loop nest per thread (its share of the column blocks): groups of column blocks whose packed
// weights (~1 MiB) stay in L2, then chunks of 64 rows of x, then the group's column pairs, then
// 32-row blocks. Chosen by measurement on SmolLM2's shapes (single thread, AMX): row chunks of
// 64 / 128 / 256 and weight groups of 0.25 / 1 / 4 MiB were within noise of each other up to
// M = 1,024; chunks of 64 did best at M = 2,048 with N = 3,072.
constexpr int64_t kRowChunk = 64;
constexpr int64_t kWeightGroupBytes = int64_t(1) << 20;
constexpr int64_t kParallelMacs = int64_t(1) << 22;
constexpr int64_t kParallelWeights = int64_t(1) << 18;

struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

bool amx_usable() {
    static const bool usable = [] {
        if (!__builtin_cpu_supports("avx512bf16")) return false;
        unsigned eax, ebx, ecx, edx;
        __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
        const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
        if (!amx_bf16 || !amx_tile) return false;
        constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // Linux asks first
        return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return usable;
}

// Tiles 0-3: C (two row blocks x two column blocks); 4-5: A row blocks; 6-7: B column blocks.
NS_AMX void configure_tiles() {
    TileConfig config{};
    config.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        config.rows[t] = kTileRows;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

// Rows [0, rows) of the fp32 block acc[32][32] (+ bias) to bf16, columns [0, cols).
NS_AMX void store_rows(uint16_t* out, int64_t ldo, const float* acc, int rows, int cols, const uint16_t* bias) {
    for (int r = 0; r < rows; ++r) {
        for (int c = 0; c < cols; c += kTileCols) {
            __m512 v = _mm512_loadu_ps(acc + r * 2 * kTileCols + c);
            if (bias != nullptr) {
                const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + c)));
                v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
            }
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + c), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
        }
    }
}

// Up to 32 rows x up to 32 columns of out. a0/a1: the two 16-row blocks of x (a1 unused when
// two_row_blocks is false); b: the first column block's packed tiles, the second follows.
NS_AMX void block(uint16_t* out, int64_t ldo, const uint16_t* a0, const uint16_t* a1, int64_t lda_bytes,
                  const uint16_t* b, int64_t k_tiles, bool two_row_blocks, bool two_col_blocks, int rows,
                  const uint16_t* bias, float* acc) {
    const uint16_t* b1 = b + k_tiles * kTileElements;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kt = 0; kt < k_tiles; ++kt) {
        _tile_loadd(4, a0 + kt * kTileK, lda_bytes);
        _tile_loadd(6, b + kt * kTileElements, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_col_blocks) {
            _tile_loadd(7, b1 + kt * kTileElements, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_row_blocks) {
            _tile_loadd(5, a1 + kt * kTileK, lda_bytes);
            _tile_dpbf16ps(2, 5, 6);
            if (two_col_blocks) _tile_dpbf16ps(3, 5, 7);
        }
    }
    constexpr int stride = 2 * kTileCols * sizeof(float);
    _tile_stored(0, acc, stride);
    if (two_col_blocks) _tile_stored(1, acc + kTileCols, stride);
    if (two_row_blocks) {
        _tile_stored(2, acc + kTileRows * 2 * kTileCols, stride);
        if (two_col_blocks) _tile_stored(3, acc + kTileRows * 2 * kTileCols + kTileCols, stride);
    }
    store_rows(out, ldo, acc, rows, two_col_blocks ? 2 * kTileCols : kTileCols, bias);
}

NS_AMX void gemm_bf16(uint16_t* out, int64_t ldo, const uint16_t* x, int64_t ldx, const uint16_t* packed,
                      const uint16_t* bias, int64_t M, int64_t N, int64_t K) {
    const int64_t k_tiles = K / kTileK;
    const int64_t col_blocks = N / kTileCols;
    const int64_t col_pairs = (col_blocks + 1) / 2;
    // Few rows: the weights' stream from memory is the cost, and two cores pull more than one.
#pragma omp parallel if (M * N * K >= kParallelMacs || N * K >= kParallelWeights)
    {
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = col_pairs * thread / threads, last = col_pairs * (thread + 1) / threads;
        // Column pairs in groups whose packed weights stay in L2 while every row chunk passes.
        const int64_t group = std::max<int64_t>(1, kWeightGroupBytes / (2 * kTileCols * K * 2));
        alignas(64) float acc[2 * kTileRows * 2 * kTileCols];
        // The last rows, copied into 32 rows so that tile loads stay inside x. Kept per thread
        // across calls (a decode step's M is rarely a multiple of 32); rows past the copied ones
        // hold whatever is there, which only reaches output rows that are never stored.
        thread_local std::vector<uint16_t> tail;
        bool tail_copied = false;
        configure_tiles();
        for (int64_t group_start = first; group_start < last; group_start += group) {
            const int64_t group_end = std::min(group_start + group, last);
            for (int64_t chunk = 0; chunk < M; chunk += kRowChunk) {
                const int64_t chunk_end = std::min(chunk + kRowChunk, M);
                for (int64_t pair = group_start; pair < group_end; ++pair) {
                    const int64_t col = pair * 2 * kTileCols;
                    const bool two_cols = pair * 2 + 1 < col_blocks;
                    const uint16_t* b = packed + pair * 2 * k_tiles * kTileElements;
                    const uint16_t* block_bias = bias != nullptr ? bias + col : nullptr;
                    for (int64_t row = chunk; row < chunk_end; row += 2 * kTileRows) {
                        const int rows = static_cast<int>(std::min<int64_t>(chunk_end - row, 2 * kTileRows));
                        const uint16_t* a = x + row * ldx;
                        int64_t lda = ldx;
                        if (rows < 2 * kTileRows) {  // only the last block of rows is short
                            if (!tail_copied) {
                                if (tail.size() < static_cast<size_t>(2 * kTileRows * K)) tail.resize(2 * kTileRows * K);
                                for (int r = 0; r < rows; ++r) std::memcpy(&tail[r * K], a + r * ldx, K * sizeof(uint16_t));
                                tail_copied = true;
                            }
                            a = tail.data();
                            lda = K;
                        }
                        block(out + row * ldo + col, ldo, a, a + kTileRows * lda, lda * sizeof(uint16_t), b,
                              k_tiles, rows > kTileRows, two_cols, rows, block_bias, acc);
                    }
                }
            }
        }
        _tile_release();
    }
}

}  // namespace

extern "C" {

// 0 done; 1 this CPU has no AMX (or the OS refuses it); 2 a shape it does not take.
int ns_gemm_bf16_amx(void* out, int64_t ldo, const void* x, int64_t ldx, const void* packed, const void* bias,
                     int64_t M, int64_t N, int64_t K) {
    if (!amx_usable()) return 1;
    if (K % kTileK != 0 || N % kTileCols != 0 || M < 0) return 2;
    if (M == 0) return 0;
    gemm_bf16(static_cast<uint16_t*>(out), ldo, static_cast<const uint16_t*>(x), ldx,
              static_cast<const uint16_t*>(packed), static_cast<const uint16_t*>(bias), M, N, K);
    return 0;
}

int ns_amx_available() { return amx_usable() ? 1 : 0; }

}  // extern "C"
