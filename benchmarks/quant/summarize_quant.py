"""The table of benchmarks/quant/bench_quant.sh's run.txt, with issue 28's targets checked.

.venv/bin/python benchmarks/quant/summarize_quant.py benchmarks/quant/<cpu>/run.txt
"""

from __future__ import annotations

import json
import re
import sys

PREFILL_INPUT_LEN = 128  # bench_quant.sh's prompt-only run: 64 prompts of 128 ids, one output each


def parse(lines: list[str]) -> tuple[dict, dict, dict, list[dict], dict]:
    batch1, offline, ppl, paired, prefill = {}, {}, {}, [], {}
    for line in lines:
        if match := re.match(r"^nanoserve prefill (\S+) \(tp=1\): ([\d.]+) output tokens/s", line):
            prefill[("nanoserve", match[1].lower())] = float(match[2]) * PREFILL_INPUT_LEN
        elif match := re.match(r"^llama\.cpp prefill (\S+): ([\d.]+) tokens/s", line):
            prefill[("llama.cpp", match[1].lower())] = float(match[2])
        elif match := re.match(r"^(nanoserve|llama\.cpp) (\S+): ([\d.]+) ms/token", line):
            batch1[(match[1], match[2].lower())] = float(match[3])
        elif match := re.match(r"^nanoserve (\w+) \(tp=1\): ([\d.]+) output tokens/s", line):
            offline[match[1]] = float(match[2])
        elif line.startswith("{") and "compare" in line:
            paired.append(json.loads(line))
        elif line.startswith("{"):
            row = json.loads(line)
            ppl[(row["engine"], row["model"].lower(), row.get("dtype", "bfloat16"))] = row["ppl"]
    return batch1, offline, ppl, paired, prefill


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def table(batch1: dict, offline: dict, ppl: dict, paired: list[dict], prefill: dict) -> list[str]:
    out = ["| measure | nanoserve | peer | ratio | target |", "|---|---|---|---|---|"]
    for name in ("q4_1", "q8_0", "q4_k_m"):
        ours = batch1.get(("nanoserve", f"smollm2-{name}.gguf"))
        peer = batch1.get(("llama.cpp", f"smollm2-{name}.gguf"))
        if ours and peer:
            target = f"no slower: {verdict(ours <= peer)}" if name != "q4_k_m" else ""
            out.append(
                f"| batch-1 ms/token, {name.upper()} file | {ours:.2f} | llama.cpp {peer:.2f} | "
                f"{peer / ours:.2f}x | {target} |"
            )
    bf16 = batch1.get(("nanoserve", "smollm2-135m-instruct"))
    if bf16:
        out.append(
            f"| batch-1 ms/token, bf16 import | {bf16:.2f} | llama.cpp BF16 "
            f"{batch1.get(('llama.cpp', 'smollm2-bf16.gguf'), float('nan')):.2f} | | |"
        )
    if "bf16" in offline:
        for name in ("q4_1", "q8_0"):
            if name in offline:
                ratio = offline[name] / offline["bf16"]
                target = f"at least 1.3x: {verdict(ratio >= 1.3)}" if name == "q4_1" else ""
                out.append(
                    f"| offline 64x(128,128) tok/s, {name.upper()} | {offline[name]:.1f} | "
                    f"nanoserve bf16 {offline['bf16']:.1f} | {ratio:.2f}x | {target} |"
                )
    bf16_files = {"nanoserve": "smollm2-135m-instruct", "llama.cpp": "smollm2-bf16.gguf"}
    for engine, bf16_file in bf16_files.items():
        base = prefill.get((engine, bf16_file))
        for name in ("q4_1", "q8_0"):
            ours = prefill.get((engine, f"smollm2-{name}.gguf"))
            if base and ours:
                out.append(
                    f"| prompt tokens/s, {engine} {name.upper()} | {ours:.0f} | {engine} bf16 {base:.0f} | "
                    f"{ours / base:.2f}x | |"
                )
    for dtype in ("bfloat16", "float32"):
        base = ppl.get(("nanoserve", "smollm2-135m-instruct", dtype))
        for name in ("q8_0", "q4_1", "q4_k_m"):
            ours = ppl.get(("nanoserve", f"smollm2-{name}.gguf", dtype))
            peer = ppl.get(("llamacpp", f"smollm2-{name}.gguf", "float32"))
            if ours is None:
                continue
            if name == "q8_0" and base:
                target = f"within 1% of bf16 weights ({base:.4f}): {verdict(abs(ours / base - 1) <= 0.01)}"
            elif peer and name == "q4_1":
                target = f"within llama.cpp's: {verdict(ours <= peer)}"
            else:
                target = ""
            out.append(
                f"| perplexity, {name.upper()}, {dtype} activations | {ours:.4f} | llama.cpp "
                f"{peer if peer else float('nan'):.4f} | {ours / base if base else float('nan'):.4f}x "
                f"bf16 weights | {target} |"
            )
    for row in paired:  # scripts/perplexity.py compare: the same tokens, window by window
        worse = (
            f"; worse on {row['windows_worse']} of {row['windows']} windows"
            if "windows" in row
            else ""
        )
        out.append(
            f"| perplexity ratio {row['compare']} | {row['ppl_ratio']:.4f} | 95% interval "
            f"{row['low']:.4f}-{row['high']:.4f}{worse} | | |"
        )
    return out


def main(path: str) -> None:
    with open(path) as f:
        lines = f.read().splitlines()
    header = [line for line in lines if line.startswith("# ")]
    print("\n".join(header + [""] + table(*parse(lines))))


if __name__ == "__main__":
    main(sys.argv[1])
