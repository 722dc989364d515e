"""A step's image rows (vision-language models): the vision encoder runs once per image, its
embeddings kept by the image's hash in an encoder cache shared by every request, and each image
slice a step holds (engine/step_input.ImageSlice) replaces the token embeddings of its rows."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from nanoserve.engine.step_input import ImageSlice

# Images whose embeddings are kept, the least recently used dropped first: at most 64 images
# and at most 64 x 576 rows in all (64 LLaVA-1.5-7B images: 600 MB in bf16; a Qwen2.5-VL image
# may take up to 16,384 rows, so the rows bound what a few large images keep: 260 MB for
# Qwen2.5-VL-7B's 3,584-wide rows).
ENCODER_CACHE_ENTRIES = 64
ENCODER_CACHE_ROWS = 64 * 576


class EncoderCache:
    """Image embeddings ([the image's rows, hidden]) by image hash, least recently used first.
    An image's row count is its own (LLaVA: image_seq_length; Qwen2.5-VL: from its grid)."""

    def __init__(
        self,
        encode: Callable[[list[torch.Tensor], list[tuple | None]], list[torch.Tensor]],
        device: torch.device,
        max_entries: int = ENCODER_CACHE_ENTRIES,
        max_rows: int = ENCODER_CACHE_ROWS,
    ):
        # (each image's pixel values, each one's grid or None) -> each one's [rows, hidden]
        self.encode = encode
        self.device = device
        self.max_entries, self.max_rows = max_entries, max_rows
        self.num_rows = 0  # the kept embeddings' rows, all images together
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_encoded_images = 0  # vision encoder runs, one per image encoded

    def embeddings(self, slices: list[ImageSlice]) -> dict[str, torch.Tensor]:
        """Each slice's image's embeddings: cached ones reused, the others encoded in one batch."""
        missing: dict[str, ImageSlice] = {}
        for piece in slices:
            if piece.image_hash not in self.entries:
                missing.setdefault(piece.image_hash, piece)
        found = {h: self.entries[h] for h in {p.image_hash for p in slices} if h in self.entries}
        if missing:
            pixels = [piece.pixel_values.to(self.device) for piece in missing.values()]
            grids = [piece.grid_thw for piece in missing.values()]
            for image_hash, rows in zip(missing, self.encode(pixels, grids), strict=True):
                found[image_hash] = rows
            self.num_encoded_images += len(missing)
        for image_hash, rows in found.items():
            if image_hash not in self.entries:
                self.num_rows += rows.shape[0]
            self.entries[image_hash] = rows
            self.entries.move_to_end(image_hash)
        # (this step's images stay in `found` even where they are dropped here)
        while self.entries and (
            len(self.entries) > self.max_entries or self.num_rows > self.max_rows
        ):
            _, dropped = self.entries.popitem(last=False)
            self.num_rows -= dropped.shape[0]
        return found


def embed_with_images(
    embed_tokens: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    image_rows: list[tuple[int, ImageSlice]],
    cache: EncoderCache,
) -> torch.Tensor:
    """The step's input embeddings, each image slice's rows taken from its image's embeddings.
    `image_rows`: (the step row of the slice's first token, the slice)."""
    embeds = embed_tokens(input_ids)
    images = cache.embeddings([piece for _, piece in image_rows])
    for row, piece in image_rows:
        rows = images[piece.image_hash][piece.offset : piece.offset + piece.count]
        embeds[row : row + piece.count] = rows.to(embeds.dtype)
    return embeds
