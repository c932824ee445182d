"""jengine/vision without a model: PNG decoding, the limits, the Idefics3 processor's sizes
against transformers' own functions, and `--limit-mm-per-prompt` parsing.

transformers' Idefics3 processors need Pillow or torchvision to import; their size functions
are pure Python, so the test takes them from the source file by name (`_hf_functions`) and
checks jengine's against them over many image sizes."""

from __future__ import annotations

import ast
import base64
import math
import struct
import types
import zlib
from pathlib import Path

import numpy as np
import pytest
import transformers

from jengine.vision.decode import decode_data_url, decode_image, encode_png, to_rgb
from jengine.vision.idefics3_processor import (
    Idefics3Processor,
    _longest_edge_size,
    _whole_tiles,
    resize,
)
from jengine.vision.inputs import parse_image_limit

HF_SOURCE = (Path(transformers.__file__).parent / "models" / "idefics3"
             / "image_processing_pil_idefics3.py")


def _hf_functions() -> types.SimpleNamespace:
    """transformers' size functions, compiled from its source with their module constants."""
    tree = ast.parse(HF_SOURCE.read_text())
    wanted = {"_resize_output_size_rescale_to_max_len",
              "_resize_output_size_scale_below_upper_bound", "get_resize_output_image_size"}
    body = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name in wanted)
            or (isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "MAX_IMAGE_SIZE")]
    body += [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body
             if isinstance(n, ast.FunctionDef) and n.name == "resize_for_vision_encoder"]
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):  # names this file lacks
        if isinstance(node, ast.arg):
            node.annotation = None
        elif isinstance(node, ast.FunctionDef):
            node.returns = None
    space: dict = {"math": math, "np": np, "SizeDict": types.SimpleNamespace}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(HF_SOURCE), "exec"), space)
    return types.SimpleNamespace(**space)


def _png_filtered(rgb: np.ndarray, kind: int) -> bytes:
    """A PNG whose every row uses filter `kind` (what other encoders write), from the spec."""
    height, width, n = rgb.shape
    data = rgb.reshape(height, width * n).astype(np.int32)
    rows = []
    for y in range(height):
        line, prev = data[y], data[y - 1] if y else np.zeros_like(data[0])
        a = np.concatenate([np.zeros(n, np.int32), line[:-n]])
        c = np.concatenate([np.zeros(n, np.int32), prev[:-n]])
        if kind == 1:
            pred = a
        elif kind == 2:
            pred = prev
        elif kind == 3:
            pred = (a + prev) >> 1
        else:
            p = a + prev - c
            pa, pb, pc = abs(p - a), abs(p - prev), abs(p - c)
            pred = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, prev, c))
        rows.append(bytes([kind]) + ((line - pred) & 0xFF).astype(np.uint8).tobytes())

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    head = struct.pack(">IIBBBBB", width, height, 8, {3: 2, 4: 6}[n], 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head)
            + chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b""))


@pytest.mark.parametrize("kind", [1, 2, 3, 4])
@pytest.mark.parametrize("channels", [3, 4])
def test_png_row_filters_decode_exactly(kind, channels):
    rgba = np.random.default_rng(kind).integers(0, 256, (9, 13, channels), dtype=np.uint8)
    assert (decode_image(_png_filtered(rgba, kind)) == rgba[..., :3]).all()


def test_data_url_round_trip_and_refusals():
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    url = "data:image/png;base64," + base64.b64encode(encode_png(rgb)).decode()
    assert (decode_data_url(url) == rgb).all()
    with pytest.raises(ValueError, match="not valid base64"):
        decode_data_url("data:image/png;base64,@@")
    with pytest.raises(ValueError, match="data:<mime>;base64"):
        decode_data_url("data:image/png,raw")
    with pytest.raises(ValueError, match="byte limit"):
        decode_data_url(url, max_bytes=50)
    with pytest.raises(ValueError, match="not a PNG"):
        decode_image(b"GIF89a....")
    big = encode_png(np.zeros((300, 400, 3), np.uint8))
    with pytest.raises(ValueError, match="400x300, over the 100000 pixel limit"):
        decode_image(big, max_pixels=100_000)
    small = encode_png(np.zeros((4, 4, 3), np.uint8))
    taller = small[:20] + struct.pack(">I", 8) + small[24:]  # IHDR says 8 rows, IDAT has 4
    with pytest.raises(ValueError, match="truncated"):
        decode_image(taller)


def test_to_rgb_takes_arrays_bytes_and_urls():
    grey = np.arange(12, dtype=np.uint8).reshape(3, 4)
    assert to_rgb(grey).shape == (3, 4, 3)
    rgba = np.zeros((2, 2, 4), np.uint8)
    assert to_rgb(rgba).shape == (2, 2, 3)
    assert (to_rgb(encode_png(to_rgb(grey))) == to_rgb(grey)).all()
    with pytest.raises(ValueError, match="part: a string image must be a data: URL"):
        to_rgb("/etc/passwd", "part")
    with pytest.raises(ValueError, match="expected a PIL image"):
        to_rgb(3.5)


def test_sizes_follow_transformers():
    hf = _hf_functions()
    tile, longest = 364, 4 * 364
    sizes = [(h, w) for h in (1, 17, 300, 364, 365, 1000, 2000, 5000)
             for w in (1, 23, 364, 700, 1456, 3000, 9000)]
    for h, w in sizes:
        want = hf.get_resize_output_image_size(np.zeros((3, h, w)), resolution_max_side=longest)
        assert _longest_edge_size(h, w, longest) == tuple(want), (h, w)

        class Self:
            def resize(self, image, size, resample=None):
                return (size.height, size.width)

        got = _whole_tiles(*want, tile)
        assert got == hf.resize_for_vision_encoder(Self(), np.zeros((3, *want)), tile), (h, w)


def test_tiles_of_an_image():
    processor = Idefics3Processor(longest_edge=64, tile=32)
    rgb = np.random.default_rng(1).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    tiles, rows, cols = processor.tiles(rgb)
    assert (rows, cols) == (2, 2) and tiles.shape == (5, 3, 32, 32)
    assert processor.num_tiles(50, 70) == 5 and processor.max_tiles == 5
    assert tiles.min() >= -1.0 and tiles.max() <= 1.0  # (x / 255 - 0.5) / 0.5
    small = Idefics3Processor(longest_edge=32, tile=32)
    assert small.tiles(rgb)[0].shape == (1, 3, 32, 32)


def test_resize_keeps_a_flat_image_flat_and_averages_when_shrinking():
    flat = np.full((40, 60, 3), 77, np.uint8)
    assert (resize(flat, 13, 29) == 77).all()
    stripes = np.zeros((8, 8, 3), np.uint8)
    stripes[:, ::2] = 255
    assert 100 < int(resize(stripes, 8, 4)[4, 2, 0]) < 156  # antialiased: not 0 or 255


@pytest.mark.parametrize("text, limit", [("image=3", 3), ('{"image": 2}', 2), (" image=0 ", 0)])
def test_limit_mm_per_prompt(text, limit):
    assert parse_image_limit(text) == limit


@pytest.mark.parametrize("text", ["video=1", "image=x", "image=1,audio=2", "{bad"])
def test_bad_limit_mm_per_prompt(text):
    with pytest.raises(ValueError, match="expected image=N"):
        parse_image_limit(text)
