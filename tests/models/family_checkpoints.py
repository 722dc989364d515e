"""Small random checkpoints of each supported family in Hugging Face layout, written by
transformers itself (config.json, model.safetensors, tokenizer files)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import build_tokenizer

# Gemma's turn markers, as in its chat_template.jinja (tokenized as plain text here).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == "
    "'assistant' else message['role']) + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

WINDOW = 24  # shorter than the long test prompts, longer than the short ones
LONGROPE_SWITCH = 128  # longer than every test sequence (transformers switches a whole forward)
SHORT_FACTOR = [1.0, 1.3, 1.9, 2.6, 3.1, 4.0]  # head_dim 16 * 0.75 / 2 frequencies
LONG_FACTOR = [1.5, 2.5, 4.0, 6.0, 9.0, 12.0]
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def _configs(family: str, specials: dict, vocab: int):
    import transformers as hf

    ids = dict(
        vocab_size=vocab,
        bos_token_id=specials["<|im_start|>"],
        eos_token_id=specials["<|im_end|>"],
        pad_token_id=specials["<|endoftext|>"],
    )
    if family == "qwen3":
        return hf.Qwen3Config(**SHAPE, **ids, num_hidden_layers=2, head_dim=16), hf.Qwen3ForCausalLM
    if family == "qwen2":  # q/k/v biases
        return hf.Qwen2Config(**SHAPE, **ids, num_hidden_layers=2), hf.Qwen2ForCausalLM
    if family == "mistral":
        return hf.MistralConfig(
            **SHAPE, **ids, num_hidden_layers=2, head_dim=16, sliding_window=WINDOW
        ), hf.MistralForCausalLM
    if family == "phi3":
        return hf.Phi3Config(
            **SHAPE, **ids, num_hidden_layers=2, sliding_window=WINDOW
        ), hf.Phi3ForCausalLM
    if (
        family == "phi4-mini"
    ):  # rotary on the first 3/4 of a head, LongRoPE (below its switch point)
        config = hf.Phi3Config(
            **SHAPE,
            **ids,
            num_hidden_layers=2,
            sliding_window=WINDOW,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=LONGROPE_SWITCH,
            rope_scaling={
                "type": "longrope",
                "short_factor": SHORT_FACTOR,
                "long_factor": LONG_FACTOR,
            },
        )
        return config, hf.Phi3ForCausalLM
    gemma = dict(SHAPE, tie_word_embeddings=True)
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    if family == "gemma2":
        return hf.Gemma2Config(
            **gemma,
            **ids,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=12,
            sliding_window=WINDOW,
            layer_types=layer_types,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=5.0,
        ), hf.Gemma2ForCausalLM
    if family == "gemma2-gguf":  # what a GGUF file can say: the attention scale from the head size
        return hf.Gemma2Config(
            **gemma,
            **ids,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=layer_types,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=5.0,
        ), hf.Gemma2ForCausalLM
    if family == "gemma3-gguf":  # and llama.cpp's pattern of five sliding layers, then a global one
        config = hf.Gemma3TextConfig(
            **gemma,
            **ids,
            num_hidden_layers=6,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        )
        return config, hf.Gemma3ForCausalLM
    if family == "gemma3":
        config = hf.Gemma3TextConfig(
            **gemma,
            **ids,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=12,
            sliding_window=WINDOW,
            layer_types=layer_types,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        )
        return config, hf.Gemma3ForCausalLM
    raise ValueError(family)


def write_random_checkpoint(
    out_dir: Path, family: str, seed: int = 0, num_labels: int | None = None
) -> Path:
    """`num_labels`: the family's *ForSequenceClassification with that many labels instead."""
    import torch
    import transformers as hf

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out_dir)
    specials = {
        t["content"]: t["id"]
        for t in json.loads((out_dir / "tokenizer.json").read_text())["added_tokens"]
    }
    config, model_class = _configs(family, specials, vocab)
    if num_labels is not None:
        name = model_class.__name__.replace("ForCausalLM", "ForSequenceClassification")
        model_class = getattr(hf, name)
        config.num_labels = num_labels
        config.id2label = {i: f"LABEL_{i}" for i in range(num_labels)}
        config.label2id = {v: k for k, v in config.id2label.items()}
    torch.manual_seed(seed)
    model = model_class(config).float()
    # Large weights make greedy choices decisive; norms off 1 (or off 0 for Gemma's 1 + w).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                # Gemma scales embeddings by sqrt(hidden) and ties them to the LM head: keep
                # them small, or the input token's own logit wins every step.
                embed_std = 0.5 / SHAPE["hidden_size"] ** 0.5 if family.startswith("gemma") else 0.5
                param.normal_(0, embed_std if "embed" in name else 2.0 / param.shape[1] ** 0.5)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    if family.startswith(
        "gemma"
    ):  # the template from chat_template.jinja, not tokenizer_config.json
        tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
        del tokenizer_config["chat_template"]
        (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        (out_dir / "chat_template.jinja").write_text(GEMMA_TEMPLATE)
    return out_dir


def yes_no_reranker_overrides(path: Path) -> tuple[dict, tuple[int, int]]:
    """A random Qwen3 causal LM served as Qwen3-Reranker is, by vLLM's --hf-overrides: the
    score is the softmax of the LM head's logits of two tokens ("no", "yes"), here two tokens
    of the test vocabulary. Returns the overrides and the two tokens' ids (no, yes)."""
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    no, yes = sorted(vocab, key=vocab.get)[300:302]
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": [no, yes],
        "is_original_qwen3_reranker": True,
    }
    return overrides, (vocab[no], vocab[yes])
