"""Hugging Face checkpoints quantized by GPTQ (AutoGPTQ / GPTQModel / optimum) and AWQ (AutoAWQ's
GEMM format): the int4 and int8 checkpoints most quantized models on the Hub come in, which
`vllm serve` runs as `--quantization gptq` / `awq` (or their marlin variants). config.json's
`quantization_config` is read and checked, and each quantized layer's `qweight` / `qzeros` /
`scales` (/ `g_idx`) are turned into the integers and scales the GGUF block kernels multiply
(models/quant_staging.IntegerWeight -> Q4_0 / Q4_1 / Q8_0 components; no new kernel).

The formats (w[i, o] for input i, output o; scales [groups, n] float16):
- GPTQ: `qweight` int32 [k * bits / 32, n], the values of inputs 32/bits * r ... packed into row r
  from bit 0 up; `qzeros` int32 [groups, n * bits / 32], zero points packed along the outputs
  the same way; `g_idx` int32 [k], each input's group. w = scale[g] * (q - z[g]), where z is
  the stored zero point plus one in the original ("gptq", v1) checkpoint format (AutoGPTQ
  subtracted one before packing; vLLM adds it back per value), as stored in "gptq_v2".
  Symmetric checkpoints store z = 2^(bits-1) everywhere: those become Q4_0 / Q8_0, the others
  (4-bit) Q4_1. `desc_act` (activation order, a `g_idx` that isn't i // group_size): the
  layer's inputs are sorted by group at load and its activations gathered in that order
  (models/quant_staging.IntegerCheckpointLoader, QuantizedWeight.input_perm).
- AWQ (version "gemm"): `qweight` int32 [k, n / 8] and `qzeros` int32 [groups, n / 8], packed
  along the outputs in the order 0, 2, 4, 6, 1, 3, 5, 7 within each word; w = scale[g] * (q - z[g]).
  Always Q4_1 (with `zero_point` false, Q4_0 around 8).

Refused with one line naming what: bits other than 4 and 8 (AWQ: 4), GPTQ's per-module
`dynamic` overrides, AWQ versions other than gemm (gemv, gemv_fast, marlin, exllama), a group
size that is neither -1 nor a positive number. Layers in AWQ's `modules_to_not_convert` (and an
unquantized lm_head) are float in the checkpoint and stay float. A layer the kernels can't take
(groups not a multiple of 32, act order in a row-parallel layer under tensor parallelism,
asymmetric int8, a MoE expert on CUDA) is dequantized into its float weight at load, as
compressed-tensors' are. On CUDA the layers stay integers too, for the Triton kernels, with a
scale once per group (kernels/quant_blocks.py: about the checkpoint's bytes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve.models.quant_staging import IntegerWeight, unpack_int32

GPTQ, AWQ = "gptq", "awq"
METHODS = (GPTQ, AWQ)
# `--quantization` values that name each (vLLM's marlin kernels serve the same checkpoints).
FLAG_ALIASES = {GPTQ: (GPTQ, "gptq_marlin"), AWQ: (AWQ, "awq_marlin")}
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds output 8w + _AWQ_ORDER[j]


def _refuse(method: str, what: str) -> ValueError:
    served = "4- and 8-bit GPTQ" if method == GPTQ else "4-bit AWQ (version gemm)"
    return ValueError(
        f"{method.upper()} {what} is not supported; nanoserve serves {served} checkpoints"
    )


def _unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows, w] -> int16 [rows, w * 32 / bits]: each word's values from bit 0 up, unsigned."""
    return unpack_int32(words, bits, words.shape[1] * (32 // bits)).to(torch.int16)


@dataclass(frozen=True)
class GroupQuantConfig:
    """A GPTQ or AWQ checkpoint's quantization_config, checked (models/quant_staging.IntegerFormat
    and its one scheme)."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group per row
    symmetric: bool  # GPTQ's sym / AWQ's not zero_point: zero points 2^(bits-1) (AWQ: none stored)
    zeros_minus_one: bool  # GPTQ v1 checkpoint format: stored zero point = z - 1
    marker = "qweight"
    skips_zero_bias = True
    tensor_roles = ("qweight", "qzeros", "scales", "g_idx")

    # -- IntegerFormat ---------------------------------------------------------------------
    def scheme_for(self, layer: str) -> GroupQuantConfig:
        return self

    def takes_role(self, layer: str, role: str) -> bool:
        return role != "weight"  # (a quantized layer has no float weight; ignore none)

    # -- IntegerScheme ---------------------------------------------------------------------
    def roles(self) -> set[str]:
        if self.method == AWQ:
            return {"qweight", "scales"} | (set() if self.symmetric else {"qzeros"})
        return {"qweight", "qzeros", "scales"}  # g_idx is optional (absent: i // group_size)

    def integers(self, tensors: dict[str, torch.Tensor], layer: str) -> IntegerWeight:
        bits, half = self.bits, 1 << (self.bits - 1)
        qweight, scales = tensors["qweight"], tensors["scales"]
        if qweight.dtype != torch.int32:
            raise ValueError(f"{layer}.qweight: expected int32 words, found {qweight.dtype}")
        scale = scales.float().t().contiguous()  # [n, groups]
        if self.method == GPTQ:
            u = _unpack_words(qweight.t().contiguous(), bits)  # [n, k]: packed along the inputs
        else:
            u = self._awq_columns(_unpack_words(qweight, bits)).t().contiguous()  # [k, n] -> [n, k]
        n, k = u.shape
        if scale.shape[0] != n:
            raise ValueError(
                f"{layer}.scales: shape {list(scales.shape)} does not fit a [{n}, {k}] weight"
            )
        group = k if self.group_size == -1 else self.group_size
        if scale.shape[1] != -(-k // group):
            raise ValueError(
                f"{layer}.scales: {scale.shape[1]} groups do not fit {k} inputs in groups of {group}"
            )
        zero = None
        if "qzeros" in tensors:
            z = _unpack_words(tensors["qzeros"], bits)  # [groups, n (padded to a word)]
            if self.method == AWQ:
                z = self._awq_columns(z)
            z = z[:, :n]
            if self.zeros_minus_one:
                z = z + 1  # per value, as vLLM reads v1 (a stored 2^bits - 1 means 2^bits)
            z = z.t().contiguous() - half  # [n, groups], signed
            zero = None if not bool(z.any()) else z
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            g_idx = g_idx.to(torch.int64)
            if (
                g_idx.shape != (k,)
                or bool((g_idx < 0).any())
                or bool((g_idx >= scale.shape[1]).any())
            ):
                raise ValueError(
                    f"{layer}.g_idx: shape {list(tensors['g_idx'].shape)} or values do not fit "
                    f"{k} inputs in {scale.shape[1]} groups"
                )
            if torch.equal(g_idx, torch.arange(k) // group):
                g_idx = None  # groups in input order (desc_act off): runs of inputs
        return IntegerWeight(u - half, scale, zero, group, bits, g_idx)

    @staticmethod
    def _awq_columns(values: torch.Tensor) -> torch.Tensor:
        """AWQ's words hold outputs 0, 2, 4, 6, 1, 3, 5, 7: [rows, n] back in output order."""
        rows, n = values.shape
        inverse = torch.argsort(torch.tensor(_AWQ_ORDER))
        return values.reshape(rows, n // 8, 8)[:, :, inverse].reshape(rows, n)


def parse_config(config: dict) -> GroupQuantConfig:
    """quantization_config (quant_method "gptq" or "awq") -> GroupQuantConfig (ValueError, one line)."""
    method = config.get("quant_method")
    bits = config.get("bits", config.get("w_bit", 4))
    group_size = config.get("group_size", config.get("q_group_size", 128))
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise _refuse(method, f"group_size {group_size!r}")
    if method == GPTQ:
        if bits not in (4, 8):
            raise _refuse(method, f"{bits}-bit weights")
        if config.get("dynamic"):
            raise _refuse(method, "per-module overrides (dynamic)")
        form = config.get("checkpoint_format", "gptq")
        if form not in ("gptq", "gptq_v2"):
            raise _refuse(method, f"checkpoint_format {form!r}")
        # (desc_act is not read: g_idx says whether a layer's groups are in input order.)
        return GroupQuantConfig(
            GPTQ, bits, group_size, bool(config.get("sym", True)), form == "gptq"
        )
    if method == AWQ:
        if bits != 4:
            raise _refuse(method, f"{bits}-bit weights")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse(method, f"version {version!r}")
        return GroupQuantConfig(AWQ, bits, group_size, not config.get("zero_point", True), False)
    raise ValueError(f"quant_method {method!r} is not GPTQ or AWQ")


def group_quant_config(model_dir: Path) -> GroupQuantConfig | None:
    """The checkpoint's GPTQ / AWQ config, checked; None when it has neither. An older GPTQ
    checkpoint keeps it in quantize_config.json (AutoGPTQ), without a quant_method."""
    model_dir = Path(model_dir)
    config_file = model_dir / "config.json"
    if config_file.is_file():
        quantization = json.loads(config_file.read_text()).get("quantization_config") or {}
        if quantization.get("quant_method") in METHODS:
            return parse_config(quantization)
        if quantization:
            return None
    legacy = model_dir / "quantize_config.json"
    if legacy.is_file():
        return parse_config({"quant_method": GPTQ, **json.loads(legacy.read_text())})
    return None
