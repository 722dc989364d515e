"""The sparse MoE block's layers: the router (a replicated linear) and the experts (FusedMoE),
with tensor parallelism over each expert's intermediate dimension (vLLM's default) or, with
--enable-expert-parallel, whole experts per rank. Either way each rank computes its part of
every token's output and one all-reduce sums the parts."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from nanoserve.distributed import all_reduce, get_tp_rank, get_tp_world_size
from nanoserve.kernels.fused_moe import fused_moe
from nanoserve.kernels.fused_moe_quant import quantized_expert_form
from nanoserve.layers.expert_weights import MATRICES, ExpertWeights
from nanoserve.layers.linear import LinearBase, RowTiling
from nanoserve.layers.quant_experts import (
    BLOCK,
    QuantExpertStaging,
    StackedQuantExperts,
    shard_columns,
)

# Checkpoint names of an expert's three matrices -> (our stacked parameter, part): Mixtral's
# w1 / w3 / w2, and Qwen-MoE's / OLMoE's gate_proj / up_proj / down_proj.
EXPERT_PARTS = {
    "w1": ("w13_weight", 0),
    "w3": ("w13_weight", 1),
    "w2": ("w2_weight", None),
    "gate_proj": ("w13_weight", 0),
    "up_proj": ("w13_weight", 1),
    "down_proj": ("w2_weight", None),
}


class ReplicatedLinear(LinearBase):
    """The whole matrix on every rank (the router, Qwen2-MoE's shared-expert gate)."""

    def forward(self, x: torch.Tensor, rows: RowTiling | None = None) -> torch.Tensor:
        return self.matmul(x, self.bias, rows)


class FusedMoE(nn.Module):
    """Every expert's gate/up and down matrices stacked ([experts, 2 * inter, hidden] and
    [experts, hidden, inter]), loaded expert by expert from the checkpoint's per-expert tensors."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        dtype: torch.dtype,
        expert_parallel: bool = False,
        bias: bool = False,
        activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """`bias`: each expert's gate/up and down outputs have one (gpt-oss: w13_bias, w2_bias);
        `activation`: of the gate/up rows (None: SiLU x mul)."""
        super().__init__()
        tp_size, tp_rank = get_tp_world_size(), get_tp_rank()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.expert_parallel = expert_parallel and tp_size > 1
        if self.expert_parallel:
            if num_experts % tp_size:
                raise ValueError(
                    f"{num_experts} experts are not divisible by tensor parallel size {tp_size} "
                    f"(--enable-expert-parallel)"
                )
            local = num_experts // tp_size
            self.first_expert, self.num_local_experts, self.inter = (
                tp_rank * local,
                local,
                intermediate_size,
            )
            expert_map = torch.full((num_experts,), -1, dtype=torch.long)
            expert_map[self.first_expert : self.first_expert + local] = torch.arange(local)
            self.register_buffer("expert_map", expert_map, persistent=False)
        else:
            if intermediate_size % tp_size:
                raise ValueError(
                    f"expert intermediate size {intermediate_size} is not divisible by tensor "
                    f"parallel size {tp_size}"
                )
            self.first_expert, self.num_local_experts = 0, num_experts
            self.inter = intermediate_size // tp_size
            self.expert_map = None
        self.tp_rank = tp_rank
        # Allocated by the first float expert the loader writes (_allocate): a quantized
        # checkpoint's experts never take a float copy's memory, not even during the load.
        self.w13_weight = nn.Parameter(
            _unallocated((self.num_local_experts, 2 * self.inter, hidden_size), dtype),
            requires_grad=False,
        )
        self.w2_weight = nn.Parameter(
            _unallocated((self.num_local_experts, hidden_size, self.inter), dtype),
            requires_grad=False,
        )
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self.activation = activation
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(
                torch.empty(self.num_local_experts, 2 * self.inter, dtype=dtype),
                requires_grad=False,
            )
            self.w2_bias = nn.Parameter(
                torch.empty(self.num_local_experts, hidden_size, dtype=dtype), requires_grad=False
            )
            self.w13_bias.weight_loader = self.w2_bias.weight_loader = self.bias_loader
        # What the kernels multiply beside the parameters: packings, quantized experts
        # (layers/expert_weights.py); a quantized checkpoint's experts are staged until whole.
        self.expert_weights = ExpertWeights()
        self.quant_staging = QuantExpertStaging(
            self.num_local_experts, {"w13": hidden_size, "w2": self.inter}, self.w13_weight.device
        )

    def weight_loader(
        self, param: nn.Parameter, loaded, shard_id: tuple[int | None, int | None]
    ) -> None:
        """`shard_id`: (global expert index, 0 gate / 1 up / None down), or (None, None) for all
        experts in one tensor (transformers 5's own layout: gate_up_proj [experts, 2 * inter,
        hidden], down_proj [experts, hidden, inter]). Experts of other ranks are skipped; with
        the intermediate dimension split, this rank's rows (gate, up) or columns (down)."""
        expert, part = shard_id
        if isinstance(loaded, StackedQuantExperts):  # models/mxfp4.Mxfp4Weight
            self._load_stacked_quantized(param, loaded)
            return
        if expert is None:
            for local in range(self.num_local_experts):
                one = loaded[self.first_expert + local : self.first_expert + local + 1][0]
                if param is self.w2_weight:
                    self.weight_loader(param, one, (self.first_expert + local, None))
                else:
                    total = one.shape[0] // 2  # every rank's gate rows, then every rank's up rows
                    self.weight_loader(param, one[:total], (self.first_expert + local, 0))
                    self.weight_loader(param, one[total:], (self.first_expert + local, 1))
            return
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        _allocate(param)
        start = 0 if self.expert_parallel else self.tp_rank * self.inter
        if part is None:
            param.data[local].copy_(loaded[:, start : start + self.inter])
        else:
            param.data[local, part * self.inter : (part + 1) * self.inter].copy_(
                loaded[start : start + self.inter]
            )

    def _load_stacked_quantized(self, param: nn.Parameter, loaded) -> None:
        """Every expert's matrix in one quantized tensor, [experts, outputs (gate rows then up rows
        for w13), inputs]: kept in its kernel format where the quantized kernels take it
        (keeps_quantized), dequantized into the parameter otherwise."""
        if not self.keeps_quantized(param, loaded.qtype):
            FusedMoE.weight_loader(
                self, param, loaded.dequantized(param.dtype), (None, None)
            )  # our layout
            return
        for local in range(self.num_local_experts):
            expert = self.first_expert + local
            qtype, one = loaded.kernel_components(expert)
            if param is self.w2_weight:
                self.load_quantized(param, one, qtype, (expert, None))
                continue
            total = one["u"].shape[0] // 2
            for part in (0, 1):
                self.load_quantized(
                    param,
                    {key: a[part * total : (part + 1) * total] for key, a in one.items()},
                    qtype,
                    (expert, part),
                )

    def takes_quantized(self, param: nn.Parameter) -> bool:
        """Whether this rank's shard of the matrix is whole blocks of 32 inputs (down's inputs
        are the split intermediate dimension)."""
        return param is self.w13_weight or self.expert_parallel or self.inter % BLOCK == 0

    def keeps_quantized(self, param: nn.Parameter, qtype: str) -> bool:
        """Whether experts of kernel format `qtype` stay quantized in this matrix: the kernels
        on its device take them (kernels/fused_moe_quant.quantized_expert_form: the C++ ones on
        a CPU, the fused-MoE Triton kernel on CUDA) and the shard is whole blocks."""
        return quantized_expert_form(param.device, qtype) is not None and self.takes_quantized(
            param
        )

    def load_quantized(
        self,
        param: nn.Parameter,
        arrays: dict[str, torch.Tensor],
        qtype: str,
        shard_id: tuple[int, int | None],
    ) -> None:
        """One expert's matrix (or its gate / up part) as kernel components (kernels/quant.py:
        "u" [rows, k], "scale" and "mins" [rows, k / 32]), kept in that format: this rank's rows
        (gate, up) or whole blocks of 32 of its columns (down; see takes_quantized)."""
        expert, part = shard_id
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        start = 0 if self.expert_parallel else self.tp_rank * self.inter
        if part is None:
            arrays = shard_columns(arrays, start, self.inter, qtype)
        else:
            arrays = {key: a[start : start + self.inter] for key, a in arrays.items()}
        self.quant_staging.add(
            "w13" if param is self.w13_weight else "w2", local, part, qtype, arrays
        )

    def finish_quantized(self) -> None:
        """The staged quantized experts into QuantWeights (models/weights.load_weights calls it once
        every tensor is read); the float parameters they replace go to the meta device."""
        for matrix in MATRICES:
            weights = self.quant_staging.finish(matrix)
            if weights is not None:
                self.expert_weights.set_quantized(matrix, weights)
                self._to_meta(matrix)

    def _to_meta(self, matrix: str) -> None:
        """The matrix's float parameter keeps only its shape and dtype (another form holds it)."""
        param = self.w13_weight if matrix == "w13" else self.w2_weight
        if param.is_meta:  # a quantized matrix's, since its experts were finished
            return
        meta = nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False
        )
        if matrix == "w13":
            self.w13_weight = meta
        else:
            self.w2_weight = meta

    def bias_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """Every expert's biases in one tensor: w13_bias [experts, 2 * inter] (gate, then up) or
        w2_bias [experts, hidden]. This rank's experts; with the intermediate dimension split, its
        gate and up parts, and the down bias on rank 0 only (the all-reduce adds it once)."""
        loaded = loaded[self.first_expert : self.first_expert + self.num_local_experts]
        if param is self.w2_bias:
            param.data.copy_(
                loaded if self.expert_parallel or self.tp_rank == 0 else torch.zeros_like(loaded)
            )
            return
        start = 0 if self.expert_parallel else self.tp_rank * self.inter
        total = loaded.shape[1] // 2
        for part in (0, 1):
            rows = loaded[:, part * total + start : part * total + start + self.inter]
            param.data[:, part * self.inter : (part + 1) * self.inter].copy_(rows)

    def prepack_gemm(self) -> bool:
        """CPU, bf16: each expert's matrices in kernels/cpu/gemm.cpp's packing (called by
        layers/cpu_prepack.prepack_gemm_weights). Whether both were packed. The packing is then
        the only copy: the parameters move to the meta device (kernels/fused_moe.py reads the
        matrices back from the packing for the paths that multiply them as they are). Quantized
        experts: each QuantWeight in the quantized kernel's packing (rows invariant either way)."""
        weights, packed = self.expert_weights, []
        for matrix, param in zip(MATRICES, (self.w13_weight, self.w2_weight)):
            packed.append(weights.pack_for_cpu(matrix, param))
            if packed[-1]:
                self._to_meta(matrix)
        weights.build_cpu_table(self.w13_weight, self.w2_weight)
        return all(packed)

    def kernel_bytes(self) -> int:
        """Bytes the experts take beside their (non-meta) parameters: quantized experts' blocks
        and the bf16 packings of prepack_gemm."""
        return self.expert_weights.nbytes()

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        bias = None if self.w13_bias is None else (self.w13_bias, self.w2_bias)
        out = fused_moe(
            hidden,
            router_logits,
            self.w13_weight,
            self.w2_weight,
            self.top_k,
            self.renormalize,
            self.expert_map,
            self.expert_weights.operands(),
            bias,
            self.activation,
            self.expert_weights.cpu_table,
        )
        return all_reduce(out)


def _unallocated(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` on the default device that holds one element (every stride 0)."""
    return torch.empty((), dtype=dtype).expand(shape)


def _allocate(param: nn.Parameter) -> None:
    """Gives an _unallocated parameter its memory (same identity, shape, dtype and device)."""
    if param.dim() and param.stride(-1) == 0:
        param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)


_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_STACKED_NAME = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")  # transformers 5's layout


def expert_weight_target(name: str) -> tuple[str, tuple[int | None, int | None]] | None:
    """A checkpoint's expert tensor name -> (our stacked parameter's name, the shard id its
    weight_loader takes); None for any other name. `...experts.3.w1.weight` ->
    (`...experts.w13_weight`, (3, 0)); `...experts.gate_up_proj` -> (`...experts.w13_weight`,
    (None, None))."""
    match = _EXPERT_NAME.match(name)
    if match is not None:
        prefix, expert, part = match.groups()
        param, index = EXPERT_PARTS[part]
        return f"{prefix}.{param}", (int(expert), index)
    match = _STACKED_NAME.match(name)
    if match is not None:
        prefix, part = match.groups()
        return f"{prefix}.{'w13_weight' if part == 'gate_up_proj' else 'w2_weight'}", (None, None)
    return None
