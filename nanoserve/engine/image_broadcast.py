"""A step's image rows under tensor parallelism. The vision encoder and its cache live on rank 0
only: rank 0 looks each image slice up in its encoder cache (encoding the images it lacks),
gathers the rows the step places, and sends them with the step: their step rows in the int64
payload (engine/model_input.py), their values as a third broadcast of raw bytes. Every rank,
rank 0 included, then places the same values at the same rows, so the ranks' language-model
shards start from identical inputs, and there is one encoder cache and one set of image hashes
(rank 0's, beside its scheduler and prefix cache), not one per rank to keep in step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoserve.engine.image_step import EncoderCache
from nanoserve.engine.step_input import ImageSlice


@dataclass(slots=True)
class ImageEmbeds:
    """The step rows that take image embeddings, and their values ([rows, hidden])."""

    rows: torch.Tensor  # int64 step row indices
    values: torch.Tensor | None  # None on a rank > 0 until receive_values

    def place(self, embeds: torch.Tensor) -> torch.Tensor:
        """The token embeddings with the image rows replaced."""
        embeds[self.rows] = self.values.to(embeds.dtype)
        return embeds


def gather_image_embeds(
    image_rows: list[tuple[int, ImageSlice]],
    cache: EncoderCache,
    dtype: torch.dtype,
    device: torch.device,
) -> ImageEmbeds:
    """Rank 0: the step's image rows and their embeddings, in `dtype` (the token embeddings')."""
    images = cache.embeddings([piece for _, piece in image_rows])
    rows = [torch.arange(row, row + piece.count) for row, piece in image_rows]
    values = [
        images[piece.image_hash][piece.offset : piece.offset + piece.count]
        for _, piece in image_rows
    ]
    return ImageEmbeds(torch.cat(rows).to(device), torch.cat(values).to(device=device, dtype=dtype))


def send_values(image_embeds: ImageEmbeds) -> None:
    """Rank 0, after the step's payload: the rows' values as bytes (any dtype, NCCL or gloo)."""
    dist.broadcast(image_embeds.values.contiguous().view(torch.uint8).flatten(), src=0)


def receive_values(
    image_embeds: ImageEmbeds, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> None:
    """A rank > 0: send_values' bytes into image_embeds.values."""
    count = image_embeds.rows.numel()
    element_size = torch.empty(0, dtype=dtype).element_size()
    received = torch.empty(count * hidden_size * element_size, dtype=torch.uint8, device=device)
    dist.broadcast(received, src=0)
    image_embeds.values = received.view(dtype).view(count, hidden_size)
