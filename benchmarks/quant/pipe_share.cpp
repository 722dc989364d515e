// Which of the quantized GEMM's other instructions compete with vpdpbusd for its pipes: one core
// runs 8 independent vpdpbusd an iteration alone, then with 4 or 8 independent instructions of a
// kind beside them (and those 8 alone); ns an iteration. An instruction that shares vpdpbusd's
// pipes adds its own time, one that doesn't hides under it. (Each Q4_1 block's fp32 fold is three
// multiplies, a conversion and two adds against 8 vpdpbusd an output register.)
//   g++ -O2 benchmarks/quant/pipe_share.cpp -o /tmp/pipe_share && /tmp/pipe_share
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#define T __attribute__((target("avx512f,avx512bw,avx512vnni,avx512bf16,avx512dq"), noinline))
constexpr long kIt = 20000000;
template <int D, int K, int KIND> T double run() {
    __m512i acc[D]; __m512 f[8]; __m512i g[8];
    for (int i = 0; i < D; ++i) acc[i] = _mm512_set1_epi32(i);
    for (int i = 0; i < 8; ++i) { f[i] = _mm512_set1_ps(1.0f + i); g[i] = _mm512_set1_epi32(i); }
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
    __m512 m = _mm512_set1_ps(1.0f);
    auto t0 = std::chrono::steady_clock::now();
    for (long it = 0; it < kIt; ++it) {
#pragma GCC unroll 16
        for (int j = 0; j < D; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
#pragma GCC unroll 16
        for (int j = 0; j < K; ++j) {
            if (KIND == 0) f[j % 8] = _mm512_mul_ps(f[j % 8], m);
            if (KIND == 1) f[j % 8] = _mm512_add_ps(f[j % 8], m);
            if (KIND == 2) f[j % 8] = _mm512_cvtepi32_ps(g[j % 8]), g[j%8] = _mm512_castps_si512(f[j%8]);
            if (KIND == 3) f[j % 8] = _mm512_fmadd_ps(f[j % 8], m, m);
            if (KIND == 4) g[j % 8] = _mm512_and_si512(g[j % 8], a);
            if (KIND == 5) g[j % 8] = _mm512_srli_epi16(g[j % 8], 4);
            if (KIND == 6) f[j % 8] = (__m512)_mm512_dpbf16_ps(f[j % 8], (__m512bh)a, (__m512bh)b);
        }
        asm volatile("" : "+v"(a), "+v"(m));
    }
    auto t1 = std::chrono::steady_clock::now();
    long s = 0; for (int i = 0; i < D; ++i) s += _mm512_reduce_add_epi32(acc[i]);
    for (int i = 0; i < 8; ++i) s += (long)_mm512_reduce_add_ps(f[i]) + _mm512_reduce_add_epi32(g[i]);
    if (s == 42) printf("x");
    return std::chrono::duration<double>(t1 - t0).count() / kIt * 1e9;  // ns per iteration
}
int main() {
    const char* names[] = {"mul_ps", "add_ps", "cvtdq2ps", "fmadd", "and", "srli16", "dpbf16"};
    double base = run<8, 0, 0>();
    printf("8 dpbusd alone: %.3f ns/it\n", base);
    double r[7][3];
    r[0][0] = run<8,4,0>(); r[0][1] = run<8,8,0>(); r[0][2] = run<0,8,0>();
    r[1][0] = run<8,4,1>(); r[1][1] = run<8,8,1>(); r[1][2] = run<0,8,1>();
    r[2][0] = run<8,4,2>(); r[2][1] = run<8,8,2>(); r[2][2] = run<0,8,2>();
    r[3][0] = run<8,4,3>(); r[3][1] = run<8,8,3>(); r[3][2] = run<0,8,3>();
    r[4][0] = run<8,4,4>(); r[4][1] = run<8,8,4>(); r[4][2] = run<0,8,4>();
    r[5][0] = run<8,4,5>(); r[5][1] = run<8,8,5>(); r[5][2] = run<0,8,5>();
    r[6][0] = run<8,4,6>(); r[6][1] = run<8,8,6>(); r[6][2] = run<0,8,6>();
    for (int k = 0; k < 7; ++k) printf("%-9s +4: %.3f  +8: %.3f  8 alone: %.3f\n", names[k], r[k][0], r[k][1], r[k][2]);
}
