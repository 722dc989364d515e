"""`nanoserve bench preemption` on the tiny model: both modes run, swap mode really swaps, the
tokens agree, and the JSON says so."""

from __future__ import annotations

import json

from nanoserve.cli import main


def test_preemption_benchmark_runs_both_modes(tiny_llama_dir, tmp_path):
    out = tmp_path / "storm.json"
    assert (
        main(
            [
                "bench",
                "preemption",
                "--model",
                str(tiny_llama_dir),
                "--dtype",
                "float32",
                "--num-prompts",
                "12",
                "--input-len",
                "48",
                "--output-len",
                "24",
                "--num-kv-blocks",
                "16",
                "--swap-space",
                "0.01",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    summary = json.loads(out.read_text())
    recompute, swap = summary["results"]
    assert summary["same_tokens"] is True
    assert recompute["preemption_mode"] == "recompute" and recompute["preemptions"] > 0
    assert swap["swap_outs"] > 0 and swap["blocks_swapped_out"] >= swap["swap_outs"]
    assert (
        swap["blocks_swapped_in"] == swap["blocks_swapped_out"]
    )  # every swapped request came back
    assert recompute["output_tokens"] == swap["output_tokens"] == 12 * 24
