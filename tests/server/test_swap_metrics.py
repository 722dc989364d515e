"""/metrics on a real server with --preemption-mode swap: vllm:num_requests_swapped and
vllm:cpu_cache_usage_perc (vLLM V0's gauges) follow swapped requests, and return to 0; the
completions are the same as a roomy pool's."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from nanoserve import LLM, SamplingParams
from tests.engine.test_swap_preemption import random_prompts
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import scrape_metrics

NUM_SWAP_BLOCKS = 256


class HoldWhileSwapped:
    """Wraps the real engine's step: after the first step that leaves a request swapped out, the
    next step waits (before its work) until released, so the server's gauges certainly show the
    swapped state while the test scrapes them, however briefly swaps last here."""

    def __init__(self, engine) -> None:
        self.engine, self.real_step = engine, engine.step
        self.swapped_seen = False
        self.holding, self.released = threading.Event(), threading.Event()
        engine.step = self

    def __call__(self):
        if self.swapped_seen and not self.released.is_set():
            self.holding.set()
            self.released.wait(120)  # (a bound that only keeps a broken test from hanging)
        outputs = self.real_step()
        self.swapped_seen = self.swapped_seen or self.engine.stats().num_swapped > 0
        return outputs


def test_swap_gauges_on_a_real_server(tiny_llama_dir):
    reference_llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=512)
    vocab = reference_llm.llm_engine.model_config.vocab_size
    prompts = random_prompts(48, vocab, seed=3)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    reference = [
        o.outputs[0].token_ids
        for o in reference_llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
    ]
    del reference_llm
    handle = ServerHandle(
        tiny_llama_dir,
        engine_kwargs={
            "dtype": "float32",
            "num_kv_blocks": 48,
            "max_num_batched_tokens": 256,
            "preemption_mode": "swap",
            "num_swap_blocks": NUM_SWAP_BLOCKS,
        },
    )
    try:
        client = handle.client()
        model = client.models.list().data[0].id

        def complete(prompt: list[int]) -> list[int]:
            reply = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=64,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            return reply.choices[0].token_ids

        hold = HoldWhileSwapped(handle.engine)
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(complete, p) for p in prompts]
            try:
                assert hold.holding.wait(120), "no request was ever swapped out"
                samples = scrape_metrics(handle.port)
            finally:
                hold.released.set()
            seen_swapped = samples["vllm:num_requests_swapped"]
            seen_usage = samples["vllm:cpu_cache_usage_perc"]
            results = [f.result(timeout=120) for f in futures]
        assert results == reference
        assert seen_swapped >= 1 and 0 < seen_usage <= 1
        # A swapped request holds whole blocks: usage is a multiple of 1 / NUM_SWAP_BLOCKS.
        assert abs(seen_usage * NUM_SWAP_BLOCKS - round(seen_usage * NUM_SWAP_BLOCKS)) < 1e-9
        samples = scrape_metrics(handle.port)
        assert (
            samples["vllm:num_requests_swapped"] == 0 and samples["vllm:cpu_cache_usage_perc"] == 0
        )
        assert (
            samples["vllm:num_preemptions_total"] >= handle.engine.stats().num_swap_outs_total > 0
        )
    finally:
        handle.close()
