"""The CPU kernels build on every x86-64 CPU, not only on the kind the suite happens to run on.

Each hand-vectorized path carries its own target attribute, so one source compiles for a CPU with
or without AVX-512 and AMX; `-march=native` decides only what the plain loops may use. A mistake
there (an intrinsic where the attribute does not reach, as in a lambda) compiles on a CPU that has
the instructions and fails on one that lacks them, where the engine would fall back to the torch
references and every kernel test would be skipped. So: the library must load here, and the
sources must compile for each x86-64 level, whatever this CPU is."""

from __future__ import annotations

import platform
import subprocess

import pytest

from nanoserve.kernels.cpu import ops as cpu_ops


def test_the_kernels_load_where_a_compiler_is():
    if cpu_ops.compiler() is None:
        pytest.skip("no C++ compiler here: the torch references serve")
    assert cpu_ops.library() is not None, cpu_ops.load_error()


# The portable baseline, AVX2 + FMA (Zen 2/3, Haswell) and AVX-512 without BF16 (Skylake-X). At
# -O0, which reports an intrinsic that can't be inlined as -O3 does, in a quarter of the time.
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 levels")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "x86-64-v4"])
def test_the_kernels_compile_for_every_x86_64_level(march, tmp_path):
    cxx = cpu_ops.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler here")
    command = [
        "-O0" if flag == "-O3" else flag
        for flag in cpu_ops.build_command(cxx, tmp_path / "lib.so", march=march)
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
