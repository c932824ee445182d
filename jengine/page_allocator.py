"""Host-side KV page allocator with reference counts.

Pages are shared by reference between sequences (the prompt pages of `n` > 1 samples, and later
prefix-cached pages); a page returns to the free list when its last holder lets go. Page 0 is
reserved as the scratch page that padding tokens write into, so it is never handed out.
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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

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

    def free(self, pages: list[int]) -> None:
        """Drops one holder from each page; pages nobody holds go back to the free list."""
        for p in pages:
            if self._refcount[p] <= 0:
                raise ValueError(f"double free of page {p}")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)
