"""GPTQ, AWQ, compressed-tensors and FP8 checkpoints (and online FP8) on CUDA, their layers kept
quantized (kernels/quant_blocks.py's form, kernels/quant_triton.py's GEMV and GEMM), eager and with
CUDA graphs: their greedy tokens' logprobs equal transformers running each layer's meaning in
float32 (the Triton kernels quantize no activations). tests/models/test_quant_on_triton.py runs
the same forms in Triton's interpreter where there is no GPU; scripts/gpu_check.sh runs this."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.layers.linear import LinearBase

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def checkpoint(source: str, tmp_path):
    """(the model to serve, transformers' model of its meaning)."""
    kind, _, scheme = source.partition(":")
    if kind in ("gptq", "awq"):
        from tests.gptq_awq_models import dequantized_transformers, write_quantized_llama

        path = write_quantized_llama(tmp_path, scheme, seed=3)
        return path, dequantized_transformers(path)
    if kind == "ct":
        from tests.compressed_tensors_models import (
            dequantized_transformers,
            write_compressed_llama,
        )

        path = write_compressed_llama(tmp_path, scheme, seed=3)
        return path, dequantized_transformers(path)
    from tests.fp8_models import dequantized_transformers, write_fp8_llama

    path = write_fp8_llama(tmp_path, scheme, seed=3)
    return path, dequantized_transformers(path)


@pytest.mark.parametrize(
    "source",
    [
        "gptq:gptq-4bit-actorder",
        "gptq:gptq-4bit-g128",
        "awq:awq-4bit-g128",
        "ct:w8a16-channel",
        "fp8:fp8-block128",
    ],
)
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@torch.inference_mode()
def test_cuda_logprobs_match_transformers(tmp_path, source, enforce_eager):
    path, model = checkpoint(source, tmp_path)
    llm = LLM(
        model=str(path),
        dtype="float32",
        device="cuda",
        enforce_eager=enforce_eager,
        gpu_memory_utilization=0.3,
        max_model_len=256,
    )
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert layers and all(
        m.weight_form.quantized and all(p.triton for p in m.weight_form.parts) for m in layers
    ), "a layer was dequantized at load"
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        ours = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        prompt_ids = llm.get_tokenizer().encode(prompt)
        ids = torch.tensor([prompt_ids + list(completion.token_ids)])
        rows = torch.log_softmax(model(ids).logits[0], dim=-1)[len(prompt_ids) - 1 : -1]
        theirs = [row[t].item() for row, t in zip(rows, completion.token_ids)]
        assert np.allclose(ours, theirs, atol=2e-3), (prompt, ours, theirs)


@torch.inference_mode()
def test_online_fp8_on_cuda(tmp_path):
    """--quantization fp8 of a float checkpoint on CUDA: every linear layer in E4M3 with a scale
    per row, held for the Triton kernel; the tokens those weights give."""
    from tests.conftest import write_random_llama

    path = write_random_llama(tmp_path / "model", hidden_size=256, intermediate_size=512)
    llm = LLM(
        model=str(path),
        dtype="float32",
        device="cuda",
        gpu_memory_utilization=0.3,
        max_model_len=256,
        quantization="fp8",
    )
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert layers and all(
        m.weight_form.quantized and m.weight_form.parts[0].qtype == "fp8_e4m3" for m in layers
    )
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
