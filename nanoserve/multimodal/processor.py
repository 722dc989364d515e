"""The CLIP image processor LLaVA checkpoints ship (preprocessor_config.json), written with PIL
and torch to give transformers' CLIPImageProcessor's pixel values exactly: RGB (transparency
composited onto white), the shortest edge resized (bicubic), a center crop, rescaled by 1/255
and normalized by the processor's mean and std; and the sha256 of the pixels the encoder reads."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# OpenAI CLIP's mean and std: CLIPImageProcessor's defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True, eq=False)
class ProcessedImage:
    """An image as its processor leaves it for the vision tower and the prompt."""

    pixel_values: torch.Tensor  # as the vision tower reads it ([3, H, W]; Qwen: [patches, dim])
    # Qwen2.5-VL's dynamic resolution: its grid (t, h, w) in patches, its number of prompt
    # tokens and their M-RoPE grid (t, h, w) in tokens; None: the model's fixed count, 1D RoPE.
    grid_thw: tuple[int, int, int] | None = None
    num_tokens: int | None = None
    rope_grid: tuple[int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class ClipImageProcessor:
    shortest_edge: int
    crop_height: int
    crop_width: int
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    resample: int = Image.Resampling.BICUBIC

    @classmethod
    def from_dir(cls, model_dir: Path, image_size: int) -> ClipImageProcessor:
        """From preprocessor_config.json; without one, the vision tower's image size and
        CLIP's defaults."""
        path = Path(model_dir) / "preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        size = raw.get("size", {"shortest_edge": image_size})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if "shortest_edge" not in size:
            raise ValueError(f"{path}: only a shortest_edge resize is supported, got {size}")
        crop = raw.get("crop_size", {"height": image_size, "width": image_size})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        for flag in ("do_resize", "do_center_crop", "do_rescale", "do_normalize"):
            if raw.get(flag) is False:
                raise ValueError(f"{path}: {flag} false is not supported")
        if crop["height"] > size["shortest_edge"] or crop["width"] > size["shortest_edge"]:
            raise ValueError(f"{path}: a crop larger than the resized image is not supported")
        return cls(
            shortest_edge=int(size["shortest_edge"]),
            crop_height=int(crop["height"]),
            crop_width=int(crop["width"]),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            image_mean=tuple(raw.get("image_mean", CLIP_MEAN)),
            image_std=tuple(raw.get("image_std", CLIP_STD)),
            resample=int(raw.get("resample", Image.Resampling.BICUBIC)),
        )

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) with the shortest edge at shortest_edge (transformers' rounding)."""
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(self.shortest_edge * long / short)
        if width <= height:
            return self.shortest_edge, new_long
        return new_long, self.shortest_edge

    def preprocess(self, image: Image.Image) -> ProcessedImage:
        return ProcessedImage(self.pixel_values(image))

    def pixel_values(self, image: Image.Image) -> torch.Tensor:
        """[3, crop_height, crop_width] float32."""
        image = to_rgb(image).resize(self.resized_size(*image.size), resample=self.resample)
        top = (image.height - self.crop_height) // 2
        left = (image.width - self.crop_width) // 2
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)
        pixels = pixels[:, top : top + self.crop_height, left : left + self.crop_width]
        # transformers rescales in float64 then keeps float32, and normalizes in float32.
        scaled = (pixels.double() * self.rescale_factor).float()
        mean = torch.tensor(self.image_mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(self.image_std, dtype=torch.float32)[:, None, None]
        return (scaled - mean) / std


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: transparency composited onto white, else converted."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def pixel_hash(pixel_values: torch.Tensor, grid_thw: tuple[int, int, int] | None = None) -> str:
    """The image's identity for the encoder and prefix caches: sha256 of its pixel values (and
    of its patch grid, where the rows alone do not say the image's shape)."""
    digest = hashlib.sha256(pixel_values.contiguous().numpy().tobytes())
    if grid_thw is not None:
        digest.update(repr(tuple(grid_thw)).encode())
    return digest.hexdigest()
