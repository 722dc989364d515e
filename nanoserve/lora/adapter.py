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
from safetensors import safe_open


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
    modules: dict[str, AdapterModule]  # the base model's module name ("model.layers.0.self_attn.q_proj")


_PREFIX = "base_model.model."


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule: a key matches a module whose name is the key or ends with "." + key (keys
    are regular expressions)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter(path: str | Path, max_rank: int) -> Adapter:
    directory = Path(path).expanduser()
    name = str(path)
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_config.json there (nanoserve loads PEFT "
                        "adapter directories from local disk)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not JSON: {error}") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {peft_type} is not supported (only LORA)")
    refusals = [
        (config.get("use_dora"), "use_dora (DoRA)"),
        (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} (only 'none')"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out"),
        (config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')}"),
    ]
    for refused, what in refusals:
        if refused:
            raise LoRAError(f"LoRA adapter {name!r}: {what} is not supported")
    for extra in ("new_embeddings.safetensors", "new_embeddings.bin"):  # vLLM's (deprecated) added tokens
        if (directory / extra).is_file():
            raise LoRAError(f"LoRA adapter {name!r}: {extra} (tokens the adapter adds to the vocabulary) is "
                            "not supported")
    weights_file = directory / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_model.safetensors (nanoserve reads safetensors only)")
    r, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), framework="pt") as handle:
        for key in handle.keys():
            match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
            if match is None:
                what = "an embedding adapter" if "lora_embedding" in key else "a tensor that is not a LoRA A or B"
                raise LoRAError(f"LoRA adapter {name!r}: {key} is {what}, which nanoserve does not serve")
            module = match.group(1).removeprefix(_PREFIX)
            tensors.setdefault(module, {})[match.group(2)] = handle.get_tensor(key).float()
    modules = {}
    for module, pair in tensors.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: module {module} has lora_{''.join(pair)} only")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise LoRAError(f"LoRA adapter {name!r}: module {module}'s A {list(a.shape)} and B "
                            f"{list(b.shape)} do not fit together")
        if rank > max_rank:  # vLLM's message
            raise LoRAError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank} (adapter {name!r})")
        module_alpha = float(_pattern_value(alpha_pattern, module, alpha))
        module_r = int(_pattern_value(rank_pattern, module, r))
        scale = module_alpha / (math.sqrt(module_r) if config.get("use_rslora") else module_r)
        modules[module] = AdapterModule(a.contiguous(), (b * scale).contiguous())
    if not modules:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    return Adapter(str(path), max(m.a.shape[0] for m in modules.values()), modules)
