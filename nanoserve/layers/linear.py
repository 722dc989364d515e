"""Linear layers that know how to take their shard of a checkpoint tensor (vLLM's names).

Each parameter owns a ``weight_loader(param, loaded, shard_id=None)``; the loader is handed a
lazy slice object (safetensors ``get_slice``) or a tensor, and reads only this rank's rows or
columns, so a rank holds about 1/N of the weights. A layer built with ``disable_tp=True`` (vLLM's
flag) is whole on the rank that builds it and never all-reduces: a vision tower that runs on
rank 0 only (models/llava.py, models/qwen2_5_vl.py).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from nanoserve.distributed import all_reduce, get_tp_rank, get_tp_world_size
from nanoserve.kernels.gemm import RowTiling
from nanoserve.layers.linear_weight import DenseWeight, LinearWeight


def divide(size: int, tp_size: int, what: str) -> int:
    """Each rank's share of `size` (`what`: "the model's {} attention heads"); a clear error when
    the ranks can't split it evenly. The engine asks before it starts any rank."""
    if size % tp_size:
        raise ValueError(f"tensor parallel size {tp_size} does not divide {what.format(size)}")
    return size // tp_size


def qkv_heads_per_rank(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) on each rank. KV heads are split when there are at least as many
    as ranks, otherwise each is replicated on tp_size / num_kv_heads ranks (GQA)."""
    heads = divide(num_heads, tp_size, "the model's {} attention heads")
    if num_kv_heads >= tp_size:
        return heads, divide(num_kv_heads, tp_size, "the model's {} KV heads")
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor parallel size {tp_size} is not a multiple of the model's {num_kv_heads} "
            "KV heads (needed to replicate them)"
        )
    return heads, 1


def _tp_size(disable_tp: bool) -> int:
    return 1 if disable_tp else get_tp_world_size()


def _read(loaded, index) -> torch.Tensor:
    """`loaded` is a tensor or a safetensors slice; both support basic indexing."""
    return loaded[index] if index is not None else loaded[:]


def load_parameter(param: nn.Parameter, loaded, shard_id=None) -> None:
    """A checkpoint tensor (or safetensors slice) into `param`: this rank's share through the
    parameter's weight_loader, or the whole of it where there is none (norms, ...)."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        param.data.copy_(_read(loaded, None))
    else:
        loader(param, loaded, shard_id)


class _Rows:
    """Rows from `start` on of a checkpoint tensor or slice, indexed like one: a fused
    checkpoint matrix (Phi-3's qkv_proj) read part by part through the parts' loaders."""

    def __init__(self, loaded, start: int):
        self.loaded, self.start = loaded, start

    def __getitem__(self, index: slice):
        return self.loaded[self.start + index.start : self.start + index.stop]


class LinearBase(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        disable_tp: bool = False,
    ):
        super().__init__()
        self.tp_rank = 0 if disable_tp else get_tp_rank()
        self.tp_size = _tp_size(disable_tp)
        self.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        # How the weight is multiplied (layers/linear_weight.py): dense until a quantized
        # checkpoint's loader (models/quant_staging.py, models/gguf/weights.py, models/fp8.py)
        # gives the layer its blocks; `weight` is then on the meta device.
        self.weight_form: LinearWeight = DenseWeight()
        # --enable-lora: this layer's adapter slots (lora/layers.py), whose delta matmul adds.
        self.lora = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        param.data.copy_(_read(loaded, None))

    def matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None, rows: RowTiling | None = None
    ) -> torch.Tensor:
        out = self.weight_form.apply(x, self.weight, bias, rows)
        # (A row-parallel layer's delta is partial too: B (A_rank x_rank) sums over the ranks.)
        return out if self.lora is None else self.lora.add_to(x, out, rows)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        disable_tp: bool = False,
    ):
        super().__init__(
            input_size,
            divide(output_size, _tp_size(disable_tp), "a layer's {} output features"),
            bias,
            dtype,
            disable_tp,
        )

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        rows = param.shape[0]
        param.data.copy_(_read(loaded, slice(self.tp_rank * rows, (self.tp_rank + 1) * rows)))

    def forward(self, x: torch.Tensor, rows: RowTiling | None = None) -> torch.Tensor:
        return self.matmul(x, self.bias, rows)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one matrix (gate + up)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        disable_tp: bool = False,
    ):
        self.output_sizes = output_sizes
        for size in output_sizes:  # each part splits on its own (the MLP's gate and up)
            divide(size, _tp_size(disable_tp), "the model's {} MLP features")
        super().__init__(input_size, sum(output_sizes), bias, dtype, disable_tp)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if shard_id == "fused":  # all parts in one checkpoint tensor, in order
            for part, start in enumerate(itertools.accumulate([0, *self.output_sizes[:-1]])):
                self.weight_loader(param, _Rows(loaded, start), part)
            return
        shard_size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        start = self.tp_rank * shard_size
        param.data[offset : offset + shard_size].copy_(
            _read(loaded, slice(start, start + shard_size))
        )


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix. Query heads are split across ranks; KV heads are
    split when there are at least as many as ranks, otherwise each is replicated on
    tp_size / num_kv_heads ranks (GQA with few KV heads)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
        disable_tp: bool = False,
    ):
        tp_size = _tp_size(disable_tp)
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = qkv_heads_per_rank(num_heads, num_kv_heads, tp_size)
        self.total_num_kv_heads = num_kv_heads
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias, dtype, disable_tp)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "qkv":  # q, k and v in one checkpoint tensor (all ranks' heads)
            total_q, total_kv = q_size * self.tp_size, self.total_num_kv_heads * self.head_dim
            for part, start in (("q", 0), ("k", total_q), ("v", total_q + total_kv)):
                self.weight_loader(param, _Rows(loaded, start), part)
            return
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        else:
            kv_rank = self.tp_rank // max(1, self.tp_size // self.total_num_kv_heads)
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, kv_rank * kv_size
        param.data[offset : offset + size].copy_(_read(loaded, slice(start, start + size)))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed with an all-reduce."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        disable_tp: bool = False,
    ):
        super().__init__(
            divide(input_size, _tp_size(disable_tp), "a layer's {} input features"),
            output_size,
            bias,
            dtype,
            disable_tp,
        )

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if param.dim() == 1:  # bias is added once, after the reduction
            param.data.copy_(_read(loaded, None))
            return
        cols = param.shape[1]
        start = self.tp_rank * cols
        param.data.copy_(_read(loaded, (slice(None), slice(start, start + cols))))

    def forward(self, x: torch.Tensor, rows: RowTiling | None = None) -> torch.Tensor:
        out = self.matmul(x, None, rows)
        if self.tp_size > 1:  # (a layer built with disable_tp holds whole sums)
            all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
