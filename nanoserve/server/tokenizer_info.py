"""GET /tokenizer_info (with --enable-tokenizer-info-endpoint): the tokenizer's configuration as
vLLM reports it, i.e. tokenizer_config.json without file paths, plus its class, added tokens
and chat template."""

from __future__ import annotations

from typing import Any


def _plain(value: Any) -> Any:
    """JSON-able: a serialized AddedToken ({"content": ...}) becomes its text, as vLLM writes it."""
    if isinstance(value, dict):
        if "content" in value and "__type" in value:
            return value["content"]
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def tokenizer_info(tokenizer) -> dict[str, Any]:
    config = {
        key: _plain(value)
        for key, value in getattr(tokenizer, "config", {}).items()
        if key not in ("vocab_file", "merges_file", "added_tokens_decoder")
    }
    added = {}
    for token_id, token in sorted(tokenizer.backend.get_added_tokens_decoder().items()):
        added[str(token_id)] = {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
    config["added_tokens_decoder"] = added
    config["tokenizer_class"] = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    return config
