"""jengine's Qwen2-VL processor against transformers' `Qwen2VLImageProcessorPil`: the same
pixel_values bit for bit and the same grid, for images scaled up to min_pixels, down to
max_pixels, rounded to the patch block either way, two images in one call, the published
Qwen2.5-VL config's keys (`min_pixels` / `max_pixels`) and transformers 5's (`size`)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from jengine.vision.qwen2_vl_processor import Qwen2VLProcessor

# Qwen2.5-VL-3B-Instruct's preprocessor_config.json as published (max_pixels cut, so the test
# images are scaled down too).
PUBLISHED = {"min_pixels": 3136, "max_pixels": 28 * 28 * 16, "patch_size": 14,
             "temporal_patch_size": 2, "merge_size": 2,
             "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711],
             "image_processor_type": "Qwen2VLImageProcessor",
             "processor_class": "Qwen2_5_VLProcessor"}


def _image(seed: int, height: int, width: int) -> np.ndarray:
    """A smooth gradient plus noise: resampling differences show on both."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    smooth = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                       (x + y) % 256], axis=-1)
    noise = rng.integers(-40, 41, (height, width, 3))
    return np.clip(smooth + noise, 0, 255).astype(np.uint8)


def _assert_equal(config: dict, images: list[np.ndarray]) -> list[tuple[int, int, int]]:
    hf = Qwen2VLImageProcessorPil(**{k: v for k, v in config.items()
                                     if not k.endswith("_class") and k != "image_processor_type"})
    ours = Qwen2VLProcessor.from_dict(config)
    out = hf(images=[Image.fromarray(i) for i in images], return_tensors="np")
    start, grids = 0, []
    for k, image in enumerate(images):
        patches, grid = ours.patches(image)
        assert grid == tuple(out["image_grid_thw"][k])
        assert ours.num_placeholders(*image.shape[:2]) == len(patches) // 4
        want = out["pixel_values"][start:start + len(patches)]
        assert patches.dtype == want.dtype == np.float32
        np.testing.assert_array_equal(patches, want)
        start += len(patches)
        grids.append(grid)
    assert start == len(out["pixel_values"])
    return grids


@pytest.mark.parametrize("height, width, grid", [
    (20, 30, (1, 4, 6)),    # under min_pixels: scaled up
    (100, 60, (1, 8, 4)),   # rounded to 28-pixel blocks
    (300, 500, (1, 6, 10)),  # over max_pixels: scaled down
    (56, 56, (1, 4, 4)),    # already whole blocks
    (30, 900, (1, 2, 42)),  # wide
])
def test_patches_equal_transformers(height, width, grid):
    assert _assert_equal(PUBLISHED, [_image(height, height, width)]) == [grid]


def test_two_images_and_transformers_5_keys():
    config = {"size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 9},
              "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    grids = _assert_equal(config, [_image(1, 40, 90), _image(2, 200, 120)])
    assert grids == [(1, 4, 6), (1, 6, 4)]  # max_pixels caps both


def test_extreme_aspect_ratio_is_refused():
    with pytest.raises(ValueError, match="aspect ratio"):
        Qwen2VLProcessor().patches(np.zeros((1, 300, 3), np.uint8))

