"""jengine's Idefics3 processor against transformers' `Idefics3ImageProcessorPil`: the same
pixel_values bit for bit, and the same tile grid, for one-tile images, wide and tall images cut
into grids, two images in one call, and the published SmolVLM sizes (364-pixel tiles)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers.models.idefics3.image_processing_pil_idefics3 import (
    Idefics3ImageProcessorPil,
)

from jengine.vision.idefics3_processor import Idefics3Processor


def _pair(longest: int, tile: int, **extra) -> tuple[Idefics3ImageProcessorPil, Idefics3Processor]:
    config = {"size": {"longest_edge": longest}, "max_image_size": {"longest_edge": tile},
              **extra}
    return Idefics3ImageProcessorPil(**config), Idefics3Processor.from_dict(config)


def _image(seed: int, height: int, width: int) -> np.ndarray:
    """A smooth gradient plus noise: resampling differences show on both."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    smooth = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                       (x + y) % 256], axis=-1)
    noise = rng.integers(-40, 41, (height, width, 3))
    return np.clip(smooth + noise, 0, 255).astype(np.uint8)


def _assert_equal(hf, ours, images: list[np.ndarray]) -> list[tuple[int, int]]:
    """HF's batch of one sample holding `images` against ours image by image; -> grids."""
    out = hf(images=[[Image.fromarray(i) for i in images]], return_row_col_info=True,
             return_tensors="np")
    start, grids = 0, []
    for k, image in enumerate(images):
        tiles, rows, cols = ours.tiles(image)
        assert (rows, cols) == (out["rows"][0][k], out["cols"][0][k])
        assert len(tiles) == ours.num_tiles(*image.shape[:2])
        want = out["pixel_values"][0, start:start + len(tiles)]
        assert tiles.dtype == want.dtype == np.float32
        np.testing.assert_array_equal(tiles, want)
        start += len(tiles)
        grids.append((rows, cols))
    assert not out["pixel_values"][0, start:].any()  # HF's padding, nothing of ours left out
    return grids


@pytest.mark.parametrize("height, width, grid", [
    (20, 30, (2, 2)),   # upscaled to the longest edge, then a 2x2 grid
    (30, 200, (1, 2)),  # wide: one row of two
    (210, 40, (2, 1)),  # tall: two rows of one
    (64, 64, (2, 2)),   # already the longest edge (Pillow's resize copies)
    (1, 90, (1, 2)),    # one pixel tall: HF's at-least-1 rounding
])
def test_tiles_equal_transformers(height, width, grid):
    hf, ours = _pair(64, 32)
    assert _assert_equal(hf, ours, [_image(height, height, width)]) == [grid]


def test_one_tile_and_no_splitting_equal_transformers():
    hf, ours = _pair(32, 32)  # the longest edge is one tile: no grid
    assert _assert_equal(hf, ours, [_image(0, 50, 70)]) == [(0, 0)]
    hf, ours = _pair(64, 32, do_image_splitting=False)  # squeezed into one tile
    assert _assert_equal(hf, ours, [_image(1, 50, 70)]) == [(0, 0)]


def test_two_images_in_one_call_equal_transformers():
    hf, ours = _pair(64, 32)
    grids = _assert_equal(hf, ours, [_image(2, 30, 200), _image(3, 90, 45)])
    assert grids == [(1, 2), (2, 1)]


def test_smolvlm_sizes_equal_transformers():
    """SmolVLM's 4 x 364 longest edge in 364-pixel tiles (transformers' defaults), with the
    config's own rescale factor and LANCZOS given as `resample: 1` as the published file has."""
    hf, ours = _pair(4 * 364, 364, resample=1, rescale_factor=0.00392156862745098)
    assert ours.resample == 1
    assert _assert_equal(hf, ours, [_image(4, 300, 500)]) == [(3, 4)]
