"""The sparse MoE block's layers: the router (a replicated linear) and the experts (FusedMoE),
with tensor parallelism over each expert's intermediate dimension (vLLM's default) or, with
--enable-expert-parallel, whole experts per rank. Either way each rank computes its part of
every token's output and one all-reduce sums the parts."""
from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from nanoserve.distributed import all_reduce, get_tp_rank, get_tp_world_size
from nanoserve.kernels import quant
from nanoserve.kernels.fused_moe import fused_moe, pack_expert_weights
from nanoserve.layers.linear import LinearBase, RowTiling

# Checkpoint names of an expert's three matrices -> (our stacked parameter, part): Mixtral's
# w1 / w3 / w2, and Qwen-MoE's / OLMoE's gate_proj / up_proj / down_proj.
EXPERT_PARTS = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", None),
                "gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", None)}


class ReplicatedLinear(LinearBase):
    """The whole matrix on every rank (the router, Qwen2-MoE's shared-expert gate)."""

    def forward(self, x: torch.Tensor, rows: RowTiling | None = None) -> torch.Tensor:
        return self.matmul(x, self.bias, rows)


class FusedMoE(nn.Module):
    """Every expert's gate/up and down matrices stacked ([experts, 2 * inter, hidden] and
    [experts, hidden, inter]), loaded expert by expert from the checkpoint's per-expert tensors."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype, expert_parallel: bool = False, bias: bool = False,
                 activation: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """`bias`: each expert's gate/up and down outputs have one (gpt-oss: w13_bias, w2_bias);
        `activation`: of the gate/up rows (None: SiLU x mul)."""
        super().__init__()
        tp_size, tp_rank = get_tp_world_size(), get_tp_rank()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.expert_parallel = expert_parallel and tp_size > 1
        if self.expert_parallel:
            if num_experts % tp_size:
                raise ValueError(f"{num_experts} experts are not divisible by tensor parallel size {tp_size} "
                                 f"(--enable-expert-parallel)")
            local = num_experts // tp_size
            self.first_expert, self.num_local_experts, self.inter = tp_rank * local, local, intermediate_size
            expert_map = torch.full((num_experts,), -1, dtype=torch.long)
            expert_map[self.first_expert : self.first_expert + local] = torch.arange(local)
            self.register_buffer("expert_map", expert_map, persistent=False)
        else:
            if intermediate_size % tp_size:
                raise ValueError(f"expert intermediate size {intermediate_size} is not divisible by tensor "
                                 f"parallel size {tp_size}")
            self.first_expert, self.num_local_experts = 0, num_experts
            self.inter = intermediate_size // tp_size
            self.expert_map = None
        self.tp_rank = tp_rank
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.inter, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.inter, dtype=dtype),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self.activation = activation
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.inter, dtype=dtype),
                                         requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, dtype=dtype),
                                        requires_grad=False)
            self.w13_bias.weight_loader = self.w2_bias.weight_loader = self.bias_loader
        self.packed: tuple | None = None  # see prepack_gemm
        # A quantized checkpoint's experts in a kernel format (load_quantized): per parameter, per
        # local expert, per part (gate 0 / up 1, down None) -> (qtype, this rank's arrays).
        self.quant_staged: dict[str, list[dict]] = {}
        self.quant_experts: tuple[list, list] | None = None  # (w13's, w2's) QuantWeight per local expert

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: tuple[int | None, int | None]) -> None:
        """`shard_id`: (global expert index, 0 gate / 1 up / None down), or (None, None) for all
        experts in one tensor (transformers 5's own layout: gate_up_proj [experts, 2 * inter,
        hidden], down_proj [experts, hidden, inter]). Experts of other ranks are skipped; with
        the intermediate dimension split, this rank's rows (gate, up) or columns (down)."""
        expert, part = shard_id
        if hasattr(loaded, "kernel_components"):  # a quantized stacked tensor (models/mxfp4.Mxfp4Weight)
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
        start = 0 if self.expert_parallel else self.tp_rank * self.inter
        if part is None:
            param.data[local].copy_(loaded[:, start : start + self.inter])
        else:
            param.data[local, part * self.inter : (part + 1) * self.inter].copy_(loaded[start : start + self.inter])

    def _load_stacked_quantized(self, param: nn.Parameter, loaded) -> None:
        """Every expert's matrix in one quantized tensor, [experts, outputs (gate rows then up rows
        for w13), inputs]: kept in its kernel format where the quantized kernels run (CPU),
        dequantized into the parameter elsewhere."""
        if not quant.takes_components(param.device):  # in our [experts, outputs, inputs] layout already
            FusedMoE.weight_loader(self, param, loaded.dequantized(param.dtype), (None, None))
            return
        qtype, arrays = loaded.kernel_components()
        for local in range(self.num_local_experts):
            expert = self.first_expert + local
            one = {key: array[expert] for key, array in arrays.items()}
            if param is self.w2_weight:
                self.load_quantized(param, one, qtype, (expert, None))
                continue
            total = one["u"].shape[0] // 2
            for part in (0, 1):
                self.load_quantized(param, {key: a[part * total : (part + 1) * total] for key, a in one.items()},
                                    qtype, (expert, part))

    def load_quantized(self, param: nn.Parameter, arrays: dict[str, torch.Tensor], qtype: str,
                       shard_id: tuple[int, int | None]) -> None:
        """One expert's matrix (or its gate / up part) as kernel components (kernels/quant.py:
        "u" [rows, k], "scale" and "mins" [rows, k / 32]), kept in that format: this rank's rows
        (gate, up) or whole blocks of 32 of its columns (down). `finish_quantized` makes the
        QuantWeights once every expert's parts are in."""
        expert, part = shard_id
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        start = 0 if self.expert_parallel else self.tp_rank * self.inter
        if part is None:  # down: columns start..start + inter, whole blocks of 32
            if start % 32 or self.inter % 32:
                raise ValueError(f"quantized experts: blocks of 32 inputs cannot split the intermediate size "
                                 f"into shards of {self.inter}")
            blocks = slice(start // 32, (start + self.inter) // 32)
            arrays = {key: a[:, start : start + self.inter] if key == "u" else a[:, blocks]
                      for key, a in arrays.items()}
        else:
            arrays = {key: a[start : start + self.inter] for key, a in arrays.items()}
        name = "w13" if param is self.w13_weight else "w2"
        experts = self.quant_staged.setdefault(name, [{} for _ in range(self.num_local_experts)])
        experts[local][part] = (qtype, {key: a.contiguous() for key, a in arrays.items()})

    def finish_quantized(self) -> None:
        """The staged quantized experts into one QuantWeight per expert and matrix (gate and up
        rows together); the float parameters they replace go to the meta device."""
        if not self.quant_staged:
            return
        weights = {}
        for name, param in (("w13", self.w13_weight), ("w2", self.w2_weight)):
            experts = self.quant_staged.get(name)
            parts = (0, 1) if name == "w13" else (None,)
            if experts is None or any(set(e) != set(parts) for e in experts):
                raise ValueError("a quantized MoE checkpoint must quantize every expert's gate, up and down "
                                 "matrices alike")
            weights[name] = []
            for expert in experts:
                qtypes = {expert[p][0] for p in parts}
                if len(qtypes) != 1:
                    raise ValueError(f"an expert's gate and up matrices are in different formats: {sorted(qtypes)}")
                arrays = {key: torch.cat([expert[p][1][key] for p in parts]) for key in expert[parts[0]][1]}
                components = quant.QuantComponents(arrays["u"], arrays["scale"], arrays.get("mins"))
                weights[name].append(quant.QuantWeight(qtypes.pop(), arrays["u"].shape[0], param.shape[2], None,
                                                       components=components))
        self.quant_staged = {}
        self.quant_experts = (weights["w13"], weights["w2"])
        self.w13_weight = nn.Parameter(self.w13_weight.detach().to("meta"), requires_grad=False)
        self.w2_weight = nn.Parameter(self.w2_weight.detach().to("meta"), requires_grad=False)

    def bias_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """Every expert's biases in one tensor: w13_bias [experts, 2 * inter] (gate, then up) or
        w2_bias [experts, hidden]. This rank's experts; with the intermediate dimension split, its
        gate and up parts, and the down bias on rank 0 only (the all-reduce adds it once)."""
        loaded = loaded[self.first_expert : self.first_expert + self.num_local_experts]
        if param is self.w2_bias:
            param.data.copy_(loaded if self.expert_parallel or self.tp_rank == 0 else torch.zeros_like(loaded))
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
        if self.quant_experts is not None:
            for weights in self.quant_experts:
                for weight in weights:
                    quant.pack_for_cpu(weight)
            return True
        w13, w2 = pack_expert_weights(self.w13_weight), pack_expert_weights(self.w2_weight)
        self.packed = (w13, w2) if w13 is not None and w2 is not None else None
        if self.packed is not None:
            self.w13_weight = nn.Parameter(self.w13_weight.detach().to("meta"), requires_grad=False)
            self.w2_weight = nn.Parameter(self.w2_weight.detach().to("meta"), requires_grad=False)
        return self.packed is not None

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        bias = None if self.w13_bias is None else (self.w13_bias, self.w2_bias)
        out = fused_moe(hidden, router_logits, self.w13_weight, self.w2_weight, self.top_k, self.renormalize,
                        self.expert_map, self.quant_experts or self.packed, bias, self.activation)
        return all_reduce(out)


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
