"""A quantized checkpoint's MoE experts kept in a kernel format (kernels/quant.py) on the CPU:
each expert's gate/up matrix and down matrix becomes one QuantWeight, which the grouped MoE path
multiplies with quant_gemm (kernels/fused_moe.py). layers/fused_moe.FusedMoE stages the parts
here as its loaders read them (this rank's rows of gate and up; of down, whole blocks of 32 of
its columns), then `finish` makes the weights. Each of the two matrices is quantized for every
expert or for none (the other may stay float: a down matrix whose shard is not whole blocks)."""
from __future__ import annotations

import torch

from nanoserve.kernels import quant

BLOCK = 32  # the kernel formats' block of inputs
MATRICES = {"w13": (0, 1), "w2": (None,)}  # each matrix's parts: gate 0 and up 1; down None


class QuantExpertStaging:
    def __init__(self, num_local_experts: int) -> None:
        self.num_local_experts = num_local_experts
        # matrix -> per local expert -> part -> (qtype, this rank's arrays)
        self.parts: dict[str, list[dict]] = {}

    def add(self, matrix: str, local: int, part: int | None, qtype: str, arrays: dict[str, torch.Tensor]) -> None:
        experts = self.parts.setdefault(matrix, [{} for _ in range(self.num_local_experts)])
        experts[local][part] = (qtype, {key: array.contiguous() for key, array in arrays.items()})

    def finish(self, matrix: str, k: int) -> list[quant.QuantWeight] | None:
        """The matrix's QuantWeight per local expert (gate rows, then up rows), or None when no
        part of it was staged; ValueError for a checkpoint that quantizes some of it only."""
        experts = self.parts.pop(matrix, None)
        if experts is None:
            return None
        parts = MATRICES[matrix]
        weights = []
        for expert in experts:
            if set(expert) != set(parts):
                raise ValueError("a quantized MoE checkpoint must hold every expert's gate, up and down "
                                 "matrices in one kind (quantized or float) each")
            qtypes = {expert[p][0] for p in parts}
            if len(qtypes) != 1:
                raise ValueError(f"an expert's gate and up matrices are in different formats: {sorted(qtypes)}")
            arrays = {key: torch.cat([expert[p][1][key] for p in parts]) for key in expert[parts[0]][1]}
            components = quant.QuantComponents(arrays["u"], arrays["scale"], arrays.get("mins"))
            weights.append(quant.QuantWeight(qtypes.pop(), arrays["u"].shape[0], k, None, components=components))
        return weights


def shard_columns(arrays: dict[str, torch.Tensor], start: int, size: int) -> dict[str, torch.Tensor]:
    """Columns start..start + size (whole blocks of 32) of components: u's, and the per-block
    arrays' blocks."""
    blocks = slice(start // BLOCK, (start + size) // BLOCK)
    return {key: a[:, start : start + size] if key == "u" else a[:, blocks] for key, a in arrays.items()}
