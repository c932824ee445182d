"""`EngineStats`: a snapshot of one engine's load and counters, for `/metrics`, benchmarks and
notebooks (`Engine.stats()`). Data-parallel replicas add theirs up (`EngineStats.total`)."""

from __future__ import annotations

import dataclasses


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
      compiles_since_ready: XLA programs compiled after warm-up (0 unless a shape was missed).
      prefix_cache_pages: pages in the prefix cache (in use or evictable); 0 when it is off.
      prefix_cache_queries: prefix-cache lookups (one per admission, readmissions included).
      prefix_cache_query_tokens: tokens those lookups covered.
      prefix_cache_hit_tokens: tokens found in the cache, so not computed again.
      prefix_cache_evicted_pages: cached pages evicted to make room.
      prefix_cache_duplicate_pages: pages computed twice because two requests prefilled the
        same prefix at once (one copy is kept).
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
    def total(cls, parts: list[EngineStats]) -> EngineStats:
        """The sum over replicas; steps and compiles are the largest (replicas step together,
        and the compile counter is per process)."""
        out = cls()
        for f in dataclasses.fields(cls):
            values = [getattr(p, f.name) for p in parts]
            combine = max if f.name in ("num_steps", "compiles_since_ready") else sum
            setattr(out, f.name, combine(values))
        return out
