"""`StateSnapshots`: prefix-cache snapshots of a hybrid model's recurrent state (host-side).

A cached KV page of a hybrid model (Qwen3.5, the Mamba2 hybrids) holds the attention layers'
K/V but not the linear layers' state after its tokens, so a page hit alone cannot resume. A
snapshot is a copy of one sequence's state (every `KVCache` state leaf, `conv` and `ssm`, at
one slot) taken right after a prefill chunk that ends on a page boundary; it belongs to the
cached page that ends there (keyed by page id: a page in the radix tree stands for exactly one
prefix) and goes when the tree drops that page. A sequence whose prompt matches k cached pages
resumes after the deepest of them that has a snapshot: the snapshot is copied into its own
state slot before the step's forward, and it prefills the rest.

The snapshots live in extra slots of the same state arrays, after the running sequences'
(`first` .. `first + count - 1`), so copies are slot-to-slot on the device (`StateCopies`).
When every snapshot slot is taken, the least recently used snapshot gives way (its page stays
cached; only a resume from it is lost). A step carries at most `MAX_COPIES` copies in and
`MAX_COPIES` out, so the device copies a fixed, small number of slots per step.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

MAX_COPIES = 4  # state copies into, and out of, the sequences' slots per step (each way)


@dataclasses.dataclass
class StateCopies:
    """One step's slot-to-slot copies of the recurrent state, (source, destination) pairs:
    `into` before the forward (snapshot -> a resuming sequence's slot), `out` after it (a
    sequence's slot -> a fresh snapshot). Unused pairs are (0, 0): the scratch slot onto
    itself."""

    into: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    out: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def array(self) -> np.ndarray:
        """[2 (into, out), 2 (source, destination), MAX_COPIES] int32, padded with 0."""
        a = np.zeros((2, 2, MAX_COPIES), np.int32)
        for i, pairs in enumerate((self.into, self.out)):
            if pairs:
                a[i, :, :len(pairs)] = np.asarray(pairs, np.int32).T
        return a


class StateSnapshots:
    """The snapshot slots: which cached page owns which, the free ones, and their LRU order."""

    def __init__(self, first: int, count: int):
        """Slots `first` .. `first + count - 1` of the state arrays hold snapshots."""
        if count < 1:
            raise ValueError(f"{count} snapshot slots: prefix caching needs at least one")
        self.first, self.count = first, count
        self._free = list(range(first + count - 1, first - 1, -1))
        self._of_page: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Snapshots that cached pages own."""
        return len(self._of_page)

    def deepest(self, pages: list[int]) -> tuple[int, int | None]:
        """(j, slot): the most leading pages of `pages` (a cached prefix, in order) that end in
        a snapshot, and that snapshot's slot, marked recently used; (0, None) without any."""
        for j in range(len(pages), 0, -1):
            slot = self._of_page.get(pages[j - 1])
            if slot is not None:
                self._of_page.move_to_end(pages[j - 1])
                return j, slot
        return 0, None

    def reserve(self) -> int:
        """A slot for a snapshot taken this step, from the free ones, else the least recently
        used snapshot's (safe: steps run in order on the device, so a copy out of it that an
        earlier step does has happened by then, and a copy in this step comes before)."""
        if not self._free:
            _, slot = self._of_page.popitem(last=False)
            return slot
        return self._free.pop()

    def attach(self, page: int, slot: int) -> None:
        """`page` (in the prefix cache now) owns the snapshot at `slot`; a page that owns one
        already keeps its own and `slot` is freed."""
        if page in self._of_page:
            self.release(slot)
        else:
            self._of_page[page] = slot

    def release(self, slot: int) -> None:
        """Gives back a reserved slot that no page took."""
        if not self.first <= slot < self.first + self.count or slot in self._free:
            raise ValueError(f"snapshot slot {slot} is not reserved")
        self._free.append(slot)

    def dropped(self, pages: list[int]) -> None:
        """The prefix cache let go of `pages`: their snapshots are freed."""
        for page in pages:
            slot = self._of_page.pop(page, None)
            if slot is not None:
                self._free.append(slot)

    def moved(self, old: int, new: int) -> None:
        """The prefix cache put page `new` in place of `old` (same tokens): the snapshot
        follows."""
        slot = self._of_page.pop(old, None)
        if slot is not None:
            self.attach(new, slot)
