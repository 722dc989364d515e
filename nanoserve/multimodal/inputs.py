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
            pixels = self._pixel_values(next(pending), field)
            prompt_images.append(
                PromptImage(pixels, pixel_hash(pixels), len(expanded), self.image_seq_length)
            )
            expanded.extend([self.image_token_id] * self.image_seq_length)
        return expanded, tuple(prompt_images)

    def _pixel_values(self, image: Image.Image, field: str) -> torch.Tensor:
        """The image checked and preprocessed: a PIL image (LLM.generate's may be lazily loaded)
        within the pixel limit, before and after its resize to the model's size (an extreme
        aspect ratio would blow up there: 1x4096 pixels become 336x1376256)."""
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(
                f"multi_modal_data's images are PIL images, got {type(image).__name__}",
                "multi_modal_data",
            )
        self.limits.check_size(image, field)
        width, height = self.processor.resized_size(*image.size)
        if width * height > self.limits.max_pixels:
            raise InvalidRequestError(
                f"the image's {image.width}x{image.height} pixels would be resized to "
                f"{width}x{height} for the model, more than the limit of "
                f"{self.limits.max_pixels} pixels (--max-image-pixels)",
                field,
            )
        try:
            return self.processor.pixel_values(image)
        except (OSError, ValueError, SyntaxError, EOFError) as error:
            raise InvalidRequestError(f"the image could not be decoded: {error}", field) from None
