"""MXFP4 checkpoints (`quant_method: "mxfp4"`): OpenAI's gpt-oss releases hold each MoE layer's
experts as OCP microscaling FP4: `experts.gate_up_proj_blocks` / `down_proj_blocks` (uint8
[experts, outputs, inputs / 32, 16], two E2M1 values a byte, the low nibble first) and
`_scales` (uint8 [experts, outputs, inputs / 32], an E8M0 exponent per 32 inputs, bias 127). The
rest (attention, router, embeddings, LM head: config `modules_to_not_convert`) is bf16.

On a CPU the experts stay quantized, in the kernels' own MXFP4 format (kernels/quant.py): the
4-bit codes as they are, packed as nibbles, and a scale 2^(exponent - 128) per block; an E2M1
value times 2 is an integer in -12..12, which a table gives the kernel, so each block's product
with the activations (quantized per row to int8, as llama.cpp runs MXFP4 on CPUs) is an exact
integer dot product. 0.625 bytes a weight as packed (gpt-oss-20b's experts: ~12 GB, against ~38
GB in bf16). Elsewhere (CUDA) they are dequantized at load into the model's dtype (exact).
"""

from __future__ import annotations

from pathlib import Path

import torch

from nanoserve.layers.quant_experts import StackedQuantExperts
from nanoserve.models.compressed_tensors import checkpoint_quant_method

MXFP4_METHOD = "mxfp4"
# E2M1: sign, 2 exponent bits, 1 mantissa bit; index = the 4-bit code.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
SCALE_BIAS = 127
_SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """blocks uint8 [..., groups, 16], scales uint8 [..., groups] -> [..., groups * 32] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks [..., groups, 16] and scales [..., groups] do not match: "
            f"{tuple(blocks.shape)} and {tuple(scales.shape)}"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(
        table[_codes(blocks)].unflatten(-1, (-1, 32)), exponents[..., None].float()
    )
    return values.flatten(-2).to(dtype)


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., groups, 16] -> the 4-bit codes, int64 [..., groups * 32] (low nibble first)."""
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-3).long()


def mxfp4_config(model_dir: Path) -> Mxfp4Tensors | None:
    """What pairs an MXFP4 checkpoint's tensors, or None when config.json says another method."""
    return Mxfp4Tensors() if checkpoint_quant_method(model_dir) == MXFP4_METHOD else None


class Mxfp4Weight(StackedQuantExperts):
    """One stacked MXFP4 tensor: blocks uint8 [experts, outputs, groups, 16], scales uint8
    [experts, outputs, groups]. layers/fused_moe.FusedMoE's loader reads it through
    `kernel_components` (kept quantized) or `dequantized`."""

    qtype = "mxfp4"

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
            raise ValueError(
                f"MXFP4 blocks [experts, outputs, groups, 16] and scales [experts, outputs, groups] "
                f"do not match: {tuple(blocks.shape)} and {tuple(scales.shape)}"
            )
        self.blocks, self.scales = blocks, scales

    def rows(self, index) -> Mxfp4Weight:
        """The given output rows of every expert (an index along dim 1)."""
        return Mxfp4Weight(self.blocks[:, index], self.scales[:, index])

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """[experts, outputs, inputs] in `dtype`."""
        return dequantize_mxfp4(self.blocks, self.scales, dtype)

    def kernel_components(self, expert: int) -> tuple[str, dict[str, torch.Tensor]]:
        """One expert's matrix as ("mxfp4", {"u": the codes, uint8 [outputs, inputs], "scale":
        fp32 [outputs, inputs / 32]}): weight = scale * 2 * E2M1, scale 2^(exponent - 128) (the
        kernel's integer is 2 * E2M1). Expert by expert, so a layer's temporaries stay one
        expert's size."""
        scales = self.scales[expert]
        scale = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - SCALE_BIAS - 1)
        return "mxfp4", {"u": _codes(self.blocks[expert]).to(torch.uint8), "scale": scale}


class Mxfp4Tensors:
    """Each `X_blocks` and `X_scales` pair, read in any order (and from any shard), handed on as
    one Mxfp4Weight named X (the name of a bf16 checkpoint's tensor)."""

    def __init__(self) -> None:
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def owns(name: str) -> bool:
        return name.endswith(_SUFFIXES)

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, Mxfp4Weight] | None:
        """The whole weight once both halves are in, else None."""
        suffix = next(s for s in _SUFFIXES if name.endswith(s))
        base = name[: -len(suffix)]
        parts = self.pending.setdefault(base, {})
        parts[suffix] = tensor
        if len(parts) < 2:
            return None
        del self.pending[base]
        return base, Mxfp4Weight(parts["_blocks"], parts["_scales"])

    def finish(self) -> None:
        if self.pending:
            base, parts = next(iter(self.pending.items()))
            missing = "_scales" if "_blocks" in parts else "_blocks"
            raise ValueError(
                f"MXFP4 checkpoint: {base}{missing} is missing ({len(self.pending)} tensor(s) unpaired)"
            )
