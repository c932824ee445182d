"""Host-side KV page allocator with reference counts.

Pages are shared by reference between holders: the sequences whose page tables list them (the
prompt pages of `n` > 1 samples, prefix-cache hits) and the prefix cache itself
(`jengine.scheduling.prefix_cache`), which keeps one reference on every page in its tree. A page
returns to the free list when its last holder lets go. Pages held by the cache alone are
*evictable*: they still hold reusable K/V, and the cache gives them up when the free list runs
short. Page 0 is reserved as the scratch page that padding tokens write into, so it is never
handed out.
"""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    """Raised by `allocate` when fewer pages are free than asked for."""


class PageAllocator:
    """Allocates, shares and frees pages `1..num_pages-1` of the KV cache."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("the KV cache needs at least 2 pages (page 0 is scratch)")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._cached = [False] * num_pages  # the prefix cache holds a reference
        self._num_evictable = 0  # cached pages nobody else holds

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages held by anyone, the prefix cache included."""
        return self.num_pages - 1 - len(self._free)

    @property
    def num_evictable(self) -> int:
        """Pages only the prefix cache holds: reusable K/V that eviction can turn into free."""
        return self._num_evictable

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_cached(self, page: int) -> bool:
        return self._cached[page]

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Adds a holder to pages that are already allocated."""
        for p in pages:
            if self._refcount[p] <= 0:
                raise ValueError(f"cannot share free page {p}")
            self._refcount[p] += 1
            if self._cached[p] and self._refcount[p] == 2:
                self._num_evictable -= 1

    def free(self, pages: list[int]) -> None:
        """Drops one holder from each page; pages nobody holds go back to the free list."""
        for p in pages:
            if self._refcount[p] <= 0:
                raise ValueError(f"double free of page {p}")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._cached[p] = False
                self._free.append(p)
            elif self._cached[p] and self._refcount[p] == 1:
                self._num_evictable += 1

    def cache_hold(self, pages: list[int]) -> None:
        """The prefix cache takes its one reference on pages a sequence holds."""
        for p in pages:
            if self._cached[p]:
                raise ValueError(f"page {p} is cached already")
            if self._refcount[p] <= 0:
                raise ValueError(f"cannot cache free page {p}")
            self._cached[p] = True
            self._refcount[p] += 1

    def cache_drop(self, pages: list[int]) -> None:
        """The prefix cache lets go of evictable pages (held by nobody else): they become free."""
        for p in pages:
            if not self._cached[p] or self._refcount[p] != 1:
                raise ValueError(f"page {p} is not evictable")
            self._num_evictable -= 1
            self.free([p])

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)
