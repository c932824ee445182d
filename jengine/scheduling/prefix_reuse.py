"""How sequences use the prefix cache: an admitted sequence takes the cached pages of its
longest cached prefix (`reuse_cached`), waits a step rather than compute a page another chunk
of this step fills (`prefix_in_flight`), and puts each page it fills into the cache the step it
fills it (`cache_pages`), reading its own copy all the same. The cache itself
(`prefix_cache.py`) knows tokens and pages only.

A hybrid model's cache (`PrefixCache.snapshots`) also needs the recurrent state after a page
to resume there: a hit is cut back to the deepest matched page with a snapshot, which is
copied into the sequence's state slot (`StateCopies.into`); prefill chunks end on page
boundaries where they can (`chunk_limit`), and each that does leaves a snapshot for the page
it filled (`plan_snapshots`, `settle_snapshot`)."""

from __future__ import annotations

from jengine.scheduling.prefix_cache import PrefixCache
from jengine.scheduling.sequence import PENDING, Sequence
from jengine.scheduling.state_snapshots import MAX_COPIES, StateCopies


def reuse_cached(cache: PrefixCache | None, seq: Sequence, copies: StateCopies | None = None
                 ) -> int | None:
    """Gives a sequence that holds no pages yet the cached pages of its longest cached
    prefix, leaving at least its last token to compute (it must be sampled from). Returns
    the tokens reused, or None when the cache is not consulted. Requests for prompt
    logprobs compute every prompt token, so they never reuse pages. With snapshots (a
    hybrid model) the prefix ends at the deepest page with one, and `seq.resume_from` names
    it; none is reused when this step's `copies` have no room for its copy."""
    if cache is None or seq.pages or seq.params.prompt_logprobs is not None:
        return None
    ps = cache.allocator.page_size
    max_pages = (seq.num_tokens - 1) // ps
    if cache.snapshots is not None and copies is not None and len(copies.into) >= MAX_COPIES:
        max_pages = 0
    pages = cache.match(seq.cache_tokens(0, max_pages * ps), max_pages, adapter=seq.lora_id)
    if cache.snapshots is not None:
        depth, seq.resume_from = cache.snapshots.deepest(pages)
        seq.snapshot_cut = len(pages) * ps if depth < len(pages) else None
        pages = pages[:depth]
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
    1.2-1.8x, docs/engine.md), so only requests that ask to be reproduced (`seed`) pay it.
    A hybrid's chunks (state snapshots) stop there too, and where a cached match without a
    snapshot ended (`seq.snapshot_cut`), and end on page boundaries where they can."""
    n = min(seq.num_uncomputed, budget)
    if seq.snapshot_cut is not None and seq.snapshot_cut <= seq.num_computed:
        seq.snapshot_cut = None
    if cache is None or seq.params.prompt_logprobs is not None:
        return n
    if seq.params.seed is None and cache.snapshots is None:
        return n
    ps = cache.allocator.page_size
    last_page = (seq.num_tokens - 1) // ps * ps
    if cache.snapshots is not None and (seq.snapshot_cut or 0) > seq.num_computed:
        last_page = seq.snapshot_cut  # where its cached match ended: snapshot it for the next
    if seq.num_computed < last_page:
        n = min(n, last_page - seq.num_computed)
        if cache.snapshots is not None:
            # A hybrid's chunk ends on a page boundary where it can, so that its state there
            # is snapshotted (the last full page of a prompt always is, by the cut above).
            aligned = (seq.num_computed + n) // ps * ps - seq.num_computed
            n = aligned if aligned > 0 else n
    return n


def plan_snapshots(cache: PrefixCache | None, chosen: list[tuple[Sequence, int]],
                   copies: StateCopies) -> None:
    """Reserves a snapshot for each chosen prefill chunk that ends on a page boundary inside
    its prompt (up to `MAX_COPIES`): the step copies the sequence's state there after its
    forward (`copies.out`), and `settle_snapshot` gives it to the page."""
    if cache is None or cache.snapshots is None:
        return
    ps = cache.allocator.page_size
    for seq, n in chosen:
        end = seq.num_computed + n
        if len(copies.out) >= MAX_COPIES:
            return
        if (seq.state_slot is None or n < 1 or end % ps or end > len(seq.prompt_ids)
                or seq.own_pages_from is not None):
            continue
        seq.snapshot_to = cache.snapshots.reserve()
        copies.out.append((seq.state_slot, seq.snapshot_to))


def settle_snapshot(cache: PrefixCache, seq: Sequence) -> None:
    """After the step's `advance` (its pages cached): the page the chunk filled owns the
    snapshot the step took, if that page went into the cache; else the slot is free again."""
    if seq.snapshot_to is None:
        return
    slot, seq.snapshot_to = seq.snapshot_to, None
    page = seq.num_computed // cache.allocator.page_size - 1
    if not seq.is_finished and 0 <= page < seq.num_cached_pages:
        cache.snapshots.attach(seq.pages[page], slot)
    else:
        cache.snapshots.release(slot)


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
