// AVX-512 helpers shared by the CPU kernels (ops.cpp, attention_amx.cpp). Each caller compiles
// them for its own target (AVX-512 BF16, or that plus AMX).
#pragma once
#include <cstdint>
#include <immintrin.h>

#define NS_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

namespace ns_simd {

// 2^x, relative error ~1e-7; below -126 it stays at 2^-126, from 128 up it is +inf (scalef
// overflows), as ops.cpp's scalar exp2_clamped.
NS_AVX512_BF16 inline __m512 exp2x16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(200.0f)), _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

NS_AVX512_BF16 inline __m256i to_bf16x16(__m512 v) {  // round to nearest even
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
}

// 16 bf16 values as fp32 (exact).
NS_AVX512_BF16 inline __m512 load_bf16x16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// v rounded to bf16 (nearest even) and back to fp32.
NS_AVX512_BF16 inline __m512 round_bf16x16(__m512 v) {
    const __m512i wide = _mm512_cvtepu16_epi32(to_bf16x16(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// A decode row's softmax over num_blocks blocks of 16 scores (base 2, -inf where masked): one
// max, one exp per score; the probabilities rounded to bf16 into probs (16 a block), lanes of the
// last block outside last_keep zero; returns their fp32 sum, unrounded.
NS_AVX512_BF16 inline float softmax_bf16(uint16_t* probs, const float* scores, int num_blocks, __mmask16 last_keep) {
    __m512 m = _mm512_loadu_ps(scores);
    for (int b = 1; b < num_blocks; ++b) m = _mm512_max_ps(m, _mm512_loadu_ps(scores + b * 16));
    const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int b = 0; b < num_blocks; ++b) {
        __m512 p = exp2x16(_mm512_sub_ps(_mm512_loadu_ps(scores + b * 16), row_max));
        if (b == num_blocks - 1) p = _mm512_maskz_mov_ps(last_keep, p);
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + b * 16), to_bf16x16(p));
    }
    return _mm512_reduce_add_ps(sum);
}

}  // namespace ns_simd
