"""The image processor Qwen2-VL and Qwen2.5-VL checkpoints ship (preprocessor_config.json,
transformers' Qwen2VLImageProcessor), written with PIL and torch to give its pixel values
exactly: RGB, a bicubic resize to the nearest size whose sides are multiples of
patch_size * merge_size and whose area lies between min_pixels and max_pixels (smart_resize),
rescaled and normalized, then cut into patches: one row per patch, in the order the vision
tower's 2x2 patch merger reads them, each row the patch's channels over temporal_patch_size
frames (a still image is its own second frame)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from nanoserve.multimodal.processor import CLIP_MEAN, CLIP_STD, ProcessedImage, to_rgb

# Qwen2VLImageProcessor's defaults (a checkpoint's preprocessor_config.json names its own).
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, the area scaled into [min_pixels,
    max_pixels] keeping the aspect ratio (transformers' smart_resize, the same rounding)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"the image's aspect ratio must be below {MAX_ASPECT_RATIO}, got "
            f"{max(height, width) / min(height, width):g}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class QwenVLImageProcessor:
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    resample: int = Image.Resampling.BICUBIC

    @classmethod
    def from_dir(
        cls, model_dir: Path, patch_size: int, temporal_patch_size: int, merge_size: int
    ) -> QwenVLImageProcessor:
        """From preprocessor_config.json (min_pixels / max_pixels, or transformers 5's
        size.shortest_edge / longest_edge, which they override); without one, the vision
        tower's sizes and the processor's defaults."""
        path = Path(model_dir) / "preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        size = raw.get("size") or {}
        min_pixels = raw.get("min_pixels") or size.get("shortest_edge") or MIN_PIXELS
        max_pixels = raw.get("max_pixels") or size.get("longest_edge") or MAX_PIXELS
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if raw.get(flag) is False:
                raise ValueError(f"{path}: {flag} false is not supported")
        processor = cls(
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            patch_size=int(raw.get("patch_size", patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", temporal_patch_size)),
            merge_size=int(raw.get("merge_size", merge_size)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            image_mean=tuple(raw.get("image_mean", CLIP_MEAN)),
            image_std=tuple(raw.get("image_std", CLIP_STD)),
            resample=int(raw.get("resample", Image.Resampling.BICUBIC)),
        )
        if (processor.patch_size, processor.temporal_patch_size, processor.merge_size) != (
            patch_size,
            temporal_patch_size,
            merge_size,
        ):
            raise ValueError(
                f"{path}: patch_size / temporal_patch_size / merge_size differ from the vision "
                "tower's in config.json"
            )
        return processor

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after smart_resize."""
        factor = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        return w, h

    def preprocess(self, image: Image.Image) -> ProcessedImage:
        """Its patches [grid_h * grid_w, channels * temporal_patch_size * patch * patch]
        (float32), its grid (1, grid_h, grid_w) in patches and its number of prompt tokens
        (one per merged 2x2 patches)."""
        image = to_rgb(image).resize(self.resized_size(*image.size), resample=self.resample)
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)
        # transformers rescales in float64 then keeps float32, and normalizes in float32.
        scaled = (pixels.double() * self.rescale_factor).float()
        mean = torch.tensor(self.image_mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(self.image_std, dtype=torch.float32)[:, None, None]
        normalized = (scaled - mean) / std
        channels, height, width = normalized.shape
        patch, merge = self.patch_size, self.merge_size
        grid_h, grid_w = height // patch, width // patch
        patches = normalized.reshape(
            channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch
        ).permute(1, 4, 2, 5, 0, 3, 6)  # (h blocks, w blocks, merge h, merge w, C, ph, pw)
        # a still image: the same frame temporal_patch_size times
        patches = patches.unsqueeze(5).expand(*patches.shape[:5], self.temporal_patch_size, -1, -1)
        rows = patches.reshape(grid_h * grid_w, channels * self.temporal_patch_size * patch * patch)
        return ProcessedImage(
            pixel_values=rows.contiguous(),
            grid_thw=(1, grid_h, grid_w),
            num_tokens=grid_h * grid_w // merge**2,
            rope_grid=(1, grid_h // merge, grid_w // merge),
        )
