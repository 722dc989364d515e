"""MXFP4 checkpoints as OpenAI releases gpt-oss: a float gpt-oss checkpoint's stacked experts
(`experts.gate_up_proj` [experts, hidden, 2 * inter], `experts.down_proj` [experts, inter,
hidden]) rounded to E2M1 values with a power-of-two scale per 32 inputs and stored as `_blocks` /
`_scales` ([experts, outputs, inputs / 32, 16] / [..., inputs / 32], the outputs first); the rest
as it is. Used by tests/models/test_mxfp4.py and benchmarks/moe/bench_gpt_oss.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


# Midpoints between the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: the nearest one's code.
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., k] float -> (blocks uint8 [..., k / 32, 16], scales uint8 [..., k / 32]): a power-of-two
    scale per 32 values (the smallest that holds the block's largest as at most 6), each value the
    nearest E2M1 (sign in bit 3), the low nibble first."""
    if weight.dim() == 3:  # one expert at a time: bounds the temporaries of a large checkpoint
        parts = [quantize_mxfp4(expert) for expert in weight]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    groups = weight.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (
        torch.bucketize(scaled.abs().contiguous(), _MIDPOINTS).to(torch.uint8)
        | (scaled < 0).to(torch.uint8) << 3
    )
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def mxfp4_checkpoint(
    float_dir: Path, out_dir: Path, meaning: bool = True
) -> dict[str, torch.Tensor]:
    """out_dir: float_dir's checkpoint with its experts in MXFP4; returns the float tensors the
    MXFP4 ones mean, in the float checkpoint's layout (transformers' own dequantization), unless
    not `meaning`."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(float_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    quantized, meant = {}, {}
    for name, tensor in load_file(float_dir / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # [experts, outputs, inputs]
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            if meaning:
                meant[name] = convert_moe_packed_tensors(
                    blocks, scales, dtype=torch.float32
                ).contiguous()
        else:
            quantized[name] = tensor
    save_file(quantized, out_dir / "model.safetensors")
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (out_dir / "config.json").write_text(json.dumps(config))
    return meant
