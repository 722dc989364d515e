// The fp8 KV cache's element formats (kernels/kv_dtype.py): float8_e4m3fn (4 exponent bits, bias 7,
// no infinities, 0x7F NaN, largest 448) and float8_e5m2 (5 exponent bits, bias 15, IEEE-like,
// largest 57344). Stores saturate at the largest finite value (NaN stays NaN) and round to nearest
// even, as kv_dtype.to_cache; loads are exact in bf16 and fp32.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace ns_fp8 {

enum Format : int { kNone = 0, kE4M3 = 1, kE5M2 = 2 };

// x saturated, then rounded to nearest even: subnormals as integer multiples of the smallest step
// (nearbyint, the default rounding mode's ties to even); normals by rounding fp32's mantissa.
// Branch-free, so that a loop of it vectorizes.
template <int kFormat>
inline uint8_t from_float(float x) {
    constexpr int M = kFormat == kE4M3 ? 3 : 2, B = kFormat == kE4M3 ? 7 : 15;
    constexpr float kLargest = kFormat == kE4M3 ? 448.0f : 57344.0f;
    constexpr uint32_t kLargestCode = kFormat == kE4M3 ? 0x7E : 0x7B, kNanCode = 0x7F;
    constexpr float kSmallestNormal = 1.0f / static_cast<float>(1u << (B - 1));
    constexpr float kSubnormalSteps = static_cast<float>(1u << (B + M - 1));  // 1 / the smallest step
    constexpr int kShift = 23 - M;
    uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    const uint32_t sign = (u >> 24) & 0x80u;
    u &= 0x7FFFFFFFu;
    float a;
    std::memcpy(&a, &u, sizeof(a));
    const uint32_t normal = ((u + ((1u << (kShift - 1)) - 1u) + ((u >> kShift) & 1u)) >> kShift) -
                            (static_cast<uint32_t>(127 - B) << M);
    const float below = a < kSmallestNormal ? a : kSmallestNormal;  // NaN and large: in range
    const uint32_t subnormal = static_cast<uint32_t>(static_cast<int32_t>(std::nearbyint(below * kSubnormalSteps)));
    uint32_t code = a < kSmallestNormal ? subnormal : normal;
    code = a >= kLargest ? kLargestCode : code;
    code = u > 0x7F800000u ? kNanCode : code;
    return static_cast<uint8_t>(sign | code);
}

inline uint8_t from_float(float x, int format) {
    return format == kE4M3 ? from_float<kE4M3>(x) : from_float<kE5M2>(x);
}

// A byte's value (building kv_fp8.cpp's tables).
inline float to_float(uint8_t b, int format) {
    const int mantissa = format == kE4M3 ? 3 : 2, bias = format == kE4M3 ? 7 : 15;
    const int e = (b & 0x7F) >> mantissa, m = b & ((1 << mantissa) - 1);
    const int top = (1 << (7 - mantissa)) - 1;  // the all-ones exponent
    float value;
    if ((b & 0x7F) == 0x7F || (format == kE5M2 && e == top && m != 0))
        value = NAN;
    else if (format == kE5M2 && e == top)
        value = INFINITY;
    else if (e == 0)
        value = std::ldexp(static_cast<float>(m), 1 - bias - mantissa);
    else
        value = std::ldexp(1.0f + static_cast<float>(m) / static_cast<float>(1 << mantissa), e - bias);
    return b & 0x80 ? -value : value;
}

}  // namespace ns_fp8
