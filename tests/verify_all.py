"""Speculating engines with the cost model out of the way.

Tests of what verification does to the outputs need every proposal verified: the cost model
(`jengine.scheduling.speculative.best_cap`, tested on the scheduler harness) may rightly decline
all of them on a slow or busy machine, and a test that then saw no speculation would prove
nothing, or fail on a count."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jengine import Engine
from jengine.scheduling.scheduler import Scheduler
from jengine.scheduling.speculation import Speculator
from jengine.scheduling.speculative import NgramProposer


def verifying_everything(engine: Engine) -> Engine:
    """`engine` with every replica proposing and verifying whenever it can."""
    for core in engine.core.replicas:
        core.scheduler.speculator.step_costs = None
    return engine


@contextlib.contextmanager
def ngram_speculation(engine: Engine, num_tokens: int = 3) -> Iterator[Scheduler]:
    """`engine` (one replica) with n-gram speculation for the block, verifying every proposal (a
    `Speculator` without step costs); yields its scheduler, whose counters count them."""
    sched = engine.core.scheduler
    saved = sched.speculator
    sched.speculator = Speculator(NgramProposer(num_tokens=num_tokens))
    try:
        yield sched
    finally:
        sched.speculator = saved
