"""One read of a model's weights for the several engines a test builds on the same source.

`Engine(...)` reads and dequantizes its model's source in `jengine.core.build.open_model`
(`converters.load_source`): ~2-3 s for SmolLM2, ~16 s for Gemma 3 270M's Q4_K_M GGUF here.
Tests that compare two engines on one model (XLA's dots against a kernel's) need that read
only once: an engine only reads a `LoadedModel`'s host arrays (data-parallel replicas share one
so, `EngineCore(loaded=...)`), and everything after the read (placement, packing,
quantization, calibration, compiling) still runs per engine."""

from __future__ import annotations

import contextlib

import pytest

from jengine.core import build


@contextlib.contextmanager
def loads_shared():
    """Within the block, `open_model`'s reads with equal arguments return the first one's
    `LoadedModel`; released at the end."""
    real = build.load_source
    loads: dict = {}

    def load(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in loads:
            loads[key] = real(*args, **kwargs)
        return loads[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "load_source", load)
        yield
    loads.clear()
