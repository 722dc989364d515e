// Scalar bf16 <-> fp32, as torch rounds (nearest even, NaN kept quiet). Shared by the kernel files.
#pragma once
#include <cstdint>
#include <cstring>

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

}  // namespace ns_bf16
