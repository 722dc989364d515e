"""Thread sizing from the affinity mask and the cgroup CPU quota, on cgroup trees written here."""

from __future__ import annotations

import os

import pytest

from nanoserve.kernels.cpu.threads import _cgroup_quota, available_cpus, threads_per_rank


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota(tmp_path):
    _write(tmp_path / "proc", "0::/box\n")
    _write(tmp_path / "fs" / "box" / "cpu.max", "150000 100000\n")
    assert _cgroup_quota(tmp_path / "fs", tmp_path / "proc") == 1.5


def test_cgroup_v2_unlimited(tmp_path):
    _write(tmp_path / "proc", "0::/box\n")
    _write(tmp_path / "fs" / "box" / "cpu.max", "max 100000\n")
    assert _cgroup_quota(tmp_path / "fs", tmp_path / "proc") is None


def test_cgroup_v1_quota(tmp_path):
    _write(tmp_path / "proc", "4:memory:/m\n1:cpu,cpuacct:/box\n")
    _write(tmp_path / "fs" / "cpu,cpuacct" / "box" / "cpu.cfs_quota_us", "300000\n")
    _write(tmp_path / "fs" / "cpu,cpuacct" / "box" / "cpu.cfs_period_us", "100000\n")
    assert _cgroup_quota(tmp_path / "fs", tmp_path / "proc") == 3.0


def test_cgroup_v1_no_quota(tmp_path):
    _write(tmp_path / "proc", "1:cpu,cpuacct:/\n")
    _write(tmp_path / "fs" / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "fs" / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert _cgroup_quota(tmp_path / "fs", tmp_path / "proc") is None


def test_available_cpus_follows_affinity():
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity here")
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two CPUs")
    try:
        os.sched_setaffinity(0, {min(before)})
        assert available_cpus() == 1
    finally:
        os.sched_setaffinity(0, before)
    assert available_cpus() == len(before) or _cgroup_quota() is not None


def test_threads_per_rank():
    assert threads_per_rank(3) == 3
    assert threads_per_rank(None, 1) == available_cpus()
    assert threads_per_rank(None, 64) == 1


def _spincount_after(code: str, env: dict) -> str:
    """What `code` prints, then GOMP_SPINCOUNT after it, in a fresh interpreter."""
    import subprocess
    import sys

    code += "\nimport os\nprint(os.environ.get('GOMP_SPINCOUNT', '-'))"
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


# The CLI's entry (`nanoserve --help` parses nothing else) and the library's (`from nanoserve
# import LLM`): each sets the spin before torch loads; a bare `import nanoserve` does not.
CLI_ENTRY = """
import contextlib, io
from nanoserve.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(["--help"])
    except SystemExit:
        pass"""
LIBRARY_ENTRY = "from nanoserve import LLM"


@pytest.mark.parametrize("entry", [CLI_ENTRY, LIBRARY_ENTRY], ids=["cli", "LLM"])
def test_openmp_spin_is_short_unless_the_user_chose(entry):
    assert _spincount_after(entry, {}) == "10000"
    assert _spincount_after(entry, {"GOMP_SPINCOUNT": "300000"}) == "300000"
    assert _spincount_after(entry, {"OMP_WAIT_POLICY": "ACTIVE"}) == "-"
    assert _spincount_after("import nanoserve", {}) == "-"


def test_openmp_spin_is_set_before_torch_loads():
    import torch  # noqa: F401 (loads libgomp in this process)

    from nanoserve import envs

    code = "from nanoserve import envs\nimport nanoserve.cli\nprint(envs.set_openmp_spin_default())"
    assert _spincount_after(code, {}).splitlines() == ["True", "10000"]
    assert envs.set_openmp_spin_default() is False  # this process has torch: too late here
