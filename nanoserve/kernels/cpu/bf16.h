// bf16 <-> fp32, as torch rounds (nearest even, NaN kept quiet). Shared by the kernel files.
#pragma once
#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace ns_bf16 {

inline float to_float(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

inline uint16_t from_float(float f) {  // branch-free
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// to_float on 8 values at once (AVX2): p[0..7] widened to fp32, exact.
__attribute__((target("avx2"))) inline __m256 to_float_x8(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// from_float on 8 values at once (AVX2): the same bits, returned as 8 packed bf16.
__attribute__((target("avx2"))) inline __m128i from_float_x8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i out = _mm256_blendv_epi8(rounded, quiet_nan, nan);  // 16-bit values in 32-bit lanes
    return _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
}

}  // namespace ns_bf16
