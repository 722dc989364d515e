"""The serving benchmark's load generator against a real server."""

from __future__ import annotations

import asyncio

from nanoserve.bench.serve import random_prompts
from nanoserve.bench.serve_client import _percentiles, run_load, summarize


def test_run_load_counts_tokens(tiny_server):
    prompts = random_prompts(6, 16, 300, seed=0)
    results, duration = asyncio.run(
        run_load(tiny_server.url, tiny_server.engine.served_model_name, prompts, 9, concurrency=3)
    )
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_tokens for r in results] == [9] * 6
    assert all(r.ttft > 0 and r.latency >= r.ttft for r in results)
    summary = summarize(results, duration)
    assert summary["completed"] == 6 and summary["total_output_tokens"] == 54
    assert summary["output_throughput"] > 0 and summary["tpot_ms"]["median"] > 0


def test_percentiles_interpolate_like_numpy():
    stats = _percentiles([1.0, 2.0, 3.0, 4.0], scale=1.0)
    assert stats["mean"] == 2.5 and stats["median"] == 2.5
    assert abs(stats["p99"] - 3.97) < 1e-9
