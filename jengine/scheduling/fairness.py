"""Which waiting sequences a step may admit first: fair between requests, so one request with
many samples (`n`) cannot fill the batch while others wait (host-side; no JAX)."""

from __future__ import annotations

import collections
from collections.abc import Iterable

from jengine.scheduling.sequence import Sequence


def fair_order(waiting: Iterable[Sequence], running: Iterable[Sequence],
               max_num_seqs: int) -> list[Sequence]:
    """The waiting queue in admission order, fair between requests: a request with many
    samples is taken round-robin with the others, by how many sequences it already runs (FIFO
    among equals), and while other requests wait it may not run more than half of
    `max_num_seqs`."""
    waiting = list(waiting)
    if len({s.request_id for s in waiting}) < 2:
        return waiting
    share = max(1, max_num_seqs // 2)
    held = collections.Counter(s.request_id for s in running)
    keyed = []
    for order, seq in enumerate(waiting):
        rank = held[seq.request_id]
        held[seq.request_id] += 1
        if rank < share:  # share >= 1: every request's first sequence is in
            keyed.append((rank, order, seq))
    return [seq for _, _, seq in sorted(keyed, key=lambda k: k[:2])]
