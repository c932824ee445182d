"""Test set-up: 8 fake CPU devices (so sharding runs), the persistent compilation cache, and one
engine per session on the bundled SmolLM2 with the small `test` bucket preset."""

from __future__ import annotations

import os

# Must happen before JAX initialises its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)

from jengine.compilation import enable_persistent_cache  # noqa: E402

enable_persistent_cache()


@pytest.fixture(scope="session")
def smol_engine():
    """The default model (SmolLM2-135M-Instruct, f32) behind the real Engine, test buckets."""
    from jengine import Engine

    return Engine(config="test", progress=False)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_engine):
    return smol_engine.tokenizer
