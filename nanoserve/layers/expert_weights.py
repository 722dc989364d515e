"""A MoE layer's experts' weights in the form their kernels multiply (as layers/linear_weight.py
for a linear layer), one object per expert set (layers/fused_moe.FusedMoE): each of the two
stacked matrices, gate/up ("w13") and down ("w2"), is the float parameter as loaded, or our CPU
GEMM's stacked bf16 packing (kernels/fused_moe.pack_expert_weights), or one QuantWeight per
expert (a quantized checkpoint's on the CPU, layers/quant_experts.py), or every expert's blocks
on the device (a quantized checkpoint's on CUDA: kernels/fused_moe_quant.ExpertBlocks, which the
fused-MoE Triton kernel dequantizes in registers). It owns those operands, their bytes
and the fused CPU decode step's expert table, so nothing asks the layer which of them it holds.
"""

from __future__ import annotations

import torch

from nanoserve.kernels import quant
from nanoserve.kernels.fused_moe import cpu_expert_table, pack_expert_weights
from nanoserve.kernels.fused_moe_quant import ExpertBlocks

MATRICES = ("w13", "w2")

# What a matrix is multiplied from besides its parameter: None (the parameter itself), a
# stacked bf16 packing [experts, ...], a QuantWeight per local expert, or an ExpertBlocks.
Operand = torch.Tensor | list[quant.QuantWeight] | ExpertBlocks | None


class ExpertWeights:
    def __init__(self) -> None:
        self._operands: dict[str, Operand] = dict.fromkeys(MATRICES)
        self._quantized: dict[str, list[quant.QuantWeight]] = {}
        self._blocks: dict[str, ExpertBlocks] = {}  # quantized, held for the Triton kernel
        self._packings: dict[str, torch.Tensor] = {}  # float matrices packed for our CPU GEMM
        # kernels/fused_moe.cpu_expert_table of the operands, once packed for the CPU (None:
        # the fused decode step and the one-call MoE path can't take them).
        self.cpu_table: torch.Tensor | None = None

    def set_quantized(self, matrix: str, weights: list[quant.QuantWeight] | ExpertBlocks) -> None:
        """The matrix is kept as these QuantWeights, or these blocks (its parameter no longer
        holds it)."""
        if isinstance(weights, ExpertBlocks):
            self._blocks[matrix] = weights
        else:
            self._quantized[matrix] = weights
        self._operands[matrix] = weights

    def held_form(self, matrix: str) -> str:
        """What holds the matrix: "float" (its parameter), "bf16 packing" (our CPU GEMM's),
        "quantized" (a QuantWeight per expert, for the CPU kernels) or "blocks" (ExpertBlocks,
        for the Triton kernel)."""
        if matrix in self._blocks:
            return "blocks"
        if matrix in self._quantized:
            return "quantized"
        return "bf16 packing" if matrix in self._packings else "float"

    def quantized(self, matrix: str) -> list[quant.QuantWeight] | None:
        """The matrix's QuantWeight per local expert; None where it is float."""
        return self._quantized.get(matrix)

    def quantized_matrices(self) -> set[str]:
        return set(self._quantized) | set(self._blocks)

    def pack_for_cpu(self, matrix: str, param: torch.Tensor) -> bool:
        """Packs the matrix for the CPU kernels: a quantized one's QuantWeights in the quantized
        kernel's packing, a float one (bf16) in our GEMM's, from `param`. Whether the matrix is
        now multiplied from a packing (a float one's parameter then holds nothing needed).
        Blocks held for the Triton kernel stay as they are."""
        if matrix in self._blocks:
            return True
        weights = self._quantized.get(matrix)
        if weights is not None:
            for weight in weights:
                quant.pack_for_cpu(weight)
            return True
        packing = pack_expert_weights(param)
        if packing is None:
            return False
        self._packings[matrix] = self._operands[matrix] = packing
        return True

    def build_cpu_table(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """The fused CPU steps' table over the packed operands (after pack_for_cpu)."""
        operands = self.operands()
        packed = operands if any(o is not None for o in operands) else None
        self.cpu_table = cpu_expert_table(w13, w2, packed)

    def operands(self) -> tuple[Operand, Operand]:
        """(w13's, w2's), as kernels/fused_moe.fused_moe's `packed` takes them."""
        return self._operands["w13"], self._operands["w2"]

    def nbytes(self) -> int:
        """Bytes held beside the layer's (non-meta) parameters: quantized blocks and packings."""
        quantized = sum(w.nbytes for weights in self._quantized.values() for w in weights)
        quantized += sum(blocks.nbytes for blocks in self._blocks.values())
        return quantized + sum(p.numel() * p.element_size() for p in self._packings.values())
