"""Decoder sequence classifiers (`LlamaForSequenceClassification`, `Qwen2...`, `Qwen3...`, as
transformers builds them): the decoder, pooled at its last token, then a `score` head (a
linear layer without bias) in place of the LM head. Rerankers ship this way (Qwen3-Reranker
converted to one label); pooling models only.

vLLM's `classifier_from_token` (through `--hf-overrides`) serves a causal LM as a classifier
with no conversion: its labels are the LM head's logits of those tokens; with
`is_original_qwen3_reranker` there is one label, the second token's logit less the first's,
so that its sigmoid is the softmax of the two (Qwen3-Reranker: `["no", "yes"]`)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from nanoserve.layers.linear import ColumnParallelLinear
from nanoserve.models.config import ModelConfig
from nanoserve.tokenizer import Tokenizer


@functools.cache
def sequence_classifier_class(base: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """`base` (a *ForCausalLM class) made into its *ForSequenceClassification."""

    class ForSequenceClassification(base):
        pooling_tasks = ("classify", "score")

        def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
            super().__init__(config, dtype)
            self.dtype = dtype
            self.label_token_ids: list[int] = []  # classifier_from_token's, set at load
            if not config.classifier_from_token:  # the checkpoint's own `score` head
                del self.lm_head
                self.score = ColumnParallelLinear(
                    config.hidden_size, config.num_labels, False, dtype
                )

        def classify(self, last_rows: torch.Tensor) -> torch.Tensor:
            """[n, hidden] last-token hidden states (float32 from pooling) -> [n, labels]."""
            rows = last_rows.to(self.dtype)
            if not self.label_token_ids:
                return self.score(rows)
            logits = self.compute_logits(rows)[:, self.label_token_ids].float()
            if self.config.original_qwen3_reranker:
                return (logits[:, 1] - logits[:, 0]).unsqueeze(1)
            return logits

    ForSequenceClassification.__name__ = base.__name__.replace(
        "ForCausalLM", "ForSequenceClassification"
    )
    return ForSequenceClassification


def label_token_ids(config: ModelConfig, model_dir: Path) -> list[int]:
    """classifier_from_token's tokens as ids of the model's own tokenizer (each one token)."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    ids = []
    for token in config.classifier_from_token:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of this model")
        ids.append(token_id)
    return ids
