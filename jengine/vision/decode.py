"""Image bytes -> an RGB uint8 array [H, W, 3], with the limits a server needs.

PNG is decoded here with zlib (8-bit grey, grey+alpha, RGB, RGBA and palette images, not
interlaced), so image input works on an install without Pillow; JPEG, WebP and the PNG
forms not covered go through Pillow when it is installed, and are refused with a message
naming it otherwise. Every failure is a ValueError whose text a server can return as a 400.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import struct
import zlib
from typing import Any

import numpy as np

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # a payload past this is refused before decoding
MAX_IMAGE_PIXELS = 40_000_000  # width x height; past it decoding would take seconds and GiBs
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # PNG colour type -> samples per pixel


def image_digest(rgb: np.ndarray) -> bytes:
    """A hash of the decoded pixels (shape included): the prefix cache's key for the image's
    placeholder tokens, so two encodings of one picture share pages."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(rgb.shape).encode())
    h.update(np.ascontiguousarray(rgb).tobytes())
    return h.digest()


def decode_data_url(url: str, *, max_bytes: int = MAX_IMAGE_BYTES) -> np.ndarray:
    """`data:image/...;base64,...` -> RGB [H, W, 3] uint8."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise ValueError("image data URL must be data:<mime>;base64,<payload>")
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise ValueError(f"image is over the {max_bytes} byte limit")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"image data URL is not valid base64: {e}") from None
    return decode_image(data, max_bytes=max_bytes)


def decode_image(data: bytes, *, max_bytes: int = MAX_IMAGE_BYTES,
                 max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Encoded image bytes (PNG; JPEG / WebP / others with Pillow) -> RGB [H, W, 3] uint8."""
    if len(data) > max_bytes:
        raise ValueError(f"image is over the {max_bytes} byte limit ({len(data)} bytes)")
    if data.startswith(PNG_MAGIC):
        try:
            return _decode_png(data, max_pixels)
        except _NeedsPillow:
            pass
    return _decode_with_pillow(data, max_pixels)


class _NeedsPillow(Exception):
    """A valid PNG of a form the zlib decoder leaves to Pillow (16-bit, interlaced)."""


def _decode_png(data: bytes, max_pixels: int) -> np.ndarray:
    pos, idat, palette, header = len(PNG_MAGIC), [], None, None
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if len(body) != length:
            break
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"PLTE":
            palette = np.frombuffer(body, np.uint8).reshape(-1, 3)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos += 12 + length
    if header is None or not idat:
        raise ValueError("image is not a valid PNG (no IHDR or IDAT chunk)")
    width, height, depth, color, _, _, interlace = header
    if color not in _CHANNELS:
        raise ValueError(f"image is not a valid PNG (colour type {color})")
    if depth != 8 or interlace:
        raise _NeedsPillow
    _check_pixels(width, height, max_pixels)
    n = _CHANNELS[color]
    try:
        raw = zlib.decompress(b"".join(idat))
    except zlib.error as e:
        raise ValueError(f"image is not a valid PNG ({e})") from None
    stride = width * n
    if len(raw) < height * (stride + 1):
        raise ValueError("image is not a valid PNG (truncated pixel data)")
    rows = np.frombuffer(raw, np.uint8, height * (stride + 1)).reshape(height, stride + 1)
    pixels = _unfilter(rows, n).reshape(height, width, n)
    if color == 3:
        if palette is None:
            raise ValueError("image is not a valid PNG (palette image without PLTE)")
        return palette[np.minimum(pixels[..., 0], len(palette) - 1)]
    if n in (1, 2):
        return np.repeat(pixels[..., :1], 3, axis=2)
    return np.ascontiguousarray(pixels[..., :3])


def _unfilter(rows: np.ndarray, bpp: int) -> np.ndarray:
    """Undoes PNG's per-row filters (None, Sub, Up, Average, Paeth) -> [H, stride] uint8."""
    height, stride = rows.shape[0], rows.shape[1] - 1
    out = np.zeros((height, stride), np.uint8)
    prev = np.zeros(stride, np.int32)
    for y in range(height):
        kind, line = rows[y, 0], rows[y, 1:].astype(np.int32)
        if kind == 0:
            cur = line
        elif kind == 2:
            cur = (line + prev) & 0xFF
        elif kind in (1, 3, 4):  # each byte depends on the one bpp before it: a scalar loop
            cur = np.zeros(stride, np.int32)
            for x in range(stride):
                a = cur[x - bpp] if x >= bpp else 0
                b, c = prev[x], (prev[x - bpp] if x >= bpp else 0)
                if kind == 1:
                    pred = a
                elif kind == 3:
                    pred = (a + b) >> 1
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[x] = (line[x] + pred) & 0xFF
        else:
            raise ValueError(f"image is not a valid PNG (row filter {kind})")
        out[y] = cur
        prev = cur
    return out


def _decode_with_pillow(data: bytes, max_pixels: int) -> np.ndarray:
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ValueError("image is not a PNG; decoding JPEG, WebP and other formats needs "
                         "Pillow (pip install pillow)") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            _check_pixels(image.width, image.height, max_pixels)
            return np.asarray(image.convert("RGB"))
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"image payload is not a decodable image ({e})") from None


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width < 1 or height < 1:
        raise ValueError("image has no pixels")
    if width * height > max_pixels:
        raise ValueError(f"image is {width}x{height}, over the {max_pixels} pixel limit")


def encode_png(rgb: np.ndarray) -> bytes:
    """RGB [H, W, 3] uint8 -> PNG bytes (no filters): test images and examples without Pillow."""
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + np.ascontiguousarray(rgb[y]).tobytes() for y in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))

    head = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (PNG_MAGIC + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))



def to_rgb(image: Any, what: str = "image") -> np.ndarray:
    """An image as callers hand it over -> RGB [H, W, 3] uint8: a NumPy array ([H, W] grey,
    [H, W, 3] RGB or [H, W, 4] RGBA, uint8), a PIL image, encoded bytes, or a `data:` URL.
    ValueError names `what` (the content part or argument) when it is none of these."""
    if isinstance(image, (bytes, bytearray)):
        return decode_image(bytes(image))
    if isinstance(image, str):
        if not image.startswith("data:"):
            raise ValueError(f"{what}: a string image must be a data: URL")
        return decode_data_url(image)
    if hasattr(image, "convert") and hasattr(image, "size"):  # a PIL image
        _check_pixels(*image.size, MAX_IMAGE_PIXELS)
        return np.asarray(image.convert("RGB"))
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ValueError(f"{what}: an image array must be uint8, not {image.dtype}")
        if image.ndim == 2:
            image = image[..., None]
        if image.ndim != 3 or image.shape[2] not in (1, 3, 4):
            raise ValueError(f"{what}: an image array must be [H, W], [H, W, 3] or [H, W, 4]")
        _check_pixels(image.shape[1], image.shape[0], MAX_IMAGE_PIXELS)
        if image.shape[2] == 1:
            return np.repeat(image, 3, axis=2)
        return np.ascontiguousarray(image[..., :3])
    raise ValueError(f"{what}: expected a PIL image, a uint8 array, image bytes or a data: URL, "
                     f"not {type(image).__name__}")
