"""GGUF `mmproj` files beside a GGUF text model, as llama.cpp's `llama-server --mmproj` and Ollama
serve vision models: the LLaVA-1.5 family's CLIP vision tower and two-layer "mlp" projector, as
llama.cpp's converter for it writes them (tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py;
convert_hf_to_gguf.py --mmproj refuses a CLIP-tower LLaVA): `general.architecture` "clip",
`clip.projector_type` "mlp", the `clip.vision.*` hyperparameters, tensors `v.*` and `mm.0` / `mm.2`.
This module reads and checks the file: the VisionConfig it implies, its preprocessing, the image
placeholder of the text model's prompts. The pair is served as transformers'
LlavaForConditionalGeneration (models/llava.py): the text file's weights as any GGUF model's
(models/gguf/weights.py), the tower's and projector's dequantized into their parameters
(models/gguf/mmproj_weights.py).

Where this follows transformers rather than llama.cpp's clip.cpp (tests/multimodal/
test_gguf_mmproj.py holds it to transformers; docs/images.md says what a user sees):
- the tower runs the layers `clip.vision.feature_layer` names, else every stored layer (the
  converter already dropped the last one, LLaVA's vision_feature_layer -2; clip.cpp drops one more,
  llama.cpp issue 25817);
- the class token leads the patches and is dropped from the features (clip.cpp's graph puts it
  last, issue 25814);
- the projector's GELU is the exact one (transformers' "gelu"), clip.cpp's the tanh approximation;
- images are resized on their shortest edge and center-cropped (the checkpoint's
  CLIPImageProcessor), with the file's image mean and std, not padded to a square.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from nanoserve.models.gguf.header import GGUFHeader, read_gguf_header
from nanoserve.models.gguf.reader import GGUFImportError, _float32_value
from nanoserve.models.llava_config import VisionConfig
from nanoserve.multimodal.processor import ClipImageProcessor

MMPROJ_ARCHITECTURE = "clip"
PROJECTOR_TYPE = "mlp"  # LLaVA-1.5's: Linear, GELU, Linear
# The placeholder of an image in a prompt: the text model's own "<image>" token when its
# vocabulary has one (a GGUF converted from a llava-hf checkpoint), else llama.cpp's media marker
# (mtmd_default_marker()), added to the tokenizer as a special token.
IMAGE_TOKEN = "<image>"
MEDIA_MARKER = "<__media__>"
# Parameters the mmproj file gives (the text file gives the others).
MMPROJ_PARAMETERS = ("vision_tower.", "multi_modal_projector.")
# Text models an mmproj goes with: Llama-architecture GGUF files (Vicuna, Mistral, Llama 3).
TEXT_ARCHITECTURES = ("LlamaForCausalLM",)


@dataclasses.dataclass(frozen=True, slots=True)
class MmprojFile:
    """An mmproj file's header, checked, and the tower and projector it describes."""

    path: Path
    header: GGUFHeader
    vision: VisionConfig
    projector_output: int  # mm.2's output features: the text model's hidden size
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    ffn_names_swapped: bool  # the converter's ffn_down holds fc1 (clip.cpp's is_ffn_swapped)

    def refuse(self, message: str) -> GGUFImportError:
        return GGUFImportError(f"mmproj {self.path.name}: {message}")


def _refuse(path: Path, message: str) -> GGUFImportError:
    return GGUFImportError(f"mmproj {Path(path).name}: {message}")


def _whole(metadata: dict, key: str, path: Path, minimum: int = 1) -> int:
    value = metadata.get(key)
    if value is None:
        raise _refuse(path, f"lacks {key}")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _refuse(path, f"{key} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def _triple(metadata: dict, key: str, path: Path) -> tuple[float, float, float]:
    value = metadata.get(key)
    if not isinstance(value, list) or len(value) != 3:
        raise _refuse(path, f"{key} must be 3 numbers (one per color channel), got {value!r}")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
        raise _refuse(path, f"{key} must be 3 numbers, got {value!r}")
    return tuple(float(v) for v in value)


def _projector_type(metadata: dict) -> str | None:
    value = metadata.get("clip.projector_type", metadata.get("clip.vision.projector_type"))
    if value is None and metadata.get("clip.has_llava_projector") is True:
        return PROJECTOR_TYPE  # the converter's files before the key existed
    return value


def _check_header(path: Path, metadata: dict) -> None:
    """The file is a vision tower with LLaVA-1.5's projector, nothing else."""
    architecture = metadata.get("general.architecture")
    if architecture != MMPROJ_ARCHITECTURE:
        raise _refuse(
            path,
            f"general.architecture is {architecture!r}, not 'clip': not an mmproj file "
            "(is it the text model?)",
        )
    if metadata.get("clip.has_vision_encoder") is False:
        raise _refuse(path, "has no vision encoder (clip.has_vision_encoder is false)")
    projector = _projector_type(metadata)
    if projector != PROJECTOR_TYPE:
        raise _refuse(
            path,
            f"projector type {projector!r} is not supported (LLaVA-1.5's 'mlp' projector with a "
            "CLIP tower is)",
        )
    if metadata.get("clip.has_text_encoder") is True:
        raise _refuse(path, "holds a CLIP text encoder too (convert it with --vision-only)")
    if "clip.vision.image_grid_pinpoints" in metadata or metadata.get(
        "clip.vision.mm_patch_merge_type"
    ) not in (None, "flat"):
        raise _refuse(
            path,
            "LLaVA-NeXT (1.6) image tiling (clip.vision.image_grid_pinpoints) is not supported, "
            "LLaVA-1.5's one image at one resolution is",
        )
    if metadata.get("clip.use_silu") is True:
        raise _refuse(path, "a SiLU vision tower (clip.use_silu) is not supported")


def _vision_config(path: Path, header: GGUFHeader) -> tuple[VisionConfig, bool, int]:
    """The tower's VisionConfig, whether its FFN names are swapped, the projector's output size."""
    metadata = header.metadata
    tensors = {tensor.name: tensor for tensor in header.tensors}
    hidden = _whole(metadata, "clip.vision.embedding_length", path)
    intermediate = _whole(metadata, "clip.vision.feed_forward_length", path)
    heads = _whole(metadata, "clip.vision.attention.head_count", path)
    layers = _whole(metadata, "clip.vision.block_count", path, minimum=0)
    image_size = _whole(metadata, "clip.vision.image_size", path)
    patch_size = _whole(metadata, "clip.vision.patch_size", path)
    eps = metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-5)
    if hidden % heads:
        raise _refuse(path, f"embedding_length {hidden} is not a multiple of head_count {heads}")
    if image_size % patch_size:
        raise _refuse(path, f"image_size {image_size} is not a multiple of patch_size {patch_size}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise _refuse(path, f"clip.vision.attention.layer_norm_epsilon must be > 0, got {eps!r}")
    feature_layers = metadata.get("clip.vision.feature_layer")
    if feature_layers is None:
        used = layers  # the converter stored the layers LLaVA reads, no more
    else:
        if not isinstance(feature_layers, list) or len(feature_layers) != 1:
            raise _refuse(
                path,
                f"clip.vision.feature_layer {feature_layers!r}: only one feature layer is "
                "supported (features stacked from several layers, Granite Vision's, are not)",
            )
        used = feature_layers[0]
        if isinstance(used, bool) or not isinstance(used, int) or not 0 <= used <= layers:
            raise _refuse(
                path, f"clip.vision.feature_layer {used!r} is outside the {layers} stored layers"
            )
    for name in ("v.class_embd", "mm.2.weight", "mm.0.weight"):
        if name not in tensors:
            raise _refuse(path, f"lacks tensor {name}")
    patches = (image_size // patch_size) ** 2
    shapes = {
        "v.class_embd": (hidden,),
        "v.position_embd.weight": (hidden, patches + 1),
        "v.patch_embd.weight": (patch_size, patch_size, 3, hidden),
        "mm.0.weight": (hidden, None),  # GGUF lists dims fastest first: (inputs, outputs)
    }
    for name, expected in shapes.items():
        tensor = tensors.get(name)
        if tensor is None:
            raise _refuse(path, f"lacks tensor {name}")
        shape = tuple(int(d) for d in tensor.shape)
        if len(shape) != len(expected) or any(
            e is not None and s != e for s, e in zip(shape, expected, strict=False)
        ):
            raise _refuse(
                path,
                f"tensor {name} has shape {shape}, not {tuple(e or '*' for e in expected)} "
                f"(hidden {hidden}, {patches} patches)",
            )
    projector_hidden = int(tensors["mm.0.weight"].shape[1])
    mm2 = tuple(int(d) for d in tensors["mm.2.weight"].shape)
    if len(mm2) != 2 or mm2[0] != projector_hidden:
        raise _refuse(
            path, f"tensor mm.2.weight has shape {mm2}, not ({projector_hidden}, *) after mm.0"
        )
    _check_layers(path, tensors, used, hidden, intermediate)
    down = tensors.get("v.blk.0.ffn_down.weight")
    # clip.cpp's rule: the converter named fc1 (hidden -> intermediate) ffn_down; such a
    # ffn_down reads the hidden size.
    swapped = down is not None and int(down.shape[0]) == hidden
    vision = VisionConfig(
        image_size=image_size,
        patch_size=patch_size,
        num_channels=3,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_hidden_layers=layers,
        num_layers_used=used,
        layer_norm_eps=_float32_value(eps),
        hidden_act="gelu" if metadata.get("clip.use_gelu") is True else "quick_gelu",
        projector_hidden_act="gelu",
        projector_bias=True,
        select_strategy="default",  # the class token's row is dropped, as clip.cpp's patches
        image_token_id=-1,  # the text model's: attach_image_token
        image_seq_length=patches,
    )
    return vision, swapped, mm2[1]


def _check_layers(path: Path, tensors: dict, used: int, hidden: int, intermediate: int) -> None:
    """The layers to run are in the file, their MLP of the sizes the header gives (before a
    tower of the header's sizes is built: a corrupt count must not allocate)."""
    if used == 0:
        return
    last = f"v.blk.{used - 1}.attn_q.weight"
    if last not in tensors:
        raise _refuse(path, f"runs {used} vision layers (its header says so) but lacks {last}")
    for name in ("v.blk.0.ffn_up.weight", "v.blk.0.ffn_down.weight"):
        tensor = tensors.get(name)
        if tensor is None:
            raise _refuse(path, f"lacks tensor {name}")
        if sorted(int(d) for d in tensor.shape) != sorted((hidden, intermediate)):
            raise _refuse(
                path,
                f"tensor {name} has shape {tuple(int(d) for d in tensor.shape)}, not "
                f"embedding_length {hidden} x feed_forward_length {intermediate}",
            )


@functools.lru_cache(maxsize=4)
def _read(path: Path, size: int, mtime: float) -> MmprojFile:
    header = read_gguf_header(path)
    _check_header(path, header.metadata)
    vision, swapped, output = _vision_config(path, header)
    return MmprojFile(
        path,
        header,
        vision,
        output,
        _triple(header.metadata, "clip.vision.image_mean", path),
        _triple(header.metadata, "clip.vision.image_std", path),
        swapped,
    )


def read_mmproj(path: str | Path) -> MmprojFile:
    """The mmproj file, checked (GGUFImportError, one line, for a malformed or unsupported one);
    cached per file version."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFImportError(f"--mmproj {path}: no such file")
    stat = path.stat()
    return _read(path.resolve(), stat.st_size, stat.st_mtime)


def mmproj_vision(
    mmproj: str | Path, text_architecture: str, text_gguf_architecture: str, text_hidden: int
) -> VisionConfig:
    """The vision config of `mmproj` served beside a GGUF text model (its HF architecture, its
    `general.architecture`, its hidden size), each mismatch one line."""
    file = read_mmproj(mmproj)
    if text_architecture not in TEXT_ARCHITECTURES or text_gguf_architecture != "llama":
        raise file.refuse(
            f"the text model is a {text_gguf_architecture!r} GGUF file ({text_architecture}); "
            "an mmproj goes with a 'llama' one (LLaVA-1.5's Vicuna, Mistral, Llama 3)"
        )
    if file.projector_output != text_hidden:
        raise file.refuse(
            f"the projector's output is {file.projector_output} features, but the text model's "
            f"hidden size is {text_hidden}: it was made for another text model"
        )
    return file.vision


def mmproj_image_processor(mmproj: str | Path) -> ClipImageProcessor:
    """CLIP's preprocessing at the tower's image size, with the file's mean and std."""
    file = read_mmproj(mmproj)
    size = file.vision.image_size
    return ClipImageProcessor(
        shortest_edge=size,
        crop_height=size,
        crop_width=size,
        rescale_factor=1 / 255,
        image_mean=file.image_mean,
        image_std=file.image_std,
    )


def attach_image_token(tokenizer, vision: VisionConfig) -> VisionConfig:
    """The image placeholder of a GGUF text model's prompts: its "<image>" token where its
    vocabulary has one, else llama.cpp's "<__media__>" marker, added to `tokenizer` as a special
    token past the model's vocabulary; image positions then hold the pad (or unknown, or 0) token,
    whose embedding rows the image's replace."""
    from tokenizers import AddedToken

    backend = tokenizer.backend
    image_id = backend.token_to_id(IMAGE_TOKEN)
    if image_id is not None:
        return dataclasses.replace(vision, image_token_id=image_id)
    if backend.token_to_id(MEDIA_MARKER) is None:
        backend.add_special_tokens([AddedToken(MEDIA_MARKER, special=True, normalized=False)])
    fill = next(
        (i for i in (tokenizer.pad_token_id, backend.token_to_id(tokenizer.unk_token or "")) if i),
        0,
    )
    return dataclasses.replace(
        vision, image_token_id=backend.token_to_id(MEDIA_MARKER), image_fill_token_id=fill
    )
