"""`nanoserve bench serve --vllm-results`: vLLM's `bench serve --save-result` files, written here
in vLLM 0.32's exact shape with known numbers, appear beside a real run against the tiny model
in the JSON, the markdown and the PNG."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from PIL import Image

from nanoserve.bench import serve as bench_serve
from nanoserve.bench.vllm_results import VllmResultsError, load_vllm_results


def vllm_result(concurrency: int, output_tps: float, ttft: float, tpot: float, itl: float) -> dict:
    """What vllm/benchmarks/serve.py (0.32) saves with --save-result (without --save-detailed),
    key for key, for a random-dataset run of 8 prompts, 16 tokens in and 8 out each."""
    duration = 64 / output_tps
    return {
        "date": "20261130-120000",
        "endpoint_type": "openai",
        "backend": "openai",
        "label": None,
        "model_id": "tiny",
        "tokenizer_id": "tiny",
        "num_prompts": 8,
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": concurrency,
        "duration": duration,
        "completed": 8,
        "failed": 0,
        "total_input_tokens": 128,
        "total_output_tokens": 64,
        "request_throughput": 8 / duration,
        "request_goodput": None,
        "output_throughput": output_tps,
        "total_token_throughput": 192 / duration,
        "latencies": [0.5] * 8,
        "queue_times": [0.0] * 8,
        "max_output_tokens_per_s": 40.0,
        "max_concurrent_requests": concurrency,
        "rtfx": 0.0,
        "mean_ttft_ms": ttft * 1.1,
        "median_ttft_ms": ttft,
        "std_ttft_ms": 1.0,
        "p99_ttft_ms": ttft * 2,
        "mean_tpot_ms": tpot * 1.1,
        "median_tpot_ms": tpot,
        "std_tpot_ms": 0.5,
        "p99_tpot_ms": tpot * 2,
        "mean_itl_ms": itl * 1.1,
        "median_itl_ms": itl,
        "std_itl_ms": 0.5,
        "p99_itl_ms": itl * 3,
        "mean_client_queue_time_ms": 0.0,
        "median_client_queue_time_ms": 0.0,
        "std_client_queue_time_ms": 0.0,
        "p99_client_queue_time_ms": 0.0,
    }


def test_run_with_vllm_results(tiny_server, tiny_llama_dir, tmp_path, capsys):
    one = tmp_path / "openai-concurrency1-tiny-20261130-120000.json"
    one.write_text(json.dumps(vllm_result(1, 18.29, 212.53, 52.94, 51.25)))
    # --append-result writes one object a line
    appended = tmp_path / "appended.json"
    appended.write_text(
        json.dumps(vllm_result(2, 33.71, 301.17, 61.38, 60.02))
        + "\n"
        + json.dumps(vllm_result(4, 47.05, 455.55, 80.16, 79.99))
    )
    out = tmp_path / "out"
    code = bench_serve.main(
        [
            "--base-url",
            tiny_server.url,
            "--model",
            str(tiny_llama_dir),
            "--concurrency",
            "1",
            "2",
            "--prompts-per-level",
            "2",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--no-offline",
            "--result-dir",
            str(out),
            "--label",
            "cmp",
            "--vllm-results",
            str(one),
            str(appended),
        ]
    )
    assert code == 0
    result = json.loads((out / "cmp.json").read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    assert all(lv["completed"] == lv["num_prompts"] for lv in result["levels"])
    vllm = result["vllm"]
    assert vllm["files"] == [str(one), str(appended)]
    assert [
        (
            lv["concurrency"],
            lv["output_throughput"],
            lv["ttft_ms"]["median"],
            lv["tpot_ms"]["median"],
            lv["itl_ms"]["p99"],
        )
        for lv in vllm["levels"]
    ] == [
        (1, 18.29, 212.53, 52.94, 51.25 * 3),
        (2, 33.71, 301.17, 61.38, 60.02 * 3),
        (4, 47.05, 455.55, 80.16, 79.99 * 3),
    ]
    assert vllm["levels"][0]["mean_input_len"] == 16 and vllm["levels"][0]["mean_output_len"] == 8

    markdown = (out / "cmp.md").read_text()
    assert markdown in capsys.readouterr().out  # printed as well
    rows = {
        line.split(" | ")[0].lstrip("| "): line.split(" | ")
        for line in markdown.splitlines()
        if line.startswith("| ") and line[2].isdigit()
    }
    assert sorted(rows, key=int) == ["1", "2", "4"]
    ours = {lv["concurrency"]: lv for lv in result["levels"]}
    for c, vllm_tps, ttft, tpot in ((1, 18.29, 212.53, 52.94), (2, 33.71, 301.17, 61.38)):
        row, mine = rows[str(c)], ours[c]["output_throughput"]
        assert row[1:4] == [f"{mine:.1f}", f"{vllm_tps:.1f}", f"{mine / vllm_tps:.2f}x"]
        assert row[4].endswith(f", {ttft:.1f} / {ttft * 2:.1f}")
        assert row[5].endswith(f", {tpot:.1f} / {tpot * 2:.1f}")
    assert rows["4"][1:4] == ["–", "47.0", "–"]  # a level only vLLM ran
    assert "mean tokens in / out per request: 16 / 8 (nanoserve: 16 / 8)" in markdown

    png = out / "cmp.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as image:
        image.verify()
    with Image.open(png) as image:
        assert image.size == (1320, 504)  # 11 x 4.2 inches at 120 dpi


def write(tmp_path, name: str, content) -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json", "not JSON (Expecting value: line 1 column 1 (char 0))"),
        (
            [{"benchmark": {}}],
            "a JSON list (a .pytorch.json?); pass the file that "
            "`vllm bench serve --save-result` wrote",
        ),
        (
            {**vllm_result(1, 1, 1, 1, 1), "max_concurrency": None},
            "max_concurrency is null; run vllm bench serve with --max-concurrency",
        ),
        (
            {"completed": 3},
            "not a vllm bench serve result (no max_concurrency, duration, "
            "request_throughput, output_throughput, median_ttft_ms, median_tpot_ms)",
        ),
    ],
)
def test_bad_vllm_files(tmp_path, content, message):
    path = write(tmp_path, "bad.json", content)
    with pytest.raises(VllmResultsError) as error:
        load_vllm_results([path])
    assert str(error.value) == f"{path}: {message}"


def test_two_runs_at_one_level_and_a_missing_file(tmp_path):
    first = write(tmp_path, "a.json", vllm_result(4, 1, 1, 1, 1))
    second = write(tmp_path, "b.json", vllm_result(4, 2, 1, 1, 1))
    with pytest.raises(
        VllmResultsError,
        match=r"b\.json: a second run at concurrency 4 \(the "
        r"first is in a\.json\)",
    ):
        load_vllm_results([first, second])
    with pytest.raises(VllmResultsError, match="nope.json: No such file or directory"):
        load_vllm_results([str(tmp_path / "nope.json")])


def test_cli_mistake_is_one_line(tmp_path):
    path = write(tmp_path, "bad.json", {"completed": 3})
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanoserve",
            "bench",
            "serve",
            "--base-url",
            "http://127.0.0.1:9",
            "--vllm-results",
            path,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"nanoserve: error: --vllm-results: {path}: not a vllm bench serve result (no "
        "max_concurrency, duration, request_throughput, output_throughput, median_ttft_ms, "
        "median_tpot_ms)"
    ]
