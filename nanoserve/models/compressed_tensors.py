"""Hugging Face checkpoints quantized by compressed-tensors (llm-compressor's output; what `vllm
serve` runs as W8A16, W8A8 and W4A16): config.json's `quantization_config` read and checked, and
each quantized linear layer's tensors turned into the integers and scales that the GGUF block
kernels already multiply (kernels/quant.py: QuantComponents; no new kernel).

What is served, as vLLM reads the config (`config_groups` with `targets` / `weights` /
`input_activations` / `format`, a global `format`, `ignore`):
- weights: symmetric int8 (`int-quantized` / `naive-quantized`: `weight` int8 [n, k]) or int4
  (`pack-quantized`: `weight_packed` int32, eight nibbles a word, with `weight_shape`; symmetric,
  or with `weight_zero_point`), scales per output channel, per group or per tensor
  (`weight_scale`). int8 becomes the Q8_0 kernel format (u = q + 128), symmetric int4 Q4_0
  (u = q + 8), int4 with zero points Q4_1 (u = q + 8, min = -scale * (zero point + 8)); the
  scales are repeated per block of 32 inputs, so a group must be a multiple of 32.
- activations: none (W8A16, W4A16) or int8 symmetric (W8A8). The kernel quantizes each
  activation row per block of 32 with its own scale (dynamic, finer than vLLM's per token);
  a static `input_scale` is accepted and not used (the dynamic per-block scale replaces it).
- FP8 weights (`float-quantized`: `weight` float8_e4m3fn with a scale per tensor, per output
  channel or per block of `block_structure`; llm-compressor's FP8 and FP8-dynamic schemes) are
  read by models/fp8.py and kept one byte each for the FP8 kernel; their FP8 activations (dynamic
  per token / group, or static) are not applied (W8A16, as vLLM's CPU backend runs them).
- refused with one line naming the scheme: other float weights or activations (NVFP4, MXFP4,
  FP8 activations beside int weights), asymmetric activations, asymmetric int8 weights, other
  bit widths, block strategies of int weights,
  activation-ordered groups (`weight_g_idx`), output activations, a KV cache scheme, transforms.

Which layers are quantized is what the checkpoint holds (a `weight_scale` beside the weight, so
`ignore`d ones such as lm_head stay float); each takes the scheme of the config group whose
targets name it (exactly or by `re:` regex), else the group targeting "Linear". A layer that the
kernels can't take (inputs not a multiple of 32, groups that aren't, a MoE expert on CUDA) is
dequantized into its float weight at load. On CUDA the Triton kernels take the same formats
(kernels/quant_blocks.py: a scale once per group).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve.models.fp8 import Fp8Weight, block_problem, fp8_weight
from nanoserve.models.quant_staging import IntegerWeight, unpack_int32

QUANT_METHOD = "compressed-tensors"
_INT_FORMATS = ("int-quantized", "naive-quantized")
_FLOAT_FORMAT = "float-quantized"
_FORMATS = (*_INT_FORMATS, "pack-quantized", _FLOAT_FORMAT)
_STRATEGIES = ("channel", "group", "tensor")
# The tensors beside a quantized layer's weight; `input_*` are read and not used.
_ROLES = (
    "weight_packed",
    "weight_shape",
    "weight_scale",
    "weight_zero_point",
    "weight_g_idx",
    "input_scale",
    "input_zero_point",
)


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weights, as far as serving them goes."""

    num_bits: int
    strategy: str  # "channel", "group" or "tensor"
    group_size: int | None
    symmetric: bool
    format: str  # "int-quantized", "naive-quantized", "pack-quantized" or "float-quantized"
    kind: str = "int"  # "float": FP8 (E4M3) weights (models/fp8.py)
    block: tuple[int, int] | None = None  # the "block" strategy's block_structure (FP8 only)

    def roles(self) -> set[str]:
        """The tensors a layer of this scheme must have."""
        names = {"weight_packed", "weight_shape"} if self.format == "pack-quantized" else {"weight"}
        return names | {"weight_scale"} | (set() if self.symmetric else {"weight_zero_point"})

    def integers(self, tensors: dict[str, torch.Tensor], layer: str) -> IntegerWeight | Fp8Weight:
        """The layer's tensors read (models/quant_staging.IntegerWeight, or models/fp8.Fp8Weight)."""
        if self.kind == "float":
            return fp8_weight(tensors["weight"], tensors["weight_scale"], self.block, layer)
        return _integers(self, tensors, layer)


@dataclass(frozen=True)
class CompressedTensorsConfig:
    """The checkpoint's config (models/quant_staging.IntegerFormat, for IntegerCheckpointLoader)."""

    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]  # (targets, scheme) in config order
    marker = "weight_scale"
    tensor_roles = _ROLES
    skips_zero_bias = False

    def takes_role(self, layer: str, role: str) -> bool:
        if role == "weight_g_idx":
            raise _refuse(f"activation-ordered groups ({layer}.weight_g_idx)")
        return not role.startswith(
            "input_"
        )  # static activation scales: the kernel's dynamic ones replace them

    def scheme_for(self, module_name: str) -> WeightScheme:
        """vLLM's order: a group naming the layer (exactly or by regex), then one targeting "Linear"."""
        for targets, scheme in self.groups:
            for target in targets:
                if (
                    target.startswith("re:")
                    and re.match(target[3:], module_name)
                    or target == module_name
                ):
                    return scheme
        for targets, scheme in self.groups:
            if "Linear" in targets:
                return scheme
        raise ValueError(
            f"{module_name} has a weight_scale but no compressed-tensors config group targets it"
        )


def checkpoint_quant_method(model_dir: Path) -> str | None:
    """config.json's quantization_config.quant_method ("unknown" when it names none), or None
    (no config.json, not quantized)."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    quantization = json.loads(config_file.read_text()).get("quantization_config")
    return None if not quantization else quantization.get("quant_method") or "unknown"


def _refuse(what: str) -> ValueError:
    return ValueError(
        f"compressed-tensors {what} is not supported; nanoserve serves int8 (W8A16, W8A8), "
        "int4 (W4A16) and FP8 (W8A16, W8A8) weights"
    )


def _check_activations(group: str, activations: dict | None, weight_kind: str) -> None:
    if activations is None:
        return
    if weight_kind == "float":  # FP8 weights: FP8 activations (dynamic or static) are not applied
        if activations.get("type") != "float" or activations.get("num_bits") != 8:
            raise _refuse(
                f"scheme {group}: {activations.get('type')}{activations.get('num_bits')} activations "
                "beside FP8 weights"
            )
        return
    if activations.get("type", "int") != "int" or activations.get("num_bits", 8) != 8:
        raise _refuse(
            f"scheme {group}: {activations.get('type')}{activations.get('num_bits')} activations"
        )
    if not activations.get("symmetric", True):
        raise _refuse(f"scheme {group}: asymmetric int8 activations")


def _weight_scheme(group: str, spec: dict, default_format: str | None) -> WeightScheme:
    """One config group checked (ValueError naming what is not supported)."""
    weights = spec.get("weights")
    if weights is None:
        raise _refuse(f"scheme {group} without weight quantization")
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if kind == "float" and bits == 8:
        return _fp8_scheme(group, spec, weights, default_format)
    if kind != "int" or bits not in (4, 8):
        raise _refuse(f"scheme {group}: {kind}{bits} weights")
    strategy, group_size = weights.get("strategy", "tensor"), weights.get("group_size")
    if strategy not in _STRATEGIES or (strategy == "group" and not group_size):
        raise _refuse(f"scheme {group}: weight strategy {strategy!r}")
    if weights.get("actorder") == "group":
        raise _refuse(f"scheme {group}: activation-ordered groups (actorder 'group')")
    symmetric = bool(weights.get("symmetric", True))
    if bits == 8 and not symmetric:
        raise _refuse(f"scheme {group}: asymmetric int8 weights")
    _check_activations(group, spec.get("input_activations"), "int")
    if spec.get("output_activations") is not None:
        raise _refuse(f"scheme {group}: output activation quantization")
    form = (
        spec.get("format") or default_format or ("pack-quantized" if bits == 4 else "int-quantized")
    )
    if form not in _FORMATS or form == _FLOAT_FORMAT:
        raise _refuse(f"format {form!r} for int{bits} weights")
    return WeightScheme(
        bits, strategy, group_size if strategy == "group" else None, symmetric, form
    )


def _fp8_scheme(group: str, spec: dict, weights: dict, default_format: str | None) -> WeightScheme:
    """An FP8 weight scheme: symmetric E4M3 weights with a scale per tensor, channel or block."""
    strategy = weights.get("strategy", "tensor")
    block = None
    if strategy == "block":
        structure = weights.get("block_structure")
        problem = block_problem(structure)
        if problem is not None:
            raise _refuse(f"scheme {group}: FP8 block_structure {structure!r}{problem}")
        block = (structure[0], structure[1])
    elif strategy not in ("tensor", "channel"):
        raise _refuse(f"scheme {group}: FP8 weight strategy {strategy!r}")
    if not weights.get("symmetric", True):
        raise _refuse(f"scheme {group}: asymmetric FP8 weights")
    _check_activations(group, spec.get("input_activations"), "float")
    if spec.get("output_activations") is not None:
        raise _refuse(f"scheme {group}: output activation quantization")
    form = spec.get("format") or default_format or _FLOAT_FORMAT
    if form not in (_FLOAT_FORMAT, "naive-quantized"):
        raise _refuse(f"format {form!r} for FP8 weights")
    return WeightScheme(8, strategy, None, True, form, kind="float", block=block)


def compressed_tensors_config(model_dir: Path) -> CompressedTensorsConfig | None:
    """The checkpoint's compressed-tensors config, checked; None when it has none."""
    if checkpoint_quant_method(model_dir) != QUANT_METHOD:
        return None
    config = json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]
    for key, what in (
        ("kv_cache_scheme", "KV cache quantization"),
        ("transform_config", "transforms"),
        ("sparsity_config", "sparsity"),
    ):
        value = config.get(key)
        if value and not (key == "sparsity_config" and value.get("format") == "dense"):
            raise _refuse(f"{what} ({key})")
    groups = config.get("config_groups") or {}
    if not groups:
        raise _refuse("config without config_groups")
    parsed = []
    for group, spec in groups.items():
        targets = spec.get("targets") or []
        parsed.append((tuple(targets), _weight_scheme(group, spec, config.get("format"))))
    return CompressedTensorsConfig(tuple(parsed))


# ---- a layer's tensors -> integers and scales -----------------------------------------------


def _per_row(values: torch.Tensor, n: int) -> torch.Tensor:
    """[n, columns] of a tensor stored per row ([n, columns]) or once for the tensor ([1], [])."""
    return values.reshape(n if values.numel() > 1 else 1, -1).expand(n, -1)


def _integers(scheme: WeightScheme, tensors: dict[str, torch.Tensor], name: str) -> IntegerWeight:
    half = 1 << (scheme.num_bits - 1)
    if scheme.format == "pack-quantized":
        n, k = (int(size) for size in tensors["weight_shape"].tolist())
        q = unpack_int32(tensors["weight_packed"], scheme.num_bits, k).to(torch.int16) - half
    else:
        weight = tensors["weight"]
        if weight.dtype != torch.int8:
            raise ValueError(
                f"{name}.weight: expected int8 values ({scheme.format}), found {weight.dtype}"
            )
        q = weight.to(torch.int16)
    n, k = q.shape
    scale = _per_row(tensors["weight_scale"].float(), n)
    group = k if scale.shape[1] == 1 else (scheme.group_size or 0)
    if scale.shape[1] != -(-k // max(group, 1)):
        raise ValueError(
            f"{name}.weight_scale: shape {list(tensors['weight_scale'].shape)} does not fit a "
            f"[{n}, {k}] weight ({scheme.strategy}, group size {scheme.group_size})"
        )
    zero = tensors.get("weight_zero_point")
    if zero is not None:
        if scheme.format == "pack-quantized" and zero.dtype == torch.int32:  # packed along the rows
            zero = unpack_int32(zero.t(), scheme.num_bits, n).t().to(torch.int16) - half
        zero = _per_row(zero.to(torch.int16), n).contiguous()
    return IntegerWeight(q, scale.contiguous(), zero, group, scheme.num_bits)


# ---- loading --------------------------------------------------------------------------------
