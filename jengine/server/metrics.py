"""Prometheus metrics of one server: request latencies and token counts observed by the handlers,
and the engine's state (queues, KV pages, recompiles) read when `/metrics` is scraped.

Each app has its own `CollectorRegistry`, so several apps can live in one process (the tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from jengine.async_engine import AsyncEngine

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
        stats = engine.stats()  # dp replicas: added up
        yield _gauge("jengine_num_requests_running", "Requests with sequences being stepped.",
                     stats.num_requests_running)
        yield _gauge("jengine_num_requests_waiting", "Requests waiting in the scheduler.",
                     stats.num_requests_waiting)
        yield _gauge("jengine_kv_pages_used",
                     "KV cache pages held by requests (not counting evictable cached pages).",
                     stats.kv_pages_used)
        yield _gauge("jengine_kv_pages_total", "KV cache pages that can be handed out.",
                     stats.kv_pages_total)
        yield _gauge("jengine_kv_cache_usage_ratio", "Fraction of KV cache pages in use.",
                     stats.kv_cache_usage)
        yield _gauge("jengine_compiles_since_ready",
                     "XLA programs compiled after warm-up (anything but 0 is a missed bucket).",
                     stats.compiles_since_ready)
        yield _counter("jengine_compiles_after_ready",
                       "Step programs (and any other XLA programs) compiled or loaded after "
                       "the engine turned ready; each stalls its batch. Logged with its shape.",
                       stats.compiles_since_ready)
        yield _gauge("jengine_preemptions", "Sequences preempted (recomputed) so far.",
                     stats.num_preemptions)
        yield _counter("jengine_prefix_cache_queries",
                       "Prefix-cache lookups (one per admission of a sequence).",
                       stats.prefix_cache_queries)
        yield _counter("jengine_prefix_cache_query_tokens",
                       "Prompt tokens looked up in the prefix cache.",
                       stats.prefix_cache_query_tokens)
        yield _counter("jengine_prefix_cache_hit_tokens",
                       "Prompt tokens found in the prefix cache (not computed again).",
                       stats.prefix_cache_hit_tokens)
        yield _gauge("jengine_prefix_cache_hit_rate",
                     "Prefix-cache hit tokens over looked-up tokens since start-up.",
                     stats.prefix_cache_hit_rate)
        yield _gauge("jengine_prefix_cache_pages",
                     "KV pages in the prefix cache (in use or evictable).",
                     stats.prefix_cache_pages)
        yield _counter("jengine_prefix_cache_evicted_pages",
                       "Cached KV pages evicted to make room.",
                       stats.prefix_cache_evicted_pages)
        yield _counter("jengine_prefix_cache_duplicate_pages",
                       "KV pages a sequence computed that the prefix cache held already.",
                       stats.prefix_cache_duplicate_pages)
        yield _counter("jengine_spec_decode_num_drafts",
                       "Speculative verifications (one sequence's decode step with proposals).",
                       stats.spec_num_drafts)
        yield _counter("jengine_spec_decode_num_draft_tokens",
                       "Tokens proposed for speculative verification.",
                       stats.spec_num_draft_tokens)
        yield _counter("jengine_spec_decode_num_accepted_tokens",
                       "Proposed tokens the model confirmed.", stats.spec_num_accepted_tokens)
        yield _gauge("jengine_spec_decode_acceptance_rate",
                     "Accepted over proposed tokens since start-up.",
                     stats.spec_acceptance_rate)
        yield _gauge("jengine_spec_decode_mean_accepted_length",
                     "Tokens per verifying step (accepted proposals + 1) since start-up.",
                     stats.spec_mean_accepted_length)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)  # exposed as NAME_total
