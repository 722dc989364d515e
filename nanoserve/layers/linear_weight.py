"""One linear layer's weight in the form its kernels multiply (vLLM's `quant_method`), chosen once
at load from the checkpoint's format: a dense bf16/fp32 weight (DenseWeight) or one kept in
kernels/quant.py's blocks (QuantizedWeight: GGUF, GPTQ/AWQ, FP8, compressed-tensors). It owns
its packings, the kernel that multiplies them, their bytes and the layer's entry in the fused
CPU decode step's table (models/cpu_decode.py), so nothing walks a layer asking which of
several optional weights it happens to hold.

The layer's `weight` parameter stays what a checkpoint loads into (its weight_loader shards it);
once a packing or quantized blocks hold the weight on their own, it moves to the meta device
and keeps only its shape and dtype.
"""

from __future__ import annotations

import torch

from nanoserve.kernels import quant
from nanoserve.kernels.gemm import (
    RowTiling,
    gemm_packing,
    onednn_packing,
    quantized_gemm,
    unquantized_gemm,
)
from nanoserve.kernels.quant import QuantWeight

MAX_PARTS = 3  # decode_layers.cpp's kMaxParts: runs of output columns a linear layer may have
LINEAR_ENTRIES = 2 + 3 * MAX_PARTS  # count, (format, weights, n) a part, input order


def _tensor_bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


class DenseWeight:
    """A bf16/fp32 weight: the layer's parameter, and the packings made once at load
    (layers/cpu_prepack.py): our CPU GEMM's (`gemm`, kernels/cpu/gemm*.cpp) or oneDNN's."""

    quantized = False

    def __init__(self) -> None:
        self.gemm: torch.Tensor | None = None
        self.onednn: torch.Tensor | None = None

    def apply(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows: RowTiling | None = None,
    ) -> torch.Tensor:
        """x @ weight.T (+ bias); the kernel is kernels/gemm.py's choice."""
        return unquantized_gemm(x, weight, bias, self.gemm, self.onednn, rows)

    def pack_for_cpu_gemm(self, weight: torch.Tensor) -> bool:
        """Packs `weight` for our CPU GEMM; whether it took it (then the packing is every
        multiplication's operand and the parameter may go to the meta device)."""
        self.gemm = gemm_packing(weight)
        return self.gemm is not None

    def pack_for_onednn(self, weight: torch.Tensor, batch_size_hint: int) -> bool:
        """oneDNN's packing, unless our GEMM multiplies this weight; whether it was made."""
        if self.gemm is not None:
            return False
        self.onednn = onednn_packing(weight, batch_size_hint)
        return self.onednn is not None

    def nbytes(self) -> int:
        """Bytes of the packings (the parameter is counted with the model's parameters)."""
        return _tensor_bytes(self.gemm) + _tensor_bytes(self.onednn)

    def decode_entry(self, weight: torch.Tensor) -> list[int] | None:
        """This weight as decode_layers.cpp reads a linear layer (format -1: bf16 on our GEMM's
        packing); None unless packed bf16 with output columns a multiple of 16."""
        if self.gemm is None or weight.dtype != torch.bfloat16 or weight.shape[0] % 16:
            return None
        return _padded([1, -1, self.gemm.data_ptr(), weight.shape[0]], None)


class QuantizedWeight:
    """A weight in kernels/quant.py's blocks: one QuantWeight, or one per run of output rows for
    a fused layer whose parts come in different block types (Q4_K_M's Q4_K q/k beside a Q6_K v).
    `input_perm`: a GPTQ layer in activation order (models/gptq_awq.py) had its columns sorted by
    group at load, so the GEMM takes its inputs in this order (int64 [k])."""

    quantized = True

    def __init__(self, parts: list[QuantWeight], input_perm: torch.Tensor | None = None) -> None:
        self.parts = parts
        self.input_perm = input_perm

    def apply(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows: RowTiling | None = None,
    ) -> torch.Tensor:
        """x @ W.T (+ bias) through kernels/quant.py (`weight` is the meta placeholder)."""
        xq = x if self.input_perm is None else x.index_select(-1, self.input_perm)
        return quantized_gemm(xq, self.parts, bias, rows)

    def pack_for_cpu_gemm(self, weight: torch.Tensor) -> bool:
        """kernels/quant.py's own CPU packing of every part; whether all took it."""
        for part in self.parts:
            quant.pack_for_cpu(part)
        return all(part.packed is not None for part in self.parts)

    def pack_for_onednn(self, weight: torch.Tensor, batch_size_hint: int) -> bool:
        return False  # multiplied by kernels/quant.py

    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def decode_entry(self, weight: torch.Tensor) -> list[int] | None:
        """The parts as decode_layers.cpp reads them (a GGUF block format each, kernels/quant.py)
        and the input order's address; None when they can't go (not packed, more than MAX_PARTS,
        columns not a multiple of 16, parts not tiling the layer's rows)."""
        n, k = weight.shape
        parts = self.parts
        if len(parts) > MAX_PARTS or any(p.packed is None or p.n % 16 or p.k != k for p in parts):
            return None
        if sum(p.n for p in parts) != n:
            return None
        order = self.input_perm
        if order is not None and (
            order.dtype != torch.int64 or not order.is_contiguous() or order.shape[0] != k
        ):
            return None
        entry = [len(parts)]
        for part in parts:
            entry += [part.kernel_format, part.packed.data_ptr(), part.n]
        return _padded(entry, order)


def _padded(entry: list[int], order: torch.Tensor | None) -> list[int]:
    """`entry` padded to LINEAR_ENTRIES, the last the input order's address (kept alive by the
    weight object) or 0."""
    return (
        entry + [0] * (LINEAR_ENTRIES - 1 - len(entry)) + [0 if order is None else order.data_ptr()]
    )


LinearWeight = DenseWeight | QuantizedWeight
