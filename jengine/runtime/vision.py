"""`VisionEncoder`: a vision model's image tower as its own compiled programs.

Tiles of one image size go through the tower in batches of a few declared sizes
(`TILE_BUCKETS`), each compiled before the engine is ready, so an image never compiles
anything while the engine serves: a prompt's tiles are cut into batches of the largest
bucket and a last one padded to the next bucket up. The rows come back to the host, where
the scheduler hands each prefill chunk the rows of the placeholders it computes
(`image_inputs.image_rows`): encoding once per request, not per chunk, and nothing held on the
device between steps.

`QwenVisionEncoder` is Qwen2.5-VL's: its images are grids of any size, so its programs are
bucketed by patch count (`patch_buckets`), one image a run, the window and image groups passed
in as arrays (`qwen2_5_vl.vision_plan`).
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models import idefics3, qwen2_5_vl, qwen3_vl
from jengine.runtime.executables import compile_fresh

log = logging.getLogger("jengine")

TILE_BUCKETS = (1, 2, 4, 8)


class VisionEncoder:
    """The tower's params on the device and one program per tile bucket."""

    def __init__(self, vc: idefics3.VisionConfig, params: dict[str, np.ndarray], dtype):
        self.config = vc
        self.dtype = jnp.dtype(dtype)
        self.params = jax.device_put({k: v.astype(self.dtype) for k, v in params.items()})
        self._programs: dict[int, jax.stages.Compiled] = {}
        self._lock = threading.Lock()
        self.ready = False
        self.programs_compiled = 0

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        vc = self.config
        return (vc.num_channels, vc.image_size, vc.image_size)

    def warmup(self) -> float:
        """Compiles and runs every bucket's program once; returns the seconds taken."""
        start = time.perf_counter()
        for bucket in TILE_BUCKETS:
            self._run(np.zeros((bucket, *self.tile_shape), np.float32))
        self.ready = True
        return time.perf_counter() - start

    def encode(self, tiles: np.ndarray) -> np.ndarray:
        """Tiles [N, C, S, S] float32 -> rows [N * tokens_per_tile, E] float32 (host)."""
        if tiles.shape[1:] != self.tile_shape:
            raise ValueError(f"tiles of shape {tiles.shape[1:]}, expected {self.tile_shape}")
        top = TILE_BUCKETS[-1]
        parts = [self._run(tiles[i:i + top]) for i in range(0, len(tiles), top)]
        return np.concatenate(parts) if parts else np.zeros((0, self.config.text_hidden_size))

    def encode_images(self, ready) -> np.ndarray:
        """A `PreparedImages`' tiles -> their rows (`encode`): the call both towers answer."""
        return self.encode(ready.tiles)

    def _run(self, tiles: np.ndarray) -> np.ndarray:
        n = len(tiles)
        bucket = next(b for b in TILE_BUCKETS if b >= n)
        padded = np.zeros((bucket, *self.tile_shape), np.float32)
        padded[:n] = tiles
        out = self._program(bucket)(self.params, jnp.asarray(padded, self.dtype))
        return np.asarray(out, np.float32)[: n * self.config.tokens_per_tile]

    def _program(self, bucket: int) -> jax.stages.Compiled:
        program = self._programs.get(bucket)
        if program is not None:
            return program
        with self._lock:
            if bucket not in self._programs:
                start = time.perf_counter()
                vc = self.config

                def encode(params, pixels):
                    return idefics3.encode(params, vc, pixels)

                args = (self.params, jax.ShapeDtypeStruct((bucket, *self.tile_shape),
                                                          self.dtype))
                self._programs[bucket], _ = compile_fresh(encode, f"vision_{bucket}", args, {})
                self.programs_compiled += 1
                level = logging.WARNING if self.ready else logging.DEBUG
                log.log(level, "compiled vision program of %d tiles in %.2fs%s", bucket,
                        time.perf_counter() - start, " after ready" if self.ready else "")
            return self._programs[bucket]


MAX_TOWER_PATCHES = 4096  # the largest Qwen2.5-VL run: its attention is dense [heads, n, n]


def patch_buckets(min_patches: int, max_patches: int) -> tuple[int, ...]:
    """Powers of two from the smallest image's patch count to the largest's (capped at
    MAX_TOWER_PATCHES): one compiled tower program each."""
    lo = 1 << max(2, (max(min_patches, 1) - 1).bit_length())
    hi = min(1 << (max(max_patches, 1) - 1).bit_length(), MAX_TOWER_PATCHES)
    return tuple(1 << k for k in range(lo.bit_length() - 1, hi.bit_length()))


class QwenVisionEncoder:
    """Qwen2.5-VL's or Qwen3-VL's tower on the device, one program per patch-count bucket; each
    image runs on its own, padded to the next bucket (the plan masks the padding off).
    Qwen2.5-VL's runs take the patches in window order and give rows back in raster order;
    Qwen3-VL's give [1 + K, rows, E]: the rows, then the DeepStack rows."""

    def __init__(self, vc: qwen2_5_vl.VisionConfig | qwen3_vl.VisionConfig,
                 params: dict[str, np.ndarray], dtype, buckets: tuple[int, ...]):
        self.config, self.buckets = vc, buckets
        self.windowed = isinstance(vc, qwen2_5_vl.VisionConfig)
        self.dtype = jnp.dtype(dtype)
        self.params = jax.device_put({k: v.astype(self.dtype) for k, v in params.items()})
        self._programs: dict[int, jax.stages.Compiled] = {}
        self._lock = threading.Lock()
        self.ready = False
        self.programs_compiled = 0

    def warmup(self) -> float:
        """Compiles and runs every bucket's program once; returns the seconds taken."""
        start = time.perf_counter()
        m = self.config.merge_size
        for n in self.buckets:
            self._image(np.zeros((n, self.config.patch_in), np.float32), (1, m, n // m), n)
        self.ready = True
        return time.perf_counter() - start

    def encode_images(self, ready) -> np.ndarray:
        """A `PreparedImages`' patches -> rows [placeholders, E] ([1 + K, placeholders, E]
        for Qwen3-VL) float32 (host), in prompt order."""
        parts, at = [], 0
        for grid in ready.grids:
            count = grid[0] * grid[1] * grid[2]
            bucket = next((b for b in self.buckets if b >= count), None)
            if bucket is None:
                raise ValueError(f"an image of {count} patches exceeds the tower's largest run "
                                 f"({self.buckets[-1]}); lower max_pixels")
            parts.append(self._image(ready.tiles[at:at + count], grid, bucket))
            at += count
        if not parts:
            return np.zeros((0, self.config.text_hidden_size), np.float32)
        return np.concatenate(parts, axis=-2)

    def _image(self, patches: np.ndarray, grid: tuple[int, int, int], n: int) -> np.ndarray:
        """One image's patches through the bucket-`n` program -> its rows (host)."""
        vc, real = self.config, len(patches) // self.config.merge_unit
        padded = np.zeros((n, vc.patch_in), np.float32)
        if self.windowed:
            plan = qwen2_5_vl.vision_plan(vc, [grid], n)
            padded[:len(patches)] = patches[plan.order[:len(patches)]]
            extra = (plan.hw, plan.window, plan.image)
        else:
            plan = qwen3_vl.tower_plan(vc, [grid], n)
            padded[:len(patches)] = patches
            extra = (plan.hw, plan.image, plan.taps, plan.weights)
        out = self._program(n)(self.params, jnp.asarray(padded, self.dtype), *extra)
        out = np.asarray(out, np.float32)[..., :real, :]
        return out[plan.unorder] if self.windowed else out

    def _program(self, n: int) -> jax.stages.Compiled:
        if (program := self._programs.get(n)) is not None:
            return program
        with self._lock:
            if n not in self._programs:
                start = time.perf_counter()
                vc, tower = self.config, (qwen2_5_vl if self.windowed else qwen3_vl)

                def encode(params, patches, *plan):
                    return tower.encode(params, vc, patches, *plan)

                ints = jax.ShapeDtypeStruct((n,), jnp.int32)
                plan = (jax.ShapeDtypeStruct((n, 2), jnp.int32), ints, ints) if self.windowed \
                    else (jax.ShapeDtypeStruct((n, 2), jnp.int32), ints,
                          jax.ShapeDtypeStruct((n, 4), jnp.int32),
                          jax.ShapeDtypeStruct((n, 4), jnp.float32))
                args = (self.params, jax.ShapeDtypeStruct((n, vc.patch_in), self.dtype), *plan)
                self._programs[n], _ = compile_fresh(encode, f"qwen_vision_{n}", args, {})
                self.programs_compiled += 1
                level = logging.WARNING if self.ready else logging.DEBUG
                log.log(level, "compiled vision program of %d patches in %.2fs%s", n,
                        time.perf_counter() - start, " after ready" if self.ready else "")
            return self._programs[n]
