"""Context managers that run part of a test with a real engine on another KV page pool or prefix
cache, then put the engine's own back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jengine.scheduling.page_allocator import PageAllocator
from jengine.scheduling.prefix_cache import PrefixCache


@contextlib.contextmanager
def _swapped(core, allocator: PageAllocator, cache: PrefixCache | None) -> Iterator[None]:
    """The engine's own prefix cache is emptied first: another pool reuses the device cache's
    pages, so its contents are about to be overwritten."""
    saved = core.allocator, core.prefix_cache
    if saved[1] is not None:
        saved[1].clear()
    core.allocator = core.scheduler.allocator = allocator
    core.prefix_cache = core.scheduler.prefix_cache = cache
    try:
        yield
    finally:
        if cache is not None:
            cache.clear()
        core.allocator = core.scheduler.allocator = saved[0]
        core.prefix_cache = core.scheduler.prefix_cache = saved[1]


@contextlib.contextmanager
def small_kv_pool(core, num_pages: int) -> Iterator[PageAllocator]:
    """`num_pages` pages (to force preemption and eviction); prefix caching as the engine has it."""
    small = PageAllocator(num_pages, core.allocator.page_size)
    cache = core.prefix_cache
    with _swapped(core, small, PrefixCache(small, cache.snapshots) if cache is not None else None):
        yield small


@contextlib.contextmanager
def prefix_caching(core, on: bool) -> Iterator[PrefixCache | None]:
    """The prefix cache on (a fresh, empty one; a hybrid's with the engine's snapshot slots) or
    off."""
    snapshots = core.prefix_cache.snapshots if core.prefix_cache is not None else None
    cache = PrefixCache(core.allocator, snapshots) if on else None
    with _swapped(core, core.allocator, cache):
        yield cache
