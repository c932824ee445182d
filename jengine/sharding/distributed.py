"""Multi-host runs with JAX's own multi-controller runtime (`jax.distributed`).

Every host runs one jengine process; all of them see the global device list, so a mesh such as
`tp=8` over two 4-device hosts spans both. Process 0 (the leader) owns the scheduler, the HTTP
server and every request; before each step program it broadcasts that step's host inputs, and
the other processes (followers) run the same program on them — XLA's collectives do the rest.
No home-made protocol: the broadcast is `multihost_utils.broadcast_one_to_all`, itself a
collective over the same devices.

The inputs travel as one pickled byte buffer (numpy arrays inside), padded to a power-of-two
length so the broadcast programs come in a handful of sizes: a length message first, then the
bytes. A `None` payload tells the followers to stop.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import jax
import numpy as np

MIN_MESSAGE_BYTES = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedSpec:
    """Where this process sits in a multi-host run (`num_processes == 1`: a single host)."""

    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0

    def validate(self) -> None:
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be at least 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id {self.process_id} must be in [0, {self.num_processes})"
            )
        if self.num_processes > 1 and not self.coordinator:
            raise ValueError("a multi-process run needs coordinator=HOST:PORT")

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


_initialized: DistributedSpec | None = None


def initialize(spec: DistributedSpec) -> None:
    """Joins the multi-controller run (once per process, before JAX's backend starts)."""
    global _initialized
    spec.validate()
    if spec.num_processes == 1:
        return
    if _initialized is not None:
        if _initialized != spec:
            raise ValueError(f"this process already joined {_initialized}")
        return
    # CPU hosts need an explicit collectives implementation for cross-process all-reduces.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=spec.coordinator,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
    )
    _initialized = spec


class StepChannel:
    """Leader -> followers: each step's host inputs (any picklable value), or stop (None)."""

    def __init__(self, spec: DistributedSpec):
        self.spec = spec

    @property
    def is_leader(self) -> bool:
        return self.spec.is_leader

    def send(self, message: Any) -> None:
        assert self.is_leader
        payload = np.frombuffer(pickle.dumps(message, protocol=5), np.uint8)
        size = max(MIN_MESSAGE_BYTES, 1 << (payload.size - 1).bit_length())
        self._broadcast(np.asarray([payload.size, size], np.int32))
        buffer = np.zeros((size,), np.uint8)
        buffer[: payload.size] = payload
        self._broadcast(buffer)

    def receive(self) -> Any:
        assert not self.is_leader
        length, size = (int(x) for x in self._broadcast(np.zeros((2,), np.int32)))
        buffer = self._broadcast(np.zeros((size,), np.uint8))
        return pickle.loads(np.asarray(buffer[:length]).tobytes())

    @staticmethod
    def _broadcast(x: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(x))
