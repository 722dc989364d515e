"""GGUF `mmproj` files of Qwen2.5-VL beside its "qwen2vl" text model, as llama.cpp's
`convert_hf_to_gguf.py --mmproj` writes them (Qwen2VLVisionModel): `general.architecture` "clip",
`clip.projector_type` "qwen2.5vl_merger", `clip.use_silu`, the window-attention pattern
`clip.vision.n_wa_pattern` (a block attends over the whole image when its index + 1 is a multiple
of it: transformers' fullatt_block_indexes 7, 15, 23, 31 are pattern 8), the patch embedding's
Conv3d split per frame into `v.patch_embd.weight` and `v.patch_embd.weight.1`, Q/K/V split into
`attn_q` / `attn_k` / `attn_v`, the SwiGLU MLP as `ffn_gate` / `ffn_up` / `ffn_down`, the
merger's norm `v.post_ln` and its MLP `mm.0` / `mm.2`. The M-RoPE sections and the image tokens
come from the text file (`qwen2vl.rope.dimension_sections`, its vocabulary).

The pair is served as models/qwen2_5_vl.py serves a Hugging Face checkpoint, its file tensors
renamed to the checkpoint's (Q/K/V concatenated, the two frames stacked back into the Conv3d).
Where this follows transformers rather than llama.cpp's clip.cpp (docs/images.md):
- images are resized by transformers' smart_resize between the file's image_min_pixels /
  image_max_pixels when it has them (the converter writes neither for Qwen2.5-VL), else those of
  Qwen2.5-VL's preprocessor_config.json (3,136 and 12,845,056 pixels); clip.cpp keeps an image
  between 8 and 4,096 tokens and rounds its size its own way;
- the merger's GELU is the exact one (nn.GELU), clip.cpp's the tanh approximation;
- the tower's RMSNorm epsilon is transformers' 1e-6 (the converter writes the text model's);
- `clip.vision.window_size` (pixels) is read where present, else 112 (Qwen2.5-VL's, the value
  clip.cpp always uses for this projector).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from torch import nn

from nanoserve.layers.linear import load_parameter
from nanoserve.models.gguf.header import GGUFHeader
from nanoserve.models.gguf.reader import GGUFImportError, _Keys, mrope_sections
from nanoserve.models.qwen2_5_vl_config import QwenVisionConfig
from nanoserve.multimodal.qwen_processor import QwenVLImageProcessor

PROJECTOR_TYPE = "qwen2.5vl_merger"
TEXT_ARCHITECTURE = "qwen2vl"
WINDOW_SIZE = 112  # pixels per window side (transformers' default, clip.cpp's constant)
# Qwen/Qwen2.5-VL-*-Instruct's preprocessor_config.json bounds (the file has none).
MIN_PIXELS = 3136
MAX_PIXELS = 12845056
VISION_TOKENS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
_LAYER_TENSOR = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER_PARTS = {
    "attn_out": "attn.proj",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_FIXED_NAMES = {
    "v.post_ln.weight": "visual.merger.ln_q.weight",
    "mm.0.weight": "visual.merger.mlp.0.weight",
    "mm.0.bias": "visual.merger.mlp.0.bias",
    "mm.2.weight": "visual.merger.mlp.2.weight",
    "mm.2.bias": "visual.merger.mlp.2.bias",
}
PATCH_TENSORS = ("v.patch_embd.weight", "v.patch_embd.weight.1")  # frame 0, frame 1


@dataclasses.dataclass(frozen=True, slots=True)
class QwenMmprojFile:
    """A Qwen2.5-VL mmproj file's header, checked, and the tower it describes."""

    path: Path
    header: GGUFHeader
    depth: int
    hidden: int
    intermediate: int
    heads: int
    patch_size: int
    merge: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    projector_output: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    min_pixels: int
    max_pixels: int

    def refuse(self, message: str) -> GGUFImportError:
        return GGUFImportError(f"mmproj {self.path.name}: {message}")


def read_qwen_mmproj(path: Path, header: GGUFHeader, whole, triple) -> QwenMmprojFile:
    """The file's tower (`whole` / `triple`: mmproj.py's checked readers of a key)."""
    metadata = header.metadata
    tensors = {tensor.name: tensor for tensor in header.tensors}

    def refuse(message: str) -> GGUFImportError:
        return GGUFImportError(f"mmproj {path.name}: {message}")

    if metadata.get("clip.use_silu") is not True:
        raise refuse("a qwen2.5vl_merger tower without clip.use_silu (SwiGLU) is not supported")
    hidden = whole(metadata, "clip.vision.embedding_length", path)
    intermediate = whole(metadata, "clip.vision.feed_forward_length", path)
    heads = whole(metadata, "clip.vision.attention.head_count", path)
    depth = whole(metadata, "clip.vision.block_count", path)
    patch_size = whole(metadata, "clip.vision.patch_size", path)
    pattern = whole(metadata, "clip.vision.n_wa_pattern", path)
    merge = metadata.get("clip.vision.spatial_merge_size", 2)
    window = metadata.get("clip.vision.window_size", WINDOW_SIZE)
    for key, value in (("spatial_merge_size", merge), ("window_size", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise refuse(f"clip.vision.{key} must be a whole number >= 1, got {value!r}")
    if hidden % heads or (hidden // heads) % 4:
        raise refuse(
            f"embedding_length {hidden} is not head_count {heads} heads of a size divisible by 4 "
            "(the 2D rotary's)"
        )
    if window % (patch_size * merge):
        raise refuse(f"window_size {window} is not a multiple of patch_size x spatial_merge_size")
    merged = hidden * merge * merge
    shapes = {  # GGUF lists dims fastest first: (inputs, outputs)
        PATCH_TENSORS[0]: (patch_size, patch_size, 3, hidden),
        PATCH_TENSORS[1]: (patch_size, patch_size, 3, hidden),
        "v.post_ln.weight": (hidden,),
        "mm.0.weight": (merged, merged),
        "mm.2.weight": (merged, None),
        "v.blk.0.ffn_gate.weight": (hidden, intermediate),
        "v.blk.0.ffn_up.weight": (hidden, intermediate),
        "v.blk.0.ffn_down.weight": (intermediate, hidden),
        f"v.blk.{depth - 1}.attn_q.weight": (hidden, hidden),
    }
    for name, expected in shapes.items():
        tensor = tensors.get(name)
        if tensor is None:
            hint = (
                " (a Conv3d of two frames, as the converter splits it)" if "patch" in name else ""
            )
            raise refuse(f"lacks tensor {name}{hint}")
        shape = tuple(int(d) for d in tensor.shape)
        if len(shape) != len(expected) or any(
            e is not None and s != e for s, e in zip(shape, expected, strict=False)
        ):
            raise refuse(
                f"tensor {name} has shape {shape}, not {tuple(e or '*' for e in expected)} "
                f"(embedding_length {hidden}, feed_forward_length {intermediate})"
            )
    min_pixels, max_pixels = (
        whole(metadata, key, path) if key in metadata else default
        for key, default in (
            ("clip.vision.image_min_pixels", MIN_PIXELS),
            ("clip.vision.image_max_pixels", MAX_PIXELS),
        )
    )
    if min_pixels > max_pixels:
        raise refuse(f"image_min_pixels {min_pixels} is above image_max_pixels {max_pixels}")
    return QwenMmprojFile(
        path,
        header,
        depth,
        hidden,
        intermediate,
        heads,
        patch_size,
        merge,
        window,
        tuple(i for i in range(depth) if (i + 1) % pattern == 0),
        int(tensors["mm.2.weight"].shape[1]),
        triple(metadata, "clip.vision.image_mean", path),
        triple(metadata, "clip.vision.image_std", path),
        int(min_pixels),
        int(max_pixels),
    )


def qwen_vision_config(
    file: QwenMmprojFile, text_metadata: dict, text_head_dim: int, text_hidden: int
) -> QwenVisionConfig:
    """The tower beside a "qwen2vl" text file, with its M-RoPE sections."""
    architecture = text_metadata.get("general.architecture")
    if architecture != TEXT_ARCHITECTURE:
        raise file.refuse(
            f"the text model is a {architecture!r} GGUF file; a qwen2.5vl_merger mmproj goes "
            "with a 'qwen2vl' one (Qwen2.5-VL's language model)"
        )
    if file.projector_output != text_hidden:
        raise file.refuse(
            f"the projector's output is {file.projector_output} features, but the text model's "
            f"hidden size is {text_hidden}: it was made for another text model"
        )
    sections = mrope_sections(_Keys(text_metadata, TEXT_ARCHITECTURE), text_head_dim)
    return QwenVisionConfig(
        depth=file.depth,
        hidden_size=file.hidden,
        intermediate_size=file.intermediate,
        num_heads=file.heads,
        in_channels=3,
        patch_size=file.patch_size,
        spatial_merge_size=file.merge,
        temporal_patch_size=len(PATCH_TENSORS),
        window_size=file.window_size,
        out_hidden_size=file.projector_output,
        fullatt_block_indexes=file.fullatt_block_indexes,
        hidden_act="silu",
        rope_theta=10000.0,
        image_token_id=-1,  # the text model's vocabulary's: attach_vision_tokens
        vision_start_token_id=-1,
        vision_end_token_id=-1,
        mrope_section=sections,
    )


def attach_vision_tokens(tokenizer, vision: QwenVisionConfig) -> QwenVisionConfig:
    """Qwen's image pad, vision start and vision end tokens from the text model's vocabulary."""
    ids = [tokenizer.backend.token_to_id(token) for token in VISION_TOKENS]
    missing = [token for token, i in zip(VISION_TOKENS, ids, strict=True) if i is None]
    if missing:
        raise GGUFImportError(
            f"the text model's vocabulary lacks Qwen's vision token(s) {missing}: not a "
            "Qwen2.5-VL language model"
        )
    return dataclasses.replace(
        vision, image_token_id=ids[0], vision_start_token_id=ids[1], vision_end_token_id=ids[2]
    )


def qwen_image_processor(file: QwenMmprojFile) -> QwenVLImageProcessor:
    """transformers' Qwen2VLImageProcessor with the file's mean, std and pixel bounds."""
    return QwenVLImageProcessor(
        min_pixels=file.min_pixels,
        max_pixels=file.max_pixels,
        patch_size=file.patch_size,
        temporal_patch_size=len(PATCH_TENSORS),
        merge_size=file.merge,
        rescale_factor=1 / 255,
        image_mean=file.image_mean,
        image_std=file.image_std,
    )


def _checkpoint_name(file: QwenMmprojFile, tensor_name: str) -> tuple[str, str | None]:
    """(the Hugging Face checkpoint's name for a file tensor, its q/k/v part where it is one)."""
    name = _FIXED_NAMES.get(tensor_name)
    if name is not None:
        return name, None
    match = _LAYER_TENSOR.fullmatch(tensor_name)
    if match is None:
        raise file.refuse(f"tensor {tensor_name} is not part of a Qwen2.5-VL tower or merger")
    layer, part, kind = int(match.group(1)), match.group(2), match.group(3)
    if layer >= file.depth:
        raise file.refuse(
            f"tensor {tensor_name}: layer {layer} is past clip.vision.block_count {file.depth}"
        )
    if part in ("attn_q", "attn_k", "attn_v"):
        return f"visual.blocks.{layer}.attn.qkv.{kind}", part[-1]
    if part not in _LAYER_PARTS:
        raise file.refuse(f"tensor {tensor_name} is not part of a Qwen2.5-VL tower or merger")
    return f"visual.blocks.{layer}.{_LAYER_PARTS[part]}.{kind}", None


def _target(model: nn.Module, name: str) -> tuple[str, object]:
    """Our parameter's name for a checkpoint name (gate / up into gate_up_proj), its shard id."""
    for fragment, (fused, shard) in getattr(model, "packed_modules", {}).items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard
    return name, None


def load_qwen_mmproj_weights(model: nn.Module, file: QwenMmprojFile, tensor_values) -> None:
    """The tower's and merger's parameters from the file (`tensor_values(file, tensor)`: a
    tensor dequantized to float32 in torch's shape), each checked against its parameter."""
    params = {n: p for n, p in model.named_parameters() if n.startswith("visual.")}
    if not params:  # a rank > 0 under tensor parallelism: the tower lives on rank 0 only
        return
    loaded: set[str] = set()
    frames: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}

    def load(name: str, values: torch.Tensor, what: str) -> None:
        target, shard = _target(model, name)
        param = params.get(target)
        if param is None:
            raise file.refuse(f"tensor {what} has no place in this model ({name})")
        expected = tuple(param.shape)
        if shard is not None:
            expected = (expected[0] // 2, *expected[1:])  # gate or up: half the fused rows
        if tuple(values.shape) != expected:
            raise file.refuse(
                f"tensor {what} has shape {tuple(values.shape)} (torch order), the model wants "
                f"{expected}"
            )
        load_parameter(param, values, shard)
        loaded.add(f"{target}:{shard}")

    for tensor in file.header.tensors:
        if tensor.name in PATCH_TENSORS:
            frames[tensor.name] = tensor_values(file, tensor)
            continue
        name, part = _checkpoint_name(file, tensor.name)
        values = tensor_values(file, tensor)
        if part is None:
            load(name, values, tensor.name)
            continue
        parts.setdefault(name, {})[part] = values
        if len(parts[name]) == 3:  # the checkpoint's fused qkv: q, k, v rows in order
            qkv = parts.pop(name)
            load(name, torch.cat([qkv["q"], qkv["k"], qkv["v"]]), tensor.name.replace("_v", "_qkv"))
    if len(frames) == len(PATCH_TENSORS):  # the Conv3d [hidden, channels, frames, p, p]
        stacked = torch.stack([frames[name] for name in PATCH_TENSORS], dim=2)
        load("visual.patch_embed.proj.weight", stacked, "v.patch_embd.weight(.1)")
    missing = []
    for name in sorted(set(params) - set(parts)):  # (a q/k/v part short: named below)
        shards = (0, 1) if ".gate_up_proj." in name else (None,)
        absent = [
            ("gate", "up")[s] for s in shards if s is not None and f"{name}:{s}" not in loaded
        ]
        if shards == (None,) and f"{name}:None" not in loaded:
            missing.append(name)
        elif absent:
            missing.append(f"{name} (its {'/'.join(absent)} part)")
    missing += [f"{n} (its {'/'.join(sorted(set('qkv') - set(p)))} part)" for n, p in parts.items()]
    if missing:
        raise file.refuse(f"lacks {len(missing)} tensor(s) this tower needs, e.g. {missing[:3]}")
