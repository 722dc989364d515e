"""The CPU kernels' ISA level (kernels/cpu/isa.h, cpu_ops.ISA_LEVELS): chosen at load from the
CPU, forced by NANOSERVE_CPU_ISA, named in the engine's startup log, and refused with one clear
line when it names no level or one this CPU can't run."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from nanoserve.kernels.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(
    cpu_ops.library() is None, reason="the CPU kernels don't load here (no compiler)"
)

PRINT_LEVEL = "from nanoserve.kernels.cpu import ops as cpu_ops; print(cpu_ops.isa())"


def run_python(code: str, level: str | None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "NANOSERVE_CPU_ISA"}
    if level is not None:
        env["NANOSERVE_CPU_ISA"] = level
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_levels_are_ordered_and_the_portable_one_always_runs():
    supported = cpu_ops.supported_isas()
    assert supported[0] == "portable"
    assert supported == [level for level in cpu_ops.ISA_LEVELS if level in supported]
    assert run_python(PRINT_LEVEL, None).stdout.strip() == supported[-1], (
        "the default is the best level here"
    )


def test_forced_level_is_the_one_used():
    for level in cpu_ops.supported_isas():
        assert run_python(PRINT_LEVEL, level).stdout.strip() == level


def test_a_name_that_is_no_level_is_refused():
    result = run_python(PRINT_LEVEL, "sse9")
    assert result.returncode != 0
    assert (
        "NANOSERVE_CPU_ISA must be one of portable, avx2, avx512bf16, amx, got 'sse9'"
        in result.stderr
    )
    with pytest.raises(ValueError, match="unknown ISA level"):
        cpu_ops.set_isa("sse9")


def test_a_level_this_cpu_cannot_run_is_refused_by_the_cli(tiny_llama_dir):
    missing = [level for level in cpu_ops.ISA_LEVELS if level not in cpu_ops.supported_isas()]
    if not missing:
        pytest.skip("this CPU runs every level")
    env = {**os.environ, "NANOSERVE_CPU_ISA": missing[-1]}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanoserve",
            "generate",
            "--model",
            str(tiny_llama_dir),
            "--max-tokens",
            "2",
            "hi",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("nanoserve: error:")]
    assert lines == [
        f"nanoserve: error: NANOSERVE_CPU_ISA={missing[-1]}: this CPU can't run that level "
        f"(it runs {', '.join(cpu_ops.supported_isas())})"
    ]
    with pytest.raises(ValueError, match="can't run"):
        cpu_ops.set_isa(missing[-1])


def test_startup_log_names_the_level(tiny_llama_dir, caplog, cpu_isa):
    from nanoserve import LLM

    with caplog.at_level(logging.INFO, logger="nanoserve.engine.model_runner"):
        LLM(model=str(tiny_llama_dir), dtype="bfloat16", device="cpu", num_kv_blocks=16)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU kernels: ")]
    assert len(lines) == 1 and lines[0].startswith(f"CPU kernels: {cpu_isa} ("), lines
