"""n > 1: the leader's prompt pages shared by its samples, forks under preemption and a short
pool, no deadlock; the fake runner of `tests/scheduler_harness.py`."""

from __future__ import annotations

import pytest
from scheduler_harness import (  # tests/ is on sys.path under pytest
    EOS,
    Harness,
    params,
    prompt_of,
    rows,
    solo_result,
    solo_tokens,
)


@pytest.mark.parametrize("prompt_len", [11, 12, 3, 1])
def test_siblings_share_the_leaders_full_prompt_pages(prompt_len):
    page_size, n, seed = 4, 3, 10
    h = Harness(page_size=page_size, max_num_batched_tokens=32)
    prompt = prompt_of(prompt_len)
    seqs = h.add("a", prompt, params(n=n, max_tokens=5, ignore_eos=True), seed=seed)
    leader, siblings = seqs[0], seqs[1:]
    num_shared = (prompt_len - 1) // page_size  # pages full of prompt, the last token excluded
    first = h.step()
    assert first.seq_ids == [leader.seq_id]  # the leader prefills alone
    assert h.allocator.num_used == h.allocator.pages_for(prompt_len)  # once, for everyone
    shared = leader.pages[:num_shared]
    assert all(h.allocator.refcount(p) == n for p in shared)
    assert all(h.allocator.refcount(p) == 1 for p in leader.pages[num_shared:])
    for s in siblings:
        assert s.pages == shared and s.num_computed == num_shared * page_size
    second = h.step()
    assert rows(second)[1:] == [
        (s.seq_id, num_shared * page_size, prompt_len - num_shared * page_size, True)
        for s in siblings
    ]
    # Each sibling adds pages only past the shared ones.
    assert h.allocator.num_used == h.allocator.pages_for(prompt_len + 1) + (n - 1) * (
        h.allocator.pages_for(prompt_len) - num_shared
    )
    h.run()
    outs = [s.output_ids for s in seqs]
    for i, s in enumerate(seqs):
        # Sample i equals an n=1 request with seed + i: its context is exactly the prompt.
        assert outs[i] == solo_tokens(prompt, seed + i, 5)
        assert s.finish_reason == "length"
    assert len({tuple(o) for o in outs}) == n
    assert h.allocator.num_used == 0


def test_leader_that_stops_on_its_first_token_still_forks():
    h = Harness(page_size=4)
    prompt = prompt_of(9)
    seed = next(s for s in range(1000) if solo_tokens(prompt, s, 1) == [EOS])
    seqs = h.add("a", prompt, params(n=2, max_tokens=4), seed=seed)
    h.step()
    assert seqs[0].finish_reason == "stop" and seqs[0].output_ids == [EOS]
    assert seqs[0].pages == [] and seqs[1].pages  # the sibling still holds the shared page
    h.run()
    assert seqs[1].output_ids == solo_tokens(prompt, seed + 1, len(seqs[1].output_ids))
    assert h.allocator.num_used == 0


def test_n_greater_than_one_under_preemption_matches_solo():
    page_size, max_model_len = 4, 32
    h = Harness(num_pages=10, page_size=page_size, max_model_len=max_model_len)
    specs = {"a": (prompt_of(10), params(n=3, max_tokens=14, ignore_eos=True), 1),
             "b": (prompt_of(7, 1), params(n=2, max_tokens=18, ignore_eos=True), 2)}
    for rid, spec in specs.items():
        h.add(rid, *spec)
    h.run()
    assert h.scheduler.num_preemptions > 0
    for rid, spec in specs.items():
        assert h.result(rid) == solo_result(rid, *spec, page_size=page_size,
                                            max_model_len=max_model_len)
    assert h.allocator.num_used == 0


def test_waiting_forks_holding_shared_pages_do_not_deadlock():
    """Regression: a fork sibling waiting behind the queue's head held the pages the head
    needed, nothing ran, and `schedule()` returned None forever with work left."""
    kw = {"page_size": 4, "max_model_len": 16}
    h = Harness(num_pages=6, max_num_seqs=3, max_num_batched_tokens=12, **kw)
    specs = {"r0": (prompt_of(13), params(n=2, max_tokens=1, ignore_eos=True), 0),
             "r1": (prompt_of(3, 1), params(n=3, max_tokens=8, ignore_eos=True), 0)}
    for rid, spec in specs.items():
        h.add(rid, *spec)
    assert h.run(max_steps=100) < 100
    for rid, spec in specs.items():
        assert h.result(rid) == solo_result(rid, *spec, **kw)
    assert h.allocator.num_used == 0


def test_a_lone_decode_takes_waiting_forks_pages_instead_of_preempting_itself():
    """Regression: with only fork siblings' pages left to take, a decode preempted itself and
    re-prefilled a chunk short of its end, every step, forever."""
    kw = {"page_size": 4, "max_model_len": 16}
    h = Harness(num_pages=5, max_num_seqs=4, max_num_batched_tokens=8, **kw)
    specs = {"r0": (prompt_of(4), params(n=2, max_tokens=8, ignore_eos=True), 0),
             "r1": (prompt_of(9, 1), params(n=3, max_tokens=2, ignore_eos=True), 0)}
    for rid, spec in specs.items():
        h.add(rid, *spec)
    assert h.run(max_steps=100) < 100
    assert h.scheduler.num_preemptions < 10
    for rid, spec in specs.items():
        assert h.result(rid) == solo_result(rid, *spec, **kw)
    assert h.allocator.num_used == 0
