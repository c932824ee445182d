"""`host_kv_budget`: on CPU, `kv_cache_memory` is the host's, whatever the fake-device mesh."""

from __future__ import annotations

import jax
import pytest

from jengine.core.kv_budget import host_kv_budget
from jengine.sharding import MeshSpec

GIB = 2**30


def test_cpu_budget_is_shared_by_replicas_and_replicated_copies():
    assert jax.default_backend() == "cpu"
    one = host_kv_budget("2GiB", MeshSpec.parse("tp=1"), 3)
    assert one == 2 * GIB
    # 3 kv heads over tp=8: every fake device holds the whole cache, all in this host's memory
    assert host_kv_budget("2GiB", MeshSpec.parse("tp=8"), 3) == 2 * GIB // 8
    # 8 kv heads over tp=8: each device holds its own heads' pages, one copy in all
    assert host_kv_budget("2GiB", MeshSpec.parse("tp=8"), 8) == 2 * GIB
    # dp replicas each get their own pool out of the same host budget
    assert host_kv_budget("2GiB", MeshSpec.parse("dp=2,tp=4"), 4) == GIB


def test_a_budget_the_host_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="does not fit in this host's available memory"):
        host_kv_budget("100TiB", MeshSpec.parse("tp=1"), 1)

