"""A random tiny Qwen2.5-VL checkpoint written by transformers: a two-block vision tower (one
block of 2x2-token windows, one over the whole image), its patch merger, a tiny Qwen2 with
M-RoPE, a tokenizer with Qwen's vision tokens and Qwen2.5-VL's chat template, and a Qwen2-VL
image processor whose pixel bounds keep images to a few dozen tokens."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import build_tokenizer

PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 30
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen/Qwen2.5-VL-7B-Instruct's chat template.
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _add_vision_tokens(out_dir: Path) -> dict[str, int]:
    """Qwen's vision tokens as added special tokens; every special token's id."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tokenizer.add_special_tokens(VISION_TOKENS)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_VL_TEMPLATE
    config["extra_special_tokens"] = {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return {t["content"]: t["id"] for t in json.loads(tokenizer.to_str())["added_tokens"]}


def write_random_qwen_vl(out_dir: Path, seed: int = 0) -> Path:
    import torch
    import transformers as hf

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    specials = _add_vision_tokens(out_dir)
    text = {
        "vocab_size": max(specials.values()) + 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        # head_dim 16: 8 frequencies, 2 temporal, 3 height, 3 width
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
        "bos_token_id": specials["<|im_start|>"],
        "eos_token_id": specials["<|im_end|>"],
        "pad_token_id": specials["<|endoftext|>"],
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": 2,
        "window_size": 56,  # 2x2 tokens per window
        "out_hidden_size": 64,
        "fullatt_block_indexes": [1],
    }
    config = hf.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=specials["<|image_pad|>"],
        video_token_id=specials["<|video_pad|>"],
        vision_start_token_id=specials["<|vision_start|>"],
        vision_end_token_id=specials["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = hf.Qwen2_5_VLForConditionalGeneration(config).float()
    # Large weights make greedy choices decisive; norms off 1.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                fan_in = param[0].numel()
                param.normal_(0, 0.5 if "embed_tokens" in name else 2.0 / fan_in**0.5)
            elif "norm" in name or "ln_q" in name:
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
    model.generation_config.eos_token_id = specials["<|im_end|>"]
    model.save_pretrained(out_dir, safe_serialization=True)
    processor = hf.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    processor.save_pretrained(out_dir)
    return out_dir


def transformers_processor(model_dir: Path):
    """transformers' Qwen2_5_VLProcessor over the checkpoint's tokenizer and PIL processor
    (without a video processor, which needs torchvision: its class check skipped for it)."""
    import transformers as hf

    class ImagesOnlyProcessor(hf.Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnlyProcessor(
        image_processor=hf.Qwen2VLImageProcessorPil.from_pretrained(model_dir),
        tokenizer=hf.AutoTokenizer.from_pretrained(model_dir),
        video_processor=None,
        chat_template=QWEN_VL_TEMPLATE,
    )
