"""How many bytes the KV page pool gets: `kv_cache_memory` per device, or per host on CPU."""

from __future__ import annotations

import jax

from jengine.config import parse_memory
from jengine.sharding import MeshSpec


def host_kv_budget(kv_cache_memory: str, mesh: MeshSpec, num_kv_heads: int,
                   num_processes: int = 1) -> int:
    """The bytes of one replica's page pool, counted as global (unsharded) KV bytes.

    On accelerators `kv_cache_memory` is per device, as in vLLM. On CPU every (fake) device
    lives in the one host's memory, so it is what the whole host spends: shared by the dp
    replicas, and by the tp copies of a cache whose kv heads are replicated (kv_heads % tp
    != 0), as far as they live on this host (a multi-host mesh spreads them over
    `num_processes` hosts). It must fit in the host's available memory (else a ValueError
    naming the fix).
    """
    budget = parse_memory(kv_cache_memory)
    if jax.default_backend() != "cpu":
        return budget
    available = _available_host_memory()
    if available is not None and budget > 0.9 * available:
        raise ValueError(
            f"kv_cache_memory {kv_cache_memory} does not fit in this host's available memory "
            f"({available / 2**30:.1f} GiB); lower --kv-cache-memory"
        )
    copies = 1 if num_kv_heads % mesh.tp == 0 else max(1, mesh.tp // num_processes)
    return budget // (max(1, mesh.dp // num_processes) * copies)


def _available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
