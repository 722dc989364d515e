"""PoolingParams: a pooling request's options, as vLLM's (no torch here: clients import it
cheaply, as SamplingParams).

`task` says what the request asks of the pooling model (vLLM's names):
- "embed": the prompt's embedding (`outputs.data`, also `outputs.embedding`);
- "classify": a sequence classifier's class probabilities (`outputs.data`, `outputs.probs`);
- "score": a cross-encoder's score of one (text, text_pair) prompt (`outputs.data` is
  `[score]`); an embedding model's score is the cosine of two embeddings (LLM.score).
None takes the model's default (embed for embedding models, classify for classifiers).
`activation` (classify / score): None takes the model's: softmax over the labels when the
model has more than one, sigmoid when it has one; False gives the raw logits."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "score")


@dataclass(slots=True)
class PoolingParams:
    """Per request: `dimensions` keeps the first N (Matryoshka) before normalizing; `normalize`
    None takes the model's. `truncate_prompt_tokens`: keep at most this many prompt tokens
    (-1: the model's limit); special tokens stay, as the tokenizer's truncation keeps them."""

    dimensions: int | None = None
    normalize: bool | None = None
    task: str | None = None
    activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}")
        if self.truncate_prompt_tokens is not None and (
            self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1
        ):
            raise ValueError(
                f"truncate_prompt_tokens must be -1 or >= 1, got {self.truncate_prompt_tokens}"
            )
