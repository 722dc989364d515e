"""A quantized checkpoint's MoE experts kept in a kernel format (kernels/quant.py): on the CPU
each expert's gate/up matrix and down matrix becomes one QuantWeight, which the grouped MoE path
multiplies with quant_gemm (kernels/fused_moe.py); on CUDA every expert's matrix goes into one
ExpertBlocks on the device, which the fused-MoE Triton kernel dequantizes in registers
(kernels/fused_moe_quant.quantized_expert_form decides which, by device).
layers/fused_moe.FusedMoE stages the parts here as its loaders read them (this rank's rows of
gate and up; of down, whole blocks of its columns: 32, or a GGUF type's block), each expert's
weight made and packed (or put in its blocks) once its parts are in; `finish` hands them over. Each of the two matrices is quantized for every expert or for none (the
other may stay float: a down matrix whose shard is not whole blocks)."""

from __future__ import annotations

import torch

from nanoserve.kernels import quant
from nanoserve.kernels.fused_moe_quant import ExpertBlocks, quantized_expert_form

BLOCK = 32  # the kernel formats' block of inputs
MATRICES = {"w13": (0, 1), "w2": (None,)}  # each matrix's parts: gate 0 and up 1; down None


class StackedQuantExperts:
    """A checkpoint's tensor of every expert's matrix in a kernel format (models/mxfp4.py's
    Mxfp4Weight), which FusedMoE's loader takes expert by expert; known by its type, so a loader
    never asks a tensor what it can do."""

    qtype: str  # the kernel format kernel_components gives

    def kernel_components(self, expert: int) -> tuple[str, dict[str, torch.Tensor]]:
        """One expert's matrix as (a kernels/quant.py qtype, its arrays)."""
        raise NotImplementedError


class QuantExpertStaging:
    """Each expert's matrix becomes its QuantWeight, packed for the CPU kernel (or copied into
    its matrix's ExpertBlocks on the device), as soon as its parts are in: a checkpoint's experts
    are never all held unpacked at once (their components take a byte a weight, twice an MXFP4 or
    4-bit packing), nor, for a device, all on the host."""

    def __init__(
        self, num_local_experts: int, inputs: dict[str, int], device: torch.device
    ) -> None:
        self.num_local_experts = num_local_experts
        self.inputs = inputs  # matrix -> k (its inputs on this rank)
        self.device = device  # where the experts are held
        # matrix -> per local expert -> part -> (qtype, this rank's arrays), until complete
        self.parts: dict[str, list[dict]] = {}
        # matrix -> per local expert: its QuantWeight (CPU), True once in `blocks`, or None
        self.weights: dict[str, list[quant.QuantWeight | bool | None]] = {}
        self.blocks: dict[str, ExpertBlocks] = {}  # matrix -> its experts on the device

    def add(
        self, matrix: str, local: int, part: int | None, qtype: str, arrays: dict[str, torch.Tensor]
    ) -> None:
        """`arrays`: kernel components ("u", "scale", optional "mins") or a GGUF file's rows ("raw")."""
        experts = self.parts.setdefault(matrix, [{} for _ in range(self.num_local_experts)])
        experts[local][part] = (qtype, {key: array.contiguous() for key, array in arrays.items()})
        if set(experts[local]) != set(MATRICES[matrix]):
            return
        expert, experts[local] = experts[local], {}
        qtypes = {expert[p][0] for p in MATRICES[matrix]}
        if len(qtypes) != 1:
            raise ValueError(
                f"an expert's gate and up matrices are in different formats: {sorted(qtypes)}"
            )
        ordered = [expert[p][1] for p in MATRICES[matrix]]
        if {frozenset(a) for a in ordered} != {frozenset(ordered[0])}:
            raise ValueError("an expert's gate and up matrices are stored in different kinds")
        arrays = {key: torch.cat([a[key] for a in ordered]) for key in ordered[0]}
        qtype, k = qtypes.pop(), self.inputs[matrix]
        if "raw" in arrays:
            weight = quant.QuantWeight(qtype, arrays["raw"].shape[0], k, arrays["raw"])
        else:
            components = quant.QuantComponents(arrays["u"], arrays["scale"], arrays.get("mins"))
            weight = quant.QuantWeight(qtype, arrays["u"].shape[0], k, None, components=components)
        held = self.weights.setdefault(matrix, [None] * self.num_local_experts)
        if quantized_expert_form(self.device, qtype) == "triton":
            if matrix not in self.blocks:
                self.blocks[matrix] = ExpertBlocks.empty(
                    self.num_local_experts, weight, self.device
                )
            self.blocks[matrix].put(local, weight)
            held[local] = True
            return
        quant.pack_for_cpu(weight)
        held[local] = weight

    def finish(self, matrix: str) -> list[quant.QuantWeight] | ExpertBlocks | None:
        """The matrix's QuantWeight per local expert (gate rows, then up rows), or its
        ExpertBlocks on the device, or None when no part of it was staged; ValueError for a
        checkpoint that quantizes some of it only."""
        weights = self.weights.pop(matrix, None)
        pending = self.parts.pop(matrix, None)
        blocks = self.blocks.pop(matrix, None)
        if weights is None and pending is None:
            return None
        if weights is None or any(w is None for w in weights) or any(pending or ()):
            raise ValueError(
                "a quantized MoE checkpoint must hold every expert's gate, up and down "
                "matrices in one kind (quantized or float) each"
            )
        if blocks is not None:
            if not all(w is True for w in weights):
                raise ValueError("a MoE layer's experts came in formats held in different forms")
            return blocks
        return weights


def shard_columns(
    arrays: dict[str, torch.Tensor], start: int, size: int, qtype: str
) -> dict[str, torch.Tensor]:
    """Columns start..start + size of components (whole blocks of 32: u's, and the per-block
    arrays' blocks) or of a GGUF file's rows ("raw": whole blocks of the type's size)."""
    if "raw" in arrays:
        block, nbytes = quant.GGUF_QTYPES[qtype]
        if start % block or size % block:
            raise ValueError(
                f"{qtype.upper()} rows split at {start}..{start + size}: not whole blocks of {block}"
            )
        return {"raw": arrays["raw"][:, start // block * nbytes : (start + size) // block * nbytes]}
    blocks = slice(start // BLOCK, (start + size) // BLOCK)
    return {
        key: a[:, start : start + size] if key == "u" else a[:, blocks] for key, a in arrays.items()
    }
