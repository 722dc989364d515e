"""Hugging Face checkpoints with FP8 (E4M3) weights, served with their weights one byte each:
`quant_method: "fp8"` (vLLM's Fp8Config, transformers' FineGrainedFP8: Qwen3-*-FP8,
DeepSeek-style 128 x 128 blocks; AutoFP8's per-tensor checkpoints) here, compressed-tensors'
`float-quantized` (llm-compressor's FP8 and FP8-dynamic) in models/compressed_tensors.py; both
read into `Fp8Weight`, which the loader of integer checkpoints (models/quant_staging.
IntegerCheckpointLoader) stages for the FP8 kernel (kernels/quant.py FP8, kernels/cpu/
gemm_fp8.cpp) as it stages integers for theirs.

quant_method fp8: a quantized layer holds `weight` (float8_e4m3fn [n, k]) and either
`weight_scale_inv` [ceil(n / bn), ceil(k / bk)] (config `weight_block_size: [bn, bk]`; despite
its name it multiplies, w = fp8 * weight_scale_inv, as DeepSeek's and vLLM's kernels read it) or
`weight_scale` (one per tensor; AutoFP8), and with `activation_scheme: "static"` an `input_scale`.
Layers in `ignored_layers` / `modules_to_not_convert` have no scale and stay float.

How it runs: W8A16, as vLLM's CPU backend and its FP8 Marlin path on GPUs without FP8 arithmetic:
the weights stay FP8 and are widened in registers, the activations stay in their dtype, so an
activation scheme (dynamic per token, or a static `input_scale`) is accepted and not applied: the
products are those of the dequantized weights and the unrounded activations. Refused with one
line: E5M2 weights, NaN weights, a block size whose input side is not a multiple of 32 (the
kernel's scale block). On CUDA the weights stay FP8 too, for the Triton kernel (kernels/
quant_triton.py, widening each byte in registers; its scales once per block: kernels/
quant_blocks.py). A layer the kernels can't take (inputs not a multiple of 32, a MoE expert on
CUDA) is dequantized into its float weight at load, as the integer formats' are.

`--quantization fp8` on an unquantized checkpoint (vLLM's online FP8): `quantize_online` rounds
every linear layer's weight to E4M3 at load, a scale per output row (amax / 448; vLLM takes one
per tensor, a row's own is finer at no cost to the kernel), on the CPU and on CUDA. The LM head,
embeddings and MoE experts stay as they are. Under tensor parallelism a row-parallel layer's
rows span the ranks: their amax is the maximum over the ranks, so each rank holds the values one
rank would.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from nanoserve.kernels import quant

logger = logging.getLogger(__name__)

FP8_METHOD = "fp8"
_BLOCK = 32  # the kernel's scale block along the inputs


@dataclass
class Fp8Weight:
    """One FP8 layer: weight[o, i] = e4m3(q[o, i]) * scale[o, i // group]; what quant_staging's
    loader reads of an IntegerWeight (q's shape, g_idx, qtype, fits_kernels, kernel_arrays,
    dequantized)."""

    q: torch.Tensor  # uint8 [n, k]: the E4M3 bytes
    scale: torch.Tensor  # float32 [n, groups]: one scale per output row and group of inputs
    group: int  # inputs per scale (k for per-tensor and per-channel scales)
    g_idx = None
    qtype = quant.FP8

    def dequantized(self) -> torch.Tensor:
        """float32 [n, k]."""
        k = self.q.shape[1]
        return quant.fp8_values(self.q) * self.scale.repeat_interleave(self.group, dim=1)[:, :k]

    def fits_kernels(self, k_local: int) -> bool:
        k = self.q.shape[1]
        return self.group % _BLOCK == 0 and k_local % _BLOCK == 0 and k % k_local == 0

    def kernel_arrays(self) -> dict[str, torch.Tensor]:
        """The kernel format's components: the bytes, and a scale per block of 32 inputs."""
        blocks = self.q.shape[1] // _BLOCK
        per_block = self.scale.repeat_interleave(self.group // _BLOCK, dim=1)[:, :blocks]
        return {"u": self.q, "scale": per_block.contiguous()}


def fp8_weight(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, name: str
) -> Fp8Weight:
    """A layer's stored `weight` and scale read: `block` (rows, inputs) for block scales
    [ceil(n / rows), ceil(k / inputs)], else a scale per tensor ([] / [1]) or per output row
    ([n] / [n, 1]). ValueError naming the layer for anything else."""
    if weight.dtype == torch.float8_e5m2:
        raise ValueError(
            f"{name}.weight: FP8 E5M2 weights are not supported; nanoserve serves E4M3 (float8_e4m3fn)"
        )
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(
            f"{name}.weight: expected a float8_e4m3fn matrix, found {weight.dtype} {list(weight.shape)}"
        )
    q = weight.contiguous().view(torch.uint8)
    if bool(((q & 0x7F) == 0x7F).any()):
        raise ValueError(f"{name}.weight: the checkpoint has NaN FP8 weights")
    n, k = q.shape
    scale = scale.float()
    if block is not None:
        rows, inputs = block
        expected = (-(-n // rows), -(-k // inputs))
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"{name}: a block scale of shape {list(scale.shape)} does not fit a [{n}, {k}] weight "
                f"in blocks of {rows} x {inputs} (expected {list(expected)})"
            )
        per_row = scale.repeat_interleave(rows, dim=0)[:n]
        return Fp8Weight(q, per_row.contiguous(), inputs)
    if scale.numel() == 1:
        return Fp8Weight(q, scale.reshape(1, 1).expand(n, 1).contiguous(), k)
    if scale.numel() == n:
        return Fp8Weight(q, scale.reshape(n, 1).contiguous(), k)
    raise ValueError(
        f"{name}: a weight scale of shape {list(scale.shape)} does not fit a [{n}, {k}] weight "
        "(one per tensor or per output row expected)"
    )


def _refuse(what: str) -> ValueError:
    return ValueError(
        f"FP8 {what} is not supported; nanoserve serves FP8 (E4M3) weights with per-tensor, "
        "per-channel or block scales"
    )


@dataclass(frozen=True)
class _Scheme:
    marker: str
    block: tuple[int, int] | None

    def roles(self) -> set[str]:
        return {"weight", self.marker}

    def integers(self, tensors: dict[str, torch.Tensor], layer: str) -> Fp8Weight:
        return fp8_weight(tensors["weight"], tensors[self.marker], self.block, layer)


@dataclass(frozen=True)
class Fp8Config:
    """A quant_method "fp8" checkpoint's config (models/quant_staging.IntegerFormat)."""

    block: tuple[int, int] | None  # weight_block_size, or None (a scale per tensor)
    tensor_roles = ("weight_scale", "weight_scale_inv", "input_scale")
    skips_zero_bias = False

    @property
    def marker(self) -> str:
        return "weight_scale_inv" if self.block is not None else "weight_scale"

    def scheme_for(self, layer: str) -> _Scheme:
        return _Scheme(self.marker, self.block)

    def takes_role(self, layer: str, role: str) -> bool:
        if role in ("weight_scale", "weight_scale_inv") and role != self.marker:
            raise ValueError(
                f"{layer}.{role}: not what this checkpoint's config implies ({self.marker})"
            )
        return role != "input_scale"  # static activation scales: the activations stay unquantized


def fp8_config(model_dir: Path) -> Fp8Config | None:
    """The checkpoint's quant_method "fp8" config, checked; None when it has none."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    quantization = json.loads(config_file.read_text()).get("quantization_config") or {}
    if quantization.get("quant_method") != FP8_METHOD:
        return None
    scheme = quantization.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _refuse(f"activation_scheme {scheme!r}")
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(f"fmt {fmt!r}")
    block = quantization.get("weight_block_size")
    if block is None:
        return Fp8Config(None)
    problem = block_problem(block)
    if problem is not None:
        raise _refuse(f"weight_block_size {block!r}{problem}")
    return Fp8Config((block[0], block[1]))


def block_problem(block) -> str | None:
    """Why a checkpoint's [rows, inputs] block of scales can't be served (" (...)" or "" for a
    malformed one), or None: two positive integers, the inputs a multiple of the kernel's 32.
    quant_method fp8's weight_block_size, compressed-tensors' block_structure."""
    if not (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(v, int) and v > 0 for v in block)
    ):
        return ""
    if block[1] % _BLOCK:
        return f" (its input side must be a multiple of {_BLOCK})"
    return None


def quantize_online(model: nn.Module) -> int:
    """vLLM's `--quantization fp8` of an unquantized checkpoint: each linear layer (not the LM
    head, embeddings or MoE experts) whose inputs are a multiple of 32 keeps its weight in E4M3
    with a scale per output row, on the FP8 kernel; its float weight goes to the meta device.
    Returns the number of layers quantized. On CUDA the weights are held for the Triton FP8
    kernel (kernels/quant.place: the bytes and a scale per row)."""
    from nanoserve.distributed import all_reduce_max
    from nanoserve.layers.linear import LinearBase, RowParallelLinear
    from nanoserve.layers.linear_weight import QuantizedWeight

    quantized = 0
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or module.weight_form.quantized:
            continue
        weight = module.weight
        n, k = weight.shape
        if k % _BLOCK:
            logger.info(
                "%s: kept in %s (%d inputs, not a multiple of %d)", name, weight.dtype, k, _BLOCK
            )
            continue
        values = weight.detach().float()
        amax = values.abs().amax(dim=1)
        if isinstance(module, RowParallelLinear):
            amax = all_reduce_max(amax)
        largest = torch.finfo(torch.float8_e4m3fn).max  # 448
        scale = (amax / largest).clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
        q = (values / scale).clamp(-largest, largest).to(torch.float8_e4m3fn).view(torch.uint8)
        arrays = Fp8Weight(q.contiguous(), scale, k).kernel_arrays()
        components = quant.QuantComponents(arrays["u"].cpu(), arrays["scale"].cpu())
        held = quant.place(
            quant.QuantWeight(quant.FP8, n, k, None, components=components), weight.device
        )
        module.weight_form = QuantizedWeight([held])
        module.weight = nn.Parameter(
            torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False
        )
        quantized += 1
    logger.info(
        "online FP8: %d linear layers quantized to E4M3 (a scale per output row)", quantized
    )
    return quantized
