"""vLLM's side of `nanoserve bench serve`: read the JSON files that `vllm bench serve
--save-result` (or `--append-result`, one object a line) writes, one run per concurrency level,
into levels shaped like ours; and the markdown summary of both servers.

Field names are vLLM 0.32's (vllm/benchmarks/serve.py): `max_concurrency`, `num_prompts`,
`completed`, `failed`, `duration`, `request_throughput`, `output_throughput`,
`total_token_throughput`, `total_input_tokens`, `total_output_tokens`, and per metric
`mean_/median_/p99_{ttft,tpot,itl,e2el}_ms` (only those of its `--percentile-metrics`)."""

from __future__ import annotations

import json
from pathlib import Path

REQUIRED = (
    "max_concurrency",
    "completed",
    "duration",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "median_tpot_ms",
)
METRICS = ("ttft", "tpot", "itl", "e2el")


class VllmResultsError(ValueError):
    """A file that is not a `vllm bench serve` result; the message names the file."""


def _records(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError as error:
        raise VllmResultsError(f"{path}: {error.strerror or error}") from None
    try:
        records = [json.loads(text)]
    except json.JSONDecodeError:  # --append-result: one JSON object a line
        try:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise VllmResultsError(f"{path}: not JSON ({error})") from None
    if not records:
        raise VllmResultsError(f"{path}: empty")
    if isinstance(records[0], list):
        raise VllmResultsError(
            f"{path}: a JSON list (a .pytorch.json?); pass the file that "
            "`vllm bench serve --save-result` wrote"
        )
    for record in records:
        if not isinstance(record, dict):
            raise VllmResultsError(f"{path}: not a JSON object")
        missing = [name for name in REQUIRED if record.get(name) is None]
        if "max_concurrency" in missing and "max_concurrency" in record:
            raise VllmResultsError(
                f"{path}: max_concurrency is null; run vllm bench serve with --max-concurrency"
            )
        if missing:
            raise VllmResultsError(
                f"{path}: not a vllm bench serve result (no {', '.join(missing)})"
            )
    return records


def _level(record: dict, source: str) -> dict:
    completed = record["completed"]
    level = {
        "concurrency": int(record["max_concurrency"]),
        "num_prompts": record.get("num_prompts"),
        "completed": completed,
        "failed": record.get("failed", 0),
        "duration_s": record["duration"],
        "request_throughput": record["request_throughput"],
        "output_throughput": record["output_throughput"],
        "total_token_throughput": record.get("total_token_throughput"),
        "mean_input_len": (
            record["total_input_tokens"] / completed
            if completed and record.get("total_input_tokens") is not None
            else None
        ),
        "mean_output_len": (
            record["total_output_tokens"] / completed
            if completed and record.get("total_output_tokens") is not None
            else None
        ),
        "source": source,
        "date": record.get("date"),
        "model_id": record.get("model_id"),
    }
    for metric in METRICS:
        if record.get(f"median_{metric}_ms") is not None:
            level[f"{metric}_ms"] = {
                stat: record.get(f"{stat}_{metric}_ms") for stat in ("mean", "median", "p99")
            }
    return level


def load_vllm_results(paths: list[str]) -> list[dict]:
    """The levels of all files, by concurrency; one run per concurrency level."""
    levels: dict[int, dict] = {}
    for name in paths:
        for record in _records(Path(name)):
            level = _level(record, Path(name).name)
            earlier = levels.get(level["concurrency"])
            if earlier is not None:
                raise VllmResultsError(
                    f"{name}: a second run at concurrency {level['concurrency']}"
                    f" (the first is in {earlier['source']})"
                )
            levels[level["concurrency"]] = level
    return [levels[c] for c in sorted(levels)]


def _cell(level: dict | None, key: str, stat: str | None = None, digits: int = 1) -> str:
    if level is None:
        return "–"
    value = level.get(key)
    if stat is not None and value is not None:
        value = value.get(stat)
    return "–" if value is None else f"{value:.{digits}f}"


def to_markdown(result: dict) -> str:
    """Per concurrency level: output tok/s, TTFT / TPOT / ITL medians and P99s; with vLLM's
    results, both servers side by side and the ratio of output tok/s."""
    ours = {level["concurrency"]: level for level in result["levels"]}
    vllm = {level["concurrency"]: level for level in (result.get("vllm") or {}).get("levels", [])}
    lines = [f"# {result['title']}", "", f"`{result['command']}`", ""]
    latency = [
        (f"{name.upper()} median / P99 (ms)", f"{name}_ms") for name in ("ttft", "tpot", "itl")
    ]
    if not vllm:
        lines += [
            "| concurrency | requests | req/s | output tok/s | "
            + " | ".join(label for label, _ in latency)
            + " |",
            "| --- " * (4 + len(latency)) + "|",
        ]
        for c, level in sorted(ours.items()):
            cells = [
                str(c),
                str(level["completed"]),
                _cell(level, "request_throughput", None, 2),
                _cell(level, "output_throughput"),
            ]
            cells += [
                f"{_cell(level, key, 'median')} / {_cell(level, key, 'p99')}" for _, key in latency
            ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"
    lines += [
        "| concurrency | nanoserve output tok/s | vLLM output tok/s | nanoserve / vLLM | "
        + " | ".join(f"{label}: nanoserve, vLLM" for label, _ in latency)
        + " |",
        "| --- " * (4 + len(latency)) + "|",
    ]
    for c in sorted(ours.keys() | vllm.keys()):
        mine, theirs = ours.get(c), vllm.get(c)
        ratio = "–"
        if mine and theirs and theirs["output_throughput"]:
            ratio = f"{mine['output_throughput'] / theirs['output_throughput']:.2f}x"
        cells = [
            str(c),
            _cell(mine, "output_throughput"),
            _cell(theirs, "output_throughput"),
            ratio,
        ]
        for _, key in latency:
            cells.append(
                f"{_cell(mine, key, 'median')} / {_cell(mine, key, 'p99')}, "
                f"{_cell(theirs, key, 'median')} / {_cell(theirs, key, 'p99')}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    sources = ", ".join(
        f"`{source}`" for source in dict.fromkeys(lv["source"] for lv in vllm.values())
    )
    shapes = sorted(
        {
            (round(level["mean_input_len"] or 0), round(level["mean_output_len"] or 0))
            for level in vllm.values()
        }
    )
    lines += [
        "",
        f"vLLM: `vllm bench serve` results from {sources}; mean tokens in / out per "
        f"request: {', '.join(f'{i} / {o}' for i, o in shapes)} (nanoserve: "
        f"{result['input_len']} / {result['output_len']}).",
    ]
    return "\n".join(lines) + "\n"
