"""The serving benchmark's PNG: output tok/s (left) and latency medians / P99s (right) against
concurrency, for nanoserve and, when its results were given, vLLM."""

from __future__ import annotations

from pathlib import Path

LATENCY = (("ttft_ms", "TTFT", "C0"), ("tpot_ms", "TPOT", "C1"), ("itl_ms", "ITL", "C2"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    levels = result["levels"]
    vllm = (result.get("vllm") or {}).get("levels", [])
    xs = [level["concurrency"] for level in levels]
    vxs = [level["concurrency"] for level in vllm]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(
        xs,
        [lv["output_throughput"] for lv in levels],
        "o-",
        color="C0",
        label="nanoserve output tok/s",
    )
    if vllm:
        left.plot(
            vxs,
            [lv["output_throughput"] for lv in vllm],
            "s--",
            color="C3",
            label="vLLM output tok/s",
        )
    if result.get("offline"):
        left.axhline(
            result["offline"]["output_throughput"],
            color="gray",
            linestyle="--",
            label=f"offline LLM.generate (batch {result['offline']['max_num_seqs']})",
        )
    left.set_ylabel("output tokens / s")
    left.set_title("Throughput")
    left.legend(fontsize=8)
    for key, label, color in LATENCY:
        right.plot(
            xs, [lv[key]["median"] for lv in levels], "o-", color=color, label=f"{label} median"
        )
        right.plot(xs, [lv[key]["p99"] for lv in levels], "x:", color=color, label=f"{label} p99")
        points = [
            (lv["concurrency"], lv[key]["median"])
            for lv in vllm
            if lv.get(key) and lv[key]["median"] is not None
        ]
        if points:
            right.plot(*zip(*points), "s--", color=color, alpha=0.6, label=f"vLLM {label} median")
    right.set_yscale("log")
    right.set_ylabel("ms")
    right.set_title("Latency (solid: nanoserve, dashed: vLLM)" if vllm else "Latency")
    right.legend(fontsize=7, ncol=2 if vllm else 1)
    ticks = sorted(set(xs) | set(vxs))
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency")
        axis.set_xticks(ticks, [str(x) for x in ticks])
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    fig.suptitle(result["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
