"""A quantized linear layer's parts as a loader stages them, and the QuantWeight(s) made of them
(kernels/quant.py); shared by the GGUF loader (models/gguf/weights.py, the file's bytes) and the
loaders of checkpoints that hold integers and scales (compressed-tensors:
models/compressed_tensors.py; GPTQ and AWQ: models/gptq_awq.py), whose common part is here:
`IntegerWeight` (one layer's integers, scales and zero points, in one convention) and
`IntegerCheckpointLoader` (each quantized layer's tensors collected, then staged for the kernels
or dequantized; a MoE expert's matrix goes to its layers/fused_moe.FusedMoE, which keeps it in
the kernel format too).

Each part arrives as one or more arrays of the whole checkpoint tensor, rows in output order and
columns that split with the input features (GGUF bytes, or u / scale per 32 / min per 32). Shards
follow the bf16 loaders: the layer's own weight_loader runs on each array, so column-parallel
layers take whole rows and row-parallel layers whole blocks of each row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from nanoserve.kernels import quant
from nanoserve.layers.embedding import ParallelLMHead
from nanoserve.layers.fused_moe import FusedMoE
from nanoserve.layers.linear import LinearBase, RowParallelLinear, load_parameter
from nanoserve.layers.linear_weight import QuantizedWeight

logger = logging.getLogger(__name__)
BLOCK = 32  # the kernel formats' block of inputs (Q8_0, Q4_0, Q4_1)


@dataclass
class StagedLinear:
    """One layer's parts as they arrive (a fused layer takes several tensors)."""

    # qtype -> array name ("raw", or "u" / "scale" / "mins") -> this rank's [n_local, columns]
    buffers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    row_qtype: list[str | None] = field(default_factory=list)  # per output row of this rank
    float_parts: int = 0
    # GPTQ's activation order (IntegerCheckpointLoader._in_group_order): the layer's inputs,
    # sorted by group at load, are gathered in this order at each GEMM (int64 [k]).
    input_perm: torch.Tensor | None = None


def stage_quantized(
    module: nn.Module,
    name: str,
    arrays: dict[str, torch.Tensor],
    qtype: str,
    block: int,
    k: int,
    shard_id,
    parts: StagedLinear,
) -> None:
    """This rank's rows (or, row-parallel, whole blocks of `block` inputs of each row) of one part
    (`arrays`, each [rows, columns proportional to k]) into the layer's buffers for `qtype`,
    through the layer's own weight_loader."""
    if isinstance(module, ParallelLMHead):
        parts.buffers[qtype] = {
            key: array[module.vocab_start : module.vocab_end] for key, array in arrays.items()
        }
        parts.row_qtype = [qtype] * (module.vocab_end - module.vocab_start)
        return
    n_local, k_local = module.weight.shape
    if k_local % block:
        raise ValueError(
            f"{name}: {qtype.upper()} blocks of {block} values cannot split its {k} "
            f"input features into {k // k_local} shards of {k_local}"
        )
    if not parts.row_qtype:
        parts.row_qtype = [None] * n_local
    buffers = parts.buffers.setdefault(qtype, {})
    for key, array in arrays.items():
        if key not in buffers:
            buffers[key] = array.new_zeros(n_local, array.shape[1] * k_local // k)
        module.weight_loader(buffers[key], array, shard_id)
    rows = next(iter(arrays.values())).shape[0]
    if isinstance(module, RowParallelLinear):
        written = range(n_local)
    else:  # the same loader on a column of marks says which rows this part filled
        marks = torch.zeros(n_local, 1, dtype=torch.uint8)
        module.weight_loader(marks, torch.ones(rows, 1, dtype=torch.uint8), shard_id)
        written = marks[:, 0].nonzero()[:, 0].tolist()
    for row in written:
        parts.row_qtype[row] = qtype


def _quant_weight(
    qtype: str, k: int, arrays: dict[str, torch.Tensor], device: torch.device
) -> quant.QuantWeight:
    """The weight in the form its kernels hold on `device` (kernels/quant.place), there."""
    arrays = {key: array.contiguous() for key, array in arrays.items()}
    n = next(iter(arrays.values())).shape[0]
    if "raw" in arrays:
        return quant.place(quant.QuantWeight(qtype, n, k, arrays["raw"]), device)
    components = quant.QuantComponents(arrays["u"], arrays["scale"], arrays.get("mins"))
    return quant.place(quant.QuantWeight(qtype, n, k, None, components=components), device)


def finish_quantized(module: nn.Module, target: str, parts: StagedLinear, shared: bool) -> None:
    """The layer's QuantizedWeight: one QuantWeight (or, when its fused parts differ in type,
    one per run of rows in output order); its bf16 weight goes to the meta device unless shared
    (a tied embedding)."""
    if any(qtype is None for qtype in parts.row_qtype):
        raise ValueError(f"{target}: the checkpoint lacks some of this layer's parts")
    device = module.weight.device
    k_local = module.weight.shape[1]
    weights, start = [], 0
    labels = parts.row_qtype
    for end in range(1, len(labels) + 1):
        if end == len(labels) or labels[end] != labels[start]:
            arrays = {key: array[start:end] for key, array in parts.buffers[labels[start]].items()}
            weights.append(_quant_weight(labels[start], k_local, arrays, device))
            start = end
    order = None if parts.input_perm is None else parts.input_perm.to(device)
    module.weight_form = QuantizedWeight(weights, order)
    if not shared:
        module.weight = nn.Parameter(
            torch.empty(module.weight.shape, dtype=module.weight.dtype, device="meta"),
            requires_grad=False,
        )


# ---- checkpoints of integers and scales (compressed-tensors, GPTQ, AWQ) ----------------------


def unpack_int32(packed: torch.Tensor, num_bits: int, count: int) -> torch.Tensor:
    """int32 [rows, words] holding 32 / num_bits values each from bit 0 up (8 or 4 bits;
    compressed-tensors' pack_to_int32, GPTQ's and AWQ's words) -> uint8 [rows, count], through
    the words' bytes (one byte a value: a large layer unpacks without an int64 copy).
    Little-endian words, as torch's hosts store them."""
    data = packed.contiguous().view(torch.uint8)
    if num_bits == 4:
        data = torch.stack((data & 0x0F, data >> 4), dim=-1).reshape(packed.shape[0], -1)
    return data[:, :count]


@dataclass
class IntegerWeight:
    """One quantized layer as its checkpoint means it: weight[o, i] = scale[o, g] * (q[o, i] -
    zero[o, g]) with g = i // group, or, with `g_idx` (GPTQ's activation order), g = g_idx[i].
    q and zero are signed, centred on 2^(bits-1) (compressed-tensors' convention: a stored
    unsigned value u is q = u - 2^(bits-1)); zero None means 0 (symmetric)."""

    q: torch.Tensor  # int16 [n, k]
    scale: torch.Tensor  # float32 [n, groups]
    zero: torch.Tensor | None  # int16 [n, groups]
    group: int
    bits: int
    g_idx: torch.Tensor | None = None  # int64 [k], only when it is not i // group

    @property
    def qtype(self) -> str | None:
        """The kernel format (kernels/quant.py) that holds it, or None (no format does)."""
        if self.bits == 8:
            return "q8_0" if self.zero is None else None
        if self.bits == 4:
            return "q4_0" if self.zero is None else "q4_1"
        return None

    def _groups(self) -> torch.Tensor:
        k = self.q.shape[1]
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(k) // self.group

    def dequantized(self) -> torch.Tensor:
        """float32 [n, k]."""
        groups = self._groups()
        q = self.q if self.zero is None else self.q - self.zero[:, groups]
        return self.scale[:, groups] * q.float()

    def fits_kernels(self, k_local: int) -> bool:
        """Whole blocks of 32 inputs each in one group, in input order, in a format the kernels have."""
        k = self.q.shape[1]
        return (
            self.qtype is not None
            and self.g_idx is None
            and self.group % BLOCK == 0
            and k_local % BLOCK == 0
            and k % k_local == 0
        )

    def in_group_order(self) -> tuple[IntegerWeight, torch.Tensor] | None:
        """GPTQ's activation order: (the weight with its inputs sorted by group, that order), when
        sorting makes every group one run of `group` inputs in order (the last may be shorter), as
        GPTQ's desc_act writes them; else None."""
        if self.g_idx is None:
            return None
        k = self.q.shape[1]
        order = torch.sort(self.g_idx, stable=True).indices
        if not torch.equal(self.g_idx[order], torch.arange(k) // self.group):
            return None
        return IntegerWeight(
            self.q[:, order].contiguous(), self.scale, self.zero, self.group, self.bits
        ), order

    def kernel_arrays(self) -> dict[str, torch.Tensor]:
        """The kernel format's components: u, scale per block of 32, min per block (Q4_1)."""
        blocks = self.q.shape[1] // BLOCK
        half = 1 << (self.bits - 1)
        u = (self.q + half).to(torch.uint8)
        per_block = self.scale.repeat_interleave(self.group // BLOCK, dim=1)[
            :, :blocks
        ].contiguous()
        arrays = {"u": u, "scale": per_block}
        if self.zero is not None:  # Q4_1: scale * u + min = scale * (q - zero) with u = q + 8
            zero = self.zero.repeat_interleave(self.group // BLOCK, dim=1)[:, :blocks]
            arrays["mins"] = -(per_block * (zero + half).float())
        return arrays


class IntegerScheme(Protocol):
    def roles(self) -> set[str]:
        """The tensors a layer of this scheme must have."""

    def integers(self, tensors: dict[str, torch.Tensor], layer: str) -> IntegerWeight:
        """The layer's tensors (role -> tensor) read."""


class IntegerFormat(Protocol):
    marker: str  # the tensor beside a quantized layer's that marks it ("weight_scale", "qweight")
    tensor_roles: tuple[str, ...]
    skips_zero_bias: bool  # a zero bias of a layer that has none is skipped (AutoGPTQ writes them)

    def scheme_for(self, layer: str) -> IntegerScheme: ...

    def takes_role(self, layer: str, role: str) -> bool:
        """False: the tensor is read and not used; may raise (ValueError) for one not served."""


@dataclass
class IntegerCheckpointLoader:
    """models/weights.load_weights' partner for a checkpoint of integers and scales: it names the
    tensors of quantized layers (`split_name`), collects each layer's (they may lie in different
    shard files), then stages them for the kernels or dequantizes them (`add`); `finish` makes
    the QuantWeights."""

    format: IntegerFormat
    modules: dict[str, nn.Module]
    quantized: set[str]  # checkpoint names of quantized layers
    pending: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    staged: dict[str, StagedLinear] = field(default_factory=dict)

    @classmethod
    def for_checkpoint(
        cls, format: IntegerFormat, model: nn.Module, tensor_names
    ) -> IntegerCheckpointLoader:
        suffix = "." + format.marker
        quantized = {name.removesuffix(suffix) for name in tensor_names if name.endswith(suffix)}
        return cls(format, dict(model.named_modules(remove_duplicate=False)), quantized)

    def split_name(self, name: str) -> tuple[str, str | None]:
        """A quantized layer's tensor -> (its weight's name, which tensor: "weight", "qweight",
        "weight_scale", ...); any other tensor -> (name, None)."""
        base, _, role = name.rpartition(".")
        if base in self.quantized and (role == "weight" or role in self.format.tensor_roles):
            return f"{base}.weight", role
        return name, None

    def add(
        self,
        layer: str,
        role: str,
        tensor: torch.Tensor,
        target: str,
        param: nn.Parameter,
        shard_id,
    ) -> None:
        """One tensor of the checkpoint layer `layer` (loading into parameter `target`)."""
        if not self.format.takes_role(layer, role):
            return
        scheme = self.format.scheme_for(layer)
        tensors = self.pending.setdefault(layer, {})
        tensors[role] = tensor
        if scheme.roles() <= tensors.keys():
            del self.pending[layer]
            self._load_layer(layer, scheme.integers(tensors, layer), target, param, shard_id)

    def _load_layer(
        self, layer: str, weight: IntegerWeight, target: str, param: nn.Parameter, shard_id
    ) -> None:
        module = self.modules[target.rsplit(".", 1)[0]]
        k = weight.q.shape[1]
        if weight.g_idx is not None:
            weight = self._in_group_order(layer, weight, module, target, param) or weight
        if (
            isinstance(module, (LinearBase, ParallelLMHead))
            and param.dim() == 2
            and weight.qtype is not None
            and quant.linear_keeps_blocks(weight.qtype, param.device)
            and weight.fits_kernels(param.shape[-1])
        ):
            stage_quantized(
                module,
                layer,
                weight.kernel_arrays(),
                weight.qtype,
                BLOCK,
                k,
                shard_id,
                self.staged.setdefault(target, StagedLinear()),
            )
            return
        # One expert's matrix: FusedMoE keeps it in the kernel format.
        if (
            isinstance(module, FusedMoE)
            and shard_id[0] is not None
            and module.keeps_quantized(param, weight.qtype)
            and weight.fits_kernels(param.shape[-1])
        ):
            module.load_quantized(param, weight.kernel_arrays(), weight.qtype, shard_id)
            return
        logger.info(
            "%s: dequantized into a %s weight (the quantized kernels don't take it here)",
            layer,
            param.dtype,
        )
        load_parameter(param, weight.dequantized().to(param.dtype), shard_id)

    def _in_group_order(
        self, layer: str, weight: IntegerWeight, module: nn.Module, target: str, param: nn.Parameter
    ) -> IntegerWeight | None:
        """GPTQ's activation order on the kernels: the layer's inputs sorted by group once at load
        and the activations gathered in that order at each GEMM (QuantizedWeight.input_perm). Every
        part of a fused layer must have the same order (GPTQ's q/k/v and gate/up do: one input, one
        Hessian), and a row-parallel layer must hold all its inputs (no tensor parallelism)."""
        if not (
            isinstance(module, LinearBase)
            and weight.qtype is not None
            and quant.linear_keeps_blocks(weight.qtype, param.device)
        ):
            return None
        if isinstance(module, RowParallelLinear) and module.tp_size > 1:
            return None
        sorted_weight = weight.in_group_order()
        if sorted_weight is None or not sorted_weight[0].fits_kernels(param.shape[-1]):
            return None
        sorted_weight, order = sorted_weight
        staged = self.staged.get(target)
        if staged is None:
            self.staged[target] = StagedLinear(input_perm=order)
        elif staged.input_perm is None or not torch.equal(staged.input_perm, order):
            raise ValueError(
                f"{layer}: its activation order (g_idx) differs from the other parts of "
                f"{target.removesuffix('.weight')}, "
                "which share its inputs; this GPTQ checkpoint is not supported"
            )
        return sorted_weight

    def finish(self) -> None:
        """Every quantized layer complete, and its QuantWeight(s) made."""
        for layer, tensors in self.pending.items():
            missing = sorted(self.format.scheme_for(layer).roles() - tensors.keys())
            raise ValueError(f"{layer}: the checkpoint lacks {', '.join(missing)}")
        for target, parts in self.staged.items():
            finish_quantized(self.modules[target.rsplit(".", 1)[0]], target, parts, shared=False)
