"""Merges what scripts/gpu_check.sh measured into e2e.json and e2e.md, with issue 10's and issue
29's targets:

    python3 -m nanoserve.bench.gpu_report --work WORK --out OUT [--stage-status FILE]

Reads WORK/<stage>-<name>.json (nanoserve.bench.gpu_e2e, nanoserve.bench.gpu_big: big-*,
tests/gpu_features.py: feature-*), OUT/kernels.json
(nanoserve.bench.kernels) and WORK/serve/*.json (nanoserve bench serve); --stage-status is the
script's "name status seconds" lines. Exit status 0 when every stage and check passed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nanoserve.bench import gpu_quant

BATCH1_SPEEDUP_TARGET = 2.0
TPOT_TARGET_MS = {"llama-3.2-1b": 3.0}
# Issue 29: batch-1 TPOT with CUDA graphs (ms) per (stage, name); the 8B Q4_K_M's weights on the
# GPU; offline 64 x (128 in, 128 out) on the 1B shape; served SmolLM2 at concurrency 64.
ISSUE29_TPOT_MS = {
    ("throughput", "llama-3.2-1b"): ("Llama-3.2-1B shape, bf16", 0.9),
    ("big", "llama-3.1-8b-bf16"): ("Llama-3.1-8B shape, bf16", 4.5),
    ("big", "llama-3.1-8b-fp8"): ("Llama-3.1-8B shape, FP8", 3.0),
    ("big", "llama-3.1-8b-q4_k_m"): ("Llama-3.1-8B shape, Q4_K_M", 3.0),
}
ISSUE29_Q4_K_M_WEIGHTS_GB = 5.2
ISSUE29_OFFLINE_TOKENS_PER_S = 40_000
ISSUE29_SERVED = {"concurrency": 64, "tokens_per_s": 20_000, "tpot_p50_ms": 2.5}


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def targets(stages: list[dict], kernels: dict | None) -> list[dict]:
    """One row per target: what, the measured value, met (True / False / None: not measured)."""
    rows = []
    for stage in stages:
        name = stage["name"]
        if stage["stage"] == "tokens" and "mismatches" in stage:
            for label, found in stage["mismatches"].items():
                rows.append(
                    {
                        "target": f"{name}: greedy tokens of {label} = CPU reference (fp32)",
                        "value": "identical"
                        if not found
                        else f"{len(found)} prompts differ: {found[:3]}",
                        "met": not found,
                    }
                )
        if stage["stage"] == "memory" and "checks" in stage:
            for check, met in stage["checks"].items():
                rows.append(
                    {
                        "target": f"{name}: KV pool, {check.replace('_', ' ')}",
                        "value": f"pool difference 0.6 - 0.3: {stage['kv_difference_fraction']:.3f} of memory"
                        if check == "kv_pool_tracks_utilization"
                        else "",
                        "met": met,
                    }
                )
        if stage["stage"] == "throughput" and "modes" in stage:
            rows.append(
                {
                    "target": f"{name}: decode tok/s at batch 1, graphs ≥ {BATCH1_SPEEDUP_TARGET:g}x eager",
                    "value": f"{stage['batch1_speedup']:.2f}x "
                    f"({stage['modes']['eager']['batch1_decode_tokens_per_s']:.0f} → "
                    f"{stage['modes']['graphs']['batch1_decode_tokens_per_s']:.0f} tok/s)",
                    "met": stage["batch1_speedup"] >= BATCH1_SPEEDUP_TARGET,
                }
            )
            if name in TPOT_TARGET_MS:
                tpot = stage["modes"]["graphs"]["batch1_tpot_ms"]
                rows.append(
                    {
                        "target": f"{name}: TPOT at batch 1 ≤ {TPOT_TARGET_MS[name]:g} ms",
                        "value": f"{tpot:.2f} ms",
                        "met": tpot <= TPOT_TARGET_MS[name],
                    }
                )
        if stage["stage"] == "feature":
            rows += feature_rows(stage)
    rows += gpu_quant.report_targets(stages)  # issue 57's quantized weights on CUDA
    for result in (kernels or {}).get("results", []):
        if "target_fraction" in result:
            rows.append(
                {
                    "target": f"kernel {result['name']}: ≥ {result['target_fraction']:.0%} of copy bandwidth",
                    "value": f"{result['fraction_of_copy_bandwidth']:.0%} "
                    f"({result['gbps']:.0f} of {kernels['copy_bandwidth_gbps']:.0f} GB/s)",
                    "met": result["meets_target"],
                }
            )
    return rows


def feature_rows(stage: dict) -> list[dict]:
    """tests/gpu_features.py's checks, one row each (and one for a check that did not finish)."""
    rows = [
        {
            "target": f"feature {stage['name']}: {check}",
            "value": "" if passed else str(stage.get("details", {}).get(check, ""))[:300],
            "met": passed,
        }
        for check, passed in stage.get("checks", {}).items()
    ]
    if stage.get("error") or not rows:
        last = (stage.get("error") or "no check ran").strip().splitlines()[-1]
        rows.append({"target": f"feature {stage['name']}: runs", "value": last, "met": False})
    return rows


def issue29_targets(stages: list[dict], serve: list[dict]) -> list[dict]:
    """Issue 29's targets, every one (met None where its stage did not run or measure it)."""
    by_key = {(s["stage"], s["name"]): s for s in stages}
    rows = []
    for key, (what, limit) in ISSUE29_TPOT_MS.items():
        stage = by_key.get(key, {})
        tpot = (
            stage.get("modes", {}).get("graphs", {}).get("batch1_tpot_ms")
            if key[0] == "throughput"
            else stage.get("tpot_ms")
        )
        rows.append(
            {
                "target": f"issue 29: {what}: batch-1 TPOT ≤ {limit:g} ms",
                "value": f"{tpot:.2f} ms" if tpot is not None else "",
                "met": None if tpot is None else tpot <= limit,
            }
        )
    held = by_key.get(("big", "llama-3.1-8b-q4_k_m"), {}).get("weights_gpu_bytes")
    rows.append(
        {
            "target": f"issue 29: Llama-3.1-8B Q4_K_M: GPU memory for weights < "
            f"{ISSUE29_Q4_K_M_WEIGHTS_GB:g} GB",
            "value": f"{held / 1e9:.2f} GB" if held is not None else "",
            "met": None if held is None else held < ISSUE29_Q4_K_M_WEIGHTS_GB * 1e9,
        }
    )
    offline = by_key.get(("throughput", "llama-3.2-1b"), {}).get("modes", {}).get("graphs", {})
    tokens = offline.get("batch64", {}).get("output_tokens_per_s")
    rows.append(
        {
            "target": f"issue 29: Llama-3.2-1B shape offline 64 x (128 in, 128 out): "
            f"≥ {ISSUE29_OFFLINE_TOKENS_PER_S:,} output tok/s",
            "value": f"{tokens:,.0f} tok/s" if tokens is not None else "",
            "met": None if tokens is None else tokens >= ISSUE29_OFFLINE_TOKENS_PER_S,
        }
    )
    level = next(
        (
            lv
            for result in serve
            for lv in result["levels"]
            if lv["concurrency"] == ISSUE29_SERVED["concurrency"]
        ),
        None,
    )
    served = f"served SmolLM2 at concurrency {ISSUE29_SERVED['concurrency']}"
    for what, value, limit, unit, at_least in (
        (
            "output tok/s",
            level and level["output_throughput"],
            ISSUE29_SERVED["tokens_per_s"],
            "tok/s",
            True,
        ),
        (
            "TPOT p50",
            level and level["tpot_ms"]["median"],
            ISSUE29_SERVED["tpot_p50_ms"],
            "ms",
            False,
        ),
    ):
        rows.append(
            {
                "target": f"issue 29: {served}: {what} {'≥' if at_least else '≤'} {limit:,g} {unit}",
                "value": f"{value:,.2f} {unit}" if value is not None else "",
                "met": None if value is None else (value >= limit if at_least else value <= limit),
            }
        )
    return rows


def to_markdown(report: dict) -> str:
    lines = [
        "# GPU end-to-end check",
        "",
        f"Device: {report.get('device') or 'unknown'}.",
        "",
        "| stage | status | seconds |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']} |" for s in report["stage_status"]]
    lines += ["", "## Targets", "", "| target | measured | met |", "| --- | --- | --- |"]
    for row in report["targets"]:
        met = {True: "yes", False: "**NO**", None: "not measured"}[row["met"]]
        lines.append(f"| {row['target']} | {row['value']} | {met} |")
    for stage in report["stages"]:
        if stage["stage"] == "throughput" and "modes" in stage:
            lines += [
                "",
                f"## Offline throughput: {stage['name']}",
                "",
                f"| mode | startup s | graph capture s / GiB | TPOT batch 1 ms | "
                f"batch {stage['batch']} output tok/s |",
                "| --- | --- | --- | --- | --- |",
            ]
            for mode, m in stage["modes"].items():
                capture = (
                    f"{m['graph_capture_s']:.1f} / {m['graph_bytes'] / (1 << 30):.2f}"
                    if m["graph_capture_s"] is not None
                    else ""
                )
                batch = m[f"batch{stage['batch']}"]
                lines.append(
                    f"| {mode} | {m['startup_s']:.1f} | {capture} | {m['batch1_tpot_ms']:.2f} | "
                    f"{batch['output_tokens_per_s']:.0f} |"
                )
        if stage.get("error"):
            lines += [
                "",
                f"## Error in {stage['stage']} {stage['name']}",
                "",
                "```",
                stage["error"][-3000:],
                "```",
            ]
    features = [s for s in report["stages"] if s["stage"] == "feature"]
    if features:
        lines += [
            "",
            "## Features since run3",
            "",
            "| feature | checks passed | seconds | figure |",
        ]
        lines.append("| --- | --- | --- | --- |")
        for stage in features:
            checks = stage.get("checks", {})
            figure = json.dumps(stage.get("figure", {}), default=str).replace("|", "/")
            lines.append(
                f"| {stage['name']} | {sum(checks.values())} of {len(checks)} | "
                f"{stage.get('seconds', '')} | {figure} |"
            )
    big = [s for s in report["stages"] if s["stage"] == "big" and "tpot_ms" in s]
    if big:
        lines += [
            "",
            "## 8B stages: Llama-3.1-8B's shape, random weights (batch 1, CUDA graphs)",
            "",
            "| stage | file GB | weights on the GPU GB | engine's count GB | write s | load s "
            "| TPOT ms |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for stage in big:
            held = stage.get("weights_gpu_bytes")
            lines.append(
                f"| {stage['name']} | {stage['file_bytes'] / 1e9:.2f} | "
                f"{'' if held is None else f'{held / 1e9:.2f}'} | "
                f"{stage['weight_bytes'] / 1e9:.2f} | {stage['write_s']:.1f} | "
                f"{stage['load_s']:.1f} | {stage['tpot_ms']:.2f} |"
            )
    for serve in report["serve"]:
        lines += [
            "",
            f"## Served: {serve.get('title', '')}",
            "",
            "| concurrency | output tok/s | TTFT median ms | TPOT median ms | failed |",
            "| --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {lv['concurrency']} | {lv['output_throughput']:.0f} | {lv['ttft_ms']['median']:.1f} | "
            f"{lv['tpot_ms']['median']:.2f} | {lv['failed']} |"
            for lv in serve["levels"]
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage-status", default=None)
    args = parser.parse_args(argv)
    work, out = Path(args.work), Path(args.out)
    stages = [s for s in (load(p) for p in sorted(work.glob("*-*.json"))) if s and "stage" in s]
    kernels = load(out / "kernels.json")
    serve = [
        s for s in (load(p) for p in sorted((work / "serve").glob("*.json"))) if s and "levels" in s
    ]
    status = []
    if args.stage_status and Path(args.stage_status).exists():
        for line in Path(args.stage_status).read_text().splitlines():
            name, result, seconds = line.split()
            status.append({"name": name, "status": result, "seconds": int(seconds)})
    report = {
        "device": next((s["device"] for s in stages if "device" in s), None),
        "stage_status": status,
        "targets": targets(stages, kernels) + issue29_targets(stages, serve),
        "stages": stages,
        "serve": serve,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "e2e.md").write_text(to_markdown(report))
    print(to_markdown(report))
    ok = all(s["ok"] for s in stages) and all(s["status"] in ("passed", "skipped") for s in status)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
