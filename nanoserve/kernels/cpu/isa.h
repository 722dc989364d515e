// The instruction-set level the CPU kernels run at: one kernel set per level, chosen at run time
// (kernels/cpu_ops.py sets it once from what the CPU reports, or from NANOSERVE_CPU_ISA; tests
// switch it to run every level this machine can execute). Every level sums each output element
// in one fixed order whatever the number of rows; the orders of two levels differ, so a level is
// fixed for the life of a process outside the tests.
#pragma once
#include <atomic>

namespace ns_isa {

enum Level : int {
    kPortable = 0,    // plain C++ (the compiler's own vectorization of it)
    kAvx2 = 1,        // AVX2 + FMA: bf16 widened to fp32, fp32 FMAs
    kAvx512Bf16 = 2,  // AVX-512 with AVX512_BF16: VDPBF16PS (Zen 4/5, Cooper Lake, Sapphire Rapids)
    kAmx = 3,         // AMX-BF16 tiles (Sapphire Rapids and later)
};

inline std::atomic<int> level{-1};  // -1: not set yet (cpu_ops sets it right after loading)

inline int current() {
    const int value = level.load(std::memory_order_relaxed);
    return value < 0 ? kPortable : value;
}

}  // namespace ns_isa
