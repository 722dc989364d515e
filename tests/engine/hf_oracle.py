"""Hugging Face transformers as the test oracle: greedy decoding with its own KV cache."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation without any EOS handling (nanoserve side uses ignore_eos)."""
    input_ids = torch.tensor([prompt_ids])
    out = model(input_ids=input_ids, use_cache=True)
    past = out.past_key_values
    tokens = []
    next_token = int(out.logits[0, -1].argmax())
    for _ in range(num_tokens):
        tokens.append(next_token)
        if len(tokens) == num_tokens:
            break
        out = model(input_ids=torch.tensor([[next_token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        next_token = int(out.logits[0, -1].argmax())
    return tokens


def load_hf(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
