"""`VisionEncoder`: a vision model's image tower as its own compiled programs.

Tiles of one image size go through the tower in batches of a few declared sizes
(`TILE_BUCKETS`), each compiled before the engine is ready, so an image never compiles
anything while the engine serves: a prompt's tiles are cut into batches of the largest
bucket and a last one padded to the next bucket up. The rows come back to the host, where
the scheduler hands each prefill chunk the rows of the placeholders it computes
(`step_io.image_rows`): encoding once per request, not per chunk, and nothing held on the
device between steps.
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models import idefics3
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
