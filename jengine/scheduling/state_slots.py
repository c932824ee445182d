"""`StateSlots`: the recurrent-state slots of a hybrid model's running sequences (host-side).

A Gated DeltaNet layer keeps a fixed-size state per sequence (`KVCache.conv` / `.ssm`, N slots
on the device) instead of pages that grow with it. A sequence takes a slot when it is admitted
to run and gives it back when it finishes or is preempted; a preempted sequence recomputes from
position 0, where the model starts its state from zeros, so a slot never needs clearing. Slot
0 is the scratch slot padding rows read and write, as page 0 is the scratch page.
"""

from __future__ import annotations


class StateSlots:
    """A free list of slots 1..num_slots - 1 (slot 0: scratch)."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"{num_slots} state slots leave none beside the scratch slot")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))  # pop() hands out 1 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot.

        Raises:
          RuntimeError: none is free (the scheduler checks `num_free` first).
        """
        if not self._free:
            raise RuntimeError("no free recurrent-state slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 < slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not in use")
        self._free.append(slot)
