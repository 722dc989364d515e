"""LLaVA-1.5 (transformers' LlavaForConditionalGeneration): a CLIP vision tower (models/clip.py),
a two-layer projector, and a Llama language model whose prompt rows at the image tokens take
the projected image features in place of the token embeddings.

Under tensor parallelism the language model splits as any Llama does; the vision tower and the
projector are whole on rank 0 and absent from the other ranks, which receive the image rows'
embeddings with the step (engine/image_broadcast.py)."""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.distributed import get_rank
from nanoserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from nanoserve.models.clip import CLIPVisionModel, activation
from nanoserve.models.config import ModelConfig
from nanoserve.models.llava_config import VisionConfig
from nanoserve.models.vision_language import VisionLanguageForCausalLM


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision: VisionConfig, text_hidden: int, dtype: torch.dtype):
        super().__init__()
        bias = vision.projector_bias
        self.linear_1 = ColumnParallelLinear(
            vision.hidden_size, text_hidden, bias, dtype, disable_tp=True
        )
        self.act = activation(vision.projector_hidden_act)
        self.linear_2 = RowParallelLinear(text_hidden, text_hidden, bias, dtype, disable_tp=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(VisionLanguageForCausalLM):
    # Checkpoint name prefixes -> ours, the first that matches: transformers 4.x wrote
    # language_model.model.*, language_model.lm_head.*, vision_tower.vision_model.*; 4.52+ and 5.x
    # write model.language_model.*, model.vision_tower.vision_model.*, lm_head.*; transformers
    # 5's save_pretrained writes the 4.x names with the tower's own (vision_tower.encoder.*).
    checkpoint_prefixes = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
        ("model.vision_tower.vision_model.", "vision_tower.vision_model."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("vision_tower.vision_model.", "vision_tower.vision_model."),
        ("vision_tower.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__(config, dtype)
        assert config.vision is not None
        if get_rank() > 0:  # the encoder runs on rank 0 only: no tower, no projector here
            self.vision_tower = self.multi_modal_projector = None
            self.checkpoint_skips = ("vision_tower.", "multi_modal_projector.")
            return
        self.vision_tower = CLIPVisionModel(config.vision, dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(
            config.vision, config.hidden_size, dtype
        )
        self.checkpoint_skips = self.vision_tower.unused_checkpoint_prefixes("vision_tower.")

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] -> [images, image_seq_length, hidden]: the rows that stand in
        for each image's tokens."""
        features = self.vision_tower(pixel_values)
        if self.config.vision.select_strategy == "default":
            features = features[:, 1:]  # the class token's row is dropped
        images, rows, hidden = features.shape
        out = self.multi_modal_projector(features.reshape(images * rows, hidden))
        return out.reshape(images, rows, -1)

    def embed_image_list(self, pixel_values: list[torch.Tensor], grids: list) -> list[torch.Tensor]:
        """The encoder cache's call: each image's [image_seq_length, hidden] (grids: None)."""
        return list(self.embed_images(torch.stack(pixel_values)))
