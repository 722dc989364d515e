"""What the vision-language models (models/llava.py, models/qwen2_5_vl.py) share: a Llama-style
language model whose step may take its input rows from the vision tower (`inputs_embeds`, the
image rows placed by engine/image_step.py) instead of the token embeddings.

Their vision tower lives on rank 0 only, whose step broadcast carries the image rows to the other
ranks (engine/image_broadcast.py): tensor parallelism splits the language model alone. Pipeline
parallelism is refused (models/registry.check_pipeline_support)."""

from __future__ import annotations

import torch

from nanoserve.layers.attention import AttentionMetadata
from nanoserve.models.llama import LlamaForCausalLM


class VisionLanguageForCausalLM(LlamaForCausalLM):
    supports_pipeline_parallel = False
    supports_tensor_parallel = True

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        intermediate=None,
        inputs_embeds: torch.Tensor | None = None,
    ):
        """`inputs_embeds`: the step's rows with the images' placed (engine/image_step.py)."""
        return self.run_text_model(
            input_ids, positions, self.cos_sin_cache, metadata, intermediate, inputs_embeds
        )

    def run_text_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        metadata: AttentionMetadata,
        intermediate,
        inputs_embeds: torch.Tensor | None,
    ):
        if inputs_embeds is not None:
            intermediate = (inputs_embeds, None)
        return self.model(input_ids, positions, cos_sin, metadata, intermediate)
