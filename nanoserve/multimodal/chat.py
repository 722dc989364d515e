"""The images of a chat conversation: each `image_url` content part (OpenAI's shape,
`{"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": "auto"}}`,
or an http(s) URL) decoded in order, each refusal a 400 naming the part's field; offline
(`LLM.chat`), vLLM's `{"type": "image_pil", "image_pil": <PIL image>}` parts too."""

from __future__ import annotations

import time

from PIL import Image

from nanoserve.errors import InvalidRequestError
from nanoserve.multimodal.fetch import FetchPolicy
from nanoserve.multimodal.image import ImageLimits, image_from_url

DETAILS = ("auto", "low", "high")  # accepted, changing nothing (as vLLM)
IMAGE_PART_TYPES = ("image_url", "image_pil")


def image_parts(messages: list[dict]):
    """(the part's field name, the part) for each image part, in order."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, (list, tuple)):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                yield f"messages[{i}].content[{j}].{part['type']}", part


def has_images(messages: list[dict]) -> bool:
    return next(image_parts(messages), None) is not None


def has_remote_images(messages: list[dict]) -> bool:
    """Whether an image part names an http(s) URL (fetching it blocks: not on an event loop)."""
    for _, part in image_parts(messages):
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if isinstance(url, str) and url[:8].lower().startswith(("http://", "https://")):
            return True
    return False


def chat_images(
    messages: list[dict], limits: ImageLimits | None = None, fetch: FetchPolicy | None = None
) -> list[Image.Image]:
    """The conversation's images, decoded from their data: URLs or fetched (in order, all of
    them within the one timeout of `fetch`'s policy, default: any public host)."""
    limits = limits or ImageLimits()
    fetch = fetch or FetchPolicy()
    deadline = time.monotonic() + fetch.timeout
    images = []
    for field, part in image_parts(messages):
        if part["type"] == "image_pil":  # LLM.chat's PIL image (JSON cannot carry one)
            image = part.get("image_pil")
            if not isinstance(image, Image.Image):
                raise InvalidRequestError(
                    f"an image_pil part holds a PIL image, got {type(image).__name__}", field
                )
            limits.check_size(image, field)
            images.append(image)
            continue
        spec = part.get("image_url")
        if isinstance(spec, str):  # some clients send the URL itself
            spec = {"url": spec}
        if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
            raise InvalidRequestError("an image_url part needs image_url.url (a string)", field)
        detail = spec.get("detail", "auto")
        if detail not in DETAILS:
            raise InvalidRequestError(
                f"image_url.detail must be one of {', '.join(DETAILS)}, got {detail!r}",
                f"{field}.detail",
            )
        images.append(image_from_url(spec["url"], limits, f"{field}.url", fetch, deadline))
    return images
