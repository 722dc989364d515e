"""Load a safetensors checkpoint (one file or sharded with an index) into a model, each
parameter taking only its own shard through its weight_loader."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from torch import nn

from nanoserve.distributed.pipeline import is_missing_parameter, missing_prefixes
from nanoserve.layers.fused_moe import FusedMoE, expert_weight_target
from nanoserve.layers.linear import load_parameter
from nanoserve.models.mxfp4 import Mxfp4Tensors
from nanoserve.models.quant_staging import IntegerCheckpointLoader, IntegerFormat


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{model_dir}: shard(s) listed in the index are missing: {', '.join(missing)}"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights found")
    return files


def _target(name_in_model: str, packed: dict, renames: dict) -> tuple[str, object]:
    """(the parameter a checkpoint tensor loads into, the shard id its loader takes)."""
    for old, new in renames.items():
        name_in_model = name_in_model.replace(old, new)
    expert = expert_weight_target(name_in_model)  # MoE: into the experts' stacked parameters
    if expert is not None:
        return expert
    for fragment, (fused, shard) in packed.items():
        if f".{fragment}." in name_in_model:
            return name_in_model.replace(f".{fragment}.", f".{fused}."), shard
    return name_in_model, None


def _tensor_names(files: list[Path]) -> list[str]:
    names = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names += list(f.keys())
    return names


def _extra_zero_bias(quantization: IntegerFormat, f, tensor_name: str) -> bool:
    """A GPTQ checkpoint may hold a bias of zeros for layers that have none (AutoGPTQ's): skipped,
    as vLLM skips it. A bias that isn't zero is still an error (the model would lose it)."""
    if not (quantization.skips_zero_bias and tensor_name.endswith(".bias")):
        return False
    return not bool(f.get_tensor(tensor_name).any())


def load_weights(
    model: nn.Module,
    model_dir: Path,
    quantization: IntegerFormat | None = None,
    mxfp4: Mxfp4Tensors | None = None,
) -> None:
    """Every tensor into its parameter. `quantization`: the config of a checkpoint of integers
    and scales (compressed-tensors, GPTQ, AWQ); its quantized layers' tensors go to
    models/quant_staging.IntegerCheckpointLoader instead. `mxfp4`: an MXFP4 checkpoint's
    blocks and scales are paired into one Mxfp4Weight for the experts' loader (models/mxfp4.py).
    MoE experts a checkpoint holds quantized are made into their QuantWeights at the end."""
    params = dict(model.named_parameters(remove_duplicate=False))
    # A headless decoder (e5-mistral's MistralModel, ...): its tensors are the decoder's, named
    # without "model."; the LM head stays unloaded (a pooling model never computes logits).
    headless = bool(getattr(model.config, "headless", False))
    if headless:
        params.pop("lm_head.weight", None)
    packed = getattr(model, "packed_modules", {})
    renames = getattr(model, "checkpoint_renames", {})  # checkpoint fragment -> ours (Mixtral)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    # Pipeline parallelism: tensors of other stages' modules are skipped. A last stage without the
    # embedding loads a tied LM head from the embedding's tensor.
    missing = missing_prefixes(model)
    tied_head_from_embedding = (
        tied and "lm_head.weight" in params and "model.embed_tokens.weight" not in params
    )
    files = checkpoint_files(model_dir)
    quantized = (
        None
        if quantization is None
        else IntegerCheckpointLoader.for_checkpoint(quantization, model, _tensor_names(files))
    )
    loaded_names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                source = None  # the paired MXFP4 weight; None: the loader reads a safetensors slice
                if mxfp4 is not None and mxfp4.owns(name):
                    paired = mxfp4.add(name, f.get_tensor(name))
                    if paired is None:
                        continue
                    name, source = paired
                tensor_name = name
                name, role = (name, None) if quantized is None else quantized.split_name(name)
                if headless and not name.startswith("model."):
                    name = "model." + name
                if tied and name == "lm_head.weight":
                    continue
                if tied_head_from_embedding and name == "model.embed_tokens.weight":
                    name_in_model = "lm_head.weight"
                elif is_missing_parameter(name, missing):
                    continue
                else:
                    name_in_model = name
                target, shard_id = _target(name_in_model, packed, renames)
                param = params.get(target)
                if (
                    param is None
                    and quantized is not None
                    and _extra_zero_bias(quantization, f, tensor_name)
                ):
                    continue
                if param is None:
                    raise ValueError(
                        f"{file.name}: unexpected tensor {tensor_name!r} for this architecture"
                    )
                loaded_names.add(target)
                if role is not None:
                    layer = tensor_name[: tensor_name.rindex(".")]
                    quantized.add(layer, role, f.get_tensor(tensor_name), target, param, shard_id)
                    continue
                load_parameter(
                    param, f.get_slice(tensor_name) if source is None else source, shard_id
                )
    if quantized is not None:
        quantized.finish()
    if mxfp4 is not None:
        mxfp4.finish()
    for module in model.modules():
        if isinstance(module, FusedMoE):  # its quantized experts
            module.finish_quantized()
    expected = {
        n for n in params if not (tied and n == "lm_head.weight" and not tied_head_from_embedding)
    }
    absent = sorted(expected - loaded_names)
    if absent:
        raise ValueError(
            f"{model_dir}: checkpoint lacks {len(absent)} tensor(s), e.g. {absent[:3]}"
        )
