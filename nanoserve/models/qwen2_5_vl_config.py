"""A Qwen2.5-VL checkpoint's config.json (Qwen2_5_VLForConditionalGeneration): its Qwen2 text
config read as any Qwen2's (transformers 5's text_config, or 4.x's fields at the top level),
the M-RoPE sections, and the vision tower's fields."""

from __future__ import annotations

from dataclasses import dataclass

QWEN2_5_VL_ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
# transformers' Qwen2_5_VLVisionConfig defaults: a saved vision_config may leave them out.
_VISION_DEFAULTS = {
    "depth": 32,
    "hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
}
_TEXT_DEFAULTS = {
    "vocab_size": 152064,
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
}
MROPE_SECTION = (16, 24, 24)  # Qwen2.5-VL's (temporal, height, width) frequency split


@dataclass(slots=True, frozen=True)
class QwenVisionConfig:
    """The vision tower, its patch merger, the image tokens and the M-RoPE split."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int  # pixels per window side
    out_hidden_size: int  # the language model's hidden size
    fullatt_block_indexes: tuple[int, ...]  # blocks attending over the whole image
    hidden_act: str
    rope_theta: float  # the vision tower's 2D rotary
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[
        int, ...
    ]  # frequencies per (temporal, height, width), summing to half a head

    @property
    def placeholder_token_ids(self) -> tuple[int, ...]:
        """What an image part is in a chat template that reads content as a string."""
        return (self.vision_start_token_id, self.image_token_id, self.vision_end_token_id)

    @property
    def patch_dim(self) -> int:
        """A patch row's values: channels x frames x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_raw(cls, raw: dict, head_dim: int) -> QwenVisionConfig:
        vision = {**_VISION_DEFAULTS, **(raw.get("vision_config") or {})}
        if "in_chans" in vision and "in_channels" not in (raw.get("vision_config") or {}):
            vision["in_channels"] = vision["in_chans"]  # transformers 4.x's name
        if vision["hidden_act"] != "silu":
            raise ValueError(
                f"{QWEN2_5_VL_ARCHITECTURE}: vision hidden_act {vision['hidden_act']!r} is not "
                "supported (silu)"
            )
        rope = _rope_parameters(raw)
        section = tuple(int(s) for s in rope.get("mrope_section") or MROPE_SECTION)
        if sum(section) * 2 != head_dim:
            raise ValueError(
                f"{QWEN2_5_VL_ARCHITECTURE}: mrope_section {list(section)} does not cover half "
                f"of the head dimension {head_dim}"
            )
        if rope.get("mrope_interleaved"):
            raise ValueError(f"{QWEN2_5_VL_ARCHITECTURE}: interleaved M-RoPE is not supported")
        vision_rope = vision.get("rope_parameters") or {}
        return cls(
            depth=int(vision["depth"]),
            hidden_size=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]),
            num_heads=int(vision["num_heads"]),
            in_channels=int(vision["in_channels"]),
            patch_size=int(vision["patch_size"]),
            spatial_merge_size=int(vision["spatial_merge_size"]),
            temporal_patch_size=int(vision["temporal_patch_size"]),
            window_size=int(vision["window_size"]),
            out_hidden_size=int(vision["out_hidden_size"]),
            fullatt_block_indexes=tuple(int(i) for i in vision["fullatt_block_indexes"]),
            hidden_act=str(vision["hidden_act"]),
            rope_theta=float(vision_rope.get("rope_theta", 10000.0)),
            image_token_id=int(raw.get("image_token_id", 151655)),
            vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(raw.get("vision_end_token_id", 151653)),
            mrope_section=section,
        )


def _text_fields(raw: dict) -> dict:
    text = raw.get("text_config")
    if text is None:  # transformers 4.x: the text model's fields at the top level
        text = {k: v for k, v in raw.items() if k not in ("vision_config", "architectures")}
    return {**_TEXT_DEFAULTS, **text}


def _rope_parameters(raw: dict) -> dict:
    """transformers 5's text_config.rope_parameters, or 4.x's rope_scaling {type: mrope}."""
    text = _text_fields(raw)
    return text.get("rope_parameters") or text.get("rope_scaling") or {}


def qwen2_5_vl_text_config(raw: dict) -> dict:
    """The language model's config.json fields, as a Qwen2 checkpoint's would read (its rotary
    plain: M-RoPE's sections are the model's, models/qwen2_5_vl.py)."""
    text = _text_fields(raw)
    rope = _rope_parameters(raw)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ValueError(f"{QWEN2_5_VL_ARCHITECTURE}: rope type {kind!r} is not supported")
    text["rope_theta"] = rope.get("rope_theta") or text.get("rope_theta") or 1000000.0
    text.pop("rope_scaling", None)
    text.pop("rope_parameters", None)
    text["architectures"] = ["Qwen2ForCausalLM"]
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text
