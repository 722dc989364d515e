"""Online serving benchmark: random prompts against nanoserve's OpenAI server at several
concurrency levels, reported like vLLM's `bench serve`, plus the ratio of served output tokens/s
at the highest concurrency to offline `LLM.generate` on the same prompts and batch size.

    nanoserve bench serve --model DIR --concurrency 1 16 64 --result-dir benchmarks/serve

With --vllm-results (the JSON files of `vllm bench serve --save-result --max-concurrency N`, one
per level) the plot and the summary (JSON and markdown) show vLLM's figures beside nanoserve's.

Without --base-url it measures offline throughput first, then starts `nanoserve serve` in a
subprocess (so the two never compete for cores), runs the load, and stops the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

from nanoserve.bench.serve_client import run_load, summarize
from nanoserve.bench.serve_plot import plot
from nanoserve.bench.throughput import greedy_timed
from nanoserve.bench.vllm_results import VllmResultsError, load_vllm_results, to_markdown


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    # Skip the low ids, where special tokens live.
    return [[rng.randrange(100, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
        "enforce_eager": args.enforce_eager,
    }
    for name in ("max_num_batched_tokens", "max_model_len", "gpu_memory_utilization"):
        if getattr(args, name):
            kwargs[name] = getattr(args, name)
    return kwargs


def timed_generate(llm, prompts: list[list[int]], output_len: int) -> dict:
    outputs, elapsed = greedy_timed(llm, prompts, output_len)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "num_prompts": len(prompts),
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_throughput": tokens / elapsed,
    }


def offline_worker(spec: dict) -> int:
    """`--offline-worker`: one LLM, kept warm; a job per stdin line, a result per stdout line."""
    from nanoserve import LLM

    llm = LLM(model=spec["model"], max_num_seqs=spec["batch"], **spec["kwargs"])
    for line in sys.stdin:
        job = json.loads(line)
        result = timed_generate(llm, job["prompts"], job["output_len"])
        print("OFFLINE " + json.dumps({**result, "max_num_seqs": spec["batch"]}), flush=True)
    return 0


class OfflineWorker:
    """Offline `LLM.generate` in its own long-lived process: warm like the server, and idle
    (no cores used) while the load runs against the server, and the other way round."""

    def __init__(self, args: argparse.Namespace, batch: int) -> None:
        spec = {"model": args.model, "batch": batch, "kwargs": engine_kwargs(args)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nanoserve.bench.serve", "--offline-worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        self.process.stdin.write(json.dumps({"prompts": prompts, "output_len": output_len}) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith("OFFLINE "):
                return json.loads(line[len("OFFLINE ") :])
        raise RuntimeError(f"the offline worker exited with {self.process.wait()}")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)


def launch_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        "-m",
        "nanoserve",
        "serve",
        "--model",
        args.model,
        "--port",
        "0",
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--seed",
        str(args.seed),
        "--log-level",
        "warning",
    ]
    for name in ("max_num_batched_tokens", "max_model_len", "gpu_memory_utilization"):
        if getattr(args, name):
            command += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.enforce_eager:
        command.append("--enforce-eager")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    for line in process.stdout:
        if line.startswith("listening on "):
            return process, line.split()[-1]
    raise RuntimeError(f"the server exited with {process.wait()} before listening")


def served_model(base_url: str) -> tuple[str, str]:
    import urllib.request

    with urllib.request.urlopen(base_url + "/v1/models", timeout=30) as response:
        card = json.loads(response.read())["data"][0]
    return card["id"], card["root"]


def print_level(concurrency: int, summary: dict) -> None:
    print(f"{'=' * 14} concurrency {concurrency} {'=' * 14}")
    print(f"Successful requests:                     {summary['completed']}")
    print(f"Benchmark duration (s):                  {summary['duration_s']:.2f}")
    print(f"Request throughput (req/s):              {summary['request_throughput']:.2f}")
    print(f"Output token throughput (tok/s):         {summary['output_throughput']:.2f}")
    print(f"Total token throughput (tok/s):          {summary['total_token_throughput']:.2f}")
    for key, label in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2el_ms", "E2EL"),
    ):
        stats = summary[key]
        print(
            f"{label:5s} mean / median / P99 (ms):   {stats['mean']:8.2f} {stats['median']:8.2f} "
            f"{stats['p99']:8.2f}"
        )
    if summary["failed"]:
        print(f"Failed requests: {summary['failed']} {summary['errors']}")


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nanoserve bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="model dir (default: the imported SmolLM2)")
    parser.add_argument("--base-url", default=None, help="a running server (else one is started)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--prompts-per-level",
        type=int,
        nargs="+",
        default=None,
        help="requests at each level (default: max(8, 2 x concurrency))",
    )
    parser.add_argument(
        "--input-len", "--random-input-len", dest="input_len", type=int, default=128
    )
    parser.add_argument(
        "--output-len", "--random-output-len", dest="output_len", type=int, default=128
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="per engine: the server and the offline baseline run side by side",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="alternate offline and served runs at the top concurrency this many "
        "times and compare medians (for noisy, shared machines)",
    )
    parser.add_argument("--no-offline", action="store_true", help="skip the offline baseline")
    parser.add_argument("--result-dir", default=None, help="write result JSON (and PNG) here")
    parser.add_argument("--label", default=None, help="file name stem for the results")
    parser.add_argument(
        "--vllm-results",
        nargs="+",
        default=None,
        metavar="FILE",
        help="`vllm bench serve --save-result` JSON files (one per concurrency "
        "level) to plot and summarize beside nanoserve's results",
    )
    parser.add_argument("--offline-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.offline_worker:
        return offline_worker(json.loads(args.offline_worker))

    vllm_levels = None
    if args.vllm_results:
        try:
            vllm_levels = load_vllm_results(args.vllm_results)
        except VllmResultsError as error:  # `nanoserve bench serve` prints it as one line
            raise VllmResultsError(f"--vllm-results: {error}") from None
    if args.model is None and args.base_url is None:
        from nanoserve.models.gguf.importer import ensure_default_model

        args.model = str(ensure_default_model())
    counts = args.prompts_per_level or [max(8, 2 * c) for c in args.concurrency]
    if len(counts) != len(args.concurrency):
        parser.error("--prompts-per-level needs one count per --concurrency value")
    vocab = 10000
    if args.model is not None:
        from nanoserve.models.config import ModelConfig

        vocab = ModelConfig.from_dir(args.model).vocab_size
    top = max(args.concurrency)
    run_offline = not args.no_offline and args.model is not None

    process = worker = None
    base_url = args.base_url
    levels, offline_runs, served_runs = [], [], []

    # Every run gets prompts no earlier run sent, so the prefix cache never helps; an offline
    # run and the served run after it share theirs.
    def prompts_for(concurrency: int, count: int, repeat: int) -> list[list[int]]:
        seed = args.seed + 1000 * concurrency + repeat
        return random_prompts(count, args.input_len, vocab, seed)

    try:
        if base_url is None:
            process, base_url = launch_server(args)
        model, root = served_model(base_url)
        if run_offline:
            worker = OfflineWorker(args, top)
        # Warm-up at the top batch size (short outputs), for the server and the offline worker
        # alike: the first large steps of a fresh process are slower.
        warm = prompts_for(1, top, 999)
        asyncio.run(run_load(base_url, model, warm, 16, top))
        if worker is not None:
            worker.run(warm, 16)
        for concurrency, count in zip(args.concurrency, counts):
            repeats = args.repeats if concurrency == top else 1
            runs = []
            for repeat in range(repeats):
                prompts = prompts_for(concurrency, count, repeat)
                if concurrency == top and worker is not None:  # the server is idle meanwhile
                    offline_runs.append(worker.run(prompts, args.output_len))
                    print(
                        f"offline LLM.generate: {offline_runs[-1]['output_throughput']:.2f} "
                        f"output tok/s ({len(prompts)} prompts, batch {top})",
                        flush=True,
                    )
                results, duration = asyncio.run(
                    run_load(base_url, model, prompts, args.output_len, concurrency)
                )
                summary = {
                    "concurrency": concurrency,
                    "num_prompts": count,
                    **summarize(results, duration),
                }
                print_level(concurrency, summary)
                runs.append(summary)
            if concurrency == top:
                served_runs = [run["output_throughput"] for run in runs]
            # keep the run with the median throughput as this level's figures
            runs.sort(key=lambda run: run["output_throughput"])
            levels.append(runs[len(runs) // 2])
    finally:
        if worker is not None:
            worker.close()
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)

    result = {
        "title": f"nanoserve serve: {Path(root).name}, {args.input_len} in / "
        f"{args.output_len} out, {platform.machine()} {os.cpu_count()} cpus",
        "command": "nanoserve bench serve " + " ".join(argv or sys.argv[1:]),
        "model": root,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "levels": levels,
        "offline": None,
    }
    if offline_runs:
        offline_tps = [run["output_throughput"] for run in offline_runs]
        result["offline"] = {
            **offline_runs[0],
            "output_throughput": median(offline_tps),
            "runs_output_throughput": offline_tps,
        }
        result["served_runs_output_throughput"] = served_runs
        result["served_over_offline"] = median(served_runs) / median(offline_tps)
        result["served_over_offline_per_pair"] = [s / o for s, o in zip(served_runs, offline_tps)]
        print(
            f"served / offline output tok/s at concurrency {top} (medians of {len(served_runs)}):"
            f" {result['served_over_offline']:.3f}"
        )
    if vllm_levels is not None:
        result["vllm"] = {"files": args.vllm_results, "levels": vllm_levels}
        print(to_markdown(result))
    if args.result_dir:
        out = Path(args.result_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = args.label or "serve"
        (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / f"{stem}.md").write_text(to_markdown(result))
        try:
            plot(result, out / f"{stem}.png")
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)
        print(f"results written to {out / stem}.json, .md and .png")
    return 0 if all(lv["failed"] == 0 for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
