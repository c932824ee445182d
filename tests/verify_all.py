"""Speculating engines with the cost model out of the way.

Tests of what verification does to the outputs need every proposal verified: the cost model
(`jengine.scheduling.speculative.best_cap`, tested on the scheduler harness) may rightly decline
all of them on a slow or busy machine, and a test that then saw no speculation would prove
nothing, or fail on a count."""

from __future__ import annotations

from jengine import Engine


def verifying_everything(engine: Engine) -> Engine:
    """`engine` with every replica proposing and verifying whenever it can."""
    for core in engine.core.replicas:
        core.scheduler.speculator.step_costs = None
    return engine
