"""Perplexity of a model on a fixed text, the same token ids for nanoserve and llama.cpp.

The text is cut into windows of CTX token ids; each window is scored on its second half (every
scored token sees at least CTX/2 tokens of context), as llama.cpp's `perplexity` tool does. No BOS
is added by either engine: both read exactly the ids written by `tokenize`.

    .venv/bin/python scripts/perplexity.py tokenize MODEL_DIR TEXT IDS.json
    .venv/bin/python scripts/perplexity.py nanoserve MODEL IDS.json [DTYPE]  # a directory or a .gguf;
                                                                             # DTYPE: activations (bfloat16)
    ~/.cache/llamacpp/venv/bin/python scripts/perplexity.py llamacpp FILE.gguf IDS.json

Each scoring command prints one JSON line: {"engine", "model", "tokens_scored", "ppl"}. The
llama.cpp branch imports only llama_cpp and numpy (it runs in llama.cpp's own venv).
"""
from __future__ import annotations

import json
import math
import sys

CTX = 1024


def windows(ids: list[int]) -> list[list[int]]:
    return [ids[start:start + CTX] for start in range(0, len(ids) - CTX + 1, CTX)]


def tokenize(model_dir: str, text_path: str, out_path: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(text_path, encoding="utf-8") as f:
        ids = tokenizer(f.read(), add_special_tokens=False)["input_ids"]
    with open(out_path, "w") as f:
        json.dump(ids, f)
    print(f"{len(ids)} tokens, {len(windows(ids))} windows of {CTX}", file=sys.stderr)


def score_nanoserve(model: str, ids: list[int], dtype: str = "bfloat16") -> tuple[int, float]:
    from nanoserve import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=CTX + 16)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    total, count = 0.0, 0
    for window in windows(ids):
        output = llm.generate([{"prompt_token_ids": window}], params, use_tqdm=False)[0]
        for position in range(CTX // 2, CTX):
            total -= output.prompt_logprobs[position][window[position]].logprob
            count += 1
    return count, total


def score_llamacpp(path: str, ids: list[int]) -> tuple[int, float]:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=CTX, n_batch=CTX, n_threads=2, logits_all=True, verbose=False)
    total, count = 0.0, 0
    for window in windows(ids):
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[:CTX], dtype=np.float64)
        # row p predicts token p + 1
        rows = logits[CTX // 2 - 1:CTX - 1]
        top = rows.max(axis=1, keepdims=True)
        log_norm = (top[:, 0] + np.log(np.exp(rows - top).sum(axis=1)))
        targets = np.asarray(window[CTX // 2:CTX])
        total += float((log_norm - rows[np.arange(len(targets)), targets]).sum())
        count += len(targets)
    return count, total


def main(argv: list[str]) -> None:
    if not argv or len(argv) not in {"tokenize": (4,), "nanoserve": (3, 4), "llamacpp": (3,)}.get(argv[0], ()):
        sys.exit(__doc__)
    if argv[0] == "tokenize":
        tokenize(*argv[1:])
        return
    with open(argv[2]) as f:
        ids = json.load(f)
    if argv[0] == "nanoserve":
        dtype = argv[3] if len(argv) == 4 else "bfloat16"
        count, total = score_nanoserve(argv[1], ids, dtype)
    else:
        dtype = "float32"  # llama.cpp computes activations in fp32
        count, total = score_llamacpp(argv[1], ids)
    print(json.dumps({"engine": argv[0], "model": argv[1].rstrip("/").rsplit("/", 1)[-1], "dtype": dtype,
                      "tokens_scored": count, "ppl": round(math.exp(total / count), 4)}))


if __name__ == "__main__":
    main(sys.argv[1:])
