"""LoRA adapters with tensor and pipeline parallelism (CPU, gloo): every rank reads its share of
each adapter when the driver first sees it (a column-parallel layer's B by output rows, a
row-parallel layer's A by input columns), and fills the slots each step's table names; --tp 2 and
--pp 2 give --tp 1's tokens, the adapters mixed in the same steps, dropped and read again."""

from __future__ import annotations

import pytest

from nanoserve import LLM, LoRARequest, SamplingParams
from tests.engine.test_lora import PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def generate(model_dir, adapters, **engine_args) -> list[list[list[int]]]:
    """Two rounds: all adapters at once, then one at a time (with --max-loras 1 and
    --max-cpu-loras 1, each adapter's turn evicts the one before, on every rank)."""
    names = list(adapters)
    loras = [None] + [LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(names)]
    requests = [(p, lora) for p in PROMPTS for lora in loras]
    engine_args.setdefault("max_loras", len(names))
    with LLM(
        model=str(model_dir), dtype="float32", enable_lora=True, num_kv_blocks=256, **engine_args
    ) as llm:
        together = llm.generate(
            [{"prompt_token_ids": p} for p, _ in requests],
            GREEDY,
            use_tqdm=False,
            lora_request=[lora for _, lora in requests],
        )
        one_by_one = [
            llm.generate(
                [{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=lora
            )[0]
            for lora in reversed(loras)
        ]
        assert len(llm.llm_engine.loras) == (
            1 if engine_args.get("max_cpu_loras") == 1 else len(names)
        )
    return [
        [o.outputs[0].token_ids for o in together],
        [o.outputs[0].token_ids for o in one_by_one],
    ]


@pytest.mark.parametrize(
    "parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_parallel_lora_equals_one_rank(tiny_llama_dir, lora_adapters, parallel):
    reference = generate(tiny_llama_dir, lora_adapters)
    assert (
        generate(tiny_llama_dir, lora_adapters, max_loras=1, max_cpu_loras=1, **parallel)
        == reference
    )
    assert len({tuple(t) for t in reference[0]}) == len(reference[0])
