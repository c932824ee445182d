"""Qwen2-VL / Qwen2.5-VL's image processor: an RGB image -> flattened patches and its patch
grid, which decides how many `<|image_pad|>` placeholders it takes (`image_prompt`).

It is transformers' `Qwen2VLImageProcessorPil` step for step, so its output equals HF's bit for
bit (tests/vision/test_qwen2_vl_processor.py): `smart_resize` picks the size nearest the image's
whose sides are multiples of `patch_size * merge_size` and whose area lies within
[min_pixels, max_pixels]; one Pillow `Image.resize` (BICUBIC unless the config says) on 8-bit
pixels; rescale in float64 cast to float32, normalize in float32; then each `patch_size`
square, repeated `temporal_patch_size` times (a still image is a one-frame video to the
tower's 3D patch embedding), flattened in merge-block order: the `merge_size` squared patches
that the merger folds into one text-model row sit next to each other.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from jengine.vision.idefics3_processor import resize

BICUBIC = int(Image.Resampling.BICUBIC)  # transformers' Qwen2-VL default `resample`
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN / _STD, HF's defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen2VLProcessor:
    """The fields of a `preprocessor_config.json` that decide the patches (transformers'
    defaults where the file leaves one out)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    do_resize: bool = True
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    resample: int = BICUBIC

    @classmethod
    def from_dir(cls, path: str | Path) -> Qwen2VLProcessor:
        file = Path(path) / "preprocessor_config.json"
        return cls.from_dict(json.loads(file.read_text()) if file.exists() else {})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Qwen2VLProcessor:
        """Published checkpoints give `min_pixels` / `max_pixels`; transformers 5 writes them
        as `size.shortest_edge` / `size.longest_edge`. The flat keys win, as in HF."""
        defaults, size = cls(), d.get("size") or {}
        return cls(
            min_pixels=int(d.get("min_pixels") or size.get("shortest_edge")
                           or defaults.min_pixels),
            max_pixels=int(d.get("max_pixels") or size.get("longest_edge")
                           or defaults.max_pixels),
            patch_size=int(d.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(d.get("temporal_patch_size", defaults.temporal_patch_size)),
            merge_size=int(d.get("merge_size", defaults.merge_size)),
            do_resize=bool(d.get("do_resize", True)),
            rescale_factor=float(d.get("rescale_factor", defaults.rescale_factor)),
            image_mean=tuple(d.get("image_mean", defaults.image_mean)),
            image_std=tuple(d.get("image_std", defaults.image_std)),
            resample=int(d.get("resample", defaults.resample)),
        )

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the image is resampled to (without resampling it).

        Raises:
          ValueError: an aspect ratio over 200 (HF's limit), or a side not a multiple of the
            patch block when resizing is off.
        """
        factor = self.patch_size * self.merge_size
        if self.do_resize:
            return smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        if height % factor or width % factor:
            raise ValueError(f"a {width}x{height} image is not in whole {factor}-pixel blocks "
                             "(the processor config has do_resize off)")
        return height, width

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(patch rows, patch cols) of an image of this size."""
        h, w = self.resized_size(height, width)
        return h // self.patch_size, w // self.patch_size

    def num_placeholders(self, height: int, width: int) -> int:
        """Text-model rows (`<|image_pad|>` tokens) an image of this size becomes."""
        gh, gw = self.grid(height, width)
        return gh * gw // self.merge_size ** 2

    def patches(self, rgb: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """RGB [H, W, 3] uint8 -> (patches [gh * gw, 3 * T * P * P] float32, (1, gh, gw))."""
        h, w = self.resized_size(*rgb.shape[:2])
        image = resize(rgb, h, w, self.resample) if self.do_resize else rgb
        # HF's order and dtypes: uint8 -> float64 * factor -> float32, then (x - mean) / std
        # in float32 (image_transforms.rescale / normalize).
        pixels = (image.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = (pixels - np.float32(self.image_mean)) / np.float32(self.image_std)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = pixels.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, c, p, p]
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        return np.ascontiguousarray(x.reshape(gh * gw, 3 * t * p * p)), (1, gh, gw)


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """transformers' `smart_resize`: each side rounded to a multiple of `factor`, then scaled
    down (or up) as a whole until the area fits [min_pixels, max_pixels].

    Raises:
      ValueError: an aspect ratio over 200.
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {width}x{height} pixels: the aspect ratio must be under "
                         "200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_prompt(count: int) -> str:
    """The text one image of `count` placeholders becomes: Qwen2.5-VL's chat template writes
    `<|vision_start|><|image_pad|><|vision_end|>` per image, and its processor repeats the pad
    `count` times."""
    return "<|vision_start|>" + "<|image_pad|>" * count + "<|vision_end|>"
