"""`nanoserve bench structured-outputs` on the tiny model: both runs decode the same number of
tokens (the grammar never completes), the constrained text follows the grammar, and the JSON
says so."""

from __future__ import annotations

import json
import re

from nanoserve.cli import main


def test_structured_outputs_benchmark_runs_both(tiny_llama_dir, tmp_path):
    out = tmp_path / "structured.json"
    assert (
        main(
            [
                "bench",
                "structured-outputs",
                "--model",
                str(tiny_llama_dir),
                "--dtype",
                "float32",
                "--batch-size",
                "4",
                "--input-len",
                "16",
                "--output-len",
                "24",
                "--num-kv-blocks",
                "64",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    summary = json.loads(out.read_text())
    free, constrained = summary["results"]
    assert not free["constrained"] and constrained["constrained"]
    assert free["output_tokens"] == constrained["output_tokens"] == 4 * 24
    assert constrained["finish_reasons"] == ["length"]
    assert re.match(r'\{"name": "[a-z]+', constrained["sample_text"]), constrained["sample_text"]
    assert isinstance(summary["overhead_percent"], float)
