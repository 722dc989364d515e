"""Images as clients send them: bytes (png, jpeg, webp, gif's first frame), data: URLs or
http(s) URLs (fetched by fetch.py), decoded with PIL under the limits (decoded bytes, pixels);
each refusal is a 400 naming the request field."""

from __future__ import annotations

import base64
import binascii
import io
import time
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from nanoserve.errors import InvalidRequestError
from nanoserve.multimodal.fetch import FetchPolicy, fetch_url

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# The defaults of --max-image-bytes and --max-image-pixels (config.py).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 4096 * 4096


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """--limit-mm-per-prompt's images per prompt; --max-image-bytes, the bytes an image's data
    may take (a data: URL's decoded base64, an http(s) URL's body); --max-image-pixels, the
    pixels (width x height) an image may have."""

    max_images: int = 1
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS

    def check_count(self, count: int, field: str) -> None:
        if count > self.max_images:
            raise InvalidRequestError(
                f"At most {self.max_images} image(s) may be provided in one prompt, got {count} "
                "(--limit-mm-per-prompt)",
                field,
            )

    def check_size(self, image: Image.Image, field: str) -> None:
        width, height = image.size
        if width == 0 or height == 0:
            raise InvalidRequestError(f"the image has no pixels ({width}x{height})", field)
        if width * height > self.max_pixels:
            raise InvalidRequestError(
                f"the image has {width}x{height} pixels, more than the limit of "
                f"{self.max_pixels} pixels (--max-image-pixels)",
                field,
            )


def decode_image(data: bytes, limits: ImageLimits, field: str) -> Image.Image:
    """`data` as an image (an animated gif: its first frame), loaded and checked."""
    if len(data) > limits.max_bytes:
        raise InvalidRequestError(
            f"the image's data is {len(data)} bytes, more than the limit of {limits.max_bytes} "
            "(--max-image-bytes)",
            field,
        )
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        limits.check_size(image, field)  # before the pixels are decoded
        image.seek(0)
        image.load()
        # A photo's EXIF orientation applied, as transformers' load_image applies it to a URL's
        # or base64 image (vLLM does not): the model sees the picture upright.
        ImageOps.exif_transpose(image, in_place=True)
    except InvalidRequestError:
        raise
    except Image.DecompressionBombError:
        # PIL's own limit (twice Image.MAX_IMAGE_PIXELS), met on opening, before ours.
        bomb = 2 * Image.MAX_IMAGE_PIXELS
        limit = (
            f"the limit of {limits.max_pixels} pixels (--max-image-pixels)"
            if limits.max_pixels < bomb
            else "PIL's decompression-bomb limit, which caps --max-image-pixels"
        )
        raise InvalidRequestError(
            f"the image has more than {bomb} pixels, more than {limit}", field
        ) from None
    except UnidentifiedImageError:
        raise InvalidRequestError(
            "the image could not be decoded: its data is not a png, jpeg, webp or gif image", field
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as error:
        raise InvalidRequestError(
            f"the image could not be decoded (png, jpeg, webp or gif): {error}", field
        ) from None
    return image


def image_from_url(
    url: str,
    limits: ImageLimits,
    field: str,
    fetch: FetchPolicy | None = None,
    deadline: float | None = None,
) -> Image.Image:
    """An image_url part's url: a base64 data: URL, or an http(s) URL fetched under `fetch`'s
    policy (default: any public host) by `deadline` (time.monotonic(); default: the policy's
    timeout from now)."""
    if url[:8].lower().startswith(("http://", "https://")):
        fetch = fetch or FetchPolicy()
        if deadline is None:
            deadline = time.monotonic() + fetch.timeout
        return decode_image(fetch_url(url, fetch, limits.max_bytes, field, deadline), limits, field)
    if not url.startswith("data:"):
        raise InvalidRequestError(
            "an image URL must be a data: URL (data:image/png;base64,...) or an http(s) URL",
            field,
        )
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep or not header.endswith(";base64") or not header.startswith("image/"):
        raise InvalidRequestError(
            "an image data: URL must read data:image/<format>;base64,<data>", field
        )
    # base64 takes 4 characters per 3 bytes: refuse before decoding what cannot fit.
    if len(payload) // 4 * 3 > limits.max_bytes + 3:
        raise InvalidRequestError(
            f"the image's data is more than the limit of {limits.max_bytes} bytes "
            "(--max-image-bytes)",
            field,
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("the image data: URL is not valid base64", field) from None
    return decode_image(data, limits, field)
