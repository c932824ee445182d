"""`EngineStats`: a snapshot of one engine's load and counters, for `/metrics`, benchmarks and
notebooks (`Engine.stats()`). Data-parallel replicas add theirs up (`EngineStats.total`)."""

from __future__ import annotations

import dataclasses

from jengine.scheduling.prefix_cache import PrefixCache
from jengine.scheduling.scheduler import Scheduler


@dataclasses.dataclass
class EngineStats:
    """What the engine is doing now, and what it has done since start-up.

    Attributes:
      num_requests_running: requests with sequences being stepped.
      num_requests_waiting: requests waiting for admission (or readmission after preemption).
      kv_pages_total: KV pages that can be handed out.
      kv_pages_used: pages held by requests (pages only the prefix cache holds are not counted:
        they are given up on demand).
      num_preemptions: sequences preempted (and recomputed) so far.
      num_steps: engine steps run.
      compiles_since_ready: step programs this engine built (compiled, or loaded from the
        executable store) after warm-up: 0 unless a shape or variant was missed.
      prefix_cache_pages: pages in the prefix cache (in use or evictable); 0 when it is off.
      prefix_cache_queries: prefix-cache lookups (one per admission, readmissions included).
      prefix_cache_query_tokens: tokens those lookups covered.
      prefix_cache_hit_tokens: tokens found in the cache, so not computed again.
      prefix_cache_evicted_pages: cached pages evicted to make room.
      prefix_cache_duplicate_pages: pages a sequence computed that the cache held already (two
        requests filling one prefix at once, or an identical request's identical output).
      spec_num_drafts: speculative verifications (a decode step of one sequence with proposals).
      spec_num_draft_tokens: tokens proposed in them.
      spec_num_accepted_tokens: proposed tokens the target model confirmed.
    """

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_pages_total: int = 0
    kv_pages_used: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    compiles_since_ready: int = 0
    prefix_cache_pages: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_evicted_pages: int = 0
    prefix_cache_duplicate_pages: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_pages_used / max(self.kv_pages_total, 1)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens over looked-up tokens (0 before any lookup)."""
        return self.prefix_cache_hit_tokens / max(self.prefix_cache_query_tokens, 1)

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted over proposed tokens (0 before any proposal)."""
        return self.spec_num_accepted_tokens / max(self.spec_num_draft_tokens, 1)

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verifying step yields on average: the accepted proposals plus the one token
        every step makes (1.0 before any verification)."""
        return 1 + self.spec_num_accepted_tokens / max(self.spec_num_drafts, 1)

    @classmethod
    def of(cls, scheduler: Scheduler, prefix_cache: PrefixCache | None, *, num_steps: int,
           compiles_since_ready: int) -> EngineStats:
        """A snapshot of one replica. Safe to call from another thread: it only reads (the
        scheduler's lists are copied first, atomically under the GIL)."""
        running, waiting = list(scheduler.running), list(scheduler.waiting)
        allocator, spec = scheduler.allocator, scheduler.spec_counters
        stats = cls(
            num_requests_running=len({s.request_id for s in running}),
            num_requests_waiting=len({s.request_id for s in waiting}),
            kv_pages_total=allocator.num_pages - 1,  # page 0 is the scratch page
            kv_pages_used=allocator.num_used - allocator.num_evictable,
            num_preemptions=scheduler.num_preemptions,
            num_steps=num_steps,
            compiles_since_ready=compiles_since_ready,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
        )
        if prefix_cache is not None:
            c = prefix_cache.stats
            stats.prefix_cache_pages = prefix_cache.num_pages
            stats.prefix_cache_queries = c.queries
            stats.prefix_cache_query_tokens = c.query_tokens
            stats.prefix_cache_hit_tokens = c.hit_tokens
            stats.prefix_cache_evicted_pages = c.evicted_pages
            stats.prefix_cache_duplicate_pages = c.duplicate_pages
        return stats

    @classmethod
    def total(cls, parts: list[EngineStats]) -> EngineStats:
        """The sum over replicas; steps are the largest (replicas step together)."""
        out = cls()
        for f in dataclasses.fields(cls):
            values = [getattr(p, f.name) for p in parts]
            setattr(out, f.name, (max if f.name == "num_steps" else sum)(values))
        return out
