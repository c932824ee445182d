"""`StepClock`: where an engine core's time goes, step by step.

The device's share is the wall time inside `Runner.launch` and `Runner.fetch` (device work and
transfers); the host's is the rest of `EngineCore.step` (schedule, sampling rows, postprocess,
detokenize): the gap between device steps. Under speculation each fetched step's device time,
from its launch or the previous step's end if later, and each gap the host left the device
idle, feed the cost model that weighs verification (`scheduling.speculative.StepCosts`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from jengine.scheduling.speculative import StepCosts


class StepClock:
    """An engine core's step counters and timings (read by `stats`, `jengine bench`)."""

    def __init__(self, costs: StepCosts | None):
        self.costs = costs  # None: speculation off, nothing to weigh
        self.num_steps = 0
        self.num_steps_ahead = 0  # steps dispatched before the previous step's tokens arrived
        self.device_seconds = 0.0
        self.host_seconds = 0.0
        self._last_done = 0.0  # when the last fetched step's outputs reached the host; 0: idle

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Times one `EngineCore.step`: what the device did not take of it is the host's."""
        t0, device_before = time.perf_counter(), self.device_seconds
        yield
        device = self.device_seconds - device_before
        self.host_seconds += time.perf_counter() - t0 - device

    def launched(self, started: float, ahead: bool) -> None:
        """A step was dispatched from `started` (`time.perf_counter()`) until now; `ahead`: while
        the previous one was still in flight, so no host gap came before it."""
        self.device_seconds += time.perf_counter() - started
        self.num_steps_ahead += ahead
        if self.costs is not None and not ahead and self._last_done:
            self.costs.observe_gap(started - self._last_done)

    def fetched(self, num_tokens: int, launched: float, started: float) -> None:
        """A step of `num_tokens` dispatched at `launched` was read back, from `started` to now."""
        done = time.perf_counter()
        self.device_seconds += done - started
        if self.costs is not None:
            # The device ran this step from its launch or the previous step's end, if later.
            self.costs.observe(num_tokens, done - max(launched, self._last_done))
        self._last_done = done
        self.num_steps += 1

    def idle(self) -> None:
        """No request is left: the next step's wait is not a host gap."""
        self._last_done = 0.0
