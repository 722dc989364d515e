"""A MoE layer's experts' weights in the form their kernels multiply (as layers/linear_weight.py
for a linear layer), one object per expert set (layers/fused_moe.FusedMoE): each of the two
stacked matrices, gate/up ("w13") and down ("w2"), is the float parameter as loaded, or our CPU
GEMM's stacked bf16 packing (kernels/fused_moe.pack_expert_weights), or one QuantWeight per
expert (a quantized checkpoint's, layers/quant_experts.py). It owns those operands, their bytes
and the fused CPU decode step's expert table, so nothing asks the layer which of them it holds.
"""

from __future__ import annotations

import torch

from nanoserve.kernels import quant
from nanoserve.kernels.fused_moe import cpu_expert_table, pack_expert_weights

MATRICES = ("w13", "w2")

# What a matrix is multiplied from besides its parameter: None (the parameter itself), a
# stacked bf16 packing [experts, ...], or a QuantWeight per local expert.
Operand = torch.Tensor | list[quant.QuantWeight] | None


class ExpertWeights:
    def __init__(self) -> None:
        self._operands: dict[str, Operand] = dict.fromkeys(MATRICES)
        self._quantized: dict[str, list[quant.QuantWeight]] = {}
        self._packings: dict[str, torch.Tensor] = {}  # float matrices packed for our CPU GEMM
        # kernels/fused_moe.cpu_expert_table of the operands, once packed for the CPU (None:
        # the fused decode step and the one-call MoE path can't take them).
        self.cpu_table: torch.Tensor | None = None

    def set_quantized(self, matrix: str, weights: list[quant.QuantWeight]) -> None:
        """The matrix is kept as these QuantWeights (its parameter no longer holds it)."""
        self._quantized[matrix] = weights
        self._operands[matrix] = weights

    def quantized(self, matrix: str) -> list[quant.QuantWeight] | None:
        """The matrix's QuantWeight per local expert; None where it is float."""
        return self._quantized.get(matrix)

    def quantized_matrices(self) -> set[str]:
        return set(self._quantized)

    def pack_for_cpu(self, matrix: str, param: torch.Tensor) -> bool:
        """Packs the matrix for the CPU kernels: a quantized one's QuantWeights in the quantized
        kernel's packing, a float one (bf16) in our GEMM's, from `param`. Whether the matrix is
        now multiplied from a packing (a float one's parameter then holds nothing needed)."""
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
        return quantized + sum(p.numel() * p.element_size() for p in self._packings.values())
