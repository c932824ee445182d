"""Image bytes -> an RGB uint8 array [H, W, 3], with the limits a server needs.

Pillow decodes (PNG, JPEG, WebP, GIF's first frame, BMP); other formats it knows are refused,
since some of its plugins hand the bytes to outside programs (EPS to Ghostscript) or have a
long record of parser bugs. `Image.open` reads only the header, so the pixel limit is checked
before any pixel is decoded: a small payload declaring a huge image (a decompression bomb)
costs nothing. Modes with transparency (RGBA, LA, P with a transparent index) are composited
onto white and the rest converted to RGB, as transformers' `convert_to_rgb` does, so a
request's pixels are those HF's processor would see. Every failure is a ValueError whose text
a server can return as a 400.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import Any

import numpy as np
from PIL import Image

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # a payload past this is refused before decoding
MAX_IMAGE_PIXELS = 40_000_000  # width x height; past it decoding would take seconds and GiBs
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # JPEG opens multi-picture (MPO) files too


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
    """Encoded image bytes (one of `FORMATS`) -> RGB [H, W, 3] uint8."""
    if len(data) > max_bytes:
        raise ValueError(f"image is over the {max_bytes} byte limit ({len(data)} bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:  # Pillow's own limit, far above ours
        raise ValueError(f"image is over the {max_pixels} pixel limit ({e})") from None
    except Exception as e:  # whatever a parser raises, the payload is bad
        raise ValueError(f"image payload is not a decodable {'/'.join(FORMATS)} image "
                         f"({type(e).__name__}: {e})") from None
    with image:
        _check_pixels(image.width, image.height, max_pixels)  # from the header alone
        try:
            image.load()
            return pil_to_rgb(image)
        except Exception as e:  # truncated or corrupt pixel data
            raise ValueError(f"image payload is not a decodable image "
                             f"({type(e).__name__}: {e})") from None


def pil_to_rgb(image: Image.Image) -> np.ndarray:
    """A PIL image of any mode -> RGB [H, W, 3] uint8, transparency composited onto white
    (transformers' `convert_to_rgb`, step for step, so the pixels equal HF's)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.asarray(image.convert("RGB"))


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width < 1 or height < 1:
        raise ValueError("image has no pixels")
    if width * height > max_pixels:
        raise ValueError(f"image is {width}x{height}, over the {max_pixels} pixel limit")


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
    if isinstance(image, Image.Image):
        _check_pixels(*image.size, MAX_IMAGE_PIXELS)
        return pil_to_rgb(image)
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
        if image.shape[2] == 4:  # transformers' array path: alpha over white, rounded
            alpha = image[..., 3:] / 255
            return np.round(alpha * image[..., :3] + (1 - alpha) * 255).astype(np.uint8)
        return np.ascontiguousarray(image)
    raise ValueError(f"{what}: expected a PIL image, a uint8 array, image bytes or a data: URL, "
                     f"not {type(image).__name__}")
