"""A quantized GGUF model on CUDA (kernels/quant_triton.py's dequantize-GEMM), eager and with CUDA
graphs: its greedy tokens' logprobs equal transformers running the dequantized weights in
float32 (the Triton GEMM quantizes no activations, so only float32 rounding separates them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from tests.gguf_models import dequantized_transformers, write_quantized_gguf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize(
    "preset", ["q8_0", "q4_1", "q4_k_m", "llama_cpp_q4_k_m", "llama_cpp_q5_k_m"]
)
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@torch.inference_mode()
def test_cuda_logprobs_match_transformers(tmp_path, preset, enforce_eager):
    path = write_quantized_gguf(tmp_path, preset, seed=28)
    llm = LLM(
        model=str(path),
        dtype="float32",
        device="cuda",
        enforce_eager=enforce_eager,
        gpu_memory_utilization=0.3,
        max_model_len=256,
    )
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    model = dequantized_transformers(path)
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        ours = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        prompt_ids = llm.get_tokenizer().encode(prompt)
        ids = torch.tensor([prompt_ids + list(completion.token_ids)])
        rows = torch.log_softmax(model(ids).logits[0], dim=-1)[len(prompt_ids) - 1 : -1]
        theirs = [row[t].item() for row, t in zip(rows, completion.token_ids)]
        assert np.allclose(ours, theirs, atol=2e-3), (prompt, ours, theirs)
        assert all(row.max().item() - value < 2e-3 for row, value in zip(rows, theirs)), prompt
