"""MXFP4 checkpoints (`quant_method: "mxfp4"`): OpenAI's gpt-oss releases hold each MoE layer's
experts as OCP microscaling FP4: `experts.gate_up_proj_blocks` / `down_proj_blocks` (uint8
[experts, outputs, inputs / 32, 16], two E2M1 values a byte, the low nibble first) and
`_scales` (uint8 [experts, outputs, inputs / 32], an E8M0 exponent per 32 inputs, bias 127). The
rest (attention, router, embeddings, LM head: config `modules_to_not_convert`) is bf16.

The experts are dequantized at load into the model's dtype (exact: an E2M1 value times a power
of two is a bf16), then loaded as a bf16 checkpoint's `experts.gate_up_proj` / `down_proj` are:
nanoserve has no FP4 expert kernel yet, so the experts take their bf16 size in memory (gpt-oss-
20b: about 40 GB in all, against 13 GB as the checkpoint holds it)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

MXFP4_METHOD = "mxfp4"
# E2M1: sign, 2 exponent bits, 1 mantissa bit; index = the 4-bit code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
_SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., groups, 16], scales uint8 [..., groups] -> [..., groups * 32] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks [..., groups, 16] and scales [..., groups] do not match: "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., groups, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(table[codes], exponents[..., None].float())
    return values.flatten(-2).to(dtype)


def mxfp4_config(model_dir: Path) -> "Mxfp4Tensors | None":
    """What pairs an MXFP4 checkpoint's tensors, or None when config.json says another method."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    quantization = json.loads(config_file.read_text()).get("quantization_config") or {}
    return Mxfp4Tensors() if quantization.get("quant_method") == MXFP4_METHOD else None


class Mxfp4Tensors:
    """Each `X_blocks` and `X_scales` pair, read in any order (and from any shard), handed on as
    one tensor X: the float weight a bf16 checkpoint holds, [experts, inputs, outputs] as
    transformers lays out gpt-oss's experts."""

    def __init__(self) -> None:
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def owns(name: str) -> bool:
        return name.endswith(_SUFFIXES)

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The whole weight once both halves are in, else None; in bf16, which holds every
        MXFP4 value exactly (the parameter's loader converts it to the model's dtype)."""
        suffix = next(s for s in _SUFFIXES if name.endswith(s))
        base = name[: -len(suffix)]
        parts = self.pending.setdefault(base, {})
        parts[suffix] = tensor
        if len(parts) < 2:
            return None
        del self.pending[base]
        weight = dequantize_mxfp4(parts["_blocks"], parts["_scales"], torch.bfloat16)  # [experts, outputs, inputs]
        return base, weight.transpose(1, 2)

    def finish(self) -> None:
        if self.pending:
            base, parts = next(iter(self.pending.items()))
            missing = "_scales" if "_blocks" in parts else "_blocks"
            raise ValueError(f"MXFP4 checkpoint: {base}{missing} is missing ({len(self.pending)} tensor(s) unpaired)")
