"""A hybrid model's recurrent-state slots in the scheduler (no JAX): one per running sequence,
taken at admission, given back with the pages on finish, abort and preemption; a sequence
waits while none is free; forked samples share no pages."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_harness import Harness, params, prompt_of, solo_tokens

from jengine.scheduling.state_slots import StateSlots


def _hybrid(**kw) -> Harness:
    h = Harness(**kw)
    h.scheduler.state_slots = StateSlots(3)  # slots 1 and 2; 0 is scratch
    return h


def test_a_sequence_waits_for_a_free_slot_and_reuses_a_freed_one():
    h = _hybrid(max_num_seqs=4)
    ignore = params(max_tokens=3, ignore_eos=True)
    a, = h.add("a", prompt_of(5), params(max_tokens=1, ignore_eos=True))
    b, = h.add("b", prompt_of(6, 1), ignore)
    c, = h.add("c", prompt_of(4, 2), ignore)
    batch = h.step()
    assert batch.seq_ids == [a.seq_id, b.seq_id]  # c: no slot left
    assert batch.state_slots.tolist() == [1, 2]
    assert a.state_slot is None and a.is_finished  # one token: done, slot 1 back
    batch = h.step()
    assert batch.seq_ids == [b.seq_id, c.seq_id]
    assert batch.state_slots.tolist() == [2, 1]
    h.run()
    assert h.scheduler.state_slots.num_free == 2
    assert h.result("c")[0][0] == solo_tokens(prompt_of(4, 2), 0, 3)


def test_abort_and_preemption_give_the_slot_back():
    h = _hybrid(num_pages=6, page_size=4, max_num_seqs=4)  # 5 usable pages
    ignore = params(max_tokens=10, ignore_eos=True)
    h.add("a", prompt_of(8), ignore)
    h.add("b", prompt_of(8, 1), ignore)
    h.step()
    h.scheduler.abort("a")
    assert h.scheduler.state_slots.num_free == 1
    h.add("c", prompt_of(8, 2), ignore)
    h.run()  # b and c each grow to 5 pages of the 5: one is preempted and recomputed
    assert h.scheduler.num_preemptions > 0
    assert h.scheduler.state_slots.num_free == 2
    assert h.result("c")[0][0] == solo_tokens(prompt_of(8, 2), 0, 10)


def test_forked_samples_prefill_the_whole_prompt():
    h = _hybrid(max_num_seqs=4)
    h.add("a", prompt_of(9), params(max_tokens=2, n=2, ignore_eos=True))
    first = h.step()
    second = h.step()
    fork = [i for i, s in enumerate(second.seq_ids) if s not in first.seq_ids]
    assert second.positions[second.cu_q_lens[fork[0]]] == 0  # from the start: no shared pages
    assert np.all(second.state_slots > 0)


def test_slot_bookkeeping_errors():
    slots = StateSlots(2)
    assert slots.allocate() == 1
    with pytest.raises(RuntimeError):
        slots.allocate()
    slots.free(1)
    with pytest.raises(ValueError):
        slots.free(1)
    with pytest.raises(ValueError):
        StateSlots(1)
