"""`HostLoras`: the LoRA adapters read from disk, kept on the host for the device slots.

An adapter is read and checked the first time a request names it (or when the server loads
it), so a bad adapter is a ValueError before anything is queued. At most `max_cpu_loras`
stay read, least recently used dropped first (vLLM's `--max-cpu-loras`), but never one that
a queued or running request uses (`in_use`): refilling its slot must not need its directory,
which may be gone by then. A dropped adapter is read again when a new request names it.
Thread-safe: the server's load route reads an adapter on its own thread while the engine
thread fills slots.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from converters.lora_adapter import Adapter, load_adapter
from jengine.lora_request import LoRARequest
from jengine.models import ModelConfig


class HostLoras:
    """Adapters by `lora_int_id`: their directories, and the last `max_cpu_loras` read."""

    def __init__(self, cfg: ModelConfig, *, max_rank: int, max_cpu_loras: int):
        if max_cpu_loras < 1:
            raise ValueError("max_cpu_loras must be at least 1")
        self.cfg, self.max_rank, self.max_cpu_loras = cfg, max_rank, max_cpu_loras
        self._paths: dict[int, str] = {}
        self._read: collections.OrderedDict[int, Adapter] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.reads = 0  # adapters read from disk (a dropped one read again counts again)
        # The adapter ids that queued or running requests use (EngineCore sets it): kept.
        self.in_use: Callable[[], set[int]] = set

    def add(self, request: LoRARequest) -> Adapter:
        """Reads (or finds) `request`'s adapter. Raises ValueError for a bad adapter, or for
        an id already given to another directory."""
        with self._lock:
            known = self._paths.get(request.lora_int_id)
            if known is not None and known != str(request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} is already the adapter at "
                                 f"{known}, not {request.lora_path}")
        adapter = self._get(request.lora_int_id, str(request.lora_path))
        with self._lock:
            self._paths[request.lora_int_id] = str(request.lora_path)
        return adapter

    def layers(self, lora_id: int) -> list[dict]:
        """The adapter's per-layer weights (read again if its copy was dropped)."""
        with self._lock:
            path = self._paths[lora_id]
        return self._get(lora_id, path).layers

    def remove(self, lora_id: int) -> None:
        """Drops an adapter's host copy, unless requests still use it: those keep it until
        they finish (then it goes least recently used first). Its directory stays known under
        its id (an id never names another directory: the server gives each load a new one)."""
        in_use = self.in_use()
        with self._lock:
            if lora_id not in in_use:
                self._read.pop(lora_id, None)

    def _get(self, lora_id: int, path: str) -> Adapter:
        with self._lock:
            adapter = self._read.get(lora_id)
            if adapter is not None:
                self._read.move_to_end(lora_id)
                return adapter
        adapter = load_adapter(path, self.cfg, self.max_rank)  # outside the lock: disk
        in_use = self.in_use() | {lora_id}
        with self._lock:
            self.reads += 1
            self._read[lora_id] = adapter
            spare = [i for i in self._read if i not in in_use]  # least recently used first
            for i in spare[: max(0, len(self._read) - self.max_cpu_loras)]:
                del self._read[i]
        return adapter
