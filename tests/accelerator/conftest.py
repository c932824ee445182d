"""The accelerator suite: what a lent GPU (or TPU) machine checks, as tests.

Every test here is marked `accelerator` and skipped unless JAX's default backend is a GPU or
TPU, or pytest runs with `--accelerator-on-cpu` (Pallas in interpret mode on the smallest cases:
a dry run of the suite, minutes on a CPU). `scripts/gpu_session.py` runs this suite and then the
throughput benchmark on a GPU machine in one call.

    python -m pytest -q tests/accelerator                        # on the GPU machine
    python -m pytest -q tests/accelerator --accelerator-on-cpu   # the dry run anywhere
"""

from __future__ import annotations

import jax
import pytest


def on_accelerator() -> bool:
    return jax.default_backend() in ("gpu", "tpu")


@pytest.fixture(autouse=True)
def _needs_accelerator(request):
    if not (on_accelerator() or request.config.getoption("--accelerator-on-cpu")):
        pytest.skip("needs a GPU or TPU (or --accelerator-on-cpu for a dry run)")


@pytest.fixture
def interpret() -> bool:
    """Kernels in interpret mode and only the smallest cases: the dry run on a CPU."""
    return not on_accelerator()
