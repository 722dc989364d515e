"""Qwen2.5-VL's M-RoPE positions (transformers' get_rope_index), from a sequence's images alone:
a text token has one position for its three sections (temporal, height, width); an image's
tokens have (base + t, base + row, base + column), base being where its first token's position
would have been; the text after an image goes on from the image's largest position + 1. So
every token after an image sits `max(h, w) - h * w` positions earlier than its index, and a
generated token's position is its index plus the sum of those (its request's rope delta).

Computed for any range of the sequence, so a prompt chunk that cuts an image, a prefix-cache
hit, a recomputed preempted request and a decode all get the positions of the whole prompt."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoserve.multimodal.inputs import PromptImage


def uses_mrope(images: Sequence[PromptImage]) -> bool:
    return any(image.rope_grid is not None for image in images)


def image_delta(image: PromptImage) -> int:
    """How much earlier than its index each token after the image sits."""
    _, height, width = image.rope_grid
    return max(height, width) - image.length


def rope_shift(images: Sequence[PromptImage], index: int) -> int:
    """Position less index of a text token at `index` (none of the images' tokens)."""
    return sum(
        image_delta(image) for image in images if image.rope_grid is not None and image.end <= index
    )


def overlaps_image(images: Sequence[PromptImage], start: int, end: int) -> bool:
    return any(
        image.rope_grid is not None and image.position < end and start < image.end
        for image in images
    )


def mrope_positions(images: Sequence[PromptImage], start: int, end: int) -> torch.Tensor:
    """[3, end - start] long: the (temporal, height, width) positions of tokens [start, end)."""
    positions = torch.arange(start, end, dtype=torch.long).repeat(3, 1)
    shift = 0  # of the images before the current one
    for image in images:
        if image.rope_grid is None:
            continue
        if image.position >= end:
            break
        first, last = max(image.position, start), min(image.end, end)
        if first < last:
            grid_t, grid_h, grid_w = image.rope_grid
            offsets = torch.arange(first - image.position, last - image.position)
            base = image.position + shift
            per_frame = grid_h * grid_w
            positions[0, first - start : last - start] = base + offsets // per_frame
            positions[1, first - start : last - start] = base + offsets % per_frame // grid_w
            positions[2, first - start : last - start] = base + offsets % grid_w
        shift += image_delta(image)
        if image.end < end:  # text after it, up to the next image, moves by the new shift
            positions[:, max(image.end, start) - start :] += image_delta(image)
    return positions
