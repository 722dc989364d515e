"""bf16.h's 8-wide AVX2 rounding (from_float_x8, the AVX2 quantized GEMM's output store) against
torch's fp32 -> bf16 rounding and against the scalar from_float it stands in for, on the values
where roundings differ: exact ties with an even and an odd last bit, one ulp either side of a tie,
the largest finite values (which round to infinity), subnormals, signed zeros, infinities and
NaNs, and random bit patterns. Compiled here, run on this CPU where it has AVX2."""

from __future__ import annotations

import platform
import subprocess

import pytest
import torch

from nanoserve.kernels.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or cpu_ops.compiler() is None, reason="an x86-64 C++ compiler"
)

_PROGRAM = r"""
#include "bf16.h"
#include <cstdio>
// stdin: fp32 bit patterns, 8 per line; stdout: from_float_x8's and from_float's bf16 bits
__attribute__((target("avx2"))) int main() {
    if (!__builtin_cpu_supports("avx2")) return 3;
    unsigned bits[8];
    while (std::scanf("%x %x %x %x %x %x %x %x", bits, bits + 1, bits + 2, bits + 3, bits + 4, bits + 5,
                      bits + 6, bits + 7) == 8) {
        alignas(32) float values[8];
        std::memcpy(values, bits, sizeof(values));
        alignas(16) uint16_t wide[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(wide), ns_bf16::from_float_x8(_mm256_load_ps(values)));
        for (int i = 0; i < 8; ++i) std::printf("%04x %04x\n", wide[i], ns_bf16::from_float(values[i]));
    }
}
"""


def _patterns() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    high = torch.randint(0, 1 << 16, (512,), generator=generator, dtype=torch.int64) << 16
    special = [
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7FC00000,
        0xFFC00000,
        0x7F800001,
        0x7FBFFFFF,
        0xFFFFFFFF,
        0x7F7FFFFF,
        0xFF7FFFFF,
        0x7F7F8000,
        0x00000001,
        0x807FFFFF,
        0x00008000,
        0x00018000,
        0x3F808000,
        0x3F818000,
    ]
    parts = [torch.tensor(special, dtype=torch.int64)]
    for low in (0x8000, 0x7FFF, 0x8001, 0xFFFF, 0x0001):  # ties, and one ulp either side
        parts.append(high | low)
    parts.append(torch.randint(0, 1 << 32, (4096,), generator=generator, dtype=torch.int64))
    bits = torch.cat(parts)
    return torch.cat([bits, bits.new_zeros((-bits.numel()) % 8)])


def test_from_float_x8_rounds_as_torch_and_as_the_scalar_path(tmp_path):
    source = tmp_path / "round.cpp"
    source.write_text(_PROGRAM)
    binary = tmp_path / "round"
    header_dir = cpu_ops._HEADERS[0].parent
    build = subprocess.run(
        [
            cpu_ops.compiler(),
            "-O2",
            "-std=c++17",
            f"-I{header_dir}",
            str(source),
            "-o",
            str(binary),
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    bits = _patterns()
    lines = "\n".join(" ".join(f"{int(b):08x}" for b in row) for row in bits.reshape(-1, 8))
    run = subprocess.run([str(binary)], input=lines + "\n", capture_output=True, text=True)
    if run.returncode == 3:
        pytest.skip("this CPU has no AVX2")
    assert run.returncode == 0, run.stderr
    pairs = [line.split() for line in run.stdout.splitlines()]
    assert len(pairs) == bits.numel()
    wide = torch.tensor([int(a, 16) for a, _ in pairs], dtype=torch.int64)
    scalar = torch.tensor([int(b, 16) for _, b in pairs], dtype=torch.int64)
    assert torch.equal(wide, scalar)  # the very bits of the scalar path, NaN payloads included
    values = bits.to(torch.int32).view(torch.float32)  # int64 -> int32 keeps the low 32 bits
    expected = values.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    nan = torch.isnan(values)
    assert torch.equal(wide[~nan], expected[~nan])
    ours_nan = (wide & 0x7FFF) > 0x7F80
    assert bool(ours_nan[nan].all()) and not bool(ours_nan[~nan].any())
