"""Speculative decoding (n-gram prompt lookup) against plain decoding on this machine, one
request at a time (concurrency 1), greedy, SmolLM2 bf16: TPOT p50 (time between a request's
first and last token over its tokens after the first, from the engine's own request metrics)
on an input-grounded workload (repeat or correct a ~300-token passage: prompts.json, committed)
and on random token prompts (nothing to look up). Each engine configuration runs in a process of
its own, one after the other; outputs are compared token for token.

    .venv/bin/python benchmarks/spec_decode/bench_spec.py [--out benchmarks/spec_decode/<cpu>]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
MAX_TOKENS = 160


def workloads() -> dict[str, list]:
    grounded = json.loads((HERE / "prompts.json").read_text())
    rng = random.Random(0)
    randoms = [
        {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(300)]} for _ in range(6)
    ]
    return {"grounded": [[{"role": "user", "content": p}] for p in grounded], "random": randoms}


def child(config: str) -> None:
    from nanoserve import LLM, SamplingParams
    from nanoserve.models.gguf.importer import ensure_default_model

    spec = NGRAM if config == "ngram" else None
    llm = LLM(model=str(ensure_default_model()), dtype="bfloat16", speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    result = {}
    for name, items in workloads().items():
        run = (
            (lambda item: llm.chat(item, params, use_tqdm=False)[0])
            if name == "grounded"
            else (
                lambda item: llm.generate(
                    [item],
                    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                    use_tqdm=False,
                )[0]
            )
        )
        run(items[0])  # warm-up
        tpots, tokens = [], []
        for item in items:
            out = run(item)
            m, n = out.metrics, len(out.outputs[0].token_ids)
            tpots.append((m.last_token_time - m.first_token_time) / max(1, n - 1))
            tokens.append(out.outputs[0].token_ids)
        result[name] = {"tpot_ms_p50": 1000 * statistics.median(tpots), "tokens": tokens}
    stats = llm.llm_engine.stats().spec_decoding
    if stats is not None:
        result["acceptance_rate"] = stats.acceptance_rate
        result["mean_acceptance_length"] = stats.mean_acceptance_length
        result["accepted_per_pos"] = stats.accepted_per_pos
        result["drafts"] = stats.num_drafts
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=("plain", "ngram"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    results = {}
    for config in ("plain", "ngram"):
        done = subprocess.run(
            [sys.executable, __file__, "--child", config],
            capture_output=True,
            text=True,
            check=True,
        )
        results[config] = json.loads(done.stdout.strip().splitlines()[-1])
    plain, ngram = results["plain"], results["ngram"]
    lines = [
        f"spec decode, {json.dumps(NGRAM)}, c=1, greedy, max_tokens {MAX_TOKENS}, SmolLM2 bf16"
    ]
    for name, target in (("grounded", 0.6), ("random", 1.05)):
        ratio = ngram[name]["tpot_ms_p50"] / plain[name]["tpot_ms_p50"]
        same = ngram[name]["tokens"] == plain[name]["tokens"]
        lines.append(
            f"{name}: TPOT p50 plain {plain[name]['tpot_ms_p50']:.2f} ms, ngram "
            f"{ngram[name]['tpot_ms_p50']:.2f} ms, ratio {ratio:.3f} (target <= {target}: "
            f"{'met' if ratio <= target else 'MISSED'}); outputs identical: {same}"
        )
    lines.append(
        f"acceptance rate {ngram['acceptance_rate']:.3f}, mean acceptance length "
        f"{ngram['mean_acceptance_length']:.2f}, accepted per position {ngram['accepted_per_pos']}, "
        f"drafts {ngram['drafts']}"
    )
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.txt").write_text("\n".join(lines) + "\n")
        for r in results.values():
            for name in ("grounded", "random"):
                r[name].pop("tokens")
        (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
