"""layers/cpu_decode.py: a CPU step of decodes runs its decoder layers in one C++ call. It calls
the modules' kernels in the same order on the same inputs, so tokens and logprobs must be
bit-identical to the modules' path, with mixed steps (prompt chunks beside decodes, which take
the modules) in between."""
from __future__ import annotations

import random

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import cpu_ops
from nanoserve.layers.cpu_decode import FusedDecode
from tests.conftest import write_random_llama

pytestmark = pytest.mark.skipif(not cpu_ops.gemm_available(),
                                reason="the fused decode path needs the CPU kernels (no compiler here)")

# head_dim 64 (the AMX attention kernel on AMX) and 32 (ops.cpp's), GQA and MHA; at every ISA level
# this machine runs (the cpu_isa fixture).
SHAPES = {
    "gqa-d64": dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "mha-d32": dict(hidden_size=128, num_heads=4, num_kv_heads=4, intermediate_size=256),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model_dir(request, tmp_path_factory):
    return write_random_llama(tmp_path_factory.mktemp(request.param), seed=5, num_layers=3, **SHAPES[request.param])


def generate(llm: LLM, fused: bool):
    runner = llm.llm_engine.runner
    kept = runner.fused_decode
    calls = []
    if fused:
        run = kept.run

        def counted(*args):
            hidden = run(*args)
            calls.append(hidden is not None)
            return hidden
        runner.fused_decode = FusedDecode.__new__(FusedDecode)
        runner.fused_decode.__dict__.update(kept.__dict__)
        runner.fused_decode.run = counted
    else:
        runner.fused_decode = None
    try:
        rng = random.Random(3)
        vocab = llm.llm_engine.model_config.vocab_size
        # Different lengths and budgets: prompts arrive while others decode (mixed steps), and a
        # chunked prompt's chunks share steps with decodes.
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in (5, 40, 90, 17, 130)]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in (30, 12, 20, 25, 8)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.fused_decode = kept
    result = [(o.outputs[0].token_ids, [[(t, lp.logprob) for t, lp in sorted(step.items())]
                                        for step in o.outputs[0].logprobs]) for o in outputs]
    return result, calls


def test_fused_decode_gives_the_modules_bits(model_dir, cpu_isa):
    llm = LLM(model=str(model_dir), dtype="bfloat16", max_num_batched_tokens=64, num_kv_blocks=128,
              device="cpu")
    assert llm.llm_engine.runner.fused_decode is not None
    fused, calls = generate(llm, fused=True)
    modules, _ = generate(llm, fused=False)
    assert sum(calls) >= 10, "the fused path ran in too few steps to be tested"
    assert not all(calls), "no step with prompt rows took the modules' path"
    for index, (a, b) in enumerate(zip(fused, modules)):
        assert a[0] == b[0], f"request {index}: tokens differ"
        assert a[1] == b[1], f"request {index}: logprobs differ"


def test_fused_decode_not_built_where_it_does_not_apply(tmp_path, monkeypatch):
    model_dir = write_random_llama(tmp_path / "m", seed=1)
    assert LLM(model=str(model_dir), dtype="float32", device="cpu").llm_engine.runner.fused_decode is None
    monkeypatch.setenv("NANOSERVE_CPU_GEMM", "onednn")  # oneDNN GEMMs: no packed weights
    assert LLM(model=str(model_dir), dtype="bfloat16", device="cpu").llm_engine.runner.fused_decode is None
