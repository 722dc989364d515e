"""llama.cpp (llama-cpp-python) prompt processing on a GGUF file: one 512-token prompt, median of 3
evaluations after a warm-up, 2 threads; prints prompt tokens/s. It runs in llama.cpp's own venv:

    ~/.cache/llamacpp/venv/bin/python benchmarks/quant/prefill_llamacpp.py FILE.gguf

benchmarks/quant/bench_quant.sh's `prefill` part puts it beside nanoserve's prompt-only offline run, to
compare how much each engine gains from a quantized file where the work is compute-bound."""

import statistics
import sys
import time

from llama_cpp import Llama

TOKENS = 512
llm = Llama(model_path=sys.argv[1], n_ctx=TOKENS + 16, n_batch=TOKENS, n_threads=2, verbose=False)
prompt = [200 + (i * 37) % 20000 for i in range(TOKENS)]


def run() -> float:
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    return time.perf_counter() - start


run()
print(
    f"llama.cpp prefill {sys.argv[1].rsplit('/', 1)[-1]}: {TOKENS / statistics.median(run() for _ in range(3)):.1f} tokens/s"
)
