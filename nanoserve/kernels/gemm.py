"""The linear layers' unquantized GEMM (vLLM's name: ``unquantized_gemm``): which kernel multiplies
the activations by a weight is chosen here, not in the layers. The layers hold the weight and the
packings made of it at load (layers/cpu_prepack.py); the first one that takes the call wins:

- ``gemm_weight`` (CPU, bf16): our GEMM (kernels/cpu/gemm*.cpp), every row in one call, each
  row's bits independent of the number of rows;
- ``packed_weight`` (CPU): oneDNN on its blocked layout; prompt rows then go in tiles of a fixed
  row count (``RowTiling``), since oneDNN's summation order depends on M;
- otherwise ``F.linear`` (cuBLAS on CUDA).

The packings are made here too (``gemm_packing``, ``onednn_packing``), each None where its kernel
can't take the weight: the layers keep what they are given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve import envs
from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.quant import QuantWeight, quant_gemm

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RowTiling:
    """Rows [0, num_free_rows) are multiplied in one GEMM; the rest, a whole number of tiles,
    tile by tile (see AttentionMetadata.prefill_row_tile)."""

    num_free_rows: int
    tile: int


def onednn_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T (+ bias) on oneDNN's prepacked weight (the private, stable since torch 2.1,
    op that inductor's CPU freezing uses)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def gemm_packing(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in our GEMM's layout (kernels/cpu/gemm*.cpp, one packing for every ISA level):
    bf16 on a CPU, K a multiple of 32, the kernels loaded, and not NANOSERVE_CPU_GEMM=onednn."""
    if envs.cpu_gemm() == "onednn":
        return None
    return cpu_ops.pack_gemm_weight(weight)


def onednn_available() -> bool:
    """oneDNN's prepacked bf16 linear ops are in this torch build, run on this CPU (oneDNN's bf16
    wants AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU has neither) and
    NANOSERVE_CPU_PREPACK allows them."""
    if not envs.cpu_prepack():
        return False
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (
        mkldnn is not None
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
        and torch.backends.mkldnn.is_available()
        and bool(mkldnn._is_mkldnn_bf16_supported())
    )


def onednn_packing(weight: torch.Tensor, batch_size_hint: int = 64) -> torch.Tensor | None:
    """A bf16 CPU weight [N, K] in oneDNN's blocked layout, for onednn_linear; None when oneDNN
    can't take it (another device or dtype, a shape or build it refuses)."""
    if not onednn_available() or weight.dim() != 2:
        return None
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)
        onednn_linear(torch.zeros(1, weight.shape[1], dtype=weight.dtype), packed, None)  # a probe
    except RuntimeError as error:
        logger.info("not prepacking a [%d, %d] weight for oneDNN: %s", *weight.shape, error)
        return None
    return packed


def _one_gemm(x, weight, bias, packed_weight) -> torch.Tensor:
    if packed_weight is not None:
        return onednn_linear(x, packed_weight, bias)
    return F.linear(x, weight, bias)


def gemm_on_packing(
    x: torch.Tensor, gemm_weight: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """x in a form cpu_ops.gemm takes (2-D, contiguous rows, bf16: the packed weight's dtype, which
    F.linear would have demanded of x too), multiplied, and given back x's shape and dtype."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    out = cpu_ops.gemm(rows, gemm_weight, None if bias is None else bias.to(torch.bfloat16), n)
    if out is None:
        raise RuntimeError(
            f"the packed bf16 GEMM refused x {list(x.shape)} {x.dtype} for a weight of {n} rows"
        )
    return out.reshape(*x.shape[:-1], n).to(x.dtype)


def unquantized_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gemm_weight: torch.Tensor | None = None,
    packed_weight: torch.Tensor | None = None,
    rows: RowTiling | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) for a weight [N, K] and its packings (None: not packed)."""
    if gemm_weight is not None:
        out = cpu_ops.gemm(x, gemm_weight, bias, weight.shape[0])
        if out is not None:
            return out
        if weight.is_meta:  # the packing is the weight's only copy (layers/cpu_prepack.py)
            return gemm_on_packing(x, gemm_weight, bias, weight.shape[0])
    if rows is None or rows.tile == 0 or x.shape[0] <= rows.num_free_rows:
        return _one_gemm(x, weight, bias, packed_weight)
    # Rows past num_free_rows come in whole tiles; each tile is its own GEMM of exactly `tile`
    # rows, written in place, so a row's result never depends on its neighbours.
    out = x.new_empty((x.shape[0], weight.shape[0]))
    free = rows.num_free_rows
    if free:
        out[:free] = _one_gemm(x[:free], weight, bias, packed_weight)
    weight_t = weight.t()
    for start in range(free, x.shape[0], rows.tile):
        end = start + rows.tile
        if bias is None:
            torch.mm(x[start:end], weight_t, out=out[start:end])
        else:
            torch.addmm(bias, x[start:end], weight_t, out=out[start:end])
    return out


def _quant_parts(
    x: torch.Tensor, parts: list[QuantWeight], bias: torch.Tensor | None
) -> torch.Tensor:
    if len(parts) == 1:
        return quant_gemm(x, parts[0], bias)
    outs, start = [], 0
    for part in parts:
        outs.append(quant_gemm(x, part, None if bias is None else bias[start : start + part.n]))
        start += part.n
    return torch.cat(outs, dim=-1)


def quantized_gemm(
    x: torch.Tensor,
    parts: list[QuantWeight],
    bias: torch.Tensor | None = None,
    rows: RowTiling | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) for a weight kept in GGUF blocks, as one or several parts stacked
    along the output (a QKV whose parts have different formats). The CPU kernels (a part's
    `packed` set) sum each output in one order whatever M; the torch reference may not, and
    then multiplies prompt rows tile by tile, as unquantized_gemm does for oneDNN."""
    if (
        all(part.packed is not None for part in parts)
        or rows is None
        or rows.tile == 0
        or x.shape[0] <= rows.num_free_rows
    ):
        return _quant_parts(x, parts, bias)
    out = x.new_empty((x.shape[0], sum(part.n for part in parts)))
    free = rows.num_free_rows
    if free:
        out[:free] = _quant_parts(x[:free], parts, bias)
    for start in range(free, x.shape[0], rows.tile):
        out[start : start + rows.tile] = _quant_parts(x[start : start + rows.tile], parts, bias)
    return out
