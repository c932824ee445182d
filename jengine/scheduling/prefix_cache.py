"""`PrefixCache`: a radix tree over token ids that maps prompt prefixes to full KV pages.

Host-side and JAX-free, like the scheduler that drives it. The tree works at page granularity:
an edge holds whole pages, each keyed by its `page_size` tokens, and consecutive pages without a
branch share one edge (SGLang's RadixAttention, with vLLM's full-page blocks). Only full pages
whose K/V are computed go in; a request reuses the longest cached run of full pages of its
prompt and computes the rest, the partial last page included.

Ownership: the tree keeps one reference (`PageAllocator.cache_hold`) on each of its pages, so a
page outlives the requests that computed it. A sequence that reuses a page holds a reference of
its own. Every sequence holds a *root path* of the tree (pages 0..k-1 of its tokens, then pages
of its own), so a page that only the tree holds has no held page below it: every evictable page
can be evicted leaves first. `evict` does that, least recently used leaf first, trimming a leaf
edge from its tail until enough pages are free.

A sequence reads the pages it computed until it finishes, even where the tree has another copy
of the same tokens (computed by a sequence beside it, or by an earlier one whose prefill was
chunked otherwise): two copies hold the same K/V only up to the last bits, which depend on the
rows each was computed with (a prefill block's attention path rounds otherwise than a decode's
row path). Switching a decoding sequence onto the tree's copy changed its logits from the step
after the page filled, a step that depends on how its tokens were grouped into steps, so a
speculative verification crossing the page's end read one copy where plain decoding read the
other, and greedy text parted on near ties (docs/engine.md, "Session 23"). So `insert` puts
the caller's copy in the tree where the tree alone holds the other, and otherwise stops: the
sequence's later pages stay its own, out of the tree, which keeps the root-path invariant.

A hybrid model's cache also has `snapshots` (`state_snapshots.StateSnapshots`): the recurrent
state after some of its pages. They belong to their pages, so the tree tells them when a page
leaves it or another copy takes its place.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Sequence

from jengine.scheduling.page_allocator import PageAllocator
from jengine.scheduling.state_snapshots import StateSnapshots

PageKey = tuple[int, ...]  # the page_size token ids one page holds


@dataclasses.dataclass
class PrefixCacheStats:
    """Counters since start-up.

    Attributes:
      queries: lookups made when a sequence was admitted (preempted ones count again).
      query_tokens: tokens those lookups covered (the sequences' lengths).
      hit_tokens: tokens found in the cache (whole pages).
      evicted_pages: pages given up to make room.
      duplicate_pages: pages a sequence computed that the tree held already (for a sequence
        beside it, or an earlier one): work that a shared prefix did twice.
    """

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0
    duplicate_pages: int = 0


class _Node:
    """One edge of the tree: consecutive pages with the same descendants."""

    __slots__ = ("keys", "pages", "children", "parent", "last_access")

    def __init__(self, keys: list[PageKey], pages: list[int], parent: _Node | None):
        self.keys = keys  # [num_pages] token ids per page
        self.pages = pages  # [num_pages] KV page ids, in the same order
        self.children: dict[PageKey, _Node] = {}  # by the child's first key
        self.parent = parent
        self.last_access = 0


class PrefixCache:
    """Radix tree of cached full pages, with least-recently-used eviction of leaves."""

    def __init__(self, allocator: PageAllocator, snapshots: StateSnapshots | None = None):
        self.allocator = allocator
        self.snapshots = snapshots
        self.page_size = allocator.page_size
        self.stats = PrefixCacheStats()
        self._root = _Node([], [], None)
        self._clock = itertools.count(1)
        self._num_nodes = 0
        self._num_pages = 0
        # Lazy min-heap of (last access, tie-break, node) over leaves. An entry is stale once
        # the node is touched again, gains a child or leaves the tree; stale ones are skipped.
        self._leaves: list[tuple[int, int, _Node]] = []
        self._tie = itertools.count()

    @property
    def num_pages(self) -> int:
        """Pages in the tree (held by running sequences or evictable)."""
        return self._num_pages

    def page_key(self, tokens: Sequence[int], index: int, adapter: int = 0) -> PageKey:
        """The key of page `index` of `tokens`: its page_size token ids. Under a LoRA adapter
        (`adapter`: its id) the first page's key starts with -id (no token id is negative),
        so each adapter's prefixes hang below a root edge of their own: K/V computed under
        one adapter is never read under another or the base model."""
        ps = self.page_size
        key = tuple(tokens[index * ps:(index + 1) * ps])
        return (-adapter, *key) if adapter and index == 0 else key

    # -- lookup -------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], max_pages: int | None = None, *,
              adapter: int = 0) -> list[int]:
        """The cached pages of the longest run of full pages that starts `tokens` (at most
        `max_pages`) under LoRA adapter `adapter` (0: the base model), marking them recently
        used. The caller shares them before using them."""
        num_pages = len(tokens) // self.page_size
        if max_pages is not None:
            num_pages = min(num_pages, max_pages)
        now = next(self._clock)
        pages: list[int] = []
        for node, matched in self._walk(tokens, num_pages, adapter=adapter):
            pages += node.pages[:matched]
            self._touch(node, now)
        return pages

    def match_length(self, tokens: Sequence[int]) -> int:
        """Tokens of `tokens` that `match` would find, without marking anything (for routing)."""
        walk = self._walk(tokens, len(tokens) // self.page_size)
        return sum(matched for _, matched in walk) * self.page_size

    def _walk(self, tokens: Sequence[int], num_pages: int, num_known: int = 0,
              adapter: int = 0):
        """Yields (node, how many pages of its edge match) along the path the first `num_pages`
        pages of `tokens` follow. The first `num_known` pages are known to be on the path (a
        sequence's cached pages), so only the keys of edges' first pages are built for them."""
        node, i = self._root, 0
        while i < num_pages:
            child = node.children.get(self.page_key(tokens, i, adapter))
            if child is None:
                return
            limit = min(len(child.keys), num_pages - i)
            matched = max(1, min(num_known - i, limit))  # the lookup matched page i already
            while matched < limit and child.keys[matched] == self.page_key(tokens, i + matched):
                matched += 1
            yield child, matched
            i += matched
            if matched < len(child.keys):
                return
            node = child

    # -- insertion ----------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], pages: list[int], num_known: int = 0, *,
               adapter: int = 0) -> int:
        """Adds the full pages `pages` holding `tokens` (`len(pages)` pages' worth) to the tree.
        `num_known`: how many leading pages are already the tree's (they are not compared).

        Where the tree holds another page for the same tokens, the caller computed them twice
        (counted in `stats.duplicate_pages`): a copy only the tree holds is freed and the
        caller's takes its place; a copy someone else holds stays, and the insertion stops
        there, so that no page of the caller's hangs below a page it does not hold. Returns how
        many leading pages of `pages` are the tree's now (all of them unless it stopped)."""
        now = next(self._clock)
        node, i = self._root, 0
        for child, matched in self._walk(tokens, len(pages), num_known, adapter):
            for j in range(max(0, num_known - i), matched):
                theirs, ours = child.pages[j], pages[i + j]
                if theirs == ours:
                    continue
                self.stats.duplicate_pages += 1
                if self.allocator.refcount(theirs) > 1:
                    self._touch(child, now)
                    return i + j
                self.allocator.cache_hold([ours])
                self.allocator.cache_drop([theirs])
                child.pages[j] = ours
                if self.snapshots is not None:
                    self.snapshots.moved(theirs, ours)
            i += matched
            self._touch(child, now)
            node = child
            if matched < len(child.keys):  # the path leaves this edge (or ends inside it)
                if i < len(pages):
                    node = self._split(child, matched)
                break
        if i < len(pages):
            keys = [self.page_key(tokens, k, adapter) for k in range(i, len(pages))]
            self._add_leaf(node, keys, pages[i:], now)
        return len(pages)

    def _add_leaf(self, parent: _Node, keys: list[PageKey], pages: list[int], now: int) -> None:
        self.allocator.cache_hold(pages)
        leaf = _Node(list(keys), list(pages), parent)
        parent.children[keys[0]] = leaf
        self._num_nodes += 1
        self._num_pages += len(pages)
        self._touch(leaf, now)

    def _split(self, node: _Node, at: int) -> _Node:
        """Cuts `node`'s edge after `at` pages; returns the new upper part (the parent of the
        lower part, which keeps `node`'s children)."""
        upper = _Node(node.keys[:at], node.pages[:at], node.parent)
        upper.last_access = node.last_access
        node.parent.children[upper.keys[0]] = upper
        node.keys, node.pages = node.keys[at:], node.pages[at:]
        node.parent = upper
        upper.children[node.keys[0]] = node
        self._num_nodes += 1
        return upper

    def _touch(self, node: _Node, now: int) -> None:
        node.last_access = now
        if not node.children:
            self._push_leaf(node)

    def _push_leaf(self, node: _Node) -> None:
        if len(self._leaves) > 2 * self._num_nodes + 64:  # mostly stale: rebuild
            self._leaves = [(n.last_access, next(self._tie), n) for n in self._iter_nodes()
                            if not n.children]
            heapq.heapify(self._leaves)
        heapq.heappush(self._leaves, (node.last_access, next(self._tie), node))

    def _iter_nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -- eviction -----------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Frees up to `num_pages` evictable pages, least recently used leaves first, each leaf
        from its last page back. Returns how many it freed."""
        freed = 0
        keep: list[tuple[int, int, _Node]] = []  # leaves still in use, or not used up
        while freed < num_pages and self._leaves:
            entry = heapq.heappop(self._leaves)
            when, _, node = entry
            if node.parent is None or node.children or when != node.last_access:
                continue  # stale
            first_key, cut = node.keys[0], len(node.pages)
            refcount = self.allocator.refcount
            while cut > 0 and freed < num_pages and refcount(node.pages[cut - 1]) == 1:
                cut -= 1
                freed += 1
            dropped = node.pages[cut:]
            if dropped:
                self.allocator.cache_drop(dropped)
                if self.snapshots is not None:
                    self.snapshots.dropped(dropped)
                self._num_pages -= len(dropped)
                self.stats.evicted_pages += len(dropped)
                del node.keys[cut:], node.pages[cut:]
            if cut:
                keep.append(entry)
                continue
            parent = node.parent
            del parent.children[first_key]
            node.parent = None
            self._num_nodes -= 1
            if parent is not self._root and not parent.children:
                self._push_leaf(parent)
        for entry in keep:
            heapq.heappush(self._leaves, entry)
        return freed

    def clear(self) -> int:
        """Evicts every evictable page; returns how many."""
        return self.evict(self.allocator.num_evictable)

    def reset(self) -> int:
        """`clear`, and the counters back to zero: as if nothing had been cached (pages that
        running sequences hold stay). Returns the pages freed."""
        freed = self.clear()
        self.stats = PrefixCacheStats()
        return freed
