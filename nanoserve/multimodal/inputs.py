"""A prompt's images as the engine carries them: each image's pixel values, its hash and where
its tokens sit in the prompt; and the prompt's expansion (each image placeholder token becomes
the image's tokens: image_seq_length of them as LlavaProcessor expands its text, or as many as
the image's grid gives as Qwen2.5-VL's processor does)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image

from nanoserve.errors import InvalidRequestError
from nanoserve.multimodal.image import ImageLimits
from nanoserve.multimodal.processor import ClipImageProcessor, ProcessedImage, pixel_hash
from nanoserve.multimodal.qwen_processor import QwenVLImageProcessor


@dataclass(frozen=True, slots=True, eq=False)
class PromptImage:
    """One image of a prompt: its tokens are prompt positions [position, position + length)."""

    pixel_values: torch.Tensor  # as the vision tower reads it ([3, H, W]; Qwen: [patches, dim])
    image_hash: str  # sha256 of pixel_values: the encoder cache's and prefix cache's key
    position: int
    length: int
    # Qwen2.5-VL: its grid (t, h, w) in patches (the vision tower's) and in tokens (M-RoPE's
    # positions, multimodal/mrope.py); None for a model of fixed-size images and 1D RoPE.
    grid_thw: tuple[int, int, int] | None = None
    rope_grid: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.position + self.length


@dataclass(frozen=True, slots=True)
class ImagePromptBuilder:
    """What a vision-language model needs to turn (token ids, images) into its prompt."""

    processor: ClipImageProcessor | QwenVLImageProcessor
    image_token_id: int
    image_seq_length: int  # tokens per image where the processor does not say (LLaVA's)
    limits: ImageLimits
    # The id the image's positions hold (None: image_token_id; a placeholder past the model's
    # vocabulary, llama.cpp's "<__media__>", expands to an id inside it).
    fill_token_id: int | None = None

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
            processed = self._preprocess(next(pending), field)
            length = processed.num_tokens or self.image_seq_length
            prompt_images.append(
                PromptImage(
                    processed.pixel_values,
                    pixel_hash(processed.pixel_values, processed.grid_thw),
                    len(expanded),
                    length,
                    processed.grid_thw,
                    processed.rope_grid,
                )
            )
            fill = self.image_token_id if self.fill_token_id is None else self.fill_token_id
            expanded.extend([fill] * length)
        return expanded, tuple(prompt_images)

    def _preprocess(self, image: Image.Image, field: str) -> ProcessedImage:
        """The image checked and preprocessed: a PIL image (LLM.generate's may be lazily loaded)
        within the pixel limit, before and after its resize to the model's size (an extreme
        aspect ratio would blow up there: CLIP's 336-pixel shortest edge makes 1x4096 pixels
        336x1376256)."""
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(
                f"multi_modal_data's images are PIL images, got {type(image).__name__}",
                "multi_modal_data",
            )
        self.limits.check_size(image, field)
        try:
            width, height = self.processor.resized_size(*image.size)
            if width * height > self.limits.max_pixels:
                raise InvalidRequestError(
                    f"the image's {image.width}x{image.height} pixels would be resized to "
                    f"{width}x{height} for the model, more than the limit of "
                    f"{self.limits.max_pixels} pixels (--max-image-pixels)",
                    field,
                )
            return self.processor.preprocess(image)
        except InvalidRequestError:
            raise
        except ValueError as error:  # an aspect ratio the processor cannot resize (Qwen's)
            raise InvalidRequestError(str(error), field) from None
        except (OSError, SyntaxError, EOFError) as error:  # a lazily loaded file's pixels
            raise InvalidRequestError(f"the image could not be decoded: {error}", field) from None
