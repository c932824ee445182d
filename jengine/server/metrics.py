"""Prometheus metrics of one server: request latencies and token counts observed by the handlers,
and the engine's state (queues, KV pages, recompiles) read when `/metrics` is scraped.

Each app has its own `CollectorRegistry`, so several apps can live in one process (the tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from jengine.engine import AsyncEngine

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """The server's metrics; `render()` is the `/metrics` body."""

    def __init__(self, engine: Callable[[], AsyncEngine | None], queued: Callable[[], int]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "jengine_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram(
            "jengine_inter_token_latency_seconds",
            "Time between successive token deltas of one completion.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(
            "jengine_e2e_request_latency_seconds", "Time from a request's arrival to its end.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(
            "jengine_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(
            "jengine_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(
            "jengine_requests", "Engine requests ended, by finish reason (stop, length, abort, "
            "error, timeout).", ["finish_reason"], registry=r)
        self.rejected = Counter(
            "jengine_requests_rejected", "HTTP requests refused before reaching the engine, by "
            "reason.", ["reason"], registry=r)
        r.register(_EngineCollector(engine, queued))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Gauges read from the engine at scrape time (plain reads of host-side counters)."""

    def __init__(self, engine: Callable[[], AsyncEngine | None], queued: Callable[[], int]):
        self._engine = engine
        self._queued = queued

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        yield _gauge("jengine_engine_ready", "1 when the engine is loaded and alive.",
                     int(engine is not None and engine.is_alive))
        yield _gauge("jengine_num_requests_queued",
                     "HTTP requests admitted that have no first token yet (what --max-queue "
                     "bounds).", self._queued())
        if engine is None:
            return
        core = engine.core
        replicas = core.replicas  # dp replicas: their counts add up
        running = waiting = used = total = preemptions = 0
        for replica in replicas:
            r, w = _request_counts(replica.scheduler)
            running, waiting = running + r, waiting + w
            used += replica.allocator.num_used
            total += replica.allocator.num_pages - 1  # page 0 is the scratch page
            preemptions += replica.scheduler.num_preemptions
        yield _gauge("jengine_num_requests_running", "Requests with sequences being stepped.",
                     running)
        yield _gauge("jengine_num_requests_waiting", "Requests waiting in the scheduler.",
                     waiting)
        yield _gauge("jengine_kv_pages_used", "KV cache pages in use.", used)
        yield _gauge("jengine_kv_pages_total", "KV cache pages that can be handed out.", total)
        yield _gauge("jengine_kv_cache_usage_ratio", "Fraction of KV cache pages in use.",
                     used / max(total, 1))
        yield _gauge("jengine_compiles_since_ready",
                     "XLA programs compiled after warm-up (anything but 0 is a missed bucket).",
                     core.compiles_since_ready)
        yield _gauge("jengine_preemptions", "Sequences preempted (recomputed) so far.",
                     preemptions)


def _request_counts(scheduler) -> tuple[int, int]:
    """(running, waiting) distinct requests; the lists belong to the engine thread, so they are
    copied first (a copy of a list or deque is atomic under the GIL)."""
    running = list(scheduler.running)
    waiting = list(scheduler.waiting)
    return len({s.request_id for s in running}), len({s.request_id for s in waiting})


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
