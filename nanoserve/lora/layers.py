"""One linear layer's LoRA slots, and the step's rows → slot map that its forward reads.

A layer holds `num_slots` adapters at once (--max-loras), each padded to `rank` (--max-lora-rank),
for each of its parts (the checkpoint projections fused into it: q, k, v of qkv_proj; gate and up
of gate_up_proj; a plain layer has one). All of them sit side by side in two matrices:
A [width, in] (slot s of part p in rows (p * num_slots + s) * rank, unused rows zero) and
B [out, width] (the same columns; a part's B fills its own output rows only, already scaled).
A step with LoRA rows then costs two GEMMs per layer whatever the mix of adapters:

    shrink = x @ A.T  ->  zero each row's columns but its own slot's  ->  out += shrink @ B.T

Both go through kernels/gemm.py's unquantized_gemm with the layer's row tiling, on our CPU GEMM
where it takes the shape, so a row's delta depends on that row alone (batch invariance), and a
row of the base model gets exactly 0 added. A step without LoRA rows skips all of it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from nanoserve.kernels.gemm import RowTiling, gemm_packing, unquantized_gemm

_GEMM_K = 32  # the LoRA width is padded to what our CPU GEMM takes as K (cpu_ops.GEMM_TILE_K)


class LoRABatch:
    """The step's row → slot map (-1: the base model) and the 0/1 column masks built from it."""

    def __init__(self, row_slots: torch.Tensor, num_slots: int, rank: int):
        self.row_slots = row_slots
        self.num_slots, self.rank = num_slots, rank
        self._masks: dict[tuple, torch.Tensor] = {}

    def mask(self, num_parts: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        key = (num_parts, width, dtype)
        mask = self._masks.get(key)
        if mask is None:
            slots = torch.arange(self.num_slots, device=self.row_slots.device)
            onehot = (self.row_slots[:, None] == slots[None, :]).to(dtype)
            mask = onehot.repeat_interleave(self.rank, dim=1).repeat(1, num_parts)
            mask = F.pad(mask, (0, width - mask.shape[1])).contiguous()
            self._masks[key] = mask
        return mask


_active: LoRABatch | None = None


@contextmanager
def lora_batch(batch: LoRABatch | None):
    """Layers add their adapters' deltas to the rows `batch` maps while this is open."""
    global _active
    previous, _active = _active, batch
    try:
        yield
    finally:
        _active = previous


class LoRALinear:
    """A linear layer's adapter slots (layers/linear.py's LinearBase.matmul calls add_to)."""

    def __init__(
        self,
        out_features: int,
        in_features: int,
        parts: list,
        num_slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.parts = parts  # the weight_loader shard ids of the projections fused in the layer
        self.num_slots, self.rank = num_slots, rank
        self.width = -(-len(parts) * num_slots * rank // _GEMM_K) * _GEMM_K
        self.a = torch.zeros(self.width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(out_features, self.width, dtype=dtype, device=device)
        self.a_gemm: torch.Tensor | None = None
        self.b_gemm: torch.Tensor | None = None
        self.filled: set[int] = set()  # slots holding some adapter's weights for this layer

    def _columns(self, part: int, slot: int) -> slice:
        start = (part * self.num_slots + slot) * self.rank
        return slice(start, start + self.rank)

    def set_slot(self, slot: int, pieces: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds these parts (part index -> this rank's A [r, in], B [out, r]); the
        others are zero. Called between steps; the packings are made again."""
        if not pieces and slot not in self.filled:
            return
        for part in range(len(self.parts)):
            cols = self._columns(part, slot)
            self.a[cols] = 0
            self.b[:, cols] = 0
            if part in pieces:
                a, b = pieces[part]
                r = a.shape[0]
                self.a[cols.start : cols.start + r] = a
                self.b[:, cols.start : cols.start + r] = b
        self.filled.discard(slot)
        if pieces:
            self.filled.add(slot)
        if self.a.device.type == "cpu":
            self.a_gemm, self.b_gemm = gemm_packing(self.a), gemm_packing(self.b)

    def add_to(self, x: torch.Tensor, out: torch.Tensor, rows: RowTiling | None) -> torch.Tensor:
        batch = _active
        if batch is None or not self.filled:
            return out
        if x.shape[0] != batch.row_slots.shape[0]:
            raise RuntimeError(
                f"a LoRA layer got {x.shape[0]} rows in a step of {batch.row_slots.shape[0]}"
            )
        shrink = unquantized_gemm(x, self.a, None, self.a_gemm, None, rows)
        shrink = shrink * batch.mask(len(self.parts), self.width, shrink.dtype)
        out += unquantized_gemm(shrink, self.b, None, self.b_gemm, None, rows)
        return out
