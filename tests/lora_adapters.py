"""PEFT LoRA adapters for the tests, written by peft itself over the tiny random Llama, and
peft's own model as the oracle (a test-only dependency, as transformers)."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, target modules, r, extra LoraConfig fields)
ADAPTERS = {
    "all-r8": (1, ALL_TARGETS, 8, {}),
    "qv-down-r4-rslora": (2, ["q_proj", "v_proj", "down_proj"], 4, {"use_rslora": True}),
    "patterns-r16": (
        3,
        ["k_proj", "o_proj", "up_proj"],
        16,
        {"rank_pattern": {"o_proj": 4}, "alpha_pattern": {"up_proj": 3.0}},
    ),
}


def write_peft_adapter(
    base_dir: Path, out_dir: Path, seed: int, targets: list[str], r: int, **extra
) -> Path:
    """A random adapter (A and B both non-zero, large enough to change greedy tokens)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, **extra
    )
    peft = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(
                    torch.randn(param.shape, generator=generator) * 0.9 / param.shape[1] ** 0.5
                )
    peft.save_pretrained(str(out_dir))
    return out_dir


def write_adapters(base_dir: Path, root: Path) -> dict[str, Path]:
    return {
        name: write_peft_adapter(base_dir, root / name, seed, targets, r, **extra)
        for name, (seed, targets, r, extra) in ADAPTERS.items()
    }


def peft_oracle(base_dir: Path, adapter_dir: Path):
    """transformers' model with the adapter applied by peft (fp32, eval)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter_dir)).eval()
