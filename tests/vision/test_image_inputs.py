"""jengine/vision without a model: decoding through Pillow (formats, modes, transparency as
transformers composites it), the byte and pixel limits checked before pixels are decoded,
the processor's tile counts, and `--limit-mm-per-prompt` parsing. The processor's pixels
against transformers' are tests/vision/test_idefics3_processor.py."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from jengine.vision.decode import decode_data_url, decode_image, to_rgb
from jengine.vision.idefics3_processor import Idefics3Processor
from jengine.vision.inputs import parse_image_limit


def _encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _rgb(seed: int, height: int = 9, width: int = 13) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize("fmt, options", [("PNG", {}), ("WEBP", {"lossless": True}),
                                          ("BMP", {}), ("GIF", {})])
def test_lossless_formats_decode_exactly(fmt, options):
    image = Image.fromarray(_rgb(1))
    if fmt == "GIF":  # 256 colours: the palette image is the picture
        image = image.quantize(64)
    want = np.asarray(image.convert("RGB"))
    assert (decode_image(_encode(image, fmt, **options)) == want).all()


def test_jpeg_decodes_close_and_cmyk_grey_and_16_bit_become_rgb():
    rgb = np.full((16, 16, 3), (200, 40, 90), np.uint8)
    jpeg = decode_image(_encode(Image.fromarray(rgb), "JPEG", quality=95))
    assert jpeg.shape == (16, 16, 3) and np.abs(jpeg.astype(int) - rgb).max() <= 3
    cmyk = Image.fromarray(rgb).convert("CMYK")
    assert decode_image(_encode(cmyk, "JPEG")).shape == (16, 16, 3)
    grey = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8))
    assert (decode_image(_encode(grey, "PNG")) == np.asarray(grey)[..., None]).all()
    deep = Image.fromarray(np.arange(64, dtype=np.uint16).reshape(8, 8) * 3)  # I;16
    data = _encode(deep, "PNG")
    want = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)  # clips as HF does
    assert (decode_image(data) == want).all() and want[0, 5, 0] == 15


def test_gif_first_frame():
    frames = [Image.fromarray(np.full((6, 6, 3), v, np.uint8)) for v in (10, 240)]
    data = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert (decode_image(data) == 10).all()


def test_transparency_composites_onto_white_as_transformers_does():
    rgba = np.random.default_rng(2).integers(0, 256, (7, 5, 4), dtype=np.uint8)
    image = Image.fromarray(rgba, "RGBA")
    want = convert_to_rgb(image, return_numpy=True)
    assert (decode_image(_encode(image, "PNG")) == want).all()
    assert (to_rgb(image) == want).all()
    assert (to_rgb(rgba) == convert_to_rgb(rgba, return_numpy=True)).all()  # array path
    la = image.convert("LA")
    assert (decode_image(_encode(la, "PNG")) == convert_to_rgb(la, return_numpy=True)).all()
    palette = Image.fromarray(_rgb(3)).quantize(16)
    palette.info["transparency"] = 0
    data = _encode(palette, "PNG", transparency=0)
    reopened = Image.open(io.BytesIO(data))
    assert (decode_image(data) == convert_to_rgb(reopened, return_numpy=True)).all()
    assert (decode_image(data) == 255).all(axis=-1).any()  # index 0 became white


def _png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header (CRC fixed) declares `width` x `height` pixels."""
    png = _encode(Image.new("RGB", (1, 1)), "PNG")
    body = struct.pack(">II", width, height) + png[24:29]
    return (png[:16] + body + struct.pack(">I", zlib.crc32(b"IHDR" + body)) + png[33:])


def test_limits_hold_before_pixels_are_decoded():
    with pytest.raises(ValueError, match="400x300, over the 100000 pixel limit"):
        decode_image(_encode(Image.new("RGB", (400, 300)), "PNG"), max_pixels=100_000)
    with pytest.raises(ValueError, match="7000x7000, over the 40000000 pixel limit"):
        decode_image(_png_claiming(7000, 7000))  # 49 M pixels (147 MB) in 70 bytes
    with pytest.raises(ValueError, match="pixel limit"):
        decode_image(_png_claiming(200_000, 200_000))  # past Pillow's own bomb check too
    with pytest.raises(ValueError, match="not a decodable image"):
        decode_image(_png_claiming(64, 64))  # declares more rows than its data holds


def test_data_url_round_trip_and_refusals():
    rgb = _rgb(0, 5, 7)
    url = "data:image/png;base64," + base64.b64encode(_encode(Image.fromarray(rgb), "PNG")).decode()
    assert (decode_data_url(url) == rgb).all()
    with pytest.raises(ValueError, match="not valid base64"):
        decode_data_url("data:image/png;base64,@@")
    with pytest.raises(ValueError, match="data:<mime>;base64"):
        decode_data_url("data:image/png,raw")
    with pytest.raises(ValueError, match="byte limit"):
        decode_data_url(url, max_bytes=50)
    with pytest.raises(ValueError, match="not a decodable PNG/JPEG"):
        decode_image(b"GIF89a....")
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\n"
    with pytest.raises(ValueError, match="not a decodable"):
        decode_image(eps)  # a format Pillow knows but jengine does not open


def test_to_rgb_takes_arrays_bytes_and_urls():
    grey = np.arange(12, dtype=np.uint8).reshape(3, 4)
    assert to_rgb(grey).shape == (3, 4, 3)
    png = _encode(Image.fromarray(to_rgb(grey)), "PNG")
    assert (to_rgb(png) == to_rgb(grey)).all()
    with pytest.raises(ValueError, match="part: a string image must be a data: URL"):
        to_rgb("/etc/passwd", "part")
    with pytest.raises(ValueError, match="expected a PIL image"):
        to_rgb(3.5)


def test_tile_counts():
    processor = Idefics3Processor(longest_edge=64, tile=32)
    tiles, rows, cols = processor.tiles(_rgb(1, 50, 70))
    assert (rows, cols) == (2, 2) and tiles.shape == (5, 3, 32, 32)
    assert processor.num_tiles(50, 70) == 5 and processor.max_tiles == 5
    assert tiles.min() >= -1.0 and tiles.max() <= 1.0  # (x / 255 - 0.5) / 0.5
    small = Idefics3Processor(longest_edge=32, tile=32)
    assert small.tiles(_rgb(1, 50, 70))[0].shape == (1, 3, 32, 32)


@pytest.mark.parametrize("text, limit", [("image=3", 3), ('{"image": 2}', 2), (" image=0 ", 0)])
def test_limit_mm_per_prompt(text, limit):
    assert parse_image_limit(text) == limit


@pytest.mark.parametrize("text", ["video=1", "image=x", "image=1,audio=2", "{bad"])
def test_bad_limit_mm_per_prompt(text):
    with pytest.raises(ValueError, match="expected image=N"):
        parse_image_limit(text)
