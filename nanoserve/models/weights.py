"""Load a safetensors checkpoint (one file or sharded with an index) into a model, each
parameter taking only its own shard through its weight_loader."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Layout:
    """How this model's parameters are named and which it holds, where that differs from its
    checkpoint: a headless decoder, a tied LM head, a pipeline stage's missing modules, fused
    (packed) projections, renamed fragments. `steps`: the name steps that apply to it, in order."""

    params: dict[str, nn.Parameter]
    packed: dict
    renames: dict
    tied: bool
    tied_head_from_embedding: bool
    missing: tuple[str, ...]
    steps: tuple[NameStep, ...]
    skips: tuple[str, ...] = ()  # checkpoint tensors (name prefixes) the model does not use
    # (checkpoint prefix, ours) pairs: a wrapper's names for its parts (LLaVA's language_model.)
    prefixes: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, model: nn.Module) -> _Layout:
        params = dict(model.named_parameters(remove_duplicate=False))
        headless = bool(getattr(model.config, "headless", False))
        if headless:
            params.pop("lm_head.weight", None)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        prefixes = tuple(getattr(model, "checkpoint_prefixes", ()))
        steps = (
            *((_wrapper_prefix,) if prefixes else ()),
            _skip_unused,
            *((_headless_prefix,) if headless else ()),
            *((_skip_tied_head,) if tied else ()),
            _pipeline_stage,
        )
        return cls(
            params=params,
            packed=getattr(model, "packed_modules", {}),
            renames=getattr(model, "checkpoint_renames", {}),  # checkpoint fragment -> ours
            tied=tied,
            # A last pipeline stage without the embedding loads a tied LM head from its tensor.
            tied_head_from_embedding=tied
            and "lm_head.weight" in params
            and "model.embed_tokens.weight" not in params,
            missing=missing_prefixes(model),
            steps=steps,
            skips=tuple(getattr(model, "checkpoint_skips", ())),
            prefixes=prefixes,
        )

    def model_name(self, name: str) -> str | None:
        """The name a checkpoint tensor has in this model, or None: not this model's to load."""
        for step in self.steps:
            name = step(self, name)
            if name is None:
                return None
        return name

    def expected(self) -> set[str]:
        """The parameters the checkpoint must fill (a tied head is the embedding's, unless it is
        loaded from the embedding's tensor on a stage without the embedding)."""
        return {
            n
            for n in self.params
            if not (self.tied and n == "lm_head.weight" and not self.tied_head_from_embedding)
        }


# A step from a checkpoint tensor's name towards this model's: the next name, or None: skip it.
NameStep = Callable[[_Layout, str], str | None]


def _skip_unused(layout: _Layout, name: str) -> str | None:
    """Tensors the model never reads (an encoder's unused pooler or masked-LM head)."""
    return None if name.startswith(layout.skips) else name


def _wrapper_prefix(layout: _Layout, name: str) -> str | None:
    """A vision-language checkpoint's parts under their wrapper's prefixes, renamed to ours (the
    first matching prefix; transformers 4.x and 5.x name them differently)."""
    for old, new in layout.prefixes:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _headless_prefix(layout: _Layout, name: str) -> str | None:
    """A headless decoder (e5-mistral's MistralModel, ...): its tensors are the decoder's, named
    without "model."; the LM head stays unloaded (a pooling model never computes logits)."""
    return name if name.startswith("model.") else "model." + name


def _skip_tied_head(layout: _Layout, name: str) -> str | None:
    """A tied LM head is the embedding: a checkpoint's own copy of it is not loaded."""
    return None if name == "lm_head.weight" else name


def _pipeline_stage(layout: _Layout, name: str) -> str | None:
    """Pipeline parallelism: tensors of other stages' modules are skipped; a last stage without
    the embedding takes the embedding's tensor as its tied LM head."""
    if layout.tied_head_from_embedding and name == "model.embed_tokens.weight":
        return "lm_head.weight"
    if is_missing_parameter(name, layout.missing):
        return None
    return name


def _checkpoint_tensor(f, name: str, mxfp4: Mxfp4Tensors | None) -> tuple[str, object] | None:
    """(the tensor's name, its paired MXFP4 weight or None: the loader reads a safetensors slice),
    or None for a tensor not loaded by itself: a rotary cache, half of an MXFP4 pair."""
    if "rotary_emb.inv_freq" in name:
        return None
    if mxfp4 is not None and mxfp4.owns(name):
        return mxfp4.add(name, f.get_tensor(name))
    return name, None


def _finish(
    model: nn.Module, quantized: IntegerCheckpointLoader | None, mxfp4: Mxfp4Tensors | None
) -> None:
    """Weights made of several tensors are built once all have arrived: integer layers, MXFP4
    experts, MoE experts a checkpoint holds quantized."""
    if quantized is not None:
        quantized.finish()
    if mxfp4 is not None:
        mxfp4.finish()
    for module in model.modules():
        if isinstance(module, FusedMoE):  # its quantized experts
            module.finish_quantized()


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
    layout = _Layout.of(model)
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
                target = _load_tensor(layout, file, f, name, quantization, quantized, mxfp4)
                if target is not None:
                    loaded_names.add(target)
    _finish(model, quantized, mxfp4)
    absent = sorted(layout.expected() - loaded_names)
    if absent:
        raise ValueError(
            f"{model_dir}: checkpoint lacks {len(absent)} tensor(s), e.g. {absent[:3]}"
        )


def _load_tensor(
    layout: _Layout,
    file: Path,
    f,
    name: str,
    quantization: IntegerFormat | None,
    quantized: IntegerCheckpointLoader | None,
    mxfp4: Mxfp4Tensors | None,
) -> str | None:
    """One checkpoint tensor into its parameter (an integer layer's part to `quantized`): the
    parameter's name, or None where the tensor is not this model's to load."""
    checkpoint = _checkpoint_tensor(f, name, mxfp4)
    if checkpoint is None:
        return None
    tensor_name, source = checkpoint
    name, role = (tensor_name, None) if quantized is None else quantized.split_name(tensor_name)
    name_in_model = layout.model_name(name)
    if name_in_model is None:
        return None
    target, shard_id = _target(name_in_model, layout.packed, layout.renames)
    param = layout.params.get(target)
    if param is None and quantized is not None and _extra_zero_bias(quantization, f, tensor_name):
        return None
    if param is None:
        raise ValueError(f"{file.name}: unexpected tensor {tensor_name!r} for this architecture")
    if role is not None:
        layer = tensor_name[: tensor_name.rindex(".")]
        quantized.add(layer, role, f.get_tensor(tensor_name), target, param, shard_id)
    else:
        load_parameter(param, f.get_slice(tensor_name) if source is None else source, shard_id)
    return target
