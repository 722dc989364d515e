// One core's peak rate of the two dot-product instructions the CPU GEMMs are built on: VNNI
// vpdpbusd (64 int8 multiply-adds, the quantized GEMM) and AVX512_BF16 vdpbf16ps (32 bf16
// multiply-adds, the bf16 GEMM), each on 12 independent accumulators (enough to hide latency).
//   g++ -O3 -march=native benchmarks/quant/dot_peak.cpp -o /tmp/dot_peak && /tmp/dot_peak
#include <immintrin.h>

#include <chrono>
#include <cstdio>

__attribute__((target("avx512f,avx512bw,avx512vnni,avx512bf16"))) int main() {
    constexpr long kIterations = 100000000;
    __m512i acc[12];
    __m512 sums[12];
    for (int i = 0; i < 12; ++i) {
        acc[i] = _mm512_set1_epi32(i);
        sums[i] = _mm512_set1_ps(static_cast<float>(i));
    }
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
    __m512bh h = (__m512bh)_mm512_set1_epi16(0x3f80);
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < kIterations; ++i) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
        asm volatile("" : "+v"(a));
    }
    const auto t1 = std::chrono::steady_clock::now();
    for (long i = 0; i < kIterations; ++i) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; ++j) sums[j] = _mm512_dpbf16_ps(sums[j], h, h);
        asm volatile("" : "+v"(h));
    }
    const auto t2 = std::chrono::steady_clock::now();
    int keep = 0;
    for (int i = 0; i < 12; ++i) keep += _mm512_reduce_add_epi32(acc[i]) + static_cast<int>(_mm512_reduce_add_ps(sums[i]));
    const double int8 = 12.0 * kIterations / std::chrono::duration<double>(t1 - t0).count();
    const double bf16 = 12.0 * kIterations / std::chrono::duration<double>(t2 - t1).count();
    std::printf("vpdpbusd  %.2f G/s = %.0f GMAC/s (int8)\nvdpbf16ps %.2f G/s = %.0f GMAC/s (bf16)\n(%d)\n",
                int8 / 1e9, int8 * 64 / 1e9, bf16 / 1e9, bf16 * 32 / 1e9, keep & 1);
}
