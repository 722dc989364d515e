"""A Hugging Face Qwen2.5-VL checkpoint turned into the two GGUF files llama.cpp serves it from,
as its `convert_hf_to_gguf.py` writes them with `--outtype f16`: the language model as a
"qwen2vl" file (Qwen2's tensors, rows in Hugging Face's order, matrices F16, vectors F32, the
M-RoPE sections padded to four as `qwen2vl.rope.dimension_sections`, tokenizer and chat template),
and with `--mmproj` the vision tower and merger (Qwen2VLVisionModel: `general.architecture`
"clip", `clip.projector_type` "qwen2.5vl_merger", `clip.use_silu`, `clip.vision.n_wa_pattern`
from fullatt_block_indexes, image_size 560 as the converter defaults it, Q/K/V split, the Conv3d
split per frame into `v.patch_embd.weight` / `v.patch_embd.weight.1`)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from tests.gguf_models import _add_tokenizer, _finish, _gguf_name
from tests.multimodal.llava_gguf import _weights, add_clip_metadata


def write_qwen_text_gguf(hf_dir: Path, path: Path, sections: list | None = None) -> Path:
    """The language model as a "qwen2vl" file. `sections`: written in place of the checkpoint's
    mrope_section padded with a zero (the refusal tests)."""
    config = json.loads((hf_dir / "config.json").read_text())
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    writer = gguf.GGUFWriter(str(path), "qwen2vl")
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_rope_freq_base(rope.get("rope_theta", 1e6))
    writer.add_rope_dimension_sections(sections or [*rope["mrope_section"], 0])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _add_tokenizer(writer, hf_dir, "qwen2")
    for name, weight in _weights(hf_dir):
        if name.startswith("visual.") or name.startswith("model.visual."):
            continue
        name = name.replace("model.language_model.", "model.")
        values = weight.numpy()
        f16 = values.ndim == 2
        writer.add_tensor(_gguf_name(name), values.astype(np.float16 if f16 else np.float32))
    return _finish(writer, path)


_BLOCK_PARTS = {
    "attn.proj": "attn_out",
    "norm1": "ln1",
    "norm2": "ln2",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _mmproj_tensors(name: str, weight) -> list[tuple[str, np.ndarray]]:
    """The converter's (name, values) for one checkpoint tensor of the tower or merger."""
    values = weight.numpy()
    name = name.removeprefix("model.").removeprefix("visual.")
    if name == "patch_embed.proj.weight":  # Conv3d [hidden, C, 2, p, p] -> one Conv2d a frame
        return [
            ("v.patch_embd.weight", values[:, :, 0]),
            ("v.patch_embd.weight.1", values[:, :, 1]),
        ]
    if name.startswith("merger."):
        merger = {"merger.ln_q.weight": "v.post_ln.weight"}
        return [(merger.get(name, name.replace("merger.mlp.", "mm.")), values)]
    _, layer, rest = name.split(".", 2)
    module, _, kind = rest.rpartition(".")
    if module == "attn.qkv":
        q, k, v = np.split(values, 3)
        return [
            (f"v.blk.{layer}.attn_{p}.{kind}", x) for p, x in zip("qkv", (q, k, v), strict=True)
        ]
    return [(f"v.blk.{layer}.{_BLOCK_PARTS[module]}.{kind}", values)]


def write_qwen_mmproj_gguf(
    hf_dir: Path,
    path: Path,
    *,
    overrides: dict | None = None,
    drop: tuple[str, ...] = (),
    replace: dict[str, np.ndarray] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    matrix_type: str = "F16",
) -> Path:
    """The tower and merger as an mmproj file. `overrides`: metadata written in place of the
    converter's (None: left out); `drop`: tensors left out, `replace`: tensors written in place
    of the checkpoint's, `extra`: tensors added (the refusal tests). `matrix_type` "Q8_0": the
    blocks' and the merger's matrices in Q8_0 (`--outtype q8_0`; the patch embedding stays F16)."""
    config = json.loads((hf_dir / "config.json").read_text())
    vision = config["vision_config"]
    text = config.get("text_config") or config
    preprocessor = json.loads((hf_dir / "preprocessor_config.json").read_text())
    fullatt = vision["fullatt_block_indexes"]
    metadata = {
        "clip.has_vision_encoder": True,
        "clip.vision.projection_dim": text["hidden_size"],
        "clip.vision.image_size": vision.get("image_size", 560),
        "clip.vision.patch_size": vision["patch_size"],
        "clip.vision.embedding_length": vision["hidden_size"],
        "clip.vision.feed_forward_length": vision["intermediate_size"],
        "clip.vision.block_count": vision["depth"],
        "clip.vision.attention.head_count": vision["num_heads"],
        "clip.vision.image_mean": preprocessor["image_mean"],
        "clip.vision.image_std": preprocessor["image_std"],
        "clip.projector_type": "qwen2.5vl_merger",
        "clip.use_silu": True,
        "clip.vision.n_wa_pattern": fullatt[0] + 1,
        "clip.vision.attention.layer_norm_epsilon": config.get("rms_norm_eps", 1e-6),
    }
    metadata.update(overrides or {})
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    add_clip_metadata(writer, metadata)
    for name, weight in _weights(hf_dir):
        if not name.startswith(("visual.", "model.visual.")):
            continue
        for gguf_name, values in _mmproj_tensors(name, weight):
            if gguf_name in drop:
                continue
            values = (replace or {}).get(gguf_name, values)
            f16 = values.ndim >= 2
            # (rows not of whole 32-value blocks stay F16, as the converter falls back)
            blocks = values.ndim == 2 and values.shape[1] % 32 == 0
            if matrix_type == "Q8_0" and blocks and gguf_name.startswith(("v.blk", "mm.")):
                q8_0 = gguf.GGMLQuantizationType.Q8_0
                writer.add_tensor(gguf_name, gguf.quants.quantize(values, q8_0), raw_dtype=q8_0)
                continue
            writer.add_tensor(
                gguf_name, np.ascontiguousarray(values, np.float16 if f16 else np.float32)
            )
    for gguf_name, values in (extra or {}).items():
        writer.add_tensor(gguf_name, values)
    return _finish(writer, path)
