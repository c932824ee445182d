"""Tests for jengine.scheduling.prefix_cache: the radix tree alone, with a page allocator and no
scheduler (tests/scheduling/test_prefix_reuse.py has it under the scheduler)."""

from __future__ import annotations

import pytest

from jengine.scheduling.page_allocator import PageAllocator
from jengine.scheduling.prefix_cache import PrefixCache, PrefixCacheStats

PS = 4  # page size of the unit tests


def cache_with(num_pages: int = 32) -> tuple[PageAllocator, PrefixCache]:
    alloc = PageAllocator(num_pages, PS)
    return alloc, PrefixCache(alloc)


def computed(alloc: PageAllocator, cache: PrefixCache, tokens: list[int]) -> list[int]:
    """What a sequence does: takes the cached pages of its prefix, allocates pages for the rest
    of `tokens`, inserts the full ones, lets go. Returns its pages."""
    hit = cache.match(tokens)
    alloc.share(hit)
    pages = hit + alloc.allocate(len(tokens) // PS - len(hit))
    assert cache.insert(tokens, pages, len(hit)) == len(pages)
    alloc.free(pages)
    return pages


def test_insert_then_match_returns_the_pages_of_whole_pages_only():
    alloc, cache = cache_with()
    tokens = list(range(1, 11))  # 2 full pages + 2 tokens
    assert cache.match(tokens) == []
    pages = computed(alloc, cache, tokens[:8])
    assert cache.match(tokens) == pages
    assert cache.match(tokens[:7]) == pages[:1]  # the second page is not whole in 7 tokens
    assert cache.match(tokens, max_pages=1) == pages[:1]
    assert cache.match_length(tokens) == 8
    assert cache.match([99] + tokens[1:]) == []
    assert cache.num_pages == 2 and alloc.num_evictable == 2 and alloc.num_free == 29


def test_a_diverging_prefix_splits_the_edge_and_both_branches_match():
    alloc, cache = cache_with()
    a = list(range(1, 17))  # 4 pages
    b = a[:8] + [50, 51, 52, 53, 60, 61, 62, 63]  # shares 2 pages, then differs
    pa = computed(alloc, cache, a)
    pb = computed(alloc, cache, b)
    assert pb[:2] == pa[:2] and set(pb[2:]).isdisjoint(pa)
    assert cache.match(a) == pa and cache.match(b) == pb
    assert cache.match(b[:12] + [0, 0, 0, 0]) == pb[:3]
    assert cache._num_nodes == 3  # the shared 2 pages, and one edge per branch
    assert cache.num_pages == 6 == alloc.num_evictable


def test_pages_computed_again_take_the_place_of_a_copy_only_the_tree_holds():
    """The later copy is the one a running sequence reads (its own): it goes in, the tree's
    goes back to the free list."""
    alloc, cache = cache_with()
    tokens = list(range(1, 13))
    first = alloc.allocate(3)
    assert cache.insert(tokens, first) == 3
    alloc.free(first)  # its sequence finished: only the tree holds it
    second = alloc.allocate(3)
    assert cache.insert(tokens, second) == 3
    assert cache.match(tokens) == second and cache.stats.duplicate_pages == 3
    assert all(alloc.is_cached(p) for p in second) and alloc.num_evictable == 0
    alloc.free(second)
    assert alloc.num_free == 31 - 3 and alloc.num_evictable == 3 == cache.num_pages


def test_a_copy_someone_holds_stays_and_the_insertion_stops_there():
    """Nothing of the second sequence's goes in from its first duplicate page: a page of its
    own below the first's would hang below a page it does not hold."""
    alloc, cache = cache_with()
    tokens = list(range(1, 13))
    first = alloc.allocate(2)
    cache.insert(tokens[:8], first)  # a running sequence's
    second = alloc.allocate(3)
    assert cache.insert(tokens, second) == 0
    assert cache.match(tokens) == first and cache.stats.duplicate_pages == 1
    assert not any(alloc.is_cached(p) for p in second)
    assert cache.insert(tokens, first + second[2:], 2) == 3  # the first goes on: its third page
    alloc.free(first + second)
    assert alloc.num_free == 31 - 3 and alloc.num_evictable == 3 == cache.num_pages


def test_eviction_takes_the_least_recently_used_leaf_from_its_tail():
    alloc, cache = cache_with()
    shared = [1, 2, 3, 4] * 2
    old = computed(alloc, cache, shared + [5] * 8)
    new = computed(alloc, cache, shared + [6] * 8)
    assert cache.evict(1) == 1
    assert cache.match(shared + [5] * 8) == old[:3]  # the old branch lost its last page
    assert cache.match(shared + [6] * 8) == new  # (this touches the new branch)
    assert cache.evict(2) == 2  # the old branch's remaining page, then the new branch's tail
    assert cache.match(shared + [5] * 8) == old[:2]
    assert cache.match(shared + [6] * 8) == new[:3]
    assert cache.stats.evicted_pages == 3
    assert alloc.num_free == 31 - 3


def test_leaves_go_before_their_parents():
    alloc, cache = cache_with()
    prefix = [1, 2, 3, 4] * 2
    a = computed(alloc, cache, prefix + [5] * 4)
    b = computed(alloc, cache, prefix + [6] * 4)
    cache.match(prefix)  # the shared pages are the most recently used, yet stay
    assert cache.evict(2) == 2
    assert cache.match(prefix + [5] * 4) == a[:2] and cache.match(prefix + [6] * 4) == b[:2]
    assert cache.evict(5) == 2 and cache.num_pages == 0 and alloc.num_free == 31


def test_pages_a_sequence_holds_are_never_evicted():
    alloc, cache = cache_with()
    tokens = list(range(1, 13))
    pages = alloc.allocate(3)
    cache.insert(tokens, pages)  # the sequence still holds them
    assert alloc.num_evictable == 0 and cache.evict(3) == 0 and cache.num_pages == 3
    alloc.free(pages[2:])  # e.g. a sharer that reused only the first two
    assert alloc.num_evictable == 1 and cache.evict(3) == 1
    alloc.free(pages[:2])
    assert cache.evict(3) == 2 and alloc.num_free == 31


def test_reset_drops_every_page_nobody_holds_and_zeroes_the_counters():
    alloc, cache = cache_with()
    computed(alloc, cache, list(range(1, 9)))  # two pages only the tree holds
    held = alloc.allocate(1)
    cache.insert([7] * PS, held)  # a running sequence's page
    cache.stats.queries, cache.stats.hit_tokens = 3, 8
    assert cache.evict(1) == 1 and cache.stats.evicted_pages == 1
    assert cache.reset() == 1  # the last page nobody holds
    assert cache.stats == PrefixCacheStats()
    assert cache.num_pages == 1 and cache.match([7] * PS) == held
    alloc.free(held)
    assert cache.reset() == 1 and cache.num_pages == 0 and alloc.num_free == 31


def test_allocator_counts_evictable_pages_through_share_and_free():
    alloc, cache = cache_with()
    pages = computed(alloc, cache, list(range(1, 9)))
    assert alloc.num_evictable == 2
    alloc.share(pages)
    assert alloc.num_evictable == 0 and alloc.num_used == 2
    alloc.free(pages[:1])
    assert alloc.num_evictable == 1
    with pytest.raises(ValueError):
        alloc.cache_hold(pages[:1])  # cached already
    with pytest.raises(ValueError):
        alloc.cache_drop(pages[1:])  # still held by a sequence
    alloc.free(pages[1:])
    alloc.cache_drop(pages)
    assert alloc.num_free == 31 and alloc.num_evictable == 0


def test_stale_leaf_entries_are_rebuilt_and_skipped():
    alloc, cache = cache_with(num_pages=8)
    tokens = list(range(1, 9))
    computed(alloc, cache, tokens)
    for _ in range(300):  # every touch pushes a heap entry; the heap is rebuilt when stale
        cache.match(tokens)
    assert len(cache._leaves) <= 2 * cache._num_nodes + 65
    assert cache.evict(2) == 2 and cache.num_pages == 0
