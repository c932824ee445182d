"""Scheduler tests, driven by the fake runner of `tests/scheduler_harness.py` (no JAX)."""

from __future__ import annotations

import collections
import random

import pytest
from scheduler_harness import (  # tests/ is on sys.path under pytest
    EOS,
    VOCAB,
    Harness,
    check_against_solo,
    params,
    prompt_of,
    rows,
    solo_result,
    solo_tokens,
)

from jengine.scheduling.sequence import SequenceStatus

# ----------------------------------------------------------------------------- the fake itself


def test_fake_runner_output_matches_the_closed_form():
    h = Harness()
    prompt = prompt_of(9)
    h.add("a", prompt, params(max_tokens=12, ignore_eos=True), seed=5)
    h.run()
    assert h.result("a") == [(solo_tokens(prompt, 5, 12), "length", None)]
    assert h.allocator.num_used == 0


# ----------------------------------------------------------------------------- budgets and order


def test_decodes_first_then_prefill_chunks_within_the_budgets():
    h = Harness(max_num_seqs=3, max_num_batched_tokens=10)
    ignore = params(max_tokens=8, ignore_eos=True)
    a, = h.add("a", prompt_of(6), ignore)
    b, = h.add("b", prompt_of(3, 1), ignore)
    c, = h.add("c", prompt_of(20, 2), ignore)
    d, = h.add("d", prompt_of(2, 3), ignore)
    # Step 1: a and b whole, c gets the one token left; d is past max_num_seqs.
    assert rows(h.step()) == [(a.seq_id, 0, 6, True), (b.seq_id, 0, 3, True),
                              (c.seq_id, 0, 1, False)]
    assert list(h.scheduler.waiting) == [d]
    # Step 2: the decodes of a and b first, then c's next chunk fills the token budget.
    assert rows(h.step()) == [(a.seq_id, 6, 1, True), (b.seq_id, 3, 1, True),
                              (c.seq_id, 1, 8, False)]
    assert rows(h.step()) == [(a.seq_id, 7, 1, True), (b.seq_id, 4, 1, True),
                              (c.seq_id, 9, 8, False)]
    # Step 4: c's last chunk samples; 5 tokens of budget are left but max_num_seqs is reached.
    batch = h.step()
    assert rows(batch) == [(a.seq_id, 8, 1, True), (b.seq_id, 5, 1, True),
                           (c.seq_id, 17, 3, True)]
    assert batch.kv_lens.tolist() == [9, 6, 20]
    assert batch.cu_q_lens.tolist() == [0, 1, 2, 5]
    assert list(h.scheduler.waiting) == [d]
    h.run()
    for rid, seq in [("a", a), ("b", b), ("c", c), ("d", d)]:
        assert h.result(rid) == [(solo_tokens(seq.prompt_ids, 0, 8), "length", None)]
    assert h.allocator.num_used == 0


def test_batch_fields_of_a_mixed_step_are_exact():
    h = Harness(max_num_batched_tokens=16, page_size=4)
    a, = h.add("a", prompt_of(5), params(max_tokens=4, ignore_eos=True))
    h.step()  # a: 5 tokens -> pages [1, 2]
    b, = h.add("b", prompt_of(7, 1), params(max_tokens=4, ignore_eos=True))
    batch = h.step()
    assert a.pages == [1, 2] and b.pages == [3, 4]
    assert batch.seq_ids == [a.seq_id, b.seq_id]
    assert batch.q_lens.tolist() == [1, 7]
    assert batch.kv_lens.tolist() == [6, 7]
    assert batch.positions.tolist() == [5, 0, 1, 2, 3, 4, 5, 6]
    assert batch.slot_mapping.tolist() == [2 * 4 + 1, 12, 13, 14, 15, 16, 17, 18]
    assert batch.page_table.tolist() == [[1, 2], [3, 4]]
    assert batch.sample.tolist() == [True, True]
    assert batch.token_ids.tolist() == [a.output_ids[0]] + b.prompt_ids


def test_max_num_seqs_caps_decodes_too():
    h = Harness(max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [h.add(f"r{i}", prompt_of(3, i), params(max_tokens=3, ignore_eos=True))[0]
            for i in range(3)]
    assert [r[0] for r in rows(h.step())] == [seqs[0].seq_id, seqs[1].seq_id]
    assert [r[0] for r in rows(h.step())] == [seqs[0].seq_id, seqs[1].seq_id]
    h.run()
    assert all(b.num_seqs <= 2 for b in h.batches)
    assert h.allocator.num_used == 0


def test_token_budget_caps_decodes():
    h = Harness(max_num_seqs=8, max_num_batched_tokens=3)
    seqs = [h.add(f"r{i}", prompt_of(1, i), params(max_tokens=4, ignore_eos=True))[0]
            for i in range(5)]
    first = h.step()
    assert first.seq_ids == [s.seq_id for s in seqs[:3]]
    second = h.step()  # three decodes use the whole budget: the waiting two stay out
    assert second.seq_ids == [s.seq_id for s in seqs[:3]] and second.q_lens.tolist() == [1] * 3
    h.run()
    for s in seqs:
        assert s.output_ids == solo_tokens(s.prompt_ids, 0, 4)
    assert h.allocator.num_used == 0


# ----------------------------------------------------------------------------- chunked prefill


def test_long_prompt_is_prefilled_in_chunks_and_samples_only_at_the_end():
    h = Harness(max_num_batched_tokens=8, page_size=4)
    prompt = prompt_of(23)
    seq, = h.add("a", prompt, params(max_tokens=3, ignore_eos=True), seed=3)
    assert [rows(h.step()) for _ in range(3)] == [
        [(seq.seq_id, 0, 8, False)], [(seq.seq_id, 8, 8, False)], [(seq.seq_id, 16, 7, True)]
    ]
    assert seq.output_ids == solo_tokens(prompt, 3, 1)
    assert len(seq.pages) == 6
    h.run()
    assert h.result("a") == [(solo_tokens(prompt, 3, 3), "length", None)]
    assert h.allocator.num_used == 0


def test_chunk_allocates_only_the_pages_it_reaches():
    h = Harness(max_num_batched_tokens=5, page_size=4)
    seq, = h.add("a", prompt_of(12), params(max_tokens=1))
    used = []
    for _ in range(3):
        h.step()
        used.append(h.allocator.num_used)
    assert used[:2] == [2, 3]  # positions 0..4 -> 2 pages, 0..9 -> 3 pages
    assert seq.is_finished and used[2] == 0


# ----------------------------------------------------------------------------- continuous batching


def test_finished_sequences_leave_and_waiting_ones_join_the_same_step():
    h = Harness(max_num_seqs=2, max_num_batched_tokens=64)
    a, = h.add("a", prompt_of(4), params(max_tokens=2, ignore_eos=True))
    b, = h.add("b", prompt_of(5, 1), params(max_tokens=5, ignore_eos=True))
    c, = h.add("c", prompt_of(6, 2), params(max_tokens=3, ignore_eos=True))
    assert h.step().seq_ids == [a.seq_id, b.seq_id]
    assert h.step().seq_ids == [a.seq_id, b.seq_id]
    assert a.is_finished and a.finish_reason == "length" and a.pages == []
    assert rows(h.step()) == [(b.seq_id, 6, 1, True), (c.seq_id, 0, 6, True)]
    h.run()
    for rid, s, n in [("a", a, 2), ("b", b, 5), ("c", c, 3)]:
        assert h.result(rid) == [(solo_tokens(s.prompt_ids, 0, n), "length", None)]
    assert h.allocator.num_used == 0


def test_requests_arriving_mid_run_get_the_same_outputs():
    h = Harness(max_num_seqs=4, max_num_batched_tokens=12)
    specs = {f"r{i}": (prompt_of(3 + 2 * i, i), params(max_tokens=6 + i, ignore_eos=True))
             for i in range(6)}

    def arrive(step: int) -> None:
        if step < len(specs) * 2 and step % 2 == 0:
            rid = f"r{step // 2}"
            h.add(rid, *specs[rid], seed=step)

    h.run(on_step=arrive)
    for i, (rid, (prompt, p)) in enumerate(specs.items()):
        assert h.result(rid) == [(solo_tokens(prompt, 2 * i, p.max_tokens), "length", None)]
    assert h.allocator.num_used == 0


# ----------------------------------------------------------------------------- preemption


def test_preemption_by_recompute_reproduces_the_solo_outputs():
    page_size, max_model_len = 4, 32
    # 9 usable pages: one sequence of max_model_len fits (8), four growing ones do not.
    h = Harness(num_pages=10, page_size=page_size, max_model_len=max_model_len,
                max_num_batched_tokens=32)
    specs = {f"r{i}": (prompt_of(5 + i, i), params(max_tokens=20, ignore_eos=True), i)
             for i in range(4)}
    for rid, spec in specs.items():
        h.add(rid, *spec)
    h.run()
    assert h.scheduler.num_preemptions > 0
    assert sum(s.num_preemptions for seqs in h.requests.values() for s in seqs) == (
        h.scheduler.num_preemptions
    )
    for rid, spec in specs.items():
        assert h.result(rid) == solo_result(rid, *spec, page_size=page_size,
                                            max_model_len=max_model_len)
    assert h.allocator.num_used == 0


def test_the_most_recently_admitted_sequence_is_preempted():
    h = Harness(num_pages=7, page_size=4, max_model_len=16, max_num_batched_tokens=32)
    ignore = params(max_tokens=12, ignore_eos=True)
    a, = h.add("a", prompt_of(4), ignore)
    b, = h.add("b", prompt_of(4, 1), ignore)
    c, = h.add("c", prompt_of(4, 2), ignore)
    h.step()  # one page each (4 tokens)
    h.step()  # all three decode into a second page: the pool (6 pages) is full
    assert h.allocator.num_free == 0 and h.scheduler.num_preemptions == 0
    for _ in range(3):
        h.step()
    batch = h.step()  # a needs a third page: c, admitted last, is preempted; then b fits
    assert [s.num_preemptions for s in (a, b, c)] == [0, 0, 1]
    assert c.status is SequenceStatus.WAITING and c.num_computed == 0 and c.pages == []
    assert batch.seq_ids == [a.seq_id, b.seq_id]
    assert h.scheduler.waiting[0] is c
    h.run()
    for rid, s in [("a", a), ("b", b), ("c", c)]:
        assert h.result(rid) == [(solo_tokens(s.prompt_ids, 0, 12), "length", None)]
    assert h.allocator.num_used == 0


# ----------------------------------------------------------------------------- abort


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


# ----------------------------------------------------------------------------- n > 1


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


# ----------------------------------------------------------------------------- stop rules


def _natural(prompt, seed, num=40):
    return solo_tokens(prompt, seed, num)


def _seed_with_eos_at(prompt, index):
    """A seed whose natural output has its first EOS at `index`."""
    for seed in range(10_000):
        out = _natural(prompt, seed)
        if EOS in out and out.index(EOS) == index:
            return seed, out
    raise AssertionError("no such seed")


def test_eos_stops_with_stop_reason_none():
    prompt = prompt_of(6)
    seed, natural = _seed_with_eos_at(prompt, 4)
    h = Harness()
    h.add("a", prompt, params(max_tokens=20), seed)
    h.run()
    assert h.result("a") == [(natural[:5], "stop", None)]
    assert h.allocator.num_used == 0


def test_ignore_eos_keeps_going_to_max_tokens():
    prompt = prompt_of(6)
    seed, natural = _seed_with_eos_at(prompt, 4)
    h = Harness()
    h.add("a", prompt, params(max_tokens=20, ignore_eos=True), seed)
    h.run()
    assert h.result("a") == [(natural[:20], "length", None)]
    assert natural[4] == EOS


def test_eos_is_only_a_stop_for_the_schedulers_eos_ids():
    prompt = prompt_of(6)
    seed, natural = _seed_with_eos_at(prompt, 4)
    h = Harness(eos_token_ids=())
    h.add("a", prompt, params(max_tokens=20), seed)
    h.run()
    assert h.result("a") == [(natural[:20], "length", None)]


def test_stop_token_id_stops_with_the_id_as_stop_reason():
    prompt = prompt_of(6)
    natural = _natural(prompt, 4)
    stop = natural[5]
    first = natural.index(stop)
    h = Harness(eos_token_ids=())
    h.add("a", prompt, params(max_tokens=30, stop_token_ids=[stop, VOCAB + 1]), 4)
    h.run()
    assert h.result("a") == [(natural[: first + 1], "stop", stop)]


def test_stop_token_ids_apply_with_ignore_eos():
    prompt = prompt_of(6)
    seed, natural = _seed_with_eos_at(prompt, 4)
    first = next(i for i in range(5, 40) if natural[i] not in natural[:i])
    stop = natural[first]
    h = Harness()
    h.add("a", prompt, params(max_tokens=30, ignore_eos=True, stop_token_ids=[stop]), seed)
    h.run()
    assert h.result("a") == [(natural[: first + 1], "stop", stop)]


def test_max_tokens_finishes_with_length():
    h = Harness(eos_token_ids=())
    h.add("a", prompt_of(6), params(max_tokens=7), 2)
    h.run()
    assert h.result("a") == [(_natural(prompt_of(6), 2)[:7], "length", None)]


def test_max_model_len_finishes_with_length():
    h = Harness(eos_token_ids=(), max_model_len=16)
    seq, = h.add("a", prompt_of(10), params(max_tokens=None), 2)
    assert seq.max_tokens == 6
    h.run()
    assert h.result("a") == [(_natural(prompt_of(10), 2)[:6], "length", None)]


@pytest.mark.parametrize("stop_kind", ["eos", "stop_token_ids"])
def test_min_tokens_delays_stops(stop_kind):
    """A stop token among the first `min_tokens` outputs is kept; the first one after ends it."""
    prompt = prompt_of(6)
    for seed in range(10_000):
        natural = _natural(prompt, seed)
        hits = [i for i, t in enumerate(natural) if t == EOS]
        if len(hits) >= 2 and hits[0] >= 1 and hits[1] - hits[0] >= 2:
            break
    min_tokens = hits[0] + 1  # the first stop token is output number min_tokens
    kw = {"stop_token_ids": [EOS]} if stop_kind == "stop_token_ids" else {}
    h = Harness(eos_token_ids=(EOS,) if stop_kind == "eos" else ())
    h.add("a", prompt, params(max_tokens=40, min_tokens=min_tokens, **kw), seed)
    h.add("b", prompt, params(max_tokens=40, **kw), seed)
    h.run()
    stop_reason = EOS if stop_kind == "stop_token_ids" else None
    assert h.result("a") == [(natural[: hits[1] + 1], "stop", stop_reason)]
    assert h.result("b") == [(natural[: hits[0] + 1], "stop", stop_reason)]


def test_min_tokens_does_not_delay_length():
    h = Harness()
    seed = 3
    h.add("a", prompt_of(4), params(max_tokens=5, min_tokens=5, ignore_eos=True), seed)
    h.run()
    assert h.result("a") == [(_natural(prompt_of(4), seed)[:5], "length", None)]


# ----------------------------------------------------------------------------- stress


def test_random_stress_with_preemption_and_aborts_matches_solo_runs():
    rng = random.Random(1234)
    page_size, max_model_len = 4, 48
    kw = {"page_size": page_size, "max_model_len": max_model_len}
    h = Harness(num_pages=14, max_num_seqs=6, max_num_batched_tokens=24, **kw)
    specs = {}
    for i in range(200):
        plen = rng.randint(1, 30)
        p = params(
            n=rng.choice([1, 1, 1, 2, 3]),
            max_tokens=rng.randint(1, max_model_len - plen),
            min_tokens=0,
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=[rng.randrange(VOCAB)] if rng.random() < 0.2 else None,
        )
        arrival = int(i * 1.5) + rng.randint(0, 3)
        abort_at = arrival + rng.randint(0, 30) if rng.random() < 0.15 else None
        specs[f"r{i}"] = ([rng.randrange(1, VOCAB) for _ in range(plen)], p, i, arrival, abort_at)

    arrivals = collections.defaultdict(list)
    aborts = collections.defaultdict(list)
    for rid, (_, _, _, arrival, abort_at) in specs.items():
        arrivals[arrival].append(rid)
        if abort_at is not None:
            aborts[abort_at].append(rid)
    last_arrival = max(arrivals)

    def on_step(step: int) -> None:
        for rid in aborts.get(step, ()):
            h.scheduler.abort(rid)
            h.check_pages()
        for rid in arrivals.get(step, ()):
            prompt, p, seed, _, _ = specs[rid]
            h.add(rid, prompt, p, seed)

    step = 0
    while step <= last_arrival or h.scheduler.has_work:
        on_step(step)
        if h.scheduler.has_work:
            h.step()
        step += 1
        assert step < 20_000

    assert h.scheduler.num_preemptions > 0
    assert h.allocator.num_used == 0 and h.allocator.num_free == h.allocator.num_pages - 1
    assert check_against_solo(h, specs, **kw) > 0


def test_a_request_with_many_samples_does_not_queue_a_later_one_behind_them_all():
    """Fairness: a request's n samples count against it. A one-sample request that arrives
    while an n=16 request fills every slot runs in the next wave, not after all 16."""
    h = Harness(max_num_seqs=8, num_pages=128, max_model_len=64)
    h.add("hog", prompt_of(6), params(n=16, max_tokens=20, ignore_eos=True))
    for _ in range(3):  # the leader's prefill, then its forks fill the 8 slots
        h.step()
    assert sum(s.request_id == "hog" for s in h.scheduler.running) == 8
    h.add("small", prompt_of(5, salt=1), params(max_tokens=3, ignore_eos=True))
    finished_at: dict[str, int] = {}
    for step in range(200):
        if not h.scheduler.has_work:
            break
        h.step()
        for rid, seqs in h.requests.items():
            if rid not in finished_at and all(s.is_finished for s in seqs):
                finished_at[rid] = step
    first_wave = 20  # the 8 running samples' remaining decodes, at most
    assert finished_at["small"] <= first_wave + 3 + 2, finished_at
    assert finished_at["small"] < finished_at["hog"] - 15, finished_at
    assert h.result("small") == solo_result("small", prompt_of(5, salt=1),
                                            params(max_tokens=3, ignore_eos=True), 0)
