"""A prompt's images as the engine carries them: each image's pixel values, its hash and where
its tokens sit in the prompt; and the prompt's expansion (each image placeholder token becomes
the image's image_seq_length tokens, as LlavaProcessor expands its text)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image

from nanoserve.errors import InvalidRequestError
from nanoserve.multimodal.image import ImageLimits
from nanoserve.multimodal.processor import ClipImageProcessor, pixel_hash


@dataclass(frozen=True, slots=True, eq=False)
class PromptImage:
    """One image of a prompt: its tokens are prompt positions [position, position + length)."""

    pixel_values: torch.Tensor  # [3, H, W] as the vision tower reads it
    image_hash: str  # sha256 of pixel_values: the encoder cache's and prefix cache's key
    position: int
    length: int

    @property
    def end(self) -> int:
        return self.position + self.length


@dataclass(frozen=True, slots=True)
class ImagePromptBuilder:
    """What a vision-language model needs to turn (token ids, images) into its prompt."""

    processor: ClipImageProcessor
    image_token_id: int
    image_seq_length: int
    limits: ImageLimits

    def expand(
        self, token_ids: list[int], images: list[Image.Image], field: str
    ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """The prompt with each placeholder expanded, and its images in order."""
        self.limits.check_count(len(images), field)
        placeholders = token_ids.count(self.image_token_id)
        if placeholders != len(images):
            raise InvalidRequestError(
                f"the prompt has {placeholders} image placeholder(s) for {len(images)} image(s)",
                field,
            )
        expanded: list[int] = []
        prompt_images = []
        pending = iter(images)
        for token in token_ids:
            if token != self.image_token_id:
                expanded.append(token)
                continue
            image = next(pending)
            self.limits.check_size(image, field)
            pixels = self.processor.pixel_values(image)
            prompt_images.append(
                PromptImage(pixels, pixel_hash(pixels), len(expanded), self.image_seq_length)
            )
            expanded.extend([self.image_token_id] * self.image_seq_length)
        return expanded, tuple(prompt_images)
