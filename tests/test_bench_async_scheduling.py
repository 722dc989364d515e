"""nanoserve.bench.async_scheduling (scripts/gpu_check.sh's async-scheduling stage) runs on a CPU
with --smoke, finds the tokens equal, and its JSON is one gpu_report reads as a stage."""

from __future__ import annotations

import json

from nanoserve.bench import async_scheduling, gpu_report


def test_smoke_run_and_report(tiny_llama_dir, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    args = ["--model", str(tiny_llama_dir), "--name", "tiny", "--work", str(work), "--smoke"]
    assert async_scheduling.main(args) == 0
    result = json.loads((work / "async_scheduling-tiny.json").read_text())
    assert result["ok"] and result["token_mismatches"] == 0 and result["requests"] == 8
    assert 0 < result["overlapped_steps"] < result["steps"]
    assert set(result["output_tokens_per_s"]) == {"sync", "async_scheduling"}
    (tmp_path / "status").write_text("async-scheduling passed 20\n")
    status = ["--work", str(work), "--out", str(out), "--stage-status", str(tmp_path / "status")]
    assert gpu_report.main(status) == 0
    assert "| async-scheduling | passed | 20 |" in (out / "e2e.md").read_text()
