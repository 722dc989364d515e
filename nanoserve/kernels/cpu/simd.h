// AVX-512 helpers shared by the CPU kernels (ops.cpp, attention_amx.cpp). Each caller compiles
// them for its own target (AVX-512 BF16, or that plus AMX).
#pragma once
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

}  // namespace ns_simd
