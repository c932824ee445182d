"""Tests for jengine.scheduling.page_allocator: allocation, sharing by reference count,
freeing, accounting."""

from __future__ import annotations

import random

import pytest

from jengine.scheduling.page_allocator import OutOfPagesError, PageAllocator


def _check_accounting(alloc: PageAllocator) -> None:
    """Free + used always covers pages 1..num_pages-1 exactly, and refcounts agree with it."""
    assert alloc.num_free + alloc.num_used == alloc.num_pages - 1
    held = [p for p in range(alloc.num_pages) if alloc.refcount(p) > 0]
    assert len(held) == alloc.num_used
    assert alloc.refcount(0) == 0


def test_rejects_a_pool_without_room_beyond_the_scratch_page():
    with pytest.raises(ValueError):
        PageAllocator(1, 4)
    PageAllocator(2, 4)  # the smallest valid pool: one usable page


def test_fresh_pool_has_every_page_but_zero_free():
    alloc = PageAllocator(9, 4)
    assert alloc.num_free == 8
    assert alloc.num_used == 0
    _check_accounting(alloc)


def test_allocate_hands_out_distinct_pages_never_zero_with_refcount_one():
    alloc = PageAllocator(9, 4)
    pages = alloc.allocate(3) + alloc.allocate(5)
    assert sorted(pages) == list(range(1, 9))
    assert all(alloc.refcount(p) == 1 for p in pages)
    assert alloc.num_free == 0 and alloc.num_used == 8
    _check_accounting(alloc)


def test_allocate_zero_pages_is_a_no_op():
    alloc = PageAllocator(5, 4)
    assert alloc.allocate(0) == []
    assert alloc.num_used == 0


def test_out_of_pages_raises_and_changes_nothing():
    alloc = PageAllocator(5, 4)
    held = alloc.allocate(3)
    assert alloc.can_allocate(1) and not alloc.can_allocate(2)
    with pytest.raises(OutOfPagesError):
        alloc.allocate(2)
    assert alloc.num_used == 3 and alloc.num_free == 1
    assert all(alloc.refcount(p) == 1 for p in held)
    [last] = alloc.allocate(1)
    assert last not in held and last != 0
    with pytest.raises(OutOfPagesError):
        alloc.allocate(1)
    _check_accounting(alloc)


def test_out_of_pages_error_is_a_runtime_error():
    assert issubclass(OutOfPagesError, RuntimeError)


def test_freed_pages_are_reused():
    alloc = PageAllocator(4, 4)
    first = alloc.allocate(3)
    alloc.free(first[1:2])
    assert alloc.num_free == 1
    assert alloc.allocate(1) == first[1:2]
    _check_accounting(alloc)


def test_share_counts_holders_and_the_page_returns_only_after_the_last_free():
    alloc = PageAllocator(6, 4)
    pages = alloc.allocate(2)
    alloc.share(pages)
    alloc.share(pages[:1])
    assert [alloc.refcount(p) for p in pages] == [3, 2]
    assert alloc.num_used == 2  # sharing allocates nothing
    alloc.free(pages)
    assert [alloc.refcount(p) for p in pages] == [2, 1]
    assert alloc.num_used == 2
    alloc.free(pages)
    assert [alloc.refcount(p) for p in pages] == [1, 0]
    assert alloc.num_used == 1 and alloc.num_free == 4
    alloc.free(pages[:1])
    assert alloc.num_used == 0
    _check_accounting(alloc)


def test_a_shared_page_is_not_handed_out_again_while_held():
    alloc = PageAllocator(3, 4)
    [page, other] = alloc.allocate(2)
    alloc.share([page])
    alloc.free([page])  # one holder left
    alloc.free([other])
    assert alloc.allocate(1) == [other]
    with pytest.raises(OutOfPagesError):
        alloc.allocate(1)


def test_double_free_raises():
    alloc = PageAllocator(5, 4)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages[:1])
    _check_accounting(alloc)


def test_freeing_a_never_allocated_page_raises():
    alloc = PageAllocator(5, 4)
    with pytest.raises(ValueError):
        alloc.free([3])
    with pytest.raises(ValueError):
        alloc.free([0])  # the scratch page is never held
    assert alloc.num_free == 4


def test_sharing_a_free_page_raises():
    alloc = PageAllocator(5, 4)
    with pytest.raises(ValueError, match="free page"):
        alloc.share([2])
    [page] = alloc.allocate(1)
    alloc.free([page])
    with pytest.raises(ValueError):
        alloc.share([page])
    with pytest.raises(ValueError):
        alloc.share([0])
    assert alloc.num_used == 0


@pytest.mark.parametrize(
    ("num_tokens", "pages"), [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)]
)
def test_pages_for_rounds_up(num_tokens, pages):
    assert PageAllocator(4, 4).pages_for(num_tokens) == pages


def test_random_operations_keep_refcounts_and_accounting_exact():
    """A model of who holds which page, checked against the allocator after every operation."""
    rng = random.Random(0)
    alloc = PageAllocator(17, 4)
    holders: list[list[int]] = []  # each holder's pages; a page may appear in several holders
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(0, 5)
            if alloc.can_allocate(n):
                pages = alloc.allocate(n)
                assert 0 not in pages
                assert all(not any(p in h for h in holders) for p in pages)
                holders.append(pages)
            else:
                with pytest.raises(OutOfPagesError):
                    alloc.allocate(n)
        elif op < 0.6 and holders:
            src = rng.choice(holders)
            shared = src[: rng.randint(0, len(src))]
            alloc.share(shared)
            holders.append(list(shared))
        elif holders:
            alloc.free(holders.pop(rng.randrange(len(holders))))
        for p in range(1, alloc.num_pages):
            assert alloc.refcount(p) == sum(h.count(p) for h in holders)
        _check_accounting(alloc)
    for h in holders:
        alloc.free(h)
    assert alloc.num_used == 0 and alloc.num_free == 16
