"""A LLaVA-1.5 checkpoint's config.json (LlavaForConditionalGeneration): its Llama text config
read as any Llama's, and the CLIP vision tower and projector fields beside it."""

from __future__ import annotations

from dataclasses import dataclass

LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
# transformers' LlamaConfig defaults: a saved text_config may leave out what equals them.
_LLAMA_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
}
# transformers' CLIPVisionConfig defaults, likewise.
_CLIP_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "num_channels": 3,
}


@dataclass(slots=True, frozen=True)
class VisionConfig:
    """The CLIP vision tower, the projector and where image features go in the prompt."""

    image_size: int
    patch_size: int
    num_channels: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int  # the checkpoint's
    # Encoder layers run: those up to vision_feature_layer (LLaVA's -2 leaves out the last).
    num_layers_used: int
    layer_norm_eps: float
    hidden_act: str
    projector_hidden_act: str
    projector_bias: bool
    select_strategy: str  # "default": the CLS token's row is dropped; "full": kept
    image_token_id: int
    image_seq_length: int  # image tokens per image in the prompt (LlavaProcessor's expansion)
    # The id an image's positions hold once expanded; None: image_token_id. A placeholder added
    # past the model's vocabulary (llama.cpp's "<__media__>", models/gguf/mmproj.py) needs one.
    image_fill_token_id: int | None = None

    @property
    def placeholder_token_ids(self) -> tuple[int, ...]:
        """What an image part is in a chat template that reads content as a string."""
        return (self.image_token_id,)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_raw(cls, raw: dict) -> VisionConfig:
        vision = {**_CLIP_DEFAULTS, **(raw.get("vision_config") or {})}
        layer = raw.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError("vision_feature_layer as a list of layers is not supported yet")
        num_layers = int(vision["num_hidden_layers"])
        used = num_layers + 1 + layer if layer < 0 else layer
        if not 0 <= used <= num_layers:
            raise ValueError(f"vision_feature_layer {layer} is outside the {num_layers} layers")
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported")
        image_size, patch_size = int(vision["image_size"]), int(vision["patch_size"])
        num_rows = (image_size // patch_size) ** 2 + (strategy == "full")
        token_id = raw.get("image_token_index", raw.get("image_token_id", 32000))
        return cls(
            image_size=image_size,
            patch_size=patch_size,
            num_channels=int(vision["num_channels"]),
            hidden_size=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]),
            num_attention_heads=int(vision["num_attention_heads"]),
            num_hidden_layers=num_layers,
            num_layers_used=used,
            layer_norm_eps=float(vision["layer_norm_eps"]),
            hidden_act=str(vision["hidden_act"]),
            projector_hidden_act=str(raw.get("projector_hidden_act", "gelu")),
            projector_bias=bool(raw.get("multimodal_projector_bias", True)),
            select_strategy=strategy,
            image_token_id=int(token_id),
            image_seq_length=num_rows,
        )


def llava_text_config(raw: dict) -> dict:
    """The language model's config.json fields, as a Llama checkpoint's would read."""
    text = {**_LLAMA_DEFAULTS, **(raw.get("text_config") or {})}
    if text.get("model_type", "llama") != "llama":
        raise ValueError(
            f"{LLAVA_ARCHITECTURE}: text model {text.get('model_type')!r} is not supported "
            "(Llama only)"
        )
    text["architectures"] = ["LlamaForCausalLM"]
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    return text
