"""A Hugging Face LLaVA-1.5 checkpoint turned into the two GGUF files llama.cpp serves it from:
the text model as convert_hf_to_gguf.py writes a Llama (`--outtype f16`: matrices F16, norms F32,
Q/K rows permuted for its rotary, tokenizer and chat template in the metadata), and the vision
tower with its projector as llama.cpp's LLaVA converter writes an mmproj
(tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py, the default f16: matrices and the
patch convolution F16, vectors F32; `general.architecture` "clip", `clip.projector_type` "mlp",
the `clip.vision.*` keys, the layers past the feature layer and the post-norm dropped, fc1 named
`ffn_down` and fc2 `ffn_up`, as that converter's name mapping has them; `names="gguf-py"`: the
other way round, as gguf-py's tensor map names them)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors import safe_open

from tests.gguf_models import _add_tokenizer, _finish, _gguf_name, _llama_cpp_permute

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _weights(hf_dir: Path):
    """(name, float32 tensor) one at a time (a real shape's checkpoint never whole in float32)."""
    with safe_open(hf_dir / "model.safetensors", framework="pt") as checkpoint:
        for name in checkpoint.keys():  # noqa: SIM118 (safe_open has no iterator)
            yield name, checkpoint.get_tensor(name).float()


def write_text_gguf(
    hf_dir: Path, path: Path, drop_image_token: bool = False, matrix_type: str = "F16"
) -> Path:
    """The language model as a "llama" GGUF file. `drop_image_token`: its vocabulary without
    "<image>" (renamed "<unused_image>"), as a GGUF converted from the original LLaVA weights,
    whose tokenizer has no image token. `matrix_type`: the matrices' GGUF type (F16, BF16, Q8_0,
    Q4_0: the gguf package's quantizer)."""
    config = json.loads((hf_dir / "config.json").read_text())
    text = config["text_config"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_rope_dimension_count(text["hidden_size"] // text["num_attention_heads"])
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_rope_freq_base(text.get("rope_parameters", {}).get("rope_theta", 10000.0))
    file_types = {"F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0"}
    writer.add_file_type(getattr(gguf.LlamaFileType, file_types.get(matrix_type, "MOSTLY_Q4_0")))
    quant_type = getattr(gguf.GGMLQuantizationType, matrix_type)
    tokenizer_dir = hf_dir
    if drop_image_token:
        tokenizer_dir = path.parent / "tokenizer_without_image"
        tokenizer_dir.mkdir(exist_ok=True)
        raw = (hf_dir / "tokenizer.json").read_text().replace('"<image>"', '"<unused_image>"')
        (tokenizer_dir / "tokenizer.json").write_text(raw)
        (tokenizer_dir / "tokenizer_config.json").write_text(
            (hf_dir / "tokenizer_config.json").read_text()
        )
    _add_tokenizer(writer, tokenizer_dir)
    for name, weight in _weights(hf_dir):
        if not name.startswith("language_model."):
            continue
        name = name.removeprefix("language_model.")
        if name.endswith("norm.weight"):
            writer.add_tensor(_gguf_name(name), weight.numpy())
            continue
        if name.endswith("q_proj.weight"):
            weight = _llama_cpp_permute(weight, text["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = _llama_cpp_permute(weight, text["num_key_value_heads"])
        if quant_type == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(_gguf_name(name), weight.numpy().astype(np.float16))
        else:
            data = gguf.quants.quantize(weight.numpy(), quant_type)
            writer.add_tensor(_gguf_name(name), data, raw_dtype=quant_type)
    return _finish(writer, path)


def _mmproj_name(name: str, names: str) -> str:
    """The LLaVA converter's name for a checkpoint tensor (vision_tower.* / multi_modal_projector.*)."""
    if name.startswith("multi_modal_projector."):
        return name.replace("multi_modal_projector.linear_1", "mm.0").replace(
            "multi_modal_projector.linear_2", "mm.2"
        )
    name = name.removeprefix("vision_tower.").removeprefix("vision_model.")
    fc1, fc2 = ("ffn_down", "ffn_up") if names == "converter" else ("ffn_up", "ffn_down")
    for old, new in (
        ("embeddings.class_embedding", "class_embd"),
        ("embeddings.patch_embedding", "patch_embd"),
        ("embeddings.position_embedding", "position_embd"),
        ("pre_layrnorm", "pre_ln"),
        ("encoder.layers.", "blk."),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.out_proj", "attn_out"),
        ("layer_norm1", "ln1"),
        ("layer_norm2", "ln2"),
        ("mlp.fc1", fc1),
        ("mlp.fc2", fc2),
    ):
        name = name.replace(old, new)
    return "v." + name


def add_clip_metadata(writer: gguf.GGUFWriter, metadata: dict) -> None:
    """An mmproj's keys as llama.cpp's converters type them (None: the key is left out)."""
    for key, value in metadata.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)


def write_mmproj_gguf(
    hf_dir: Path,
    path: Path,
    *,
    names: str = "converter",
    feature_layer_key: bool = False,
    overrides: dict | None = None,
    drop: tuple[str, ...] = (),
    replace: dict[str, np.ndarray] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    matrix_type: str = "F16",
) -> Path:
    """The vision tower and projector as an mmproj file. `feature_layer_key`: write
    clip.vision.feature_layer (the converter does when the config it reads has
    vision_feature_layer), else only the layers up to it. `overrides`: metadata written in place
    of the converter's; `drop`: tensors left out, `replace`: tensors written in place of the
    checkpoint's, `extra`: tensors added (the refusal tests). `matrix_type` "Q8_0": the layers' and the projector's
    matrices in Q8_0 (as convert_hf_to_gguf.py --outtype q8_0 writes an mmproj)."""
    config = json.loads((hf_dir / "config.json").read_text())
    vision = config["vision_config"]
    layers = vision["num_hidden_layers"]
    feature_layer = config.get("vision_feature_layer", -2)
    feature_layer = feature_layer if feature_layer >= 0 else layers + 1 + feature_layer
    metadata = {
        "clip.has_text_encoder": False,
        "clip.has_vision_encoder": True,
        "clip.has_llava_projector": True,
        "clip.projector_type": "mlp",
        "clip.vision.image_size": vision["image_size"],
        "clip.vision.patch_size": vision["patch_size"],
        "clip.vision.embedding_length": vision["hidden_size"],
        "clip.vision.feed_forward_length": vision["intermediate_size"],
        "clip.vision.projection_dim": vision.get("projection_dim", 512),
        "clip.vision.attention.head_count": vision["num_attention_heads"],
        "clip.vision.attention.layer_norm_epsilon": vision.get("layer_norm_eps", 1e-5),
        "clip.vision.block_count": feature_layer,
        "clip.vision.image_mean": CLIP_MEAN,
        "clip.vision.image_std": CLIP_STD,
        "clip.use_gelu": vision.get("hidden_act", "quick_gelu") == "gelu",
    }
    if feature_layer_key:
        metadata["clip.vision.feature_layer"] = [feature_layer]
    metadata.update(overrides or {})
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_file_type(1)
    writer.add_name("llava-tiny")
    writer.add_description("image encoder for LLaVA")
    add_clip_metadata(writer, metadata)
    for name, weight in _weights(hf_dir):
        if not name.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        if "post_layernorm" in name or "position_ids" in name:
            continue
        if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= feature_layer:
            continue
        gguf_name = _mmproj_name(name, names)
        if gguf_name in drop:
            continue
        values = (replace or {}).get(gguf_name, weight.numpy())
        f16 = values.ndim == 4 or (values.ndim == 2 and gguf_name.endswith(".weight"))
        if matrix_type == "Q8_0" and f16 and gguf_name.startswith(("v.blk.", "mm.")):
            q8_0 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, q8_0), raw_dtype=q8_0)
            continue
        writer.add_tensor(gguf_name, values.astype(np.float16 if f16 else np.float32))
    for gguf_name, values in (extra or {}).items():
        writer.add_tensor(gguf_name, values)
    return _finish(writer, path)
