"""An mmproj file's tensors (models/gguf/mmproj.py reads and checks the file) into a LLaVA's
vision tower and projector: each tensor named as llama.cpp's LLaVA converter names it, mapped to
our parameter (Q/K/V into the fused qkv_proj, fc1 / fc2 under either of the converter's names),
dequantized to float32 by the gguf package and loaded in the activations' dtype."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from nanoserve.layers.linear import load_parameter
from nanoserve.models.gguf.header import GGUFTensorInfo
from nanoserve.models.gguf.mmproj import MMPROJ_PARAMETERS, MmprojFile, read_mmproj

_TOWER = "vision_tower.vision_model."
_FIXED_NAMES = {
    "v.class_embd": _TOWER + "embeddings.class_embedding",
    "v.patch_embd.weight": _TOWER + "embeddings.patch_embedding.weight",
    "v.position_embd.weight": _TOWER + "embeddings.position_embedding.weight",
    "v.pre_ln.weight": _TOWER + "pre_layrnorm.weight",
    "v.pre_ln.bias": _TOWER + "pre_layrnorm.bias",
    "mm.0.weight": "multi_modal_projector.linear_1.weight",
    "mm.0.bias": "multi_modal_projector.linear_1.bias",
    "mm.2.weight": "multi_modal_projector.linear_2.weight",
    "mm.2.bias": "multi_modal_projector.linear_2.bias",
}
_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_LAYER_TENSOR = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")
# Q/K/V go into the fused qkv_proj (models/clip.py), as a Hugging Face checkpoint's do.
_PACKED = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}


# CLIP's post-norm: LLaVA reads a layer's hidden state before it (transformers never applies
# it); older conversions kept it, clip.cpp applies it when present.
_UNUSED = ("v.post_ln.weight", "v.post_ln.bias")


def _parameter_name(file: MmprojFile, tensor_name: str) -> str | None:
    """Our parameter's name for a file tensor; None for one LLaVA does not read (a layer past
    the feature layer, the post-norm)."""
    if tensor_name in _UNUSED:
        return None
    name = _FIXED_NAMES.get(tensor_name)
    if name is not None:
        return name
    match = _LAYER_TENSOR.fullmatch(tensor_name)
    if match is None or match.group(2) not in _LAYER_PARTS:
        raise file.refuse(f"tensor {tensor_name} is not part of a CLIP tower or an mlp projector")
    layer, part, kind = int(match.group(1)), match.group(2), match.group(3)
    if layer >= file.vision.num_hidden_layers:
        raise file.refuse(
            f"tensor {tensor_name}: layer {layer} is past clip.vision.block_count "
            f"{file.vision.num_hidden_layers}"
        )
    if layer >= file.vision.num_layers_used:
        return None
    if file.ffn_names_swapped and part in ("ffn_up", "ffn_down"):
        part = "ffn_down" if part == "ffn_up" else "ffn_up"
    return f"{_TOWER}encoder.layers.{layer}.{_LAYER_PARTS[part]}.{kind}"


def _tensor_values(file: MmprojFile, tensor: GGUFTensorInfo) -> torch.Tensor:
    """float32 in torch's shape (GGUF lists dims fastest first)."""
    raw = np.fromfile(file.path, dtype=np.uint8, count=tensor.n_bytes, offset=tensor.data_offset)
    if raw.size != tensor.n_bytes:
        raise file.refuse(f"tensor {tensor.name}: the file ends inside its data")
    try:
        values = gguf.quants.dequantize(raw, tensor.tensor_type)
    except NotImplementedError:
        raise file.refuse(
            f"tensor {tensor.name}: type {tensor.tensor_type.name} cannot be dequantized"
        ) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape))


def load_mmproj_weights(model: nn.Module, mmproj: str | Path) -> None:
    """The vision tower's and projector's parameters from the mmproj file, dequantized into the
    activation dtype; every one of them must be there (one line naming the first missing ones)."""
    file = read_mmproj(mmproj)
    params = dict(model.named_parameters())
    expected = {name for name in params if name.startswith(MMPROJ_PARAMETERS)}
    if not expected:  # a rank > 0 under tensor parallelism: the tower lives on rank 0 only
        return
    loaded: set[str] = set()
    for tensor in file.header.tensors:
        name = _parameter_name(file, tensor.name)
        if name is None:
            continue
        shard_id = None
        stem, _, kind = name.rpartition(".")
        module = stem.rpartition(".")[2]
        if module in _PACKED:
            shard_id = _PACKED[module]
            name = f"{stem.rpartition('.')[0]}.qkv_proj.{kind}"
        param = params.get(name)
        if param is None:
            raise file.refuse(f"tensor {tensor.name} has no place in this model ({name})")
        values = _tensor_values(file, tensor)
        expected_shape = _part_shape(param, shard_id)
        if tuple(values.shape) != expected_shape:
            raise file.refuse(
                f"tensor {tensor.name} has shape {tuple(values.shape)} (torch order), the model "
                f"wants {expected_shape}"
            )
        load_parameter(param, values, shard_id)
        loaded.add(f"{name}:{shard_id}" if shard_id else name)
    missing = []
    for name in sorted(expected - loaded):
        parts = [s for s in "qkv" if f"{name}:{s}" not in loaded] if ".qkv_proj." in name else []
        if not parts and ".qkv_proj." not in name:
            missing.append(name)
        elif parts:
            missing.append(f"{name} (its {'/'.join(parts)} part)")
    if missing:
        raise file.refuse(f"lacks {len(missing)} tensor(s) this tower needs, e.g. {missing[:3]}")


def _part_shape(param: nn.Parameter, shard_id: str | None) -> tuple[int, ...]:
    """The shape a file tensor must have to fill `param` (a q, k or v part of the fused qkv)."""
    shape = tuple(param.shape)
    if shard_id is None:
        return shape
    return (shape[0] // 3, *shape[1:])  # CLIP's q, k and v have as many heads each
