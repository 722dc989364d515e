"""Images as clients send them, against transformers: EXIF orientation applied as its
`load_image` applies it to a base64 image, every PIL mode preprocessed as its CLIP processor does;
corrupt, truncated, empty, bomb-sized and extremely thin images refused with a 400 naming the
part (their pixels never decoded or resized); 1x1 images served."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from nanoserve.errors import InvalidRequestError
from nanoserve.multimodal.chat import chat_images
from nanoserve.multimodal.image import ImageLimits, decode_image
from nanoserve.multimodal.processor import ClipImageProcessor
from tests.multimodal.llava_checkpoint import IMAGE_SIZE
from tests.multimodal.test_llava import GREEDY, ONE_IMAGE, make_llm
from tests.multimodal.test_preprocessing import random_image

FIELD = "messages[0].content[0].image_url.url"


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    """transformers' CLIP processor (PIL backend) and ours, from one preprocessor_config.json."""
    import transformers as hf

    path = tmp_path_factory.mktemp("clip")
    reference = hf.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    reference.save_pretrained(path)
    return reference, ClipImageProcessor.from_dir(path, IMAGE_SIZE)


def encoded(image: Image.Image, fmt: str, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def url_of(data: bytes, fmt: str = "png") -> str:
    return f"data:image/{fmt};base64," + base64.b64encode(data).decode()


def messages_with(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


def refusal(url: str, limits: ImageLimits | None = None) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as error:
        chat_images(messages_with(url), limits)
    assert error.value.param == FIELD
    assert "\n" not in str(error.value)
    return error.value


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", [1, 2, 3, 6, 8])
def test_exif_orientation_is_applied_as_transformers_load_image(processors, fmt, orientation):
    from transformers.image_utils import load_image

    reference, ours = processors
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation
    save = {"exif": exif.tobytes()} | ({"lossless": True} if fmt == "WEBP" else {})
    url = url_of(encoded(random_image(60, 40, "RGB", orientation), fmt, **save), fmt.lower())
    (image,) = chat_images(messages_with(url))
    upright = load_image(url)  # transformers: exif_transpose, then RGB
    assert image.size == upright.size == ((40, 60) if orientation in (6, 8) else (60, 40))
    assert np.array_equal(np.array(image.convert("RGB")), np.array(upright))
    expected = reference(images=[upright], return_tensors="pt")["pixel_values"][0]
    assert torch.equal(ours.pixel_values(image), expected)


def cmyk_jpeg() -> Image.Image:
    return decode_image(
        encoded(random_image(50, 70, "RGB", 5).convert("CMYK"), "JPEG"), ImageLimits(), "url"
    )


@pytest.mark.parametrize(
    "make",
    [
        cmyk_jpeg,
        lambda: random_image(50, 70, "RGB", 6).convert("P"),
        lambda: random_image(50, 70, "RGBA", 7).convert("PA"),
        lambda: random_image(50, 70, "LA", 8),
        lambda: random_image(50, 70, "RGB", 9).convert("1"),
        lambda: Image.fromarray(np.random.default_rng(10).integers(0, 65535, (70, 50), np.uint16)),
        lambda: random_image(50, 70, "RGB", 11).convert("I"),
        lambda: random_image(50, 70, "RGB", 12).convert("F"),
        lambda: random_image(50, 70, "RGB", 13).convert("YCbCr"),
    ],
    ids=["CMYK", "P", "PA", "LA", "1", "I;16", "I", "F", "YCbCr"],
)
def test_every_mode_is_preprocessed_as_transformers(processors, make):
    reference, ours = processors
    image = make()
    expected = reference(images=[image], return_tensors="pt")["pixel_values"][0]
    assert torch.equal(ours.pixel_values(image), expected)


def png_header(width: int, height: int, body: bytes = b"") -> bytes:
    """A PNG (8-bit RGB) declaring width x height, with `body` as its compressed rows."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(body))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp", "gif"])
def test_truncated_images_are_400s(fmt):
    data = encoded(random_image(64, 48, "RGB", 14), fmt.upper())
    error = refusal(url_of(data[: len(data) // 2], fmt))
    assert "could not be decoded" in str(error)


@pytest.mark.parametrize(
    "data",
    [
        encoded(Image.new("RGB", (8, 8)), "BMP"),
        b"\x00" * 64,
        png_header(0, 0),  # a zero-size PNG: PIL refuses to identify it
    ],
    ids=["bmp", "zeros", "zero-size-png"],
)
def test_what_is_not_an_image_is_a_400_saying_which_formats(data):
    error = refusal(url_of(data))
    assert "not a png, jpeg, webp or gif image" in str(error)
    assert "BytesIO" not in str(error)


@pytest.mark.parametrize("side", [9000, 100_000])
def test_a_huge_declared_size_is_refused_before_decoding(side):
    """9000^2 is past our limit, 100000^2 past PIL's too: both refused from the header (a PNG of
    a few dozen bytes), each naming --max-image-pixels."""
    error = refusal(url_of(png_header(side, side)))
    assert "--max-image-pixels" in str(error)


def test_one_pixel_images_are_served(llava_dir, processors):
    reference, ours = processors
    tiny = Image.new("RGB", (1, 1), (200, 30, 90))
    expected = reference(images=[tiny], return_tensors="pt")["pixel_values"][0]
    assert torch.equal(ours.pixel_values(tiny), expected)
    (image,) = chat_images(messages_with(url_of(encoded(tiny, "PNG"))))
    llm = make_llm(llava_dir, num_kv_blocks=16)
    out = llm.generate({"prompt": ONE_IMAGE, "multi_modal_data": {"image": image}}, GREEDY)
    assert len(out[0].outputs[0].token_ids) > 0


def test_empty_and_extremely_thin_images_are_refused(llava_dir):
    """A 1 x 100 image is resized to 56 x 5600 for the model (its shortest edge to 56): with a
    limit of 56 x 560 pixels it is refused before any resize; 1 x 10 (56 x 560) is served."""
    llm = make_llm(llava_dir, num_kv_blocks=16, max_image_pixels=56 * 560)

    def generate(image):
        prompt = {"prompt": ONE_IMAGE, "multi_modal_data": {"image": image}}
        return llm.generate(prompt, GREEDY, use_tqdm=False)

    with pytest.raises(InvalidRequestError, match=r"resized to 56x5600 .*--max-image-pixels"):
        generate(Image.new("RGB", (1, 100)))
    assert generate(Image.new("RGB", (1, 10)))[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="no pixels"):
        generate(Image.new("RGB", (0, 0)))
