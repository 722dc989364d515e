"""The style the project keeps: ruff's lint rules and its formatter (settings in pyproject.toml,
ruff pinned in the test extra). Each test fails naming the files and lines that do not follow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_ruff_check_passes():
    done = ruff("check", "--output-format", "concise", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_has_nothing_to_change():
    done = ruff("format", "--check", ".")
    assert done.returncode == 0, done.stdout + done.stderr
