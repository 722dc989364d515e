"""LLaVA on the CPU's fused decode path (models/cpu_decode.py): its decode steps are plain Llama
steps, so they take the one C++ call of decoder layers, and the tokens and logprobs are the
modules' path's, bit for bit; steps with image rows take the modules."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.models.cpu_decode import FusedDecode
from tests.multimodal.test_llava import IMAGES, ONE_IMAGE, TWO_IMAGES

pytestmark = pytest.mark.skipif(
    not cpu_ops.gemm_available(),
    reason="the fused decode path needs the CPU kernels (no compiler here)",
)

PROMPTS = [
    {"prompt": ONE_IMAGE, "multi_modal_data": {"image": IMAGES[0]}},
    {"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES}},
    {"prompt": "USER: Say something. ASSISTANT:"},
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in (20, 14, 9)
]


def generate(llm: LLM, fused: bool):
    """The prompts' tokens and logprobs, with the fused decode path or without; with it, one
    entry per call of the fused path: whether it ran the step (not None)."""
    runner = llm.llm_engine.runner
    kept = runner.fused_decode
    calls: list[bool] = []
    if fused:

        def counted(*args):
            hidden = FusedDecode.run(kept, *args)
            calls.append(hidden is not None)
            return hidden

        runner.fused_decode = FusedDecode.__new__(FusedDecode)
        runner.fused_decode.__dict__.update(kept.__dict__)
        runner.fused_decode.run = counted
    else:
        runner.fused_decode = None
    try:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        runner.fused_decode = kept
    result = [
        (
            list(o.outputs[0].token_ids),
            [[(t, lp.logprob) for t, lp in sorted(step.items())] for step in o.outputs[0].logprobs],
        )
        for o in outputs
    ]
    return result, calls


def test_llava_decode_steps_take_the_fused_path(llava_dir, cpu_isa):
    llm = LLM(
        model=str(llava_dir),
        dtype="bfloat16",
        device="cpu",
        num_kv_blocks=64,
        limit_mm_per_prompt={"image": 2},
        max_num_batched_tokens=32,  # the image prompts' chunks share steps with decodes
    )
    assert llm.llm_engine.runner.fused_decode is not None
    encoded = llm.llm_engine.runner.encoder_cache.num_encoded_images
    fused, calls = generate(llm, fused=True)
    assert llm.llm_engine.runner.encoder_cache.num_encoded_images == encoded + 2
    modules, _ = generate(llm, fused=False)
    # 43 tokens decoded in all, the last step of each prompt sampling the first: most steps are
    # decodes only, which the fused path ran; a step with a text prompt's rows returned None.
    assert sum(calls) >= 15, calls
    assert not all(calls), "no step with prompt rows reached the fused path and left it"
    for index, (a, b) in enumerate(zip(fused, modules, strict=True)):
        assert a[0] == b[0], f"prompt {index}: tokens differ"
        assert a[1] == b[1], f"prompt {index}: logprobs differ"
