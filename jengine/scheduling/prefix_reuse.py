"""How sequences use the prefix cache: an admitted sequence takes the cached pages of its
longest cached prefix (`reuse_cached`), waits a step rather than compute a page another chunk
of this step fills (`prefix_in_flight`), and puts each page it fills into the cache the step it
fills it (`cache_pages`), reading its own copy all the same. The cache itself
(`prefix_cache.py`) knows tokens and pages only."""

from __future__ import annotations

from jengine.scheduling.prefix_cache import PrefixCache
from jengine.scheduling.sequence import PENDING, Sequence


def reuse_cached(cache: PrefixCache | None, seq: Sequence) -> int | None:
    """Gives a sequence that holds no pages yet the cached pages of its longest cached
    prefix, leaving at least its last token to compute (it must be sampled from). Returns
    the tokens reused, or None when the cache is not consulted. Requests for prompt
    logprobs compute every prompt token, so they never reuse pages."""
    if cache is None or seq.pages or seq.params.prompt_logprobs is not None:
        return None
    ps = cache.allocator.page_size
    max_pages = (seq.num_tokens - 1) // ps
    pages = cache.match(seq.cache_tokens(0, max_pages * ps), max_pages, adapter=seq.lora_id)
    if pages:
        cache.allocator.share(pages)
        seq.pages = pages
        seq.num_cached_pages = len(pages)
        seq.num_computed = len(pages) * ps
    return seq.num_computed


def chunk_limit(cache: PrefixCache | None, seq: Sequence, budget: int) -> int:
    """The tokens `seq` computes this step, at most `budget`. A seeded request's prefill chunk
    stops at the start of its last page, which `reuse_cached` would leave to compute on a full
    hit, so that page is always computed in a step of its own: its rows then meet the same
    kernels and keys on a cold cache as on a warm one, and one seed gives one output whatever
    the cache held (a 40-row chunk and the 8 rows a hit leaves take other kernel paths, whose
    sums part in the last bits). It costs a step on a cold prompt longer than a page (TTFT
    1.2-1.8x, docs/engine.md), so only requests that ask to be reproduced (`seed`) pay it."""
    n = min(seq.num_uncomputed, budget)
    if cache is None or seq.params.seed is None or seq.params.prompt_logprobs is not None:
        return n
    last_page = (seq.num_tokens - 1) // cache.allocator.page_size * cache.allocator.page_size
    if seq.num_computed < last_page:
        n = min(n, last_page - seq.num_computed)
    return n


def prefix_in_flight(seq: Sequence, chosen: list[tuple[Sequence, int]], ps: int) -> bool:
    """Whether a prefill chunk chosen this step fills the first page `seq` could reuse but
    has not found cached (same tokens up to that page's end, under the same LoRA adapter)."""
    have = seq.num_computed // ps
    if have >= (seq.num_tokens - 1) // ps:
        return False  # its remaining pages are its own to compute
    end = (have + 1) * ps
    tokens = seq.cache_tokens(0, end)
    return any(n > 1 and other.lora_id == seq.lora_id and other.num_computed + n >= end
               and other.cache_tokens(0, end) == tokens for other, n in chosen)


def count_lookup(cache: PrefixCache, seq: Sequence, hit: int) -> None:
    """Adds one admission's lookup to the cache's counters."""
    stats = cache.stats
    stats.queries += 1
    stats.query_tokens += seq.num_tokens
    stats.hit_tokens += hit
    if seq.num_preemptions == 0:
        seq.num_cached_tokens = hit


def cache_pages(cache: PrefixCache, seq: Sequence) -> None:
    """Puts the sequence's computed full pages into the prefix cache, the step it fills each.
    The sequence keeps its own pages: where the tree held another copy that a running sequence
    holds, it caches none of its later pages (`PrefixCache.insert` says why)."""
    ps, known = cache.allocator.page_size, seq.num_cached_pages
    full = seq.num_computed // ps
    if seq.own_pages_from is not None or full <= known:
        return
    tokens = seq.cache_tokens(0, full * ps)
    if PENDING in tokens[known * ps:]:  # cannot happen: a PENDING token is never computed
        raise RuntimeError(f"sequence {seq.seq_id} has a computed PENDING token")
    seq.num_cached_pages = cache.insert(tokens, seq.pages[:full], known, adapter=seq.lora_id)
    if seq.num_cached_pages < full:
        seq.own_pages_from = seq.num_cached_pages
