"""Prompt logprobs in the engine (issue 18): collected across prefill chunks, once per request
(n > 1), not duplicated when a sequence is preempted and recomputed; checked against
transformers' forward of each prompt."""

from __future__ import annotations

import torch

from nanoserve import LLM, SamplingParams
from tests.engine.hf_oracle import load_hf
from tests.helpers import random_prompts


def test_prompt_logprobs_survive_chunking_preemption_and_n(tiny_llama_dir):
    # 9 blocks of 16 tokens for three 40-token prompts that each grow to 80: preemption is certain.
    llm = LLM(
        model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=9, max_num_batched_tokens=16
    )
    engine = llm.llm_engine
    prompts = random_prompts(3, engine.model_config.vocab_size, seed=21, min_len=40, max_len=40)
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2, n=n)
        for n in (1, 2, 1)
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert engine.schedulers[0].num_preemptions > 0
    model = load_hf(tiny_llama_dir)
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            reference = model(input_ids=torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        got = output.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for position in range(1, len(prompt)):
            token = prompt[position]
            assert abs(got[position][token].logprob - reference[position - 1, token].item()) < 1e-4
            assert set(reference[position - 1].topk(2).indices.tolist()) <= set(got[position])
    assert [len(o.outputs) for o in outputs] == [1, 2, 1]
    # A request that does not ask has none, and pays for no prompt rows.
    plain = llm.generate(
        [{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False
    )[0]
    assert plain.prompt_logprobs is None
