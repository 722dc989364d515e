"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.distributed import all_reduce, gather_to_first, get_tp_rank, get_tp_world_size
from nanoserve.kernels.quant import lookup_rows
from nanoserve.layers.linear_weight import DenseWeight, LinearWeight


class FileRows:
    """An embedding table as a GGUF file stores it (uint8 [rows, row bytes], this rank's
    vocabulary rows): on a CPU mapped from the file, on CUDA its blocks copied to the device. A
    lookup reads and dequantizes only the rows it asks for (kernels/quant.lookup_rows), so the
    table takes no memory of its own on a CPU (a 128k-token vocabulary in bf16 is 525 MB for
    Llama 3.2 1B, where its Q6_K rows in the file are 215 MB, paged in only as tokens use them)
    and its file's bytes on CUDA. `qtype`: a kernels/quant.py block type, or None for rows of
    `file_dtype` (F32, F16, BF16)."""

    def __init__(
        self, data: torch.Tensor, qtype: str | None, file_dtype: torch.dtype | None, k: int
    ):
        self.data, self.qtype, self.file_dtype, self.k = data, qtype, file_dtype, k

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[len(ids), k] in dtype: the same bits as dequantizing the whole table to float32 and
        rounding it to dtype."""
        if self.qtype is None:
            rows = self.data[ids.reshape(-1)]
            return rows.view(self.file_dtype).to(dtype).reshape(*ids.shape, self.k)
        return lookup_rows(self.data, self.qtype, self.k, ids, dtype)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_world_size()
        self.vocab_size = vocab_size
        self.shard_size = (vocab_size + self.tp_size - 1) // self.tp_size
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, vocab_size)
        # Empty: a loader writes every row this rank holds (pages never written take no memory);
        # the last rank's padding rows beyond the vocabulary are zeros.
        self.weight = nn.Parameter(
            torch.empty(self.shard_size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.weight.data[self.vocab_end - self.vocab_start :].zero_()
        self.weight.weight_loader = self.weight_loader
        # A GGUF model's table read from the file on lookup (models/gguf/weights.py); `weight`
        # then lives on the meta device.
        self.file_rows: FileRows | None = None

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_end])

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.file_rows is not None:
            return self.file_rows.lookup(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(token_ids)
        in_shard = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
        local_ids = torch.where(in_shard, token_ids - self.vocab_start, 0)
        out = self._rows(local_ids) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the last token of each sequence; shards gathered to rank 0 for sampling."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, bias: bool = False):
        super().__init__(vocab_size, hidden_size, dtype)
        if bias:
            raise ValueError("LM head bias is not supported")
        # How the head's weight is multiplied (layers/linear_weight.py): a GGUF model's head keeps
        # its quantization blocks (this rank's vocabulary rows; the tied embedding's, Q8_0 in the
        # default model), one QuantWeight: one tensor, one type.
        self.weight_form: LinearWeight = DenseWeight()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.weight_form.apply(hidden, self.weight, None)
        if logits.shape[-1] < self.shard_size:  # the last rank's padding rows: zero logits
            logits = F.pad(logits, (0, self.shard_size - logits.shape[-1]))
        if self.tp_size == 1:
            return logits
        gathered = gather_to_first(logits.contiguous(), dim=-1)
        return None if gathered is None else gathered[:, : self.vocab_size]
