"""A random tiny LLaVA-1.5 checkpoint written by transformers: a CLIP vision tower (56-pixel
images, 14-pixel patches: 16 image tokens), a two-layer projector, a tiny Llama, a tokenizer
with an `<image>` token and LLaVA's chat template, and a CLIP image processor beside it."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import build_tokenizer

IMAGE_SIZE = 56
PATCH_SIZE = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # the class token's row is dropped
# llava-hf/llava-1.5-7b-hf's chat template: a message's images first, then its text.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def _add_image_token(out_dir: Path) -> int:
    """`<image>` as an added special token; its id."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tokenizer.add_special_tokens(["<image>"])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAVA_TEMPLATE
    config["extra_special_tokens"] = {"image_token": "<image>"}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.token_to_id("<image>")


def write_random_llava(out_dir: Path, seed: int = 0, f16_exact: bool = False) -> Path:
    """`f16_exact`: every weight a float16 value (in float32), so that a GGUF file storing them
    in F16, as llama.cpp's converters do, holds them exactly (tests/multimodal/llava_gguf.py)."""
    import torch
    import transformers as hf

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    image_token = _add_image_token(out_dir)
    specials = {
        t["content"]: t["id"]
        for t in json.loads((out_dir / "tokenizer.json").read_text())["added_tokens"]
    }
    text = hf.LlamaConfig(
        vocab_size=image_token + 1,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=specials["<|im_start|>"],
        eos_token_id=specials["<|im_end|>"],
        pad_token_id=specials["<|endoftext|>"],
    )
    vision = hf.CLIPVisionConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=32,
    )
    config = hf.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token,
        image_seq_length=IMAGE_TOKENS,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    model = hf.LlavaForConditionalGeneration(config).float()
    # Large weights make greedy choices decisive; norms off 1.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0, 0.5 if "embed" in name else 2.0 / param.shape[1] ** 0.5)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
            if f16_exact:
                param.copy_(param.half().float())
    model.save_pretrained(out_dir, safe_serialization=True)
    processor = hf.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor.save_pretrained(out_dir)
    return out_dir


def transformers_processor(model_dir: Path):
    """transformers' LlavaProcessor over the checkpoint's tokenizer and PIL image processor."""
    import transformers as hf

    return hf.LlavaProcessor(
        image_processor=hf.CLIPImageProcessorPil.from_pretrained(model_dir),
        tokenizer=hf.AutoTokenizer.from_pretrained(model_dir),
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE,
    )
