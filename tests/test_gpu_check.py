"""scripts/gpu_check.sh and its Python stages, without a GPU: the scripts parse, the stages run
end to end on a CPU (--smoke) and the report judges the targets from what was measured."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from nanoserve.bench import gpu_e2e, gpu_quant, gpu_report

ROOT = Path(__file__).resolve().parent.parent
if (
    not torch.cuda.is_available()
):  # before any Triton kernel is made (see tests/kernels/conftest.py)
    os.environ["TRITON_INTERPRET"] = "1"


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


def test_quant_stages_run_on_a_cpu_and_the_report_reads_them(tmp_path, monkeypatch):
    """The CUDA forms of quantized weights under Triton's interpreter (as gpu_check.sh's smoke
    run sets it): every format checked against its reference, a Q4_K_M file's weights held in
    its bytes; the report's rows for them."""
    from nanoserve.kernels import reset_kernel_choice

    monkeypatch.setenv("NANOSERVE_KERNELS", "triton")
    reset_kernel_choice()
    work, out = tmp_path / "work", tmp_path / "out"
    try:
        for stage in ("quant-kernels", "quant-memory"):
            assert gpu_quant.main([stage, "--work", str(work), "--smoke"]) == 0
    finally:
        monkeypatch.delenv("NANOSERVE_KERNELS")
        reset_kernel_choice()
    kernels = json.loads((work / "quant-kernels-smoke.json").read_text())
    formats = {row["format"] for row in kernels["results"]}
    assert len(formats) == 13 and all(row["ok"] for row in kernels["results"])
    assert {row["kernel"] for row in kernels["results"]} == {"gemv", "gemm"}
    memory = json.loads((work / "quant-memory-smoke.json").read_text())
    assert memory["ok"] and abs(memory["ratio_to_file"] - 1) < 0.05
    assert gpu_report.main(["--work", str(work), "--out", str(out)]) == 0
    rows = {row["target"]: row for row in json.loads((out / "e2e.json").read_text())["targets"]}
    assert rows["quantized GEMV / GEMM of every format = torch reference"]["met"] is True
    assert rows["smoke Q4_K_M: memory for weights = file ± 5%"]["met"] is True


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
