"""A lone user on a real model's shape (issue 51): each GGUF type's batch-1 decode as a fraction of
this machine's read bandwidth, beside llama.cpp's `llama-bench` on the same file, with prompt
speed and resident memory. Each engine runs in a process of its own, one after the other: run it
on an idle machine, from the project root, after `make install`,
`../shared/bench/setup-llamacpp-tools.sh` and `../shared/bench/real-shapes.sh SHAPE`:

    .venv/bin/python benchmarks/real-shapes/bench_real_shapes.py --shape llama-3.2-1b [--types Q4_K_M Q8_0 ...]

Writes benchmarks/real-shapes/<cpu>/<shape>.txt (raw lines) and .md (the table). Measures:
- bandwidth: the best of several 2-thread sums over 2 GiB of float32 (torch.sum), GB/s, before and
  after the engines run, and the rate nanoserve's bf16 GEMM reads 2 GiB of weights at for one row
  (the highest of the three is the limit the fractions are of);
- nanoserve decode: a 16-token prompt then 128 greedy tokens (`ignore_eos`), median of 3 after a
  warm-up, tokens/s = 128 / (time - the prompt's); the file's bytes x tokens/s is the rate its
  weights are read at (a tied head reads the embedding's bytes once a token too);
- nanoserve prefill: one 512-token prompt, 1 token out, median of 3, prompt tokens/s;
- memory: VmRSS after the runs, the KV pool's resident part (pages written), VmHWM (peak);
- llama.cpp: `llama-bench -p 512 -n 128 -t 2 -r 3 -o csv` on the same file (pp512, tg128).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "BF16")
DECODE_TOKENS = 128
PROMPT_TOKENS = 512


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def bandwidth_gbs(gib: float = 2.0, rounds: int = 7) -> float:
    import torch

    torch.set_num_threads(2)
    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def gemv_read_gbs(gib: float = 2.0, rounds: int = 3) -> float:
    """The rate nanoserve's own bf16 GEMM reads weights at for one row (16 matrices of 2 GiB in
    all, packed as a model's are): a second probe of the limit, as torch.sum alone read less than
    the BF16 decodes did on a Zen 3 VM."""
    import torch

    from nanoserve.kernels.cpu import ops as cpu_ops

    torch.set_num_threads(2)
    n, k = 8192, int(gib * (1 << 30)) // 16 // 8192 // 2
    weights = [
        cpu_ops.pack_gemm_weight(torch.full((n, k), 0.01, dtype=torch.bfloat16)) for _ in range(16)
    ]
    x = torch.ones(1, k, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for weight in weights:
            cpu_ops.gemm(x, weight, None, n)
        best = min(best, time.perf_counter() - start)
    return sum(w.numel() * 2 for w in weights) / best / 1e9


def kv_pool_resident_bytes(llm) -> int:
    """Bytes of the KV pool's pages that are resident (mincore over each layer's K and V)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    runner = llm.llm_engine.runner
    total = 0
    for layer in runner.stage_layers():
        for cache in (layer.self_attn.attn.key_cache, layer.self_attn.attn.value_cache):
            start = cache.data_ptr() // page * page
            length = cache.untyped_storage().nbytes() + (cache.data_ptr() - start)
            pages = -(-length // page)
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) == 0:
                total += sum(v & 1 for v in vector) * page
    return total


def nanoserve_worker(path: str) -> dict:
    from nanoserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=path, dtype="bfloat16", max_model_len=4096)
    load_s = time.perf_counter() - start
    rss_loaded = status_kib("VmRSS")

    def timed(ids, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        begin = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == max_tokens
        return time.perf_counter() - begin

    # Each run's prompt its own (the prefix cache would skip a repeated one's work).
    prompts = iter(
        [[200 + (run * 7919 + i * 37) % 20000 for i in range(PROMPT_TOKENS)] for run in range(16)]
    )
    timed(next(prompts)[:16], DECODE_TOKENS)
    first = statistics.median(timed(next(prompts)[:16], 1) for _ in range(3))
    decode = (
        statistics.median(timed(next(prompts)[:16], DECODE_TOKENS + 1) for _ in range(3)) - first
    )
    prefill = statistics.median(timed(next(prompts), 1) for _ in range(3))
    return {
        "decode_tok_s": DECODE_TOKENS / decode,
        "prefill_tok_s": PROMPT_TOKENS / prefill,
        "load_s": load_s,
        "rss_loaded_mib": rss_loaded / 1024,
        "rss_mib": status_kib("VmRSS") / 1024,
        "peak_mib": status_kib("VmHWM") / 1024,
        "kv_resident_mib": kv_pool_resident_bytes(llm) / 2**20,
        "weight_mib": llm.llm_engine.runner.weight_bytes / 2**20,
    }


def llama_bench(tools: Path, path: Path) -> dict:
    out = (
        subprocess.run(
            [
                str(tools / "llama-bench"),
                "-m",
                str(path),
                "-p",
                str(PROMPT_TOKENS),
                "-n",
                str(DECODE_TOKENS),
                "-t",
                "2",
                "-r",
                "3",
                "-o",
                "csv",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()
    )
    header = [h.strip('"') for h in out[0].split(",")]
    result = {}
    for line in out[1:]:
        row = dict(zip(header, (v.strip('"') for v in line.split(","))))
        key = "prefill_tok_s" if int(row["n_prompt"]) > 0 else "decode_tok_s"
        result[key] = float(row["avg_ts"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--types", nargs="+", default=list(TYPES))
    parser.add_argument(
        "--shapes-dir",
        default=os.environ.get("REAL_SHAPES", str(Path.home() / ".cache/llamacpp/real-shapes")),
    )
    parser.add_argument(
        "--tools",
        default=str(
            Path(os.environ.get("LLAMACPP_TOOLS", Path.home() / ".cache/llamacpp/tools"))
            / "build"
            / "bin"
        ),
    )
    parser.add_argument(
        "--out", default=None, help="folder for the results (default benchmarks/real-shapes/<cpu>)"
    )
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(nanoserve_worker(args.worker)), flush=True)
        return
    cpu = subprocess.run(
        "lscpu | sed -n 's/^Model name: *//p'", shell=True, capture_output=True, text=True
    ).stdout.strip()
    from nanoserve.kernels.cpu import ops as cpu_ops

    folder = Path(args.out or Path("benchmarks/real-shapes") / cpu_folder(cpu))
    folder.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    raw = open(folder / f"{args.shape}.txt", "a")

    def log(line: str) -> None:
        print(line, flush=True)
        raw.write(line + "\n")
        raw.flush()

    log(
        f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {cpu}, {os.cpu_count()} CPUs, nanoserve {commit}"
    )
    log(f"# {cpu_ops.describe_isa()}")
    first_gbs = bandwidth_gbs()
    log(f"bandwidth {first_gbs:.1f} GB/s")
    gemv_gbs = gemv_read_gbs()
    log(f"bf16 GEMV reads {gemv_gbs:.1f} GB/s")
    rows = []
    for qtype in args.types:
        path = Path(args.shapes_dir) / args.shape / f"{qtype}.gguf"
        size = path.stat().st_size
        worker = subprocess.run(
            [sys.executable, __file__, "--worker", str(path)], capture_output=True, text=True
        )
        if worker.returncode != 0:
            log(f"nanoserve {qtype}: failed: {worker.stderr.strip().splitlines()[-1:]}")
            continue
        ours = json.loads(worker.stdout.strip().splitlines()[-1])
        log(f"nanoserve {qtype} {json.dumps(ours)}")
        peer = {} if args.no_llamacpp else llama_bench(Path(args.tools), path)
        if peer:
            log(f"llama.cpp {qtype} {json.dumps(peer)}")
        rows.append((qtype, size, ours, peer))
    # The read rate a VM's neighbours leave varies between minutes (34-43 GB/s on one 2-core Zen 3
    # EPYC): measured again after the engines ran, and the higher of the two is the limit.
    last_gbs = bandwidth_gbs()
    log(f"bandwidth {last_gbs:.1f} GB/s (after)")
    gbs = max(first_gbs, last_gbs, gemv_gbs)
    table = table_lines(gbs, rows)
    for line in table:
        log(line)
    (folder / f"{args.shape}.md").write_text(
        f"# {args.shape}, {cpu}, nanoserve {commit}\n\nmeasured read bandwidth {gbs:.1f} GB/s\n\n"
        + "\n".join(table)
        + "\n"
    )


def cpu_folder(cpu: str) -> str:
    """benchmarks/'s name for this CPU kind: the model name, with the Zen generation (AMD, whose
    lscpu name is only "AMD EPYC" in these VMs) or whether AMX is usable (Intel)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""

    def field(name: str) -> str:
        lines = (line for line in info.splitlines() if line.startswith(name))
        return next((line.split(":", 1)[1].strip() for line in lines), "")

    name = "-".join(
        cpu.lower().replace("(r)", "").replace("(tm)", "").replace("processor", "").split()
    )
    if "amd" in name and field("cpu family").isdigit():
        family, model = int(field("cpu family")), int(field("model") or 0)
        zen = {23: "zen2", 26: "zen5"}.get(
            family, "zen3" if family == 25 and model < 0x10 else "zen4"
        )
        return f"{name}-{zen}"
    if "intel" in name:
        return f"{name}-{'amx' if 'amx_tile' in field('flags').split() else 'no-amx'}"
    return name


if len(sys.argv) == 2 and sys.argv[1] == "--cpu-folder":  # for bench_served.sh, beside this file
    print(
        cpu_folder(
            subprocess.run(
                "lscpu | sed -n 's/^Model name: *//p'", shell=True, capture_output=True, text=True
            ).stdout.strip()
        )
    )
    sys.exit(0)


def table_lines(gbs: float, rows) -> list[str]:
    lines = [
        "| file | MB | decode tok/s nanoserve / llama.cpp | of bandwidth nanoserve / llama.cpp | pp512 tok/s "
        "nanoserve / llama.cpp | RSS MiB (KV resident) / peak |",
        "|---|---|---|---|---|---|",
    ]
    for qtype, size, ours, peer in rows:
        theirs = peer.get("decode_tok_s")
        fraction = lambda tok_s: f"{size * tok_s / 1e9 / gbs:.0%}"  # noqa: E731
        lines.append(
            f"| {qtype} | {size / 1e6:.0f} | {ours['decode_tok_s']:.1f} / {theirs or float('nan'):.1f} | "
            f"{fraction(ours['decode_tok_s'])} / {fraction(theirs) if theirs else '-'} | "
            f"{ours['prefill_tok_s']:.1f} / {peer.get('prefill_tok_s', float('nan')):.1f} | "
            f"{ours['rss_mib']:.0f} ({ours['kv_resident_mib']:.0f}) / {ours['peak_mib']:.0f} |"
        )
    return lines


if __name__ == "__main__":
    main()
