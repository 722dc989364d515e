"""nanoserve/envs.py is the one place that reads the environment: no other module of the package
touches os.environ / os.getenv, every variable it declares is documented (there and in
docs/deployment.md), and the accessors read what the environment says."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve import envs

PACKAGE = Path(envs.__file__).parent
DEPLOYMENT_GUIDE = PACKAGE.parent / "docs" / "deployment.md"


def _environment_reads(path: Path) -> list[str]:
    """`os.environ`, `os.getenv`, `os.putenv`, `environ` / `getenv` imported from os, in one file's
    syntax tree (comments and strings do not count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in (
            "environ",
            "environb",
            "getenv",
            "putenv",
            "unsetenv",
        ):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in ("environ", "environb", "getenv", "putenv", "unsetenv"):
                    found.append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: from os import {alias.name}"
                    )
    return found


def test_only_envs_py_reads_the_environment():
    offenders = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "envs.py" or path.parent != PACKAGE
        for hit in _environment_reads(path)
    ]
    assert offenders == [], "read the environment through nanoserve/envs.py:\n" + "\n".join(
        offenders
    )


def test_the_check_finds_a_read():
    sample = PACKAGE / "envs.py"  # the one file allowed to read: the check must see its reads
    assert _environment_reads(sample)


def test_every_variable_is_documented():
    guide = DEPLOYMENT_GUIDE.read_text()
    assert len(envs.ENVIRONMENT_VARIABLES) >= 15
    for name, variable in envs.ENVIRONMENT_VARIABLES.items():
        assert variable.name == name and re.fullmatch(r"[A-Z][A-Z0-9_]*", name)
        assert len(variable.doc) >= 20, f"{name}: say what it does"
        assert f"`{name}`" in guide, f"{name} is not in docs/deployment.md's table of variables"


def test_every_name_envs_reads_is_declared():
    """A read of an undeclared name fails at once (KeyError), and every literal name passed to
    read() in envs.py is declared."""
    with pytest.raises(KeyError):
        envs.read("NANOSERVE_NO_SUCH_VARIABLE")
    source = (PACKAGE / "envs.py").read_text()
    names = set(re.findall(r'(?:read|_flag|_one_of)\("([A-Z_0-9]+)"', source))
    assert names and names <= set(envs.ENVIRONMENT_VARIABLES)


def test_accessors_read_the_environment_each_call(monkeypatch, tmp_path):
    monkeypatch.delenv("NANOSERVE_HOME", raising=False)
    assert envs.nanoserve_home() == Path.home() / ".cache" / "nanoserve"
    monkeypatch.setenv("NANOSERVE_HOME", str(tmp_path))
    assert envs.nanoserve_home() == tmp_path
    monkeypatch.setenv("NANOSERVE_HOME", "")  # empty counts as unset
    assert envs.nanoserve_home() == Path.home() / ".cache" / "nanoserve"

    monkeypatch.delenv("NANOSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert envs.api_key() == "v"
    monkeypatch.setenv("NANOSERVE_API_KEY", "n")
    assert envs.api_key() == "n"

    for value, expected in (("2.5", 2.5), ("0", 10.0), ("-1", 10.0), ("soon", 10.0), ("", 10.0)):
        monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", value)
        assert envs.log_stats_interval() == expected

    monkeypatch.setenv("NANOSERVE_KERNELS", "Reference")
    assert envs.kernels() == "reference"
    monkeypatch.setenv("NANOSERVE_KERNELS", "cuda")
    with pytest.raises(
        ValueError, match="NANOSERVE_KERNELS must be one of auto, triton, reference, got 'cuda'"
    ):
        envs.kernels()

    monkeypatch.setenv("NANOSERVE_CPU_GEMM", "mkl")
    with pytest.raises(ValueError, match="NANOSERVE_CPU_GEMM must be one of nanoserve, onednn"):
        envs.cpu_gemm()

    monkeypatch.setenv("NANOSERVE_CPU_ISA", " AVX2 ")
    assert envs.cpu_isa() == "avx2"

    monkeypatch.setenv("NANOSERVE_PP_LAYER_PARTITION", "")
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    assert envs.pp_layer_partition() == "1,3"


def test_keep_cpu_memory_steps_aside(monkeypatch):
    for name in [name for name in os.environ if name.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("NANOSERVE_KEEP_CPU_MEMORY", raising=False)
    assert envs.keep_cpu_memory()
    monkeypatch.setenv("NANOSERVE_KEEP_CPU_MEMORY", "0")
    assert not envs.keep_cpu_memory()
    monkeypatch.setenv("NANOSERVE_KEEP_CPU_MEMORY", "1")
    monkeypatch.setenv("MALLOC_ARENA_MAX_", "2")  # a glibc tunable of the user's own
    assert not envs.keep_cpu_memory()


def _run(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
        cwd=PACKAGE.parent,
    ).stdout.strip()


def test_importing_nanoserve_leaves_the_environment_alone():
    code = (
        "import os; before = dict(os.environ); import nanoserve; from nanoserve import SamplingParams; "
        "print(dict(os.environ) == before)"
    )
    assert _run(code) == "True"
