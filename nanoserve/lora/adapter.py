"""A PEFT LoRA adapter directory read into plain tensors: per targeted module, A [r, in] and B
[out, r] with the adapter's scaling folded into B (alpha / r, or alpha / sqrt(r) with rsLoRA;
`rank_pattern` / `alpha_pattern` per module, matched as PEFT matches them). Anything the engine
would otherwise apply wrongly (DoRA, trained biases, extra saved modules, embedding or LM-head
adapters) is refused with one line naming it."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


class LoRAError(ValueError):
    """An adapter that can't be served: the message names the adapter and what is wrong."""


@dataclass(slots=True)
class AdapterModule:
    a: torch.Tensor  # [r, in], fp32
    b: torch.Tensor  # [out, r], fp32, times the module's scaling


@dataclass(slots=True)
class Adapter:
    path: str
    rank: int  # the largest module rank
    modules: dict[
        str, AdapterModule
    ]  # the base model's module name ("model.layers.0.self_attn.q_proj")


_PREFIX = "base_model.model."
# PEFT writes about 1 KiB; a config file larger than this is not one (and is not read whole).
MAX_CONFIG_BYTES = 1 << 20
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _fail(name: str, what: str) -> LoRAError:
    return LoRAError(f"LoRA adapter {name!r}: {what}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(slots=True)
class _Config:
    """adapter_config.json's fields that nanoserve uses, each checked for its JSON type."""

    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: list[tuple[re.Pattern, int]]
    alpha_pattern: list[tuple[re.Pattern, float]]

    def scale(self, module: str) -> float:
        """PEFT's scaling for one module: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        alpha = _pattern_value(self.alpha_pattern, module, self.alpha)
        r = _pattern_value(self.rank_pattern, module, self.r)
        return alpha / (math.sqrt(r) if self.use_rslora else r)


def _pattern_value(patterns: list[tuple[re.Pattern, float]], module: str, default):
    """PEFT's rule: a key matches a module whose name is the key or ends with "." + key (keys
    are regular expressions)."""
    for pattern, value in patterns:
        if pattern.match(module):
            return value
    return default


def _patterns(
    name: str, config: dict, key: str, check, what: str
) -> list[tuple[re.Pattern, float]]:
    patterns = config.get(key) or {}
    if not isinstance(patterns, dict):
        raise _fail(
            name, f"adapter_config.json: {key} must be an object, got {_json_type(patterns)}"
        )
    compiled = []
    for module, value in patterns.items():
        if not check(value):
            raise _fail(
                name,
                f"adapter_config.json: {key}[{module!r:.80}] must be {what}, got {value!r:.80}",
            )
        try:
            compiled.append((re.compile(rf"(.*\.)?({module})$"), value))
        except re.error as error:
            raise _fail(
                name,
                f"adapter_config.json: {key} key {module!r:.80} is not a regular "
                f"expression ({error})",
            ) from None
    return compiled


def _json_type(value) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
    }
    return names.get(type(value), "a number")


def _read_config(directory: Path, name: str) -> dict:
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise _fail(
            name,
            "no adapter_config.json there (nanoserve loads PEFT adapter directories "
            "from local disk)",
        )
    try:
        with open(config_file, "rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise _fail(name, f"adapter_config.json can't be read: {error.strerror or error}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise _fail(name, f"adapter_config.json is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(data)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise _fail(
            name, f"adapter_config.json is not JSON: {error or 'nested too deeply'}"
        ) from None
    if not isinstance(config, dict):
        raise _fail(name, f"adapter_config.json must be a JSON object, got {_json_type(config)}")
    return config


def _check_config(config: dict, name: str) -> _Config:
    """Refuse what the engine would apply wrongly; type-check what it uses."""
    for key, what in (("peft_type", "a string"), ("bias", "a string")):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise _fail(name, f"adapter_config.json: {key} must be {what}, got {config[key]!r:.80}")
    for key in ("use_dora", "fan_in_fan_out", "use_rslora"):
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise _fail(
                name, f"adapter_config.json: {key} must be true or false, got {config[key]!r:.80}"
            )
    peft_type = (config.get("peft_type") or "LORA").upper()
    if peft_type != "LORA":
        raise _fail(name, f"peft_type {peft_type:.80} is not supported (only LORA)")
    bias = config.get("bias") or "none"
    refusals = [
        (config.get("use_dora"), "use_dora (DoRA)"),
        (bias != "none", f"bias {bias!r:.80} (only 'none')"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out"),
        (config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')!r:.200}"),
    ]
    for refused, what in refusals:
        if refused:
            raise _fail(name, f"{what} is not supported")
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if not (_is_int(r) and r > 0):
        raise _fail(name, f"adapter_config.json: r must be a positive integer, got {r!r:.80}")
    if not _is_number(alpha):
        raise _fail(
            name, f"adapter_config.json: lora_alpha must be a finite number, got {alpha!r:.80}"
        )
    rank_pattern = _patterns(
        name, config, "rank_pattern", lambda v: _is_int(v) and v > 0, "a positive integer"
    )
    alpha_pattern = _patterns(name, config, "alpha_pattern", _is_number, "a finite number")
    return _Config(r, float(alpha), bool(config.get("use_rslora")), rank_pattern, alpha_pattern)


def _check_tensor(
    name: str, key: str, part: str, shape: list[int], dtype: str, max_rank: int
) -> None:
    """From the file's header, before a byte of the tensor is read."""
    if dtype not in _FLOAT_DTYPES:
        raise _fail(name, f"adapter_model.safetensors: {key} has dtype {dtype}, not a float type")
    if len(shape) != 2:
        raise _fail(name, f"adapter_model.safetensors: {key} must be 2-D, got shape {list(shape)}")
    rank = shape[0] if part == "A" else shape[1]
    if rank < 1:
        raise _fail(name, f"adapter_model.safetensors: {key} has rank 0 (shape {list(shape)})")
    if rank > max_rank:  # vLLM's message
        raise LoRAError(
            f"LoRA rank {rank} is greater than max_lora_rank {max_rank} (adapter {name!r})"
        )


def _read_weights(
    weights_file: Path, name: str, max_rank: int
) -> dict[str, dict[str, torch.Tensor]]:
    """Each module's A and B (fp32). Every tensor's name, dtype and shape are checked in the
    header first; values must be finite (a NaN in A would reach every row of a step through
    the shared shrink GEMM, whatever the row's adapter)."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as handle:
            for key in handle.keys():
                match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
                if match is None:
                    what = (
                        "an embedding adapter"
                        if "lora_embedding" in key
                        else "a tensor that is not a LoRA A or B"
                    )
                    raise _fail(name, f"{key:.200} is {what}, which nanoserve does not serve")
                module, part = match.group(1).removeprefix(_PREFIX), match.group(2)
                header = handle.get_slice(key)
                _check_tensor(name, key, part, header.get_shape(), header.get_dtype(), max_rank)
                if part in tensors.setdefault(module, {}):
                    raise _fail(
                        name, f"adapter_model.safetensors holds lora_{part} of {module:.200} twice"
                    )
                tensor = handle.get_tensor(key).float()
                if not torch.isfinite(tensor).all():
                    raise _fail(
                        name, f"adapter_model.safetensors: {key} holds NaN or infinite values"
                    )
                tensors[module][part] = tensor
    except (SafetensorError, OSError) as error:
        raise _fail(name, f"adapter_model.safetensors can't be read: {error}") from None
    return tensors


def read_adapter(path: str | Path, max_rank: int) -> Adapter:
    """The adapter at `path`; anything malformed (a config field of the wrong type, a weights
    file that is not safetensors, tensors of the wrong shape) is a LoRAError naming it."""
    name = str(path)
    try:
        directory = Path(path).expanduser()
        config = _check_config(_read_config(directory, name), name)
        for extra in (
            "new_embeddings.safetensors",
            "new_embeddings.bin",
        ):  # vLLM's (deprecated) added tokens
            if (directory / extra).is_file():
                raise _fail(
                    name, f"{extra} (tokens the adapter adds to the vocabulary) is not supported"
                )
        weights_file = directory / "adapter_model.safetensors"
        weights_exist = weights_file.is_file()
    except (OSError, ValueError) as error:  # a path the OS refuses (too long, a NUL byte)
        if isinstance(error, LoRAError):
            raise
        raise _fail(name, f"not a readable directory ({error})") from None
    if not weights_exist:
        raise _fail(name, "no adapter_model.safetensors (nanoserve reads safetensors only)")
    modules = {}
    for module, pair in _read_weights(weights_file, name, max_rank).items():
        if set(pair) != {"A", "B"}:
            raise _fail(name, f"module {module} has lora_{''.join(pair)} only")
        a, b = pair["A"], pair["B"]
        if b.shape[1] != a.shape[0]:
            raise _fail(
                name,
                f"module {module}'s A {list(a.shape)} and B {list(b.shape)} do not fit together",
            )
        modules[module] = AdapterModule(a.contiguous(), (b * config.scale(module)).contiguous())
    if not modules:
        raise _fail(name, "adapter_model.safetensors holds no LoRA weights")
    return Adapter(name, max(m.a.shape[0] for m in modules.values()), modules)
