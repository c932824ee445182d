"""Idefics3 / SmolVLM's image processor: an RGB image -> normalized tiles and the tile grid
its `<image>` placeholder expands to (`jengine.models.idefics3.image_prompt`).

It is transformers' `Idefics3ImageProcessorPil` step for step, so its output equals HF's bit
for bit (tests/vision/test_idefics3_processor.py): the longest edge resized to
`size.longest_edge`, both sides rounded up to whole tiles of `max_image_size.longest_edge`,
cut into that grid plus the whole image resized into one global tile, each resize a Pillow
`Image.resize` with the config's filter on 8-bit pixels; then rescaled in float64 and cast to
float32, then normalized in float32. It is jengine's own rather than HF's object because the
engine needs the tile count before resampling (`num_tiles`, admission limits) and one image's
tiles without HF's padding to the batch's largest image count.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

LANCZOS = int(Image.Resampling.LANCZOS)  # transformers' Idefics3 default `resample`
MAX_IMAGE_SIZE = 4096  # transformers' cap on either side after the first resize


@dataclasses.dataclass(frozen=True, kw_only=True)
class Idefics3Processor:
    """The fields of a `preprocessor_config.json` that decide the tiles (transformers'
    defaults where the file leaves one out)."""

    longest_edge: int = 4 * 364
    tile: int = 364  # max_image_size.longest_edge: the vision tower's image_size
    do_resize: bool = True
    do_image_splitting: bool = True
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resample: int = LANCZOS  # a PIL.Image.Resampling value, as preprocessor_config.json has it

    @classmethod
    def from_dir(cls, path: str | Path) -> Idefics3Processor:
        file = Path(path) / "preprocessor_config.json"
        return cls.from_dict(json.loads(file.read_text()) if file.exists() else {})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Idefics3Processor:
        defaults = cls()
        return cls(
            longest_edge=int((d.get("size") or {}).get("longest_edge", defaults.longest_edge)),
            tile=int((d.get("max_image_size") or {}).get("longest_edge", defaults.tile)),
            do_resize=bool(d.get("do_resize", True)),
            do_image_splitting=bool(d.get("do_image_splitting", True)),
            rescale_factor=float(d.get("rescale_factor", defaults.rescale_factor)),
            image_mean=tuple(d.get("image_mean", defaults.image_mean)),
            image_std=tuple(d.get("image_std", defaults.image_std)),
            resample=int(d.get("resample", defaults.resample)),
        )

    def tiles(self, rgb: np.ndarray) -> tuple[np.ndarray, int, int]:
        """RGB [H, W, 3] uint8 -> (tiles [N, 3, tile, tile] float32, grid rows, grid cols);
        N = rows * cols + 1 (the global tile last), or 1 with rows = cols = 0."""
        image, t = rgb, self.tile
        if self.do_resize:
            image = self._resize(image, *_longest_edge_size(*image.shape[:2], self.longest_edge))
        if not self.do_image_splitting:
            frames, rows, cols = [self._resize(image, t, t)], 0, 0
        else:
            image = self._resize(image, *_whole_tiles(*image.shape[:2], t))
            height, width = image.shape[:2]
            if height > t or width > t:
                rows, cols = height // t, width // t
                frames = [image[r * t:(r + 1) * t, c * t:(c + 1) * t]
                          for r in range(rows) for c in range(cols)]
                frames.append(self._resize(image, t, t))
            else:
                frames, rows, cols = [image], 0, 0
        # HF's order and dtypes: uint8 -> float64 * factor -> float32, then (x - mean) / std
        # in float32 (image_transforms.rescale / normalize).
        pixels = (np.stack(frames).astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = (pixels - np.float32(self.image_mean)) / np.float32(self.image_std)
        return np.ascontiguousarray(pixels.transpose(0, 3, 1, 2)), rows, cols

    def _resize(self, image: np.ndarray, height: int, width: int) -> np.ndarray:
        return resize(image, height, width, self.resample)

    def num_tiles(self, height: int, width: int) -> int:
        """Tiles an image of this size becomes (without resampling it)."""
        if self.do_resize:
            height, width = _longest_edge_size(height, width, self.longest_edge)
        if not self.do_image_splitting:
            return 1
        height, width = _whole_tiles(height, width, self.tile)
        if height > self.tile or width > self.tile:
            return (height // self.tile) * (width // self.tile) + 1
        return 1

    @property
    def max_tiles(self) -> int:
        """The most tiles one image can become."""
        if not self.do_image_splitting:
            return 1
        side = -(-min(self.longest_edge, MAX_IMAGE_SIZE) // self.tile)
        return side * side + 1


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' get_resize_output_image_size: the longest edge to `longest` (the other
    side rounded down, then up to even), then both under MAX_IMAGE_SIZE."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _whole_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' resize_for_vision_encoder: both sides rounded up to whole tiles."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def resize(image: np.ndarray, height: int, width: int, resample: int = LANCZOS) -> np.ndarray:
    """[H, W, 3] uint8 -> [height, width, 3] uint8 by Pillow's `Image.resize` (transformers'
    PIL backend resizes through the same call, so the pixels are HF's)."""
    return np.asarray(Image.fromarray(image).resize((width, height), resample=resample))
