"""The kernel benchmark script runs end to end (tiny shapes; on a CPU under the interpreter),
so the one GPU run it gets does not die on a Python error."""

from __future__ import annotations

import json

from nanoserve.bench import kernels as bench


def test_bench_kernels_smoke(tmp_path):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "kernels.json").read_text())
    names = [r["name"] for r in report["results"]]
    assert len(names) == 6 and not any("error" in r for r in report["results"])
    assert all(all(c["ok"] for c in r["checks"].values()) for r in report["results"])
    decode = report["results"][0]
    assert set(decode["sweep_us"]) >= {"splits=1", "splits=16", "block_n=128"}
    assert all(isinstance(v, float) for v in decode["sweep_us"].values()), decode["sweep_us"]
    assert "| decode attention" in (tmp_path / "kernels.md").read_text()
