"""Our CLIP preprocessing (PIL and torch) against transformers' CLIPImageProcessor (its PIL
backend) on images of several sizes and modes; image decoding, data: URLs and their limits."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from nanoserve.errors import InvalidRequestError
from nanoserve.multimodal.chat import chat_images
from nanoserve.multimodal.image import ImageLimits, decode_image, image_from_url
from nanoserve.multimodal.processor import ClipImageProcessor, pixel_hash
from tests.multimodal.llava_checkpoint import IMAGE_SIZE


def random_image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    "size,mode",
    [
        ((56, 56), "RGB"),
        ((100, 60), "RGB"),
        ((33, 91), "RGBA"),
        ((57, 200), "L"),
        ((300, 57), "LA"),
    ],
)
@pytest.mark.parametrize("shortest_edge", [IMAGE_SIZE, 336])
def test_pixel_values_equal_transformers(size, mode, shortest_edge, tmp_path):
    import transformers as hf

    reference = hf.CLIPImageProcessorPil(
        size={"shortest_edge": shortest_edge},
        crop_size={"height": shortest_edge, "width": shortest_edge},
    )
    reference.save_pretrained(tmp_path)
    ours = ClipImageProcessor.from_dir(tmp_path, image_size=shortest_edge)
    image = random_image(*size, mode, seed=size[0] * 1000 + size[1])
    expected = reference(images=[image], return_tensors="pt")["pixel_values"][0]
    got = ours.pixel_values(image)
    assert got.dtype == expected.dtype == torch.float32
    assert torch.equal(got, expected)


def test_palette_transparency_is_composited_as_transformers(tmp_path):
    import transformers as hf

    image = random_image(64, 70, "RGB", seed=3).convert("P")
    image.info["transparency"] = 0
    reference = hf.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    reference.save_pretrained(tmp_path)
    expected = reference(images=[image], return_tensors="pt")["pixel_values"][0]
    assert torch.equal(
        ClipImageProcessor.from_dir(tmp_path, IMAGE_SIZE).pixel_values(image), expected
    )


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_decode_formats(fmt):
    image = random_image(40, 30, "RGB", seed=1)
    decoded = image_from_url(data_url(image, fmt), ImageLimits(), "url")
    assert decoded.size == (40, 30)
    if fmt == "PNG":  # lossless: the same pixels
        assert np.array_equal(np.array(decoded.convert("RGB")), np.array(image))


def test_gif_gives_its_first_frame():
    frames = [random_image(20, 20, "RGB", seed=s).convert("P") for s in (1, 2)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    decoded = decode_image(buffer.getvalue(), ImageLimits(), "url")
    assert np.array_equal(np.array(decoded.convert("RGB")), np.array(frames[0].convert("RGB")))


def test_pixel_hash_tells_images_apart():
    a, b = random_image(56, 56, "RGB", seed=1), random_image(56, 56, "RGB", seed=2)
    processor = ClipImageProcessor(56, 56, 56, 1 / 255, (0.5,) * 3, (0.5,) * 3)
    assert pixel_hash(processor.pixel_values(a)) == pixel_hash(processor.pixel_values(a.copy()))
    assert pixel_hash(processor.pixel_values(a)) != pixel_hash(processor.pixel_values(b))


@pytest.mark.parametrize(
    "url,limits,message",
    [
        ("https://127.0.0.1:9/cat.png", ImageLimits(), "not a public address"),
        ("ftp://example.com/cat.png", ImageLimits(), "data: URL"),
        ("data:image/png;base64,!!!!", ImageLimits(), "not valid base64"),
        ("data:text/plain;base64,aGk=", ImageLimits(), "data:image/"),
        (
            "data:image/png;base64," + base64.b64encode(b"not an image").decode(),
            ImageLimits(),
            "decoded",
        ),
        (data_url(random_image(64, 64, "RGB", 1)), ImageLimits(max_bytes=100), "bytes"),
        (data_url(random_image(64, 64, "RGB", 1)), ImageLimits(max_pixels=64 * 63), "pixels"),
    ],
)
def test_refusals_name_the_field(url, limits, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        image_from_url(url, limits, "messages[0].content[1].image_url.url")
    assert error.value.param == "messages[0].content[1].image_url.url"


def test_chat_images_in_order_and_detail_checked():
    a, b = random_image(30, 30, "RGB", 1), random_image(20, 25, "RGB", 2)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(a), "detail": "low"}},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": data_url(b)}},
            ],
        },
    ]
    assert [image.size for image in chat_images(messages)] == [(30, 30), (20, 25)]
    messages[0]["content"][0]["image_url"]["detail"] = "ultra"
    with pytest.raises(InvalidRequestError) as error:
        chat_images(messages)
    assert error.value.param == "messages[0].content[0].image_url.detail"
