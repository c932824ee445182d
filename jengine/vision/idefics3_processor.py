"""Idefics3 / SmolVLM's image processor in NumPy: an RGB image -> normalized tiles and the
tile grid its `<image>` placeholder expands to (`jengine.models.idefics3.image_prompt`).

The sizes follow transformers' Idefics3ImageProcessor step for step (longest edge resized to
`size.longest_edge`, both sides rounded up to whole tiles of `max_image_size.longest_edge`,
cut into that grid, plus the whole image squeezed into one global tile); transformers needs
Pillow or torchvision to run it, and neither is a jengine dependency. The resampling is an
antialiased Lanczos-3 (Pillow's LANCZOS filter, computed in float32 and rounded to 8 bits
after each pass as Pillow does), so pixels may differ from Pillow's by a unit of rounding.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

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
        )

    def tiles(self, rgb: np.ndarray) -> tuple[np.ndarray, int, int]:
        """RGB [H, W, 3] uint8 -> (tiles [N, 3, tile, tile] float32, grid rows, grid cols);
        N = rows * cols + 1 (the global tile last), or 1 with rows = cols = 0."""
        image = rgb
        if self.do_resize:
            image = resize(image, *_longest_edge_size(*image.shape[:2], self.longest_edge))
        if not self.do_image_splitting:
            frames, rows, cols = [resize(image, self.tile, self.tile)], 0, 0
        else:
            image = resize(image, *_whole_tiles(*image.shape[:2], self.tile))
            height, width = image.shape[:2]
            if height > self.tile or width > self.tile:
                rows, cols = height // self.tile, width // self.tile
                t = self.tile
                frames = [image[r * t:(r + 1) * t, c * t:(c + 1) * t]
                          for r in range(rows) for c in range(cols)]
                frames.append(resize(image, t, t))
            else:
                frames, rows, cols = [image], 0, 0
        pixels = np.stack(frames).astype(np.float32) * np.float32(self.rescale_factor)
        pixels = (pixels - np.float32(self.image_mean)) / np.float32(self.image_std)
        return np.ascontiguousarray(pixels.transpose(0, 3, 1, 2)), rows, cols

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


def resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] uint8 -> [height, width, C] uint8 by antialiased Lanczos-3, width first."""
    if image.shape[1] != width:
        image = _resample(image, width, axis=1)
    if image.shape[0] != height:
        image = _resample(image, height, axis=0)
    return image


def _resample(image: np.ndarray, size: int, axis: int) -> np.ndarray:
    weights = _lanczos_weights(image.shape[axis], size)  # [size, in]
    moved = np.moveaxis(image.astype(np.float32), axis, 0)  # [in, ...]
    out = np.tensordot(weights, moved, axes=(1, 0))
    return np.moveaxis(np.clip(np.rint(out), 0, 255).astype(np.uint8), 0, axis)


def _lanczos_weights(src: int, dst: int, lobes: int = 3) -> np.ndarray:
    """[dst, src] normalized filter rows: Pillow's support (lobes x the downscale factor)
    and pixel centres."""
    scale = src / dst
    stretch = max(scale, 1.0)
    centers = (np.arange(dst) + 0.5) * scale  # [dst]
    x = (np.arange(src)[None, :] + 0.5 - centers[:, None]) / stretch  # [dst, src]
    w = np.where(np.abs(x) < lobes, np.sinc(x) * np.sinc(x / lobes), 0.0)
    return (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
