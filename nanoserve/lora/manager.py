"""The adapters one rank holds, and which of them sit in the layers' slots.

Every rank keeps the adapters the engine registered (at most --max-cpu-loras), each already cut
to this rank's share (tensor parallelism: a column-parallel layer's B by its output rows, a
row-parallel layer's A by its input columns, through the layers' own weight loaders; B A x then
sums over the ranks like the base layer's partial outputs) and cast to the model's dtype. The
driver decides each step which adapter is in which of the --max-loras slots (`assign`: the ones
already placed stay) and sends that table with the step; every rank fills the slots it names
(`apply`), so all ranks agree whatever order the steps come in.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from nanoserve.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from nanoserve.lora.adapter import LoRAError, read_adapter
from nanoserve.lora.layers import _GEMM_K, LoRABatch, LoRALinear

_LAYER = re.compile(r"(.*\.layers\.)(\d+)(\..+)")


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_slots, self.max_rank = num_slots, max_rank
        self.dtype, self.device = dtype, device
        self.packed_modules: dict = getattr(model, "packed_modules", {})
        self.num_layers = len(model.model.layers)
        self.linears: dict[str, LinearBase] = {}
        for name, module in model.model.layers.named_modules(prefix="model.layers"):
            if isinstance(module, LinearBase):
                leaf = name.rsplit(".", 1)[-1]
                parts = [
                    shard for fused, shard in self.packed_modules.values() if fused == leaf
                ] or [None]
                out_features, in_features = module.weight.shape
                module.lora = LoRALinear(
                    out_features, in_features, parts, num_slots, max_rank, dtype, device
                )
                self.linears[name] = module
        if not self.linears:
            raise LoRAError(f"{type(model).__name__} has no linear layers LoRA can apply to")
        # Module names with the layer index wildcarded: a name another pipeline stage holds.
        self.layer_patterns = {_LAYER.sub(r"\1*\3", name) for name in self.linears}
        self.adapters: dict[int, dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.slots: list[int] = [0] * num_slots  # the adapter id in each slot (0: empty)
        self.last_used: dict[int, int] = {}  # slot -> the driver's step count when last assigned
        self.steps = 0
        self._fused: tuple | None = None  # fused_table()'s answer for the slots as they are

    @property
    def all_on_cpu_gemm(self) -> bool:
        """Every layer's LoRA GEMMs go through kernels/cpu/gemm*.cpp (rows invariant unpadded)."""
        from nanoserve.kernels.gemm import gemm_packing

        return all(
            gemm_packing(m.lora.a[:32]) is not None and gemm_packing(m.lora.b) is not None
            for m in self.linears.values()
        )

    def _target(self, module: str, adapter: str) -> tuple[str, int] | None:
        """A checkpoint module name -> (our layer's name, its part), or None when the layer is on
        another pipeline stage."""
        prefix, _, leaf = module.rpartition(".")
        fused, shard = self.packed_modules.get(leaf, (leaf, None))
        name = f"{prefix}.{fused}"
        if name in self.linears:
            lora = self.linears[name].lora
            if shard in lora.parts:
                return name, lora.parts.index(shard)
        match = _LAYER.fullmatch(name)
        if (
            match
            and int(match.group(2)) < self.num_layers
            and shard in (None, *[s for f, s in self.packed_modules.values() if f == fused])
            and _LAYER.sub(r"\1*\3", name) in self.layer_patterns
        ):
            return None
        supported = sorted(
            {p.rsplit(".", 1)[-1] for p in self.layer_patterns}
            - {f for f, _ in self.packed_modules.values()}
            | set(self.packed_modules)
        )
        raise LoRAError(
            f"LoRA adapter {adapter!r} targets {module}, which nanoserve can't apply it to "
            f"(it serves adapters on {', '.join(supported)})"
        )

    def add(self, adapter_id: int, path: str) -> None:
        """Read an adapter and keep this rank's share of it (replacing any under the same id)."""
        adapter = read_adapter(path, self.max_rank)
        pieces: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, weights in adapter.modules.items():
            target = self._target(module, path)
            if target is None:
                continue
            name, part = target
            linear = self.linears[name]
            out_features, in_features = linear.weight.shape
            a, b = weights.a, weights.b
            shard = linear.lora.parts[part]
            try:
                if isinstance(linear, RowParallelLinear):
                    a_full, a = a, torch.zeros(a.shape[0], in_features)
                    linear.weight_loader(a, a_full)
                elif isinstance(linear, ColumnParallelLinear):
                    b_full, b = b, torch.zeros(out_features, b.shape[1])
                    linear.weight_loader(b, b_full, shard)
                if a.shape[1] != in_features or b.shape[0] != out_features:
                    raise RuntimeError("shape")
            except RuntimeError:
                raise LoRAError(
                    f"LoRA adapter {path!r}: {module}'s A {list(weights.a.shape)} / B "
                    f"{list(weights.b.shape)} do not fit the model's layer"
                ) from None
            pieces.setdefault(name, {})[part] = (a.to(self.dtype), b.to(self.dtype))
        self.adapters[adapter_id] = {
            name: {p: (a.to(self.device), b.to(self.device)) for p, (a, b) in parts.items()}
            for name, parts in pieces.items()
        }
        if adapter_id in self.slots:  # replaced: the slot must be filled again
            self._fill(self.slots.index(adapter_id), adapter_id)

    def remove(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)
        if adapter_id in self.slots:
            self._fill(self.slots.index(adapter_id), 0)

    def _fill(self, slot: int, adapter_id: int) -> None:
        weights = self.adapters.get(adapter_id, {}) if adapter_id else {}
        for name, linear in self.linears.items():
            linear.lora.set_slot(slot, weights.get(name, {}))
        self.slots[slot] = adapter_id
        self._fused = None

    def fused_table(self, model: nn.Module) -> tuple[torch.Tensor, int, int, int] | None:
        """The fused CPU decode step's view of the slots (kernels/cpu/decode_layers.cpp): per
        decoder layer and linear (qkv, o, gate_up, down) the addresses of A's and B's packings (0
        where the layer holds no adapter), the width and the parts; then the slots, the rank and
        the widest width. None when a layer holding an adapter has no packing (not bf16 on our GEMM)."""
        if self._fused is None:
            rows, widest, packed = [], _GEMM_K, True
            for layer in model.model.layers:
                for linear in (
                    layer.self_attn.qkv_proj,
                    layer.self_attn.o_proj,
                    getattr(layer.mlp, "gate_up_proj", None),
                    getattr(layer.mlp, "down_proj", None),
                ):
                    lora = None if linear is None else linear.lora  # (a MoE layer's MLP has none)
                    if lora is None or not lora.filled:
                        rows.append([0, 0, 0, 0])
                        continue
                    packed = packed and lora.a_gemm is not None and lora.b_gemm is not None
                    rows.append(
                        [
                            lora.a_gemm.data_ptr() if packed else 0,
                            lora.b_gemm.data_ptr() if packed else 0,
                            lora.width,
                            len(lora.parts),
                        ]
                    )
                    widest = max(widest, lora.width)
            self._fused = (
                (torch.tensor(rows, dtype=torch.int64), self.num_slots, self.max_rank, widest)
                if packed
                else (None,)
            )
        return None if self._fused[0] is None else self._fused

    # ---- each step ------------------------------------------------------------------------------
    def assign(self, adapter_ids: set[int]) -> list[int]:
        """The driver: a slot table holding every adapter of the step (at most num_slots; the
        scheduler sees to that). Placed adapters stay; a new one takes the least recently used
        slot the step does not need."""
        self.steps += 1
        table = list(self.slots)
        for adapter_id in adapter_ids:
            if adapter_id not in table:
                free = [s for s in range(self.num_slots) if table[s] not in adapter_ids]
                slot = min(free, key=lambda s: (table[s] != 0, self.last_used.get(s, 0)))
                table[slot] = adapter_id
        for slot, adapter_id in enumerate(table):
            if adapter_id in adapter_ids:
                self.last_used[slot] = self.steps
        return table

    def apply(self, table: list[int]) -> None:
        """Every rank: make the slots hold what the step's table says."""
        for slot, adapter_id in enumerate(table):
            if self.slots[slot] != adapter_id:
                self._fill(slot, adapter_id)

    def batch(self, row_slots: torch.Tensor) -> LoRABatch:
        return LoRABatch(row_slots, self.num_slots, self.max_rank)
