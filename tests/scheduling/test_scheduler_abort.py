"""Aborting requests in every state (running, waiting, preempted, mid-step, with forks pending):
pages freed at once, nothing left behind; the fake runner of `tests/scheduler_harness.py`."""

from __future__ import annotations

from scheduler_harness import (  # tests/ is on sys.path under pytest
    Harness,
    params,
    prompt_of,
    solo_tokens,
)

from jengine.scheduling.sequence import SequenceStatus


def test_abort_of_a_running_request_frees_its_pages_at_once():
    h = Harness()
    a, = h.add("a", prompt_of(9), params(max_tokens=10, ignore_eos=True))
    b, = h.add("b", prompt_of(5, 1), params(max_tokens=10, ignore_eos=True))
    h.step()
    assert h.allocator.num_used == 3 + 2
    removed = h.scheduler.abort("a")
    assert removed == [a]
    assert a.is_finished and a.finish_reason == "abort" and a.pages == []
    assert h.allocator.num_used == 2
    h.check_pages()
    assert a not in h.scheduler.running
    assert all(a.seq_id not in batch.seq_ids for batch in [h.step() for _ in range(3)])
    h.run()
    assert h.result("b") == [(solo_tokens(b.prompt_ids, 0, 10), "length", None)]
    assert h.allocator.num_used == 0


def test_abort_of_a_waiting_request_removes_it():
    h = Harness(max_num_seqs=1)
    h.add("a", prompt_of(4), params(max_tokens=3, ignore_eos=True))
    b, = h.add("b", prompt_of(4, 1), params(max_tokens=3, ignore_eos=True))
    h.step()
    assert list(h.scheduler.waiting) == [b]
    assert h.scheduler.abort("b") == [b]
    assert b.finish_reason == "abort" and not h.scheduler.waiting
    h.run()
    assert b.output_ids == [] and h.allocator.num_used == 0


def test_abort_of_a_preempted_partial_and_unknown_requests():
    h = Harness(max_num_batched_tokens=4)
    a, = h.add("a", prompt_of(10), params(max_tokens=3))
    h.step()  # a partially prefilled: holds one page, no output yet
    assert h.allocator.num_used == 1 and a.output_ids == []
    assert h.scheduler.abort("nope") == []
    h.scheduler.abort("a")
    assert h.allocator.num_used == 0 and not h.scheduler.has_work


def test_abort_while_the_step_runs_drops_its_tokens():
    h = Harness()
    a, = h.add("a", prompt_of(6), params(max_tokens=5, ignore_eos=True))
    b, = h.add("b", prompt_of(6, 1), params(max_tokens=5, ignore_eos=True))
    h.step()
    batch = h.scheduler.schedule()
    tokens = h.runner(batch)
    h.scheduler.abort("a")
    assert h.allocator.num_used == 2
    updated = h.scheduler.postprocess(batch, tokens)
    assert updated == [b]
    assert len(a.output_ids) == 1 and a.num_computed == 6  # nothing appended after the abort
    h.check_pages()
    h.run()
    assert h.allocator.num_used == 0


def test_abort_with_pending_forks_finishes_every_sample():
    h = Harness(max_num_batched_tokens=4)
    seqs = h.add("a", prompt_of(10), params(n=3, max_tokens=4))
    h.step()  # the leader is mid-prefill; its siblings wait to fork
    assert seqs[0].pending_forks == seqs[1:]
    removed = h.scheduler.abort("a")
    assert sorted(s.seq_id for s in removed) == sorted(s.seq_id for s in seqs)
    assert all(s.finish_reason == "abort" and s.pages == [] for s in seqs)
    assert seqs[0].pending_forks == []
    assert h.allocator.num_used == 0 and not h.scheduler.has_work


def test_abort_after_the_fork_frees_the_shared_pages():
    h = Harness(page_size=4, max_num_batched_tokens=12)
    seqs = h.add("a", prompt_of(11), params(n=3, max_tokens=6, ignore_eos=True))
    other, = h.add("b", prompt_of(3, 1), params(max_tokens=6, ignore_eos=True))
    h.step()  # leader prefills 11 tokens, b its 3 ... leader's first token forks the siblings
    assert all(s.status is SequenceStatus.WAITING for s in seqs[1:])
    assert h.allocator.num_used == 3 + 1
    h.scheduler.abort("a")
    assert all(s.finish_reason == "abort" for s in seqs)
    assert h.allocator.num_used == 1
    h.check_pages()
    h.run()
    assert h.allocator.num_used == 0
    assert other.output_ids == solo_tokens(other.prompt_ids, 0, 6)
