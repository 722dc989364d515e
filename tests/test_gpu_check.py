"""scripts/gpu_check.sh and its Python stages, without a GPU: the scripts parse, the stages run
end to end on a CPU (--smoke) and the report judges the targets from what was measured."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from nanoserve.bench import gpu_e2e, gpu_report

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script", ["gpu_check.sh", "fetch_device_wheels.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)


def test_stages_run_on_a_cpu_and_the_report_reads_them(tiny_llama_dir, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    for stage in ("tokens", "throughput", "memory"):
        assert (
            gpu_e2e.main(
                [
                    stage,
                    "--model",
                    str(tiny_llama_dir),
                    "--name",
                    "tiny",
                    "--work",
                    str(work),
                    "--smoke",
                ]
            )
            == 0
        )
    tokens = json.loads((work / "tokens-tiny.json").read_text())
    assert tokens["ok"] and set(tokens["runs"]) >= {
        "cpu_reference_fp32",
        "cuda_graphs_fp32",
        "transformers_fp32",
    }
    assert tokens["max_tokens"] == sorted(tokens["max_tokens"], reverse=True)
    assert all(len(run) == len(tokens["max_tokens"]) for run in tokens["runs"].values())
    (tmp_path / "status").write_text("tokens passed 3\nserve skipped-no-msgspec-httptools 0\n")
    assert (
        gpu_report.main(
            ["--work", str(work), "--out", str(out), "--stage-status", str(tmp_path / "status")]
        )
        == 1
    )
    report = json.loads((out / "e2e.json").read_text())
    rows = {row["target"]: row for row in report["targets"]}
    assert rows["tiny: greedy tokens of cuda_graphs_fp32 = CPU reference (fp32)"]["met"] is True
    assert any("graphs ≥ 2x eager" in target for target in rows)
    assert "| tokens | passed | 3 |" in (out / "e2e.md").read_text()


def test_report_judges_targets(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()

    def mode(tpot_ms):
        return {
            "startup_s": 1.0,
            "graph_capture_s": None,
            "graph_bytes": None,
            "batch1_tpot_ms": tpot_ms,
            "batch1_decode_tokens_per_s": 1e3 / tpot_ms,
            "batch64": {"output_tokens_per_s": 1000.0},
        }

    stages = [
        {
            "stage": "throughput",
            "name": "llama-3.2-1b",
            "ok": True,
            "batch": 64,
            "batch1_speedup": 2.5,
            "modes": {"eager": mode(6.25), "graphs": mode(2.5)},
        },
        {
            "stage": "throughput",
            "name": "smollm2",
            "ok": True,
            "batch": 64,
            "batch1_speedup": 1.5,
            "modes": {"eager": mode(3.0), "graphs": mode(2.0)},
        },
        {
            "stage": "tokens",
            "name": "smollm2",
            "ok": False,
            "mismatches": {
                "cuda_eager_fp32": [],
                "cuda_graphs_fp32": [{"prompt": 3, "position": 17}],
            },
        },
    ]
    for stage in stages:
        (work / f"{stage['stage']}-{stage['name']}.json").write_text(json.dumps(stage))
    (out / "kernels.json").write_text(
        json.dumps(
            {
                "copy_bandwidth_gbps": 4000.0,
                "results": [
                    {
                        "name": "decode attention",
                        "target_fraction": 0.6,
                        "fraction_of_copy_bandwidth": 0.55,
                        "gbps": 2200.0,
                        "meets_target": False,
                    }
                ],
            }
        )
    )
    assert gpu_report.main(["--work", str(work), "--out", str(out)]) == 1
    met = {
        row["target"]: row["met"] for row in json.loads((out / "e2e.json").read_text())["targets"]
    }
    assert met == {
        "llama-3.2-1b: decode tok/s at batch 1, graphs ≥ 2x eager": True,
        "llama-3.2-1b: TPOT at batch 1 ≤ 3 ms": True,
        "smollm2: decode tok/s at batch 1, graphs ≥ 2x eager": False,
        "smollm2: greedy tokens of cuda_eager_fp32 = CPU reference (fp32)": True,
        "smollm2: greedy tokens of cuda_graphs_fp32 = CPU reference (fp32)": False,
        "kernel decode attention: ≥ 60% of copy bandwidth": False,
    }
